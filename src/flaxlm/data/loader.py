"""Batches of rows as global, sharded `jax.Array`s: one training loader and one evaluation
batching for every kind of data.

Both count rows 0..N-1 and hand the indices of each global batch to a `RowGather`, which turns
them into this process's part of the batch: packed token blocks here (`block_rows`), encoded
examples in data/encoding.py. Each process reads only the rows of its own devices.

Training (`RowLoader`): a seeded shuffle per epoch (indexing grain's shuffled `MapDataset` past
its length draws a fresh permutation for every pass, so epoch e is indices [e*N, (e+1)*N)), the
incomplete final batch dropped. A position in the data is just (epoch, step), which makes
resuming exact.

Evaluation (`eval_batches`): every row exactly once, in order; the last batch is padded with
zero rows and a row mask says which rows are real.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Protocol

import grain
import jax
import numpy as np
from jax.sharding import Mesh

from flaxlm.data.documents import block_starts, with_documents
from flaxlm.errors import FlaxlmError
from flaxlm.parallel import global_batch, process_rows

# Packed blocks (B, L), or named arrays: examples, or blocks with their documents' segment ids
# and positions (data/documents.py).
Batch = jax.Array | dict[str, jax.Array]

# The global batch whose rows are the given indices, as this process's part of global arrays.
# Fewer indices than the batch size (only evaluation's last batch) are filled up with zero rows.
RowGather = Callable[[np.ndarray], Batch]

# The loader-state keys (`RowLoader.rows_key`) that count the training data rather than fix how
# it is read: a run resumed on changed data knowingly (trainer.resume_on_changed_data) may
# change them.
DATA_SIZE_KEYS = ("num_blocks", "num_examples")


class BatchSource(Protocol):
    """What the training loop reads: epochs of global batches, and a state that a checkpoint
    keeps so that a resumed run reads on exactly where it stopped."""

    @property
    def steps_per_epoch(self) -> int: ...

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """The global batches of `epoch`, from `start_step` on."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, saved: dict) -> None: ...


@dataclasses.dataclass
class RowLoader:
    """Training batches over rows 0..num_rows-1: a seeded shuffle per epoch, the incomplete
    last batch dropped."""

    num_rows: int
    global_batch_size: int
    seed: int
    gather: RowGather
    kind: str  # names the data in the state dict: "blocks", "classify"
    rows_key: str  # the state dict's name for num_rows
    settings: dict = dataclasses.field(default_factory=dict)  # the rest that fixes the batches

    @property
    def steps_per_epoch(self) -> int:
        return self.num_rows // self.global_batch_size  # 0 when N < one batch

    def state_dict(self) -> dict:
        """What fixes the order of batches: with (epoch, step in epoch), which the training
        loop saves alongside, the loader's whole position for a checkpoint."""
        return {"kind": self.kind, "seed": self.seed, self.rows_key: self.num_rows,
                "global_batch_size": self.global_batch_size, **self.settings}

    def load_state_dict(self, saved: dict) -> None:
        """Check that a checkpoint's loader would yield the batches this one yields."""
        check_same_loader(saved, self.state_dict())

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """The global batches of `epoch`, from `start_step` on."""
        rows = self.global_batch_size
        shuffled = grain.MapDataset.source(np.arange(self.num_rows)).shuffle(seed=self.seed)
        for step in range(start_step, self.steps_per_epoch):
            start = epoch * self.num_rows + step * rows
            batch_rows = np.fromiter(
                (shuffled[i] for i in range(start, start + rows)), np.int64, count=rows
            )
            yield self.gather(batch_rows)


def eval_batches(
    num_rows: int, global_batch_size: int, mesh: Mesh, gather: RowGather
) -> Iterator[tuple[Batch, jax.Array]]:
    """(batch, row_mask_B) over rows 0..num_rows-1, each exactly once and in order: batch b
    holds rows [b*G, (b+1)*G). A process takes the rows of its own devices, so the zero rows
    that fill the last batch (mask 0) always sit at its end, after the real rows (mask 1)."""
    real = np.ones(num_rows, np.int32)
    for start in range(0, num_rows, global_batch_size):
        batch_rows = np.arange(start, min(start + global_batch_size, num_rows))
        yield gather(batch_rows), local_part(real, batch_rows, global_batch_size, mesh)


def num_eval_batches(num_rows: int, global_batch_size: int) -> int:
    return -(-num_rows // global_batch_size)


def local_part(
    array: np.ndarray, batch_rows: np.ndarray, global_batch_size: int, mesh: Mesh
) -> jax.Array:
    """This process's rows of `array` among a global batch's `batch_rows`, as its part of one
    global array; a batch short of `global_batch_size` rows is filled up with zero rows."""
    first, count = process_rows(global_batch_size, mesh)
    return global_batch(_filled(array[batch_rows[first : first + count]], count), mesh)


def _filled(values: np.ndarray, count: int) -> np.ndarray:
    """`values` filled up with zero rows to `count` rows."""
    pad = count - len(values)
    if pad:
        values = np.concatenate([values, np.zeros((pad, *values.shape[1:]), values.dtype)])
    return values


def block_rows(blocks: np.ndarray, global_batch_size: int, mesh: Mesh,
               document_starts: np.ndarray | None = None) -> RowGather:
    """Gathers packed token blocks (num_blocks, max_seq_length): a batch is one (B, L) array;
    with `document_starts` (`packing.PackedBlocks`), a dict with the blocks' segment ids and
    positions too (`documents.with_documents`)."""

    def gather(batch_rows: np.ndarray) -> Batch:
        if document_starts is None:
            return local_part(blocks, batch_rows, global_batch_size, mesh)
        first, count = process_rows(global_batch_size, mesh)
        rows = batch_rows[first : first + count]
        starts_BxL = block_starts(document_starts, rows, blocks.shape[1])
        local = with_documents(_filled(blocks[rows], count), _filled(starts_BxL, count))
        return {key: global_batch(value, mesh) for key, value in local.items()}

    return gather


def block_loader(
    blocks: np.ndarray, global_batch_size: int, mesh: Mesh, *, seed: int,
    document_starts: np.ndarray | None = None,
) -> RowLoader:
    """The training loader of packed token blocks (num_blocks, max_seq_length), with their
    documents' segment ids and positions where `document_starts` is given (`block_rows`)."""
    return RowLoader(len(blocks), global_batch_size, seed,
                     block_rows(blocks, global_batch_size, mesh, document_starts),
                     kind="blocks", rows_key="num_blocks")


def check_same_loader(saved: dict, current: dict) -> None:
    """A resumed run must read the same data in the same order; name what differs."""
    differences = [f"{key}: {saved.get(key)!r} → {current[key]!r}"
                   for key in current if saved.get(key) != current[key]]
    if differences:
        raise FlaxlmError(
            "The checkpoint's training data differs from this run's (" + "; ".join(differences)
            + "), so resuming would not continue the same run. Resume with the run's own "
            "language, tokenizer, task.max_seq_length, seed and batch settings, or start a new "
            "run (trainer.resume=never and a new run_dir)."
        )
