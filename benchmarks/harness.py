"""What the step benchmarks share: contenders timed in processes of their own, alternating over
several rounds, summarised as median and spread, with the ratio of medians to our own.

A process that has run one framework is a worse place to time another (JAX's thread pools slow
PyTorch down by 10–20%), and a shared machine drifts over minutes, so each contender runs once
per round in a fresh process, the order rotating from round to round, and only medians are
compared. A worker prints one `RESULT_PREFIX` line: its seconds per step, or why it could not run.

Standard library only (and numpy in the workers): the workers of other environments import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

RESULT_PREFIX = "BENCH-RESULT "
PROFILE_ENV = "FLAXLM_BENCH_PROFILE"  # where a JAX worker writes its trace (--profile)
PROFILED_STEPS = 3
CPU_FLAGS_SHOWN = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


@dataclasses.dataclass(frozen=True)
class Contender:
    """One way of running the step: a command that starts a worker process."""

    name: str
    command: tuple[str, ...]
    env: dict[str, str] | None = None  # added to this process's environment
    skip_reason: str | None = None  # set when the contender cannot run here at all


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    rates: tuple[float, ...]  # one per round that ran
    median: float | None
    ratio: float | None  # median / the baseline's median
    note: str = ""


def time_steps(step: Callable[[], None], warmup: int, steps: int) -> float:
    """Seconds per step after `warmup` untimed steps; `step()` must block until done."""
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - start) / steps
    trace_dir = os.environ.get(PROFILE_ENV)
    if trace_dir and "jax" in sys.modules:  # after the timed steps, so tracing costs them nothing
        import jax

        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(PROFILED_STEPS):
                step()
    return seconds


def seconds(call: Callable[[], None]) -> float:
    """The wall time of one `call()` (a first step: its compilation, mostly)."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def save_program(compiled: Callable) -> None:
    """With --profile, the optimized HLO of the profiled step beside its trace (`compiled()`
    returns the compiled executable): profile_summary.py reads what each fusion computes
    from it, which the trace's operation names alone do not say."""
    trace_dir = os.environ.get(PROFILE_ENV)
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        with open(os.path.join(trace_dir, "step.hlo.txt"), "w") as f:
            f.write(compiled().as_text())


def emit(seconds_per_step: float | None = None, **info) -> None:
    """The worker's result line: seconds per step, or `skip=<reason>` in `info`."""
    print(RESULT_PREFIX + json.dumps({"seconds_per_step": seconds_per_step, **info}), flush=True)


def parse_result(stdout: str) -> dict | None:
    """The last result line a worker printed, or None."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else None


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The contenders of one round: every one once, starting one further along each round, so
    none always runs first (on a cold machine) or right after the same neighbour."""
    shift = round_index % len(names) if names else 0
    return [*names[shift:], *names[:shift]]


def run_rounds(contenders: Sequence[Contender], rounds: int, units_per_step: float,
               timeout: float = 1800, profile: str | None = None):
    """Each runnable contender once per round in a fresh process. By name: its rates (units per
    second), why it has none (skipped, or its worker failed), and its last worker's result.
    With `profile`, JAX workers trace steps into profile/<name>/round-<n>."""
    rates: dict[str, list[float]] = {c.name: [] for c in contenders}
    info: dict[str, dict] = {}
    notes = {c.name: f"skipped: {c.skip_reason}" for c in contenders if c.skip_reason}
    by_name = {c.name: c for c in contenders}
    loads = []
    for index in range(rounds):
        for name in round_order([c.name for c in contenders if not c.skip_reason], index):
            if name in notes:  # skipped or failed in an earlier round
                continue
            loads.append(os.getloadavg()[0])
            trace_dir = profile and os.path.join(profile, name, f"round-{index + 1}")
            result, failure = _run_worker(by_name[name], timeout, trace_dir)
            if failure:
                notes[name] = failure
                print(f"  round {index + 1}: {name}: {failure}", flush=True)
                continue
            rates[name].append(units_per_step / result["seconds_per_step"])
            info[name] = result
            print(f"  round {index + 1}: {name}: {rates[name][-1]:,.1f}/s "
                  f"(load average {loads[-1]:.1f} at its start)", flush=True)
    cores = len(os.sched_getaffinity(0))
    if loads and max(loads) > 1.5 * cores:
        print(f"warning: the load average reached {max(loads):.1f} on {cores} usable core(s): "
              "other work shared the cores, and PyTorch's OpenMP threads lose most from that "
              "(OMP_WAIT_POLICY=passive softens it); these figures are noisy", flush=True)
    return rates, notes, info


def _run_worker(contender: Contender, timeout: float,
                trace_dir: str | None = None) -> tuple[dict | None, str | None]:
    env = {**os.environ, **(contender.env or {})}
    if trace_dir:
        env[PROFILE_ENV] = os.path.abspath(trace_dir)
    try:
        done = subprocess.run(contender.command, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"failed: no result within {timeout:.0f} s"
    result = parse_result(done.stdout)
    if result and result.get("skip"):
        return None, f"skipped: {result['skip']}"
    if done.returncode or not result or not result.get("seconds_per_step"):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"failed (exit {done.returncode}): {tail}"
    return result, None


def summarise(rates: dict[str, list[float]], notes: dict[str, str], baseline: str) -> list[Row]:
    """One row per contender: median and the ratio of its median to the baseline's."""
    base = statistics.median(rates[baseline]) if rates.get(baseline) else None
    rows = []
    for name, values in rates.items():
        median = statistics.median(values) if values else None
        ratio = median / base if median is not None and base else None
        rows.append(Row(name, tuple(values), median, ratio, notes.get(name, "")))
    return rows


def format_table(rows: Sequence[Row], unit: str, baseline: str,
                 mfu: Callable[[float], float] | None = None) -> str:
    """The side-by-side table; an MFU column only when `mfu` (rate → fraction) is given."""
    header = ["contender", f"median {unit}", "spread (min–max)", "rounds", f"vs {baseline}"]
    if mfu:
        header.append("MFU")
    lines, reasons = [header], []
    for row in rows:
        if row.median is None:
            note = row.note or "no result"
            lines.append([row.name, note.split(":")[0] + " (below)", "", "", ""]
                         + ([""] if mfu else []))
            reasons.append(f"{row.name}: {note}")
            continue
        cells = [row.name, f"{row.median:,.1f}", f"{min(row.rates):,.1f}–{max(row.rates):,.1f}",
                 str(len(row.rates)), f"{row.ratio:.2f}×" if row.ratio else ""]
        if mfu:
            cells.append(f"{mfu(row.median):.1%}")
        lines.append(cells)
    table = ["| " + " | ".join(cells) + " |" for cells in aligned_columns(lines)]
    return "\n".join([*table, *reasons])


def aligned_columns(lines: list[list[str]]) -> list[list[str]]:
    widths = [max(len(line[col]) for line in lines if col < len(line))
              for col in range(len(lines[0]))]
    out = [[cell.ljust(widths[col]) for col, cell in enumerate(line)] for line in lines]
    return out[:1] + [["-" * w for w in widths]] + out[1:]


def cpu_description(cpuinfo: str) -> str:
    """The CPU model, the cores this process may use, and the vector flags that matter to
    matrix multiplies, from the text of /proc/cpuinfo."""
    model, flags = "unknown CPU", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    shown = [flag for flag in CPU_FLAGS_SHOWN if flag in flags]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} core(s) usable, flags: {' '.join(shown) or 'none of note'}"


def machine_description(packages: Sequence[str] = ("jax", "flax", "torch", "transformers")) -> str:
    """CPU, Python and package versions, for the table's heading: machines differ."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = cpu_description(f.read())
    except OSError:
        cpu = platform.processor() or platform.machine()
    versions = []
    for package in packages:
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} absent")
    return f"CPU: {cpu}\nPython {platform.python_version()}, {', '.join(versions)}"


def add_arguments(parser: argparse.ArgumentParser, *, timed_steps: bool = True,
                  choose: bool = True) -> None:
    """The command-line options every contender benchmark has: rounds, PyTorch's threads, the
    hidden worker switch and, where it times steps, warm-up and timed steps, and `--only`."""
    parser.add_argument("--rounds", type=int, default=3, help="processes per contender")
    if timed_steps:
        parser.add_argument("--steps", type=int, default=5, help="timed steps per process")
        parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="PyTorch's intra-op threads (default: the usable cores)")
    if choose:
        parser.add_argument("--only", default=None,
                            help="comma-separated contenders to run (default: all)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help=f"JAX contenders also trace {PROFILED_STEPS} steps into DIR/<name>; "
                             "summarise with benchmarks/profile_summary.py")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def worker_command(script: str, argv: Sequence[str], name: str,
                   python: str = sys.executable) -> tuple[str, ...]:
    """The command that runs `script` as the worker `name`, with the parent's own arguments."""
    return (python, script, *argv, "--worker", name)
