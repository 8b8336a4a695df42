"""Seconds to each job's first train step in an optimizer sweep, run as `flaxlm-train -m` runs
it (Hydra's basic launcher: every job in this one process), with a fresh persistent
compilation cache: the first job compiles its train step, and a later job whose programs are
the same (issue 52, goal 6: the optimizer's numbers are arguments of the step) reads them back.

    python benchmarks/sweep_start.py [flaxlm-train overrides...]

With no overrides: the quickstart for one step, a sweep over optimizer.lr × weight_decay.
Per job: the seconds from the job's start to its first step's metrics, the XLA compilations in
that time and their seconds, and the persistent-cache hits.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

DEFAULT = ["optimizer.lr=1e-3,3e-4", "optimizer.weight_decay=0,0.1", "trainer.max_steps=1",
           "trainer.eval_before_training=false", "logger=none"]


def main(overrides: list[str]) -> None:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="sweep-xla-"))
    import jax
    from jax import monitoring

    from flaxlm import job
    from flaxlm.cli import train as train_cli
    from flaxlm.training import loop

    jobs: list[dict] = []

    def on_event(event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits" and jobs:
            jobs[-1]["cache_hits"] += 1

    def on_duration(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and jobs:
            jobs[-1]["compiles"] += 1
            jobs[-1]["compile_s"] += seconds

    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_duration)

    train, stepped = job.train, loop.Loop.stepped

    def timed_train(cfg, *args, **kwargs):
        jobs.append({"lr": cfg.optimizer.lr, "weight_decay": cfg.optimizer.weight_decay,
                     "started": time.perf_counter(), "compiles": 0, "compile_s": 0.0,
                     "cache_hits": 0})
        return train(cfg, *args, **kwargs)

    def timed_stepped(self, state, metrics):
        if "first_step_s" not in jobs[-1]:
            jax.block_until_ready(metrics)
            jobs[-1]["first_step_s"] = time.perf_counter() - jobs[-1]["started"]
            jobs[-1]["at_first_step"] = dict(compiles=jobs[-1]["compiles"],
                                             compile_s=jobs[-1]["compile_s"],
                                             cache_hits=jobs[-1]["cache_hits"])
        return stepped(self, state, metrics)

    job.train, loop.Loop.stepped = timed_train, timed_stepped
    sys.argv = ["flaxlm-train", "-m", *overrides]
    try:
        train_cli.main()
    except SystemExit as exit_:
        if exit_.code:
            raise
    print("\njob | lr | weight_decay | first step (s) | compiles before it (s) | cache hits")
    for number, entry in enumerate(jobs):
        first = entry["at_first_step"]
        print(f"{number} | {entry['lr']:g} | {entry['weight_decay']:g} | "
              f"{entry['first_step_s']:.2f} | {first['compiles']} ({first['compile_s']:.2f}) | "
              f"{first['cache_hits']}")


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
