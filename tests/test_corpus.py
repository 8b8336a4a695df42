"""Tests of `flaxlm.data.corpus`: the three corpus sources, the split, and every user error."""

from __future__ import annotations

import ast
import functools
import gc
import hashlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import config_node
from hypothesis import given, settings
from hypothesis import strategies as st

from flaxlm.config import CorpusSource, LanguageConfig, TextSplitting
from flaxlm.data import corpus
from flaxlm.data.corpus import (
    CorpusSplits,
    builtin_documents,
    load_corpus,
    read_without_datasets,
)
from flaxlm.data.texts import Texts, read_json_lines
from flaxlm.errors import FlaxlmError


def files_config(*files: object, **settings) -> LanguageConfig:
    return config_node("language", name="t", source=CorpusSource.files,
                       files=[str(f) for f in files], **settings)


def hub_config(path: object, **settings) -> LanguageConfig:
    return config_node("language", name="t", source=CorpusSource.hub, hub_path=str(path),
                       **settings)


def texts(splits: CorpusSplits) -> list[str]:
    """All documents in corpus order: validation first, as it was cut from the front."""
    for split in (splits.train, splits.validation):
        assert split.column_names == ["text"]
        if isinstance(split, Texts):  # flaxlm's own reading: plain Python strings
            assert all(isinstance(text, str) for text in split["text"])
        else:
            assert split.features["text"] == datasets.Value("string")
    return list(splits.validation["text"]) + list(splits.train["text"])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def raises(language: LanguageConfig, *fragments: str) -> FlaxlmError:
    """Assert that loading fails with a FlaxlmError whose message holds every fragment."""
    with pytest.raises(FlaxlmError) as info:
        load_corpus(language)
    for fragment in fragments:
        assert fragment in str(info.value)
    return info.value


# --- builtin --------------------------------------------------------------------------------------

_DIGEST = (
    "import hashlib; from flaxlm.data.corpus import builtin_documents as b; "
    "print(hashlib.sha256('\\0'.join(b()).encode()).hexdigest())"
)


@pytest.mark.slow
def test_builtin_is_deterministic_across_calls_and_processes():
    documents = builtin_documents()
    assert documents == builtin_documents()
    documents.append("mutating the returned list must not change the corpus")
    assert builtin_documents() == documents[:-1]

    here = hashlib.sha256("\0".join(documents[:-1]).encode()).hexdigest()
    there = subprocess.run(
        [sys.executable, "-c", _DIGEST], capture_output=True, text=True, check=True
    )
    assert there.stdout.strip() == here


def test_builtin_is_substantial_english_prose():
    documents = builtin_documents()
    text = "".join(documents)
    assert len(documents) > 300
    assert len(text) > 1_000_000
    assert all(len(doc) >= 200 and doc.strip() for doc in documents)
    assert sum(c.isascii() for c in text) / len(text) > 0.99
    assert sum(" the " in doc for doc in documents) / len(documents) > 0.9
    assert any(doc.startswith('The "if" statement') for doc in documents)  # a pydoc topic
    assert any("Manage shelves of pickled objects." in doc for doc in documents)  # a docstring
    skipped = ("Base class for regression test exceptions.", "The idlelib package implements")
    assert not any(phrase in doc for doc in documents for phrase in skipped)  # test/, idlelib/


@pytest.mark.slow
def test_builtin_is_kept_in_the_cache_and_read_again_when_its_copy_is_damaged(
        tmp_path, monkeypatch):
    documents = builtin_documents()
    # The cache directory as a new process finds it (the parse itself stays in this process).
    fresh = functools.cache(corpus._builtin_documents.__wrapped__)
    monkeypatch.setattr(corpus, "_builtin_documents", fresh)
    assert builtin_documents(str(tmp_path)) == documents
    [kept] = (tmp_path / "builtin").iterdir()
    assert json.loads(kept.read_text()) == documents

    def parse_nothing(sources):
        raise AssertionError("the kept copy was not read")

    fresh.cache_clear()
    with monkeypatch.context() as patch:
        patch.setattr(corpus, "_parse_builtin", parse_nothing)
        assert builtin_documents(str(tmp_path)) == documents

    kept.write_text(kept.read_text()[:1000])  # cut short, as by a full disk
    fresh.cache_clear()
    assert builtin_documents(str(tmp_path)) == documents
    assert json.loads(kept.read_text()) == documents
    assert [p.name for p in (tmp_path / "builtin").iterdir()] == [kept.name]  # no temp files


def test_builtin_splits_first_5_percent_for_validation():
    documents = builtin_documents()
    splits = load_corpus(config_node("language", name="t"))
    n_validation = math.ceil(0.05 * len(documents))
    assert len(splits.validation) == n_validation
    assert len(splits.train) == len(documents) - n_validation
    assert texts(splits) == documents


def test_a_process_parses_the_standard_library_once_whatever_its_cache_directories(
        tmp_path, monkeypatch):
    """Jobs of one process (a sweep's trials, say) with different cache directories share one
    parse; each directory still gets its copy."""
    sources = corpus._stdlib_sources()[:3]  # a few modules: the parse is not what is measured
    parsed = []
    parse_builtin = corpus._parse_builtin.__wrapped__

    def parse(sources):
        parsed.append(sources)
        return parse_builtin(sources)

    monkeypatch.setattr(corpus, "_stdlib_sources", lambda: sources)
    monkeypatch.setattr(corpus, "_parse_builtin", functools.cache(parse))
    monkeypatch.setattr(
        corpus, "_builtin_documents", functools.cache(corpus._builtin_documents.__wrapped__))
    documents = builtin_documents(str(tmp_path / "a"))
    assert builtin_documents(str(tmp_path / "b")) == builtin_documents() == documents
    assert len(parsed) == 1
    for cache in ("a", "b"):
        [kept] = (tmp_path / cache / "builtin").iterdir()
        assert json.loads(kept.read_text()) == documents


def test_builtin_without_pydoc_data_says_what_to_do(monkeypatch):
    # Fresh caches, so the real ones (built once for the other tests) stay untouched.
    monkeypatch.setattr(
        corpus, "_builtin_documents", functools.cache(corpus._builtin_documents.__wrapped__)
    )
    monkeypatch.setattr(
        corpus, "_parse_builtin", functools.cache(corpus._parse_builtin.__wrapped__))
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # makes the import fail
    raises(config_node("language", name="t"), "pydoc_data", "language.source=files")


# --- files ----------------------------------------------------------------------------------------

_TEXT = "First paragraph,\nstill the first.\n\n  \t\nSecond one.\n\n\n\nThird one.\n"


@pytest.mark.parametrize(
    ("splitting", "expected"),
    [
        (TextSplitting.document, [_TEXT, _TEXT.upper()]),
        (
            TextSplitting.paragraph,
            [
                "First paragraph,\nstill the first.",
                "Second one.",
                "Third one.",
                "FIRST PARAGRAPH,\nSTILL THE FIRST.",
                "SECOND ONE.",
                "THIRD ONE.",
            ],
        ),
        (
            TextSplitting.line,
            [
                "First paragraph,",
                "still the first.",
                "Second one.",
                "Third one.",
                "FIRST PARAGRAPH,",
                "STILL THE FIRST.",
                "SECOND ONE.",
                "THIRD ONE.",
            ],
        ),
    ],
)
def test_txt_splitting_modes(tmp_path, splitting, expected):
    (tmp_path / "a.txt").write_text(_TEXT, encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(
        _TEXT.upper().replace("\n", "\r\n").encode()
    )  # Windows endings
    assert (
        texts(load_corpus(files_config(tmp_path / "*.txt", text_splitting=splitting))) == expected
    )


def test_glob_over_several_files_is_sorted_and_deduplicated(tmp_path, monkeypatch):
    for i in (2, 0, 1):
        write_jsonl(
            tmp_path / f"shard-{i}.jsonl", [{"text": f"shard {i} doc {j}"} for j in range(2)]
        )
    monkeypatch.chdir(tmp_path)
    language = files_config("shard-1.jsonl", "shard-*.jsonl", str(tmp_path / "shard-0.jsonl"))
    assert texts(load_corpus(language)) == [
        "shard 1 doc 0",
        "shard 1 doc 1",
        "shard 0 doc 0",
        "shard 0 doc 1",
        "shard 2 doc 0",
        "shard 2 doc 1",
    ]


def test_home_directory_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.txt").write_text("one\ntwo\n", encoding="utf-8")
    assert texts(load_corpus(files_config("~/c.txt", text_splitting=TextSplitting.line))) == [
        "one",
        "two",
    ]


def test_jsonl_and_json_array_drop_blank_documents(tmp_path):
    write_jsonl(
        tmp_path / "a.jsonl",
        [{"text": "alpha", "id": 1}, {"text": "  \n"}, {"text": None}, {"text": "beta"}],
    )
    (tmp_path / "b.json").write_text(
        json.dumps([{"text": "gamma"}, {"text": ""}]), encoding="utf-8"
    )
    assert texts(load_corpus(files_config(tmp_path / "a.jsonl", tmp_path / "b.json"))) == [
        "alpha",
        "beta",
        "gamma",
    ]


def test_parquet_with_large_strings_and_csv_with_other_column_name(tmp_path):
    pd.DataFrame({"body": ["p0", "p1"], "n": [0, 1]}).to_parquet(
        tmp_path / "a.parquet"
    )  # large_string
    pq.write_table(pa.table({"body": pa.array(["p2"], pa.string())}), tmp_path / "b.parquet")
    pd.DataFrame({"label": [1, 2], "body": ["c0, with a comma", "c1"]}).to_csv(
        tmp_path / "c.csv", index=False
    )
    language = files_config(tmp_path / "*.parquet", tmp_path / "c.csv", text_column="body")
    assert texts(load_corpus(language)) == ["p0", "p1", "p2", "c0, with a comma", "c1"]


def test_mixed_formats_keep_file_order(tmp_path):
    (tmp_path / "1.txt").write_text("from text\n\nand more text", encoding="utf-8")
    write_jsonl(tmp_path / "2.jsonl", [{"text": "from json"}])
    assert texts(load_corpus(files_config(tmp_path / "*"))) == [
        "from text",
        "and more text",
        "from json",
    ]


# --- hub ------------------------------------------------------------------------------------------


def test_hub_path_can_be_a_local_directory_of_parquet(tmp_path):
    for i in range(2):
        pq.write_table(
            pa.table({"text": [f"row {i}-{j}" for j in range(10)]}), tmp_path / f"part-{i}.parquet"
        )
    splits = load_corpus(hub_config(tmp_path))
    assert sorted(texts(splits)) == sorted(f"row {i}-{j}" for i in range(2) for j in range(10))
    assert len(splits.validation) == 1


def test_hub_split_and_text_column_are_honoured(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"story": "train story"}] * 3)
    write_jsonl(tmp_path / "test.jsonl", [{"story": f"test story {i}"} for i in range(4)])
    splits = load_corpus(hub_config(tmp_path, hub_split="test", text_column="story"))
    assert texts(splits) == [f"test story {i}" for i in range(4)]


def test_hub_failures_name_the_settings_and_keep_the_cause(tmp_path):
    error = raises(
        hub_config(tmp_path / "missing"), "language.hub_path", "missing", "HF_TOKEN", "network"
    )
    assert error.__cause__ is not None
    raises(hub_config("nobody/no-such-corpus"), "'nobody/no-such-corpus'", "HF_TOKEN")
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}, {"text": "b"}])
    raises(hub_config(tmp_path, hub_config="nope"), "language.hub_config='nope'", "nope")
    raises(hub_config(tmp_path, hub_split="validation"), "language.hub_split='validation'")
    raises(hub_config(tmp_path, text_column="story"), "language.text_column='story'", "['text']")
    raises(config_node("language", name="t", source=CorpusSource.hub),
           "language.hub_path is not set")


# --- split and caps -------------------------------------------------------------------------------


def test_caps_keep_the_first_documents_of_each_split(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"doc {i}"} for i in range(40)])
    splits = load_corpus(files_config(tmp_path / "a.jsonl", max_train_docs=3, max_eval_docs=1))
    assert list(splits.validation["text"]) == ["doc 0"]
    assert list(splits.train["text"]) == ["doc 2", "doc 3", "doc 4"]
    uncapped = load_corpus(files_config(tmp_path / "a.jsonl", max_train_docs=1000))
    assert (len(uncapped.validation), len(uncapped.train)) == (2, 38)


def test_validation_size_is_not_inflated_by_float_noise(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"doc {i}"} for i in range(100)])
    assert (
        len(load_corpus(files_config(tmp_path / "a.jsonl", validation_fraction=0.07)).validation)
        == 7
    )


def test_split_errors(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a single paragraph\n", encoding="utf-8")
    for fraction in (0.0, 1.0, 1.5, -0.1):
        raises(files_config(one, validation_fraction=fraction), "language.validation_fraction")
    raises(files_config(one, max_train_docs=0), "language.max_train_docs=0")
    raises(files_config(one, max_eval_docs=-1), "language.max_eval_docs=-1")
    raises(files_config(one), "1 non-blank document", str(one))
    two = write_jsonl(tmp_path / "two.jsonl", [{"text": "a"}, {"text": "b"}])
    raises(
        files_config(two, validation_fraction=0.9),
        "leaves no training documents",
        "language.validation_fraction",
    )


# --- bad files ------------------------------------------------------------------------------------


def test_file_list_errors(tmp_path, monkeypatch):
    raises(files_config(), "language.files is empty")
    monkeypatch.chdir(tmp_path)
    raises(files_config("nothing/*.txt"), "language.files", "'nothing/*.txt'", str(tmp_path))
    (tmp_path / "notes.md").write_text("# hello", encoding="utf-8")
    raises(
        files_config(tmp_path / "notes.md"),
        "notes.md",
        "'.md'",
        ".txt, .jsonl, .json, .parquet, .csv",
    )


@pytest.mark.parametrize("name", ["empty.txt", "empty.jsonl", "empty.parquet", "empty.csv"])
def test_empty_file(tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    raises(files_config(tmp_path / name), "language.files", name, "is empty")


def test_file_without_text(tmp_path):
    (tmp_path / "blank.txt").write_text(" \n\n\t\n", encoding="utf-8")
    raises(files_config(tmp_path / "blank.txt"), "blank.txt", "no non-blank text")
    write_jsonl(tmp_path / "blank.jsonl", [{"text": " "}, {"text": None}])
    raises(files_config(tmp_path / "blank.jsonl"), "blank.jsonl", "no non-blank text", "'text'")


@pytest.mark.parametrize("source", ["files", "hub"])
def test_rows_without_text_are_counted_in_one_warning(tmp_path, capsys, source):
    rows = [{"text": f"doc {i}"} for i in range(7)] + [{"id": 7}, {"text": None, "id": 8}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    language = files_config(path) if source == "files" else hub_config(tmp_path)
    assert len(texts(load_corpus(language))) == 7
    # `datasets` draws progress bars on stderr too
    (warning,) = [line for line in re.split(r"[\r\n]", capsys.readouterr().err)
                  if line.startswith("flaxlm:")]
    assert warning.startswith("flaxlm: warning: language.text_column='text' of ")
    named = repr(str(path)) if source == "files" else f"language.hub_path={str(tmp_path)!r}"
    assert f"{named} is missing or null in 2 of the 9 rows (22%)" in warning, warning


def test_no_warning_for_blank_text_or_a_plain_text_file(tmp_path, capsys):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "alpha"}, {"text": " "}, {"text": "beta"}])
    (tmp_path / "b.txt").write_text("one\n\n\n\ntwo\n", encoding="utf-8")
    assert texts(load_corpus(files_config(tmp_path / "a.jsonl", tmp_path / "b.txt"))) == [
        "alpha", "beta", "one", "two"
    ]
    assert "flaxlm:" not in capsys.readouterr().err


def test_text_missing_from_every_row_names_the_setting(tmp_path):
    write_jsonl(tmp_path / "none.jsonl", [{"text": None}, {"id": 1}])
    raises(files_config(tmp_path / "none.jsonl"), "language.text_column='text'",
           "missing or null in every one of the 2 rows", "none.jsonl")


@pytest.mark.parametrize("name", ["latin.txt", "latin.jsonl", "latin.csv"])
def test_invalid_utf8_names_file_and_offset(tmp_path, name):
    content = {
        "latin.txt": "caf\xe9 au lait",
        "latin.jsonl": '{"text": "caf\xe9"}\n',
        "latin.csv": "text\ncaf\xe9\n",
    }
    (tmp_path / name).write_bytes(content[name].encode("latin-1"))
    offset = content[name].index("\xe9")
    raises(
        files_config(tmp_path / name),
        "language.files",
        name,
        "not valid UTF-8",
        f"byte offset {offset}",
    )


def test_missing_or_non_text_column_lists_the_columns(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"content": "x", "id": 1}])
    raises(
        files_config(tmp_path / "a.jsonl"),
        "language.text_column='text'",
        "a.jsonl",
        "['content', 'id']",
    )
    raises(
        files_config(tmp_path / "a.jsonl", text_column="id"),
        "language.text_column='id'",
        "not text",
    )
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    raises(files_config(tmp_path / "b.parquet"), "b.parquet", "['body']")
    (tmp_path / "c.csv").write_text("title,body\nt,b\n", encoding="utf-8")
    raises(files_config(tmp_path / "c.csv"), "c.csv", "['title', 'body']")


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("bad.jsonl", b'{"text": "fine"}\n{"text": broken\n'),
        ("bad.json", b'[{"text": "unterminated"'),
        ("bad.parquet", b"this is not parquet"),
        ("bad.csv", b'text\n"an unterminated quote\n'),
    ],
)
def test_unparseable_file_names_the_file(tmp_path, caplog, name, content):
    (tmp_path / name).write_bytes(content)
    error = raises(files_config(tmp_path / name), "language.files", "could not parse", name)
    assert error.__cause__ is not None
    # `datasets` logs nothing before it: the error is the first line the user reads
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("datasets")]


def test_a_source_file_is_parsed_with_the_collector_paused_and_a_spurious_depth_error_retried(
        monkeypatch, tmp_path):
    """CPython 3.11's "AST constructor recursion depth mismatch" (a collection in the middle of
    a parse running a finalizer that parses too) once failed a worker's builtin corpus: the
    parse runs with the collector paused, and a parse that meets it all the same is redone."""
    real_parse, collector_on = ast.parse, []

    def parse(source, *args, **kwargs):
        collector_on.append(gc.isenabled())
        if len(collector_on) == 1:
            raise SystemError("AST constructor recursion depth mismatch (before=162, after=214)")
        return real_parse(source, *args, **kwargs)

    monkeypatch.setattr(corpus.ast, "parse", parse)
    path = tmp_path / "module.py"
    path.write_text('"""What the module is."""\n\n\ndef f():\n    """What f does."""\n')
    text = corpus._docstrings(path)
    assert "What the module is." in text and "What f does." in text
    assert collector_on == [False, False] and gc.isenabled()


_ROWS = st.lists(st.one_of(
    st.fixed_dictionaries({"text": st.one_of(st.none(), st.text(max_size=30))},
                          optional={"id": st.integers(-5, 5)}),
    st.fixed_dictionaries({"id": st.integers(-5, 5)})), min_size=1, max_size=12).filter(
        lambda rows: any("text" in row for row in rows))


@settings(max_examples=30, deadline=None)
@given(rows=_ROWS, blank_lines=st.booleans())
def test_flaxlms_json_lines_reader_reads_what_datasets_reads(tmp_path_factory, rows,
                                                            blank_lines):
    """`read_json_lines` (a run on a .jsonl corpus imports no `datasets`) gives the text column
    `datasets`' JSON reader gives: the same rows, None where a row lacks it or holds null."""
    path = tmp_path_factory.mktemp("jsonl") / "rows.jsonl"
    separator = "\n\n" if blank_lines else "\n"
    path.write_text(separator.join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    ours = read_json_lines(path, "text", "language.files")
    theirs = datasets.load_dataset("json", data_files=[str(path)], split="train")
    assert ours["text"] == theirs["text"]


def test_a_json_lines_row_that_is_not_an_object_names_the_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "one"}\n["two"]\n', encoding="utf-8")
    raises(files_config(path), "language.files", "rows.jsonl", "line 2", "not an object")


def test_the_corpora_flaxlm_reads_itself_are_texts_and_the_others_datasets(tmp_path):
    """`read_without_datasets` says which corpora a run reads without importing `datasets`
    (the libraries it imports ahead follow it); `load_corpus` agrees with it."""
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"doc {i}"} for i in range(4)])
    (tmp_path / "b.txt").write_text("one\n\ntwo\n\nthree\n", encoding="utf-8")
    pq.write_table(pa.table({"text": ["x", "y", "z"]}), tmp_path / "c.parquet")
    for files, flaxlms in [(["a.jsonl"], True), (["a.jsonl", "b.txt"], True),
                           (["c.parquet"], False), (["b.txt", "c.parquet"], False)]:
        language = files_config(*(tmp_path / name for name in files))
        assert read_without_datasets(language) is flaxlms
        splits = load_corpus(language)
        assert isinstance(splits.train, Texts) is flaxlms, files
        assert isinstance(splits.validation, Texts) is flaxlms, files
    builtin = config_node("language", name="t", source=CorpusSource.builtin)
    assert read_without_datasets(builtin)
