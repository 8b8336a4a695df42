"""Training rows of conversations from a stream (task.streaming): a Hub chat dataset or local
files read as they are needed, nothing materialised whole.

This process's shard of the stream (`streaming.process_shard`) is checked, encoded and laid out
in rows exactly as `chat_packing` lays out a materialised split (next fit, in stream order; a
conversation longer than a row truncated or dropped), then batched. There is no shuffle beyond
the order of the stream. The position after a batch is the count of the shard's conversations
that its rows used, plus the passes over the shard: a row never holds part of a conversation, so
restarting there yields the same next rows. The stream's length is unknown, so there are no
epochs (trainer.max_steps says how long); a shard that runs out starts a new pass over it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import jax
import numpy as np
from jax.sharding import Mesh

from flaxlm.config import LongConversations
from flaxlm.data.chat_packing import layout_rows
from flaxlm.data.chat_template import encode_chat
from flaxlm.data.loader import check_same_loader
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module
from flaxlm.parallel import global_batch, process_rows

datasets = lazy_module("datasets")


@dataclasses.dataclass(frozen=True)
class ChatStreamState:
    passes: int = 0  # completed passes over the shard
    conversations: int = 0  # conversations of the current pass wholly in emitted rows


class ChatStreamLoader:
    """A `BatchSource` over a stream of conversations: one epoch of `max_steps` batches."""

    def __init__(self, shard: datasets.IterableDataset, turns_of: Callable[[dict, str], list],
                 tokenizer, max_seq_length: int, policy: LongConversations, pad_id: int,
                 pack: bool, global_batch_size: int, mesh: Mesh, max_steps: int):
        self.shard, self.turns_of, self.tokenizer = shard, turns_of, tokenizer
        self.max_seq_length, self.policy, self.pad_id, self.pack = (max_seq_length, policy,
                                                                    pad_id, pack)
        self.global_batch_size, self.mesh, self.max_steps = global_batch_size, mesh, max_steps
        self._state = ChatStreamState()

    @property
    def steps_per_epoch(self) -> int:
        return self.max_steps

    def state_dict(self) -> dict:
        return {"kind": "chat stream", "global_batch_size": self.global_batch_size,
                "max_seq_length": self.max_seq_length, "pack": self.pack,
                "stream": dataclasses.asdict(self._state)}

    def load_state_dict(self, saved: dict) -> None:
        current = self.state_dict()
        check_same_loader({**saved, "stream": current["stream"]}, current)
        self._state = ChatStreamState(**saved["stream"])

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, jax.Array]]:
        """Global batches from the current stream position, until step `steps_per_epoch`."""
        _, local_rows = process_rows(self.global_batch_size, self.mesh)
        batches = self._local_batches(local_rows)
        for _, (rows, state) in zip(range(start_step, self.steps_per_epoch), batches):
            self._state = state
            yield {key: global_batch(values, self.mesh) for key, values in rows.items()}

    def _local_batches(self, count: int):
        """This process's rows of each batch, with the stream position after them."""
        rows = []
        for row, state in self._rows():
            rows.append(row)
            if len(rows) == count:
                yield {key: np.stack([r[key] for r in rows]) for key in rows[0]}, state
                rows = []

    def _rows(self):
        """Rows, each with the position after it: the conversations before the first one that
        did not fit it (that one opens the next row)."""
        state = self._state
        while True:
            pending, used, consumed = [], 0, state.conversations
            yielded = False
            for index, record in enumerate(self.shard.skip(state.conversations)):
                where = f"the training stream, conversation {state.conversations + index + 1}"
                ids, mask = encode_chat(self.tokenizer, self.turns_of(record, where), where)
                if len(ids) > self.max_seq_length:
                    if self.policy == LongConversations.drop:
                        continue
                    ids, mask = ids[: self.max_seq_length], mask[: self.max_seq_length]
                if not mask[1:].any():
                    continue
                if pending and (not self.pack or used + len(ids) > self.max_seq_length):
                    consumed = state.conversations + index
                    yield self._row(pending), dataclasses.replace(state, conversations=consumed)
                    yielded, pending, used = True, [], 0
                pending.append((ids, mask))
                used += len(ids)
            if pending:  # the shard's last row, then a new pass
                yielded = True
                yield self._row(pending), ChatStreamState(state.passes + 1, 0)
            if not yielded:
                raise FlaxlmError(
                    "The training stream of this process holds no conversation with an "
                    "assistant token within task.max_seq_length. Check the data and "
                    "task.long_conversations, or use fewer processes for a small stream.")
            print(f"flaxlm: the training stream's shard ran out after {state.passes + 1} "
                  "pass(es); reading it again from its start", flush=True)
            state = ChatStreamState(state.passes + 1, 0)

    def _row(self, encoded) -> dict[str, np.ndarray]:
        return {key: values[0] for key, values in
                layout_rows(encoded, self.max_seq_length, self.pad_id, pack=True).items()}
