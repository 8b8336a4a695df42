"""In-memory datasets named by their content.

`datasets` names every dataset it holds (its `_fingerprint`, which keys the cache files of later
transforms). A table made in memory (`Dataset.from_dict`) it names by pickling the whole table
with dill: a pass over every document at each start, and one that fails outright where pyarrow
lies outside the interpreter's prefix (packages installed with `pip install --target` and found
through PYTHONPATH, as on a TPU VM): dill pickles such a module's classes by value, and pyarrow's
`MonthDayNano` cannot be ("it's not found as builtins.MonthDayNano"), whatever pyarrow's
version. flaxlm hashes its text anyway (its caches are keyed by that hash), so every in-memory
dataset it makes is built here, handed its name, and `datasets` never pickles a table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flaxlm.data.fingerprint import documents_fingerprint, remember_text_hash, settings_fingerprint
from flaxlm.lazy_imports import lazy_module

datasets = lazy_module("datasets")
pa = lazy_module("pyarrow")


def text_dataset(texts: Sequence[str]) -> datasets.Dataset:
    """A {"text"} dataset of `texts`, named by their content hash (`documents_fingerprint`),
    which `text_fingerprint` then knows without reading the texts again."""
    content = documents_fingerprint(texts)
    features = datasets.Features({"text": datasets.Value("string")})
    table = named_dataset({"text": texts}, features, content)
    remember_text_hash(table, content)
    return table


def named_dataset(columns: Mapping[str, Any], features: datasets.Features,
                  fingerprint: str) -> datasets.Dataset:
    """A dataset of `columns` (lists or Arrow arrays) typed by `features`, named `fingerprint`:
    a hash of everything the columns were made from, as `datasets` names its transforms."""
    table = pa.Table.from_pydict(dict(columns), schema=features.arrow_schema)
    return datasets.Dataset(datasets.table.InMemoryTable(table),
                            info=datasets.DatasetInfo(features=features), fingerprint=fingerprint)


def derived_fingerprint(source: datasets.Dataset, *how: Any) -> str:
    """The name of a dataset made from `source` by `how` (settings, JSON-serialisable)."""
    return settings_fingerprint(source._fingerprint, *how)
