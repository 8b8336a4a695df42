"""What `flaxlm-train` adds to Hydra around its jobs: a clear error when Hydra's output folder
cannot be written, and, for a multirun, one status file per job and a summary at the end.

A job of a multirun that fails records why and the sweep goes on with the next job; the
summary then lists every job (ok / failed with the reason / preempted) with its run directory,
and the command exits 1 if any failed. The statuses are files in the sweep directory
(`<sweep dir>/job-status/<job folder>.json`, see flaxlm.layout), not state in this process,
so a launcher that runs jobs elsewhere (submitit) reports the same way. A preempted job stops
the sweep: the machine is being taken away, so the jobs after it are not started.

The same sweep run again in its directory (a continued Optuna study) keeps the earlier
invocations' status files; its summary and exit code are about its own jobs. A job records
"running" when it starts: one still running when the sweep starts again was cut off by a
sweep that was killed, and is recorded as failed, with the command that resumes its run.
Every invocation holds a shared lock on the sweep directory while it runs, so that only one
that runs alone there takes such records (and an Optuna study's running trials) for dead.
"""

from __future__ import annotations

import fcntl
import math
import os
import shlex
import sys
import time
from collections.abc import Mapping
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from flaxlm.cli.optuna_study import continue_study, is_optuna
from flaxlm.errors import FlaxlmError, writable_dir
from flaxlm.layout import (
    JOB_FAILED,
    JOB_OK,
    JOB_PREEMPTED,
    JOB_RUNNING,
    JOB_STATUS_SUBDIR,
    SWEEP_LOCK_FILE,
    job_status_path,
)
from flaxlm.run_records import (
    job_status_record,
    job_status_times,
    read_job_statuses,
    write_job_status,
)

FAILED_EXIT_CODE = 1
LOCK_WAIT_S = 60  # another invocation holds the lock exclusively only while it tidies up


class SweepJob:
    """The status file of one multirun job (its format: flaxlm.layout), written as it starts and
    once it ends."""

    def __init__(self, sweep_dir: str, number: int, overrides: list[str], run_dir: str):
        self.sweep_dir, self.number = sweep_dir, number
        self.overrides, self.run_dir = overrides, run_dir

    def started(self) -> None:
        """Record that the job runs: a record left "running" names a job the sweep was killed in."""
        self._record(JOB_RUNNING, "started")

    def done(self, objective: str, value: float) -> float | None:
        """Record the job's objective (trainer.objective) and return it to the sweeper; one
        that is not a number (e.g. a correlation of constant predictions) as None, as for a
        failed job."""
        self._record(JOB_OK, f"{objective} {value:.4f}", objective=objective,
                     objective_value=value)
        return value if math.isfinite(value) else None

    def failed(self, reason: str) -> None:
        """Record the failure. The job's value for the sweeper is None, not a number: Optuna's
        sweeper then records a failed trial and goes on (a NaN would stop it)."""
        self._record(JOB_FAILED, reason)

    def preempted(self, reason: str) -> None:
        self._record(JOB_PREEMPTED, reason)
        print_summary(self.sweep_dir, stopped_after=self.number)

    def _record(self, status: str, reason: str, **extra: Any) -> None:
        from flaxlm.distributed import is_primary  # JAX is imported once a job runs, not before

        if not is_primary():  # every host of a multi-host job runs it; one records it
            return
        write_job_status(
            job_status_path(self.sweep_dir, self.run_dir, self.number),
            job_status_record(self.number, status, reason, self.overrides, self.run_dir,
                              **extra))


def print_summary(sweep_dir: str, stopped_after: int | None = None,
                  earlier: Mapping[str, int] | None = None) -> bool:
    """Print one line per job of the sweep in `sweep_dir`, leaving out the status files of
    earlier invocations (`earlier`: `job_status_times` when this one started); True if every
    job succeeded."""
    earlier = earlier or {}
    records, left_out = [], 0
    for path, record in read_job_statuses(sweep_dir).items():
        if earlier.get(path) == os.stat(path).st_mtime_ns:
            left_out += 1
        else:
            records.append(record)
    records.sort(key=lambda r: r["job"])
    counts = {s: sum(r["status"] == s for r in records)
              for s in (JOB_OK, JOB_FAILED, JOB_PREEMPTED)}
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
    if left_out:
        print(f"  (not shown: {left_out} job(s) of earlier invocations in this directory, "
              f"see {os.path.join(sweep_dir, JOB_STATUS_SUBDIR)})", flush=True)
    if stopped_after is not None:
        print(f"flaxlm: the multirun stopped at job #{stopped_after} (preempted); the jobs after "
              "it were not started", flush=True)
    return counts[JOB_OK] == len(records)


class HydraCallbacks(Callback):
    """Configured under `hydra.callbacks` (conf/hydra/default.yaml)."""

    def __init__(self) -> None:
        self.earlier: dict[str, int] = {}  # status files of earlier invocations
        self.lock: int | None = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_writable(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = _check_writable(config.hydra.sweep.dir, "hydra.sweep.dir")
        self.lock, alone = _lock_sweep_dir(sweep_dir)
        try:
            if alone:
                _fail_interrupted_jobs(sweep_dir)
            # Before Hydra builds the sweeper from this config: it reads the seed then.
            if is_optuna(config.hydra.sweeper):
                continue_study(config.hydra.sweeper, alone)
        finally:
            _share_lock(self.lock, sweep_dir)
        self.earlier = job_status_times(sweep_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        ok = print_summary(os.path.abspath(config.hydra.sweep.dir), earlier=self.earlier)
        if self.lock is not None:
            os.close(self.lock)  # closing drops the flock
            self.lock = None
        if not ok:
            sys.exit(FAILED_EXIT_CODE)


def _lock_sweep_dir(sweep_dir: str) -> tuple[int, bool]:
    """The lock file's descriptor, and whether this invocation is alone in the directory (then
    it holds the lock exclusively, until `_share_lock`)."""
    descriptor = os.open(os.path.join(sweep_dir, SWEEP_LOCK_FILE), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return descriptor, True
    except BlockingIOError:
        return descriptor, False


def _share_lock(descriptor: int, sweep_dir: str) -> None:
    """Hold the lock shared for as long as this invocation runs: other invocations may run
    beside it, but none takes its running jobs for dead."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(descriptor)
                print(f"flaxlm: error: another process has held {sweep_dir}/{SWEEP_LOCK_FILE} "
                      f"for over {LOCK_WAIT_S} s. Wait for the other flaxlm-train in "
                      f"hydra.sweep.dir={sweep_dir} to start its jobs, or use another "
                      "hydra.sweep.dir.", file=sys.stderr, flush=True)
                sys.exit(2)
            time.sleep(0.5)


def _fail_interrupted_jobs(sweep_dir: str) -> None:
    """Record as failed the jobs still "running" although no invocation runs in the directory:
    the sweep was killed while they ran. A run with a checkpoint can be resumed by hand."""
    from flaxlm.runs import has_checkpoint  # here: the callbacks load before JAX is configured

    for path, record in read_job_statuses(sweep_dir).items():
        if record["status"] != JOB_RUNNING:
            continue
        run_dir = record["run_dir"]
        reason = "the sweep was stopped while this job ran"
        if has_checkpoint(run_dir):
            command = shlex.join(["flaxlm-train", *record["overrides"], f"resume_from={run_dir}"])
            reason += f"; its checkpoint continues with: {command}"
        write_job_status(path, {**record, "status": JOB_FAILED, "reason": reason})
        print(f"flaxlm: job #{record['job']} ({run_dir}): {reason}", flush=True)


def _check_writable(path: str, setting: str) -> str:
    try:
        return writable_dir(path, setting, f"Set {setting} to a directory you can write to.")
    except FlaxlmError as err:
        print(f"flaxlm: error: {err}", file=sys.stderr)
        sys.exit(2)

