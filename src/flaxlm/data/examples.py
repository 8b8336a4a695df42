"""The examples of `task=classify`, loaded and normalised.

Data come from a Hub dataset (`task.hub_path`, e.g. nyu-mll/glue with config mrpc, or a local
directory laid out like one) or, when `task.files` is set, from local tsv / csv / jsonl /
json / parquet files. Either way every split ends as a `datasets.Dataset` with the columns
`text`, optional `text_pair`, and `label` (int class ids, or float32 targets for regression,
resolved by data/labels.py), so that nothing downstream knows where the data came from.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flaxlm.config import TaskConfig
from flaxlm.data.datasets_cache import keep_datasets_cache_under
from flaxlm.data.files import check_file_type, expand_patterns, quiet_datasets_logs, root_cause
from flaxlm.data.labels import resolve_labels, with_labels
from flaxlm.data.tables import derived_fingerprint, named_dataset
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module

datasets = lazy_module("datasets")
pa = lazy_module("pyarrow")
pc = lazy_module("pyarrow.compute")

# File extension -> (`datasets` packaged builder, its extra arguments).
# tsv: QUOTE_NONE (3), as GLUE's original files need: MRPC's sentences hold unbalanced quotes.
# csv/tsv: only empty cells are missing; "NA" or "null" as a sentence stays text.
_NA = {"keep_default_na": False, "na_values": [""]}
_BUILDERS = {
    ".tsv": ("csv", {"delimiter": "\t", "quoting": 3, **_NA}),
    ".csv": ("csv", dict(_NA)),
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".parquet": ("parquet", {}),
}


@dataclasses.dataclass(frozen=True)
class Examples:
    """Train and eval splits with columns `text`, optional `text_pair`, `label`."""

    train: datasets.Dataset
    eval: datasets.Dataset
    num_labels: int  # 1 for regression
    is_regression: bool
    label_names: list[str] | None  # class names by id, when the data name them


def load_examples(task: TaskConfig, cache_dir: str | None = None) -> Examples:
    """Both splits of the data `task` names, with normalised columns and checked labels.

    Local files win when `task.files` is set (so a Hub preset can be pointed at local
    copies by adding files); otherwise `task.hub_path` is loaded. Copies of files in a
    bucket are kept in `cache_dir`, and what `datasets` builds from the files.
    """
    keep_datasets_cache_under(cache_dir)
    if task.files or task.eval_files:
        _check_both_files(task)
        train = _load_files(task.files, "task.files", task, cache_dir)
        evaluation = _load_files(task.eval_files, "task.eval_files", task, cache_dir)
        train_where = f"task.files={list(task.files)}"
        eval_where = f"task.eval_files={list(task.eval_files)}"
    elif task.hub_path:
        train = _load_hub(task, task.hub_split)
        evaluation = _load_hub(task, task.hub_eval_split)
        train_where = _hub_where(task, task.hub_split)
        eval_where = _hub_where(task, task.hub_eval_split)
    else:
        raise FlaxlmError(
            "task=classify needs data: set task.hub_path to a Hub dataset (e.g. "
            "task.hub_path=nyu-mll/glue task.hub_config=mrpc) or a local directory laid out "
            "like one, or set task.files and task.eval_files to local tsv / csv / jsonl / "
            "parquet files."
        )
    labels = resolve_labels(train, evaluation, task, train_where, eval_where)
    return Examples(
        train=with_labels(train, labels.train, labels.names),
        eval=with_labels(evaluation, labels.eval, labels.names),
        num_labels=labels.num_labels,
        is_regression=labels.is_regression,
        label_names=labels.names,
    )


def _hub_where(task: TaskConfig, split: str) -> str:
    return (
        f"task.hub_path={task.hub_path!r} (task.hub_config={task.hub_config!r}) "
        f"split {split!r}"
    )


def _load_hub(task: TaskConfig, split: str) -> datasets.Dataset:
    """One split of `task.hub_path`, with its columns mapped; every failure as a FlaxlmError."""
    try:
        table = datasets.load_dataset(task.hub_path, task.hub_config, split=split)
    except Exception as err:  # not found, offline, unknown config or split, bad files
        raise FlaxlmError(
            f"Could not load {_hub_where(task, split)}: {root_cause(err)}. Check the dataset, "
            "config and split names (GLUE: task.hub_path=nyu-mll/glue with task.hub_config "
            "cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte or wnli; mnli's eval split is "
            "validation_matched), and that this machine can reach the Hub or, with "
            "HF_HUB_OFFLINE=1, has the dataset in its cache. Without the Hub, use local copies: "
            "task.files=[train.tsv] task.eval_files=[dev.tsv]."
        ) from err
    return _map_columns(table, task, _hub_where(task, split))


def _check_both_files(task: TaskConfig) -> None:
    for setting, other in (("files", "eval_files"), ("eval_files", "files")):
        if not getattr(task, setting):
            raise FlaxlmError(
                f"task.{other} is set but task.{setting} is empty: local data need both, e.g. "
                "task.files=[train.tsv] task.eval_files=[dev.tsv]."
            )


def _load_files(patterns: list[str], setting: str, task: TaskConfig, cache_dir: str | None
                ) -> datasets.Dataset:
    parts = [
        _map_columns(read_data_file(path, setting), task, repr(str(path)))
        for path in expand_patterns(patterns, setting, cache_dir)
    ]
    return parts[0] if len(parts) == 1 else _concatenate(parts)


def read_data_file(path: Path, setting: str) -> datasets.Dataset:
    check_file_type(path, setting, _BUILDERS)
    suffix = path.suffix.lower()
    builder, options = _BUILDERS[suffix]
    try:
        with quiet_datasets_logs():
            return datasets.load_dataset(builder, data_files=[str(path)], split="train",
                                         **options)
    except Exception as err:  # datasets raises anything from StopIteration to ArrowInvalid
        raise FlaxlmError(
            f"{setting}: could not parse {str(path)!r} as {suffix[1:]} ({root_cause(err)}). "
            "Check that the file is well-formed (csv/tsv with a header row, JSON Lines, or "
            f"Parquet), or remove it from {setting}."
        ) from err


def _map_columns(table: datasets.Dataset, task: TaskConfig, where: str) -> datasets.Dataset:
    """Keep the task's columns, renamed `text`, `text_pair`, `label`; text as str, never null."""
    wanted = {"text": ("task.text_column", task.text_column)}
    if task.text_pair_column is not None:
        wanted["text_pair"] = ("task.text_pair_column", task.text_pair_column)
    wanted["label"] = ("task.label_column", task.label_column)
    for setting, column in wanted.values():
        if column not in table.column_names:
            single = setting == "task.text_pair_column"
            pair_hint = ", or null for single sentences" if single else ""
            raise FlaxlmError(
                f"{setting}={column!r} is not a column of {where}; its columns are "
                f"{table.column_names}. Set {setting} to the right one{pair_hint}."
            )
    arrow = table.with_format("arrow")
    columns = {}
    for name, (setting, column) in wanted.items():
        values = arrow[column]
        if name != "label":
            values = _as_text(values, setting, column, where)
        columns[name] = values
    features = {name: table.features[column] for name, (_, column) in wanted.items()}
    features.update({n: datasets.Value("string") for n in columns if n != "label"})
    return named_dataset(columns, datasets.Features(features),
                         derived_fingerprint(table, "examples", sorted(wanted.items())))


def _as_text(values: pa.ChunkedArray, setting: str, column: str, where: str) -> pa.ChunkedArray:
    """Strings, with missing cells as "" (a blank sentence still counts as an example)."""
    if pa.types.is_null(values.type):  # every cell empty
        return pa.chunked_array([pa.array([""] * len(values), pa.string())])
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
            or pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise FlaxlmError(
            f"{setting}={column!r} of {where} holds {values.type}, not text. Set {setting} to a "
            "column of strings."
        )
    return pc.fill_null(values.cast(pa.string()), "")


def _concatenate(parts: list[datasets.Dataset]) -> datasets.Dataset:
    """One split from several files, whose label columns may have been read as different types."""
    label_types = {str(part.features["label"]) for part in parts}
    if len(label_types) > 1:
        arrow_types = [part.with_format("arrow")["label"].type for part in parts]
        if any(pa.types.is_string(t) or pa.types.is_large_string(t) for t in arrow_types):
            target = datasets.Value("string")
        elif any(pa.types.is_floating(t) for t in arrow_types):
            target = datasets.Value("float64")
        else:
            target = datasets.Value("int64")
        parts = [part.cast_column("label", target) for part in parts]
    return datasets.concatenate_datasets(parts)

