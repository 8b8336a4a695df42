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

A run that does not fit gets the memory recipes (remat, bfloat16 moments, adafactor, bfloat16
parameters, smaller micro-batches) in the order of what they cost in quality, each with the
per-chip state it leaves; `--fit` compiles them in that order and plans the first that fits,
less the recipes costing only time (remat, the loss in chunks) that a later one made unneeded.

`--save DIR` also writes the compiled train and eval steps to DIR: a run of the same overrides
on those devices loads them instead of compiling (`flaxlm-train ... compiled_steps=DIR`,
`flaxlm.training.executables`; docs/planning.md).

Exit status: 0 the run fits (or the chip's memory is unknown; with --fit: it or a recipe
fits, the recipe's overrides printed); 2 it does not (one paragraph naming what to change),
or a mistake in the command or the config.
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
    parse.add_argument("--save", metavar="DIR",
                       help="also write the compiled train and eval steps to DIR, for a run "
                            "of the same overrides on these devices to load instead of "
                            "compiling (flaxlm-train ... compiled_steps=DIR); needs "
                            "trainer.max_steps (default: nothing written)")
    parse.add_argument("--fit", action="store_true",
                       help="if the run does not fit, compile the memory recipes in order "
                            "(cheapest in quality first) and plan the first that fits")
    return parse


def run(argv: Sequence[str]) -> int:
    """Plan as the command line says; returns the exit status (0 fits, 2 does not)."""
    args = parser().parse_args(argv)
    if args.save and args.fit:
        raise FlaxlmError("flaxlm-plan: --save writes the steps of the run the overrides "
                          "describe; find the recipe with --fit first, then plan it with "
                          "its overrides and --save.")
    cfg = compose(args.overrides)
    from flaxlm import aot  # only now: it starts JAX, which the composed config configures

    try:
        planned = aot.plan(cfg, save_to=args.save)
    except aot.DoesNotFit as refused:  # no figures but the compiler's
        planned, problem = None, str(refused)
    else:
        _print(planned, args.json)
        problem = aot.verdict(planned)
    if problem is None:
        if planned.fits:
            print(f"flaxlm: fits: {planned.peak_bytes / aot.GIB:.2f} of "
                  f"{planned.hbm_bytes / aot.GIB:.2f} GiB per chip")
        return 0
    run = aot.abstract_run(cfg)
    ladder = aot.recipe_ladder(run.config, run.mesh.size,
                               lambda extra: compose(aot.override(args.overrides, extra)))
    contexts = aot.context_axis_candidates(run.config, run.mesh.size, run.seq_len)
    temporaries = planned.train.temp_bytes if planned else None
    rows_too_long = aot.rows_do_not_fit(run, ladder, temporaries)
    if args.fit:
        return _fit(args, ladder, problem, contexts, rows_too_long)
    advice = aot.ladder_advice(ladder, aot.hbm_bytes(run), temporaries)
    if contexts and rows_too_long is not None:
        sizes = ", ".join(_context_of(mesh).split("=")[1] for mesh in contexts)
        advice += (f" Or split each row's positions over devices (hardware.mesh.context={sizes}"
                   f"): flaxlm-plan --fit tries them {'first' if rows_too_long else 'after'}.")
    raise FlaxlmError(f"{problem} {advice}".strip())


def _fit(args, ladder, problem: str, contexts=(), rows_too_long: bool | None = None) -> int:
    """Compile the ladder's rungs in order (a rung whose state alone exceeds the chip is not
    compiled) and the context axis's sizes (`contexts`, smallest first: each row's positions
    over more devices, no cost in quality), and plan the first that fits. The sizes come
    first where the rows are what does not fit (`rows_too_long`: no recipe for the state
    can make room for their temporaries), after the ladder where the state might be; not at
    all where the state alone exceeds the chip (None)."""
    tried = []
    if rows_too_long:
        fitted = _fit_context(args, contexts, tried)
        if fitted is not None:
            return fitted
    fitted = _fit_ladder(args, ladder, tried)
    if fitted is None and rows_too_long is False:
        fitted = _fit_context(args, contexts, tried)
    if fitted is not None:
        return fitted
    raise FlaxlmError(f"{problem} No memory recipe fits either: "
                      + "; ".join(tried or ["none applies"]) + ".")


def _context_of(mesh: Sequence[str]) -> str:
    return next(o for o in mesh if o.startswith("hardware.mesh.context="))


def _fit_context(args, contexts, tried: list) -> int | None:
    """Plan the run with each context size in turn; 0 at the first that fits, else None
    (each tried, with what it needed, added to `tried`)."""
    from flaxlm import aot

    for mesh in contexts:
        context = _context_of(mesh)
        print(f"flaxlm: planning with {context} ({' '.join(mesh)})", flush=True)
        try:
            planned = aot.plan(compose(aot.override(args.overrides, mesh)))
        except FlaxlmError as refused:  # the compiler's refusal, or a setting the axis refuses
            tried.append(f"{context} ({str(refused).split('. ')[0]})")
            continue
        if planned.fits is False:
            tried.append(f"{context} ({aot.gib(planned.peak_bytes)})")
            continue
        _print(planned, args.json, recipe=mesh)
        print(f"flaxlm: fits with {' '.join(mesh)}: {aot.gib(planned.peak_bytes)} of "
              f"{aot.gib(planned.hbm_bytes)} per chip (each row's positions split over "
              f"{context.split('=')[1]} devices, the global batch kept in micro-batches: the "
              "same loss; attention's keys and values "
              "sent between them)")
        return 0
    return None


def _fit_ladder(args, ladder, tried: list) -> int | None:
    """Plan the ladder's rungs in turn; 0 at the first that fits, else None."""
    from flaxlm import aot

    for step in ladder:
        recipe = " ".join(step.overrides)
        cfg = compose(aot.override(args.overrides, step.overrides))
        hbm = aot.hbm_bytes(aot.abstract_run(cfg))
        if hbm is not None and step.state_bytes > hbm:
            tried.append(f"{recipe} (state alone {aot.gib(step.state_bytes)})")
            continue
        print(f"flaxlm: planning with {recipe}", flush=True)
        try:
            planned = aot.plan(cfg)
        except aot.DoesNotFit:
            tried.append(f"{recipe} (refused by the compiler)")
            continue
        if planned.fits is False:
            tried.append(f"{recipe} ({aot.gib(planned.peak_bytes)})")
            continue
        overrides, planned = _without_unneeded(args, step, planned)
        dropped = [o for o in step.overrides if o not in overrides]
        _print(planned, args.json, recipe=overrides)
        print(f"flaxlm: fits with {' '.join(overrides)}: {aot.gib(planned.peak_bytes)} of "
              f"{aot.gib(planned.hbm_bytes)} per chip ({step.cost})"
              + (f"; not needed with it: {' '.join(dropped)}" if dropped else ""))
        return 0
    return None


def _without_unneeded(args, step, planned):
    """The fitting rung `step` (planned: `planned`) without the recipes before it that cost
    only time and that it made unneeded: each tried without, the last added first, and left
    out where the step still fits. Its overrides and their plan."""
    from flaxlm import aot
    from flaxlm.training.memory import TIME_ONLY_SETTINGS

    kept = list(step.overrides)
    for recipe in reversed([o for o in step.overrides if o not in step.added
                            and o.split("=", 1)[0] in TIME_ONLY_SETTINGS]):
        trial = [o for o in kept if o != recipe]
        print(f"flaxlm: planning without {recipe}", flush=True)
        try:
            candidate = aot.plan(compose(aot.override(args.overrides, trial)))
        except aot.DoesNotFit:
            continue
        if candidate.fits is not False:
            kept, planned = trial, candidate
    return tuple(kept), planned


def _print(planned, json_path: str | None, recipe: Sequence[str] = ()) -> None:
    from flaxlm import aot

    print(aot.report(planned), flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump({**planned.as_dict(), "recipe": list(recipe)}, f, indent=2)


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
