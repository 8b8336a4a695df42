"""The training loader of a mixture (data/mixture.py says how rows are drawn): global batches
of whole blocks, each from one source, in the proportions of the weights.

Each process computes the whole global schedule (a few integers per row) and reads only its
own rows: a packed source's row number picks the block, so processes read disjoint blocks of
it; a streamed source is read from this process's own shard of it (every `world`-th document),
its next blocks for each of this process's rows of it. The loader's position is the schedule's
(`SchedulePosition`: the same on every process) and each streamed source's stream position
(this process's own), which a checkpoint keeps per process (training/checkpoint/resume.py).
An epoch of the mixture is as many blocks as its packed sources hold together (a streamed
source has no length: then trainer.max_steps makes one long epoch).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator, Sequence

import grain
import jax
import numpy as np
from jax.sharding import Mesh

from flaxlm import distributed
from flaxlm.data.documents import block_starts, with_documents
from flaxlm.data.loader import Batch, check_same_loader
from flaxlm.data.mixture import MixtureSchedule, SchedulePosition
from flaxlm.data.streaming import PREFETCH_BATCHES, Prefetcher, StreamState, shuffled_blocks
from flaxlm.lazy_imports import lazy_module
from flaxlm.parallel import global_batch, process_rows

datasets = lazy_module("datasets")
transformers = lazy_module("transformers")


def source_seed(seed: int, name: str) -> int:
    """A source's own shuffle seed: the run's, and the source's name (not its place in the
    list, so that a source's order does not depend on the others)."""
    return int(np.random.SeedSequence([seed % 2**32, zlib.crc32(name.encode())])
               .generate_state(1)[0])


@dataclasses.dataclass
class PackedSource:
    """A source's cached blocks, read in a seeded shuffle that is drawn afresh for each of its
    own epochs (as `RowLoader` reads a single corpus)."""

    name: str
    blocks: np.ndarray  # (num_blocks, max_seq_length), memory-mapped
    document_starts: np.ndarray | None  # `PackedBlocks.document_starts`
    seed: int  # the run's; the source's own is derived from it and its name

    def __post_init__(self):
        shuffled = grain.MapDataset.source(np.arange(len(self.blocks)))
        self._order = shuffled.shuffle(seed=source_seed(self.seed, self.name))

    def rows(self, numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The blocks at the source's row `numbers` (counted over its epochs: row n is row
        n mod N of epoch n // N), and which of their tokens open a document, if recorded."""
        indices = np.fromiter((self._order[int(n)] for n in numbers), np.int64, len(numbers))
        starts = (None if self.document_starts is None
                  else block_starts(self.document_starts, indices, self.blocks.shape[1]))
        return np.asarray(self.blocks[indices]), starts

    def announce_epochs(self, taken_before: int, taken_after: int) -> None:
        """One line when the rows drawn from the source (over all processes) went from
        `taken_before` to `taken_after` across the start of one of its epochs."""
        size = len(self.blocks)
        first_of_epoch = -(-taken_before // size) * size  # the first epoch start from there
        if 0 < first_of_epoch < taken_after and distributed.is_primary():
            print(f"flaxlm: mixture source {self.name} ran out and begins its epoch "
                  f"{(taken_after - 1) // size + 1} (a new shuffle of its {size} blocks)",
                  flush=True)


@dataclasses.dataclass
class StreamedSource:
    """A streamed source: this process's shard of its training stream, packed on the fly and
    shuffled a window at a time (data/streaming.py)."""

    name: str
    shard: datasets.IterableDataset  # this process's documents
    tokenizer: transformers.PreTrainedTokenizerFast
    max_seq_length: int
    seed: int  # the run's; the source's own is derived from it and its name
    shuffle_buffer: int
    prefix: Sequence[int] = ()

    def blocks(self, start: StreamState) -> Iterator[tuple[tuple[np.ndarray, np.ndarray],
                                                          StreamState]]:
        return shuffled_blocks(self.shard, self.tokenizer, self.max_seq_length,
                               source_seed(self.seed, self.name), self.shuffle_buffer, start,
                               self.prefix)


Source = PackedSource | StreamedSource


class MixtureLoader:
    """A `BatchSource` over the sources of a mixture: batches of `global_batch_size` blocks in
    the schedule's order; `state_dict()` is the position after the last batch yielded."""

    def __init__(self, sources: Sequence[Source], schedule: MixtureSchedule,
                 global_batch_size: int, mesh: Mesh, seed: int, max_steps: int | None,
                 documents: bool = False, prefetch: int = PREFETCH_BATCHES):
        self.sources, self.schedule = list(sources), schedule
        self.global_batch_size, self.mesh, self.seed = global_batch_size, mesh, seed
        self.documents = documents  # batches carry segment ids and positions
        self.prefetch = prefetch
        self.streamed = [s.name for s in self.sources if isinstance(s, StreamedSource)]
        packed = sum(len(s.blocks) for s in self.sources if isinstance(s, PackedSource))
        # A stream has no length: trainer.max_steps (required then) is one long epoch.
        self._steps_per_epoch = max_steps if self.streamed else packed // global_batch_size
        self._position = schedule.start()
        self._streams = {name: StreamState() for name in self.streamed}

    @property
    def steps_per_epoch(self) -> int:
        return self._steps_per_epoch

    def state_dict(self) -> dict:
        """What fixes the batches (checked on resume) and the position after the last one."""
        return {"kind": "mixture", "seed": self.seed, "global_batch_size": self.global_batch_size,
                "sources": [s.name for s in self.sources],
                "num_blocks": {s.name: len(s.blocks) for s in self.sources
                               if isinstance(s, PackedSource)},
                "position": self._position.to_json(),
                # this process's own: a checkpoint keeps every process's (resume.py)
                "streams": {name: dataclasses.asdict(state)
                            for name, state in self._streams.items()}}

    def load_state_dict(self, saved: dict) -> None:
        """Continue from a checkpoint's position (the same sources, seed and batch, checked)."""
        current = self.state_dict()
        check_same_loader({**saved, "position": current["position"],
                           "streams": current["streams"]}, current)
        self._position = SchedulePosition.from_json(saved["position"])
        self._streams = {name: StreamState(**saved["streams"][name]) for name in self.streamed}

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """Global batches from the current position until step `steps_per_epoch` of `epoch`.
        The position, not (epoch, step), says which rows come next."""
        first, count = process_rows(self.global_batch_size, self.mesh)
        local = self.local_batches(first, count)
        batches = Prefetcher(local, self.prefetch) if self.streamed else local
        try:
            for _, (rows, position, streams) in zip(range(start_step, self.steps_per_epoch),
                                                    batches):
                self._position, self._streams = position, streams
                yield jax.tree.map(lambda part: global_batch(part, self.mesh), rows)
        finally:
            batches.close()

    def local_batches(self, first: int, count: int):
        """Rows [first, first + count) of each global batch (a process's: `process_rows`) from
        the current position on, with the position after the batch (the schedule's, and the
        streams' as this process reads them), as numpy arrays."""
        position, streams = self._position, dict(self._streams)
        readers = {s.name: s.blocks(streams[s.name]) for s in self.sources
                   if isinstance(s, StreamedSource)}
        try:
            while True:
                before = position.taken
                sources, numbers, position = self.schedule.draw(position, self.global_batch_size)
                for source, taken_before, taken_after in zip(self.sources, before, position.taken):
                    if isinstance(source, PackedSource):
                        source.announce_epochs(taken_before, taken_after)
                sources, numbers = sources[first:first + count], numbers[first:first + count]
                tokens = starts = None
                for index, source in enumerate(self.sources):
                    mine = np.flatnonzero(sources == index)
                    if not len(mine):
                        continue
                    if isinstance(source, PackedSource):
                        part, part_starts = source.rows(numbers[mine])
                    else:
                        read = [next(readers[source.name]) for _ in mine]
                        part = np.stack([block for (block, _), _ in read])
                        part_starts = np.stack([opening for (_, opening), _ in read])
                        streams[source.name] = read[-1][1]
                    if tokens is None:
                        tokens = np.zeros((count, part.shape[1]), part.dtype)
                        starts = np.zeros((count, part.shape[1]), bool)
                    tokens[mine] = part
                    if part_starts is not None:
                        starts[mine] = part_starts
                rows = with_documents(tokens, starts) if self.documents else tokens
                yield rows, position, dict(streams)
        finally:
            for reader in readers.values():
                reader.close()

