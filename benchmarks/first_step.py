"""Seconds to the first training step, and where they go: imports, the runtime's start (where
flaxlm-train starts it: what the run does meanwhile, on other threads, overlaps it), and from the
runtime being up to the first logged step (corpus, tokenizer, packing, tracing, compiling or
loading compiled programs), with every program JAX compiled or read back from its cache.

Each run is a fresh process (`flaxlm-train` in it, nothing shared in memory). The first run of a
fresh cache directory is cold (no tokenizer, packed data or compiled program kept); the runs
after it reuse that directory: warm. Nothing is asserted; one JSON line per run, then a table.

    python benchmarks/first_step.py                              # the quickstart, cold then warm
    python benchmarks/first_step.py --runs 3 -- hardware=tpu hardware.per_device_batch_size=8
    python benchmarks/first_step.py --cache /tmp/c -- optimizer.lr=1e-3   # a sweep's later job:
    python benchmarks/first_step.py --cache /tmp/c -- optimizer.lr=3e-4   # the same cache
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

# What each run leaves out of the quickstart by default: the time is the first step's.
QUICK = ["logger=none", "trainer.max_steps=1", "trainer.eval_before_training=false",
         "language.max_eval_docs=8", "samples.prompts=[]"]


def child(run_dir: str, overrides: list[str]) -> None:
    spawned = float(os.environ["FIRST_STEP_SPAWNED"])
    python_up = time.time()
    import flaxlm.cli.train as cli
    import flaxlm.job  # noqa: F401 — what flaxlm-train imports once the config is composed
    import flaxlm.tasks.clm  # noqa: F401

    imported = time.time()
    import jax
    import jax.monitoring

    durations: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    programs: list[tuple[str, str, float]] = []

    def on_duration(event: str, seconds: float, **kwargs) -> None:
        durations[event] += seconds
        counts[event] += 1
        if event.endswith(("backend_compile_duration", "cache_retrieval_time_sec")):
            programs.append((event.rsplit("/", 1)[-1], str(kwargs.get("fun_name", "?")), seconds))

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(lambda event, **_: counts.update([event]))
    # The runtime starts where flaxlm-train starts it (what it does meanwhile overlaps it):
    # "up" is when JAX's backends first return.
    from jax._src import xla_bridge

    start_backends, up = xla_bridge.backends, []

    def backends():
        found = start_backends()
        if not up:
            up.append(time.time())
        return found

    xla_bridge.backends = backends
    sys.argv = ["flaxlm-train", *overrides, f"hydra.run.dir={run_dir}"]
    try:
        cli.main()
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
    ended = time.time()
    runtime_up = up[0]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        first_step = next(record["time"] for record in map(json.loads, f)
                          if "train/loss" in record)
    print("FIRST_STEP " + json.dumps({
        "python_s": python_up - spawned,
        "imports_s": imported - python_up,
        "runtime_s": runtime_up - imported,  # Hydra and the config's checks, then the start
        "to_first_step_s": first_step - runtime_up,
        "spawn_to_first_step_s": first_step - spawned,
        "process_s": ended - spawned,
        "compiled": counts["/jax/core/compile/backend_compile_duration"],
        "compile_s": durations["/jax/core/compile/backend_compile_duration"],
        "trace_s": durations["/jax/core/compile/jaxpr_trace_duration"],
        "lower_s": durations["/jax/core/compile/jaxpr_to_mlir_module_duration"],
        "cache_hits": counts["/jax/compilation_cache/cache_hits"],
        "programs": sorted(programs, key=lambda p: -p[2]),
    }), flush=True)


def run(cache: str, overrides: list[str], label: str, logs: str | None = None) -> dict:
    env = {key: value for key, value in os.environ.items()
           if key != "JAX_COMPILATION_CACHE_DIR"}  # the run's own cache, under FLAXLM_CACHE
    if not any(o.startswith("hardware=") and o != "hardware=cpu" for o in overrides):
        # The runtime is started before flaxlm-train runs, as the cpu group would start it.
        env.setdefault("JAX_PLATFORMS", "cpu")
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""),
                                     f"--xla_force_host_platform_device_count={os.cpu_count()}"])
    env.update(FLAXLM_CACHE=cache, FIRST_STEP_SPAWNED=repr(time.time()))
    with tempfile.TemporaryDirectory() as run_dir:
        done = subprocess.run([sys.executable, __file__, "--child", run_dir, "--", *overrides],
                              env=env, capture_output=True, text=True)
    if logs:
        os.makedirs(logs, exist_ok=True)
        with open(os.path.join(logs, f"{label}.log"), "w") as log:
            log.write(done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("FIRST_STEP ")]
    if done.returncode or not lines:
        sys.exit(f"{label}: flaxlm-train failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return {"label": label, **json.loads(lines[-1].removeprefix("FIRST_STEP "))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides after --")
    parser.add_argument("--cache", help="FLAXLM_CACHE to use (default: a fresh one: cold first)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="without the QUICK overrides")
    parser.add_argument("--label", default="")
    parser.add_argument("--logs", help="a folder for each run's output, <label>.log")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = args.overrides if args.full else [*QUICK, *args.overrides]
    if args.child:
        return child(args.child, overrides)
    cache = args.cache or tempfile.mkdtemp(prefix="flaxlm-first-step-")
    fresh = not os.path.exists(os.path.join(cache, "xla"))
    results = []
    for index in range(args.runs):
        label = args.label + ("cold" if fresh and index == 0 else "warm")
        results.append(run(cache, overrides, f"{label}{index}" if index > 1 else label,
                           args.logs))
        print(json.dumps(results[-1]), flush=True)
    print(f"{'run':<12} {'python':>7} {'imports':>8} {'runtime':>8} {'to step':>8} "
          f"{'spawn→step':>10} {'process':>8} {'compiled':>9} {'compile':>8} {'trace':>6} "
          f"{'hits':>5}")
    for r in results:
        print(f"{r['label']:<12} {r['python_s']:7.1f} {r['imports_s']:8.1f} {r['runtime_s']:8.1f} "
              f"{r['to_first_step_s']:8.1f} {r['spawn_to_first_step_s']:10.1f} "
              f"{r['process_s']:8.1f} {r['compiled']:9d} "
              f"{r['compile_s']:8.1f} {r['trace_s']:6.1f} {r['cache_hits']:5d}")


if __name__ == "__main__":
    main()
