"""The training and evaluation steps: pure functions of arrays, jitted with explicit shardings.

The batch is sharded over the mesh's `data` axis and the state is replicated, so the gradient
of the mean loss is the mean over all devices, exactly what the seed's pmap + `lax.pmean` did.
With gradient accumulation one train step takes `grad_accum_steps` micro-batches and makes one
optimizer update from their mean gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxlm.parallel import DATA_AXIS, batch_sharded, replicated


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any  # nnx.State of the model's parameters
    opt_state: optax.OptState


def create_state(model: nnx.Module, tx: optax.GradientTransformation) -> tuple[Any, TrainState]:
    """Split the model into its static graph and its parameters; start the optimizer."""
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def next_token_losses(logits_BxLxV: jax.Array, inputs_BxL: jax.Array) -> jax.Array:
    """Cross-entropy of predicting token t+1 from positions ≤ t, in float32: (B, L-1).

    Labels are the inputs shifted by one inside the loss, and stay integers: no one-hot over
    the vocabulary.
    """
    return optax.softmax_cross_entropy_with_integer_labels(
        logits_BxLxV[:, :-1].astype(jnp.float32), inputs_BxL[:, 1:]
    )


def train_step(state: TrainState, inputs_KxBxL: jax.Array, dropout_key: jax.Array, *, graphdef,
               tx: optax.GradientTransformation, schedule: optax.Schedule):
    """One optimizer step on the mean gradient of K micro-batches of B rows (K = 1: the seed)."""

    def loss_fn(params, inputs_BxL, key):
        model = nnx.merge(graphdef, params)
        logits_BxLxV = model(inputs_BxL, rngs=nnx.Rngs(dropout=key))
        return next_token_losses(logits_BxLxV, inputs_BxL).mean()

    first_micro_batch = state.step * inputs_KxBxL.shape[0]
    loss, grads = accumulate_gradients(
        loss_fn, state.params, inputs_KxBxL, dropout_key, first_micro_batch
    )
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new_state = TrainState(
        step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state
    )
    metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": schedule(state.step),
    }
    return new_state, metrics


def accumulate_gradients(loss_fn: Callable, params, inputs_KxBxL: jax.Array,
                         dropout_key: jax.Array, first_micro_batch: jax.Array):
    """Mean loss and mean gradient over the K micro-batches, one micro-batch at a time.

    A `lax.scan` inside the jitted step rather than `optax.MultiSteps`: one dispatch per
    optimizer step, so the loop's step, the schedule and the optimizer's counters all count
    optimizer steps unchanged, and no accumulator lives in the optimizer state between calls.
    Only one micro-batch's activations are alive at a time; the sums are kept in float32 whatever
    the parameter dtype. The run's m-th micro-batch draws its dropout from
    `fold_in(dropout_key, m)`: fresh masks for every micro-batch, and without accumulation
    (m = step) the seed's key for every step.
    """
    num_micro = inputs_KxBxL.shape[0]

    def add_micro_batch(sums, index_and_inputs):
        index, inputs_BxL = index_and_inputs
        key = jax.random.fold_in(dropout_key, first_micro_batch + index)
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs_BxL, key)
        loss_sum, grad_sums = sums
        grad_sums = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sums, grads)
        return (loss_sum + loss, grad_sums), None

    zeros = (jnp.zeros((), jnp.float32),
             jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    (loss_sum, grad_sums), _ = jax.lax.scan(
        add_micro_batch, zeros, (jnp.arange(num_micro), inputs_KxBxL)
    )
    grads = jax.tree.map(lambda s, p: (s / num_micro).astype(p.dtype), grad_sums, params)
    return loss_sum / num_micro, grads


def split_micro_batches(inputs_NxL: jax.Array, num_micro: int, sharding: NamedSharding):
    """(K·B, L) rows → (K, B, L) micro-batches, micro-batch i being rows i, i+K, i+2K, …

    Each device holds a contiguous run of K·B/devices rows; taking every K-th row keeps all of
    them on their device as its B/devices rows of every micro-batch, so no data moves.
    """
    rows, length = inputs_NxL.shape
    inputs_KxBxL = inputs_NxL.reshape(rows // num_micro, num_micro, length).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(inputs_KxBxL, sharding)


def eval_step(params, inputs_BxL: jax.Array, row_mask_B: jax.Array, token_bytes_V: jax.Array,
              *, graphdef) -> dict[str, jax.Array]:
    """Sums, not means: loss summed over real tokens, their count and their UTF-8 bytes, so
    batches (and padding) combine exactly."""
    model = nnx.merge(graphdef, params)
    losses_BxL = next_token_losses(model(inputs_BxL), inputs_BxL)
    mask_BxL = jnp.broadcast_to(row_mask_B[:, None], losses_BxL.shape).astype(jnp.float32)
    targets_BxL = inputs_BxL[:, 1:]
    return {
        "loss_sum": (losses_BxL * mask_BxL).sum(),
        "tokens": mask_BxL.sum(),
        "bytes": (token_bytes_V[targets_BxL] * mask_BxL).sum(),
    }


@dataclasses.dataclass(frozen=True)
class CompiledSteps:
    train: Callable
    eval: Callable


def compile_steps(mesh: Mesh, graphdef, tx, schedule, grad_accum_steps: int = 1) -> CompiledSteps:
    """jit both steps with explicit shardings; the train state is donated (updated in place).

    The train step takes `grad_accum_steps` micro-batches' rows at once, sharded as one batch.
    """
    rep, data = replicated(mesh), batch_sharded(mesh)
    micro_batches = NamedSharding(mesh, PartitionSpec(None, DATA_AXIS))
    train = jax.jit(
        lambda state, inputs, key: train_step(
            state, split_micro_batches(inputs, grad_accum_steps, micro_batches), key,
            graphdef=graphdef, tx=tx, schedule=schedule,
        ),
        in_shardings=(rep, data, rep),
        out_shardings=(rep, rep),
        donate_argnums=0,
    )
    evaluate = jax.jit(
        lambda params, inputs, mask, token_bytes: eval_step(
            params, inputs, mask, token_bytes, graphdef=graphdef
        ),
        in_shardings=(rep, data, data, rep),
        out_shardings=rep,
    )
    return CompiledSteps(train=train, eval=evaluate)
