"""Training batches from a streamed corpus (language.streaming): nothing materialised whole.

A background thread reads this process's shard of the stream, tokenises and packs it on the fly
(blocks of max_seq_length tokens across document boundaries, EOS after every document, exactly
as `join_documents` + `cut_blocks` pack a materialised split), shuffles the blocks a window at a
time, and puts whole local batches on a bounded queue a few steps ahead of the training loop.
Memory is bounded by: one encode batch of documents and their int32 ids (a long document is
tokenised in pieces), one shuffle window of blocks, and the queue's batches, whatever the corpus
size.

The shuffle is a *windowed* one: `shuffle_buffer` consecutive blocks are permuted by a seed
derived from (seed, pass, where the window starts in the stream), then emitted. Unlike a
reservoir-style buffer, no block stays behind across windows, so the position after any block
is a handful of integers (`StreamState`) rather than the buffer's contents: restarting from it
re-reads at most one window, and yields the same next batch without repeating or skipping a
document. With shuffle_buffer=1 the blocks come in stream order.

The stream's length is unknown, so there are no epochs: the training loop sees one long epoch
of trainer.max_steps steps. When a process's shard runs out first, it starts a new pass over it
(same documents, new shuffle seed) and says so; a shard that yields no block at all is an error.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

import jax
import numpy as np
from jax.sharding import Mesh

from flaxlm.data.documents import opening_tokens, with_documents
from flaxlm.data.loader import check_same_loader
from flaxlm.data.packing import join_documents
from flaxlm.data.tokenizer import DocumentEncoder
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module
from flaxlm.parallel import global_batch, process_rows

datasets = lazy_module("datasets")
transformers = lazy_module("transformers")

ENCODE_DOCS = 256  # documents tokenised together: the producer's batch of raw text
PREFETCH_BATCHES = 4  # local batches the producer may hold ready ahead of the training step

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class StreamState:
    """Where this process's shard of the training stream stands, after a block or batch."""

    passes: int = 0  # completed passes over the shard
    documents: int = 0  # documents of the shard wholly before the current shuffle window
    token_offset: int = 0  # tokens (its EOS included) of the next document in earlier windows
    window_blocks: int = 0  # blocks of the current window already emitted


def process_shard(train: datasets.IterableDataset, rank: int, world_size: int):
    """This process's documents: every `world_size`-th one from `rank` on, so that processes
    read disjoint documents whose union is the stream. By example, not by file shard: the
    validation head was skipped first, and per-file sharding would split that skip across
    files (each process still reads the whole stream, keeping its share)."""
    if world_size == 1:
        return train
    from datasets.distributed import split_dataset_by_node  # datasets only where it is used

    return split_dataset_by_node(train, rank=rank, world_size=world_size, strategy="examples")


def pack_stream(
    texts: Iterable[str],
    tokenizer: transformers.PreTrainedTokenizerFast,
    max_seq_length: int,
    first_document: int = 0,
    token_offset: int = 0,
    prefix: Sequence[int] = (),
) -> Iterator[tuple[np.ndarray, np.ndarray, int, int]]:
    """(block, starts, document, offset): each block of `max_seq_length` tokens, which of its
    tokens open a document's segment (bool, `documents.opening_tokens`), and the position
    right after it (`offset` tokens of document `document` consumed). `texts` starts at document
    `first_document`, of which the first `token_offset` tokens are skipped. The incomplete
    tail at the end of the stream is dropped, as by `cut_blocks`. `prefix` goes in front of
    every document, as in `join_documents`."""
    encoder, eos = DocumentEncoder(tokenizer.backend_tokenizer), tokenizer.eos_token_id
    carry = np.zeros(0, np.int32)  # tokens after the last whole block, always < max_seq_length
    carry_starts = np.zeros(0, bool)  # which of them open a segment
    first, skip = first_document, token_offset
    warned = False  # about inexact cuts: once per pass, as soon as one is made
    for batch in _batched(texts, ENCODE_DOCS):
        ids = encoder.encode(batch)
        if encoder.inexact_cuts and not warned:
            print(encoder.inexact_cuts_warning(), flush=True)
            warned = True
        joined = join_documents(ids, eos, prefix)
        ends = np.cumsum([len(prefix) + len(doc) + 1 for doc in ids])  # in `joined`, EOS included
        starts = np.concatenate([[0], ends])  # starts[len(ids)] is the end of the batch
        joined_starts = np.zeros(len(joined), bool)
        lengths = np.diff(starts)
        joined_starts[opening_tokens(lengths, bool(prefix))] = True
        stream = np.concatenate([carry, joined[skip:]])
        stream_starts = np.concatenate([carry_starts, joined_starts[skip:]])
        shift = skip - len(carry)  # index in `joined` = index in `stream` + shift
        num_blocks = len(stream) // max_seq_length
        for b in range(num_blocks):
            end = (b + 1) * max_seq_length + shift  # first token after the block, in `joined`
            doc = int(np.searchsorted(ends, end, side="right"))
            # A copy: a view would keep the whole encode batch alive while it waits to be shuffled.
            block = stream[b * max_seq_length : end - shift].copy()
            block_starts = stream_starts[b * max_seq_length : end - shift].copy()
            yield block, block_starts, first + doc, int(end - starts[doc])
        carry = stream[num_blocks * max_seq_length :]
        carry_starts = stream_starts[num_blocks * max_seq_length :]
        first, skip = first + len(ids), 0


def shuffled_blocks(
    shard: datasets.IterableDataset,
    tokenizer: transformers.PreTrainedTokenizerFast,
    max_seq_length: int,
    seed: int,
    shuffle_buffer: int,
    start: StreamState = StreamState(),
    prefix: Sequence[int] = (),
) -> Iterator[tuple[tuple[np.ndarray, np.ndarray], StreamState]]:
    """Every block of `shard` from `start` on, pass after pass (endless), shuffled a window at
    a time, as (tokens, document starts) (`pack_stream`); with each block the state right after
    it. `prefix`: as in `pack_stream`."""
    state = start
    while True:
        fresh = state == StreamState(passes=state.passes)
        emitted = yield from _one_pass(
            shard, tokenizer, max_seq_length, seed, shuffle_buffer, state, prefix
        )
        if fresh and emitted == 0:
            raise FlaxlmError(
                f"This process's share of the training stream makes no block of "
                f"task.max_seq_length={max_seq_length} tokens. Use more text (or a larger "
                "language.max_train_docs), or a smaller task.max_seq_length."
            )
        state = StreamState(passes=state.passes + 1)
        print(
            f"flaxlm: the training stream ended; starting pass {state.passes + 1} over it "
            "with a new shuffle seed", flush=True,
        )


def _one_pass(shard, tokenizer, max_seq_length, seed, shuffle_buffer, state: StreamState,
              prefix: Sequence[int]):
    texts = (row["text"] for row in shard.skip(state.documents))
    packed = pack_stream(texts, tokenizer, max_seq_length, state.documents, state.token_offset,
                         prefix)
    window_start = (state.documents, state.token_offset)
    already_emitted, emitted = state.window_blocks, 0
    for window in _batched(packed, shuffle_buffer):
        # Seeded by where the window starts, so a restart re-draws the same permutation.
        rng = np.random.default_rng([seed % 2**32, state.passes, *window_start])
        order = rng.permutation(len(window))
        window_end = window[-1][2:]  # the position after the window's last block
        for j in range(already_emitted, len(window)):
            after = (
                StreamState(state.passes, *window_start, j + 1)
                if j + 1 < len(window)
                else StreamState(state.passes, *window_end, 0)
            )
            yield window[order[j]][:2], after
            emitted += 1
        window_start, already_emitted = window_end, 0
    return emitted


class Prefetcher:
    """Runs `source` in a daemon thread, at most `size` items ahead of the consumer. An
    exception in the thread is re-raised in the consumer; `close()` stops the thread."""

    def __init__(self, source: Iterator[T], size: int):
        self.size = size
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._produce, args=(source,), daemon=True, name="flaxlm-stream"
        )
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self) -> T:
        kind, value = self._queue.get()
        if kind == "error":
            raise value
        if kind == "end":
            self._queue.put((kind, value))  # stay exhausted
            raise StopIteration
        return value

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout)

    def _produce(self, source: Iterator[T]) -> None:
        try:
            for item in source:
                if not self._put(("item", item)):
                    return
            self._put(("end", None))
        except BaseException as err:  # handed to the consumer, which raises it
            self._put(("error", err))
        finally:
            close = getattr(source, "close", None)
            if close is not None:  # a generator is closed by the thread that runs it
                close()

    def _put(self, message) -> bool:
        """Block until there is room (or close() was called: then False)."""
        while not self._stop.is_set():
            try:
                self._queue.put(message, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


class StreamingLoader:
    """A `BatchSource` over a stream: one epoch of `max_steps` global batches.

    `state()` is the position after the last batch yielded; a loader built with
    `start_from=state` yields the batch that would have come next.
    """

    def __init__(
        self,
        shard: datasets.IterableDataset,
        tokenizer: transformers.PreTrainedTokenizerFast,
        max_seq_length: int,
        global_batch_size: int,
        mesh: Mesh,
        seed: int,
        shuffle_buffer: int,
        max_steps: int,
        prefetch: int = PREFETCH_BATCHES,
        start_from: StreamState | None = None,
        prefix: Sequence[int] = (),
        documents: bool = False,
    ):
        self.shard, self.tokenizer, self.max_seq_length = shard, tokenizer, max_seq_length
        self.prefix = tuple(prefix)  # in front of every document (`join_documents`)
        self.global_batch_size, self.mesh, self.seed = global_batch_size, mesh, seed
        self.shuffle_buffer, self.max_steps, self.prefetch = shuffle_buffer, max_steps, prefetch
        self._state = start_from or StreamState()
        self.documents = documents  # batches carry segment ids and positions (data/documents.py)

    @property
    def steps_per_epoch(self) -> int:
        return self.max_steps  # the stream's length is unknown: one long epoch

    def state(self) -> StreamState:
        return self._state

    def state_dict(self) -> dict:
        """The stream position after the last batch yielded, and what fixes the order."""
        return {"kind": "stream", "seed": self.seed, "shuffle_buffer": self.shuffle_buffer,
                "global_batch_size": self.global_batch_size,
                "stream": dataclasses.asdict(self._state)}

    def load_state_dict(self, saved: dict) -> None:
        """Continue from a checkpoint's position (same order settings, checked)."""
        current = self.state_dict()
        check_same_loader({**saved, "stream": current["stream"]}, current)
        self._state = StreamState(**saved["stream"])

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[jax.Array]:
        """Global batches from the current stream position, until step `steps_per_epoch`.
        `epoch` is ignored: the stream position, not (epoch, step), says where data resumes."""
        _, local_rows = process_rows(self.global_batch_size, self.mesh)
        blocks = shuffled_blocks(
            self.shard, self.tokenizer, self.max_seq_length, self.seed, self.shuffle_buffer,
            self._state, self.prefix,
        )
        batches = Prefetcher(_local_batches(blocks, local_rows, self.documents), self.prefetch)
        try:
            # range first: zip then takes no batch beyond the last step
            for _, (rows, state) in zip(range(start_step, self.steps_per_epoch), batches):
                self._state = state
                yield jax.tree.map(lambda local: global_batch(local, self.mesh), rows)
        finally:
            batches.close()


def _local_batches(blocks, rows: int, documents: bool = False):
    """This process's rows of each global batch (tokens, or with `documents` the dict of
    `documents.with_documents`), with the stream state after them."""
    for group in _batched(blocks, rows):
        if len(group) == rows:  # `blocks` is endless; a short group only if it raised
            tokens_BxL = np.stack([tokens for (tokens, _), _ in group])
            if documents:
                starts_BxL = np.stack([starts for (_, starts), _ in group])
                yield with_documents(tokens_BxL, starts_BxL), group[-1][1]
            else:
                yield tokens_BxL, group[-1][1]


def _batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
