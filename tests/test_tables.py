"""The datasets flaxlm makes in memory are named by their content (`flaxlm.data.tables`):
`datasets` never pickles a table to name one, which fails wherever pyarrow lies outside the
interpreter's prefix ("Can't pickle <class 'MonthDayNano'>") and costs a pass over the data at
every start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import datasets.arrow_dataset
import pyarrow
import pytest
from conftest import config_node

from flaxlm.config import CorpusSource
from flaxlm.data.corpus import load_corpus, load_corpus_stream
from flaxlm.data.examples import load_examples
from flaxlm.data.fingerprint import documents_fingerprint, text_fingerprint
from flaxlm.data.tables import text_dataset


@pytest.fixture
def tables_never_pickled(monkeypatch):
    """`datasets` naming an in-memory table by pickling it is a failure of the test."""
    name_by_pickling = datasets.arrow_dataset.generate_fingerprint

    def refuse(dataset):
        if isinstance(dataset._data, datasets.table.InMemoryTable):
            raise AssertionError("datasets named an in-memory table by pickling it")
        return name_by_pickling(dataset)

    monkeypatch.setattr(datasets.arrow_dataset, "generate_fingerprint", refuse)


def make_every_kind_of_dataset(folder: Path) -> dict[str, list]:
    """Each way a run makes a dataset in memory: the builtin corpus, plain-text and JSON Lines
    files, a stream's validation head, and classification examples with named labels."""
    (folder / "a.txt").write_text("First document.\n\nSecond document.\n", encoding="utf-8")
    (folder / "b.jsonl").write_text(
        "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(4)), encoding="utf-8")
    files = config_node("language", name="t", source=CorpusSource.files, max_eval_docs=1,
                        files=[str(folder / "a.txt"), str(folder / "b.jsonl")])
    builtin = load_corpus(config_node("language", name="t", max_train_docs=3, max_eval_docs=2))
    validation_head, _ = load_corpus_stream(files)
    examples_file = folder / "pairs.jsonl"
    examples_file.write_text("".join(
        json.dumps({"sentence1": f"a{i}", "sentence2": f"b{i}", "label": ["no", "yes"][i % 2]})
        + "\n" for i in range(4)), encoding="utf-8")
    examples = load_examples(config_node(
        "task", ["task=classify"], files=[str(examples_file)], eval_files=[str(examples_file)],
        text_column="sentence1", text_pair_column="sentence2"))
    return {
        "builtin": builtin.validation["text"][:] + builtin.train["text"][:],
        "files": load_corpus(files).train["text"][:],
        "stream head": validation_head["text"][:],
        "examples": [examples.train["text"][:], examples.train["label"][:]],
    }


def test_no_dataset_a_run_makes_is_named_by_pickling_its_table(tmp_path, tables_never_pickled):
    made = make_every_kind_of_dataset(tmp_path)
    assert made["files"] == ["Second document.", "row 0", "row 1", "row 2", "row 3"]
    assert made["stream head"] == ["First document."]
    assert made["examples"] == [["a0", "a1", "a2", "a3"], [0, 1, 0, 1]]
    assert len(made["builtin"]) == 5


def test_a_text_dataset_is_named_by_its_content_and_hashed_once(monkeypatch):
    texts = ["one", "two", "three"]
    table = text_dataset(texts)
    assert table._fingerprint == documents_fingerprint(texts)
    assert text_dataset(list(texts))._fingerprint == table._fingerprint
    assert text_dataset(["one", "two", "three!"])._fingerprint != table._fingerprint

    monkeypatch.setattr("flaxlm.data.fingerprint._hash_documents", lambda _: "read again")
    assert text_fingerprint(table) == documents_fingerprint(texts)
    # A transform's result is a new dataset with a name of its own, hashed when asked.
    assert text_fingerprint(table.select(range(2))) == "read again"


@pytest.mark.slow  # several seconds: make test runs it
def test_every_kind_of_dataset_with_pyarrow_outside_the_interpreters_prefix(tmp_path):
    """The same datasets in a process whose pyarrow lies outside the interpreter's prefix, as
    on a machine whose packages are installed with `pip install --target` and PYTHONPATH (the
    TPU VM's recipe in docs/development.md). dill pickles a module from outside the prefix by
    value, and pyarrow's `MonthDayNano` then fails it ("not found as builtins.MonthDayNano"):
    whatever pyarrow's version, `datasets` would fail there on any table it named by pickling."""
    elsewhere = tmp_path / "packages"
    shutil.copytree(Path(pyarrow.__file__).parent, elsewhere / "pyarrow")
    here = Path(__file__).parent
    script = (f"import sys, json, pyarrow; sys.path.insert(0, {str(here)!r}); "
              f"assert pyarrow.__file__.startswith({str(elsewhere)!r}), pyarrow.__file__; "
              "from test_tables import make_every_kind_of_dataset; from pathlib import Path; "
              f"print(json.dumps(make_every_kind_of_dataset(Path({str(tmp_path)!r}))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(elsewhere), *filter(None, [os.environ.get("PYTHONPATH")])])}
    child = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    here_too = tmp_path / "here"
    here_too.mkdir()
    assert json.loads(child.stdout.splitlines()[-1]) == make_every_kind_of_dataset(here_too)
