"""The training and evaluation steps: pure functions of arrays, jitted with explicit shardings.

The batch is sharded over the mesh's `data` axis and the state is replicated, so the gradient
of the mean loss is the mean over all devices, exactly what the seed's pmap + `lax.pmean` did.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from flaxlm.parallel import batch_sharded, replicated


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


def train_step(state: TrainState, inputs_BxL: jax.Array, dropout_key: jax.Array, *, graphdef,
               tx: optax.GradientTransformation, schedule: optax.Schedule):
    step_key = jax.random.fold_in(dropout_key, state.step)  # fresh dropout every step

    def loss_fn(params):
        model = nnx.merge(graphdef, params)
        logits_BxLxV = model(inputs_BxL, rngs=nnx.Rngs(dropout=step_key))
        return next_token_losses(logits_BxLxV, inputs_BxL).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
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


def compile_steps(mesh: Mesh, graphdef, tx, schedule) -> CompiledSteps:
    """jit both steps with explicit shardings; the train state is donated (updated in place)."""
    rep, data = replicated(mesh), batch_sharded(mesh)
    train = jax.jit(
        lambda state, inputs, key: train_step(
            state, inputs, key, graphdef=graphdef, tx=tx, schedule=schedule
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
