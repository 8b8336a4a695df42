"""Examples for `task=classify`: load, normalise labels, tokenise, and batch them.

Data come from a Hub dataset (`task.dataset`, e.g. nyu-mll/glue with config mrpc, or a local
directory laid out like one) or, when `task.train_files` is set, from local tsv / csv / jsonl /
json / parquet files. Either way every split ends as a `datasets.Dataset` with the columns
`text`, optional `text_pair`, and `label` (int class ids, or float32 targets for regression),
so that nothing downstream knows where the data came from.

Batches are global `jax.Array`s sharded on the mesh's `data` axis, each process reading only its
own rows (as data/loader.py does for token blocks). Training: a seeded shuffle per epoch and the
incomplete last batch dropped. Evaluation: every example exactly once and in order, the last
batch padded with zero rows and a `mask` that says which rows are real.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Iterator

import datasets
import grain
import jax
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from jax.sharding import Mesh

from flaxlm.config import Padding, TaskConfig
from flaxlm.data.corpus import check_file_type, expand_patterns, quiet_datasets_logs, root_cause
from flaxlm.data.loader import check_same_loader
from flaxlm.errors import FlaxlmError
from flaxlm.parallel import global_batch, process_rows

# Model inputs in every batch; `lengths` (tokens per example) only chooses the bucket.
FEATURES = ("input_ids", "attention_mask", "token_type_ids", "labels")
_ENCODE_CHUNK = 16384  # rows per tokenizer call: the fast tokenizer parallelises within a call
_SMALLEST_BUCKET = 16

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
_GLUE_UNLABELED = -1  # GLUE's test splits carry this label


@dataclasses.dataclass(frozen=True)
class Examples:
    """Train and eval splits with columns `text`, optional `text_pair`, `label`."""

    train: datasets.Dataset
    eval: datasets.Dataset
    num_labels: int  # 1 for regression
    is_regression: bool
    label_names: list[str] | None  # class names by id, when the data name them


# --- loading -------------------------------------------------------------------------------------


def load_examples(task: TaskConfig) -> Examples:
    """Both splits of the data `task` names, with normalised columns and checked labels.

    Local files win when `task.train_files` is set (so a Hub preset can be pointed at local
    copies by adding files); otherwise `task.dataset` is loaded.
    """
    if task.train_files or task.eval_files:
        _check_both_files(task)
        train = _load_files(task.train_files, "task.train_files", task)
        evaluation = _load_files(task.eval_files, "task.eval_files", task)
        train_where = f"task.train_files={list(task.train_files)}"
        eval_where = f"task.eval_files={list(task.eval_files)}"
    elif task.dataset:
        train = _load_hub(task, task.train_split)
        evaluation = _load_hub(task, task.eval_split)
        train_where = _hub_where(task, task.train_split)
        eval_where = _hub_where(task, task.eval_split)
    else:
        raise FlaxlmError(
            "task=classify needs data: set task.dataset to a Hub dataset (e.g. "
            "task.dataset=nyu-mll/glue task.dataset_config=mrpc) or a local directory laid out "
            "like one, or set task.train_files and task.eval_files to local tsv / csv / jsonl / "
            "parquet files."
        )
    labels = _resolve_labels(train, evaluation, task, train_where, eval_where)
    return Examples(
        train=_with_labels(train, labels.train, labels.names),
        eval=_with_labels(evaluation, labels.eval, labels.names),
        num_labels=labels.num_labels,
        is_regression=labels.is_regression,
        label_names=labels.names,
    )


def _hub_where(task: TaskConfig, split: str) -> str:
    return (
        f"task.dataset={task.dataset!r} (task.dataset_config={task.dataset_config!r}) "
        f"split {split!r}"
    )


def _load_hub(task: TaskConfig, split: str) -> datasets.Dataset:
    """One split of `task.dataset`, with its columns mapped; every failure as a FlaxlmError."""
    try:
        table = datasets.load_dataset(task.dataset, task.dataset_config, split=split)
    except Exception as err:  # not found, offline, unknown config or split, bad files
        raise FlaxlmError(
            f"Could not load {_hub_where(task, split)}: {root_cause(err)}. Check the dataset, "
            "config and split names (GLUE: task.dataset=nyu-mll/glue with task.dataset_config "
            "cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte or wnli; mnli's eval split is "
            "validation_matched), and that this machine can reach the Hub or, with "
            "HF_HUB_OFFLINE=1, has the dataset in its cache. Without the Hub, use local copies: "
            "task.train_files=[train.tsv] task.eval_files=[dev.tsv]."
        ) from err
    return _map_columns(table, task, _hub_where(task, split))


def _check_both_files(task: TaskConfig) -> None:
    for setting, other in (("train_files", "eval_files"), ("eval_files", "train_files")):
        if not getattr(task, setting):
            raise FlaxlmError(
                f"task.{other} is set but task.{setting} is empty: local data need both, e.g. "
                "task.train_files=[train.tsv] task.eval_files=[dev.tsv]."
            )


def _load_files(patterns: list[str], setting: str, task: TaskConfig) -> datasets.Dataset:
    parts = [
        _map_columns(_read_file(path, setting), task, repr(str(path)))
        for path in expand_patterns(patterns, setting)
    ]
    return parts[0] if len(parts) == 1 else _concatenate(parts)


def _read_file(path: Path, setting: str) -> datasets.Dataset:
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
    return datasets.Dataset.from_dict(columns, features=datasets.Features(features))


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


# --- labels --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Labels:
    train: np.ndarray
    eval: np.ndarray
    num_labels: int
    is_regression: bool
    names: list[str] | None


def _resolve_labels(
    train: datasets.Dataset, evaluation: datasets.Dataset, task: TaskConfig,
    train_where: str, eval_where: str,
) -> _Labels:
    """Class ids (int32) or regression targets (float32) for both splits, checked against
    `task.num_labels`. Each helper's docstring gives its rule; all are checked here, before
    tokenising, so a mistake costs seconds rather than a training run."""
    for table, where in ((train, train_where), (evaluation, eval_where)):
        _check_present(table, where)
    feature = train.features["label"]
    train_values = train.with_format("arrow")["label"]
    eval_values = evaluation.with_format("arrow")["label"]
    if isinstance(feature, datasets.ClassLabel):
        return _class_label_labels(
            feature, train_values, eval_values, task, train_where, eval_where
        )
    kind = train_values.type
    if _is_text(kind) != _is_text(eval_values.type):
        raise FlaxlmError(
            f"task.label_column={task.label_column!r} holds {kind} in {train_where} but "
            f"{eval_values.type} in {eval_where}; both splits must label classes the same way "
            "(both names or both numbers)."
        )
    if _is_text(kind) or pa.types.is_large_string(kind):
        return _string_labels(train_values, eval_values, task, train_where, eval_where)
    if pa.types.is_floating(kind) or task.num_labels == 1:
        return _float_labels(train_values, eval_values, task, train_where, eval_where)
    if pa.types.is_integer(kind) or pa.types.is_boolean(kind):
        return _integer_labels(
            _to_int(train_values), _to_int(eval_values), task, train_where, eval_where, names=None
        )
    raise FlaxlmError(
        f"task.label_column={task.label_column!r} of {train_where} holds {kind}; labels must be "
        "integers, strings (class names) or floats (regression). Set task.label_column to the "
        "column that holds the labels."
    )


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _check_present(table: datasets.Dataset, where: str) -> None:
    if len(table) == 0:
        raise FlaxlmError(f"{where} holds no examples. Point it at data with rows.")
    missing = table.with_format("arrow")["label"].null_count
    if missing:
        raise FlaxlmError(
            f"{where}: {missing} of {len(table)} examples have no label (an empty cell or null "
            "in task.label_column). Fill or remove those rows."
        )


def _to_int(values: pa.ChunkedArray) -> np.ndarray:
    return values.to_numpy().astype(np.int64)


def _check_not_unlabeled(labels: np.ndarray, where: str, everywhere: bool) -> None:
    """GLUE's test splits have label -1 for every row: the answers are secret, not wrong."""
    unlabeled = labels == _GLUE_UNLABELED
    if unlabeled.all() if everywhere else unlabeled.any():
        raise FlaxlmError(
            f"{where} has label -1 on {int(unlabeled.sum())} of {len(labels)} examples: that "
            "split has no labels (GLUE's test splits are unlabeled; their answers are scored "
            "only by the GLUE server). Evaluate on a labelled split instead, e.g. "
            "task.eval_split=validation (validation_matched for mnli)."
        )


def _class_label_labels(
    feature: datasets.ClassLabel, train_values, eval_values, task, train_where, eval_where
) -> _Labels:
    """Hub datasets with a ClassLabel feature (GLUE) name their classes: the count is known."""
    if task.num_labels is not None and task.num_labels != feature.num_classes:
        raise FlaxlmError(
            f"task.num_labels={task.num_labels}, but task.label_column={task.label_column!r} of "
            f"{train_where} has {feature.num_classes} classes {feature.names}. Set "
            f"task.num_labels={feature.num_classes} (or null to take it from the data)."
        )
    task = dataclasses.replace(task, num_labels=feature.num_classes)
    return _integer_labels(
        _to_int(train_values), _to_int(eval_values), task, train_where, eval_where,
        names=list(feature.names),
    )


def _integer_labels(train, evaluation, task, train_where, eval_where, names) -> _Labels:
    """Class ids in [0, num_labels), each one used by the train split; num_labels null → one
    more than train's largest id."""
    for labels, where in ((train, train_where), (evaluation, eval_where)):
        _check_not_unlabeled(labels, where, everywhere=False)
    used, counts = np.unique(train, return_counts=True)
    _check_several_classes(used.tolist(), train_where)
    num_labels = task.num_labels
    if num_labels is None:
        num_labels = int(train.max()) + 1
        setting = f"task.num_labels=null, so {num_labels} from the largest label of the train split"
    else:
        setting = f"task.num_labels={num_labels}"
    for labels, where in ((train, train_where), (evaluation, eval_where)):
        bad = np.unique(labels[(labels < 0) | (labels >= num_labels)])
        if bad.size:
            raise FlaxlmError(
                f"{where} has labels {bad[:10].tolist()} outside [0, {num_labels}) "
                f"({setting}). Set task.num_labels to the number of classes, or fix the labels "
                "(class ids must run from 0)."
            )
    # A class the train split never shows is never learnt, and an eval example of it can only
    # be scored wrong; with num_labels null, one stray large id would also invent the classes
    # below it.
    unused = np.setdiff1d(np.arange(num_labels), used)
    if unused.size:
        raise FlaxlmError(
            f"{setting}, but {train_where} uses only the labels {used[:20].tolist()} (with "
            f"{counts[:20].tolist()} examples): the classes {unused[:20].tolist()} would never be "
            "trained. Class ids must run from 0 to the number of classes - 1, each in the train "
            "split: fix or remove the rows with stray labels, or set task.num_labels to the "
            "number of classes (or null to take it from the data); check task.label_column."
        )
    return _Labels(train.astype(np.int32), evaluation.astype(np.int32), num_labels, False, names)


def _check_several_classes(used: list, where: str) -> None:
    if len(used) < 2:
        raise FlaxlmError(
            f"Every example of {where} has the label {used[0]!r}, so the classifier has "
            "nothing to learn: classification needs at least two classes in the train split. "
            "Add examples of the other classes, or check task.label_column."
        )


def _string_labels(train_values, eval_values, task, train_where, eval_where) -> _Labels:
    """Class names mapped to ids in sorted order, so the mapping is the same in every run."""
    if task.num_labels == 1:
        raise FlaxlmError(
            f"task.num_labels=1 asks for regression, but task.label_column="
            f"{task.label_column!r} of {train_where} holds text. Set task.num_labels to the "
            "number of classes (or null), or point task.label_column at numeric scores."
        )
    names = sorted(pc.unique(train_values).to_pylist())
    _check_several_classes(names, train_where)
    if task.num_labels is not None and task.num_labels != len(names):
        raise FlaxlmError(
            f"task.num_labels={task.num_labels}, but {train_where} has {len(names)} label names "
            f"{names[:20]}. Set task.num_labels={len(names)} (or null), or check "
            "task.label_column."
        )
    vocabulary = pa.array(names, pa.string())
    unseen = pc.unique(pc.filter(eval_values, pc.invert(pc.is_in(eval_values, vocabulary))))
    if len(unseen):
        raise FlaxlmError(
            f"{eval_where} has labels {unseen.to_pylist()[:10]} that the train split never "
            f"uses (its labels: {names[:20]}). A model cannot learn classes it never sees: add "
            "examples of them to the train split, or fix the labels."
        )
    ids = [
        pc.index_in(values.cast(pa.string()), value_set=vocabulary).to_numpy()
        for values in (train_values, eval_values)
    ]
    return _Labels(ids[0].astype(np.int32), ids[1].astype(np.int32), len(names), False, names)


def _float_labels(train_values, eval_values, task, train_where, eval_where) -> _Labels:
    """Real-valued labels are regression targets unless num_labels > 1 and all are integral."""
    train = train_values.to_numpy().astype(np.float64)
    evaluation = eval_values.to_numpy().astype(np.float64)
    if task.num_labels is not None and task.num_labels > 1:
        for labels, where in ((train, train_where), (evaluation, eval_where)):
            fractional = labels[labels != np.round(labels)]
            if fractional.size:
                raise FlaxlmError(
                    f"task.num_labels={task.num_labels} asks for classification, but {where} has "
                    f"real-valued labels such as {fractional[:5].tolist()}. Set task.num_labels=1 "
                    "(or null) for regression, or fix task.label_column."
                )
        return _integer_labels(
            train.astype(np.int64), evaluation.astype(np.int64), task, train_where, eval_where,
            names=None,
        )
    for labels, where in ((train, train_where), (evaluation, eval_where)):
        _check_not_unlabeled(labels, where, everywhere=True)
        if not np.isfinite(labels).all():
            raise FlaxlmError(
                f"{where} has labels that are not finite numbers (nan or inf). Fix or remove "
                "those rows."
            )
    return _Labels(train.astype(np.float32), evaluation.astype(np.float32), 1, True, None)


def _with_labels(
    table: datasets.Dataset, labels: np.ndarray, names: list[str] | None
) -> datasets.Dataset:
    """The split with its label column replaced by the resolved ids or targets."""
    columns = {c: table.with_format("arrow")[c] for c in table.column_names if c != "label"}
    features = {c: datasets.Value("string") for c in columns}
    if labels.dtype == np.float32:
        features["label"] = datasets.Value("float32")
    elif names is not None:
        features["label"] = datasets.ClassLabel(names=names)
    else:
        features["label"] = datasets.Value("int32")
    return datasets.Dataset.from_dict(
        {**columns, "label": labels}, features=datasets.Features(features)
    )


# --- tokenising ----------------------------------------------------------------------------------


def encode(split: datasets.Dataset, tokenizer, max_length: int) -> dict[str, np.ndarray]:
    """Token arrays for a split: `input_ids`, `attention_mask`, `token_type_ids` (int32,
    (N, max_length), right-padded), `labels` ((N,) int32 or float32) and `lengths` ((N,) int32,
    real tokens per example, which bucketed batching uses to trim padding).

    Pairs are truncated longest-first, as the tokenizer does by default. Padding is done here
    rather than by the tokenizer, so a tokenizer without a pad token (GPT-2's) works too: the
    attention mask keeps the model from reading the pad id.
    """
    if max_length < 2:
        raise FlaxlmError(f"task.max_seq_length={max_length} must be at least 2.")
    has_pair = "text_pair" in split.column_names
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    parts = []
    arrow = split.with_format("arrow")
    for start in range(0, len(split), _ENCODE_CHUNK):
        rows = arrow[start : start + _ENCODE_CHUNK]
        text = rows["text"].to_pylist()
        pair = rows["text_pair"].to_pylist() if has_pair else None
        encoding = tokenizer(text, pair, truncation=True, max_length=max_length,
                             return_token_type_ids=True)
        parts.append(_pad_encoding(encoding, max_length, pad_id))
    if parts:
        arrays = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    else:
        arrays = _empty(max_length)
    labels = split.with_format("numpy")["label"][:]
    arrays["labels"] = np.asarray(labels, np.float32 if labels.dtype.kind == "f" else np.int32)
    return arrays


def _pad_encoding(encoding, max_length: int, pad_id: int) -> dict[str, np.ndarray]:
    """Ragged token lists → right-padded (N, max_length) int32 arrays, without a loop per row:
    the real positions of a row-major array are exactly the tokens in order."""
    ids = encoding["input_ids"]
    lengths = np.fromiter(map(len, ids), np.int32, count=len(ids))
    real_NxL = np.arange(max_length) < lengths[:, None]
    arrays = {"lengths": lengths, "attention_mask": real_NxL.astype(np.int32)}
    for name, fill in (("input_ids", pad_id), ("token_type_ids", 0)):
        out = np.full((len(ids), max_length), fill, np.int32)
        if name in encoding:
            out[real_NxL] = np.fromiter(
                itertools.chain.from_iterable(encoding[name]), np.int32, count=int(lengths.sum())
            )
        arrays[name] = out
    return arrays


def _empty(max_length: int) -> dict[str, np.ndarray]:
    names = ("input_ids", "attention_mask", "token_type_ids")
    arrays = {name: np.zeros((0, max_length), np.int32) for name in names}
    arrays["lengths"] = np.zeros((0,), np.int32)
    return arrays


def max_length_for(task: TaskConfig) -> int:
    """The length every example is truncated and padded to; conf/task/classify.yaml sets it,
    so that file is the one place its value lives."""
    if task.max_seq_length is None:
        raise FlaxlmError(
            "task.max_seq_length is null, but task=classify truncates and pads every example "
            "to one length: set it (conf/task/classify.yaml does), e.g. task.max_seq_length=256."
        )
    return task.max_seq_length


def bucket_lengths(max_length: int, smallest: int = _SMALLEST_BUCKET) -> list[int]:
    """Powers of two from `smallest` below `max_length`, then `max_length` itself: each batch
    is padded to the first that fits its longest example, so a run compiles at most
    log2(max_length / smallest) + 1 shapes."""
    lengths = []
    length = smallest
    while length < max_length:
        lengths.append(length)
        length *= 2
    return [*lengths, max_length]


def _width(arrays: dict[str, np.ndarray], rows: np.ndarray, padding: Padding) -> int:
    """Columns of a batch of the examples `rows`: the arrays' full max_length, or with
    buckets the smallest bucket that holds the longest of them. `rows` are the whole global
    batch's, so every process picks the same width."""
    full = arrays["input_ids"].shape[1]
    if Padding(padding) == Padding.max_length or len(rows) == 0:
        return full
    longest = int(arrays["lengths"][rows].max())
    return next(b for b in bucket_lengths(full) if b >= longest)


# --- batching ------------------------------------------------------------------------------------


def _local_batch(
    arrays: dict[str, np.ndarray], rows: np.ndarray, local_rows: int, width: int, mesh: Mesh,
    with_mask: bool,
) -> dict[str, jax.Array]:
    """This process's examples `rows`, zero-padded to `local_rows`, as parts of global arrays."""
    pad = local_rows - len(rows)
    batch = {}
    for name in FEATURES:
        values = arrays[name][rows]
        if values.ndim == 2:
            values = values[:, :width]
        if pad:
            values = np.concatenate([values, np.zeros((pad, *values.shape[1:]), values.dtype)])
        batch[name] = global_batch(values, mesh)
    if with_mask:
        mask = np.concatenate([np.ones(len(rows), np.int32), np.zeros(pad, np.int32)])
        batch["mask"] = global_batch(mask, mesh)
    return batch


@dataclasses.dataclass
class ClassificationLoader:
    """Training batches: a seeded shuffle per epoch, the incomplete last batch dropped.

    Indexing grain's shuffled `MapDataset` past its length draws a fresh permutation for every
    pass, so epoch e is positions [e*N, (e+1)*N) and a position in the data is just
    (epoch, step): resuming mid-epoch replays exactly the batches a run would have seen.
    """

    arrays: dict[str, np.ndarray]  # from `encode`
    global_batch_size: int
    mesh: Mesh
    seed: int
    padding: Padding = Padding.max_length  # task.padding

    @property
    def num_examples(self) -> int:
        return len(self.arrays["labels"])

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.global_batch_size  # 0 when N < one batch

    def state_dict(self) -> dict:
        """What fixes the order of batches: with (epoch, step in epoch), which the training
        loop saves alongside, the loader's whole position for a checkpoint."""
        return {"kind": "classify", "seed": self.seed, "num_examples": self.num_examples,
                "global_batch_size": self.global_batch_size, "padding": Padding(self.padding).value}

    def load_state_dict(self, saved: dict) -> None:
        """Check that a checkpoint's loader would yield the batches this one yields."""
        check_same_loader(saved, self.state_dict())

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, jax.Array]]:
        """The global batches of `epoch` from `start_step` on: dicts of FEATURES."""
        rows = self.global_batch_size
        first_row, local_rows = process_rows(rows, self.mesh)
        shuffled = grain.MapDataset.source(np.arange(self.num_examples)).shuffle(seed=self.seed)
        for step in range(start_step, self.steps_per_epoch):
            start = epoch * self.num_examples + step * rows
            batch_rows = np.fromiter(
                (shuffled[i] for i in range(start, start + rows)), np.int64, count=rows
            )
            width = _width(self.arrays, batch_rows, self.padding)
            mine = batch_rows[first_row : first_row + local_rows]
            yield _local_batch(self.arrays, mine, local_rows, width, self.mesh, with_mask=False)


def eval_batches(
    arrays: dict[str, np.ndarray], global_batch_size: int, mesh: Mesh,
    padding: Padding = Padding.max_length,
) -> Iterator[dict[str, jax.Array]]:
    """Every example exactly once, in order: dicts of FEATURES plus `mask` (1 real, 0 padding).

    Batch b holds examples [b*G, (b+1)*G); a process takes the rows of its own devices, so the
    padding of the last batch always sits at its end, after the real rows.
    """
    num_examples = len(arrays["labels"])
    first_row, local_rows = process_rows(global_batch_size, mesh)
    for start in range(0, num_examples, global_batch_size):
        batch_rows = np.arange(start, min(start + global_batch_size, num_examples))
        width = _width(arrays, batch_rows, padding)
        mine = batch_rows[first_row : first_row + local_rows]
        yield _local_batch(arrays, mine, local_rows, width, mesh, with_mask=True)


def num_eval_batches(num_examples: int, global_batch_size: int) -> int:
    return -(-num_examples // global_batch_size)
