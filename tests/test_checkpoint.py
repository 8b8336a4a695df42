"""`flaxlm.training.checkpoint`: what a checkpoint holds, which ones are kept, what a damaged
or half-written one does to a resume, and `restore_params`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CHECKPOINT_LOADER as LOADER
from conftest import bumped, leaves_equal, save_steps
from flax import nnx

from flaxlm.errors import FlaxlmError
from flaxlm.parallel import make_mesh, replicated
from flaxlm.training.checkpoint.manager import (
    REPLICA_PARALLEL_MIN_BYTES,
    Checkpointer,
    finalised_steps,
    key_from_json,
    key_to_json,
    restore_params,
)
from flaxlm.training.step import TrainState
from flaxlm.training.stop import StopRequest


def restore_latest(directory, abstract_state):
    checkpointer = Checkpointer(str(directory))
    try:
        return checkpointer.restore_latest(abstract_state)
    finally:
        checkpointer.close()


def test_a_checkpoint_restores_state_loader_and_metadata_exactly(tmp_path, train_state):
    key = jax.random.fold_in(jax.random.key(3), 7)
    checkpointer = Checkpointer(str(tmp_path / "ckpt"))
    checkpointer.save(5, train_state, LOADER, {"config": {"a": 1}, "key": key_to_json(key)})
    checkpointer.close()

    restored = restore_latest(tmp_path / "ckpt", train_state)
    assert restored.step == 5 and restored.loader_state == LOADER
    assert restored.metadata["config"] == {"a": 1}
    assert isinstance(restored.state, TrainState) and leaves_equal(restored.state, train_state)
    assert restored.state.params["wte"]["embedding"].sharding == replicated(make_mesh(2))
    same_key = key_from_json(restored.metadata["key"], key)
    assert np.array_equal(jax.random.key_data(same_key), jax.random.key_data(key))


def test_replicas_split_a_large_array_between_them_and_one_writes_a_small_one(tmp_path,
                                                                            monkeypatch):
    """A replicated array's slices are cut on the devices, one program per shape: below
    REPLICA_PARALLEL_MIN_BYTES a slice costs more than it saves, and one replica writes it all.
    Either way the checkpoint holds every value."""
    sliced = []
    slice_in_dim = jax.lax.slice_in_dim

    def recording_slice(operand, *args, **kwargs):
        sliced.append(operand.shape)
        return slice_in_dim(operand, *args, **kwargs)

    monkeypatch.setattr(jax.lax, "slice_in_dim", recording_slice)
    small, large = (8, 1237), (8, REPLICA_PARALLEL_MIN_BYTES // 4 + 3)  # 1 row per replica
    state = jax.device_put(
        {"params": {"small": jnp.arange(np.prod(small), dtype=jnp.float32).reshape(small),
                    "large": jnp.arange(np.prod(large), dtype=jnp.float32).reshape(large)}},
        replicated(make_mesh(8)))
    checkpointer = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    checkpointer.save(1, state, LOADER, {})
    restored = checkpointer.restore(1, state)
    checkpointer.close()
    assert sliced == [large] * 8
    assert leaves_equal(restored.state, state)


@pytest.mark.slow
def test_an_async_save_is_not_changed_by_the_steps_that_donate_the_state_after_it(tmp_path,
                                                                                   train_state):
    """The loop dispatches the next step (which donates and overwrites the state's buffers)
    right after save() returns; the checkpoint must still hold the state as it was."""
    state = bumped(train_state, 1.0)
    expected = jax.device_get(state)
    step_on = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s), donate_argnums=0)
    checkpointer = Checkpointer(str(tmp_path / "ckpt"), async_save=True)
    checkpointer.save(1, state, LOADER, {})
    for _ in range(3):
        state = step_on(state)
    checkpointer.close()
    restored = restore_latest(tmp_path / "ckpt", train_state)
    assert leaves_equal(restored.state, expected)


def test_an_async_save_calls_before_commit_once_its_files_are_written_before_it_counts(
        tmp_path, train_state):
    """What a bucket run's metrics copy hangs on (flaxlm.run_mirror): when before_commit runs,
    the step's items are written but the step is not yet one a resume would pick."""
    directory = str(tmp_path / "ckpt")
    seen = []
    checkpointer = Checkpointer(directory, async_save=True, before_commit=lambda: seen.append(
        (finalised_steps(directory), sorted(os.listdir(directory)))))
    checkpointer.save(1, train_state, LOADER, {})
    checkpointer.close()
    assert len(seen) == 1
    steps_then, names_then = seen[0]
    assert steps_then == []  # not yet complete
    assert any(name.startswith("1.orbax-checkpoint-tmp") for name in names_then)  # but written
    assert finalised_steps(directory) == [1]


def test_keeps_the_last_k_and_the_best_by_eval_loss(tmp_path, train_state):
    checkpointer = Checkpointer(str(tmp_path / "ckpt"), keep_last=2, keep_best=1)
    losses = {2: 3.0, 4: 1.0, 6: None, 8: 2.0, 10: None}  # None: saved without an eval
    for step, loss in losses.items():
        metrics = None if loss is None else {"eval/loss": loss, "eval/perplexity": 9.0}
        checkpointer.save(step, bumped(train_state, step), LOADER, {}, metrics)
    checkpointer.close()
    assert checkpointer.steps() == [4, 8, 10]  # last two (8, 10) + best (4: loss 1.0)


# orbax's failed read of the damaged step leaves a callback for its closed event loop.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_latest_checkpoint_is_skipped_with_a_message(tmp_path, train_state, capsys):
    directory = tmp_path / "ckpt"
    save_steps(directory, train_state, [4, 8]).close()
    # A step folder that looks finalised but lost its array data (a truncated copy, a full disk)
    for root, _, files in os.walk(directory / "8" / "state"):
        for name in files:
            if "ocdbt" in root or name.startswith("manifest"):
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(os.path.getsize(os.path.join(root, name)) // 3)

    restored = restore_latest(directory, train_state)
    assert restored.step == 4 and leaves_equal(restored.state, bumped(train_state, 4))
    err = capsys.readouterr().err
    assert "checkpoint step 8" in err and "falling back" in err


def test_a_save_killed_before_it_finished_is_never_a_step(tmp_path, train_state):
    """orbax writes `<step>.orbax-checkpoint-tmp-<n>/` and renames it when whole: a process
    killed mid-write leaves only the tmp folder, which no resume lists and the next run
    removes."""
    directory = tmp_path / "ckpt"
    save_steps(directory, train_state, [4]).close()
    half = directory / "8.orbax-checkpoint-tmp-1234567"
    shutil.copytree(directory / "4", half)
    os.remove(half / "state" / "manifest.ocdbt")

    checkpointer = Checkpointer(str(directory))
    assert checkpointer.steps() == [4]
    assert checkpointer.restore_latest(train_state).step == 4
    checkpointer.close()
    assert not half.exists()


def test_a_step_folder_without_its_items_is_skipped(tmp_path, train_state, capsys):
    directory = tmp_path / "ckpt"
    save_steps(directory, train_state, [4]).close()
    (directory / "8").mkdir()  # a bare folder named like a step
    restored = restore_latest(directory, train_state)
    assert restored.step == 4
    assert "checkpoint step 8" in capsys.readouterr().err


def test_restore_params_gives_the_pure_dict_of_the_latest_or_a_given_step(tmp_path, train_state):
    save_steps(tmp_path / "checkpoints", train_state, [3, 6]).close()
    params, config, step = restore_params(str(tmp_path))
    assert step == 6 and config == {"model": {"num_layers": 2}}
    expected = nnx.to_pure_dict(jax.device_get(bumped(train_state, 6).params))
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(params))
    assert leaves_equal(params, expected)
    assert restore_params(str(tmp_path), step=3)[2] == 3
    with pytest.raises(FlaxlmError, match="no checkpoint for step 5"):
        restore_params(str(tmp_path), step=5)


def test_restore_params_of_a_run_without_checkpoints_says_so(tmp_path):
    with pytest.raises(FlaxlmError, match="no complete checkpoint"):
        restore_params(str(tmp_path))


KILLED_MID_SAVE = """
import os, signal, sys
import numpy as np
from flaxlm.training.checkpoint.manager import Checkpointer
checkpointer = Checkpointer(sys.argv[1], async_save=True)
checkpointer.save(1, {"params": {"w": np.ones((4, 4), np.float32)}}, {}, {})
checkpointer.wait()
big = {"params": {"w": np.full((64, 1024, 1024), 2.0, np.float32)}}  # 256 MiB: takes a while
checkpointer.save(2, big, {}, {})
print("saving", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_as_the_latest(tmp_path):
    """A real kill -9 while the background thread writes step 2: step 2 is not listed, and
    step 1 restores."""
    directory = tmp_path / "ckpt"
    result = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(directory)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL and "saving" in result.stdout, result.stderr
    leftovers = [name for name in os.listdir(directory) if name != "1"]
    checkpointer = Checkpointer(str(directory))
    try:
        assert checkpointer.steps() == [1]
        restored = checkpointer.restore_latest({"params": {"w": np.zeros((4, 4), np.float32)}})
    finally:
        checkpointer.close()
    assert restored.step == 1 and np.array_equal(restored.state["params"]["w"], np.ones((4, 4)))
    assert all(".orbax-checkpoint-tmp" in name for name in leftovers), leftovers


def test_a_repeated_sigterm_is_ignored_and_a_second_sigint_goes_to_the_previous_handler(
        capsys):
    """Issue 20: the second of two SIGTERMs (a scheduler signals the process group and the
    process) went to the previous handler, which kills the process mid-save."""
    received = []

    def record(signum, _frame):
        received.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = StopRequest()
        with stop.catching_signals():
            for _ in range(3):
                os.kill(os.getpid(), signal.SIGTERM)
            assert stop.signal_name == "SIGTERM" and received == []
            os.kill(os.getpid(), signal.SIGINT)
            assert received == [signal.SIGINT]
            assert signal.getsignal(signal.SIGTERM) is record  # put back at once
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert err.count("SIGTERM again: ignored while the checkpoint is saved") == 2
    assert "SIGINT again: stopping at once" in err


SECOND_CTRL_C = """
import os, signal, sys, time
from flaxlm.training.stop import StopRequest

# As at an interactive shell: a job started in the background of a script inherits SIGINT
# ignored, and a process that ignores Ctrl-C cannot be stopped by it.
signal.signal(signal.SIGINT, signal.default_int_handler)

with StopRequest().catching_signals():
    os.kill(os.getpid(), signal.SIGINT)
    print("saving", flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
    print("still running", flush=True)
"""


def test_a_second_ctrl_c_ends_the_process_at_once():
    """Python's KeyboardInterrupt would let the job's clean-up wait for the save."""
    result = subprocess.run([sys.executable, "-c", SECOND_CTRL_C], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == -signal.SIGINT, result.stderr[-3000:]
    assert result.stdout == "saving\n"
    assert "SIGINT again: stopping at once" in result.stderr


def test_bfloat16_moments_come_back_bfloat16_and_exact(tmp_path, train_state):
    """optimizer.moment_dtype=bfloat16's state, saved and restored into the state a resumed run
    builds (the same optimizer): the moments stay bfloat16, bit for bit."""
    import optax

    from flaxlm.training.optimizer import moments_stored_in

    tx = moments_stored_in(jnp.bfloat16, optax.adamw(1e-3))
    params = train_state.params
    _, opt_state = jax.jit(tx.update)(params, tx.init(params), params)  # a gradient: params
    state = train_state.replace(opt_state=opt_state)
    save_steps(tmp_path / "ckpt", state, [3]).close()
    restored = restore_latest(tmp_path / "ckpt", jax.eval_shape(lambda: state)).state
    moments = [leaf for leaf in jax.tree.leaves(restored.opt_state) if leaf.ndim]
    assert moments and {leaf.dtype for leaf in moments} == {jnp.dtype(jnp.bfloat16)}
    assert leaves_equal(restored, bumped(state, 3))
