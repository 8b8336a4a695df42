"""Packing: tokenise every document, join them with EOS, cut the stream into equal blocks.

Blocks are exactly `max_seq_length` tokens and cross document boundaries, as in the seed's
`group_texts`; only the remainder at the very end of the stream is dropped. The seed
concatenated Python lists with `sum(lists, [])`, which is quadratic; here each batch of
documents becomes one numpy array and the arrays are concatenated once.

Packed blocks are cached as `.npy` under `<cache_dir>/blocks/`, keyed by the text, the
tokenizer, its EOS id and the block length, written to a temporary name then renamed into
place, and read back memory-mapped.
"""

from __future__ import annotations

import os
import tempfile

import datasets
import numpy as np
import transformers
from tqdm.auto import tqdm

from flaxlm.data.fingerprint import settings_fingerprint, text_fingerprint

ENCODE_BATCH = 1000


def join_documents(token_ids: list[list[int]], eos_id: int) -> np.ndarray:
    """One int32 stream of the documents, each followed by `eos_id`."""
    lengths = np.fromiter((len(ids) + 1 for ids in token_ids), dtype=np.int64, count=len(token_ids))
    stream = np.full(int(lengths.sum()), eos_id, dtype=np.int32)
    # Every document's tokens go right after the previous document's EOS; the EOS slots keep
    # the fill value.
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for start, ids in zip(starts, token_ids):
        stream[start : start + len(ids)] = ids
    return stream


def tokenize_and_pack(
    texts: datasets.Dataset,
    tokenizer: transformers.PreTrainedTokenizerFast,
    max_seq_length: int,
    cache_dir: str,
    desc: str = "tokenize",
) -> np.ndarray:
    """(num_blocks, max_seq_length) int32 token blocks of `texts`, memory-mapped from the cache
    (packed and cached first if absent), so a corpus larger than RAM costs only page cache."""
    key = settings_fingerprint(
        text_fingerprint(texts), tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token_id,
        max_seq_length,
    )
    path = os.path.join(os.path.expanduser(cache_dir), "blocks", f"{key[:24]}.npy")
    if not os.path.exists(path):
        _save_atomically(path, _pack(texts, tokenizer, max_seq_length, desc))
    return np.load(path, mmap_mode="r")


def _pack(texts, tokenizer, max_seq_length: int, desc: str) -> np.ndarray:
    backend = tokenizer.backend_tokenizer
    streams = []
    for start in tqdm(range(0, len(texts), ENCODE_BATCH), desc=desc, unit="batch", leave=False):
        batch = texts[start : start + ENCODE_BATCH]["text"]
        encodings = backend.encode_batch(batch, add_special_tokens=False)
        streams.append(join_documents([e.ids for e in encodings], tokenizer.eos_token_id))
        del encodings  # free them before the next batch is encoded, not after
    return cut_blocks(np.concatenate(streams) if streams else np.zeros(0, np.int32), max_seq_length)


def cut_blocks(stream: np.ndarray, max_seq_length: int) -> np.ndarray:
    """Rows of `max_seq_length` tokens; the incomplete tail of the stream is dropped."""
    num_blocks = len(stream) // max_seq_length
    return stream[: num_blocks * max_seq_length].reshape(num_blocks, max_seq_length)


def _save_atomically(path: str, array: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".npy.tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
