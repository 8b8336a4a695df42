"""What `flaxlm-train` adds to Hydra around its jobs: a clear error when Hydra's output folder
cannot be written, and, for a multirun, one status file per job and a summary at the end.

A job of a multirun that fails records why and the sweep goes on with the next job; the
summary then lists every job (ok / failed with the reason / preempted) with its run directory,
and the command exits 1 if any failed. The statuses are files in the sweep directory
(`<sweep dir>/job-status/<job folder>.json`), not state in this process, so a launcher that
runs jobs elsewhere (submitit) reports the same way. A preempted job stops the sweep: the
machine is being taken away, so the jobs after it are not started.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from flaxlm.errors import FlaxlmError, writable_dir

STATUS_SUBDIR = "job-status"
FAILED_EXIT_CODE = 1


class SweepJob:
    """The status file of one multirun job, written once the job ends."""

    def __init__(self, sweep_dir: str, number: int, overrides: list[str], run_dir: str):
        self.sweep_dir, self.number = sweep_dir, number
        self.overrides, self.run_dir = overrides, run_dir

    def done(self, objective: str, value: float) -> float | None:
        """Record the job's objective (trainer.objective) and return it to the sweeper; one
        that is not a number (e.g. a correlation of constant predictions) as None, as for a
        failed job."""
        self._record("ok", f"{objective} {value:.4f}", objective=objective,
                     objective_value=value)
        return value if math.isfinite(value) else None

    def failed(self, reason: str) -> None:
        """Record the failure. The job's value for the sweeper is None, not a number: Optuna's
        sweeper then records a failed trial and goes on (a NaN would stop it)."""
        self._record("failed", reason)

    def preempted(self, reason: str) -> None:
        self._record("preempted", reason)
        print_summary(self.sweep_dir, stopped_after=self.number)

    def _record(self, status: str, reason: str, **extra: Any) -> None:
        from flaxlm.distributed import is_primary  # JAX is imported once a job runs, not before

        if not is_primary():  # every host of a multi-host job runs it; one records it
            return
        lines = reason.strip().splitlines() or [""]
        record = {"job": self.number, "status": status, "reason": _shorten(lines[0]),
                  "overrides": self.overrides, "run_dir": self.run_dir, **extra}
        directory = os.path.join(self.sweep_dir, STATUS_SUBDIR)
        os.makedirs(directory, exist_ok=True)
        # Named by the job's folder: a continued Optuna study numbers its new jobs from 0 again.
        name = os.path.basename(os.path.normpath(self.run_dir)) or str(self.number)
        path = os.path.join(directory, f"{name}.json")
        with open(f"{path}.tmp", "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(f"{path}.tmp", path)


def job_statuses(sweep_dir: str) -> list[dict[str, Any]]:
    records = []
    for path in glob.glob(os.path.join(sweep_dir, STATUS_SUBDIR, "*.json")):
        with open(path, encoding="utf-8") as f:
            records.append(json.load(f))
    return sorted(records, key=lambda r: r["job"])


def print_summary(sweep_dir: str, stopped_after: int | None = None) -> bool:
    """Print one line per job of the sweep in `sweep_dir`; True if every job succeeded."""
    records = job_statuses(sweep_dir)
    counts = {s: sum(r["status"] == s for r in records) for s in ("ok", "failed", "preempted")}
    print(f"flaxlm: multirun in {sweep_dir}: " + ", ".join(
        f"{n} {status}" for status, n in counts.items() if n), flush=True)
    # Overrides that every job shares are left out: the rest is what sets a job apart.
    shared = set()
    if len(records) > 1:
        shared = set.intersection(*(set(r["overrides"]) for r in records))
    for r in records:
        own = " ".join(o for o in r["overrides"] if o not in shared)
        print(f"  #{r['job']} {r['status']:<9} {own or '(no overrides)'} | {r['reason']} | "
              f"run dir {r['run_dir']}", flush=True)
    if stopped_after is not None:
        print(f"flaxlm: the multirun stopped at job #{stopped_after} (preempted); the jobs after "
              "it were not started", flush=True)
    return counts["ok"] == len(records)


class HydraCallbacks(Callback):
    """Configured under `hydra.callbacks` (conf/hydra/default.yaml)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_writable(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = _check_writable(config.hydra.sweep.dir, "hydra.sweep.dir")
        # A sweep run again in the same folder reports only its own jobs.
        for path in glob.glob(os.path.join(sweep_dir, STATUS_SUBDIR, "*.json")):
            os.remove(path)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not print_summary(os.path.abspath(config.hydra.sweep.dir)):
            sys.exit(FAILED_EXIT_CODE)


def _check_writable(path: str, setting: str) -> str:
    try:
        return writable_dir(path, setting, f"Set {setting} to a directory you can write to.")
    except FlaxlmError as err:
        print(f"flaxlm: error: {err}", file=sys.stderr)
        sys.exit(2)


def _shorten(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
