"""Experiment tracking behind one small interface: every metric goes to `metrics.jsonl` in the
run directory and, with `logger=wandb`, to a W&B run. On several hosts only process 0 tracks;
the others' tracker does nothing, so the run has one metrics.jsonl and one W&B run.

W&B runs online when the user is logged in (WANDB_API_KEY or `wandb login`), otherwise offline
inside the run directory, with one line on how to upload it later. Tests use a real offline run
and read the records back; nothing here needs a W&B server.
"""

from __future__ import annotations

import json
import netrc
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

from flaxlm import distributed
from flaxlm.config import LoggerConfig
from flaxlm.errors import FlaxlmError
from flaxlm.layout import METRICS_FILE, run_path

_MODES = ("auto", "online", "offline", "disabled")


class Tracker:
    """Appends metrics to `<run_dir>/metrics.jsonl` and, if given, to a W&B run; with
    run_dir None (a process other than 0) it records nothing."""

    def __init__(self, run_dir: str | None, wandb_run=None):
        self.wandb_run = wandb_run
        self._path = run_path(run_dir, METRICS_FILE) if run_dir is not None else None
        self._jsonl = open(self._path, "a", buffering=1) if self._path is not None else None

    def rewind(self, step: int) -> int:
        """Drop the metrics.jsonl lines after `step` (those of a run that was killed after its
        last checkpoint, and a half-written last line): a resumed run then continues the file
        exactly as the uninterrupted run wrote it. Returns how many lines were dropped. (A W&B
        run keeps what it was sent; it ignores steps logged again.)"""
        if self._jsonl is None:
            return 0
        self._jsonl.close()
        kept, dropped = [], 0
        with open(self._path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                if record is None or not line.endswith("\n") or record.get("step", 0) > step:
                    dropped += 1
                else:
                    kept.append(line)
        temporary = f"{self._path}.tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(temporary, self._path)
        self._jsonl = open(self._path, "a", buffering=1)
        return dropped

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self._jsonl is None:
            return
        record = {k: _plain(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **record}) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=step)

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                  step: int) -> None:
        """A small table (e.g. generated samples): one metrics.jsonl record whose `key` holds
        the rows as {column: value} dicts, and a `wandb.Table` in the W&B run."""
        if self._jsonl is None:
            return
        records = [{c: _plain(v) for c, v in zip(columns, row)} for row in rows]
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), key: records}) + "\n")
        if self.wandb_run is not None:
            import wandb

            table = wandb.Table(columns=list(columns), data=[list(row) for row in rows])
            self.wandb_run.log({key: table}, step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        if self.wandb_run is not None:
            self.wandb_run.summary.update({k: _plain(v) for k, v in values.items()})

    def finish(self, exit_code: int = 0, preempted: bool = False) -> None:
        """Close everything; a failed run is marked failed in W&B (exit code 1), a preempted
        one (stopped by a signal after saving a checkpoint) as preempting, so W&B shows it as
        resumable. Always call this, so that the next job of a multirun does not log into this
        job's W&B run."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self.wandb_run is not None:
            if preempted:
                self.wandb_run.mark_preempting()
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None


def start_tracker(
    logger: LoggerConfig,
    run_dir: str,
    config: dict,
    *,
    name: str | None,
    group: str | None,
    run_id: str | None = None,
) -> Tracker:
    """`run_id` names the W&B run: the same id continues the same run (a resumed training
    run passes the id it stored in its run directory). On a process other than 0: a tracker
    that records nothing."""
    if not distributed.is_primary():
        return Tracker(None)
    if not logger.wandb:
        return Tracker(run_dir)
    import wandb

    mode = resolve_mode(logger.mode)
    run = wandb.init(
        id=run_id,
        resume="allow" if run_id else None,
        project=logger.project,
        entity=logger.entity,
        dir=run_dir,
        mode=mode,
        name=name,
        group=group,
        tags=list(logger.tags),
        notes=logger.notes,
        config=config,
        reinit="finish_previous",
    )
    if mode == "offline":
        print(
            f"W&B is offline; upload this run later with: "
            f"wandb sync {os.path.join(run_dir, 'wandb', 'offline-run-*')}"
        )
    return Tracker(run_dir, run)


def resolve_mode(mode: str) -> str:
    """`auto` → WANDB_MODE if set, else online when logged in, else offline."""
    if mode not in _MODES:
        raise FlaxlmError(f"logger.mode={mode!r} is not one of {list(_MODES)}.")
    if mode != "auto":
        return mode
    return os.environ.get("WANDB_MODE") or ("online" if logged_in_to_wandb() else "offline")


def logged_in_to_wandb() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return entry is not None and bool(entry[2])  # (login, account, password=API key)


def _plain(value: Any) -> Any:
    """numpy / JAX scalars as Python numbers, for JSON and W&B."""
    return value.item() if hasattr(value, "item") else value
