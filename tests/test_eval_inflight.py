"""Evaluation keeps only a couple of programs in flight, so XLA's CPU client never aborts it.

Each eval batch is one jitted program with a cross-device reduction (or replicated outputs).
A loop that dispatches every batch without waiting queues them all whenever a batch computes
slower than the host dispatches it (a loaded CPU, a big batch). XLA's CPU client queues at most
32 programs per device, and on `hardware=cpu` (one device per core, so one XLA worker thread
per device) the launches blocked on that limit starve the collective of a program already
running: XLA aborts the process after its collective timeout ("only 1 of them arrived"). That
abort is a race and would kill the test process; these tests pin its cause instead, by
counting eval batches that are dispatched but not finished, which must stay small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.parallel import make_mesh, replicated
from flaxlm.training.evaluation import LMEvaluator, predict
from flaxlm.training.step import CompiledSteps

NUM_BATCHES = 16  # the queue of an unbounded loop grows past 2 within a few batches
MAX_IN_FLIGHT = 2


def slow_row_sums(rows_BxL: jax.Array) -> jax.Array:
    """Each row's sum, after milliseconds of compute that dispatching the batch does not take
    (the diagonal of x stays near 1, so the added minimum is exactly 0)."""
    x_DxD = jnp.tanh(rows_BxL[:1, :1].astype(jnp.float32)) + jnp.eye(256)
    x_DxD = jax.lax.fori_loop(0, 32, lambda _, x: jnp.tanh(x @ x) * 0.01 + jnp.eye(256), x_DxD)
    return rows_BxL.astype(jnp.float32).sum(1) + jnp.minimum(x_DxD[0, 0], 0.0)


class InFlightCounter:
    """Wraps a jitted step: before each dispatch, counts the earlier results not yet ready."""

    def __init__(self, step):
        self.step = step
        self.results: list = []
        self.most = 0

    def __call__(self, *args):
        running = sum(not all(leaf.is_ready() for leaf in jax.tree.leaves(out))
                      for out in self.results)
        self.most = max(self.most, running)
        result = self.step(*args)
        self.results.append(result)
        return result


def evaluate_lm(mesh, num_batches: int) -> InFlightCounter:
    """The LM Evaluator over `num_batches` batches of 4 rows (the last one padded), with an
    eval step that sums each real row's tokens as its "loss"."""

    def eval_sums(params, inputs_BxL, mask_B, token_bytes_V):
        return {"loss_sum": (slow_row_sums(inputs_BxL) * mask_B).sum(),
                "tokens": mask_B.sum().astype(jnp.float32), "bytes": token_bytes_V.sum()}

    counter = InFlightCounter(jax.jit(eval_sums, out_shardings=replicated(mesh)))
    blocks = np.ones((num_batches * 4 - 1, 8), np.int32)
    token_bytes = jax.device_put(np.ones(4, np.float32), replicated(mesh))
    evaluate = LMEvaluator(CompiledSteps(train=None, eval=counter), blocks, 4, mesh, token_bytes)
    assert evaluate(params=None)["eval/loss"] == 8.0  # every real row sums to 8
    assert len(counter.results) == num_batches
    return counter


def predict_row_sums(mesh, num_batches: int) -> InFlightCounter:
    """The classifier's `predict` over `num_batches` batches of 4 rows (the last one padded),
    with replicated outputs, as the classifier's eval step has."""
    counter = InFlightCounter(jax.jit(lambda batch: slow_row_sums(batch["input_ids"])[:, None],
                                      out_shardings=replicated(mesh)))
    n = num_batches * 4 - 1
    ids = np.arange(n * 8, dtype=np.int32).reshape(n, 8)
    arrays = {"input_ids": ids, "attention_mask": np.ones_like(ids),
              "token_type_ids": np.zeros_like(ids), "labels": np.zeros(n, np.int32)}
    np.testing.assert_array_equal(predict(counter, arrays, 4, mesh)[:, 0], ids.sum(1))
    assert len(counter.results) == num_batches
    return counter


def test_lm_evaluator_keeps_few_batches_in_flight():
    counter = evaluate_lm(make_mesh(2), NUM_BATCHES)  # 2 devices: hardware=cpu on 2 cores
    assert counter.most <= MAX_IN_FLIGHT, f"{counter.most} eval batches were in flight"


def test_classifier_predict_keeps_few_batches_in_flight():
    counter = predict_row_sums(make_mesh(2), NUM_BATCHES)
    assert counter.most <= MAX_IN_FLIGHT, f"{counter.most} eval batches were in flight"
