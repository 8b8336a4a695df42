"""Experiment tracking behind one small interface: every metric goes to `metrics.jsonl` in the
run directory and, with `logger=wandb`, to a W&B run.

W&B runs online when the user is logged in (WANDB_API_KEY or `wandb login`), otherwise offline
inside the run directory, with one line on how to upload it later. Tests use a real offline run
and read the records back; nothing here needs a W&B server.
"""

from __future__ import annotations

import json
import netrc
import os
import time
from typing import Any, Mapping
from urllib.parse import urlparse

from flaxlm.config import LoggerConfig
from flaxlm.errors import FlaxlmError

_MODES = ("auto", "online", "offline", "disabled")


class Tracker:
    """Appends metrics to `<run_dir>/metrics.jsonl` and, if given, to a W&B run."""

    def __init__(self, run_dir: str, wandb_run=None):
        self.wandb_run = wandb_run
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        record = {k: _plain(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **record}) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        if self.wandb_run is not None:
            self.wandb_run.summary.update({k: _plain(v) for k, v in values.items()})

    def finish(self, exit_code: int = 0) -> None:
        """Close everything; a failed run is marked failed in W&B (exit code 1). Always call
        this, so that the next job of a multirun does not log into this job's W&B run."""
        self._jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None


def start_tracker(
    logger: LoggerConfig,
    run_dir: str,
    config: dict,
    *,
    name: str | None,
    group: str | None,
) -> Tracker:
    if not logger.wandb:
        return Tracker(run_dir)
    import wandb

    mode = resolve_mode(logger.mode)
    run = wandb.init(
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
