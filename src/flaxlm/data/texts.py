"""Documents held in a Python list: what the builtin corpus, plain-text files and JSON Lines
files become, read by flaxlm itself rather than by `datasets`.

Importing `datasets` (pandas and pyarrow under it) takes seconds at the start of a run, more on
a TPU VM, and a run whose tokenizer and packed blocks are in its cache needs nothing of the text
but its content hash. `Texts` has the part of `datasets.Dataset`'s interface that tokenizing,
packing, hashing and splitting use (a length, a slice's {"text": [...]} batch, the "text"
column, `select`); whatever needs more (a mixture's byte counts, streaming) turns it into a
Dataset with `as_dataset`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from flaxlm.data.fingerprint import documents_fingerprint
from flaxlm.errors import FlaxlmError


class Texts:
    """A {"text"} table of `documents` (str; None where a row had no text), in order."""

    column_names = ["text"]

    def __init__(self, documents: Sequence[str | None]):
        self.documents = list(documents)

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, key):
        if key == "text":
            return self.documents
        if isinstance(key, (slice, int)):  # rows: as a Dataset gives them, by column
            return {"text": self.documents[key]}
        raise KeyError(f"{key!r}: a Texts table has one column, 'text'")

    def select(self, indices: Iterable[int]) -> Texts:
        if isinstance(indices, range) and indices.step == 1:
            return Texts(self.documents[indices.start:indices.stop])
        return Texts([self.documents[i] for i in indices])

    @functools.cached_property
    def content_hash(self) -> str:
        """`fingerprint.text_fingerprint` of the documents, hashed once."""
        return documents_fingerprint(self.documents)

    def as_dataset(self):
        """The same documents as a `datasets.Dataset` (`tables.text_dataset`)."""
        from flaxlm.data.tables import text_dataset  # imports datasets, for what needs it

        return text_dataset(self.documents)


def concatenate(parts: Sequence[Texts]) -> Texts:
    return Texts([text for part in parts for text in part.documents])


def read_json_lines(path: Path, column: str, setting: str) -> Texts:
    """The `column` of every row of a JSON Lines file (None where a row lacks it or holds
    null); blank lines are skipped, as pyarrow's reader skips them. A line that is not a JSON
    object, or a column that holds something else than text, is a FlaxlmError naming the file
    and the line."""
    documents: list[str | None] = []
    columns: dict[str, None] = {}  # every row's keys, in the order they first appear
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise FlaxlmError(
                    f"{setting}: could not parse {str(path)!r} as jsonl (line {number}: {err}). "
                    f"Check that the file is well-formed JSON Lines (one object per line), or "
                    f"remove it from {setting}."
                ) from err
            if not isinstance(row, dict):
                raise FlaxlmError(
                    f"{setting}: could not parse {str(path)!r} as jsonl (line {number} holds "
                    f"a JSON {type(row).__name__}, not an object). Check that the file is JSON "
                    f"Lines (one object per line), or remove it from {setting}."
                )
            columns.update(dict.fromkeys(row))
            text = row.get(column)
            if text is not None and not isinstance(text, str):
                raise FlaxlmError(
                    f"language.text_column={column!r} of {str(path)!r} holds "
                    f"{type(text).__name__} values (line {number}), not text. Set "
                    "language.text_column to a column of strings."
                )
            documents.append(text)
    if documents and column not in columns:
        raise FlaxlmError(
            f"language.text_column={column!r} is not a column of {str(path)!r}; its columns are "
            f"{list(columns)}. Set language.text_column to the one that holds the text."
        )
    return Texts(documents)
