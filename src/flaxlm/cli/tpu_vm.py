"""`launcher=tpu-vm`: one `flaxlm-train` job run on every worker (host) of a TPU VM slice.

Hydra's launcher for it (hydra_plugins/flaxlm_tpu_vm_launcher) hands each job of a sweep here,
one job at a time: a slice runs one job. Everything that can be wrong before a worker starts is
checked first and is one paragraph (exit code 2): no `gcloud`, no slice name or zone, a slice
that `gcloud` does not know or that is not READY, distributed settings that cannot join the
slice's workers.

Each worker gets its own `gcloud compute tpus tpu-vm ssh NAME --worker=I --command ...` rather
than one `--worker=all`: gcloud interleaves the workers' output in that form and ends with one
exit status for all, while one session per worker keeps each worker's output and exit status
apart. Worker 0's output (process 0's: the progress lines, the summary) streams to the
terminal; every worker's is also kept in `<sweep dir>/.tpu-vm/<job>/worker-I.log`.

The workers run the job's overrides unchanged, as one run each (`launcher=local`) in the job's
run directory, so with `hardware.distributed.mode=auto` every worker runs the same command and
JAX numbers the workers from the TPU metadata. With `mode=explicit` the launcher gives each
worker its process id (and the process count, the slice's worker count).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from flaxlm.errors import FlaxlmError

LOG_SUBDIR = ".tpu-vm"  # in the sweep directory, as submitit's `.submitit`
PREEMPTED_EXIT_CODE = 75  # flaxlm-train's, after a checkpoint (flaxlm.training.stop)
# After one worker failed, how long the others get to end on their own beyond
# hardware.distributed.timeout_s (within which JAX notices a lost peer): Python's exit, a
# checkpoint that was being written.
STOP_SLACK_S = 60


@dataclasses.dataclass(frozen=True)
class Slice:
    """hydra.launcher.* of `launcher=tpu-vm` (hydra_plugins/flaxlm_tpu_vm_launcher/config.py)."""

    name: str | None
    zone: str | None
    project: str | None = None
    workdir: str = "flaxlm"  # on every worker, relative to the home directory
    train_command: str = ".venv/bin/flaxlm-train"  # a shell word or words, run in workdir
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    ssh_flags: tuple[str, ...] = ()  # more gcloud ssh flags: --internal-ip, -- -o ...
    gcloud: str = "gcloud"

    def where(self) -> list[str]:
        """The flags that name the slice to gcloud."""
        project = [f"--project={self.project}"] if self.project else []
        return [self.name, f"--zone={self.zone}", *project]


@dataclasses.dataclass(frozen=True)
class WorkerEnd:
    worker: int
    exit_code: int
    last_line: str
    log: str


def check_slice(settings: Slice) -> str:
    """The gcloud executable to use; a FlaxlmError when a setting is missing or gcloud is not
    installed."""
    missing = [key for key in ("name", "zone") if not getattr(settings, key)]
    if missing:
        raise FlaxlmError(
            "launcher=tpu-vm needs " + " and ".join(f"hydra.launcher.{key}" for key in missing)
            + ": the TPU VM slice to run on and its zone, as `gcloud compute tpus tpu-vm list "
            "--zone ZONE` shows them, e.g. hydra.launcher.name=flaxlm-v4-32 "
            "hydra.launcher.zone=us-central2-b (docs/scaling-out.md: TPU pod slices).")
    gcloud = shutil.which(settings.gcloud)
    if gcloud is None:
        raise FlaxlmError(
            f"launcher=tpu-vm runs the workers through Google Cloud's CLI, and "
            f"`{settings.gcloud}` is not on this machine's PATH. Install the Google Cloud SDK "
            "(https://cloud.google.com/sdk/docs/install) and run `gcloud auth login`, or set "
            "hydra.launcher.gcloud to its path.")
    return gcloud


def slice_workers(settings: Slice, gcloud: str) -> list[str]:
    """The slice's workers' internal addresses, in worker order, as gcloud describes the slice;
    a FlaxlmError when gcloud cannot or the slice is not READY."""
    argv = [gcloud, "compute", "tpus", "tpu-vm", "describe", *settings.where(), "--format=json"]
    try:
        described = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                   text=True, timeout=120)
    except subprocess.TimeoutExpired:
        described = None
    if described is None or described.returncode != 0:
        said = (" ".join(described.stderr.split())[-500:] if described is not None
                else "no answer within 120 s")
        raise FlaxlmError(
            f"launcher=tpu-vm: `{shlex.join(argv[1:])}` failed ({said}). Check "
            f"hydra.launcher.name={settings.name} and hydra.launcher.zone={settings.zone} "
            "against `gcloud compute tpus tpu-vm list --zone ZONE`, and that gcloud is logged "
            "in (`gcloud auth login`) to the slice's project (hydra.launcher.project).")
    try:
        slice_info = json.loads(described.stdout)
        state = slice_info.get("state", "READY")
        workers = [endpoint.get("ipAddress", "") for endpoint in slice_info["networkEndpoints"]]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise FlaxlmError(f"launcher=tpu-vm: gcloud described slice {settings.name} without "
                          f"its workers (networkEndpoints): {err}.") from None
    if state != "READY" or not workers:
        raise FlaxlmError(
            f"launcher=tpu-vm: slice {settings.name} in {settings.zone} is {state} with "
            f"{len(workers)} workers; a run needs it READY. A preempted slice is deleted and "
            "created again (`gcloud compute tpus tpu-vm delete`, then the same `create`); the "
            "same command then resumes the run from its last checkpoint.")
    return workers


def worker_overrides(job_overrides: Sequence[str], run_dir: str, distributed: dict,
                     addresses: Sequence[str]) -> list[list[str]]:
    """Each worker's `flaxlm-train` arguments: the job's overrides as one run (launcher=local,
    not this launcher again) in the job's run directory, and, with mode=explicit, its process
    id. `distributed` is the job's hardware.distributed; `addresses`, the workers'."""
    workers = len(addresses)
    shared = [o for o in job_overrides if not o.lstrip("+~").startswith("launcher=")]
    shared += ["launcher=local", f"hydra.run.dir={run_dir}"]
    mode = str(distributed.get("mode"))
    if mode == "off" and workers > 1:
        raise FlaxlmError(
            f"hardware.distributed.mode=off on a slice of {workers} workers: each would train "
            "alone, all in one run directory. Use hardware.distributed.mode=auto (the "
            "multi-host presets, e.g. hardware=tpu-v4-32, set it), with which JAX finds the "
            "slice's workers itself.")
    if mode != "explicit":
        return [shared for _ in range(workers)]
    count = distributed.get("num_processes")
    if count is not None and count != workers:
        raise FlaxlmError(
            f"hardware.distributed.num_processes={count}, but the slice has {workers} workers, "
            "each of which runs one process. Leave hardware.distributed.num_processes unset "
            "(launcher=tpu-vm sets it), or use hardware.distributed.mode=auto.")
    if not distributed.get("coordinator_address"):
        raise FlaxlmError(
            "hardware.distributed.mode=explicit needs hardware.distributed.coordinator_address: "
            f"worker 0's internal address and a free port, e.g. {addresses[0]}:8482. Or use "
            "hardware.distributed.mode=auto, with which JAX finds worker 0 itself.")
    return [[*shared, f"hardware.distributed.num_processes={workers}",
             f"hardware.distributed.process_id={worker}"] for worker in range(workers)]


def ssh_command(settings: Slice, gcloud: str, worker: int, overrides: Sequence[str]) -> list[str]:
    """The gcloud command that runs `flaxlm-train OVERRIDES` on one worker. Output unbuffered:
    it streams back through ssh as it is printed. --quiet: no prompt waits for an answer that
    cannot come (the sessions have no input); the user's flags last, so that `--` and ssh's own
    options (e.g. `-o ServerAliveInterval=60`) may end them."""
    variables = {**settings.env, "PYTHONUNBUFFERED": "1"}
    remote = " ".join([
        f"cd {shlex.quote(settings.workdir)} &&",
        *(f"{key}={shlex.quote(str(value))}" for key, value in variables.items()),
        settings.train_command, *map(shlex.quote, overrides)])
    return [gcloud, "compute", "tpus", "tpu-vm", "ssh", *settings.where(), f"--worker={worker}",
            "--quiet", f"--command={remote}", *settings.ssh_flags]


def run_workers(commands: Sequence[Sequence[str]], log_dir: str, stop_after_s: float,
                out: IO[str] | None = None) -> list[WorkerEnd]:
    """Run one command per worker at once; worker 0's output goes to `out` as it comes, every
    worker's to `log_dir/worker-I.log`. Once a worker failed, the others get `stop_after_s`
    to end on their own (their peers lost, they stop) before their ssh sessions are ended."""
    os.makedirs(log_dir, exist_ok=True)
    logs = [os.path.join(log_dir, f"worker-{worker}.log") for worker in range(len(commands))]
    files = [open(path, "w", encoding="utf-8") for path in logs]
    processes, streams = [], []
    try:
        for worker, (command, log) in enumerate(zip(commands, files)):
            streamed = worker == 0
            processes.append(subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                stdout=subprocess.PIPE if streamed else log, text=True, errors="replace"))
            if streamed:
                streams.append(threading.Thread(
                    target=_tee, args=(processes[0].stdout, out or sys.stdout, log), daemon=True))
                streams[0].start()
        _wait(processes, stop_after_s)
        for stream in streams:
            stream.join(timeout=30)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in files:
            log.close()
    return [WorkerEnd(worker, process.returncode, _last_line(log), log)
            for worker, (process, log) in enumerate(zip(processes, logs))]


def _tee(source: IO[str], out: IO[str], log: IO[str]) -> None:
    for line in source:
        out.write(line)
        out.flush()
        log.write(line)
        log.flush()


def _wait(processes: list[subprocess.Popen], stop_after_s: float) -> None:
    deadline, terminated = None, False
    while any(process.poll() is None for process in processes):
        if deadline is None and any(process.poll() not in (None, 0) for process in processes):
            deadline = time.monotonic() + stop_after_s
        if deadline is not None and time.monotonic() > deadline:
            for process in processes:
                if process.poll() is None and terminated:
                    process.kill()
                elif process.poll() is None:
                    process.terminate()
            deadline, terminated = time.monotonic() + 30, True
        time.sleep(0.2)


def _last_line(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def outcome(ends: Sequence[WorkerEnd], slice_name: str) -> tuple[str, str]:
    """The job's status (ok / preempted / failed, as flaxlm.layout names them) and its reason:
    worker 0's summary line, or the workers that failed, each with its last line and log."""
    from flaxlm.layout import JOB_FAILED, JOB_OK, JOB_PREEMPTED

    failed = [end for end in ends if end.exit_code not in (0, PREEMPTED_EXIT_CODE)]
    if failed:
        return JOB_FAILED, "; ".join(
            f"worker {end.worker} of {len(ends)} on slice {slice_name} exited {end.exit_code}: "
            f"{end.last_line} (its output: {end.log})" for end in failed)
    if any(end.exit_code == PREEMPTED_EXIT_CODE for end in ends):
        return JOB_PREEMPTED, f"stopped on slice {slice_name}: {ends[0].last_line}"
    # Worker 0's summary (`flaxlm: done in ... | run dir D`) without the run dir, which the
    # sweep's summary names itself.
    return JOB_OK, ends[0].last_line.split(" | run dir ")[0]
