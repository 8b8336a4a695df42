"""What a run directory records as it goes, read back the same way by every reader: its
`metrics.jsonl` and its `status.json` (how the run ended, or that it is running); and what a
sweep directory records of its jobs (`job-status/`, see flaxlm.layout).

One policy for metrics.jsonl, wherever it is read (resume, the objective handed to a sweeper,
the report, an export's model card): a last line that is not a whole JSON object is what a run
killed while writing, or a copy cut short, leaves; it is skipped with a one-line warning and
the records before it are whole. Such a line anywhere else cannot come from a kill: the file
was damaged, and that is an error naming the file and the line.

Nothing here needs JAX or the network: the report reads run directories on any machine.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import socket
import sys
import time
from typing import Any

from flaxlm.errors import FlaxlmError
from flaxlm.layout import JOB_STATUS_SUBDIR, STATUS_FILE, run_path

# status.json's `status`: "running" from the start until the run ends with one of the others.
RUNNING, FINISHED, PREEMPTED, FAILED = "running", "finished", "preempted", "failed"
END_STATES = (FINISHED, PREEMPTED, FAILED)


@dataclasses.dataclass(frozen=True)
class MetricsLog:
    """metrics.jsonl read back: its whole records, and the number of a cut-off last line that
    was skipped (None when the file ends whole)."""

    records: list[dict[str, Any]]
    torn_line: int | None = None


def read_metrics(path: str) -> MetricsLog:
    """The records of the metrics.jsonl at `path` (none if there is no such file). A cut-off
    last line is skipped with a warning on stderr; any other line that is not a JSON object is
    a FlaxlmError naming the file and the line."""
    if not os.path.isfile(path):
        return MetricsLog([])
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    records = []
    for index, (number, line) in enumerate(lines):
        record = _record(line)
        if record is None and index == len(lines) - 1:
            _warn(f"{path}, line {number} (the last), was cut off mid-line (a run stopped while "
                  "writing it, or a copy cut short); it is skipped, the lines before it are read")
            return MetricsLog(records, torn_line=number)
        if record is None:
            raise FlaxlmError(
                f"{path}, line {number}, is not a JSON object: the file was damaged (only its "
                "last line can be cut off by a stopped run), or it is not a flaxlm metrics.jsonl. "
                f"Remove or repair line {number} (e.g. from a backup), or leave this run out."
            )
        records.append(record)
    return MetricsLog(records)


def _record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def write_status(run_dir: str, status: str, reason: str = "") -> None:
    """Record in `run_dir` that the run is running, or how it ended (one of END_STATES, and
    why), for the report to read back from the directory alone, wherever it was copied. The
    host and process id let a reader on the same machine tell a run still running from one
    killed outright (which records nothing). Written to a temporary name and renamed into
    place; a write that fails (a full disk, the reason the run is ending) is one warning, never
    an error that hides the run's own."""
    path = run_path(run_dir, STATUS_FILE)
    record = {"status": status, "reason": reason.strip().splitlines()[0] if reason.strip() else "",
              "time": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
    try:
        with open(f"{path}.tmp", "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(f"{path}.tmp", path)
    except OSError as err:
        _warn(f"could not record the run's status ({status}) in {path}: {err.strerror or err}")


def read_status(run_dir: str) -> dict[str, Any] | None:
    """The run's status.json (see `write_status`); None if it has none or it is unreadable
    (then the reader falls back on what else the directory holds). A run recorded as running
    whose process is gone from this machine is returned as `killed`."""
    try:
        with open(run_path(run_dir, STATUS_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("status"), str):
        return None
    if record["status"] == RUNNING and _gone(record):
        return {**record, "status": "killed",
                "reason": "it stopped without recording how (killed outright, or out of memory)"}
    return record


def _gone(record: dict[str, Any]) -> bool:
    """Whether the process that recorded itself running is known to be gone: only a process
    of this machine can be checked."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # someone else's process: alive
        return False
    return False


def plain(value: Any) -> Any:
    """numpy / JAX scalars, and dicts and lists of them, as plain Python: what JSON, YAML and
    W&B take."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value.item() if hasattr(value, "item") else value


# ---------------------------------------------------------------- a sweep's job statuses


def job_status_record(job: int, status: str, reason: str, overrides: list[str], run_dir: str,
                      **extra: Any) -> dict[str, Any]:
    """A job status file's content (see flaxlm.layout): the reason's first line, shortened."""
    lines = reason.strip().splitlines() or [""]
    return {"job": job, "status": status, "reason": _shorten(lines[0]),
            "overrides": overrides, "run_dir": run_dir, **extra}


def write_job_status(path: str, record: dict[str, Any]) -> None:
    """Write a job status file (`layout.job_status_path`), renamed into place."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # A name of its own for the temporary file: before the processes of a multi-host job
    # have joined, each of them takes itself for process 0.
    temporary = f"{path}.{socket.gethostname()}-{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(temporary, path)


def read_job_statuses(sweep_dir: str) -> dict[str, dict[str, Any]]:
    """Each job status file's record in `sweep_dir`, by file path (a file that is not JSON is
    a ValueError)."""
    records = {}
    for path in _job_status_files(sweep_dir):
        with open(path, encoding="utf-8") as f:
            records[path] = json.load(f)
    return records


def job_statuses(sweep_dir: str) -> list[dict[str, Any]]:
    """The job status records of the sweep in `sweep_dir`, by job number."""
    return sorted(read_job_statuses(sweep_dir).values(), key=lambda r: r["job"])


def job_status_times(sweep_dir: str) -> dict[str, int]:
    """Each job status file's modification time (ns), by path: what an invocation finds when
    it starts tells its own jobs' files (new or rewritten since) from earlier invocations'."""
    return {path: os.stat(path).st_mtime_ns for path in _job_status_files(sweep_dir)}


def _job_status_files(sweep_dir: str) -> list[str]:
    return glob.glob(os.path.join(sweep_dir, JOB_STATUS_SUBDIR, "*.json"))


def _shorten(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _warn(message: str) -> None:
    print(f"flaxlm: warning: {message}", file=sys.stderr, flush=True)
