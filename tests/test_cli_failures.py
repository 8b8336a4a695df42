"""How `flaxlm-train` fails: one `flaxlm: error:` line and exit code 2 for every mistake the
user can fix (Hydra's own composition errors included), no traceback after it, no run
directory that blocks the retry, and a multirun that reports every job instead of stopping at
the first failure."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import sys
import threading

import pytest
from conftest import ENGLISH, SHORT, TINY, assert_names, compose, write

from flaxlm.errors import FlaxlmError
from flaxlm.job import train
from flaxlm.training.checkpoint.manager import Checkpointer


def error_lines(result) -> list[str]:
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if line.startswith("flaxlm: error:")]


# --- exit code 2 and one message for every configuration mistake ----------------------------


@pytest.mark.parametrize("override, hydra_says", [
    ("trainer.max_step=3", "Key 'max_step' not in 'TrainerConfig'"),
    ("model=gpt9", "Could not find 'model/gpt9'"),
    ("trainer.max_steps=many", "Value 'many' of type 'str' could not be converted to Integer"),
], ids=["misspelt-key", "unknown-option", "wrong-type"])
def test_a_config_hydra_cannot_compose_exits_2_with_hydras_message(tmp_path, train_cli, override,
                                                                   hydra_says):
    result = train_cli(override, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert hydra_says in result.stderr


# A config dir of the user's (--config-dir) with a file PyYAML cannot read: the unclosed
# list in a model option, a tab in an experiment, a repeated key, the primary config itself, and
# a file in another encoding: (file, content, arguments, what the message says).
BROKEN_CONFIG_FILES = {
    "unclosed-list": ("model/broken.yaml", "num_layers: [1\n", ["model=broken"],
                      ["not valid YAML", "broken.yaml, line 2", "expected ',' or ']'"]),
    "tab": ("experiment/mine.yaml", "# @package _global_\ntrainer:\n  max_steps: 3\n\tx: 1\n",
            ["experiment=mine"],
            ["not valid YAML", "mine.yaml, line 4", "found character '\\t'"]),
    "repeated-key": ("model/twice.yaml", "num_layers: 1\nnum_layers: 2\n", ["model=twice"],
                     ["not valid YAML", "twice.yaml, line 2", "found duplicate key num_layers"]),
    "primary-config": ("mine.yaml", "defaults:\n  - train\nseed: [0\n", ["--config-name", "mine"],
                       ["not valid YAML", "mine.yaml, line 4", "expected ',' or ']'"]),
    "latin-1": ("model/cafe.yaml", "name: caf\xe9\n".encode("latin-1"), ["model=cafe"],
                ["not UTF-8 text", "cafe.yaml, byte 0xe9 at offset 9"]),
}


@pytest.mark.parametrize("case", BROKEN_CONFIG_FILES)
def test_a_config_file_that_is_not_yaml_exits_2_naming_the_file_and_line(
        tmp_path, monkeypatch, capsys, case):
    """Issue 20: a broken YAML file in --config-dir ended in exit 1 and ~100 lines of PyYAML's
    traceback."""
    from flaxlm.cli.train import main

    name, content, args, fragments = BROKEN_CONFIG_FILES[case]
    path = tmp_path / "mine" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "")  # main() sets it; this restores it afterwards
    monkeypatch.setattr(sys, "argv", ["flaxlm-train", "--config-dir", str(tmp_path / "mine"),
                                      *args, "logger=none"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    [error] = captured.err.strip().splitlines()
    assert_names(error, "flaxlm: error: A config file is", str(path.parent), *fragments)
    assert not (tmp_path / "outputs").exists()


def test_the_resolved_config_prints(tmp_path, train_cli):
    result = train_cli("--cfg", "job", "--resolve", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "run_dir: null" in lines  # Hydra runs no job, so there is no output directory
    assert "  name: gpt2-tiny" in lines and any(line.startswith("cache_dir: ") for line in lines)


def test_an_unwritable_hydra_run_dir_is_one_message(tmp_path, unwritable, train_cli):
    run_dir = unwritable / "run"
    result = train_cli("logger=none", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    [error] = error_lines(result)
    assert_names(error, f"hydra.run.dir={run_dir}", "Set hydra.run.dir")


@pytest.mark.parametrize("setting", ["run_dir", "cache_dir"])
def test_an_unwritable_run_or_cache_dir_names_the_setting(tmp_path, unwritable, setting):
    target = unwritable / "x"
    if setting == "run_dir":
        cfg = compose(SHORT, run_dir=target)
    else:
        cfg = compose([*SHORT, f"cache_dir={target}"], run_dir=tmp_path / "run")
    with pytest.raises(FlaxlmError) as info:
        train(cfg)
    assert_names(info.value, f"{setting}={target}", "can write to")
    assert not (tmp_path / "run").exists()  # checked before the run directory is claimed


def test_resume_from_a_missing_directory_gives_advice_that_applies(tmp_path):
    missing = tmp_path / "no-such-run"
    with pytest.raises(FlaxlmError) as info:
        train(compose([*SHORT, f"resume_from={missing}"], run_dir=tmp_path / "run"))
    assert_names(info.value, f"resume_from={missing}", "does not exist", "drop resume_from")
    assert "trainer.resume=auto" not in str(info.value)  # it is auto already
    with pytest.raises(FlaxlmError) as info:
        train(compose([*SHORT, "trainer.resume=must"], run_dir=missing))
    assert_names(info.value, "trainer.resume=must", "trainer.resume=auto")
    assert not missing.exists()


def test_a_run_whose_config_yaml_is_damaged_is_not_resumed_and_says_why(tmp_path):
    """Issue 20's class of defect: a damaged config.yaml in the run being resumed was a PyYAML
    traceback."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "2").mkdir(parents=True)  # a step to resume, as far as it shows
    (run_dir / "config.yaml").write_text("seed: 0\ntrainer: {max_steps: 4\n")
    with pytest.raises(FlaxlmError) as info:
        train(compose(SHORT, run_dir=run_dir))
    assert_names(info.value, f"Cannot resume the run in {run_dir}", "config.yaml, line 3",
                 "Restore the file, or start a new run")


# --- a failed start does not block the retry -----------------------------------------------


def test_a_start_that_failed_before_its_first_step_does_not_block_the_retry(tmp_path):
    run_dir = tmp_path / "run"
    english = write(tmp_path / "english.txt", ENGLISH)
    retry = [*SHORT, "language=files", f"language.files=[{english}]"]
    missing = tmp_path / "missing.txt"
    with pytest.raises(FlaxlmError, match="matches no file"):
        train(compose([*SHORT, "language=files", f"language.files=[{missing}]"], run_dir))
    first_wandb_id = (run_dir / "wandb_run_id").read_text()

    # The retry takes the directory over (here to stop later, on a batch larger than the corpus).
    with pytest.raises(FlaxlmError) as info:
        train(compose([*retry, "hardware.per_device_batch_size=1000"], run_dir))
    assert_names(info.value, "hardware.per_device_batch_size")
    assert "missing.txt" not in (run_dir / "config.yaml").read_text()
    assert (run_dir / "wandb_run_id").read_text() != first_wandb_id  # a W&B run of its own

    # Never while another process holds the directory: it may be a start still running.
    lock = os.open(run_dir / ".lock", os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        with pytest.raises(FlaxlmError, match="Another process is training"):
            train(compose(retry, run_dir))
    finally:
        os.close(lock)

    # Nor once a checkpoint was started.
    (run_dir / "checkpoints" / "5.orbax-checkpoint-tmp-1").mkdir(parents=True)
    with pytest.raises(FlaxlmError, match="already holds a run"):
        train(compose(retry, run_dir))


@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_starts_again_with_the_same_config(tmp_path):
    run_dir = tmp_path / "run"
    english = write(tmp_path / "english.txt", ENGLISH)
    same = [*SHORT, "language=files", f"language.files=[{english}]",
            "trainer.max_steps=2", "trainer.eval_before_training=true",
            "hardware.per_device_batch_size=1"]
    train(compose(same, run_dir))
    # What a kill -9 before the first checkpoint leaves: metrics logged, no checkpoint.
    shutil.rmtree(run_dir / "checkpoints")
    logged = (run_dir / "metrics.jsonl").read_text()
    first_wandb_id = (run_dir / "wandb_run_id").read_text()
    assert logged

    # Another config's metrics are never taken over, nor with trainer.resume=never.
    for other in (["model.num_layers=3"], ["trainer.resume=never"]):
        with pytest.raises(FlaxlmError, match="already holds a run"):
            train(compose([*same, *other], run_dir))
    assert (run_dir / "metrics.jsonl").read_text() == logged

    train(compose(same, run_dir))  # the same command starts again from step 0
    kept = list(run_dir.glob("metrics.jsonl.stopped-*"))
    assert [path.read_text() for path in kept] == [logged]
    def steps(text: str) -> list[int]:
        return [json.loads(line)["step"] for line in text.splitlines()]

    assert steps((run_dir / "metrics.jsonl").read_text()) == steps(logged)
    assert (run_dir / "wandb_run_id").read_text() != first_wandb_id
    assert (run_dir / "checkpoints").is_dir()


def test_a_checkpointer_leaves_no_orbax_thread_running(tmp_path, monkeypatch):
    # orbax removes the tmp folders of killed saves in a thread; one still running when the
    # process exits prints a traceback after the user's error message.
    from orbax.checkpoint._src.path import temporary_paths

    cleanup, finished = temporary_paths.cleanup_temporary_paths, threading.Event()

    async def slow_cleanup(*args, **kwargs):
        await asyncio.sleep(0.3)
        await cleanup(*args, **kwargs)
        finished.set()

    monkeypatch.setattr(temporary_paths, "cleanup_temporary_paths", slow_cleanup)
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    assert finished.is_set()
    checkpointer.close()


def test_early_input_errors_print_one_message_and_leave_the_run_dir_reusable(tmp_path, train_cli):
    for _ in range(3):  # the same command again, in the same run directory
        result = train_cli(*TINY, "language=files", "language.files=[missing.txt]",
                              f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        [error] = error_lines(result)
        assert_names(error, "language.files", "'missing.txt'", "matches no file")


# --- multiruns ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_multirun_runs_every_job_and_sums_them_up(tmp_path, train_cli):
    english = write(tmp_path / "english.txt", "\n\n".join([ENGLISH] * 10))
    sweep_dir = tmp_path / "sweep"
    result = train_cli(
        "-m", *TINY, "language=files", f"language.files=[missing.txt],[{english}]",
        "task.max_seq_length=16", "trainer.max_steps=1", "trainer.eval_before_training=false",
        "samples.prompts=[]", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    [error] = error_lines(result)
    assert "missing.txt" in error
    # The job after the failed one ran to its end.
    metrics = [json.loads(line) for line in (sweep_dir / "1" / "metrics.jsonl").open()]
    assert any("eval/loss" in record for record in metrics)

    summary = result.stdout[result.stdout.index(f"flaxlm: multirun in {sweep_dir}"):]
    lines = summary.splitlines()
    assert lines[0] == f"flaxlm: multirun in {sweep_dir}: 1 ok, 1 failed"
    assert lines[1].startswith("  #0 failed    language.files=[missing.txt] | language.files:")
    assert lines[1].endswith(f"run dir {sweep_dir / '0'}")
    assert lines[2].startswith(f"  #1 ok        language.files=[{english}] | eval/loss ")
    assert lines[2].endswith(f"run dir {sweep_dir / '1'}")
