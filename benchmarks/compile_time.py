"""Compile time of the train step, layers unrolled (one compiled copy of the block per layer)
against scanned (`model.scan_layers=true`: one block, run by `lax.scan`), and against the same
model cut to 2 layers: how far a scanned model's compile time is from a shallow one's.

Each figure is the train step's `.lower().compile()` as `flaxlm-plan` times it (the real step
of task=clm for an abstract train state: no weights allocated, no data read), in a process of
its own (nothing cached in memory; the plan keeps no persistent XLA cache), on this machine's
CPU devices. Rounds alternate the variants; the table gives each one's median. Nothing is
asserted.

    python benchmarks/compile_time.py                                  # smollm-135m and llama-1b
    python benchmarks/compile_time.py --models smollm-135m --rounds 3 --seq 512
    python benchmarks/compile_time.py --models llama-tiny -- model.remat=full  # more overrides
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

PLAN = os.path.join(os.path.dirname(sys.executable), "flaxlm-plan")
VARIANTS = {  # name → the overrides that make it
    "2 layers": ["model.num_layers=2"],
    "unrolled": ["model.scan_layers=false"],
    "scanned": ["model.scan_layers=true"],
}


def compile_seconds(model: str, variant: str, args) -> tuple[float, float] | str:
    """The train step's compile time (s) and temporaries (MiB per device) of one plan, or
    why there are none."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        command = [PLAN, f"model={model}", f"hardware={args.hardware}",
                   f"hardware.per_device_batch_size={args.batch}",
                   f"task.max_seq_length={args.seq}", *VARIANTS[variant], *args.overrides,
                   "--json", out]
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            return f"over {args.timeout_s:.0f} s"
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or ["failed"])[-1]
        with open(out) as f:
            train = json.load(f)["train"]
        return train["compile_s"], train["temp_bytes"] / 2**20


def ratio(median: dict[str, float], numerator: str, denominator: str) -> str:
    if numerator in median and denominator in median:
        return f"{median[numerator] / median[denominator]:.2f}×"
    return "·"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm-135m", "llama-1b"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hardware", default="cpu")
    parser.add_argument("--batch", type=int, default=1, help="rows per device")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides (after --)")
    args = parser.parse_args()
    print(harness.machine_description(("jax", "flax")), flush=True)
    print(f"train step compile time (s), hardware={args.hardware}, "
          f"{args.batch} row(s) per device × {args.seq} tokens, median of {args.rounds}",
          flush=True)
    header = ["model", *VARIANTS, "scanned / 2 layers", "unrolled / scanned",
              "temporaries unrolled / scanned (MiB)"]
    lines = [header, ["---"] * len(header)]
    for model in args.models:
        times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        failures: dict[str, str] = {}
        temporaries: dict[str, float] = {}
        for round_index in range(args.rounds):
            for variant in harness.round_order(list(VARIANTS), round_index):
                seconds = compile_seconds(model, variant, args)
                print(f"  {model} {variant}: {seconds}", flush=True)
                if isinstance(seconds, str):
                    failures[variant] = seconds
                else:
                    times[variant].append(seconds[0])
                    temporaries[variant] = seconds[1]
        median = {variant: statistics.median(values) for variant, values in times.items()
                  if values}

        lines.append([model, *(f"{median[v]:.1f}" if v in median else failures.get(v, "·")
                               for v in VARIANTS),
                      ratio(median, "scanned", "2 layers"), ratio(median, "unrolled", "scanned"),
                      " / ".join(f"{temporaries[v]:.0f}" if v in temporaries else "·"
                                 for v in ("unrolled", "scanned"))])
    print("\n".join("| " + " | ".join(row) + " |" for row in lines))


if __name__ == "__main__":
    main()
