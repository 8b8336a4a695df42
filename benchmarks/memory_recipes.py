"""The memory recipes (docs/planning.md#memory-recipes) side by side: what each costs in loss
and speed, from a short training run on this machine's CPU against float32 AdamW, and what
each leaves of llama-1b on one TPU v5e chip, from flaxlm-plan (XLA's TPU compiler, here).

    python benchmarks/memory_recipes.py                    # both parts
    python benchmarks/memory_recipes.py --part train --steps 100 --model llama-tiny
    python benchmarks/memory_recipes.py --part plan --batches 1 2

Train: each recipe a `flaxlm-train` of its own (the builtin English corpus, seed 0, the same
batches in the same order), its last eval loss and its mean train tokens/s after the first
logged interval (the compile is in that one). Plan: each recipe a `flaxlm-plan` of llama-1b at
`--seq` tokens on tpu-v5e-8 (per chip: one v5e, 15.75 GiB usable), its per-chip peak or the
compiler's refusal. Results go to --out (JSON) and a Markdown table to stdout. Nothing is
asserted: CPU speeds say little about a TPU's, the loss is the point there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

BIN = os.path.dirname(sys.executable)
RECIPES = {  # name → the overrides that make it, float32 AdamW (the default) first
    "float32 AdamW": [],
    "model.remat=block": ["model.remat=block"],
    "bfloat16 moments": ["optimizer.moment_dtype=bfloat16"],
    "adafactor": ["optimizer=adafactor"],
    "model.remat=full": ["model.remat=full"],
    "bfloat16 parameters": ["hardware.param_dtype=bfloat16"],
    "chunked loss": ["trainer.loss_chunk_size=512"],
    "bfloat16 moments, remat=block": ["optimizer.moment_dtype=bfloat16", "model.remat=block"],
}
QUIET = ["logger=none", "samples.prompts=[]", "checkpoint.every_steps=null"]


def train(name: str, overrides: list[str], args) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        command = [os.path.join(BIN, "flaxlm-train"), f"model={args.model}", "seed=0",
                   f"trainer.max_steps={args.steps}",
                   f"run_dir={run_dir}", *QUIET, *overrides]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            return {"recipe": name, "error": done.stderr.strip().splitlines()[-1]}
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
    speeds = [r["train/tokens_per_second"] for r in rows if "train/tokens_per_second" in r][1:]
    losses = [r["eval/loss"] for r in rows if "eval/loss" in r]
    return {"recipe": name, "overrides": overrides, "eval_loss": losses[-1],
            "first_eval_loss": losses[0], "tokens_per_s": sum(speeds) / len(speeds),
            "wall_s": time.perf_counter() - started,
            "train_loss": [r["train/loss"] for r in rows if "train/loss" in r]}


def plan(name: str, overrides: list[str], batch: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        command = [os.path.join(BIN, "flaxlm-plan"), "model=llama-1b", "hardware=tpu-v5e-8",
                   f"task.max_seq_length={args.seq}", f"hardware.per_device_batch_size={batch}",
                   *overrides, "--json", path]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        row = {"recipe": name, "overrides": overrides, "batch": batch,
               "wall_s": time.perf_counter() - started}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                figures = json.load(f)
            return {**row, **{k: figures[k] for k in ("param_bytes", "opt_state_bytes",
                                                      "peak_bytes", "hbm_bytes", "fits")},
                    "temp_bytes": figures["train"]["temp_bytes"],
                    "compile_s": figures["train"]["compile_s"] + figures["eval"]["compile_s"]}
        refused = re.search(r"HLO temporaries \(([\d.]+G)\)", done.stderr)
        return {**row, "fits": False,
                "error": f"refused: temporaries {refused.group(1)}" if refused
                else done.stderr.strip().splitlines()[-1][:300]}


def main() -> None:
    parse = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parse.add_argument("--part", choices=["train", "plan", "all"], default="all")
    parse.add_argument("--recipes", nargs="*", default=list(RECIPES)[:6], choices=list(RECIPES))
    parse.add_argument("--model", default="llama-tiny")
    parse.add_argument("--steps", type=int, default=150)
    parse.add_argument("--batches", type=int, nargs="*", default=[1, 2])
    parse.add_argument("--seq", type=int, default=2048)
    parse.add_argument("--out", default="memory_recipes.json")
    args = parse.parse_args()
    results = {"train": [], "plan": []}
    if args.part in ("train", "all"):
        for name in args.recipes:
            results["train"].append(train(name, RECIPES[name], args))
            print(json.dumps({k: v for k, v in results["train"][-1].items()
                              if k != "train_loss"}), flush=True)
    if args.part in ("plan", "all"):
        for batch in args.batches:
            for name in args.recipes:
                results["plan"].append(plan(name, RECIPES[name], batch, args))
                print(json.dumps(results["plan"][-1]), flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    print(table(results, args))


def table(results: dict, args) -> str:
    lines = []
    if results["train"]:
        base = results["train"][0]
        lines += [f"{args.model}, {args.steps} steps on the CPU:", "",
                  "| recipe | eval loss | Δ vs float32 AdamW | train tokens/s |",
                  "|---|---|---|---|"]
        for r in results["train"]:
            if "error" in r:
                lines.append(f"| {r['recipe']} | {r['error']} | | |")
                continue
            lines.append(f"| {r['recipe']} | {r['eval_loss']:.4f} | "
                         f"{r['eval_loss'] - base['eval_loss']:+.4f} | {r['tokens_per_s']:,.0f} |")
    if results["plan"]:
        gib = 2**30
        lines += ["", f"llama-1b on tpu-v5e-8, {args.seq} tokens per row, per chip:", "",
                  "| recipe | rows per chip | parameters | optimizer state | temporaries | "
                  "peak (of 15.75 GiB) | compile |", "|---|---|---|---|---|---|---|"]
        for r in results["plan"]:
            if "error" in r:
                lines.append(f"| {r['recipe']} | {r['batch']} | | | | ✗ {r['error']} | "
                             f"{r['wall_s']:.0f} s |")
                continue
            mark = "✓" if r["fits"] else "✗"
            lines.append(f"| {r['recipe']} | {r['batch']} | {r['param_bytes'] / gib:.2f} GiB | "
                         f"{r['opt_state_bytes'] / gib:.2f} GiB | {r['temp_bytes'] / gib:.2f} GiB"
                         f" | {mark} {r['peak_bytes'] / gib:.2f} GiB | {r['compile_s']:.0f} s |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
