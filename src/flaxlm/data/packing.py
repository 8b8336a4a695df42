"""Packing: tokenise every document, join them with EOS, cut the stream into equal blocks.
A tokenizer that keeps its own conventions (`tokenizer.convention`) also puts its BOS, if it adds
one, in front of every document.

Blocks are exactly `max_seq_length` tokens and cross document boundaries (HF's `group_texts`
layout); only the remainder at the very end of the stream is dropped. Each batch of documents
becomes one numpy array, appended to a scratch file: linear time, bounded memory (joining
Python lists with `sum(lists, [])` would be quadratic).
A long document is tokenised in pieces (`DocumentEncoder`), so one huge line costs memory in
proportion to its int32 ids, not the tokenizer's far larger working set for one string.

Packed blocks are cached as `.npy` under `<cache_dir>/blocks/`, keyed by the text, the tokenizer,
its EOS id, the block length and whether the stream offsets where documents start are kept
beside them (`<key>.starts.npy`, for task.document_masking: data/documents.py); written in a
scratch folder then renamed into place, with a record beside them (`<key>.json`: size and
sampled checksum, data/cache.py) that is checked before they are read back memory-mapped;
damaged blocks are packed again. On several hosts process 0 packs while the
others wait, then all read the file (a host without the shared cache packs its own copy). Packing
holds one batch of documents in memory at a time, so corpora far larger than RAM pack too.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from flaxlm import distributed
from flaxlm.data import cache
from flaxlm.data.documents import opening_tokens
from flaxlm.data.fingerprint import settings_fingerprint, text_fingerprint
from flaxlm.data.tokenizer import DocumentEncoder
from flaxlm.lazy_imports import lazy_module

datasets = lazy_module("datasets")
transformers = lazy_module("transformers")

ENCODE_BATCH = 1000  # documents tokenised together
COPY_TOKENS = 1 << 24  # tokens moved at a time from the scratch stream into the blocks


def join_documents(token_ids: list[Sequence[int]], eos_id: int,
                   prefix: Sequence[int] = ()) -> np.ndarray:
    """One int32 stream of the documents, each followed by `eos_id` (and preceded by `prefix`,
    the special tokens a tokenizer that keeps its own conventions puts in front of a text:
    `document_prefix`)."""
    lengths = np.fromiter((len(prefix) + len(ids) + 1 for ids in token_ids), dtype=np.int64,
                          count=len(token_ids))
    stream = np.full(int(lengths.sum()), eos_id, dtype=np.int32)
    # Every document's tokens go right after the previous document's EOS; the EOS slots keep
    # the fill value.
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for start, ids in zip(starts, token_ids):
        stream[start : start + len(prefix)] = prefix
        stream[start + len(prefix) : start + len(prefix) + len(ids)] = ids
    return stream


@dataclasses.dataclass(frozen=True)
class PackedBlocks:
    """Token blocks, and (with `documents`) where in their stream each document's segment
    opens."""

    tokens: np.ndarray  # (num_blocks, max_seq_length) int32, memory-mapped
    # Sorted int64 offsets in the token stream (block r is tokens [r·L, (r+1)·L)) of the
    # tokens that open a document's segment (`documents.opening_tokens`); None where packing
    # did not record them (task.document_masking off).
    document_starts: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)


def tokenize_and_pack(
    texts: datasets.Dataset,
    tokenizer: transformers.PreTrainedTokenizerFast,
    max_seq_length: int,
    cache_dir: str,
    desc: str = "tokenize",
    prefix: Sequence[int] = (),
) -> np.ndarray:
    """(num_blocks, max_seq_length) int32 token blocks of `texts` (`pack_blocks`' tokens)."""
    return pack_blocks(texts, tokenizer, max_seq_length, cache_dir, desc, prefix).tokens


def pack_blocks(
    texts: datasets.Dataset,
    tokenizer: transformers.PreTrainedTokenizerFast,
    max_seq_length: int,
    cache_dir: str,
    desc: str = "tokenize",
    prefix: Sequence[int] = (),
    documents: bool = False,
) -> PackedBlocks:
    """The token blocks of `texts`, memory-mapped from the cache (packed and cached first if
    absent), so a corpus larger than RAM costs only page cache. `prefix` goes in front of every
    document (`join_documents`). With `documents`, where each document starts is recorded too
    (data/documents.py turns it into segment ids and positions), under a cache key of its own."""
    key = settings_fingerprint(
        text_fingerprint(texts), tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token_id,
        # Keyed by a prefix, or documents, only where there is one: flaxlm's own runs without
        # document masking keep their cache keys.
        max_seq_length, *([list(prefix)] if prefix else []),
        *(["document starts"] if documents else []),
    )
    folder = os.path.join(os.path.expanduser(cache_dir), "blocks")
    path = os.path.join(folder, f"{key[:24]}.npy")
    starts_path = _starts_path(path) if documents else None

    def build() -> None:
        cache.remove_stale_scratch(folder)
        if os.path.exists(path):
            problem = _damage(path, starts_path)
            if problem is None:
                return
            print(f"flaxlm: the cached token blocks {path} are damaged ({problem}); packing "
                  "them again", flush=True)
        _pack(texts, tokenizer, max_seq_length, desc, path, prefix, starts_path)

    distributed.primary_first("packing the token blocks", build)
    return PackedBlocks(np.load(path, mmap_mode="r"),
                        np.load(starts_path, mmap_mode="r") if starts_path else None)


def _starts_path(path: str) -> str:
    return os.path.splitext(path)[0] + ".starts.npy"


def _record_path(path: str) -> str:
    return os.path.splitext(path)[0] + ".json"


def _damage(path: str, starts_path: str | None = None) -> str | None:
    """What is wrong with the cached blocks at `path` (and the document starts at
    `starts_path`), or None. Blocks packed before records existed (no record) are kept, and
    recorded, when their size is what their header says."""
    record = _record_path(path)
    if os.path.exists(record):
        return cache.damage(record, _entry_files(path, starts_path))
    problem = _layout_damage(path)
    if problem is None:
        cache.write_record(record, [os.path.basename(path)])
    return problem


def _layout_damage(path: str) -> str | None:
    """Whether the .npy file at `path` has the size its header implies."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(f)
            expected = f.tell() + int(np.prod(shape)) * dtype.itemsize
    except (OSError, ValueError) as err:
        return f"not a readable .npy file: {err}"
    size = os.path.getsize(path)
    return None if size == expected else f"{size:,} bytes where its header implies {expected:,}"


def _entry_files(path: str, starts_path: str | None) -> list[str]:
    """The files of one cache entry, by name: the blocks, and the document starts if any."""
    return [os.path.basename(p) for p in (path, starts_path) if p]


def _pack(texts, tokenizer, max_seq_length: int, desc: str, path: str,
          prefix: Sequence[int] = (), starts_path: str | None = None) -> None:
    """Write the blocks of `texts` to `path` holding one batch of documents in memory at a time:
    token ids go to a scratch file batch by batch, then the whole blocks are laid out as .npy.
    Both are made in a scratch folder beside `path`; the record, then the finished blocks, are
    renamed into place, so blocks in the cache always have a record (one key's blocks are the
    same bytes whoever packs them, so a record renamed in over an older one says the same). A
    killed run leaves nothing that a later run would trust, and a scratch folder that the next
    use removes. With `starts_path`, the stream offsets where documents start are written
    there too (int64 .npy), in the same way."""
    with cache.scratch_folder(os.path.dirname(path)) as scratch:
        stream_path = os.path.join(scratch, "stream.int32")
        lengths_path = os.path.join(scratch, "lengths.int64")
        with open(stream_path, "wb") as stream_file, open(lengths_path, "wb") as lengths_file:
            for ids, lengths in _token_batches(texts, tokenizer, desc, prefix):
                ids.tofile(stream_file)
                lengths.tofile(lengths_file)
        blocks_path = os.path.join(scratch, os.path.basename(path))
        _write_blocks(stream_path, blocks_path, max_seq_length)
        if starts_path:
            _write_starts(lengths_path, os.path.join(scratch, os.path.basename(starts_path)),
                          prefixed=bool(prefix))
        names = _entry_files(path, starts_path)
        record_path = os.path.join(scratch, os.path.basename(_record_path(path)))
        cache.write_record(record_path, names)
        os.replace(record_path, _record_path(path))
        # The blocks last: they are what says the entry exists.
        for name in reversed(names):
            os.replace(os.path.join(scratch, name), os.path.join(os.path.dirname(path), name))


def _token_batches(texts, tokenizer, desc: str,
                   prefix: Sequence[int]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The token stream of `texts`, `prefix` before and EOS after every document, one array
    per batch of documents, with the documents' lengths in it (int64)."""
    encoder = DocumentEncoder(tokenizer.backend_tokenizer)
    for start in tqdm(range(0, len(texts), ENCODE_BATCH), desc=desc, unit="batch", leave=False):
        batch = texts[start : start + ENCODE_BATCH]["text"]
        ids = encoder.encode(batch)
        lengths = np.fromiter((len(prefix) + len(doc) + 1 for doc in ids), np.int64, len(ids))
        yield join_documents(ids, tokenizer.eos_token_id, prefix), lengths
    if warning := encoder.inexact_cuts_warning():
        print(warning, flush=True)


def _write_blocks(stream_path: str, blocks_path: str, max_seq_length: int) -> None:
    num_blocks = os.path.getsize(stream_path) // 4 // max_seq_length
    blocks = np.lib.format.open_memmap(
        blocks_path, mode="w+", dtype=np.int32, shape=(num_blocks, max_seq_length)
    )
    if num_blocks:
        stream = np.memmap(stream_path, dtype=np.int32, mode="r")
        rows = max(1, COPY_TOKENS // max_seq_length)
        for first in range(0, num_blocks, rows):
            last = min(first + rows, num_blocks)
            blocks[first:last] = cut_blocks(
                stream[first * max_seq_length : last * max_seq_length], max_seq_length
            )
    blocks.flush()


def _write_starts(lengths_path: str, starts_path: str, prefixed: bool) -> None:
    """The stream offsets of the tokens that open each document's segment
    (`documents.opening_tokens`), from the documents' lengths."""
    count = os.path.getsize(lengths_path) // 8
    offsets = np.lib.format.open_memmap(starts_path, mode="w+", dtype=np.int64, shape=(count,))
    if count:
        opening_tokens(np.memmap(lengths_path, dtype=np.int64, mode="r"), prefixed, out=offsets)
    offsets.flush()


def cut_blocks(stream: np.ndarray, max_seq_length: int) -> np.ndarray:
    """Rows of `max_seq_length` tokens; the incomplete tail of the stream is dropped."""
    num_blocks = len(stream) // max_seq_length
    return stream[: num_blocks * max_seq_length].reshape(num_blocks, max_seq_length)
