"""Content hashes: they key the on-disk caches (tokenizers, packed blocks), and a run's
checkpoints record the hashes of the data it trains and evaluates on, so that a resume on other
data is noticed (`data_fingerprint`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from flaxlm.lazy_imports import lazy_module

datasets = lazy_module("datasets")

_TEXT_HASHES: dict[str, str] = {}  # datasets' own fingerprint of a dataset → its text hash


def text_fingerprint(texts: datasets.Dataset) -> str:
    """sha256 over every document of a {"text"} dataset, lengths included so that splitting a
    document in two changes the hash. The tokenizer and the block cache both key on the
    training text, so each dataset is hashed once per process (datasets gives every version of
    a dataset its own `_fingerprint`), not once per cache. flaxlm's own `data.texts.Texts`
    (which this module cannot name: it hashes with this module) keep their hash."""
    content = getattr(texts, "content_hash", None)
    if content is not None:
        return content
    if texts._fingerprint not in _TEXT_HASHES:
        _TEXT_HASHES[texts._fingerprint] = _hash_documents(texts)
    return _TEXT_HASHES[texts._fingerprint]


def remember_text_hash(texts: datasets.Dataset, content: str) -> None:
    """Record `content` as the `text_fingerprint` of `texts`, whose maker hashed it already."""
    _TEXT_HASHES[texts._fingerprint] = content


def _hash_documents(texts: datasets.Dataset, batch_size: int = 10_000) -> str:
    return documents_fingerprint(
        text
        for start in range(0, len(texts), batch_size)
        for text in texts[start : start + batch_size]["text"]
    )


def documents_fingerprint(texts: Iterable[str]) -> str:
    """sha256 over documents in order, lengths included (as `text_fingerprint`)."""
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def arrays_fingerprint(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over named arrays: each one's name, dtype, shape and values."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        digest.update(array.reshape(-1).view(np.uint8))
    return digest.hexdigest()


def settings_fingerprint(*parts: Any) -> str:
    """sha256 of JSON-serialisable settings (dicts, lists, strings, numbers)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()

