"""Fault injection: a run killed with SIGKILL at any point, a damaged or half-written checkpoint
of any kind, and a full disk each leave a run directory that nothing in is corrupt, and that
resumes to the result of the run that never failed."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
import safetensors.numpy
from conftest import (
    TINY,
    assert_same_params,
    bumped,
    compose,
    leaves_equal,
    metrics_of,
    save_steps,
    trained_run,
)
from orbax.checkpoint._src.serialization import serialization

from flaxlm.errors import FlaxlmError
from flaxlm.job import train
from flaxlm.models import hf
from flaxlm.tracking import Tracker
from flaxlm.training.checkpoint.manager import Checkpointer, finalised_steps, restore_params
from flaxlm.training.stop import PREEMPTED_EXIT_CODE

# 2 epochs of 6 steps: checkpoints at 4, 6, 8, 12 (the last 3 and the best kept), evaluations at
# 0, 6 and 12. The same data as test_resume's and test_multihost's runs, packed once a session.
RUN = [*TINY, "language.max_train_docs=8", "language.max_eval_docs=2", "trainer.num_epochs=2",
       "trainer.log_every_steps=2", "checkpoint.every_steps=4", "optimizer.warmup_steps=2",
       "trainer.eval_every_steps=6", "samples.prompts=[]"]

# Runs flaxlm-train in a subprocess with one fault planted: argv is the fault, its argument and
# the overrides. "step" N: SIGKILL while the N-th step runs; "save" N: SIGKILL when the save of
# step N is written but not yet renamed into place; "eval" N: SIGKILL inside the N-th
# evaluation; "export": SIGKILL between moving the old model/ aside and the new one into place;
# "slow-save" S: every save takes S seconds more to finish in the background.
FAULTY_RUN = r"""
import dataclasses, os, signal, sys

fault, argument, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
calls = 0


def kill_at(n):
    global calls
    calls += 1
    if calls == n:
        print(f"fault: SIGKILL at {fault} {n}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


if fault == "step":
    import flaxlm.tasks.language_model as language_model
    compile_steps = language_model.compile_steps

    def compile_killing(*args, **kwargs):
        steps = compile_steps(*args, **kwargs)

        def train(*step_args):
            result = steps.train(*step_args)  # dispatched: the step runs on the devices
            kill_at(int(argument))
            return result

        return dataclasses.replace(steps, train=train)

    language_model.compile_steps = compile_killing
elif fault == "save":
    from orbax.checkpoint._src.path import atomicity
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize_killing(self, *args, **kwargs):
        if self.get_final().name == argument:
            kill_at(1)
        return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize_killing
elif fault == "eval":
    import flaxlm.training.evaluation as evaluation
    eval_batches = evaluation.eval_batches

    def eval_batches_killing(*args, **kwargs):
        for index, batch in enumerate(eval_batches(*args, **kwargs)):
            if index == 1:
                kill_at(int(argument))
            yield batch

    evaluation.eval_batches = eval_batches_killing
elif fault == "export":
    rename = os.rename

    def rename_killing(source, target, *args, **kwargs):
        rename(source, target, *args, **kwargs)
        if os.path.basename(target).startswith(".model.old-"):
            kill_at(1)

    os.rename = rename_killing
elif fault == "slow-save":
    import asyncio
    from orbax.checkpoint._src.path import atomicity
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize_slowly(self, *args, **kwargs):
        if self.get_final().name.isdigit():  # the step's folder, not its items'
            await asyncio.sleep(float(argument))
        return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize_slowly

sys.argv = ["flaxlm-train", *overrides]
from flaxlm.cli.train import main
main()
"""


# A failed orbax read or write leaves a callback for its closed event loop.
orbax_closed_loop = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def run_with_fault(run_dir, fault: str, argument, *overrides: str):
    return subprocess.run(
        [sys.executable, "-c", FAULTY_RUN, fault, str(argument), *RUN, *overrides,
         f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=600,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run that never failed."""
    return trained_run(tmp_path_factory, "reference", RUN)


def assert_intact(run_dir):
    """Every checkpoint restores, no half-written one is left, every metrics line is whole,
    and model/ holds the latest checkpoint's parameters."""
    checkpoints = run_dir / "checkpoints"
    assert all(name.isdigit() or ".damaged-" in name for name in os.listdir(checkpoints))
    for step in finalised_steps(str(checkpoints)):
        assert restore_params(str(run_dir), step=step)[2] == step
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == sorted(steps)
    params, _, _ = restore_params(str(run_dir))
    exported = safetensors.numpy.load_file(str(run_dir / "model" / "model.safetensors"))
    expected = hf.to_hf_state_dict(params)
    assert exported.keys() <= expected.keys()
    for key, value in exported.items():
        np.testing.assert_array_equal(value, expected[key], err_msg=key)
    assert [name for name in os.listdir(run_dir) if name.startswith(".model.")] == []


def assert_same_run(run_dir, reference_dir):
    assert metrics_of(run_dir) == metrics_of(reference_dir)
    assert_same_params(run_dir, reference_dir)
    assert_intact(run_dir)


@pytest.mark.slow
def test_a_run_killed_at_any_point_resumes_to_the_result_of_the_run_never_killed(
        tmp_path, reference, capsys):
    """One run killed four times, each start resuming the last: in a step, in an async save,
    in an evaluation, in the final export; the last start finishes it."""
    run_dir = tmp_path / "run"
    sync = "checkpoint.async_save=false"  # the kill must find the checkpoint before it on disk

    killed = run_with_fault(run_dir, "step", 6, sync)
    assert "fault: SIGKILL at step 6" in killed.stdout, killed.stderr[-3000:]
    assert killed.returncode == -signal.SIGKILL
    assert finalised_steps(str(run_dir / "checkpoints")) == [4]

    killed = run_with_fault(run_dir, "save", 8)
    assert "fault: SIGKILL at save" in killed.stdout, killed.stderr[-3000:]
    assert finalised_steps(str(run_dir / "checkpoints")) == [4, 6]
    assert any(name.startswith("8.orbax-checkpoint-tmp")
               for name in os.listdir(run_dir / "checkpoints"))

    killed = run_with_fault(run_dir, "eval", 1, sync)  # the evaluation at 12, before its save
    assert "fault: SIGKILL at eval 1" in killed.stdout, killed.stderr[-3000:]
    assert "from its checkpoint at step 6" in killed.stdout
    assert finalised_steps(str(run_dir / "checkpoints")) == [4, 6, 8]

    killed = run_with_fault(run_dir, "export", 1, sync)
    assert "fault: SIGKILL at export" in killed.stdout, killed.stderr[-3000:]
    assert "from its checkpoint at step 8" in killed.stdout
    assert not (run_dir / "model").exists()  # the worst moment: the old one moved aside
    assert finalised_steps(str(run_dir / "checkpoints"))[-1] == 12  # the run had finished

    capsys.readouterr()
    train(compose(RUN, run_dir=run_dir))  # trains no step: only exports again
    assert "from its checkpoint at step 12" in capsys.readouterr().out
    assert_same_run(run_dir, reference)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _largest_array_file(step_dir):
    data = os.path.join(step_dir, "state", "ocdbt.process_0", "d")
    return max((os.path.join(data, n) for n in os.listdir(data)), key=os.path.getsize)


def _empty(step_dir):
    shutil.rmtree(step_dir)
    os.mkdir(step_dir)


def _metadata_of_another_step(step_dir):
    shutil.rmtree(step_dir)
    shutil.copytree(os.path.join(os.path.dirname(step_dir), "4"), step_dir)


DAMAGE = {
    "truncated array file": lambda step_dir: _truncate(_largest_array_file(step_dir)),
    "missing array file": lambda step_dir: os.remove(_largest_array_file(step_dir)),
    "missing array index": lambda step_dir: os.remove(
        os.path.join(step_dir, "state", "manifest.ocdbt")),
    "truncated tree metadata": lambda step_dir: _truncate(
        os.path.join(step_dir, "state", "_METADATA")),
    "corrupt loader json": lambda step_dir: _truncate(
        os.path.join(step_dir, "loader", "metadata")),
    "missing run metadata": lambda step_dir: shutil.rmtree(os.path.join(step_dir, "meta")),
    "metadata of another step": _metadata_of_another_step,
    "empty step folder": _empty,
    "a file named like the step": lambda step_dir: (shutil.rmtree(step_dir),
                                                     open(step_dir, "w").close()),
}


@pytest.mark.slow
@orbax_closed_loop
def test_a_run_whose_last_checkpoint_is_damaged_sets_it_aside_and_finishes_from_the_one_before(
        tmp_path, reference, capsys):
    """Issue 9, defect 3: the damaged step stayed, and saving that step again failed with
    orbax's StepAlreadyExistsError on every retry."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    DAMAGE["truncated array file"](str(run_dir / "checkpoints" / "12"))  # the repro
    capsys.readouterr()
    train(compose(RUN, run_dir=run_dir))
    captured = capsys.readouterr()
    assert "from its checkpoint at step 8" in captured.out
    [aside] = [n for n in os.listdir(run_dir / "checkpoints") if not n.isdigit()]
    assert aside.startswith("12.damaged-")
    assert f"aside to {run_dir / 'checkpoints' / aside}" in captured.err
    assert finalised_steps(str(run_dir / "checkpoints"))[-1] == 12  # saved anew
    assert_same_run(run_dir, reference)


@pytest.mark.slow  # several seconds: make test runs it
@orbax_closed_loop
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_set_aside_and_its_step_can_be_saved_again(
        tmp_path, train_state, damage, capsys):
    """Every kind of damage: the previous checkpoint is restored, the damaged one renamed (as
    it was, never deleted) out of orbax's sight, and the step can be saved anew."""
    directory = tmp_path / "checkpoints"
    save_steps(directory, train_state, [4, 8]).close()
    DAMAGE[damage](str(directory / "8"))
    damaged_names = sorted(os.listdir(directory / "8")) if (directory / "8").is_dir() else None

    checkpointer = Checkpointer(str(directory))
    restored = checkpointer.restore_latest(train_state)
    assert restored.step == 4 and leaves_equal(restored.state, bumped(train_state, 4))
    [aside] = [n for n in os.listdir(directory) if not n.isdigit()]
    assert aside.startswith("8.damaged-")
    err = capsys.readouterr().err
    assert f"aside to {directory / aside}" in err
    if damaged_names is not None:  # a folder: orbax listed it as a step, and it failed
        assert "checkpoint step 8" in err
        assert sorted(os.listdir(directory / aside)) == damaged_names  # moved, not changed
    assert checkpointer.steps() == [4] and finalised_steps(str(directory)) == [4]

    checkpointer.save(8, bumped(train_state, 9), {"step": 8}, {})  # the crash loop's save
    checkpointer.close()
    again = Checkpointer(str(directory))  # orbax's clean-up of tmp folders spares it
    try:
        resaved = again.restore_latest(train_state)
    finally:
        again.close()
    assert resaved.step == 8 and leaves_equal(resaved.state, bumped(train_state, 9))
    assert aside in os.listdir(directory)


@orbax_closed_loop
def test_when_no_checkpoint_restores_none_is_moved(tmp_path, train_state, capsys):
    """A state that fits no checkpoint (the fault is not the checkpoints') moves nothing."""
    directory = tmp_path / "checkpoints"
    save_steps(directory, train_state, [4, 8]).close()
    other_shape = jax.tree.map(lambda x: np.zeros((3, *x.shape), x.dtype), train_state)
    checkpointer = Checkpointer(str(directory))
    try:
        assert checkpointer.restore_latest(other_shape) is None
    finally:
        checkpointer.close()
    assert sorted(os.listdir(directory)) == ["4", "8"]
    assert "moved" not in capsys.readouterr().err


def test_a_save_that_fails_midway_leaves_no_callback_tracebacks(tmp_path, train_state,
                                                                monkeypatch):
    """Issue 20: a disk full at the first checkpoint printed, one try in two, 77 tracebacks of
    `RuntimeError: Event loop is closed` beside flaxlm's one message. orbax writes the arrays
    concurrently in an event loop of its own and closes it at the first failed write; every
    write still under way calls back into the closed loop when it ends, and tensorstore reports
    that as an unraisable exception. Here those writes are held until the save has failed, so
    it happens every time."""
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import serialization

    held = []

    async def first_write_fails(*args, **kwargs):
        if not held:
            promise, written = ts.Promise.new()
            held.append(promise)
            await asyncio.sleep(0.05)  # the other writes are under way by now
            raise ValueError('RESOURCE_EXHAUSTED: Error writing local file "x": Failed to write '
                             "1363 bytes to file 7: No space left on device [os_error_code='28']")
        promise, written = ts.Promise.new()
        held.append(promise)
        return await written

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(serialization, "async_serialize_from_host", first_write_fails)
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    # Earlier tests' abandoned writes may report while the hook is bare, before the
    # checkpointer puts its filter in front: only what follows is this test's.
    unraisable.clear()
    checkpointer.save(1, train_state, {"step": 1}, {})
    with pytest.raises(Exception, match="No space left on device"):
        checkpointer.close()
    assert len(held) > 2
    for promise in held:  # the writes under way end: each calls back into the closed loop
        promise.set_result(None)
    assert [str(u.exc_value) for u in unraisable] == []


@pytest.mark.slow
@orbax_closed_loop
def test_a_full_disk_stops_the_run_with_a_message_and_it_resumes_when_there_is_room(
        tmp_path, reference, monkeypatch, train_cli):
    """Disk full at a checkpoint (tensorstore's error, in orbax's background thread) and at a
    metrics line (Python's OSError): each stops the run with one message naming the last
    complete checkpoint, which the next start resumes."""
    run_dir = tmp_path / "run"
    serialize = serialization.async_serialize_from_host

    async def serialize_out_of_space(slices, spec, **kwargs):
        if "/8.orbax-checkpoint-tmp" in json.dumps(spec, default=str):  # the save of step 8
            raise ValueError(  # tensorstore's own words, from a real full tmpfs
                'RESOURCE_EXHAUSTED: Error writing "params.wte.embedding.value/0" in OCDBT '
                'database at local file "ocdbt.process_0/": Failed to write 1363 bytes to '
                "file 7: No space left on device [os_error_code='28']")
        return await serialize(slices, spec, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(serialization, "async_serialize_from_host", serialize_out_of_space)
        full = train_cli(*RUN, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert full.returncode == 2, full.stderr[-3000:]
    assert "flaxlm: error: A disk is full" in full.stderr
    assert "last complete checkpoint, step 6, is intact" in full.stderr
    assert "Traceback" not in full.stderr
    assert finalised_steps(str(run_dir / "checkpoints")) == [4, 6]

    log = Tracker.log

    def log_out_of_space(self, metrics, step):
        if step == 10:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a full file write does
        log(self, metrics, step=step)

    with monkeypatch.context() as patch:
        patch.setattr(Tracker, "log", log_out_of_space)
        with pytest.raises(FlaxlmError,
                           match=r"disk is full.*No space left on device.*step 8, is intact"):
            train(compose(RUN, run_dir=run_dir))

    train(compose(RUN, run_dir=run_dir))
    assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_a_repeated_sigterm_does_not_cut_the_preemption_save_short(tmp_path, reference):
    """Issue 20: schedulers and wrappers deliver SIGTERM twice (to the process group and to
    the process); the second one, 0.2 s after the first, killed the run mid-save (exit 143,
    only a tmp folder left). Now it is ignored: the save completes and the run exits 75.

    The second signal is sent once the first is handled: two sent while the process is inside
    one long call into XLA reach Python's handler as one."""
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-c", FAULTY_RUN, "slow-save", "1", *RUN, f"hydra.run.dir={run_dir}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    lines, handled = [], threading.Event()

    def read_stderr():
        for line in process.stderr:
            lines.append(line)
            if "SIGTERM received" in line:
                handled.set()

    try:
        wait_for_logged_step(run_dir, 5, process)  # past the first save (step 4)
        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        process.send_signal(signal.SIGTERM)
        assert handled.wait(timeout=120), "".join(lines)[-3000:]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=300)
        reader.join(timeout=60)
    finally:
        process.kill()
    err = "".join(lines)
    assert process.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    assert "SIGTERM again: ignored while the checkpoint is saved" in err
    stopped = int(re.search(r"stopped by SIGTERM after step (\d+)", err)[1])
    assert finalised_steps(str(run_dir / "checkpoints"))[-1] == stopped
    assert [n for n in os.listdir(run_dir / "checkpoints") if not n.isdigit()] == []
    train(compose(RUN, run_dir=run_dir))
    assert_same_run(run_dir, reference)


def wait_for_logged_step(run_dir, step: int, process, timeout: float = 300) -> None:
    """Until metrics.jsonl holds a line of `step` or later (the run is past it)."""
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while True:
        lines = path.read_text().splitlines(keepends=True) if path.exists() else []
        if any(json.loads(line)["step"] >= step for line in lines if line.endswith("\n")):
            return
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"no step {step} within {timeout}s"
        time.sleep(0.1)


@pytest.mark.slow
@orbax_closed_loop
def test_a_failed_asynchronous_save_stops_the_run_at_the_next_step(tmp_path, monkeypatch):
    """Issue 20: after a save that failed in the background, training ran on until the next
    save (every step in between lost) before stopping. Now the next step stops it, with the
    save's own error."""
    from orbax.checkpoint._src.serialization import serialization

    import flaxlm.tasks.language_model as language_model

    failed = threading.Event()
    serialize = serialization.async_serialize_from_host

    async def serialize_failing(slices, spec, **kwargs):
        if "/4.orbax-checkpoint-tmp" in json.dumps(spec, default=str):
            failed.set()
            raise ValueError("PERMISSION_DENIED: injected failure of the save of step 4")
        return await serialize(slices, spec, **kwargs)

    compile_steps, calls = language_model.compile_steps, [0]

    def compile_waiting(*args, **kwargs):
        steps = compile_steps(*args, **kwargs)

        def train_step(*step_args):
            calls[0] += 1
            if calls[0] == 5:  # the failure has happened by the 5th step, however slow orbax is
                assert failed.wait(60)
                time.sleep(0.5)
            return steps.train(*step_args)

        return dataclasses.replace(steps, train=train_step)

    monkeypatch.setattr(serialization, "async_serialize_from_host", serialize_failing)
    monkeypatch.setattr(language_model, "compile_steps", compile_waiting)
    run_dir = tmp_path / "run"
    with pytest.raises(Exception, match="injected failure of the save of step 4"):
        train(compose(RUN, run_dir=run_dir))
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert max(logged) == 4  # stopped at step 5, not at the next save (step 8)
    assert finalised_steps(str(run_dir / "checkpoints")) == []
