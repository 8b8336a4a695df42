"""The train step compiled (or loaded) ahead, while the model is initialised.

A run's start-up compiles programs one after another: the initialisation, the eval step (with
an eval before training), then the train step at its first call. Each XLA compile runs on one
core with Python's lock released, so the train step, the longest of them, can compile beside
the others: from the state's and the first batch's shapes (`jax.stages`, as flaxlm-plan does),
in a worker thread, while the main thread initialises the model and evaluates. The first step
waits for it only if it is not done yet. On a TPU v5e the quickstart's programs compile in
19.7 s (the train step), 8.1 s (the init) and 3.3 s (the eval step): ahead, the longest decides
the wait, not their sum (docs/benchmarks.md, "Seconds to the first step").

A step that keeps its programs (`flaxlm.training.executables.StoredStep`) loads its executable
in the worker, or traces, compiles and keeps it there on a miss: JAX's trace state and nnx's
graph contexts are per thread. A plain jitted step is traced on the calling thread and only
its compile (or its read from JAX's persistent cache) runs in the worker.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import jax

_WORKERS = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="compile")


class CompiledAhead:
    """`jitted`, called through the executable compiled ahead for `abstract_args`.

    A call whose arguments are not those the executable was made for (other shapes, dtypes or
    layouts: JAX checks them before it runs anything, so nothing donated is lost) goes to
    `jitted` itself from then on, which compiles for what it is given, as it would have without
    this class. A failed compile raises at the first call, where the step's own compile error
    would have (out of memory, a kernel that does not compile), so the same messages apply."""

    def __init__(self, jitted: Callable, abstract_args: Sequence[Any]):
        self.jitted = jitted
        prepare = getattr(jitted, "prepare", None)
        if prepare is not None:  # a step that keeps its programs (StoredStep) loads or compiles
            self._compiled = _WORKERS.submit(lambda: prepare(abstract_args) or jitted)
        else:
            self._compiled = _WORKERS.submit(jitted.lower(*abstract_args).compile)
        self._call: Callable | None = None

    def __call__(self, *args):
        if self._call is None:
            self._call = self._compiled.result()
        try:
            return self._call(*args)
        except (TypeError, ValueError) as err:  # the arguments' check, before anything runs
            if self._call is self.jitted:  # its own program, or its own refusal
                raise
            print(f"flaxlm: note: the train step compiled ahead does not take these "
                  f"arguments ({str(err).splitlines()[0][:200]}); compiling it for them")
            self._call = self.jitted
            return self.jitted(*args)

    def ready(self) -> bool:
        """Whether the executable is compiled (or its compile failed)."""
        return self._compiled.done()


def abstract(tree) -> Any:
    """Each array of `tree` as its shape, dtype and (for a committed array) sharding."""

    def spec(leaf):
        if not isinstance(leaf, jax.Array):
            return leaf
        sharding = leaf.sharding if leaf.committed else None
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding,
                                    weak_type=getattr(leaf, "weak_type", False))

    return jax.tree.map(spec, tree)
