"""The training loop: one jitted step after another, and hooks that run on a cadence or at events.

`fit` only steps: it dispatches step t, then fetches the metrics of step t-1, which are long
done by then, so the host never stalls the accelerator. Everything else a run does while it
trains (log, evaluate, checkpoint, stop on a signal, report an epoch) is a `Hook` that runs
every N steps or at an event: `training/hooks.py` has the standard ones, in the order they
run. A new periodic thing (a downstream evaluation, a profiler window) is one more hook.

Epochs are derived from the step count: step s is step `s % steps_per_epoch` of epoch
`s // steps_per_epoch`, and the loader's epochs are chained into one stream of batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

import jax
import numpy as np
from tqdm.auto import tqdm

from flaxlm.data.loader import Batch, BatchSource
from flaxlm.errors import FlaxlmError
from flaxlm.layout import TOKENS_SEEN
from flaxlm.tracking import Tracker
from flaxlm.training.plan import Plan
from flaxlm.training.progress import progress_file
from flaxlm.training.step import CompiledSteps, TrainState
from flaxlm.training.stop import Preempted, StopRequest

# The events a hook can run at, besides its `every`: the loop starts (or resumes) before its
# first step; a step ends an epoch (or is the last step); the last step.
START, EPOCH_END, END = "start", "epoch_end", "end"
# Every step's events include STEP: a hook's `every` counts those.
STEP = "step"


@dataclasses.dataclass
class LoopState:
    """What the loop itself carries from step to step, beyond the train state: saved with each
    checkpoint so that a resumed run logs exactly what the uninterrupted one would have."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    window_losses: list[float] = dataclasses.field(default_factory=list)  # since the last log
    window_skipped: int = 0
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    # The epoch of the evaluation due at `step` that a stop cut short: the resumed run does it
    # first, as the uninterrupted run did.
    eval_due: float | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> LoopState:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


class Saver(Protocol):
    def __call__(self, step: int, state: TrainState, loop_state: LoopState,
                 metrics: dict[str, float] | None) -> None:
        """Write a checkpoint of `state` after `step` (`metrics`: this step's evaluation)."""

    def raise_failed(self) -> None:
        """Raise the error of an earlier save that failed in the background; never waits."""


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What turns a step rate into tokens/s and MFU."""

    tokens_per_step: int
    flops_per_token: float
    peak_flops: float | None  # all devices of the mesh together; None → no MFU logged


class Hook:
    """Something the loop does after every `every` steps and at the events in `at` (START,
    EPOCH_END, END); at most once per step, in the order of the loop's hooks.

    A hook reads and acts through the `Loop` it is called with. Before it runs, the loop
    fetches the step's metrics (its loss is then known finite), unless `fetches` is False:
    a hook that runs every step and needs no metrics must leave them on the device, or the
    host would wait for every step.
    """

    fetches = True

    def __init__(self, every: int | None = None, at: Sequence[str] = ()):
        self.every = every
        self.at = frozenset(at)

    def due(self, step: int, events: frozenset[str]) -> bool:
        periodic = STEP in events and bool(self.every) and step % self.every == 0
        return periodic or bool(self.at & events)

    def __call__(self, loop: Loop) -> None:
        raise NotImplementedError


class Loop:
    """What hooks see of the loop, and what they may do: its position (`step`, `epoch`,
    `events`), the train state, the train metrics since the last log (`window`), the last
    evaluation, the tracker and the stop request; `fetch_metrics`, `record_eval`, `checkpoint`
    and `preempt`."""

    def __init__(self, state: TrainState, plan: Plan, throughput: Throughput,
                 tracker: Tracker, stop: StopRequest, save: Saver | None,
                 resume: LoopState | None, bar: tqdm | None = None):
        progress = resume or LoopState()
        self.state, self.plan, self.tracker, self.stop = state, plan, tracker, stop
        self.throughput = throughput
        self.step = progress.step
        self.resumed = resume is not None
        self.events: frozenset[str] = frozenset()
        self.window = _Window(throughput, progress.window_losses, progress.window_skipped,
                              plan.count_skipped)
        self.last_eval = dict(progress.last_eval)
        self.evaluated_at: int | None = None  # the step of `last_eval`, if this start did it
        self.eval_due = progress.eval_due  # read at the start: see LoopState
        self._save, self._bar = save, bar
        self._last_saved = progress.step if resume else None
        self._pending = None  # (step, metrics) of a step still on the device

    @property
    def epoch(self) -> float:
        """Epochs trained: the epoch value of every log line."""
        epoch, step_in_epoch = divmod(self.step, self.plan.steps_per_epoch)
        return epoch + step_in_epoch / self.plan.steps_per_epoch

    def tokens_seen(self) -> dict[str, int]:
        # Token positions trained on (for classify: padded widths, as tokens/s counts them).
        return {TOKENS_SEEN: self.step * self.throughput.tokens_per_step}

    def show(self, **values: str) -> None:
        """Show `values` beside the progress bar."""
        if self._bar is not None:
            self._bar.set_postfix(values)

    def fetch_metrics(self) -> None:
        """Fetch the metrics of a step not yet fetched into `window`, which stops the run on a
        non-finite loss (or counts a skipped step)."""
        if self._pending is not None:
            step, metrics = self._pending
            self._pending = None
            self.window.add(step, metrics, last_saved=self._last_saved)

    def stepped(self, state: TrainState, metrics) -> None:
        """The next step is dispatched: its state is the loop's; the previous step's metrics,
        long computed by now, are fetched; this step's stay on the device for the next."""
        self.state = state
        self.step += 1
        self.fetch_metrics()
        self._pending = (self.step, metrics)

    def record_eval(self, results: dict[str, float], epoch: float) -> None:
        """`results` become the run's last evaluation, done at this step, and are logged."""
        self.last_eval, self.evaluated_at = results, self.step
        self.tracker.log({**results, "epoch": epoch, **self.tokens_seen()}, step=self.step)
        self.window.restart_clock()  # evaluation time is not training throughput

    def checkpoint(self, eval_due: float | None = None) -> None:
        """Save the state after this step (once per step), with this step's evaluation if one
        was done. Its metrics are fetched first: a state is saved once its loss is known
        finite."""
        if self._save is None or self._last_saved == self.step:
            return
        self.fetch_metrics()
        epoch, step_in_epoch = divmod(self.step, self.plan.steps_per_epoch)
        loop_state = LoopState(self.step, epoch, step_in_epoch, list(self.window.losses),
                               self.window.skipped, dict(self.last_eval), eval_due)
        self._save(self.step, self.state, loop_state,
                   self.last_eval if self.evaluated_at == self.step else None)
        self._last_saved = self.step
        self.window.restart_clock()  # nor is the copy off the device

    def preempt(self, eval_due: float | None = None) -> Preempted:
        """Save the state after this step (its loss checked first) for `Preempted`, which the
        caller raises; `eval_due`: the epoch of an evaluation of this step a stop cut short."""
        self.fetch_metrics()
        self.checkpoint(eval_due)
        return Preempted(self.step, self.stop.signal_name)

    def run(self, hooks: Sequence[Hook], events: frozenset[str]) -> None:
        self.events = events
        for hook in hooks:
            if hook.due(self.step, events):
                if hook.fetches:
                    self.fetch_metrics()
                hook(self)


def fit(
    state: TrainState,
    steps: CompiledSteps,
    loader: BatchSource,
    plan: Plan,
    throughput: Throughput,
    tracker: Tracker,
    dropout_key: jax.Array,
    hooks: Sequence[Hook],
    *,
    save: Saver | None = None,
    resume: LoopState | None = None,
    stop: StopRequest | None = None,
) -> tuple[TrainState, dict[str, float]]:
    """Train for `plan.total_steps`, running `hooks` at their steps and events; return the
    final state and the last evaluation.

    `resume` continues a run from a checkpoint's loop state (with `state` restored from the
    same checkpoint). `save` is what `Loop.checkpoint` calls; a save that failed in the
    background stops the loop at the next step. `stop` is the SIGTERM / SIGINT request the
    hooks ask (on every process at the same points: the hooks run in the same order
    everywhere).
    """
    first = resume.step if resume else 0
    bar = tqdm(total=plan.total_steps, initial=first, file=progress_file())
    loop = Loop(state, plan, throughput, tracker, stop or StopRequest(), save, resume, bar)
    loop.run(hooks, frozenset({START}))
    with bar, contextlib.closing(_batches(loader, first, plan.steps_per_epoch)) as batches:
        # range first: zip then takes no batch beyond the last step
        for _, inputs in zip(range(loop.step, plan.total_steps), batches):
            bar.set_description(f"train (epoch {loop.step // plan.steps_per_epoch + 1})",
                                refresh=False)
            loop.stepped(*steps.train(loop.state, inputs, dropout_key))
            bar.update()
            if save is not None:
                save.raise_failed()
            loop.run(hooks, _events(loop.step, plan))
    loop.fetch_metrics()
    return loop.state, loop.last_eval


def _events(step: int, plan: Plan) -> frozenset[str]:
    events = {STEP}
    if step % plan.steps_per_epoch == 0 or step == plan.total_steps:
        events.add(EPOCH_END)
    if step == plan.total_steps:
        events.add(END)
    return frozenset(events)


def _batches(loader: BatchSource, step: int, steps_per_epoch: int) -> Iterator[Batch]:
    """The loader's epochs one after another, from the batch of step `step + 1` on."""
    epoch, start = divmod(step, steps_per_epoch)
    while True:
        yielded = start
        for batch in loader.epoch(epoch, start):
            yielded += 1
            yield batch
        if yielded < steps_per_epoch:
            raise RuntimeError(f"the loader's epoch {epoch} ended after {yielded} of its "
                               f"{steps_per_epoch} batches")
        epoch, start = epoch + 1, 0


# What every train step reports (`step.train_step`); any other metric is its objective's own
# (the z-loss term, DPO's rewards), logged as the window's mean under train/<name>.
_STEP_METRICS = frozenset({"loss", "grad_norm", "learning_rate", "finite", "skipped"})


class _Window:
    """Train metrics between two log lines: mean loss and mean objective metrics, last learning
    rate and grad norm, and throughput over wall time (the first step, which compiles, is not
    timed). Every step's metrics pass through `add`, which stops the run on a non-finite one (or
    counts it when skipped)."""

    def __init__(self, throughput: Throughput, losses=(), skipped: int = 0,
                 count_skipped: bool = False):
        self.throughput = throughput
        self.losses: list[float] = list(losses)
        self.skipped = skipped
        self.count_skipped = count_skipped
        self.timed_steps = 0
        self.started: float | None = None
        self.last_loss = self.losses[-1] if self.losses else float("nan")
        self.last_lr = float("nan")
        self.last_grad_norm = float("nan")
        self.objective_metrics: dict[str, list[float]] = {}

    def add(self, step: int, metrics, last_saved: int | None = None) -> None:
        metrics = jax.device_get(metrics)
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        self.last_lr = float(metrics["learning_rate"])
        if bool(metrics.get("skipped", False)):
            self.skipped += 1
            print(f"flaxlm: step {step} skipped: loss {loss}, gradient norm {grad_norm} "
                  "(trainer.skip_nonfinite=true)", flush=True)
        elif not bool(metrics.get("finite", True)):
            raise _diverged(step, loss, grad_norm, last_saved)
        else:
            self.losses.append(loss)
            self.last_loss, self.last_grad_norm = loss, grad_norm
            for name, value in metrics.items():
                if name not in _STEP_METRICS:
                    self.objective_metrics.setdefault(name, []).append(float(value))
        if self.started is None:
            self.started = time.perf_counter()  # the clock starts once a first step finished
        else:
            self.timed_steps += 1

    def restart_clock(self) -> None:
        self.started, self.timed_steps = None, 0

    def flush(self, epoch: float) -> dict[str, float]:
        record = {
            "train/loss": float(np.mean(self.losses)) if self.losses else float("nan"),
            "train/learning_rate": self.last_lr,
            "train/grad_norm": self.last_grad_norm,
            "epoch": epoch,
        }
        for name, values in self.objective_metrics.items():
            record[f"train/{name}"] = float(np.mean(values))
        if self.count_skipped:
            record["train/skipped_steps"] = self.skipped
        elapsed = time.perf_counter() - self.started if self.started is not None else 0.0
        if self.timed_steps and elapsed > 0:
            tokens_per_second = self.timed_steps * self.throughput.tokens_per_step / elapsed
            record["train/tokens_per_second"] = tokens_per_second
            if self.throughput.peak_flops is not None:
                record["train/mfu"] = (
                    tokens_per_second * self.throughput.flops_per_token
                    / self.throughput.peak_flops
                )
        self.losses, self.objective_metrics, self.skipped, self.timed_steps = [], {}, 0, 0
        self.started = time.perf_counter()
        return record


def _diverged(step: int, loss: float, grad_norm: float, last_saved: int | None) -> FlaxlmError:
    kept = (f"The last checkpoint (step {last_saved}) was saved before it and is intact."
            if last_saved else "No checkpoint was written from a non-finite state.")
    return FlaxlmError(
        f"Training diverged at step {step}: the loss is {loss} and the gradient norm "
        f"{grad_norm}; the loss, the gradients or the updated parameters are not finite. "
        f"{kept} Lower optimizer.lr, add optimizer.warmup_steps or gradient clipping "
        "(optimizer.max_grad_norm), check the data, or set trainer.skip_nonfinite=true to skip "
        "such steps and go on."
    )
