"""Conversations as rows of exactly `max_seq_length` tokens, with their target masks.

With task.document_masking each row holds as many whole conversations as fit one after the
other (next fit, in data order), each a segment of its own (segment ids, positions restarting
at each: data/documents.py), so attention never crosses a conversation; the rest of the row is
padding, a segment of its own. Without it each row holds one conversation, padded. Either way
padding is never a target, and a conversation never spans two rows: one longer than a row is
truncated to it or dropped (task.long_conversations), and counted.

A batch is the dict of (B, L) arrays under `CHAT_KEYS`: what `documents.with_documents`
gives, plus `target_mask`, True on the tokens the loss scores (the assistant's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh

from flaxlm.config import LongConversations
from flaxlm.data.chat_template import encode_chat
from flaxlm.data.documents import INPUT_IDS, POSITIONS, SEGMENT_IDS, TARGET_MASK
from flaxlm.data.loader import RowGather, RowLoader, local_part

CHAT_KEYS = (INPUT_IDS, SEGMENT_IDS, POSITIONS, TARGET_MASK)


@dataclasses.dataclass(frozen=True)
class ChatRows:
    """Rows of conversations, and what became of the ones that did not fit a row."""

    arrays: dict[str, np.ndarray]  # CHAT_KEYS → (num_rows, max_seq_length)
    conversations: int  # those in the rows
    truncated: int
    dropped: int  # too long with task.long_conversations=drop, or no target left once cut

    def __len__(self) -> int:
        return len(self.arrays[INPUT_IDS])

    def describe(self, name: str, policy: LongConversations) -> str:
        """'120 train conversations in 40 rows (3 truncated, 1 dropped)'."""
        changed = [f"{self.truncated} truncated"] * bool(self.truncated) + [
            f"{self.dropped} dropped"] * bool(self.dropped)
        note = f" ({', '.join(changed)}: task.long_conversations={policy.value})" if changed else ""
        return f"{self.conversations} {name} conversations in {len(self)} rows{note}"


def encode_conversations(tokenizer, conversations: Sequence[list[dict]], max_seq_length: int,
                         policy: LongConversations, where: str, pad_id: int,
                         pack: bool) -> ChatRows:
    """Each conversation encoded with its target mask (`chat_template.encode_chat`), cut or
    dropped when longer than a row, then laid out in rows (`layout_rows`)."""
    encoded, truncated, dropped = [], 0, 0
    for index, turns in enumerate(conversations):
        ids, mask = encode_chat(tokenizer, turns, f"{where}, conversation {index + 1}")
        if len(ids) > max_seq_length:
            if policy == LongConversations.drop:
                dropped += 1
                continue
            ids, mask = ids[:max_seq_length], mask[:max_seq_length]
            truncated += 1
        if not mask[1:].any():  # the first token is predicted from nothing: never a target
            dropped += 1
            continue
        encoded.append((ids, mask))
    arrays = layout_rows(encoded, max_seq_length, pad_id, pack)
    return ChatRows(arrays, len(encoded), truncated, dropped)


def layout_rows(encoded: Sequence[tuple[np.ndarray, np.ndarray]], max_seq_length: int,
                pad_id: int, pack: bool) -> dict[str, np.ndarray]:
    """(ids, target mask) pairs, each at most `max_seq_length` long, as rows: several per row
    when `pack`, else one."""
    rows: list[list[int]] = []  # indices into `encoded`, row by row
    used = max_seq_length
    for index, (ids, _) in enumerate(encoded):
        if not pack or used + len(ids) > max_seq_length:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += len(ids)
    L = max_seq_length
    ids_NxL = np.full((len(rows), L), pad_id, np.int32)
    segments_NxL = np.zeros((len(rows), L), np.int32)
    positions_NxL = np.zeros((len(rows), L), np.int32)
    targets_NxL = np.zeros((len(rows), L), bool)
    for row, members in enumerate(rows):
        start = 0
        for segment, index in enumerate(members):
            ids, mask = encoded[index]
            end = start + len(ids)
            ids_NxL[row, start:end] = ids
            targets_NxL[row, start:end] = mask
            segments_NxL[row, start:end] = segment
            positions_NxL[row, start:end] = np.arange(len(ids))
            start = end
        # The padding: a segment of its own, so no conversation attends to it.
        segments_NxL[row, start:] = len(members)
        positions_NxL[row, start:] = np.arange(L - start)
    return {INPUT_IDS: ids_NxL, SEGMENT_IDS: segments_NxL, POSITIONS: positions_NxL,
            TARGET_MASK: targets_NxL}


def chat_rows(arrays: dict[str, np.ndarray], global_batch_size: int, mesh: Mesh) -> RowGather:
    """Gathers rows of `arrays` as this process's part of a global batch of each."""

    def gather(batch_rows: np.ndarray):
        return {key: local_part(values, batch_rows, global_batch_size, mesh)
                for key, values in arrays.items()}

    return gather


def chat_loader(rows: ChatRows, global_batch_size: int, mesh: Mesh, *, seed: int) -> RowLoader:
    """The training loader of conversation rows: a seeded shuffle per epoch, as for blocks."""
    return RowLoader(len(rows), global_batch_size, seed,
                     chat_rows(rows.arrays, global_batch_size, mesh),
                     kind="chat", rows_key="num_blocks")
