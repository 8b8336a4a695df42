"""A sweep's runs side by side, from what their run directories hold: each run's saved config
(`config.yaml`), its `metrics.jsonl` and its `status.json`. Nothing here needs the network, JAX
or W&B, so a report can be made on any machine that holds a copy of the directories.

A report is a table (one row per run: the settings that differ between the runs, the final and
best evaluation metrics, steps, tokens, wall time, status) sorted by an objective, and PNG plots:
the loss curves of every run, the objective against each numeric setting that differs, and,
for runs that logged it (eval.position_buckets), the held-out loss by position in the document.

A run's status is what its directory recorded (running, finished, preempted, failed; killed
when it recorded running and its process is gone from this machine), else its sweep's job
status, else `finished` when it reached trainer.max_steps, else `unknown`. A run whose files
cannot be read is a row marked `damaged`, with the reason below the table; the other runs are
reported as usual.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import yaml

from flaxlm.config import dotted, upgrade_saved_config
from flaxlm.errors import FlaxlmError
from flaxlm.layout import (
    CONFIG_FILE,
    JOB_FAILED,
    JOB_OK,
    JOB_PREEMPTED,
    METRICS_FILE,
    STATUS_FILE,
    TOKENS_SEEN,
    run_path,
)
from flaxlm.run_records import job_statuses, read_metrics, read_status
from flaxlm.storage import is_url

# Metrics where lower is better; every other eval metric (accuracy, F1, correlations) is better
# higher. Perplexity and bits per byte are the loss again in other units, so the table skips them
# (a mixture's per-language figures, eval/<language>/loss and .../bits_per_byte, it shows: bits
# per byte is what compares the languages).
LOWER_IS_BETTER = ("eval/loss", "eval/perplexity", "eval/bits_per_byte")
DERIVED_FROM_LOSS = ("eval/perplexity", "eval/bits_per_byte")
# Settings every run has its own value of, whatever the sweep changed.
PER_RUN_KEYS = ("run_dir", "resume_from")
# A sweep job's status file (written by flaxlm-train's multirun callbacks) → the report's word.
STATUS_WORDS = {JOB_OK: "finished", JOB_FAILED: "failed", JOB_PREEMPTED: "preempted"}
DAMAGED = "damaged"
CURVES_FILE = "curves.png"
# The held-out loss by position in the document (eval.position_buckets), where a run logged it.
POSITIONS_FILE = "positions.png"
POSITION_LOSS = re.compile(r"^eval/position/(\d+)-(\d+)/loss$")
REPORT_FILE = "report.md"
PLOT_DPI = 80  # readable on a screen, small enough to keep beside the runs


@dataclasses.dataclass
class Run:
    """One run directory as read back: its flattened config, its metric records, its status
    (and why, where the run recorded a reason)."""

    path: str
    name: str
    config: dict[str, Any]
    records: list[dict[str, Any]]
    status: str = "unknown"
    reason: str = ""

    def series(self, key: str, axis: str = "step") -> list[tuple[float, float]]:
        """(x, value) for every record that logged `key` as a number, x being its `axis`
        (`step`, or `tokens_seen`)."""
        return [(r[axis], float(r[key])) for r in self.records
                if _is_number(r.get(key)) and _is_number(r.get(axis))]

    def last(self, key: str) -> float | None:
        values = self.series(key)
        return values[-1][1] if values else None

    def best(self, key: str, maximize: bool) -> float | None:
        values = [v for _, v in self.series(key) if not math.isnan(v)]
        if not values:
            return None
        return max(values) if maximize else min(values)

    @property
    def steps(self) -> int | None:
        return max((r["step"] for r in self.records if "step" in r), default=None)

    @property
    def tokens_seen(self) -> int | None:
        values = [r[TOKENS_SEEN] for r in self.records if _is_number(r.get(TOKENS_SEEN))]
        return int(max(values)) if values else None

    @property
    def wall_time_s(self) -> float | None:
        times = [r["time"] for r in self.records if _is_number(r.get("time"))]
        return times[-1] - times[0] if len(times) > 1 else None


def collect_runs(paths: Sequence[str]) -> list[Run]:
    """The runs named by `paths`: each a run directory, or a multirun directory whose numbered
    job folders are runs (with their job statuses). Damaged runs
    are among them (status `damaged`); if no run has a metric to report, that is an error."""
    runs: list[Run] = []
    for path in paths:
        if is_url(path):
            runs.extend(read_bucket_runs(path))
        elif is_run_dir(path):
            runs.append(read_run(path, os.path.basename(os.path.normpath(path))))
        elif _job_dirs(path):
            runs.extend(_read_multirun(path, _sweep_statuses(path)))
        else:
            what = "does not exist" if not os.path.exists(path) else (
                f"is neither a run directory (no {CONFIG_FILE} and {METRICS_FILE}) nor a "
                "multirun directory (numbered job folders)")
            raise FlaxlmError(
                f"{path} {what}. Give flaxlm-report run directories (outputs/<task>/runs/<time>) "
                "or multirun directories (outputs/<task>/multiruns/<time>)."
            )
    if not runs:
        raise FlaxlmError(f"{', '.join(paths)} holds no runs to report on.")
    if not any(run.records for run in runs):
        raise FlaxlmError(" ".join(_why_no_metrics(run) for run in runs)
                          + " Leave these runs out of the report, or train them first.")
    return runs


def read_bucket_runs(url: str) -> list[Run]:
    """The runs in a bucket: `url` is one run's folder (its output_url: config.yaml and
    metrics.jsonl in it) or a folder of such folders. Each run's small files are downloaded
    into a scratch folder and read as a local run's; the run is named and located by its URL."""
    from flaxlm import storage

    url = url.rstrip("/")
    setting = "flaxlm-report"
    if _is_bucket_run(url, storage.list_names(url, setting)):
        folders = [url]
    else:
        folders = [f"{url}/{name}" for name in sorted(storage.list_names(url, setting))]
        folders = [folder for folder in folders
                   if _is_bucket_run(folder, storage.list_names(folder, setting))]
    if not folders:
        bucket = url.partition("://")[2].split("/", 1)[0]
        if not storage.exists(f"{url.partition('://')[0]}://{bucket}", setting):
            raise storage.storage_error(FileNotFoundError(f"no bucket {bucket!r}"), url, setting)
        raise FlaxlmError(
            f"{url} holds no run: neither its own {CONFIG_FILE} and {METRICS_FILE} (a run's "
            "output_url) nor folders that hold them. Give flaxlm-report a run's output_url or "
            "the bucket folder above several."
        )
    runs = []
    with tempfile.TemporaryDirectory(prefix="flaxlm-report-") as scratch:
        for index, folder in enumerate(folders):
            local = os.path.join(scratch, str(index))
            os.makedirs(local)
            for name in (CONFIG_FILE, METRICS_FILE, STATUS_FILE):
                if storage.exists(f"{folder}/{name}", setting):
                    storage.download(f"{folder}/{name}", run_path(local, name), setting)
            name = folder[len(url.rsplit("/", 1)[0]) + 1:]  # "<run>" or "<folder>/<run>"
            run = read_run(local, name)
            run.path, run.reason = folder, run.reason.replace(local, folder)
            runs.append(run)
    return runs


def _is_bucket_run(url: str, names: list[str]) -> bool:
    return CONFIG_FILE in names and METRICS_FILE in names


def is_run_dir(path: str) -> bool:
    return all(os.path.isfile(run_path(path, name)) for name in (CONFIG_FILE, METRICS_FILE))


def read_run(path: str, name: str, job_status: dict[str, Any] | None = None) -> Run:
    """A run directory read back, with its status (see the module's docstring; `job_status`
    is its sweep's record of the job, if any). Files that cannot be read make it a `damaged`
    run, with the reason."""
    try:
        records = read_metrics(run_path(path, METRICS_FILE)).records
        config = _read_config(run_path(path, CONFIG_FILE))
    except FlaxlmError as err:
        return Run(path, name, {}, [], DAMAGED, str(err))
    run = Run(path, name, config, records)
    own = read_status(path)
    if own is not None:
        run.status, run.reason = own["status"], str(own.get("reason") or "")
    elif job_status is not None:
        word = str(job_status.get("status", "unknown"))
        run.status = STATUS_WORDS.get(word, word)
        run.reason = str(job_status.get("reason") or "")
    else:
        max_steps = config.get("trainer.max_steps")
        if _is_number(max_steps) and run.steps is not None and run.steps >= max_steps:
            run.status = "finished"
    return run


def _why_no_metrics(run: Run) -> str:
    if run.status == DAMAGED:
        return f"{run.name} is damaged: {run.reason}"
    return (f"{run_path(run.path, METRICS_FILE)} holds no metrics: the run stopped before its "
            "first log line.")


def status_notes(runs: Sequence[Run]) -> list[str]:
    """One line per run that did not finish and recorded why."""
    return [f"{run.name}: {run.status}: {run.reason}" for run in runs
            if run.reason and run.status != "finished"]


def _sweep_statuses(sweep_dir: str) -> list[dict[str, Any]]:
    """The sweep's job statuses; unreadable ones are one warning, since each run's own
    status.json says the same."""
    try:
        return job_statuses(sweep_dir)
    except (OSError, ValueError, KeyError) as err:
        print(f"flaxlm: warning: the job statuses in {sweep_dir} cannot be read ({err}); each "
              "run's status comes from its own directory", file=sys.stderr, flush=True)
        return []


def _read_multirun(sweep_dir: str, statuses: list[dict[str, Any]]) -> list[Run]:
    # A status names its job's run directory; a job folder's number alone can repeat (a
    # continued Optuna study numbers its new trials from 0 again, in new folders).
    by_dir = {os.path.abspath(record.get("run_dir") or ""): record for record in statuses}
    by_job = {str(record.get("job")): record for record in statuses}
    sweep_name = os.path.basename(os.path.normpath(sweep_dir))
    runs = []
    for job in _job_dirs(sweep_dir):
        path = os.path.join(sweep_dir, job)
        job_status = by_dir.get(os.path.abspath(path)) or by_job.get(job)
        runs.append(read_run(path, f"{sweep_name}/{job}", job_status))
    return runs


def _job_dirs(path: str) -> list[str]:
    """A multirun's job folders, in job order: named by the job number (`3`), or by the
    number and a time (`3_09-01-22_206152`, as the Optuna preset names them)."""
    if not os.path.isdir(path):
        return []
    jobs = [(int(match.group(1)), name) for name in os.listdir(path)
            if (match := _JOB_FOLDER.fullmatch(name)) and os.path.isdir(os.path.join(path, name))]
    return [name for _, name in sorted(jobs)]


_JOB_FOLDER = re.compile(r"(\d+)(?:_.+)?")


def _read_config(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            tree = yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise FlaxlmError(f"{path} is not a YAML config: {err}") from None
    return dotted(upgrade_saved_config(tree)) if isinstance(tree, dict) else {}


def differing_keys(runs: Sequence[Run]) -> list[str]:
    """The config keys whose values are not the same in every run (that has a config)."""
    configs = [run.config for run in runs if run.config]
    keys = sorted(set().union(*configs)) if configs else []
    return [key for key in keys if key not in PER_RUN_KEYS
            and len({repr(config.get(key)) for config in configs}) > 1]


def metric_keys(runs: Sequence[Run], objective: str) -> list[str]:
    """The objective first, then the other eval metrics any run logged."""
    logged = {key for run in runs for record in run.records for key, value in record.items()
              if key.startswith("eval/") and _is_number(value)}
    # The loss by position has its own plot and section (positions.png), not 2 columns a bucket.
    by_position = {key for key in logged if key.startswith("eval/position/")}
    others = sorted(logged - {objective} - set(DERIVED_FROM_LOSS) - by_position,
                    key=lambda key: (key != "eval/loss", key))
    return [objective, *others]


def report_objective(runs: Sequence[Run], objective: str | None = None,
                     maximize: bool | None = None) -> tuple[str, bool]:
    """The metric to sort by and whether higher is better: as given, else the objective the
    runs were trained for (their saved `trainer.objective` and mode, where they all agree), else
    eval/loss. A direction not given is the runs' for that metric, else max for every metric
    but a loss."""
    recorded = {(run.config.get("trainer.objective"), run.config.get("trainer.objective_mode"))
                for run in runs if run.config}
    saved_name, saved_mode = recorded.pop() if len(recorded) == 1 else (None, None)
    name = objective or saved_name or "eval/loss"
    if maximize is None:
        if name == saved_name and saved_mode in ("min", "max"):
            maximize = saved_mode == "max"
        else:
            maximize = not lower_is_better(name)
    return name, maximize


def lower_is_better(key: str) -> bool:
    """Whether a lower value of the eval metric `key` is better: a loss in any unit, the
    whole validation set's (eval/loss) or one language's (eval/is/bits_per_byte)."""
    return key in LOWER_IS_BETTER or (
        key.startswith("eval/") and key.rsplit("/", 1)[-1] in
        {name.removeprefix("eval/") for name in LOWER_IS_BETTER})


def sort_runs(runs: Sequence[Run], objective: str, maximize: bool) -> list[Run]:
    """Best objective first; runs that never logged it last, in the given order. An objective
    that no run logged is an error."""
    if all(run.best(objective, maximize) is None for run in runs):
        logged = sorted({key for run in runs for record in run.records for key in record
                         if key.startswith("eval/")})
        raise FlaxlmError(
            f"No run logged {objective}, so the runs cannot be sorted by it. Choose --objective "
            f"from the metrics they logged: {', '.join(logged) or 'none'}."
        )
    def key(run: Run) -> tuple[bool, float]:
        best = run.best(objective, maximize)
        if best is None:
            return (True, 0.0)
        return (False, -best if maximize else best)

    return sorted(runs, key=key)


@dataclasses.dataclass
class Table:
    header: list[str]
    rows: list[list[str]]

    def text(self) -> str:
        """Aligned columns for the terminal."""
        widths = [max(len(cell) for cell in column) for column in zip(self.header, *self.rows)]
        lines = [self.header, ["-" * width for width in widths], *self.rows]
        return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                         for line in lines)

    def markdown(self) -> str:
        lines = [self.header, ["---"] * len(self.header), *self.rows]
        return "\n".join("| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |"
                         for line in lines)


def build_table(runs: Sequence[Run], objective: str, maximize: bool) -> Table:
    """One row per run, in the order given (sort first with `sort_runs`)."""
    settings = differing_keys(runs)
    metrics = metric_keys(runs, objective)
    with_tokens = any(run.tokens_seen is not None for run in runs)
    with_time = any(run.wall_time_s is not None for run in runs)
    header = ["run", *settings]
    for key in metrics:
        header += [f"final {key}", f"best {key}"]
    header += ["steps"] + (["tokens"] if with_tokens else []) + (["wall"] if with_time else [])
    header.append("status")
    rows = []
    for run in runs:
        row = [run.name, *(_cell(run.config.get(key)) if run.config else "-" for key in settings)]
        for key in metrics:
            direction = maximize if key == objective else not lower_is_better(key)
            row += [_number(run.last(key)), _number(run.best(key, direction))]
        row.append("-" if run.steps is None else str(run.steps))
        if with_tokens:
            row.append("-" if run.tokens_seen is None else f"{run.tokens_seen:,}")
        if with_time:
            row.append(_duration(run.wall_time_s))
        row.append(run.status)
        rows.append(row)
    return Table(header, rows)


def numeric_settings(runs: Sequence[Run]) -> list[str]:
    """The differing settings whose values are numbers in every run that has a config."""
    configs = [run.config for run in runs if run.config]
    return [key for key in differing_keys(runs)
            if all(_is_number(config.get(key)) for config in configs)]


def write_plots(runs: Sequence[Run], out_dir: str, objective: str,
                maximize: bool) -> list[str]:
    """The loss curves of every run, the objective against each numeric setting that differs,
    and the loss by position where a run logged it; returns the PNG file names (in
    `out_dir`)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    # Against steps, and against tokens where the runs logged them: runs with different batch
    # sizes or sequence lengths line up only on tokens.
    x_axes = ["step"] + ([TOKENS_SEEN] if any(run.tokens_seen for run in runs) else [])
    settings = differing_keys(runs)
    figure, grid = plt.subplots(len(x_axes), 2, figsize=(11, 4 * len(x_axes)), squeeze=False)
    for row, axis in zip(grid, x_axes):
        for ax, key in zip(row, ("train/loss", "eval/loss")):
            for run in runs:
                points = run.series(key, axis)
                if points:
                    ax.plot(*zip(*points), marker="." if key.startswith("eval/") else None,
                            label=_legend(run, settings))
            ax.set(title=f"{key} against {axis}", xlabel=axis, ylabel="loss")
            ax.grid(alpha=0.3)
    grid[0][1].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(os.path.join(out_dir, CURVES_FILE), dpi=PLOT_DPI)
    plt.close(figure)
    files = [CURVES_FILE]
    for key in numeric_settings(runs):
        points = [(run.config[key], run.best(objective, maximize)) for run in runs
                  if run.config and run.best(objective, maximize) is not None]
        figure, ax = plt.subplots(figsize=(4.5, 3.5))
        if points:
            ax.scatter(*zip(*points))
        values = [value for value, _ in points]
        if values and min(values) > 0 and max(values) >= 10 * min(values):
            ax.set_xscale("log")
        ax.set(xlabel=key, ylabel=f"best {objective}", title=f"{objective} against {key}")
        ax.grid(alpha=0.3)
        figure.tight_layout()
        name = f"{_file_stem(objective)}_vs_{_file_stem(key)}.png"
        figure.savefig(os.path.join(out_dir, name), dpi=PLOT_DPI)
        plt.close(figure)
        files.append(name)
    if any(position_buckets(run) for run in runs):
        _plot_positions(runs, os.path.join(out_dir, POSITIONS_FILE), settings, plt)
        files.append(POSITIONS_FILE)
    return files


def position_buckets(run: Run) -> list[tuple[int, int, str]]:
    """(from, to, metric) of each position bucket whose loss `run` logged, by position."""
    found = {key: match for record in run.records for key in record
             if (match := POSITION_LOSS.match(key))}
    return sorted((int(match[1]), int(match[2]), key) for key, match in found.items())


def last_position_losses(run: Run) -> list[tuple[int, int, float]]:
    """(from, to, loss) of each bucket at the run's last evaluation that logged them."""
    buckets = position_buckets(run)
    for record in reversed(run.records):
        losses = [(start, stop, float(record[key])) for start, stop, key in buckets
                  if _is_number(record.get(key))]
        if losses:
            return losses
    return []


def position_markdown(runs: Sequence[Run]) -> list[str]:
    """A section of report.md: each run's last held-out loss by position bucket (none when no
    run logged one)."""
    rows = [(run.name, last_position_losses(run)) for run in runs]
    rows = [(name, losses) for name, losses in rows if losses]
    if not rows:
        return []
    lines = ["## Loss by position in the document", "",
             "The last evaluation's loss over the predictions made at each range of positions "
             "(eval.position_buckets):", ""]
    for name, losses in rows:
        cells = ", ".join(f"{start}-{stop}: {_number(loss)}" for start, stop, loss in losses)
        lines.append(f"- {name}: {cells}")
    return [*lines, ""]


def _plot_positions(runs: Sequence[Run], path: str, settings: Sequence[str], plt) -> None:
    """Left, each run's last held-out loss by position in the document, one step a bucket
    over the positions it covers: a model that uses its longer context predicts the later
    positions better, so its steps go down. Right, each bucket's loss against step: a context
    extension shows as the later buckets falling faster than the first."""
    figure, (by_position, by_step) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        losses = last_position_losses(run)
        if not losses:
            continue
        label = _legend(run, settings)
        edges = [losses[0][0], *(stop for _, stop, _ in losses)]
        by_position.stairs([loss for *_, loss in losses], edges, baseline=None, label=label)
        for start, stop, key in position_buckets(run):
            by_step.plot(*zip(*run.series(key)), marker=".", label=f"{label}: {start}-{stop}")
    by_position.set(title="last eval/loss by position in the document",
                    xlabel="position (tokens)", ylabel="loss")
    by_step.set(title="eval/loss by position against step", xlabel="step", ylabel="loss")
    for ax in (by_position, by_step):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=PLOT_DPI)
    plt.close(figure)


def write_markdown(table: Table, plots: Iterable[str], out_dir: str, objective: str,
                   maximize: bool, notes: Sequence[str] = (), runs: Sequence[Run] = ()) -> str:
    """`report.md` in `out_dir`: the table, the `notes` on runs that did not finish, the last
    loss by position of the `runs` that logged one, and the plots; returns its path."""
    direction = "highest" if maximize else "lowest"
    lines = [f"# flaxlm report\n\nRuns sorted by `{objective}` ({direction} first).\n",
             table.markdown(), ""]
    if notes:
        lines += ["## Runs that did not finish", "", *(f"- {note}" for note in notes), ""]
    lines += position_markdown(runs)
    lines += ["## Plots", ""]
    lines += [f"![{name}]({name})" for name in plots]
    path = os.path.join(out_dir, REPORT_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _legend(run: Run, settings: Sequence[str]) -> str:
    """The run's name and its values of the settings that differ (a few at most)."""
    values = [f"{key.rsplit('.', 1)[-1]}={_cell(run.config.get(key))}" for key in settings[:3]]
    return f"{run.name} ({', '.join(values)})" if values and run.config else run.name


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _cell(value: Any) -> str:
    return "null" if value is None else str(value)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _file_stem(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_")
