"""Classification examples as token arrays, and batches of them.

`encode` tokenises a split once into right-padded arrays; a batch takes the rows it needs, cut
to one width: the full `task.max_seq_length`, or with `task.padding=buckets` the smallest bucket
that holds its longest example. Batching itself (the shuffle, evaluation's padding and mask) is
data/loader.py's, the same as for token blocks.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
from jax.sharding import Mesh

from flaxlm.config import Padding, TaskConfig
from flaxlm.data.loader import RowGather, RowLoader, local_part
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module

datasets = lazy_module("datasets")

# Model inputs in every batch; `lengths` (tokens per example) only chooses the bucket.
FEATURES = ("input_ids", "attention_mask", "token_type_ids", "labels")
_ENCODE_CHUNK = 16384  # rows per tokenizer call: the fast tokenizer parallelises within a call
_SMALLEST_BUCKET = 16


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


def example_rows(
    arrays: dict[str, np.ndarray], global_batch_size: int, mesh: Mesh,
    padding: Padding = Padding.max_length,
) -> RowGather:
    """Gathers examples from `arrays` (from `encode`): a batch is a dict of FEATURES, each
    (B, width) or (B,)."""

    def gather(batch_rows: np.ndarray) -> dict[str, jax.Array]:
        width = _width(arrays, batch_rows, padding)
        return {
            name: local_part(
                arrays[name][:, :width] if arrays[name].ndim == 2 else arrays[name],
                batch_rows, global_batch_size, mesh,
            )
            for name in FEATURES
        }

    return gather


def example_loader(
    arrays: dict[str, np.ndarray], global_batch_size: int, mesh: Mesh, *, seed: int,
    padding: Padding = Padding.max_length,
) -> RowLoader:
    """The training loader of encoded examples (`arrays` from `encode`; padding: task.padding)."""
    return RowLoader(len(arrays["labels"]), global_batch_size, seed,
                     example_rows(arrays, global_batch_size, mesh, padding),
                     kind="classify", rows_key="num_examples",
                     settings={"padding": Padding(padding).value})
