"""The two attentions under a context axis side by side, as `flaxlm-plan` compiles them ahead of
time for a TPU slice on this machine: per-chip memory and the bytes the chips send each other
per step, for each `model.context_attention` (all_gather, ring) and context size, and the run
without the axis. The table of docs/benchmarks.md ("Long context: the ring against the
all-gather") is its output.

    PYTHONPATH=src python benchmarks/context_attention_plans.py                  # that table
    PYTHONPATH=src python benchmarks/context_attention_plans.py --contexts 1,8,32 \\
        --run model=llama3-8b task.max_seq_length=131072 hardware=tpu-v5p-128 \\
        hardware.mesh.data=1 hardware.mesh.fsdp=-1 model.remat=full model.scan_layers=true \\
        hardware.per_device_batch_size=1 --json plans.json

Each plan is `flaxlm.aot.plan` of the overrides with hardware.mesh.context=C (the batch axis
set to -1 takes the devices the axis leaves) and model.context_attention=<variant>: the real
train and eval steps compiled by XLA's TPU compiler (libtpu, the `tpu` extra). A step the
compiler cannot fit is listed as refused. Nothing is run on a chip; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import sys

# llama-1b at 32,768 positions on a TPU v5p-8 (4 chips): both variants compile there, so both
# show their memory and bytes (llama3-8b at 131,072 on a v5p-128, where only the ring fits,
# takes about 40 minutes of compiling on 2 cores: its command is in the docstring).
DEFAULT_RUN = ["model=llama-1b", "model.max_positions=32768", "task.max_seq_length=32768",
               "hardware=tpu-v5p-8", "hardware.mesh.data=1", "hardware.mesh.fsdp=-1",
               "model.remat=full", "model.scan_layers=true", "hardware.per_device_batch_size=1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", nargs="+", default=DEFAULT_RUN, metavar="OVERRIDE",
                        help="flaxlm-train overrides of the run (default: llama-1b at 32k on a "
                             "v5p-8, fsdp, full remat)")
    parser.add_argument("--contexts", default="1,4",
                        help="context sizes, comma-separated (1: no axis, planned once)")
    parser.add_argument("--variants", default="all_gather,ring")
    parser.add_argument("--json", default=None, help="also write every plan's figures here")
    args = parser.parse_args()

    from flaxlm import aot
    from flaxlm.cli.plan import compose

    rows, figures = [], []
    for context in (int(c) for c in args.contexts.split(",")):
        for variant in (["-"] if context == 1 else args.variants.split(",")):
            overrides = [*args.run, f"hardware.mesh.context={context}"]
            if context > 1:
                overrides.append(f"model.context_attention={variant}")
            print(f"planning context={context} {variant} ...", file=sys.stderr, flush=True)
            try:
                planned = aot.plan(compose(overrides))
            except aot.DoesNotFit as refused:
                rows.append(f"| {variant} | {context} | refused by the compiler: "
                            f"{str(refused).split('. ')[0][:160]} | | | |")
                figures.append({"context": context, "variant": variant, "refused": str(refused)})
                continue
            moved = planned.train.collective_bytes
            kinds = ", ".join(f"{kind} {aot.gib(size)}" for kind, size in moved.items() if size)
            fits = {True: "yes", False: "no", None: "?"}[planned.fits]
            rows.append(f"| {variant} | {context} | {aot.gib(planned.peak_bytes)} | {fits} | "
                        f"{aot.gib(planned.train.temp_bytes)} | "
                        f"{aot.gib(planned.train.communication_bytes)} ({kinds}) |")
            figures.append({"context": context, "variant": variant, **planned.as_dict()})
    print("| model.context_attention | hardware.mesh.context | per chip (peak) | fits | "
          "temporaries (train) | collectives per step per chip |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2, default=str)


if __name__ == "__main__":
    main()
