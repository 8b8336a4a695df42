"""A periodic thing during training is one hook: a task hands it to the loop, which runs it at
its steps and events, without an edit inside `fit`; a resumed run runs it at exactly the steps
the uninterrupted run would have."""

from __future__ import annotations

import pytest
from conftest import TINY, compose, stop_at

from flaxlm.job import train
from flaxlm.tasks import base
from flaxlm.training.loop import END, EPOCH_END, START, STEP, Hook, Loop
from flaxlm.training.stop import Preempted

# 2 epochs of 4 steps (39 blocks, 8 rows per step).
RUN = [*TINY, "hardware.per_device_batch_size=1", "language.max_train_docs=6",
       "language.max_eval_docs=2", "trainer.num_epochs=2", "trainer.log_every_steps=2",
       "checkpoint.every_steps=5", "samples.prompts=[]"]


class Recorder(Hook):
    """Every 3 steps and at each epoch end: what the loop shows a hook."""

    def __init__(self):
        super().__init__(every=3, at=(EPOCH_END,))
        self.seen: list[tuple[int, float, bool]] = []

    def __call__(self, loop: Loop) -> None:
        self.seen.append((loop.step, loop.epoch, EPOCH_END in loop.events))


def with_hook(monkeypatch, hook: Hook) -> None:
    """The task's loop gets `hook` after its own, as a task passes its hooks to
    `base.run_loop`."""
    run_loop = base.run_loop

    def run_loop_with_hook(*args, hooks=(), **kwargs):
        return run_loop(*args, hooks=[*hooks, hook], **kwargs)

    monkeypatch.setattr(base, "run_loop", run_loop_with_hook)


def test_a_hook_is_due_every_n_steps_and_at_its_events():
    hook = Hook(every=3, at=(EPOCH_END,))
    due = [step for step in range(1, 11)
           if hook.due(step, frozenset({STEP, *([EPOCH_END] if step % 5 == 0 else [])}))]
    assert due == [3, 5, 6, 9, 10]
    assert not hook.due(0, frozenset({START}))  # `every` counts steps, not the start
    assert Hook(at=(START,)).due(0, frozenset({START}))
    assert not Hook(every=2).due(4, frozenset({END}))


@pytest.mark.slow
def test_a_custom_hook_runs_at_its_steps_and_the_resumed_run_at_the_same_ones(
        tmp_path, monkeypatch):
    reference = Recorder()
    with monkeypatch.context() as patch:
        with_hook(patch, reference)
        train(compose(RUN, run_dir=tmp_path / "reference"))
    assert reference.seen == [(3, 0.75, False), (4, 1.0, True), (6, 1.5, False), (8, 2.0, True)]

    # Stopped by SIGTERM at step 6, while the loop logs it: the hook runs at 6 before the
    # loop stops, and the resumed run goes on from 7.
    first, resumed = Recorder(), Recorder()
    run_dir = tmp_path / "stopped"
    with monkeypatch.context() as patch:
        with_hook(patch, first)
        stop_at(patch, 6)
        with pytest.raises(Preempted) as stopped:
            train(compose(RUN, run_dir=run_dir))
    assert stopped.value.step == 6
    with monkeypatch.context() as patch:
        with_hook(patch, resumed)
        train(compose(RUN, run_dir=run_dir))
    assert first.seen + resumed.seen == reference.seen
    assert first.seen[-1][0] == 6 and resumed.seen[0][0] > 6
