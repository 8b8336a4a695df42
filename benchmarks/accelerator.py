"""flaxlm's training step on the accelerator at hand: GPT-2 (124M) and distilgpt2 at sequence
1024 in bfloat16, each at the largest global batch that fits, with its tokens/s and its MFU
against the devices' dense bfloat16 peak.

On a machine with a GPU or a TPU, from the repository root, as it is:

    make bench-accelerator
    make bench-accelerator ARGS="--models gpt2 --seq 2048 --max-batch 512"

Several sequence lengths and attention backends make one row each (model × length × backend):

    python benchmarks/accelerator.py --models smollm-135m --seq 2048,4096 \
        --attention splash,xla --start-batch 4 --max-batch 4 model.max_positions=4096 --out a.json

JAX's platform picks the hardware group (conf/hardware/gpu.yaml or tpu.yaml: bfloat16 compute,
float32 parameters and AdamW state, all devices on the data axis); `hardware=...` among the
arguments chooses another, and any other Hydra override of conf/train.yaml is passed on. For
each model the search starts at the group's per-device batch (`--start-batch` to change it)
and doubles the global batch up to `--max-batch`; when the start itself runs out of memory it
halves instead, down to one row per device. At each further `--seq` the start and the cap
are the same number of tokens (rows × the first length ÷ this one). Every try is a fresh
process of benchmarks/train_step.py's flaxlm worker running two steps; the first try that
fails ends the search, and only a failure that names memory (XLA's RESOURCE_EXHAUSTED, "out of
memory", or the process killed by SIGKILL) counts as "does not fit": any other failure is
printed as one. The largest batch that ran is then timed in `--rounds` fresh processes
(harness.py), and one table gives the median tokens/s, the spread, the device memory peak and
MFU: tokens/s × training FLOPs per token ÷ the devices' peak (flaxlm.hardware_peak). The
memory peak is JAX's `peak_bytes_in_use`; on a TPU it leaves out the program's temporaries
(activations and all), so the table also gives the compiled step's footprint from XLA's
`memory_analysis()`. JAX's GPU allocator takes 75% of the memory by default
(XLA_PYTHON_CLIENT_MEM_FRACTION changes it, and the batch that fits).
`--attention` names `model.attention` for each row (default: the model's own, `auto`). `--out`
also writes the rows as JSON. On a TPU, where the train step of a 30-layer model takes over a
minute to compile, set JAX_COMPILATION_CACHE_DIR: the timed process can then take the compile
of the try that found its batch from the cache.

For scale: MaxText, the reference JAX stack, reports 45–65% MFU for large models on TPUs and
GPUs in its own published figures; that is the bar, and a model as small as GPT-2 small, with
narrow matrices and a large vocabulary, should be expected to stay below it.

On a CPU it runs too (to try it out, and for the tests) with the cpu group, in float32: its
figures are a CPU's, and it prints no MFU, since a CPU's peak is not known.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import train_step  # noqa: E402

TRAIN_STEP = os.path.abspath(train_step.__file__)
GROUPS = {"gpu": "gpu", "cuda": "gpu", "tpu": "tpu", "cpu": "cpu"}  # JAX's backend → group
MAX_ROWS_PER_DEVICE = 1024  # the default cap, so that a search that never fails ends
PROBE_WARMUP, PROBE_STEPS = 1, 1  # a try: compilation, then the steady state's memory
# How XLA, the CUDA driver and the TPU compiler say that memory ran out.
OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|out[ _]of[ _]memory", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One try of a global batch: the worker's result, or why it did not run."""

    batch: int
    result: dict | None = None
    failure: str | None = None
    out_of_memory: bool = False


@dataclasses.dataclass(frozen=True)
class Search:
    batch: int | None  # the largest global batch that ran; None when none did
    stopped: str  # why the search ended


def largest_batch(attempt: Callable[[int], Attempt], start: int, unit: int, cap: int) -> Search:
    """The largest global batch, in multiples of `unit` (one row per device), that `attempt`
    runs: doubling from `start` up to `cap`, or halving from it while it runs out of memory.
    The first failure ends the search; one not about memory is reported as it is."""
    if cap < unit:
        raise SystemExit(
            f"--max-batch {cap} is less than one row per device ({unit} devices): raise "
            f"--max-batch to at least {unit}, or use fewer devices (hardware.num_devices=...)."
        )
    cap = cap // unit * unit
    batch = min(max(unit, start // unit * unit), cap)
    attempts: list[Attempt] = []
    while True:
        tried = attempt(batch)
        attempts.append(tried)
        fitted = [a.batch for a in attempts if a.failure is None]
        came_down = len(fitted) < len(attempts)  # from a larger batch that ran out of memory
        if tried.failure is None:
            if came_down or batch == cap:
                stopped = ("a larger batch ran out of memory" if came_down
                           else f"reached the cap, --max-batch {cap}")
                break
            batch = min(2 * batch, cap)
        elif tried.out_of_memory and not fitted and batch > unit:
            batch = max(unit, batch // 2 // unit * unit)
        else:
            kind = "ran out of memory" if tried.out_of_memory else "failed, not for memory"
            stopped = f"batch {batch} {kind}: {tried.failure}"
            break
    return Search(max(fitted, default=None), stopped)


def run_attempt(batch: int, command: tuple[str, ...], timeout: float) -> Attempt:
    """Run one try's worker process; tell running out of memory from other failures by the
    whole of its stderr (a TPU's out-of-memory report ends in a listing of buffers)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Attempt(batch, failure=f"no result within {timeout:.0f} s")
    result = harness.parse_result(done.stdout)
    if done.returncode == 0 and result and result.get("seconds_per_step"):
        return Attempt(batch, result=result)
    lines = done.stderr.strip().splitlines() or ["no output"]
    memory_lines = [line for line in lines if OUT_OF_MEMORY.search(line)]
    if done.returncode == -signal.SIGKILL:
        memory_lines.append("killed by SIGKILL (the kernel's out-of-memory killer, usually)")
    line = (memory_lines or lines)[-1].strip()
    return Attempt(batch, failure=f"exit {done.returncode}: {line[:300]}",
                   out_of_memory=bool(memory_lines))


def detect_platform() -> str:
    """JAX's default backend, asked in a process of its own: a parent holding the accelerator
    would leave the workers without it."""
    done = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                          capture_output=True, text=True, timeout=600)
    backend = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode or backend not in GROUPS:
        reason = backend or (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(
            f"JAX's platform here is not one this script knows ({reason}); it picks the "
            f"hardware group for {sorted(set(GROUPS.values()))}. Name the group yourself with "
            "hardware=<group> (a file of conf/hardware/), or install the jax extra for this "
            "accelerator, e.g. `pip install -U 'jax[cuda12]'`."
        )
    return GROUPS[backend]


def devices_worker(overrides: list[str]) -> None:
    """The devices the flaxlm worker will use, as it sets them up (platform, device count)."""
    import jax

    from flaxlm.parallel import configure_platform, make_mesh

    hardware = train_step.compose(overrides).hardware
    configure_platform(hardware)
    mesh = make_mesh(hardware.num_devices)
    harness.emit(platform=jax.default_backend(), devices=mesh.size,
                 device_kind=mesh.devices.flat[0].device_kind,
                 per_device_batch=hardware.per_device_batch_size,
                 compute_dtype=hardware.compute_dtype)


def describe_devices(overrides: list[str]) -> dict:
    command = harness.worker_command(os.path.abspath(__file__), overrides, "devices")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    found = harness.parse_result(done.stdout)
    if done.returncode or not found:
        sys.exit((done.stderr.strip() or "the devices worker printed nothing").splitlines()[-1])
    return found


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the table: a model at a sequence length, with an attention backend (None:
    the model's own setting)."""

    model: str
    seq: int
    attention: str | None = None

    @property
    def label(self) -> str:
        return "/".join([self.model, str(self.seq), *([self.attention] if self.attention else [])])

    def overrides(self) -> list[str]:
        return [f"model={self.model}",
                *([f"model.attention={self.attention}"] if self.attention else [])]


def step_command(overrides: list[str], variant: Variant, batch: int, warmup: int,
                 steps: int) -> tuple[str, ...]:
    argv = [*overrides, *variant.overrides(), "--seq", str(variant.seq), "--batch", str(batch),
            "--warmup", str(warmup), "--steps", str(steps)]
    return harness.worker_command(TRAIN_STEP, argv, "flaxlm")


def search_batch(overrides: list[str], variant: Variant, args, start: int, unit: int,
                 cap: int) -> Search:
    def attempt(batch: int) -> Attempt:
        command = step_command(overrides, variant, batch, PROBE_WARMUP, PROBE_STEPS)
        tried = run_attempt(batch, command, args.timeout)
        if tried.failure:
            print(f"  {variant.label}: batch {batch}: {tried.failure}", flush=True)
        else:
            used = memory(tried.result)
            print(f"  {variant.label}: batch {batch} runs"
                  + (f" (device memory at its peak: {used})" if used != "—" else ""), flush=True)
        return tried

    return largest_batch(attempt, start, unit, cap)


def same_tokens(rows: int, first_seq: int, seq: int, unit: int) -> int:
    """`rows` of `first_seq` tokens as rows of `seq` tokens, at least one per device."""
    return max(unit, rows * first_seq // seq // unit * unit)


def memory(result: dict) -> str:
    """Device 0's peak bytes in use (and its limit) as the worker saw them, where JAX keeps
    them."""
    peak, limit = result.get("peak_bytes_in_use"), result.get("bytes_limit")
    if not peak:
        return "—"
    return f"{peak / 2**30:.1f}" + (f" of {limit / 2**30:.1f}" if limit else "") + " GiB"


def step_memory(result: dict) -> str:
    """The compiled train step's footprint (arguments + outputs − donated + temporaries): on a
    TPU the figure to read, since the peak above leaves the program's temporaries out."""
    step_bytes = result.get("step_bytes")
    return f"{step_bytes / 2**30:.1f} GiB" if step_bytes else "—"


def table_row(variant: Variant, search: Search, rates: list[float], info: dict | None,
              failure: str | None) -> tuple[list[str], str]:
    """The variant's cells, and a note: why the search stopped, or why a figure is missing."""
    attention = variant.attention or "(model's)"
    if not rates:
        empty = [variant.model, "", str(variant.seq), attention, "", "", "", "no result (below)",
                 "", "", "", ""]
        return empty, f"{variant.label}: {failure or search.stopped}"
    median = statistics.median(rates)
    mfu = "—"
    if info.get("peak_flops"):
        mfu = f"{median * info['flops_per_token'] / info['peak_flops']:.1%}"
    params = f"{info['num_params'] / 1e6:.1f}M" if info.get("num_params") else "?"
    step_ms = search.batch * variant.seq / median * 1e3
    cells = [variant.model, params, str(variant.seq), attention, str(search.batch),
             info.get("devices", "?"), f"{step_ms:,.1f}", f"{median:,.0f}",
             f"{min(rates):,.0f}–{max(rates):,.0f}", mfu, memory(info), step_memory(info)]
    return cells, f"{variant.label}: batch {search.batch}; the search stopped: {search.stopped}"


def json_row(variant: Variant, search: Search, rates: list[float], info: dict | None,
             failure: str | None) -> dict:
    """One row's figures as numbers, for --out."""
    row = dict(model=variant.model, seq=variant.seq, attention=variant.attention,
               global_batch=search.batch, search_stopped=search.stopped, failure=failure,
               tokens_per_s=[float(rate) for rate in rates])
    if rates:
        median = statistics.median(rates)
        row.update(median_tokens_per_s=median,
                   step_s=search.batch * variant.seq / median,
                   mfu=(median * info["flops_per_token"] / info["peak_flops"]
                        if info.get("peak_flops") else None),
                   **{key: info.get(key) for key in ("num_params", "flops_per_token",
                                                     "peak_flops", "devices",
                                                     "peak_bytes_in_use", "bytes_limit",
                                                     "step_bytes")})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. hardware=tpu-v3-8")
    parser.add_argument("--models", default="gpt2,distilgpt2",
                        help="comma-separated model groups (conf/model/)")
    parser.add_argument("--seq", default="1024",
                        help="comma-separated sequence lengths, one row each")
    parser.add_argument("--attention", default=None,
                        help="comma-separated model.attention backends, one row each (default: "
                             "the model's own)")
    parser.add_argument("--start-batch", type=int, default=None,
                        help="first global batch tried at the first --seq (default: the group's "
                             "per-device batch × devices)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help=f"largest global batch tried at the first --seq (default: "
                             f"{MAX_ROWS_PER_DEVICE} per device)")
    parser.add_argument("--out", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds one worker process may take")
    harness.add_arguments(parser, choose=False)
    parser.set_defaults(rounds=2, steps=10, warmup=3)
    args = parser.parse_args()
    if args.worker == "devices":
        devices_worker(args.overrides)
        return

    overrides = list(args.overrides)
    if not any(item.startswith("hardware=") for item in overrides):
        overrides.insert(0, f"hardware={detect_platform()}")
    found = describe_devices(overrides)
    unit = found["devices"]
    print(harness.machine_description())
    print(f"devices: {unit} × {found['device_kind']} ({found['platform']}), "
          f"{' '.join(overrides)}, compute in {found['compute_dtype']}")
    if found["platform"] == "cpu":
        print("THESE ARE A CPU'S FIGURES, not an accelerator's, and no MFU is printed (a CPU's "
              "peak is not known). For the real ones, run this on a GPU or TPU machine whose "
              "jax has that accelerator's extra (JAX falls back to the CPU without it).")
    start = args.start_batch or found["per_device_batch"] * unit
    cap = args.max_batch or MAX_ROWS_PER_DEVICE * unit
    seqs = [int(seq) for seq in args.seq.split(",")]
    attentions = args.attention.split(",") if args.attention else [None]
    print(f"sequence {args.seq}; batches from {start}, at most {cap} (at sequence {seqs[0]}), "
          f"each try {PROBE_WARMUP + PROBE_STEPS} steps in a fresh process; then {args.rounds} "
          f"round(s) of {args.warmup} warm-up + {args.steps} timed steps", flush=True)

    rows, notes, records = [], [], []
    for variant in [Variant(model, seq, attention) for model in args.models.split(",")
                    for seq in seqs for attention in attentions]:
        search = search_batch(overrides, variant, args,
                              same_tokens(start, seqs[0], variant.seq, unit), unit,
                              same_tokens(cap, seqs[0], variant.seq, unit))
        rates, failures, info = [], {}, {}
        if search.batch is not None:
            contender = harness.Contender(variant.label, step_command(
                overrides, variant, search.batch, args.warmup, args.steps))
            timed, failures, info = harness.run_rounds(
                [contender], args.rounds, search.batch * variant.seq, args.timeout,
                args.profile)
            rates = timed[variant.label]
        outcome = (search, rates, info.get(variant.label), failures.get(variant.label))
        cells, note = table_row(variant, *outcome)
        rows.append(cells)
        notes.append(note)
        records.append(json_row(variant, *outcome))

    header = ["model", "parameters", "seq", "attention", "global batch", "devices",
              "step (ms)", "median tokens/s", "spread (min–max)", "MFU", "device memory (peak)",
              "compiled step"]
    lines = harness.aligned_columns([header, *rows])
    print()
    print("\n".join(["| " + " | ".join(cells) + " |" for cells in lines] + notes))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(dict(devices=found, overrides=overrides, rows=records), f, indent=2)
    if found["platform"] != "cpu" and any(cells[9] == "—" for cells in rows):
        print(f"no MFU: the bfloat16 peak of {found['device_kind']} is not known "
              "(flaxlm.hardware_peak); hardware.peak_tflops_per_device=... sets one")


if __name__ == "__main__":
    main()
