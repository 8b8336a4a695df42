"""Experiment tracking behind one small interface: every metric goes to `metrics.jsonl` in the
run directory and, with `logger=wandb`, to a W&B run, with `logger=tensorboard` to TensorBoard
event files in the run directory (both: `logger=[wandb,tensorboard]`). On several hosts only
process 0 tracks; the others' tracker does nothing, so the run has one metrics.jsonl, one W&B
run and one set of event files.

W&B runs online when the user is logged in (WANDB_API_KEY or `wandb login`), otherwise offline
inside the run directory, with one line on how to upload it later. Tests use a real offline run
and read the records back; nothing here needs a W&B server.
"""

from __future__ import annotations

import json
import netrc
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

from flaxlm import distributed
from flaxlm.config import LoggerConfig, dotted
from flaxlm.errors import FlaxlmError
from flaxlm.layout import METRICS_FILE, TENSORBOARD_SUBDIR, TOKENS_SEEN, run_path
from flaxlm.run_records import plain, read_metrics

_MODES = ("auto", "online", "offline", "disabled")
STEP_AXIS = "step"  # the training step, logged with every W&B row as the charts' x axis


class Tracker:
    """Appends metrics to `<run_dir>/metrics.jsonl` and, if given, to a W&B run and TensorBoard;
    with run_dir None (a process other than 0) it records nothing."""

    def __init__(self, run_dir: str | None, wandb_run=None,
                 tensorboard: TensorBoard | None = None, objective: str | None = None):
        self.wandb_run = wandb_run
        self.tensorboard = tensorboard
        self.objective = objective  # W&B keeps its best value as the summary; see `summary`
        self._path = run_path(run_dir, METRICS_FILE) if run_dir is not None else None
        self._jsonl = open(self._path, "a", buffering=1) if self._path is not None else None
        # Called after an evaluation's record is written (a bucket run copies its files then).
        self.after_evaluation: Callable[[], None] | None = None

    def rewind(self, step: int, evaluates_again: bool = False) -> int:
        """Drop the metrics.jsonl records after `step` (those of a run that was killed after
        its last checkpoint, and a cut-off last line): a resumed run then continues the file
        exactly as the uninterrupted run wrote it. `evaluates_again`: the resumed run evaluates
        `step` again (a stop cut that evaluation short), so an evaluation logged at `step` by
        an earlier resume goes too. Returns how many lines were dropped. (A W&B run keeps what
        it was sent; it ignores steps logged again.)"""
        if self._jsonl is None:
            return 0
        self._jsonl.close()
        log = read_metrics(self._path)

        def kept_on_resume(record: dict) -> bool:
            evaluation = any(key.startswith("eval/") for key in record)
            return record.get("step", 0) < step or (
                record.get("step", 0) == step and not (evaluates_again and evaluation))

        kept = [json.dumps(record) + "\n" for record in log.records if kept_on_resume(record)]
        dropped = len(log.records) - len(kept) + (log.torn_line is not None)
        temporary = f"{self._path}.tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(temporary, self._path)
        self._jsonl = open(self._path, "a", buffering=1)
        if self.tensorboard is not None:
            self.tensorboard.rewind(step)
        return dropped

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self._log(metrics, step, wandb_step=step)

    def log_after_the_run(self, metrics: Mapping[str, Any], step: int) -> None:
        """`log` for metrics of an earlier step, computed after the run (flaxlm-eval): W&B
        refuses a step lower than the run's last, so its row carries the step only as the
        charts' x axis (`STEP_AXIS`)."""
        self._log(metrics, step, wandb_step=None)

    def _log(self, metrics: Mapping[str, Any], step: int, wandb_step: int | None) -> None:
        if self._jsonl is None:
            return
        record = {k: plain(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **record}) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({**record, STEP_AXIS: step}, step=wandb_step)
        if self.tensorboard is not None:
            self.tensorboard.log(record, step)
        if self.after_evaluation is not None and any(key.startswith("eval/") for key in record):
            self.after_evaluation()

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                  step: int) -> None:
        """A small table (e.g. generated samples): one metrics.jsonl record whose `key` holds
        the rows as {column: value} dicts, a `wandb.Table` in the W&B run, a Markdown table in
        TensorBoard's text tab."""
        if self._jsonl is None:
            return
        records = [{c: plain(v) for c, v in zip(columns, row)} for row in rows]
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), key: records}) + "\n")
        if self.wandb_run is not None:
            import wandb

            table = wandb.Table(columns=list(columns), data=[list(row) for row in rows])
            self.wandb_run.log({key: table}, step=step)
        if self.tensorboard is not None:
            self.tensorboard.text(key, _markdown_table(columns, rows), step)

    def summary(self, values: Mapping[str, Any]) -> None:
        """End-of-run values for the W&B summary, all but the objective's: its summary stays
        the best value over the run (declared at start), which sweeps compare runs by."""
        if self.wandb_run is not None:
            self.wandb_run.summary.update({k: plain(v) for k, v in values.items()
                                           if k != self.objective})

    def finish(self, exit_code: int = 0, preempted: bool = False) -> None:
        """Close everything; a failed run is marked failed in W&B (exit code 1), a preempted
        one (stopped by a signal after saving a checkpoint) as preempting, so W&B shows it as
        resumable. Always call this, so that the next job of a multirun does not log into this
        job's W&B run."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.finish(exit_code, preempted)
            self.tensorboard = None
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
    objective: str | None = None,
    maximize: bool = False,
) -> Tracker:
    """`config` is the resolved config plus `choices` (the option picked in each config group).
    `run_id` names the W&B run: the same id continues the same run (a resumed training run
    passes the id it stored in its run directory). `objective` (the metric a sweep optimises,
    higher better if `maximize`) gets its best value so far as its W&B summary. On a process
    other than 0: a tracker that records nothing."""
    if not distributed.is_primary():
        return Tracker(None)
    wandb_run = None
    if logger.wandb:
        wandb_run = _start_wandb(logger, run_dir, config, name, group, run_id)
        if objective is not None:
            wandb_run.define_metric(objective, step_metric=STEP_AXIS,
                                    summary="max" if maximize else "min")
    tensorboard = TensorBoard(run_dir, config) if logger.tensorboard else None
    return Tracker(run_dir, wandb_run, tensorboard, objective)


def _start_wandb(logger: LoggerConfig, run_dir: str, config: dict, name: str | None,
                 group: str | None, run_id: str | None):
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
        job_type=config.get("task", {}).get("name"),
        tags=[*logger.tags, *choice_tags(config.get("choices", {})), *language_tags(config)],
        notes=logger.notes,
        config=config,
        reinit="finish_previous",
    )
    # The training step as a declared x axis (logged in every row): train and eval metrics,
    # logged at different cadences, line up on it in every chart and in sweep comparisons.
    run.define_metric(STEP_AXIS)
    run.define_metric(TOKENS_SEEN)  # a second x axis to pick in the charts
    for pattern in ("train/*", "eval/*", "epoch"):
        run.define_metric(pattern, step_metric=STEP_AXIS)
    if mode == "offline":
        print(
            f"W&B is offline; upload this run later with: "
            f"wandb sync {os.path.join(run_dir, 'wandb', 'offline-run-*')}"
        )
    return run


def choice_tags(choices: Mapping[str, Any]) -> list[str]:
    """`group=option` for every config group with an option picked (`model=gpt2-tiny`,
    `experiment=oscar-is-distilgpt2`): W&B tags to filter runs by."""
    return [f"{group}={option}" for group, option in choices.items() if option is not None]


def language_tags(config: Mapping[str, Any]) -> list[str]:
    """`language=<name>` for every language a mixture run mixes (its option, `language=
    mixture` or a preset's name, is already a choice tag)."""
    sources = (config.get("mixture") or {}).get("sources") or {}
    return [f"language={name}" for name in sources]


class TensorBoard:
    """Event files in `<run_dir>/tensorboard/`: the resolved config as text and the run's
    hyperparameters (HParams tab) at start, then every numeric metric as a scalar at its step
    and tables as Markdown text. The hyperparameters are written as a session of their own, so
    `tensorboard --logdir <multirun dir>` puts a sweep's trials in one table."""

    def __init__(self, run_dir: str, config: Mapping[str, Any]):
        from omegaconf import OmegaConf
        from tensorboardX import SummaryWriter
        from tensorboardX.summary import hparams

        self._writer = SummaryWriter(run_path(run_dir, TENSORBOARD_SUBDIR), flush_secs=30)
        self._writer.add_text("config", _code_block(OmegaConf.to_yaml(dict(config))), 0)
        _, session_start, _ = hparams(hyperparameters(config), {})
        # The raw file writer: SummaryWriter.add_hparams would open a second run beside this one.
        self._writer._get_file_writer().add_summary(session_start)

    def rewind(self, step: int) -> None:
        """A resumed run: TensorBoard drops what the killed run logged after `step` (a session
        restart, which TensorBoard's readers take as "forget steps from here on")."""
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        restart = Event(step=step + 1, session_log=SessionLog(status=SessionLog.START))
        self._writer._get_file_writer().add_event(restart)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, step)

    def text(self, key: str, text: str, step: int) -> None:
        self._writer.add_text(key, text, step)

    def finish(self, exit_code: int, preempted: bool) -> None:
        status = ("STATUS_SUCCESS" if exit_code == 0 else
                  "STATUS_RUNNING" if preempted else "STATUS_FAILURE")
        self._writer._get_file_writer().add_summary(_session_end(status))
        self._writer.close()


def hyperparameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config's leaves as `a.b.c: value` for TensorBoard's HParams: numbers, strings and
    booleans as they are, lists as text; unset (null) values left out."""
    return {key: json.dumps(value) if isinstance(value, (list, tuple)) else value
            for key, value in dotted(dict(config)).items() if value is not None}


def _session_end(status: str):
    """TensorBoard's HParams record that closes a session, with how it ended."""
    from tensorboardX.proto.api_pb2 import Status
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData, SessionEndInfo
    from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata

    content = HParamsPluginData(session_end_info=SessionEndInfo(status=Status.Value(status)),
                                version=0)
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
        plugin_name="hparams", content=content.SerializeToString()))
    return Summary(value=[Summary.Value(tag="_hparams_/session_end_info", metadata=metadata)])


def _markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return str(plain(value)).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _code_block(text: str) -> str:
    """Preformatted in TensorBoard's Markdown text view."""
    return "\n".join("    " + line for line in text.splitlines())


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
