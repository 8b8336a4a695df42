"""What fits on a TPU: `flaxlm-plan` over model presets × TPU slices × sequence lengths ×
parallelism, written as a table into docs/tpu-fits.md.

    python benchmarks/tpu_plan.py                                   # the whole table (hours)
    python benchmarks/tpu_plan.py --models gpt2-tiny llama-tiny --hardware tpu-v5e-8 --seq 1024
    python benchmarks/tpu_plan.py --docs-only                       # the page from the cache
    python benchmarks/tpu_plan.py --budget-s 3600                   # start no plan after an hour

Each cell (model, hardware, sequence) tries three layouts of the same run, each one
`flaxlm-plan` in its own process (XLA's TPU compiler from libtpu, on this CPU; one compile at a
time): plain data parallelism (`hardware.mesh.data=-1 hardware.mesh.fsdp=1`), fsdp over all
chips (`hardware.mesh.data=1 hardware.mesh.fsdp=-1`) and fsdp with `model.remat=full`. The batch
is `--batch` rows per chip (one micro-batch); a preset whose learned positions are fewer than
the sequence gets `model.max_positions=<sequence>` (its parameter count grows by the extra
position embeddings).

Compiles are slow (minutes for a 1B model on a 2-core machine), so the work is bounded:
- each finished plan is kept in `--cache` (JSON, keyed by its overrides): a rerun compiles only
  what is missing, and `--docs-only` rewrites the page from it;
- the layouts save memory in the order tried, so once one fits the later ones are marked as
  fitting without a compile (the table's memory and speed are then the first fitting layout's);
- a layout that does not fit at sequence 1024 does not fit at 2048 either (activations grow
  with the sequence, nothing shrinks): not compiled;
- a layout whose parameters and optimizer state alone (known from any earlier plan of the
  model) exceed the chip's memory is not compiled.
A cell not yet planned shows "·"; the page lists the command that fills it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = os.path.join(os.path.dirname(sys.executable), "flaxlm-plan")
MODELS = ("gpt2-tiny", "llama-tiny", "distilgpt2", "gpt2", "smollm-135m", "gpt2-medium",
          "gpt2-large", "llama-1b", "gpt2-xl")
HARDWARE = ("tpu-v3-8", "tpu-v4-32", "tpu-v5e-8", "tpu-v5p-8", "tpu-v6e-8")
SEQS = (1024, 2048)
LAYOUTS = {  # in the order tried: each needs less memory per chip than the one before
    "data parallel": ["hardware.mesh.data=-1", "hardware.mesh.fsdp=1", "model.remat=none"],
    "fsdp": ["hardware.mesh.data=1", "hardware.mesh.fsdp=-1", "model.remat=none"],
    "fsdp + remat": ["hardware.mesh.data=1", "hardware.mesh.fsdp=-1", "model.remat=full"],
}
# What libtpu is told it is (it reads this at start-up); the compile targets the preset's
# topology whatever it says.
ACCELERATOR_TYPE = {"tpu-v3-8": "v3-8", "tpu-v4-32": "v4-32", "tpu-v5e-8": "v5litepod-8",
                    "tpu-v5p-8": "v5p-8", "tpu-v6e-8": "v6e-8"}
GIB = 2**30
DOCS = os.path.join(REPO, "docs", "tpu-fits.md")
CACHE = os.path.join(REPO, "benchmarks", "tpu_plan.json")


def overrides(model: str, hardware: str, seq: int, layout: str, batch: int) -> list[str]:
    return [f"model={model}", f"hardware={hardware}", f"task.max_seq_length={seq}",
            f"hardware.per_device_batch_size={batch}", *LAYOUTS[layout],
            *_positions(model, seq)]


def _positions(model: str, seq: int) -> list[str]:
    """Learned position tables shorter than the sequence are lengthened to it."""
    return [f"model.max_positions={seq}"] if _model_positions(model) < seq else []


def _model_positions(model: str) -> int:
    from omegaconf import OmegaConf

    path = os.path.join(REPO, "conf", "model", f"{model}.yaml")
    config = OmegaConf.load(path)
    if "max_positions" in config:
        return int(config.max_positions)
    parents = [d for d in config.get("defaults", []) if isinstance(d, str)
               and d != "_self_" and not d.startswith("/")]
    return _model_positions(parents[0]) if parents else 1024


def key(model: str, hardware: str, seq: int, layout: str, batch: int) -> str:
    return f"{model}|{hardware}|{seq}|{layout}|{batch}"


def run_plan(args: list[str], hardware: str, timeout_s: float) -> dict:
    """One `flaxlm-plan` in its own process: its figures, or why there are none."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_WORKER_HOSTNAMES": "localhost",
           "TPU_ACCELERATOR_TYPE": ACCELERATOR_TYPE.get(hardware, "v5litepod-8"),
           "PYTHONPATH": os.path.join(REPO, "src")}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        started = time.perf_counter()
        try:
            proc = subprocess.run([PLAN, *args, "--json", out], env=env, cwd=REPO,
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "wall_s": timeout_s}
        wall = time.perf_counter() - started
        if os.path.exists(out):
            with open(out, encoding="utf-8") as f:
                figures = json.load(f)
            return {"status": "fits" if proc.returncode == 0 else "no", "wall_s": wall,
                    "plan": figures}
        if proc.returncode == 2 and "does not fit" in proc.stderr + proc.stdout:
            return {"status": "no", "wall_s": wall, "reason": _last_paragraph(proc)}
        return {"status": "error", "wall_s": wall, "reason": _last_paragraph(proc)}


def _last_paragraph(proc: subprocess.CompletedProcess) -> str:
    text = (proc.stderr or proc.stdout).strip().splitlines()
    return text[-1][:600] if text else f"exit status {proc.returncode}"


def implied(cache: dict, model: str, hardware: str, seq: int, layout: str, batch: int,
            hbm_gib: float) -> dict | None:
    """A layout's answer that needs no compile (the module's docstring says which), or None."""
    names = list(LAYOUTS)
    for earlier in names[:names.index(layout)]:
        result = cache.get(key(model, hardware, seq, earlier, batch))
        if result and result["status"] in ("fits", "implied fits"):
            return {"status": "implied fits", "by": earlier}
    if seq > min(SEQS):
        shorter = cache.get(key(model, hardware, min(SEQS), layout, batch))
        if shorter and shorter["status"] in ("no", "implied no"):
            return {"status": "implied no", "by": f"sequence {min(SEQS)}"}
    state = _state_bytes(cache, model, hardware, layout)
    if state is not None and state > hbm_gib * GIB:
        return {"status": "implied no", "by": f"state alone {state / GIB:.1f} GiB"}
    return None


def _state_bytes(cache: dict, model: str, hardware: str, layout: str) -> int | None:
    """Per-chip parameter and optimizer bytes of `layout`, from an earlier plan of `model`:
    replicated under data parallelism (any hardware's plan says), else the plan's own fsdp
    figure on this hardware."""
    for name, result in cache.items():
        plan = result.get("plan")
        m, h, _, lay, _ = name.split("|")
        if plan is None or m != model:
            continue
        if layout == "data parallel" and lay == "data parallel":
            return plan["param_bytes"] + plan["opt_state_bytes"]
        if layout != "data parallel" and h == hardware and lay != "data parallel":
            return plan["param_bytes"] + plan["opt_state_bytes"]
    return None


def hbm_gib(hardware: str) -> float:
    from omegaconf import OmegaConf

    config = OmegaConf.load(os.path.join(REPO, "conf", "hardware", f"{hardware}.yaml"))
    while "hbm_gib_per_device" not in config:
        parent = next(d for d in config.defaults if d != "_self_")
        config = OmegaConf.load(os.path.join(REPO, "conf", "hardware", f"{parent}.yaml"))
    return float(config.hbm_gib_per_device)


def fill(cache: dict, cells: Iterable[tuple[str, str, int]], batch: int, cache_path: str,
         deadline: float, timeout_s: float) -> None:
    for model, hardware, seq in cells:
        for layout in LAYOUTS:
            name = key(model, hardware, seq, layout, batch)
            if name in cache and cache[name]["status"] not in ("timeout", "error"):
                continue
            answer = implied(cache, model, hardware, seq, layout, batch, hbm_gib(hardware))
            if answer is None:
                if time.time() > deadline:
                    print(f"budget spent: {name} not planned", flush=True)
                    continue
                print(f"planning {name} ...", flush=True)
                answer = run_plan(overrides(model, hardware, seq, layout, batch), hardware,
                                  min(timeout_s, max(deadline - time.time(), 60)))
            answer["overrides"] = overrides(model, hardware, seq, layout, batch)
            cache[name] = answer
            print(f"  {name}: {summary(answer)}", flush=True)
            save(cache, cache_path)


def save(cache: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(cache, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def summary(result: dict | None) -> str:
    """One table cell: ✓/✗ and the per-chip memory, or why it is not known."""
    if result is None:
        return "·"
    status = result["status"]
    plan = result.get("plan")
    if status == "fits":
        return f"✓ {plan['peak_bytes'] / GIB:.2f} GiB"
    if status == "implied fits":
        return "✓ (as the layout before)"
    if status == "no":
        if plan:
            return f"✗ {plan['peak_bytes'] / GIB:.1f} GiB"
        return "✗ (compiler)"
    if status == "implied no":
        return f"✗ ({result['by']})"
    return f"? {status}"


def speed(row: list[dict | None]) -> tuple[str, str, str]:
    """The first fitting layout's roofline step, MFU and compile time."""
    for result in row:
        if result and result["status"] == "fits":
            plan = result["plan"]
            compile_s = plan["train"]["compile_s"] + plan["eval"]["compile_s"]
            return (f"{plan['roofline_s'] * 1e3:,.1f} ms", f"{plan['mfu']:.0%}",
                    f"{compile_s:.0f} s")
    return "", "", ""


def page(cache: dict, batch: int) -> str:
    lines = [
        "# What fits on a TPU",
        "",
        "Generated by `python benchmarks/tpu_plan.py` from `flaxlm-plan` (XLA's TPU compiler,",
        "on a CPU; [Planning a run](planning.md) says what the figures mean); do not edit by "
        "hand.",
        f"Each run: {batch} rows per chip of `task.max_seq_length` tokens, one micro-batch, "
        "AdamW,",
        "float32 parameters and optimizer state, bfloat16 compute (the `tpu` hardware "
        "defaults).",
        "A cell says whether the train and eval steps fit each chip's memory, and the per-chip "
        "peak",
        "(`memory_analysis`: arguments + outputs − donated + temporaries): with plain data",
        "parallelism (`hardware.mesh.data=-1 hardware.mesh.fsdp=1`), with the parameters and",
        "optimizer state split over all chips (`hardware.mesh.data=1 hardware.mesh.fsdp=-1`), "
        "and",
        "with that and `model.remat=full`. \"as the layout before\" means a cheaper layout "
        "already fits",
        "(not compiled); ✗ with a reason was not compiled either (see the script's docstring);"
        " \"·\" is not",
        "planned yet. The step time and MFU are the first fitting layout's roofline",
        "**estimates** (compiled FLOPs and HBM bytes against the chip's published peaks, no",
        "communication; not bounds). Presets with learned positions shorter than",
        "the sequence get `model.max_positions=<sequence>`.",
        "",
    ] + _effort_lines(cache)
    missing = []
    for hardware in HARDWARE:
        lines += [f"## {hardware} ({hbm_gib(hardware):g} GiB usable per device)", "",
                  "| model | sequence | " + " | ".join(LAYOUTS)
                  + " | roofline step | MFU | compile |",
                  "|---|---|" + "---|" * (len(LAYOUTS) + 3)]
        for model in MODELS:
            for seq in SEQS:
                row = [cache.get(key(model, hardware, seq, layout, batch)) for layout in LAYOUTS]
                if any(r is None for r in row):
                    missing.append((model, hardware, seq))
                lines.append(f"| {model} | {seq} | "
                             + " | ".join(summary(r) for r in row) + " | "
                             + " | ".join(speed(row)) + " |")
        lines.append("")
    lines += _missing_lines(missing, batch)
    return "\n".join(lines) + "\n"


def _effort_lines(cache: dict) -> list[str]:
    """How long the compiled cells took: what a rerun of the missing ones will cost."""
    walls = [r["wall_s"] for r in cache.values() if r["status"] in ("fits", "no", "timeout")]
    if not walls:
        return []
    return [f"So far {len(walls)} plans were compiled, {sum(walls) / 60:.0f} min in all "
            f"({min(walls) / 60:.1f} to {max(walls) / 60:.1f} min each, train and eval step, "
            "on a shared 2-core CPU); every other cell was answered without a compile.", ""]


def _missing_lines(missing: list[tuple[str, str, int]], batch: int) -> list[str]:
    if not missing:
        return []
    models = sorted({m for m, _, _ in missing}, key=MODELS.index)
    hardware = sorted({h for _, h, _ in missing}, key=HARDWARE.index)
    seqs = sorted({s for _, _, s in missing})
    return [
        "## Not planned yet",
        "",
        f"{len(missing)} cells (model, hardware, sequence) are not complete. This fills them "
        "(a rerun compiles only what `benchmarks/tpu_plan.json` lacks; the largest models take",
        "minutes per compile on a small CPU):",
        "",
        "```bash",
        f"python benchmarks/tpu_plan.py --batch {batch} --models {' '.join(models)} \\",
        f"    --hardware {' '.join(hardware)} --seq {' '.join(map(str, seqs))}",
        "```",
        "",
    ]


def main(argv: list[str] | None = None) -> None:
    parse = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parse.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parse.add_argument("--hardware", nargs="+", default=list(HARDWARE), choices=HARDWARE)
    parse.add_argument("--seq", nargs="+", type=int, default=list(SEQS), choices=SEQS)
    parse.add_argument("--batch", type=int, default=4, help="rows per chip (default 4)")
    parse.add_argument("--budget-s", type=float, default=float("inf"),
                       help="start no plan after this many seconds (default: no limit)")
    parse.add_argument("--timeout-s", type=float, default=3600,
                       help="stop one plan after this many seconds (default 3600)")
    parse.add_argument("--cache", default=CACHE, help=f"results JSON (default {CACHE})")
    parse.add_argument("--docs", default=DOCS, help=f"the page written (default {DOCS})")
    parse.add_argument("--docs-only", action="store_true",
                       help="write the page from the cache; compile nothing")
    args = parse.parse_args(argv)
    cache = {}
    if os.path.exists(args.cache):
        with open(args.cache, encoding="utf-8") as f:
            cache = json.load(f)
    if not args.docs_only:
        cells = [(m, h, s) for m in MODELS if m in args.models
                 for s in sorted(args.seq) for h in HARDWARE if h in args.hardware]
        fill(cache, cells, args.batch, args.cache, time.time() + args.budget_s, args.timeout_s)
    with open(args.docs, "w", encoding="utf-8") as f:
        f.write(page(cache, args.batch))
    print(f"wrote {args.docs}")


if __name__ == "__main__":
    main()
