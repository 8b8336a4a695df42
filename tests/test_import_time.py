"""The import-time budget of the train path's own modules (issue 52): what flaxlm's modules do
when imported (their definitions, not the libraries they import) stays a fraction of a second.

A generous bound, not a measurement: flaxlm's modules take 0.25-0.65 s all told on the 2-core
machine (loaded 6-10 times over; `python benchmarks/startup_imports.py` measures it, with each
tool's --help and the libraries the path imports). The test catches the mistakes that cost
seconds at every start, before any step: a computation, a file read or a JAX call at module
level."""

from __future__ import annotations

import compileall
import re
import subprocess
import sys

import pytest

import flaxlm

TRAIN_PATH = "import flaxlm.job, flaxlm.tasks.clm"  # what flaxlm-train imports to run a job
BUDGET_S = 2.5
# `-X importtime`'s lines: "import time: <self us> | <cumulative us> | <indent><module>".
_IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)")


def own_import_seconds(statement: str) -> dict[str, float]:
    """Seconds of each flaxlm module's own import (without the imports it makes), in a fresh
    process."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", statement],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {module: int(self_us) / 1e6
            for self_us, module in _IMPORT_LINE.findall(done.stderr)
            if module.split(".")[0] == "flaxlm"}


@pytest.mark.slow
def test_the_train_paths_own_modules_import_within_their_budget():
    # Compiled first: a fresh checkout (or PYTHONDONTWRITEBYTECODE) would time the compiler.
    compileall.compile_dir(flaxlm.__path__[0], quiet=1)
    own = own_import_seconds(TRAIN_PATH)
    assert {"flaxlm.job", "flaxlm.tasks.clm", "flaxlm.training.loop"} <= set(own)
    slowest = sorted(own.items(), key=lambda item: -item[1])[:5]
    assert sum(own.values()) < BUDGET_S, f"{sum(own.values()):.2f} s; slowest: {slowest}"
