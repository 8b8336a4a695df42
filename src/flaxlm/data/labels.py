"""Labels of classification examples: class ids or regression targets for both splits, with
every mistake in them (a missing label, one class only, a class the train split never shows,
GLUE's unlabeled test split, ...) found before tokenising, so it costs seconds, not a run."""

from __future__ import annotations

import dataclasses

import numpy as np

from flaxlm.config import TaskConfig
from flaxlm.data.fingerprint import arrays_fingerprint
from flaxlm.data.tables import derived_fingerprint, named_dataset
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module

datasets = lazy_module("datasets")
pa = lazy_module("pyarrow")
pc = lazy_module("pyarrow.compute")

_GLUE_UNLABELED = -1  # GLUE's test splits carry this label


@dataclasses.dataclass(frozen=True)
class Labels:
    """Both splits' labels: class ids (int32) or regression targets (float32)."""

    train: np.ndarray
    eval: np.ndarray
    num_labels: int
    is_regression: bool
    names: list[str] | None


def resolve_labels(
    train: datasets.Dataset, evaluation: datasets.Dataset, task: TaskConfig,
    train_where: str, eval_where: str,
) -> Labels:
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
    if _is_text(kind):
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
            "task.hub_eval_split=validation (validation_matched for mnli)."
        )


def _class_label_labels(
    feature: datasets.ClassLabel, train_values, eval_values, task, train_where, eval_where
) -> Labels:
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


def _integer_labels(train, evaluation, task, train_where, eval_where, names) -> Labels:
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
    return Labels(train.astype(np.int32), evaluation.astype(np.int32), num_labels, False, names)


def _check_several_classes(used: list, where: str) -> None:
    if len(used) < 2:
        raise FlaxlmError(
            f"Every example of {where} has the label {used[0]!r}, so the classifier has "
            "nothing to learn: classification needs at least two classes in the train split. "
            "Add examples of the other classes, or check task.label_column."
        )


def _string_labels(train_values, eval_values, task, train_where, eval_where) -> Labels:
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
    return Labels(ids[0].astype(np.int32), ids[1].astype(np.int32), len(names), False, names)


def _float_labels(train_values, eval_values, task, train_where, eval_where) -> Labels:
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
    return Labels(train.astype(np.float32), evaluation.astype(np.float32), 1, True, None)


def with_labels(
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
    return named_dataset({**columns, "label": labels}, datasets.Features(features),
                         derived_fingerprint(table, "labels", arrays_fingerprint({"label": labels}),
                                             names))

