"""Evaluation, for every task: each validation token or example counted exactly once.

The language model's (`LMEvaluator`): loss, perplexity and bits per byte from sums over all
batches, divided once. The classifier's (`ClassifierEvaluator`): loss and the task's metrics,
computed once over all the predictions.

Two common ways to get this wrong: dropping the incomplete last batch, or padding it by
repeating examples and forgetting to remove the repeats. Here the eval batches are padded with
zero rows and a mask (data/loader.py). The LM's sums are masked on the device. A classifier's
outputs are gathered to every process in global row order (batch order, then mesh device
order: exactly the dataset order), the padded rows are dropped by the mask, and the metrics are
computed once, on exactly the N real examples, by scikit-learn and scipy.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from tqdm.auto import tqdm

from flaxlm.config import Padding
from flaxlm.data.encoding import example_rows
from flaxlm.data.loader import RowGather, block_rows, eval_batches, num_eval_batches
from flaxlm.errors import FlaxlmError
from flaxlm.training.inflight import ready_in_order
from flaxlm.training.progress import progress_file
from flaxlm.training.step import CompiledSteps
from flaxlm.training.stop import StopRequest, unless_stopped

CLASSIFICATION_METRICS = ("accuracy", "f1", "matthews")
REGRESSION_METRICS = ("pearson", "spearman")
KNOWN_METRICS = CLASSIFICATION_METRICS + REGRESSION_METRICS


class Evaluate(Protocol):
    def __call__(self, params, stop: StopRequest | None = None) -> dict[str, float]:
        """`eval/loss` and the task's other `eval/…` metrics of `params`; a requested `stop`
        cuts it short (`EvaluationCut`)."""


def describe(evaluation: dict[str, float]) -> str:
    """One line from any task's eval record: 'eval loss 6.3981 | perplexity 600.38 | …'."""
    parts = [f"eval loss {evaluation['eval/loss']:.4f}"]
    for key, value in evaluation.items():
        if key.startswith("eval/") and key != "eval/loss":
            name = key.removeprefix("eval/").replace("bits_per_byte", "bits/byte")
            parts.append(f"{name} {value:.4g}")
    return " | ".join(parts)


# --- the language model --------------------------------------------------------------------------


@dataclasses.dataclass
class LMEvaluator:
    steps: CompiledSteps
    blocks: np.ndarray
    global_batch_size: int
    mesh: Mesh
    token_bytes: jax.Array  # (vocab,) UTF-8 bytes per token id
    # Where the blocks' documents start (`packing.PackedBlocks`): given, each document is
    # evaluated on its own, as it is trained (task.document_masking).
    document_starts: np.ndarray | None = None

    def __call__(self, params, stop: StopRequest | None = None) -> dict[str, float]:
        """Loss over every validation token exactly once: sums over all batches, divided once.
        A requested `stop` cuts it short (`EvaluationCut`)."""
        return lm_metrics(self.sums(params, stop))

    def sums(self, params, stop: StopRequest | None = None) -> dict[str, float]:
        """The loss summed over every validation token, the tokens and their UTF-8 bytes
        (`lm_sums`)."""
        gather = block_rows(self.blocks, self.global_batch_size, self.mesh, self.document_starts)
        return lm_sums(self.steps, params, len(self.blocks), gather, self.global_batch_size,
                       self.mesh, self.token_bytes, stop)


@dataclasses.dataclass
class ChatEvaluator:
    """task=sft's: the LM metrics over the assistant tokens of every held-out conversation
    once (rows from data/chat_packing.py, whose target mask the eval step applies)."""

    steps: CompiledSteps
    num_rows: int
    gather: RowGather  # `chat_packing.chat_rows` of the held-out rows
    global_batch_size: int
    mesh: Mesh
    token_bytes: jax.Array

    def __call__(self, params, stop: StopRequest | None = None) -> dict[str, float]:
        return lm_metrics(lm_sums(self.steps, params, self.num_rows, self.gather,
                                  self.global_batch_size, self.mesh, self.token_bytes, stop))


def lm_sums(steps: CompiledSteps, params, num_rows: int, gather: RowGather,
            global_batch_size: int, mesh: Mesh, token_bytes: jax.Array,
            stop: StopRequest | None = None) -> dict[str, float]:
    """The LM eval step's sums over rows 0..num_rows-1 (`gather`), each row once.

    Each batch's sums are fetched one batch after its dispatch, so only a couple of eval
    programs are ever queued (see `inflight` for why that matters), and are added up on the
    host in float64.
    """
    batches = eval_batches(num_rows, global_batch_size, mesh, gather)
    dispatched = (steps.eval(params, inputs, mask, token_bytes) for inputs, mask in batches)
    total = num_eval_batches(num_rows, global_batch_size)
    totals = collections.defaultdict(float, dict.fromkeys(("loss_sum", "tokens", "bytes"), 0.0))
    for sums in tqdm(unless_stopped(ready_in_order(dispatched), stop, total), total=total,
                     desc="eval", leave=False, file=progress_file()):
        for key, value in jax.device_get(sums).items():
            totals[key] += float(value)
    return dict(totals)


def lm_metrics(totals: dict[str, float], prefix: str = "eval/",
               perplexity: bool = True) -> dict[str, float]:
    """Loss (nats per token), perplexity and bits per byte from `LMEvaluator.sums`; and the
    loss and perplexity of each bucket of positions the sums hold (`step.position_sums`),
    `<prefix>position/<from>-<to>/...`, where it held any token."""
    loss = totals["loss_sum"] / totals["tokens"]
    metrics = {
        f"{prefix}loss": loss,
        **({f"{prefix}perplexity": math.exp(min(loss, 700.0))} if perplexity else {}),
        f"{prefix}bits_per_byte": totals["loss_sum"] / (math.log(2) * totals["bytes"]),
    }
    for key, tokens in totals.items():
        if key.startswith("position/") and key.endswith("/tokens") and tokens > 0:
            bucket = key[:-len("/tokens")]
            bucket_loss = totals[f"{bucket}/loss_sum"] / tokens
            metrics[f"{prefix}{bucket}/loss"] = bucket_loss
            if perplexity:
                metrics[f"{prefix}{bucket}/perplexity"] = math.exp(min(bucket_loss, 700.0))
    return metrics


@dataclasses.dataclass
class MixtureEvaluator:
    """A mixture's evaluation: each source's validation blocks on their own, as
    `eval/<source>/loss` and `eval/<source>/bits_per_byte`, and all of them together as the
    usual eval/loss, eval/perplexity and eval/bits_per_byte (every token once, whichever
    source it is from). Bits per byte is what compares languages: a loss per token depends on
    how finely the shared tokenizer cuts each language's text, the bytes do not."""

    sources: dict[str, LMEvaluator]

    def __call__(self, params, stop: StopRequest | None = None) -> dict[str, float]:
        each = {name: evaluator.sums(params, stop) for name, evaluator in self.sources.items()}
        overall = {key: sum(totals.get(key, 0.0) for totals in each.values())
                   for key in set().union(*each.values())}
        results = lm_metrics(overall)
        for name, totals in each.items():
            results.update(lm_metrics(totals, f"eval/{name}/", perplexity=False))
        return results


def source_metrics(names) -> tuple[str, ...]:
    """The per-source metrics a `MixtureEvaluator` of sources `names` logs."""
    return tuple(f"eval/{name}/{metric}" for name in names
                 for metric in ("loss", "bits_per_byte"))


# --- the classifier ------------------------------------------------------------------------------


@dataclasses.dataclass
class ClassifierEvaluator:
    """Loss and the task's metrics over every eval example exactly once; keeps the last
    predictions for predictions.jsonl."""

    steps: CompiledSteps
    arrays: dict[str, np.ndarray]
    global_batch_size: int
    mesh: Mesh
    metrics: list[str]
    is_regression: bool
    num_labels: int
    padding: Padding
    last_predictions: np.ndarray | None = None

    def __call__(self, params, stop: StopRequest | None = None) -> dict[str, float]:
        results, self.last_predictions = evaluate(
            lambda batch: self.steps.eval(params, batch), self.arrays, self.global_batch_size,
            self.mesh, self.metrics, self.is_regression, self.num_labels, self.padding, stop,
        )
        return results


# --- prediction ----------------------------------------------------------------------------------


def predict(
    apply_fn: Callable[[dict[str, jax.Array]], jax.Array],
    arrays: dict[str, np.ndarray],
    global_batch_size: int,
    mesh: Mesh,
    padding: Padding = Padding.max_length,
    stop: StopRequest | None = None,
) -> np.ndarray:
    """The model outputs (N, C) for the N examples of `arrays`, in dataset order, on every
    process. A requested `stop` cuts it short (`EvaluationCut`)."""
    num_examples = len(arrays["labels"])
    return predict_rows(apply_fn, num_examples,
                        example_rows(arrays, global_batch_size, mesh, padding),
                        global_batch_size, mesh, stop)


def predict_rows(apply_fn: Callable[[dict[str, jax.Array]], jax.Array], num_rows: int,
                 gather: RowGather, global_batch_size: int, mesh: Mesh,
                 stop: StopRequest | None = None, progress: str | None = None) -> np.ndarray:
    """`apply_fn`'s outputs (N, C) for rows 0..num_rows-1 (`gather` builds them: classified
    examples, preference pairs), each row once, in order, on every process; the last batch's
    filler rows dropped by its mask. With `progress`, a progress bar of that name.

    Batch b is fetched once batch b+1 is dispatched, so the host builds the next batch while
    the devices run one, and only a couple of programs are ever queued (see `inflight`).
    """
    batches = eval_batches(num_rows, global_batch_size, mesh, gather)
    dispatched = ((apply_fn(batch), mask) for batch, mask in batches)
    total = num_eval_batches(num_rows, global_batch_size)
    ready = unless_stopped(ready_in_order(dispatched), stop, total)
    if progress:
        ready = tqdm(ready, total=total, desc=progress, leave=False, file=progress_file())
    outputs = [_real_rows(gather_rows(out), gather_rows(mask)) for out, mask in ready]
    outputs_NxC = np.concatenate(outputs) if outputs else np.zeros((0, 1), np.float32)
    if len(outputs_NxC) != num_rows:  # the one thing this module exists to guarantee
        raise AssertionError(f"evaluation produced {len(outputs_NxC)} outputs for {num_rows} "
                             "rows")
    return outputs_NxC


def gather_rows(array: jax.Array) -> np.ndarray:
    """A global array as one host numpy array on every process, rows in global order.

    Single-process arrays are simply fetched. Across hosts `process_allgather(tiled=True)`
    reshards to replicated and fetches; it is only called on arrays that span processes,
    because on a fully addressable array it would instead concatenate every process's copy.
    """
    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _real_rows(outputs: np.ndarray, mask: np.ndarray) -> np.ndarray:
    outputs_BxC = outputs.reshape(len(outputs), -1)  # a regression head may return (B,)
    return outputs_BxC[mask.astype(bool)]


def to_predictions(outputs_NxC: np.ndarray, is_regression: bool) -> np.ndarray:
    """Class ids (argmax of the logits) or regression scores (the single output)."""
    if is_regression:
        return outputs_NxC.reshape(len(outputs_NxC), -1)[:, 0].astype(np.float32)
    return outputs_NxC.argmax(axis=-1).astype(np.int32)


def eval_loss(outputs_NxC: np.ndarray, labels: np.ndarray, is_regression: bool) -> float:
    """The mean loss over the N real examples, computed once from the gathered outputs:
    cross-entropy of the logits, or squared error for regression (as HF's heads train)."""
    outputs = outputs_NxC.astype(np.float64)
    if is_regression:
        return float(np.mean((outputs.reshape(len(outputs), -1)[:, 0] - labels) ** 2))
    shifted = outputs - outputs.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return float(-np.mean(log_probs[np.arange(len(labels)), labels.astype(np.int64)]))


def evaluate(
    apply_fn: Callable[[dict[str, jax.Array]], jax.Array],
    arrays: dict[str, np.ndarray],
    global_batch_size: int,
    mesh: Mesh,
    metrics: Sequence[str],
    is_regression: bool,
    num_labels: int | None = None,
    padding: Padding = Padding.max_length,
    stop: StopRequest | None = None,
) -> tuple[dict[str, float], np.ndarray]:
    """`eval/loss` plus the named metrics, and the predictions they were computed from; a
    requested `stop` cuts it short (`EvaluationCut`)."""
    outputs_NxC = predict(apply_fn, arrays, global_batch_size, mesh, padding, stop)
    labels = arrays["labels"]
    predictions = to_predictions(outputs_NxC, is_regression)
    results = {"eval/loss": eval_loss(outputs_NxC, labels, is_regression)}
    results.update(compute_metrics(metrics, predictions, labels, is_regression, num_labels))
    return results, predictions


# --- metrics -------------------------------------------------------------------------------------


def default_metrics(num_labels: int, is_regression: bool) -> list[str]:
    """What GLUE reports when a task names none: accuracy (+ f1 for two classes), or
    Pearson and Spearman correlations for regression."""
    if is_regression:
        return list(REGRESSION_METRICS)
    return ["accuracy", "f1"] if num_labels == 2 else ["accuracy"]


def check_metrics(names: Sequence[str], is_regression: bool) -> None:
    """Fail before training on a metric name that is unknown or does not fit the task."""
    unknown = [n for n in names if n not in KNOWN_METRICS]
    if unknown:
        raise FlaxlmError(
            f"task.metrics has unknown metric(s) {unknown}. Known: {list(KNOWN_METRICS)} "
            "(empty → accuracy, + f1 with two labels, or pearson and spearman for regression)."
        )
    kind, allowed = (
        ("regression", REGRESSION_METRICS) if is_regression
        else ("classification", CLASSIFICATION_METRICS)
    )
    wrong = [n for n in names if n not in allowed]
    if wrong:
        raise FlaxlmError(
            f"task.metrics={list(names)}: {wrong} do not apply to {kind} (task.num_labels"
            f"{'=1' if is_regression else ' > 1'}); for {kind} use {list(allowed)}."
        )


def compute_metrics(
    names: Sequence[str],
    predictions: np.ndarray,
    labels: np.ndarray,
    is_regression: bool,
    num_labels: int | None = None,
) -> dict[str, float]:
    """`eval/<name>` for each metric, by scikit-learn and scipy, over all the examples at once.

    f1 is GLUE's: binary with class 1 positive; with more than two classes (num_labels, or the
    classes seen) it is the macro average. A correlation of fewer than two examples, or of a
    constant prediction, is undefined and reported as nan.
    """
    check_metrics(names, is_regression)
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions for {len(labels)} labels")
    return {
        f"eval/{name}": float(_METRICS[name](predictions, labels, num_labels)) for name in names
    }


# scikit-learn and scipy are imported by the metrics that use them: a second at the start of
# every process, which a language model's run never needs.


def _accuracy(predictions, labels, num_labels):
    import sklearn.metrics

    return sklearn.metrics.accuracy_score(labels, predictions)


def _f1(predictions, labels, num_labels):
    import sklearn.metrics

    classes = num_labels or int(max(predictions.max(initial=0), labels.max(initial=0))) + 1
    if classes <= 2:
        return sklearn.metrics.f1_score(labels, predictions, pos_label=1, zero_division=0.0)
    return sklearn.metrics.f1_score(
        labels, predictions, labels=list(range(classes)), average="macro", zero_division=0.0
    )


def _matthews(predictions, labels, num_labels):
    import sklearn.metrics

    return sklearn.metrics.matthews_corrcoef(labels, predictions)


def _correlation(statistic: str):
    def metric(predictions, labels, num_labels):
        import scipy.stats

        if len(labels) < 2:
            return math.nan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", scipy.stats.ConstantInputWarning)
            return getattr(scipy.stats, statistic)(predictions, labels)[0]

    return metric


_METRICS = {
    "accuracy": _accuracy,
    "f1": _f1,
    "matthews": _matthews,
    "pearson": _correlation("pearsonr"),
    "spearman": _correlation("spearmanr"),
}


# --- predictions file ----------------------------------------------------------------------------


def write_predictions(
    path: str,
    predictions: np.ndarray,
    labels: np.ndarray,
    label_names: Sequence[str] | None = None,
) -> None:
    """`predictions.jsonl`: one line per eval example, in dataset order,
    {"index", "prediction", "label"} (+ "prediction_name", "label_name" when classes are named).

    Written to a temporary name and renamed into place, so a killed run never leaves a file
    that looks complete. Every process holds the same predictions: call it on process 0 only.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=".predictions-", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            for index, (prediction, label) in enumerate(zip(predictions.tolist(), labels.tolist())):
                row = {"index": index, "prediction": prediction, "label": label}
                if label_names is not None:
                    row["prediction_name"] = label_names[prediction]
                    row["label_name"] = label_names[label]
                file.write(json.dumps(row) + "\n")
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
