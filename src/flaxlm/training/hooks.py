"""What a run does while it trains, as hooks of the loop: log, evaluate, report each epoch,
checkpoint, stop on a signal.

A hook (`Hook`, training/loop.py) runs after every `every` steps and at the events in `at`
(START, EPOCH_END, END), and is called with the `Loop`. `standard_hooks` lists a run's hooks in
the order they run at a step, and that order is part of what they promise: the train metrics
are logged before the step's evaluation (as metrics.jsonl has always had them), a checkpoint
carries the evaluation of its step, and the stop request comes last, asked at the same points
on every process. A task adds its own (a downstream evaluation, a profiler window) from its
`Task.hooks` (tasks/pipeline.py); they run after the evaluation, before the checkpoint.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tqdm.auto import tqdm

from flaxlm.training.evaluation import Evaluate, describe
from flaxlm.training.loop import END, EPOCH_END, START, Hook, Loop
from flaxlm.training.plan import Plan
from flaxlm.training.stop import EvaluationCut


def standard_hooks(plan: Plan, evaluate: Evaluate, extra: Sequence[Hook] = ()) -> list[Hook]:
    """A run's hooks, in the order they run at a step; `extra` after the evaluation."""
    return [
        LogTrain(plan.log_every),
        Evaluation(evaluate, plan.eval_every, plan.eval_before_training),
        EpochReport(),
        *extra,
        Checkpoint(plan.checkpoint_every, plan.checkpoint_at_epoch_end),
        StopOnRequest(),
    ]


class LogTrain(Hook):
    """The train metrics since the last log line, every `every` steps and after the last."""

    def __init__(self, every: int):
        super().__init__(every, at=(END,))

    def __call__(self, loop: Loop) -> None:
        record = loop.window.flush(loop.epoch)
        loop.show(loss=f"{record['train/loss']:.3f}")
        loop.tracker.log({**record, **loop.tokens_seen()}, step=loop.step)


class Evaluation(Hook):
    """The task's evaluation every `every` steps and at each epoch end, and before training if
    `before_training`. A stop cuts it short: nothing is logged, the state is saved with the
    evaluation marked due, and the resumed run does it first, at its start."""

    def __init__(self, evaluate: Evaluate, every: int | None, before_training: bool):
        super().__init__(every, at=(START, EPOCH_END))
        self.evaluate, self.before_training = evaluate, before_training

    def __call__(self, loop: Loop) -> None:
        if START not in loop.events:
            self.run(loop, loop.epoch)
        elif loop.eval_due is not None:  # cut short by the stop this run resumes from
            self.run(loop, loop.eval_due)
            tqdm.write(f"{f'step {loop.step}' if loop.step else 'before training'}: "
                       + describe(loop.last_eval))
        elif self.before_training and not loop.resumed:
            self.run(loop, 0.0)
            tqdm.write("before training: " + describe(loop.last_eval))

    def run(self, loop: Loop, epoch: float) -> None:
        try:
            results = self.evaluate(loop.state.params, loop.stop)
        except EvaluationCut as cut:  # nothing logged: these numbers are not an evaluation
            print(f"flaxlm: {loop.stop.signal_name}: the evaluation at step {loop.step} was cut "
                  f"after {cut.done} of {cut.total} batches and is not logged; the resumed run "
                  "evaluates this step again", file=sys.stderr, flush=True)
            raise loop.preempt(eval_due=epoch) from None
        loop.record_eval(results, epoch)


class EpochReport(Hook):
    """A console line at each epoch end: the train loss, learning rate and evaluation."""

    def __init__(self):
        super().__init__(at=(EPOCH_END,))

    def __call__(self, loop: Loop) -> None:
        steps_per_epoch = loop.plan.steps_per_epoch
        ended = (loop.step - 1) // steps_per_epoch + 1  # counted from 1
        line = (f"Epoch {ended}/{loop.plan.num_epochs} | step {loop.step} | "
                f"train loss {loop.window.last_loss:.4f} | lr {loop.window.last_lr:.3g}")
        if loop.evaluated_at == loop.step:
            line += " | " + describe(loop.last_eval)
        tqdm.write(line)


class Checkpoint(Hook):
    """A checkpoint every `every` steps, at each epoch end if `at_epoch_end`, and after the
    last step (on a stop, `StopOnRequest` saves)."""

    def __init__(self, every: int | None, at_epoch_end: bool):
        super().__init__(every, at=(EPOCH_END, END) if at_epoch_end else (END,))

    def __call__(self, loop: Loop) -> None:
        loop.checkpoint()


class StopOnRequest(Hook):
    """After every step, the stop request (SIGTERM / SIGINT): when it is set, the state after
    this step is saved and `Preempted` raised. It fetches no metrics: asked every step, it
    must not make the host wait for the step (`preempt` fetches them when it stops)."""

    fetches = False

    def __init__(self):
        super().__init__(every=1)

    def __call__(self, loop: Loop) -> None:
        if loop.stop.requested:
            raise loop.preempt()
