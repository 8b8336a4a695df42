"""Batches of token blocks as global, sharded `jax.Array`s.

Training: a seeded shuffle per epoch (indexing grain's shuffled `MapDataset` past its length
draws a fresh permutation for every pass, so epoch e is indices [e*N, (e+1)*N)), the
incomplete final batch dropped, and each process reading only its own rows.
A position in the stream is just (epoch, step), which makes resuming exact.

Evaluation: every block exactly once, in order; the last batch is padded with zero rows and a
row mask says which rows are real.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import grain
import jax
import numpy as np
from jax.sharding import Mesh

from flaxlm.errors import FlaxlmError
from flaxlm.parallel import global_batch, process_rows


@dataclasses.dataclass
class TrainLoader:
    blocks: np.ndarray  # (num_blocks, max_seq_length)
    global_batch_size: int
    mesh: Mesh
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return len(self.blocks) // self.global_batch_size

    def state_dict(self) -> dict:
        """What fixes the order of batches: with (epoch, step in epoch), which the training
        loop saves alongside, the loader's whole position for a checkpoint."""
        return {"kind": "blocks", "seed": self.seed, "num_blocks": len(self.blocks),
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, saved: dict) -> None:
        """Check that a checkpoint's loader would yield the batches this one yields."""
        check_same_loader(saved, self.state_dict())

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[jax.Array]:
        """The global batches of `epoch`, from `start_step` on."""
        num_blocks, rows = len(self.blocks), self.global_batch_size
        first_row, local_rows = process_rows(rows, self.mesh)
        shuffled = grain.MapDataset.source(self.blocks).shuffle(seed=self.seed)
        for step in range(start_step, self.steps_per_epoch):
            start = epoch * num_blocks + step * rows + first_row
            local = np.stack([shuffled[i] for i in range(start, start + local_rows)])
            yield global_batch(local, self.mesh)


def eval_batches(
    blocks: np.ndarray, global_batch_size: int, mesh: Mesh
) -> Iterator[tuple[jax.Array, jax.Array]]:
    """(inputs_BxL, row_mask_B) over all `blocks`; padding rows carry mask 0."""
    first_row, local_rows = process_rows(global_batch_size, mesh)
    for start in range(0, len(blocks), global_batch_size):
        rows = blocks[start + first_row : start + first_row + local_rows]
        pad = local_rows - len(rows)
        mask = np.concatenate([np.ones(len(rows), np.int32), np.zeros(pad, np.int32)])
        rows = np.concatenate([rows, np.zeros((pad, blocks.shape[1]), blocks.dtype)])
        yield global_batch(rows, mesh), global_batch(mask, mesh)


def num_eval_batches(num_blocks: int, global_batch_size: int) -> int:
    return -(-num_blocks // global_batch_size)


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
