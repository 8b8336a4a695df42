"""Data files in a bucket (issue 45): language.files and task.files take s3:// and gs:// URLs,
read through fsspec from copies in flaxlm's cache, against the emulators of tests/buckets.py.
A bucket's data must train exactly as the same files on disk; a wrong URL, a missing bucket or
credential, or a missing fsspec package is one paragraph naming the URL, before training."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import SHORT, TINY, assert_names, config_node, documents, make_tokenizer, metrics_of

from flaxlm.config import CorpusSource
from flaxlm.data.corpus import load_corpus
from flaxlm.data.files import expand_patterns
from flaxlm.data.packing import pack_blocks
from flaxlm.errors import FlaxlmError

STORES = ["s3", "gcs"]


def corpus_files() -> dict[str, str]:
    """Two JSON-lines files of a corpus, and a file beside them that `*.jsonl` leaves out."""
    docs = documents(40, seed=3)
    lines = [json.dumps({"text": doc}) + "\n" for doc in docs]
    return {"corpus/a.jsonl": "".join(lines[:25]), "corpus/b.jsonl": "".join(lines[25:]),
            "corpus/notes.txt": "not part of the corpus\n"}


def lay_out(files: dict[str, str], directory: Path, bucket) -> None:
    """The same files on disk under `directory` and in `bucket`."""
    for key, text in files.items():
        (directory / key).parent.mkdir(parents=True, exist_ok=True)
        (directory / key).write_text(text, encoding="utf-8")
        bucket.put(key, text)


def language(*files: str):
    return config_node("language", name="t", source=CorpusSource.files, files=list(files))


@pytest.mark.parametrize("store", STORES)
def test_a_corpus_in_a_bucket_packs_the_blocks_of_the_same_files_on_disk(
        store, request, tmp_path):
    bucket = request.getfixturevalue(store)
    lay_out(corpus_files(), tmp_path / "disk", bucket)
    on_disk = load_corpus(language(f"{tmp_path}/disk/corpus/*.jsonl"), str(tmp_path / "cache-a"))
    remote = load_corpus(language(f"{bucket.url}/corpus/*.jsonl"), str(tmp_path / "cache-b"))

    assert remote.train["text"][:] == on_disk.train["text"][:]
    assert remote.validation["text"][:] == on_disk.validation["text"][:]
    assert len(remote.train) + len(remote.validation) == 40  # notes.txt was not matched
    tokenizer = make_tokenizer()
    # Separate caches: the blocks of one are not the other's cache hit.
    local_blocks = pack_blocks(on_disk.train, tokenizer, 16, str(tmp_path / "cache-a"))
    remote_blocks = pack_blocks(remote.train, tokenizer, 16, str(tmp_path / "cache-b"))
    assert local_blocks.tokens.shape[0] > 10
    assert (remote_blocks.tokens == local_blocks.tokens).all()


@pytest.mark.slow
def test_training_on_a_bucket_matches_training_on_the_same_files(s3, tmp_path, train_cli):
    lay_out(corpus_files(), tmp_path, s3)
    runs = {}
    for name, files in (("disk", f"{tmp_path}/corpus/*.jsonl"),
                        ("bucket", f"{s3.url}/corpus/*.jsonl")):
        result = train_cli(*TINY, "language=files", f"language.files=[{files}]",
                           "task.max_seq_length=16", "trainer.max_steps=3",
                           f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = metrics_of(tmp_path / name)
    assert [m for m in runs["bucket"] if "train/loss" in m]  # it trained
    assert runs["bucket"] == runs["disk"]


# --- the cache ----------------------------------------------------------------------------------


def test_a_rewritten_object_is_read_again_and_an_unchanged_one_is_not(s3, tmp_path):
    cache_dir = str(tmp_path / "cache")
    s3.put("c/a.txt", "first version\n\nof the text\n")
    [first] = expand_patterns([f"{s3.url}/c/*.txt"], "language.files", cache_dir)
    assert first.read_text() == "first version\n\nof the text\n"
    assert str(first).startswith(cache_dir) and first.parts[-3:] == (s3.name, "c", "a.txt")
    written = first.stat().st_mtime_ns

    [again] = expand_patterns([f"{s3.url}/c/*.txt"], "language.files", cache_dir)
    assert again == first and again.stat().st_mtime_ns == written  # not downloaded again

    s3.put("c/a.txt", "second version\n\nof the text\n")
    [changed] = expand_patterns([f"{s3.url}/c/*.txt"], "language.files", cache_dir)
    assert changed != first
    assert changed.read_text() == "second version\n\nof the text\n"
    splits = load_corpus(language(f"{s3.url}/c/a.txt"), cache_dir)
    assert splits.train["text"][:] == ["of the text"]  # what a run trains on is the new text


# --- bad input: one paragraph, exit code 2 --------------------------------------------------------


def error_lines(result) -> list[str]:
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if line.startswith("flaxlm: error:")]


def test_a_bucket_that_does_not_exist_stops_the_run_with_exit_2(s3_env, tmp_path, train_cli):
    result = train_cli(*SHORT, "language=files", "language.files=[s3://no-such-bucket/d/*.jsonl]",
                       f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    [error] = error_lines(result)
    assert_names(error, "language.files", "'s3://no-such-bucket/d/*.jsonl'",
                 "'s3://no-such-bucket'", "does not exist", "aws s3 ls")


def test_a_glob_that_matches_no_object_stops_the_run_with_exit_2(s3, tmp_path, train_cli):
    s3.put("d/a.txt", "text")
    pattern = f"{s3.url}/d/*.jsonl"
    result = train_cli(*SHORT, "language=files", f"language.files=[{pattern}]",
                       f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    [error] = error_lines(result)
    assert_names(error, "language.files", repr(pattern), "matches no object", repr(s3.url))


@pytest.mark.parametrize("store", STORES)
def test_no_bucket_and_no_match_say_which(store, request):
    bucket = request.getfixturevalue(store)
    scheme = bucket.url.partition("://")[0]
    with pytest.raises(FlaxlmError) as missing:
        expand_patterns([f"{scheme}://no-such-bucket/*.jsonl"], "task.files", "/unused")
    assert_names(missing.value, "task.files", f"'{scheme}://no-such-bucket'", "does not exist")
    with pytest.raises(FlaxlmError) as unmatched:
        expand_patterns([f"{bucket.url}/*.jsonl"], "task.eval_files", "/unused")
    assert_names(unmatched.value, "task.eval_files", "matches no object")


def test_missing_credentials_name_the_variables(s3, monkeypatch):
    from buckets import _forget_filesystems

    s3.put("d/a.txt", "text")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    _forget_filesystems()
    with pytest.raises(FlaxlmError) as error:
        expand_patterns([f"{s3.url}/d/*.txt"], "language.files", "/unused")
    assert_names(error.value, "language.files", f"'{s3.url}/d/*.txt'", "no credentials",
                 "AWS_ACCESS_KEY_ID")


def test_a_scheme_whose_package_is_missing_names_the_extra(monkeypatch):
    import fsspec  # noqa: F401 — its `registry` attribute hides the module of that name

    registry = sys.modules["fsspec.registry"]._registry  # the classes imported so far
    monkeypatch.delitem(registry, "s3", raising=False)
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed
    with pytest.raises(FlaxlmError) as error:
        expand_patterns(["s3://bucket/*.jsonl"], "language.files", "/unused")
    assert_names(error.value, "language.files", "'s3://bucket/*.jsonl'", "flaxlm[cloud]", "s3fs")
