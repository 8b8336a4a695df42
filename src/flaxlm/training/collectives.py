"""The bytes a compiled step moves between chips, read from its optimized HLO text.

XLA's cost analysis counts no communication, and a plan that compares ways of laying a run out
(an all-gather of the keys and values against a ring of them, fsdp against data parallelism)
needs it. Every collective of the per-chip program is counted by the bytes of its result, the
data each chip gathers, reduces, scatters or receives:

- all-gather: the gathered array (each chip receives all of it but its own share);
- all-reduce: the reduced array (a ring all-reduce sends and receives about twice that);
- reduce-scatter: the chip's share of the result;
- all-to-all, collective-permute: the array received.

An asynchronous pair (`-start` / `-done`) is counted once, at its start; of a start's tuple
the largest array (the gathered one; a permute's buffers are all the same size). A loop's
body counts as many times as the loop runs (the trip count read from its condition's bound:
the layers of `model.scan_layers`, the micro-batches of `trainer.grad_accum_steps`); a
conditional's branches each count once, as if taken.
"""

from __future__ import annotations

import functools
import math
import re

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.-]+) ")
# An instruction: its result's type, then the opcode (the first word before a parenthesis
# that follows a space: inside a type, layouts' T(8,128) follow a colon).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%[\w.-]+ = (?P<type>.*?) (?P<op>[a-z][\w-]*)\(")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(?:calls|to_apply|true_computation|false_computation)=%([\w.-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_LOOP = re.compile(r"condition=%([\w.-]+), body=%([\w.-]+)")
_BOUND = re.compile(r"s32\[\]\S* constant\((\d+)\)")


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes per kind of collective (`KINDS`) one chip's program moves in one run of it."""
    computations: dict[str, list[str]] = {}
    entry, lines = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            lines = computations.setdefault(header.group(1), [])
            entry = header.group(1) if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            lines = None
        elif lines is not None:
            lines.append(line)

    def trip_count(condition: str) -> int:
        bounds = [int(b) for line in computations.get(condition, ())
                  for b in _BOUND.findall(line)]
        return max(bounds, default=1)

    @functools.cache
    def totals(name: str) -> tuple[int, ...]:
        sums = [0] * len(KINDS)
        for line in computations.get(name, ()):
            instruction = _INSTRUCTION.match(line)
            if instruction:
                op = instruction.group("op").removesuffix("-start")
                if op in KINDS:
                    sums[KINDS.index(op)] += _largest_array(instruction.group("type"))
            calls = [(callee, 1) for callee in _CALLEE.findall(line)]
            for branches in _BRANCHES.findall(line):
                calls += [(b.strip().lstrip("%"), 1) for b in branches.split(",") if b.strip()]
            for condition, body in _LOOP.findall(line):
                calls.append((body, trip_count(condition)))
            for callee, times in calls:
                if callee != name:
                    sums = [s + times * c for s, c in zip(sums, totals(callee))]
        return tuple(sums)

    counted = totals(entry) if entry else (0,) * len(KINDS)
    return dict(zip(KINDS, counted))


def _largest_array(hlo_type: str) -> int:
    """The bytes of the largest array in a result type (an array, or a tuple of them)."""
    sizes = [math.prod(int(d) for d in dims.split(",") if d) * _ITEM_BYTES.get(dtype, 4)
             for dtype, dims in _ARRAY.findall(hlo_type)]
    return max(sizes, default=0)
