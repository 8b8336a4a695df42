"""Never lose a run: stopped by SIGTERM, a run resumes to exactly the parameters and metrics of
the run that never stopped; a changed config that would train something else is refused; a
non-finite step stops the run (or is skipped) without ever reaching a checkpoint."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal

import numpy as np
import pytest
import safetensors.numpy
from conftest import (
    TINY,
    assert_same_params,
    compose,
    flat,
    metrics_of,
    stop_at,
    streaming_run,
    trained_run,
)

from flaxlm.data.loader import RowLoader
from flaxlm.errors import FlaxlmError
from flaxlm.job import train
from flaxlm.models import hf
from flaxlm.training import evaluation
from flaxlm.training.checkpoint.manager import restore_params
from flaxlm.training.stop import Preempted

# 2 epochs of 6 steps; a checkpoint every 4 steps and at each epoch end (4, 6, 8, 12). The
# same data as test_multihost's run, so the session packs it once.
RUN = [*TINY, "language.max_train_docs=8", "language.max_eval_docs=2", "trainer.num_epochs=2",
       "trainer.log_every_steps=2", "checkpoint.every_steps=4", "optimizer.warmup_steps=2",
       "samples.prompts=[]"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every resumed run is compared with."""
    return trained_run(tmp_path_factory, "reference", RUN)


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_resumes_to_the_same_parameters_and_metrics(
        tmp_path, reference, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        stop_at(patch, 10)  # in the second epoch, not a checkpoint step
        with pytest.raises(Preempted) as stopped:
            train(compose(RUN, run_dir=run_dir))
    assert stopped.value.step == 10 and stopped.value.signal_name == "SIGTERM"
    assert os.path.isdir(run_dir / "checkpoints" / "10")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers put back
    # As if killed -9 after the checkpoint: lines past it, the last one half-written.
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 11, "train/loss": 1.0}) + '\n{"step": 12, "train/lo')

    capsys.readouterr()
    train(compose(RUN, run_dir=run_dir))
    out = capsys.readouterr().out
    assert "resuming" in out and "step 10" in out and "2 metrics.jsonl line(s)" in out
    assert metrics_of(run_dir) == metrics_of(reference)
    assert_same_params(run_dir, reference)


@pytest.mark.slow
def test_resuming_with_another_model_shape_fails_listing_the_differences(tmp_path, reference):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    with pytest.raises(FlaxlmError) as error:
        train(compose([*RUN, "model.num_layers=3", "optimizer.lr=1e-3"], run_dir=run_dir))
    message = str(error.value)
    assert "model.num_layers: 2 → 3" in message and "optimizer.lr: 0.0003 → 0.001" in message
    assert "trainer.resume=never" in message


@pytest.mark.slow
def test_resuming_with_a_new_log_cadence_and_length_continues(tmp_path, reference, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    train(compose([*RUN, "trainer.log_every_steps=3", "trainer.num_epochs=3"], run_dir=run_dir))
    assert "resuming" in capsys.readouterr().out
    records = metrics_of(run_dir)
    assert records[: len(metrics_of(reference))] == metrics_of(reference)
    assert [r["step"] for r in records if "train/loss" in r][-2:] == [15, 18]
    assert restore_params(str(run_dir))[2] == 18


def test_resume_must_without_a_checkpoint_and_never_with_resume_from_fail(tmp_path):
    with pytest.raises(FlaxlmError, match="no complete checkpoint"):
        train(compose([*RUN, "trainer.resume=must"], run_dir=tmp_path / "new"))
    with pytest.raises(FlaxlmError, match="trainer.resume=never"):
        train(compose([*RUN, "trainer.resume=never", f"resume_from={tmp_path}"],
                      run_dir=tmp_path / "x"))


def corrupt_batch_at(monkeypatch, bad_step: int):
    """Token ids past the vocabulary in the batch of `bad_step`: the embedding lookup fills
    them with NaN, so that step's loss and gradients are NaN. By the batch's place in the run,
    not by how many were read: the run reads its first batch's shapes before training (the
    train step compiled ahead)."""
    epoch_of = RowLoader.epoch

    def epoch(self, epoch_index, start_step=0):
        for index, batch in enumerate(epoch_of(self, epoch_index, start_step), start_step):
            step = epoch_index * self.steps_per_epoch + index + 1
            yield batch + 100_000 if step == bad_step else batch

    monkeypatch.setattr(RowLoader, "epoch", epoch)


def test_a_nan_loss_stops_the_run_naming_the_step_and_keeps_the_good_checkpoint(
        tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    corrupt_batch_at(monkeypatch, 7)
    with pytest.raises(FlaxlmError, match=r"diverged at step 7.*checkpoint \(step 6\)"):
        train(compose([*RUN, "checkpoint.every_steps=3"], run_dir=run_dir))
    params, _, step = restore_params(str(run_dir))
    assert step == 6  # step 9's save never happened: the loop stopped on 7's loss first
    assert all(np.isfinite(leaf).all() for _, leaf in flat(params))


@pytest.mark.slow
def test_skip_nonfinite_skips_the_bad_step_and_counts_it(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    corrupt_batch_at(monkeypatch, 3)
    # Logs at 2, 4 and 6: before the bad step, with it, and after it (the count restarts).
    loss = train(compose([*RUN, "trainer.skip_nonfinite=true", "trainer.max_steps=6"],
                         run_dir=run_dir))
    assert math.isfinite(loss)
    assert "step 3 skipped" in capsys.readouterr().out
    logs = {r["step"]: r for r in metrics_of(run_dir) if "train/loss" in r}
    assert [logs[s]["train/skipped_steps"] for s in sorted(logs)] == [0, 1, 0]
    assert all(math.isfinite(r["train/loss"]) for r in logs.values())  # mean of the others
    params, _, _ = restore_params(str(run_dir))
    assert all(np.isfinite(leaf).all() for _, leaf in flat(params))


@pytest.mark.slow
def test_restore_params_equals_the_exported_model(reference):
    params, config, step = restore_params(str(reference))
    assert step == 12 and config["model"]["num_layers"] == 2
    exported = safetensors.numpy.load_file(str(reference / "model" / "model.safetensors"))
    for key, value in hf.to_hf_state_dict(params).items():
        if key in exported:
            np.testing.assert_array_equal(exported[key], value, err_msg=key)
    assert set(exported) <= set(hf.to_hf_state_dict(params))


@pytest.mark.slow
def test_a_streaming_run_resumes_from_its_stream_position(tmp_path, monkeypatch, capsys):
    """language.streaming: the checkpoint holds the StreamState, and the resumed run reads the
    same next batches as the run that never stopped."""
    settings = ["trainer.max_steps=6", "checkpoint.every_steps=3", "trainer.log_every_steps=2",
                "language.shuffle_buffer=5"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    train(streaming_run(tmp_path / "a", *settings))
    cfg = streaming_run(tmp_path / "b", *settings)
    with monkeypatch.context() as patch:
        stop_at(patch, 4)
        with pytest.raises(Preempted):
            train(cfg)
    assert restore_params(str(tmp_path / "b" / "run"))[2] == 4
    capsys.readouterr()
    train(cfg)
    assert "from its checkpoint at step 4" in capsys.readouterr().out
    assert metrics_of(tmp_path / "b" / "run") == metrics_of(tmp_path / "a" / "run")
    assert_same_params(tmp_path / "b" / "run", tmp_path / "a" / "run")


# Evaluations at steps 0, 3 and 6 (the last), each of several batches (RUN's data, one
# validation block per device and batch).
LONG_EVAL = [*TINY, "language.max_train_docs=8", "language.max_eval_docs=2",
             "hardware.per_device_eval_batch_size=1", "trainer.max_steps=6",
             "trainer.eval_every_steps=3", "trainer.log_every_steps=1", "samples.prompts=[]"]


def sigterm_in_evaluation(monkeypatch, call: int):
    """Send SIGTERM to this process while the `call`-th evaluation of the run dispatches its
    second batch."""
    eval_batches = evaluation.eval_batches
    calls = [0]

    def eval_batches_signalling(*args, **kwargs):
        calls[0] += 1
        for index, batch in enumerate(eval_batches(*args, **kwargs)):
            if calls[0] == call and index == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    monkeypatch.setattr(evaluation, "eval_batches", eval_batches_signalling)


@pytest.mark.slow
def test_sigterm_in_a_long_evaluation_cuts_it_and_the_resumed_run_evaluates_again(
        tmp_path_factory, monkeypatch, capsys):
    """Issue 20: SIGTERM waited for the whole evaluation (a preemption's grace period is
    short). Now the evaluation stops at its next batch, is not logged, and the resumed run
    does it again: once cut in a mid-run evaluation, once in the last one."""
    reference = trained_run(tmp_path_factory, "long-eval-reference", LONG_EVAL)
    run_dir = tmp_path_factory.mktemp("long-eval") / "run"
    cfg = compose(LONG_EVAL, run_dir=run_dir)
    for stop_step in (3, 6):  # the 2nd evaluation of each start: 0, 3 | 3 (again), 6
        capsys.readouterr()
        with monkeypatch.context() as patch:
            sigterm_in_evaluation(patch, call=2)
            with pytest.raises(Preempted) as stopped:
                train(cfg)
        assert stopped.value.step == stop_step
        err = capsys.readouterr().err
        cut = re.search(rf"the evaluation at step {stop_step} was cut after (\d+) of (\d+) "
                        "batches and is not logged", err)
        assert cut is not None, err[-3000:]
        assert int(cut[1]) <= 2 < int(cut[2])
        assert not [r for r in metrics_of(run_dir) if r["step"] == stop_step and "eval/loss" in r]
        assert restore_params(str(run_dir))[2] == stop_step
    train(cfg)
    assert metrics_of(run_dir) == metrics_of(reference)
    assert_same_params(run_dir, reference)
    train(cfg)  # finished: evaluates the cut step again, and logs it once
    assert metrics_of(run_dir) == metrics_of(reference)
