"""Where a profiled step's time goes: `python benchmarks/profile_summary.py DIR [--top N]`.

DIR is what a benchmark's `--profile DIR` wrote (one folder per contender and round, each a
jax.profiler trace of harness.PROFILED_STEPS steps). For each contender this prints, per step,
the time its XLA operations took summed over the threads that ran them, grouped by operation
with XLA's numeric suffix dropped (`ynn_fusion.12` and `ynn_fusion.40` are one row), and how
busy each thread was. Summed time exceeds wall time where operations ran side by side.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

# Events that wrap or wait for operations rather than being one.
FRAMEWORK_EVENTS = ("$", "ThunkExecutor", "Slinky", "ThreadpoolListener", "PjitFunction",
                    "PmapFunction", "end: ", "Rendezvous", "Wait", "CommonPjRt")


def load_events(trace_dir: str) -> tuple[list[dict], dict]:
    """The complete ('X') events of the newest trace under `trace_dir`, and thread names."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        sys.exit(f"no *.trace.json.gz under {trace_dir}: run a benchmark with --profile first")
    with gzip.open(paths[-1]) as f:
        trace = json.load(f)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"], threads


def operation_times(events: list[dict], steps: int) -> collections.Counter:
    """Milliseconds per step by operation (numeric suffix dropped)."""
    totals: collections.Counter = collections.Counter()
    for e in events:
        if not e["name"].startswith(FRAMEWORK_EVENTS):
            totals[re.sub(r"\.\d+$", "", e["name"])] += e["dur"] / 1e3 / steps
    return totals


def summarise(trace_dir: str, top: int, steps: int = harness.PROFILED_STEPS) -> str:
    events, threads = load_events(trace_dir)
    ops = [e for e in events if not e["name"].startswith(FRAMEWORK_EVENTS)]
    if not ops:
        return f"{trace_dir}: the trace holds no operations"
    span = (max(e["ts"] + e["dur"] for e in ops) - min(e["ts"] for e in ops)) / 1e3 / steps
    totals = operation_times(events, steps)
    lines = [f"{trace_dir}: {span:,.0f} ms of wall time per step from the first operation to "
             f"the last; operations summed over threads: {sum(totals.values()):,.0f} ms"]
    busy: collections.Counter = collections.Counter()
    for e in ops:
        busy[threads.get((e["pid"], e["tid"]), str(e["tid"]))] += e["dur"] / 1e3 / steps
    for name, ms in busy.most_common(4):
        lines.append(f"  thread {name}: {ms:,.0f} ms busy per step ({ms / span:.0%})")
    lines.append(f"  {'ms/step':>8}  operation")
    for name, ms in totals.most_common(top):
        lines.append(f"  {ms:8.1f}  {name}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", help="what --profile DIR wrote, or one contender's folder in it")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    rounds = sorted({os.path.dirname(os.path.dirname(p)) for p in glob.glob(
        os.path.join(args.dir, "**", "plugins", "profile"), recursive=True)})
    if not rounds:
        sys.exit(f"no profiles under {args.dir}: run a benchmark with --profile {args.dir}")
    for trace_dir in rounds:
        print(summarise(trace_dir, args.top))
        print()


if __name__ == "__main__":
    main()
