"""A resume continues on the data the run started with, or says why not: every checkpoint
records a fingerprint of the training and validation data (content, not counts), a resume on
changed data stops naming what changed unless trainer.resume_on_changed_data accepts it (and
metrics.jsonl records that), and a checkpoint written before fingerprints still resumes.

The corpus is named by a relative path (language.files=[corpus.txt]), so that every test
resumes a copy of one stopped run with its own corpus file beside it and the same config."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from conftest import TINY, TINY_CLASSIFY, compose, streaming_run, write_pairs

from flaxlm.errors import FlaxlmError
from flaxlm.job import train

_WORDS = ("the cat sat on a mat while dogs ran over green hills and rivers under skies of "
          "blue grey stone").split()
DOCS = [" ".join(_WORDS[(7 * d + 3 * w) % len(_WORDS)] for w in range(40 + d % 30))
        for d in range(40)]
# The first document lands in the validation split (language.validation_fraction 5%: 2 docs).
CHANGED_DATA_RECORD = "resume/changed_data"  # metrics.jsonl's record of an accepted change
DATA_FINGERPRINT_KEY = "data_fingerprint"  # in a checkpoint's metadata
RUN = [*TINY, "language=files", "language.files=[corpus.txt]",
       "language.text_splitting=paragraph", "checkpoint.every_steps=2", "samples.prompts=[]",
       "optimizer.warmup_steps=1"]


def write_corpus(directory, docs) -> None:
    (directory / "corpus.txt").write_text("\n\n".join(docs) + "\n")


def with_first_word_changed(docs, index) -> list[str]:
    words = docs[index].split()
    return [*docs[:index], " ".join(["zebra", *words[1:]]), *docs[index + 1:]]


def with_words_swapped(docs) -> list[str]:
    """Every document's 2nd and 3rd words swapped: the same tokens, in another order."""
    swapped = []
    for doc in docs:
        words = doc.split()
        words[1], words[2] = words[2], words[1]
        swapped.append(" ".join(words))
    return swapped


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stopped_run(directory, overrides):
    """A run of `overrides` stopped after 4 steps (checkpoints at 2 and 4), trained on DOCS
    in `directory`."""
    write_corpus(directory, DOCS)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(directory)
        train(compose([*overrides, "trainer.max_steps=4"], run_dir=directory / "run"))
    return directory / "run"


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    return stopped_run(tmp_path_factory.mktemp("stopped"), RUN)


def copy_of(run_dir, tmp_path, docs, monkeypatch):
    """`run_dir` copied into `tmp_path`, which becomes the working directory, beside a corpus
    of `docs`."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    write_corpus(tmp_path, docs)
    monkeypatch.chdir(tmp_path)
    return copy


@pytest.mark.slow
def test_a_changed_validation_document_stops_the_resume_naming_the_validation_data(
        stopped, tmp_path, monkeypatch, capsys):
    run_dir = copy_of(stopped, tmp_path, with_first_word_changed(DOCS, 0), monkeypatch)
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(FlaxlmError) as error:
        train(compose([*RUN, "trainer.max_steps=6"], run_dir=run_dir))
    message = str(error.value)
    assert "validation data changed" in message and "training data" not in message
    assert "trainer.resume_on_changed_data=true" in message
    assert (run_dir / "metrics.jsonl").read_text() == before  # a refused resume changes nothing

    # Accepted knowingly: the run goes on, and says so where its curves are read.
    capsys.readouterr()
    train(compose([*RUN, "trainer.max_steps=6", "trainer.resume_on_changed_data=true"],
                  run_dir=run_dir))
    assert "continues from step 4 on changed validation data" in capsys.readouterr().out
    [record] = [r for r in records(run_dir) if CHANGED_DATA_RECORD in r]
    assert record["step"] == 5
    assert [row["data"] for row in record[CHANGED_DATA_RECORD]] == ["validation data"]
    assert max(r["step"] for r in records(run_dir)) == 6

    # Its later checkpoints record the data it now trains on: the next resume needs no override.
    train(compose([*RUN, "trainer.max_steps=8"], run_dir=run_dir))
    assert max(r["step"] for r in records(run_dir)) == 8
    assert len([r for r in records(run_dir) if CHANGED_DATA_RECORD in r]) == 1


@pytest.mark.slow
def test_swapped_words_in_every_training_document_stop_the_resume_with_a_fixed_tokenizer(
        stopped, tmp_path_factory, tmp_path, monkeypatch):
    """The same tokens in another order: the block count, the batch and the tokenizer are the
    same, only the content differs."""
    fixed = [*RUN, f"tokenizer.path={stopped / 'model'}"]
    run_dir = stopped_run(tmp_path_factory.mktemp("fixed-tokenizer"), fixed)
    swapped = DOCS[:2] + with_words_swapped(DOCS[2:])  # the training documents only
    run_dir = copy_of(run_dir, tmp_path, swapped, monkeypatch)
    with pytest.raises(FlaxlmError) as error:
        train(compose([*fixed, "trainer.max_steps=6"], run_dir=run_dir))
    message = str(error.value)
    assert "its training data changed since its checkpoint at step 4" in message
    assert "validation data" not in message and "tokenizer" not in message

    # Accepted knowingly, the data may grow too: more blocks, the same position by step.
    write_corpus(tmp_path, swapped[:2] + [f"{doc} {doc}" for doc in swapped[2:]])
    train(compose([*fixed, "trainer.max_steps=6", "trainer.resume_on_changed_data=true"],
                  run_dir=run_dir))
    [record] = [r for r in records(run_dir) if CHANGED_DATA_RECORD in r]
    assert [row["data"] for row in record[CHANGED_DATA_RECORD]] == ["training data"]
    assert max(r["step"] for r in records(run_dir)) == 6


@pytest.mark.slow
def test_a_retrained_tokenizer_names_the_changed_training_data_as_its_cause(
        stopped, tmp_path, monkeypatch):
    """The tokenizer is trained on the training documents: a new word in each changes it."""
    changed = DOCS[:2] + [doc.replace("cat", "zebra") for doc in DOCS[2:]]
    run_dir = copy_of(stopped, tmp_path, changed, monkeypatch)
    with pytest.raises(FlaxlmError, match=r"tokenizer differs.*training data changed too"):
        train(compose([*RUN, "trainer.max_steps=6", "trainer.resume_on_changed_data=true"],
                      run_dir=run_dir))


@pytest.mark.slow
def test_a_checkpoint_without_a_fingerprint_or_config_yaml_still_resumes(
        stopped, tmp_path, monkeypatch, capsys):
    """As a checkpoint written before fingerprints existed; config.yaml lost too: the error
    says how to restore it from the checkpoint, and that works. A longer run says what its
    new length does to the learning rate."""
    run_dir = copy_of(stopped, tmp_path, DOCS, monkeypatch)
    for metadata in run_dir.glob("checkpoints/*/meta/metadata"):
        saved = json.loads(metadata.read_text())
        saved.pop(DATA_FINGERPRINT_KEY, None)
        metadata.write_text(json.dumps(saved))
    (run_dir / "config.yaml").unlink()
    with pytest.raises(FlaxlmError, match="config.yaml is missing") as error:
        train(compose([*RUN, "trainer.max_steps=6"], run_dir=run_dir))
    [command] = re.findall(r'python -c "(.*)"', str(error.value))
    assert "checkpoints/4/meta/metadata" in command
    subprocess.run([sys.executable, "-c", command], check=True)

    capsys.readouterr()
    train(compose([*RUN, "trainer.max_steps=6"], run_dir=run_dir))
    out = capsys.readouterr().out
    assert "records no fingerprint of the training data and validation data" in out
    assert ("now make the run 6 steps long where its checkpoint planned 4: the learning-rate "
            "schedule is stretched to 6 steps, so at step 4 the learning rate is") in out
    assert max(r["step"] for r in records(run_dir)) == 6


@pytest.mark.slow
def test_changed_evaluation_examples_stop_a_classifier_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_pairs(tmp_path / "train.tsv", 64, 0)
    write_pairs(tmp_path / "validation.tsv", 20, 1)
    run = [*TINY_CLASSIFY, "task.files=[train.tsv]", "task.eval_files=[validation.tsv]",
           "checkpoint.every_steps=2"]
    train(compose([*run, "trainer.max_steps=2"], run_dir=tmp_path / "run"))
    write_pairs(tmp_path / "validation.tsv", 20, 2)
    with pytest.raises(FlaxlmError, match=r"its evaluation examples changed since"):
        train(compose([*run, "trainer.max_steps=4"], run_dir=tmp_path / "run"))


@pytest.mark.slow
def test_a_changed_start_of_a_training_stream_stops_the_resume(tmp_path):
    """Streaming: the training stream is checked by its first documents, here one that the
    tokenizer (trained on the first tokenizer.train_docs=100) never saw."""
    cfg = streaming_run(tmp_path, "trainer.max_steps=2", "checkpoint.every_steps=2")
    train(cfg)
    shard = tmp_path / "c2.jsonl"  # documents 200-299: training documents 170-269
    lines = shard.read_text().splitlines()
    lines[0] = json.dumps({"text": "zebra " + json.loads(lines[0])["text"]})
    shard.write_text("\n".join(lines))
    with pytest.raises(FlaxlmError) as error:
        train(cfg)
    assert "its training data (first 1000 documents of the stream) changed" in str(error.value)
    assert "tokenizer" not in str(error.value)
