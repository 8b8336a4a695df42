"""The training loop: epochs of jitted steps, evaluation, logging and progress bars.

The loop is the only place that waits for the device. On several hosts only process 0 shows
progress bars. It dispatches step t, then fetches the
metrics of step t-1, which are long done by then, so the host never stalls the accelerator.
"""

from __future__ import annotations

import dataclasses
import io
import math
import sys
import time
from typing import Protocol

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from flaxlm import distributed
from flaxlm.data.loader import BatchSource, block_rows, eval_batches, num_eval_batches
from flaxlm.errors import FlaxlmError
from flaxlm.layout import TOKENS_SEEN
from flaxlm.tracking import Tracker
from flaxlm.training.checkpoint import EvaluationCut, Preempted, StopRequest, unless_stopped
from flaxlm.training.inflight import ready_in_order
from flaxlm.training.step import CompiledSteps, TrainState


@dataclasses.dataclass(frozen=True)
class Plan:
    """How long to train and how often to evaluate, log and checkpoint, in steps."""

    steps_per_epoch: int
    total_steps: int
    eval_every: int | None
    log_every: int
    eval_before_training: bool
    checkpoint_every: int | None = None  # also at epoch ends (if below), the last step, on stop
    checkpoint_at_epoch_end: bool = True
    count_skipped: bool = False  # trainer.skip_nonfinite: log train/skipped_steps

    @property
    def num_epochs(self) -> int:
        return math.ceil(self.total_steps / self.steps_per_epoch)


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


@dataclasses.dataclass
class Evaluator:
    steps: CompiledSteps
    blocks: np.ndarray
    global_batch_size: int
    mesh: Mesh
    token_bytes: jax.Array  # (vocab,) UTF-8 bytes per token id

    def __call__(self, params, stop: StopRequest | None = None) -> dict[str, float]:
        """Loss over every validation token exactly once: sums over all batches, divided once.
        A requested `stop` cuts it short (`EvaluationCut`).

        Each batch's sums are fetched one batch after its dispatch, so only a couple of eval
        programs are ever queued (see `inflight` for why that matters), and are added up on
        the host in float64.
        """
        gather = block_rows(self.blocks, self.global_batch_size, self.mesh)
        batches = eval_batches(len(self.blocks), self.global_batch_size, self.mesh, gather)
        dispatched = (self.steps.eval(params, inputs, mask, self.token_bytes)
                      for inputs, mask in batches)
        total = num_eval_batches(len(self.blocks), self.global_batch_size)
        totals = dict.fromkeys(("loss_sum", "tokens", "bytes"), 0.0)
        for sums in tqdm(unless_stopped(ready_in_order(dispatched), stop, total), total=total,
                         desc="eval", leave=False, file=_progress_file()):
            for key, value in jax.device_get(sums).items():
                totals[key] += float(value)
        loss = totals["loss_sum"] / totals["tokens"]
        return {
            "eval/loss": loss,
            "eval/perplexity": math.exp(min(loss, 700.0)),
            "eval/bits_per_byte": totals["loss_sum"] / (math.log(2) * totals["bytes"]),
        }


def fit(
    state: TrainState,
    steps: CompiledSteps,
    loader: BatchSource,
    evaluate: Evaluator,
    plan: Plan,
    throughput: Throughput,
    tracker: Tracker,
    dropout_key: jax.Array,
    *,
    save: Saver | None = None,
    resume: LoopState | None = None,
    stop: StopRequest | None = None,
) -> tuple[TrainState, dict[str, float]]:
    """Train for `plan.total_steps`; return the final state and the last evaluation.

    `resume` continues a run from a checkpoint's loop state (with `state` restored from the
    same checkpoint). `save` is called after every step that should be checkpointed, only with
    a state whose metrics were fetched and found finite; a save that failed in the background
    stops the loop at the next step. When `stop` is requested (SIGTERM / SIGINT) the loop saves
    after the current step (an evaluation under way is cut at its next batch, and done again
    by the resumed run) and raises `Preempted`.
    """
    progress = resume or LoopState()
    step, last_eval = progress.step, dict(progress.last_eval)
    last_saved = step if resume else None
    window = _Window(throughput, progress.window_losses, progress.window_skipped,
                     plan.count_skipped)
    stop = stop or StopRequest()

    def seen(step: int) -> dict[str, int]:
        # Token positions trained on (for classify: padded widths, as tokens/s counts them).
        return {TOKENS_SEEN: step * throughput.tokens_per_step}

    def run_eval(epoch: float) -> None:
        nonlocal last_eval
        try:
            last_eval = evaluate(state.params, stop)
        except EvaluationCut as cut:  # nothing logged: these numbers are not an evaluation
            print(f"flaxlm: {stop.signal_name}: the evaluation at step {step} was cut after "
                  f"{cut.done} of {cut.total} batches and is not logged; the resumed run "
                  "evaluates this step again", file=sys.stderr, flush=True)
            raise preempt(eval_due=epoch) from None
        tracker.log({**last_eval, "epoch": epoch, **seen(step)}, step=step)
        window.restart_clock()  # evaluation time is not training throughput

    def checkpoint(epoch: int, step_in_epoch: int, metrics: dict[str, float] | None,
                   eval_due: float | None = None) -> None:
        nonlocal last_saved
        if save is None or last_saved == step:
            return
        save(step, state, LoopState(step, epoch, step_in_epoch, list(window.losses),
                                    window.skipped, dict(last_eval), eval_due), metrics)
        last_saved = step
        window.restart_clock()  # nor is the copy off the device

    def check(step_metrics) -> None:
        window.add(*step_metrics, last_saved=last_saved)

    def preempt(eval_due: float | None = None) -> Preempted:
        """Save the state after `step` (its loss checked first) for `Preempted`."""
        nonlocal pending
        if pending is not None:
            check(pending)
            pending = None
        checkpoint(*divmod(step, plan.steps_per_epoch), None, eval_due)
        return Preempted(step, stop.signal_name)

    pending = None  # (step, metrics) of the previous step, still on the device
    if progress.eval_due is not None:  # cut short by the stop this run resumes from
        run_eval(progress.eval_due)
        tqdm.write(_describe(f"step {step}" if step else "before training", last_eval))
    elif plan.eval_before_training and resume is None:
        run_eval(0.0)
        tqdm.write(_describe("before training", last_eval))


    first_epoch = step // plan.steps_per_epoch
    epochs = tqdm(total=plan.num_epochs, desc="epoch", position=0, initial=first_epoch,
                  file=_progress_file())
    for epoch in range(first_epoch, plan.num_epochs):
        if step >= plan.total_steps:
            break
        start_step = step - epoch * plan.steps_per_epoch
        epoch_steps = min(plan.steps_per_epoch, plan.total_steps - epoch * plan.steps_per_epoch)
        bar = tqdm(total=epoch_steps, initial=start_step, desc=f"train (epoch {epoch + 1})",
                   position=1, leave=False, file=_progress_file())
        for inputs in loader.epoch(epoch, start_step):
            if step == plan.total_steps:
                break
            state, metrics = steps.train(state, inputs, dropout_key)
            step += 1
            if pending is not None:  # fetched only now, after the next step was dispatched
                check(pending)
            pending = (step, metrics)
            bar.update()
            if save is not None:
                save.raise_failed()
            mid_epoch = bar.n < epoch_steps  # the epoch's last step is handled after the loop
            save_now = mid_epoch and save is not None and bool(
                plan.checkpoint_every and step % plan.checkpoint_every == 0
            )
            log_now = step % plan.log_every == 0 or step == plan.total_steps
            if log_now or save_now:  # a state is saved only once its loss is known finite
                check(pending)
                pending = None
            if log_now:
                record = window.flush(epoch + bar.n / plan.steps_per_epoch)
                bar.set_postfix(loss=f"{record['train/loss']:.3f}")
                tracker.log({**record, **seen(step)}, step=step)
            evaluated = bool(plan.eval_every and step % plan.eval_every == 0 and mid_epoch)
            if evaluated:
                run_eval(epoch + bar.n / plan.steps_per_epoch)
            if save_now:
                checkpoint(epoch, bar.n, last_eval if evaluated else None)
            if stop.requested and mid_epoch:  # a signal may arrive at any point of the step
                raise preempt()
        bar.close()
        if pending is not None:
            check(pending)
            pending = None
        run_eval(epoch + bar.n / plan.steps_per_epoch)
        tqdm.write(
            f"Epoch {epoch + 1}/{plan.num_epochs} | step {step} | "
            f"train loss {window.last_loss:.4f} | lr {window.last_lr:.3g} | "
            + _describe("", last_eval)
        )
        if (plan.checkpoint_at_epoch_end or step == plan.total_steps or stop.requested
                or (plan.checkpoint_every and step % plan.checkpoint_every == 0)):
            # An epoch that ended exactly here saves the position at the next epoch's start.
            ended = bar.n == plan.steps_per_epoch
            checkpoint(epoch + 1 if ended else epoch, 0 if ended else bar.n, last_eval)
        if stop.requested:
            raise Preempted(step, stop.signal_name)
        epochs.update()
    epochs.close()
    return state, last_eval


class _Discard(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)


def _progress_file() -> io.TextIOBase | None:
    """Where a progress bar prints: stderr (None) on process 0, nowhere on the others. Not
    tqdm's `disable`: a disabled bar stops counting, and the loop reads its count."""
    return None if distributed.is_primary() else _Discard()


class _Window:
    """Train metrics between two log lines: mean loss, last learning rate and grad norm, and
    throughput over wall time (the first step, which compiles, is not timed). Every step's
    metrics pass through `add`, which stops the run on a non-finite one (or counts it when
    skipped)."""

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
        self.losses, self.skipped, self.timed_steps = [], 0, 0
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


def describe(evaluation: dict[str, float]) -> str:
    """One line from any task's eval record: 'eval loss 6.3981 | perplexity 600.38 | …'."""
    parts = [f"eval loss {evaluation['eval/loss']:.4f}"]
    for key, value in evaluation.items():
        if key.startswith("eval/") and key != "eval/loss":
            name = key.removeprefix("eval/").replace("bits_per_byte", "bits/byte")
            parts.append(f"{name} {value:.4g}")
    return " | ".join(parts)


def _describe(prefix: str, evaluation: dict[str, float]) -> str:
    text = describe(evaluation)
    return f"{prefix}: {text}" if prefix else text
