"""The training loop: epochs of jitted steps, evaluation, logging and progress bars.

The loop is the only place that waits for the device. It dispatches step t, then fetches the
metrics of step t-1, which are long done by then, so the host never stalls the accelerator.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from flaxlm.data.loader import TrainLoader, eval_batches, num_eval_batches
from flaxlm.tracking import Tracker
from flaxlm.training.step import CompiledSteps, TrainState


@dataclasses.dataclass(frozen=True)
class Plan:
    """How long to train and how often to evaluate and log, in steps."""

    steps_per_epoch: int
    total_steps: int
    eval_every: int | None
    log_every: int
    eval_before_training: bool

    @property
    def num_epochs(self) -> int:
        return math.ceil(self.total_steps / self.steps_per_epoch)


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What turns a step rate into tokens/s and MFU."""

    tokens_per_step: int
    flops_per_token: float
    peak_flops: float  # all devices of the mesh together


@dataclasses.dataclass
class Evaluator:
    steps: CompiledSteps
    blocks: np.ndarray
    global_batch_size: int
    mesh: Mesh
    token_bytes: jax.Array  # (vocab,) UTF-8 bytes per token id

    def __call__(self, params) -> dict[str, float]:
        """Loss over every validation token exactly once: sums over all batches, divided once."""
        totals = None
        batches = eval_batches(self.blocks, self.global_batch_size, self.mesh)
        total = num_eval_batches(len(self.blocks), self.global_batch_size)
        for inputs, mask in tqdm(batches, total=total, desc="eval", leave=False):
            sums = self.steps.eval(params, inputs, mask, self.token_bytes)
            totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
        totals = jax.device_get(totals)
        loss = float(totals["loss_sum"] / totals["tokens"])
        return {
            "eval/loss": loss,
            "eval/perplexity": math.exp(min(loss, 700.0)),
            "eval/bits_per_byte": float(totals["loss_sum"] / (math.log(2) * totals["bytes"])),
        }


def fit(
    state: TrainState,
    steps: CompiledSteps,
    loader: TrainLoader,
    evaluate: Evaluator,
    plan: Plan,
    throughput: Throughput,
    tracker: Tracker,
    dropout_key: jax.Array,
) -> tuple[TrainState, dict[str, float]]:
    """Train for `plan.total_steps`; return the final state and the last evaluation."""
    last_eval: dict[str, float] = {}

    window = _Window(throughput)

    def run_eval(step: int, epoch: float) -> None:
        nonlocal last_eval
        last_eval = evaluate(state.params)
        tracker.log({**last_eval, "epoch": epoch}, step=step)
        window.restart_clock()  # evaluation time is not training throughput

    if plan.eval_before_training:
        run_eval(0, 0.0)
        tqdm.write(_describe("before training", last_eval))

    pending = None  # the previous step's metrics, still on the device
    step = 0
    epochs = tqdm(range(plan.num_epochs), desc="epoch", position=0)
    for epoch in epochs:
        epoch_steps = min(plan.steps_per_epoch, plan.total_steps - step)
        bar = tqdm(total=epoch_steps, desc=f"train (epoch {epoch + 1})", position=1, leave=False)
        for inputs in loader.epoch(epoch):
            if step == plan.total_steps:
                break
            state, metrics = steps.train(state, inputs, dropout_key)
            step += 1
            if pending is not None:  # fetched only now, after the next step was dispatched
                window.add(pending)
            pending = metrics
            bar.update()
            if step % plan.log_every == 0 or step == plan.total_steps:
                window.add(pending)
                pending = None
                record = window.flush(epoch + bar.n / plan.steps_per_epoch)
                bar.set_postfix(loss=f"{record['train/loss']:.3f}")
                tracker.log(record, step=step)
            if plan.eval_every and step % plan.eval_every == 0 and bar.n < epoch_steps:
                run_eval(step, epoch + bar.n / plan.steps_per_epoch)
        bar.close()
        if pending is not None:
            window.add(pending)
            pending = None
        run_eval(step, epoch + bar.n / plan.steps_per_epoch)
        tqdm.write(
            f"Epoch {epoch + 1}/{plan.num_epochs} | step {step} | "
            f"train loss {window.last_loss:.4f} | lr {window.last_lr:.3g} | "
            + _describe("", last_eval)
        )
    epochs.close()
    return state, last_eval


class _Window:
    """Train metrics between two log lines: mean loss, last learning rate and grad norm, and
    throughput over wall time (the first step, which compiles, is not timed)."""

    def __init__(self, throughput: Throughput):
        self.throughput = throughput
        self.losses: list[float] = []
        self.timed_steps = 0
        self.started: float | None = None
        self.last_loss = float("nan")
        self.last_lr = float("nan")
        self.last_grad_norm = float("nan")

    def add(self, metrics) -> None:
        metrics = jax.device_get(metrics)
        self.losses.append(float(metrics["loss"]))
        self.last_loss = self.losses[-1]
        self.last_lr = float(metrics["learning_rate"])
        self.last_grad_norm = float(metrics["grad_norm"])
        if self.started is None:
            self.started = time.perf_counter()  # the clock starts once a first step finished
        else:
            self.timed_steps += 1

    def restart_clock(self) -> None:
        self.started, self.timed_steps = None, 0

    def flush(self, epoch: float) -> dict[str, float]:
        record = {
            "train/loss": float(np.mean(self.losses)),
            "train/learning_rate": self.last_lr,
            "train/grad_norm": self.last_grad_norm,
            "epoch": epoch,
        }
        elapsed = time.perf_counter() - self.started if self.started is not None else 0.0
        if self.timed_steps and elapsed > 0:
            tokens_per_second = self.timed_steps * self.throughput.tokens_per_step / elapsed
            record["train/tokens_per_second"] = tokens_per_second
            record["train/mfu"] = (
                tokens_per_second * self.throughput.flops_per_token / self.throughput.peak_flops
            )
        self.losses, self.timed_steps, self.started = [], 0, time.perf_counter()
        return record


def _describe(prefix: str, evaluation: dict[str, float]) -> str:
    text = (
        f"eval loss {evaluation['eval/loss']:.4f} | perplexity {evaluation['eval/perplexity']:.2f}"
        f" | bits/byte {evaluation['eval/bits_per_byte']:.3f}"
    )
    return f"{prefix}: {text}" if prefix else text
