"""Every input a user can get wrong ends in one clear error naming the setting or file, before
training starts, and never in a write into another run's directory."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    ENGLISH,
    SHORT,
    TINY_CORPUS,
    assert_names,
    compose,
    config_node,
    write,
)
from hydra.errors import ConfigCompositionException

from flaxlm.data.corpus import load_corpus
from flaxlm.data.tokenizer import prepare_tokenizer
from flaxlm.errors import FlaxlmError
from flaxlm.job import train
from flaxlm.runs import claim_run_dir


def train_on(tmp_path: Path, files: str | Path, *overrides: str) -> FlaxlmError:
    """Train on `files`; return the FlaxlmError it must raise."""
    cfg = compose([*SHORT, "language=files", f"language.files=[{files}]", *overrides],
                  run_dir=tmp_path / "run")
    with pytest.raises(FlaxlmError) as info:
        train(cfg)
    assert not (tmp_path / "run" / "model" / "model.safetensors").exists()
    return info.value


@pytest.fixture
def english(tmp_path) -> Path:
    return write(tmp_path / "english.txt", ENGLISH)


# --- the corpus -----------------------------------------------------------------------------------


def test_missing_corpus_file_names_the_pattern(tmp_path):
    error = train_on(tmp_path, "/nonexistent/*.txt")
    assert_names(error, "language.files", "'/nonexistent/*.txt'", "matches no file")


def test_a_directory_as_corpus_file_says_so_and_suggests_a_glob(tmp_path):
    """Issue 20: a directory said "matches no file", as if it were not there."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a.txt", "b.txt"):
        write(corpus / name, ENGLISH)
    write(corpus / "README.md", "about the corpus")
    error = train_on(tmp_path, corpus)
    assert_names(error, "language.files", f"{str(corpus)!r} is a directory",
                 f"language.files=[{corpus}/*.txt]", "2 of the 3 file(s)")
    assert "matches no file" not in str(error)


@pytest.mark.parametrize(
    ("name", "content", "fragments"),
    [
        pytest.param("empty.txt", b"", ["is empty"], id="empty"),
        pytest.param("latin1.txt", "Caf\xe9 au lait, s'il vous pla\xeet.".encode("latin-1"),
                     ["not valid UTF-8", "byte offset 3"], id="invalid-utf8"),
        pytest.param("blank.txt", b"\n \n\t\n", ["no non-blank text"], id="blank"),
    ],
)
def test_unusable_corpus_file_is_named(tmp_path, name, content, fragments):
    error = train_on(tmp_path, write(tmp_path / name, content))
    assert_names(error, "language.files", str(tmp_path / name), *fragments)


def test_files_language_without_files_says_so(tmp_path):
    cfg = compose([*SHORT, "language=files"], run_dir=tmp_path / "run")
    with pytest.raises(FlaxlmError) as info:
        train(cfg)
    assert_names(info.value, "language.files is empty")


def test_corpus_too_small_for_one_block(tmp_path):
    error = train_on(tmp_path, write(tmp_path / "tiny.txt", TINY_CORPUS))
    assert_names(error, "shorter than one block", "task.max_seq_length=64", "language=files")


def test_corpus_too_small_for_one_batch(tmp_path, english):
    error = train_on(tmp_path, english, "hardware.per_device_batch_size=64")
    assert_names(error, "fewer than one global batch of 512", "hardware.per_device_batch_size",
                 "language=files")


# --- settings -------------------------------------------------------------------------------------


BAD_SETTINGS = {
    "task.max_seq_length=65": ["task.max_seq_length=65", "model.max_positions=64"],
    "task.max_seq_length=1": ["task.max_seq_length=1"],
    "trainer.global_batch_size=12": ["trainer.global_batch_size=12", "8 devices", "multiple of 8"],
    # Issue 20: it said "does not divide evenly" (-8 does).
    "trainer.global_batch_size=-8": ["trainer.global_batch_size=-8", "must be at least 1"],
    "hardware.num_devices=16": ["hardware.num_devices=16", "8 device(s)"],
    "hardware.num_devices=0": ["hardware.num_devices=0"],
    "hardware.per_device_batch_size=0": ["hardware.per_device_batch_size=0"],
    "trainer.max_steps=0": ["trainer.max_steps=0"],
}


@pytest.mark.parametrize("override", BAD_SETTINGS)
def test_bad_setting_is_named(tmp_path, english, override):
    assert_names(train_on(tmp_path, english, override), *BAD_SETTINGS[override])


def test_trained_tokenizer_larger_than_the_model_vocab(tmp_path, english):
    error = train_on(tmp_path, english, "model.vocab_size=300", "tokenizer.vocab_size=512")
    assert_names(error, "model.vocab_size=300", "tokenizer.vocab_size")


def test_tokenizer_path_larger_than_the_model_vocab(tmp_path, english):
    corpus = load_corpus(config_node("language", ["language=files"], files=[str(english)]))
    settings = config_node("tokenizer", vocab_size=512)
    big = prepare_tokenizer(settings, corpus.train, 512, str(tmp_path))
    big.save_pretrained(tmp_path / "big-tokenizer")
    assert len(big) > 300

    error = train_on(tmp_path, english, "model.vocab_size=300",
                     f"tokenizer.path={tmp_path / 'big-tokenizer'}")
    assert_names(error, "model.vocab_size=300", f"{len(big)} tokens")


def test_misspelt_setting_fails_at_composition(tmp_path):
    with pytest.raises(ConfigCompositionException, match="trainer.max_step"):
        compose([*SHORT, "trainer.max_step=3"], run_dir=tmp_path / "run")


# --- run directories ------------------------------------------------------------------------------


def test_a_run_directory_is_claimed_only_once(tmp_path):
    run_dir = tmp_path / "run"
    assert claim_run_dir(str(run_dir)) == str(run_dir)
    write(run_dir / "metrics.jsonl", '{"step": 1, "loss": 2.0}\n')
    write(run_dir / "config.yaml", "seed: 0\n")
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.iterdir()}

    with pytest.raises(FlaxlmError) as info:
        claim_run_dir(str(run_dir))
    assert_names(info.value, f"run_dir={run_dir}", "already holds a run")
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.iterdir()} == before


def test_a_directory_hydra_prepared_can_be_claimed(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    assert claim_run_dir(str(run_dir)) == str(run_dir)
    assert (run_dir / "metrics.jsonl").read_text() == ""


def test_claimed_metrics_file_is_a_plain_non_executable_file(tmp_path):
    run_dir = claim_run_dir(str(tmp_path / "run"))
    mode = os.stat(os.path.join(run_dir, "metrics.jsonl")).st_mode
    assert stat.S_ISREG(mode)
    assert not mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH), oct(mode)


def test_train_never_writes_into_an_earlier_runs_directory(tmp_path, english):
    # A first run that claims the directory, writes its config, then stops (corpus too small)
    # after logging a metric: it is a run, not only a failed start.
    train_on(tmp_path, english, "hardware.per_device_batch_size=1000")
    write(tmp_path / "run" / "metrics.jsonl", '{"step": 0, "eval/loss": 6.0}\n')
    config = (tmp_path / "run" / "config.yaml").read_bytes()
    assert b"per_device_batch_size: 1000" in config

    error = train_on(tmp_path, english, "seed=1")
    assert_names(error, f"run_dir={tmp_path / 'run'}")
    assert (tmp_path / "run" / "config.yaml").read_bytes() == config


# --- the command line -----------------------------------------------------------------------------


def test_cli_prints_one_paragraph_without_traceback_and_exits_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["FLAXLM_CACHE"] = str(tmp_path / "cache")
    result = subprocess.run(
        [sys.executable, "-m", "flaxlm.cli.train", "logger=none",
         "task.max_seq_length=100000", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    error = result.stderr.strip()
    assert error.startswith("flaxlm: error: ")
    assert error.count("flaxlm: error:") == 1
    assert_names(error, "task.max_seq_length=100000", "model.max_positions=256")
    assert not (tmp_path / "outputs").exists()  # hydra.run.dir was honoured
