"""Libraries imported where they are first used, not where a module names them.

`datasets` (with pandas under it), `transformers` and pyarrow take seconds to import, more on a TPU
VM, and not every use of a module that names them needs them: a tool's `--help` needs none, a
run only what its corpus, task, tokenizer and export use, and only when it gets there. A module
that writes

    datasets = lazy_module("datasets")

uses `datasets.Dataset` as before; the library is imported at the first attribute read, by
Python's own import (so `sys.modules` holds the real module, never this stand-in), and annotations
(`from __future__ import annotations`) never read it. tests/test_imports.py pins which libraries
importing the train path loads.
"""

from __future__ import annotations

import importlib
import threading
import types
from typing import Any


class LazyModule(types.ModuleType):
    """Stands for the module `name` until an attribute is read from it."""

    def __getattr__(self, attribute: str) -> Any:
        # Only called for what the stand-in itself lacks, i.e. everything of the library's own.
        return getattr(importlib.import_module(self.__name__), attribute)

    def __repr__(self) -> str:
        return f"<module {self.__name__!r}, imported at its first use>"


def lazy_module(name: str) -> Any:
    """The module `name`, imported at its first use (typed Any: it stands for any module)."""
    return LazyModule(name)


def import_in_background(names: list[str]) -> threading.Thread:
    """Import the modules `names` (a dotted name may end in an attribute of a lazy package:
    "transformers.PreTrainedTokenizerFast") in a daemon thread, while the caller goes on with
    work that leaves Python's lock free: starting a TPU's runtime holds it for little of its
    5-10 s. Whatever fails here is left to the first use, which imports the module again and
    raises where it would have without this.

    The caller joins the thread before anything may fork: a process forked while the thread
    holds an import's lock would wait for that lock forever (the thread is not in the child)."""

    def run() -> None:
        for name in names:
            try:
                module_name, _, attribute = name.rpartition(".")
                try:
                    importlib.import_module(name)
                except ImportError:  # "package.Attribute": the package, then the attribute
                    getattr(importlib.import_module(module_name), attribute)
            except Exception:  # noqa: BLE001, S110 — the first use reports it
                pass

    thread = threading.Thread(target=run, name="imports", daemon=True)
    thread.start()
    return thread
