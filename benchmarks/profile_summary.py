"""Where a profiled step's time goes: `python benchmarks/profile_summary.py DIR [--top N]`.

DIR is what a benchmark's `--profile DIR` wrote (one folder per contender and round, each a
jax.profiler trace of harness.PROFILED_STEPS steps, and the step's optimized HLO). For each
contender this prints, per step, the time its XLA operations took summed over the threads that
ran them, grouped by operation with XLA's numeric suffix dropped (`ynn_fusion.12` and
`ynn_fusion.40` are one row), and how busy each thread was. Summed time exceeds wall time
where operations ran side by side. On an accelerator only the device's own line of XLA
operations counts (the host's threads only launch them).

With the HLO beside the trace, each operation is also put in a category from what it computes
(`category`): the attention kernel, matrix products (the vocabulary's apart), the rest of the
vocabulary's work (softmax and cross-entropy), and, for everything else, whether it belongs
to the forward pass, the backward pass or neither (the optimizer update and the step's
bookkeeping), by the JAX transformations its `op_name` metadata names.
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
    """The complete ('X') events of the newest trace under `trace_dir`, and thread names.
    Where the trace has an accelerator (a process named /device:TPU:0 or GPU), only the
    events of its first device's "XLA Ops" line."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        sys.exit(f"no *.trace.json.gz under {trace_dir}: run a benchmark with --profile first")
    with gzip.open(paths[-1]) as f:
        trace = json.load(f)
    metadata = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in metadata
               if e.get("name") == "thread_name"}
    devices = sorted((e["args"]["name"], e["pid"]) for e in metadata
                     if e.get("name") == "process_name"
                     and re.search(r"/device:(TPU|GPU):", e["args"]["name"]))
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if devices:
        device = devices[0][1]
        ops_lines = {key for key, name in threads.items()
                     if key[0] == device and name == "XLA Ops"}
        events = [e for e in events if e["pid"] == device
                  and (not ops_lines or (e["pid"], e["tid"]) in ops_lines)]
    return with_self_times(events), threads


def with_self_times(events: list[dict]) -> list[dict]:
    """`events`, each given its own time ("self", µs): its duration less that of the events
    it encloses on its line. A TPU's "XLA Ops" line shows a while loop (the loss over the
    vocabulary in chunks, scanned layers) as one event around its body's operations: summed
    whole, the body would be counted twice."""
    lines = collections.defaultdict(list)
    for e in events:
        lines[(e["pid"], e["tid"])].append(e)
    for line in lines.values():
        line.sort(key=lambda e: (e["ts"], -e["dur"]))
        enclosing: list[dict] = []
        for e in line:
            e["self"] = e["dur"]
            while enclosing and enclosing[-1]["ts"] + enclosing[-1]["dur"] <= e["ts"]:
                enclosing.pop()
            if enclosing and e["ts"] + e["dur"] <= enclosing[-1]["ts"] + enclosing[-1]["dur"]:
                enclosing[-1]["self"] -= e["dur"]
            enclosing.append(e)
    return events


def load_hlo(trace_dir: str) -> dict[str, str]:
    """Instruction name → its line in the step's HLO (with the computations it calls, inlined
    after it), or {} where the benchmark wrote none."""
    path = os.path.join(trace_dir, "step.hlo.txt")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        text = f.read()
    computations, current = {}, None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = computations.setdefault(header.group(1), [])
        elif current is not None:
            current.append(line)
    instructions = {}
    for line in text.splitlines():
        match = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) = ", line)
        if match:
            called = re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line)
            instructions[match.group(1)] = "\n".join(
                [line, *(body for name in called for body in computations.get(name, []))])
    return instructions


LAYOUT_OPCODES = {"copy", "transpose", "copy-start", "copy-done"}


def _opcode(line: str) -> str:
    """The opcode of one HLO instruction line (`%x = f32[8]{0} multiply(%a, %b), ...`)."""
    _, _, rest = line.partition(" = ")
    if rest.startswith("("):  # a tuple shape: skip to its closing parenthesis
        depth = 0
        for index, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                rest = rest[index + 1:]
                break
    else:
        rest = rest.partition(" ")[2]
    return rest.strip().partition("(")[0]


def category(hlo: str, vocab: int | None) -> str:
    """What an operation computes, from its HLO (`load_hlo`)."""
    first = hlo.splitlines()[0] if hlo else ""
    if "custom-call" in hlo and ("tpu_custom_call" in hlo or "splash" in hlo):
        return "attention kernel"
    over_vocab = vocab is not None and re.search(rf"[\[,]{vocab}[\],]", hlo) is not None
    if " convolution(" in hlo or " dot(" in hlo:
        return "matmul: vocabulary" if over_vocab else "matmul"
    if over_vocab:
        return "vocabulary: softmax, loss"
    op_name = re.search(r'op_name="([^"]*)"', first)
    where = op_name.group(1) if op_name else ""
    body_root = next((line for line in hlo.splitlines()[1:] if "ROOT " in line), first)
    if {_opcode(first), _opcode(body_root)} & LAYOUT_OPCODES:
        kind = "copies, layout"
    else:
        kind = "elementwise, reductions"
    if "transpose(" in where:
        return f"{kind} (backward)"
    if "jvp(" in where:
        return f"{kind} (forward)"
    return f"{kind} (outside the gradient: optimizer, metrics)"


def operation_times(events: list[dict], steps: int) -> collections.Counter:
    """Milliseconds per step by operation (numeric suffix dropped), each its own time."""
    totals: collections.Counter = collections.Counter()
    for e in events:
        if not e["name"].startswith(FRAMEWORK_EVENTS):
            totals[re.sub(r"\.\d+$", "", e["name"])] += e["self"] / 1e3 / steps
    return totals


def summarise(trace_dir: str, top: int, steps: int = harness.PROFILED_STEPS,
              vocab: int | None = None) -> str:
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
        busy[threads.get((e["pid"], e["tid"]), str(e["tid"]))] += e["self"] / 1e3 / steps
    for name, ms in busy.most_common(4):
        lines.append(f"  thread {name}: {ms:,.0f} ms busy per step ({ms / span:.0%})")
    hlo = load_hlo(trace_dir)
    if hlo:
        by_category: collections.Counter = collections.Counter()
        for e in ops:
            by_category[category(hlo.get(e["name"], ""), vocab)] += e["self"] / 1e3 / steps
        lines.append(f"  {'ms/step':>8}  {'share':>6}  category")
        for name, ms in by_category.most_common():
            lines.append(f"  {ms:8.1f}  {ms / sum(by_category.values()):6.1%}  {name}")
    lines.append(f"  {'ms/step':>8}  operation")
    for name, ms in totals.most_common(top):
        lines.append(f"  {ms:8.1f}  {name}")
        example = next((e["name"] for e in ops if re.sub(r"\.\d+$", "", e["name"]) == name), None)
        if hlo and example in hlo:
            lines.append("            " + hlo[example].splitlines()[0].strip()[:240])
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", help="what --profile DIR wrote, or one contender's folder in it")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--vocab", type=int, default=None,
                        help="the model's vocabulary size: its work gets categories of its own")
    args = parser.parse_args()
    rounds = sorted({os.path.dirname(os.path.dirname(p)) for p in glob.glob(
        os.path.join(args.dir, "**", "plugins", "profile"), recursive=True)})
    if not rounds:
        sys.exit(f"no profiles under {args.dir}: run a benchmark with --profile {args.dir}")
    for trace_dir in rounds:
        print(summarise(trace_dir, args.top, vocab=args.vocab))
        print()


if __name__ == "__main__":
    main()
