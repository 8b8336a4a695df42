"""`flaxlm-plan <flaxlm-train overrides>`: will the run fit, and how fast might it go, before
paying for the hardware.

    flaxlm-plan model=llama-1b hardware=tpu-v5p-8
    flaxlm-plan model=gpt2-xl hardware=tpu-v4-32 model.remat=full --json plan.json

Composes the job as flaxlm-train would, builds the model and train state as shapes (nothing
allocated, no data read, no tokenizer trained) and compiles the real train and eval steps for
the hardware group's devices: a TPU group's slice (`hardware.topology`) with XLA's TPU compiler
from libtpu (the `tpu` extra) on this machine's CPU; a CPU or GPU group's attached devices.
Prints, per chip, parameters, optimizer state, batch, the compiler's temporaries and their
total against the chip's memory, and, per step, FLOPs, a roofline time estimate, the tokens/s
and MFU it projects, and the compile time (docs/planning.md says what each figure means).

Exit status: 0 the run fits (or the chip's memory is unknown); 2 it does not (one paragraph
naming what to change), or a mistake in the command or the config.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from flaxlm.cli.common import Parser, run_command
from flaxlm.errors import FlaxlmError

# Planning writes no run directory; the composed config still needs a value for it.
_NO_RUN_DIR = "run_dir=unused-by-flaxlm-plan"


def parser() -> Parser:
    parse = Parser("flaxlm-plan",
                   "Compile a flaxlm-train run for its hardware without running it: per-chip\n"
                   "memory against the chip's, FLOPs, a roofline time estimate, tokens/s and\n"
                   "MFU. Exit status 0 if it fits, 2 if not (docs/planning.md).")
    parse.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                       help="a flaxlm-train override (model=llama-1b hardware=tpu-v5p-8 "
                            "model.remat=full ...): the run to plan")
    parse.add_argument("--json", metavar="FILE",
                       help="also write the plan's figures to FILE as JSON (default: none)")
    return parse


def run(argv: Sequence[str]) -> int:
    """Plan as the command line says; returns the exit status (0 fits, 2 does not)."""
    args = parser().parse_args(argv)
    cfg = compose(args.overrides)
    from flaxlm import aot  # only now: it starts JAX, which the composed config configures

    planned = aot.plan(cfg)
    print(aot.report(planned), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(planned.as_dict(), f, indent=2)
    problem = aot.verdict(planned)
    if problem is not None:
        raise FlaxlmError(problem)
    if planned.fits:
        print(f"flaxlm: fits: {planned.peak_bytes / aot.GIB:.2f} of "
              f"{planned.hbm_bytes / aot.GIB:.2f} GiB per chip")
    return 0


def compose(overrides: Sequence[str]):
    """conf/train.yaml with `overrides`, as flaxlm-train composes it, as a typed config."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import CompactHydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from flaxlm.cli.language_list import expand_language_list
    from flaxlm.cli.train import CONFIG_DIR, composition_error

    overrides = expand_language_list(overrides)
    extra = [] if any(o.startswith("run_dir=") for o in overrides) else [_NO_RUN_DIR]
    try:
        with initialize_config_dir(os.path.abspath(CONFIG_DIR), version_base="1.3"):
            return OmegaConf.to_object(hydra_compose("train", overrides=[*overrides, *extra]))
    except (CompactHydraException, OmegaConfBaseException) as err:
        raise FlaxlmError(composition_error(err)) from err


def main(argv: Sequence[str] | None = None) -> None:
    run_command(run, argv)


if __name__ == "__main__":
    main()
