"""A sentence-pair dataset made offline from the built-in corpus, laid out like GLUE MRPC.

    flaxlm-pairs pairs/            # pairs/train.tsv, pairs/validation.tsv

Each row is `sentence1 <TAB> sentence2 <TAB> label`. A positive pair (label 1) is a sentence of
the interpreter's documentation and a noisy rewording of it (a fifth of its words dropped, two
neighbours swapped); a negative pair (0) rewords a *neighbouring* sentence of the same document
instead, so both halves share topic and vocabulary and the model has to compare meaning-bearing
words, not just spot the topic. It stands in for MRPC where the Hub is out of reach; it is
easier than MRPC, so its scores are not MRPC scores.
"""

from __future__ import annotations

import csv
import os
import random
import re

from flaxlm.data.corpus import builtin_documents

# MRPC's split sizes.
TRAIN_ROWS, VALIDATION_ROWS = 3668, 408

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def sentences(documents: list[str], min_words: int = 8, max_words: int = 40) -> list[list[str]]:
    """Each document's prose sentences of a sensible length, grouped per document."""
    grouped = []
    for document in documents:
        found = [
            " ".join(s.split())
            for s in _SENTENCE_END.split(document)
            if min_words <= len(s.split()) <= max_words and not s.lstrip().startswith(">>>")
        ]
        if len(found) >= 2:
            grouped.append(found)
    return grouped


def reword(sentence: str, rng: random.Random, drop: float = 0.2) -> str:
    words = sentence.split()
    kept = [w for w in words if rng.random() >= drop] or words[:1]
    if len(kept) > 2:
        i = rng.randrange(len(kept) - 1)
        kept[i], kept[i + 1] = kept[i + 1], kept[i]
    return " ".join(kept)


def make_pairs(documents: list[str], num_pairs: int, seed: int) -> list[dict]:
    """`num_pairs` rows, half positive, in a seeded random order."""
    rng = random.Random(seed)
    grouped = sentences(documents)
    rows = []
    for index in range(num_pairs):
        group = rng.choice(grouped)
        i = rng.randrange(len(group))
        if index % 2 == 0:
            rows.append({"sentence1": group[i], "sentence2": reword(group[i], rng), "label": 1})
        else:
            j = (i + rng.choice([-1, 1])) % len(group)
            rows.append({"sentence1": group[i], "sentence2": reword(group[j], rng), "label": 0})
    rng.shuffle(rows)
    return rows


def write_tsv(path: str, rows: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, ["sentence1", "sentence2", "label"], delimiter="\t",
                                quoting=csv.QUOTE_NONE, escapechar=None, quotechar=None)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def write_pair_dataset(out_dir: str, train_rows: int = TRAIN_ROWS,
                       validation_rows: int = VALIDATION_ROWS, seed: int = 0) -> list[str]:
    """`out_dir`/train.tsv and validation.tsv from the built-in corpus; returns their paths.
    The documents are split first, so that no sentence is in both."""
    documents = list(builtin_documents())
    cut = len(documents) // 10
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, docs, count in [("validation", documents[:cut], validation_rows),
                              ("train", documents[cut:], train_rows)]:
        path = os.path.join(out_dir, f"{name}.tsv")
        write_tsv(path, make_pairs(docs, count, seed))
        paths.append(path)
    return paths
