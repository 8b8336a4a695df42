"""The training and evaluation steps: pure functions of arrays, jitted with explicit shardings.

The batch is sharded over the mesh's `data` × `fsdp` × `expert` axes and the state is laid out
by its parameters' logical axes (`flaxlm.parallel`): replicated on the default all-`data` mesh,
so the gradient of the mean loss is the mean over all devices (pmap + `lax.pmean`'s data
parallelism, as one program); split over `fsdp` / `expert` / `tensor` otherwise, the compiler
gathering each weight where it is used and reduce-scattering its gradient.
With gradient accumulation one train step takes `grad_accum_steps` micro-batches and makes one
optimizer update from their mean gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from flax.nnx.filterlib import Filter
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxlm.data.documents import INPUT_IDS, POSITIONS, SEGMENT_IDS, TARGET_MASK
from flaxlm.models import moe
from flaxlm.models.moe import AuxLosses
from flaxlm.parallel import (
    BATCH_AXES,
    batch_sharded,
    constrain_state,
    is_abstract,
    place_state,
    replicated,
    state_shardings,
    traced_on,
)
from flaxlm.training.optimizer import Optimizer


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any  # nnx.State of the model's parameters
    opt_state: optax.OptState


def create_state(model: nnx.Module, tx: optax.GradientTransformation,
                 mesh: Mesh | None = None, trainable: Filter | None = None
                 ) -> tuple[Any, TrainState]:
    """Split the model into its static graph and its parameters; start the optimizer. With a
    `mesh`, the state is laid out on it by its logical axes (`flaxlm.parallel`), the optimizer
    state made there directly: it is never whole on one device. With `trainable` (an nnx
    filter, e.g. `nnx.LoRAParam`) the optimizer state covers only the parameters it selects,
    the rest stays frozen (`train_step`).

    An abstract model (`nnx.eval_shape`) gives the abstract state, each leaf a
    `jax.ShapeDtypeStruct` with the sharding training gives it: no parameter is allocated,
    and the steps compile for it (flaxlm-plan)."""
    graphdef, params = nnx.split(model, nnx.Param)
    abstract = is_abstract(params)
    # Put from the host, not `jnp.zeros`: that would compile a program of its own.
    step = (jax.ShapeDtypeStruct((), jnp.int32) if abstract
            else jax.device_put(np.zeros((), np.int32)))
    trained = lambda params: (params if trainable is None  # noqa: E731
                              else nnx.filter_state(params, trainable))
    if mesh is None:
        # Compiled even here: run op by op, optax's init makes every moment in float32 before
        # `moments_stored_in` rounds it, which for llama-1b's bfloat16 moments is 9.2 GiB more
        # than the state it leaves (one v5e chip ran out of memory there, its step fitting).
        init = jax.eval_shape if abstract else lambda fn, tree: jax.jit(fn)(tree)
        return graphdef, TrainState(step=step, params=params,
                                    opt_state=init(tx.init, trained(params)))
    params = place_state(params, mesh)
    opt_state_sharding = state_shardings(jax.eval_shape(tx.init, trained(params)), mesh)

    def init_optimizer(params):  # the program's name in JAX's compile log
        return tx.init(params)

    init_opt_state = jax.jit(init_optimizer, out_shardings=opt_state_sharding)
    opt_state = (jax.eval_shape(init_opt_state, trained(params)) if abstract
                 else init_opt_state(trained(params)))
    return graphdef, place_state(TrainState(step=step, params=params, opt_state=opt_state), mesh)


def trained_part(state: TrainState, trainable: Filter | None) -> TrainState:
    """What of `state` trains, as a checkpoint holds it: the parameters `trainable` selects
    (None: all), the optimizer state and the step. A frozen base is not saved again with every
    checkpoint; it comes back from where it was loaded (`with_trained_part`)."""
    if trainable is None:
        return state
    return state.replace(params=nnx.filter_state(state.params, trainable))


def with_trained_part(state: TrainState, part: TrainState, trainable: Filter | None
                      ) -> TrainState:
    """`state` with what trains replaced by `part` (a restored `trained_part`)."""
    if trainable is None:
        return part
    frozen = nnx.split_state(state.params, trainable, ...)[1]
    return part.replace(params=nnx.merge_state(part.params, frozen))


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """How the next-token loss is computed (trainer.z_loss, trainer.loss_chunk_size).

    `z_loss`: the coefficient of the mean log²Z (Z the softmax normaliser of each position's
    logits) added to the training loss: it keeps the logits from drifting to large values, a
    source of bfloat16 round-off and loss spikes (PaLM, Chowdhery et al. 2022, uses 1e-4).
    `chunk_size`: positions of the sequence whose logits exist at once; None computes the
    (B, L, V) logits whole."""

    z_loss: float = 0.0
    chunk_size: int | None = None


def next_token_losses(logits_BxLxV: jax.Array, inputs_BxL: jax.Array) -> jax.Array:
    """Cross-entropy of predicting token t+1 from positions ≤ t, in float32: (B, L-1).

    Labels are the inputs shifted by one inside the loss, and stay integers: no one-hot over
    the vocabulary. Every position's loss is computed and the last (which has no next token)
    dropped afterwards: slicing the logits instead copies the whole (B, L, V) array, and its
    gradient pads one back, each as costly as a small layer.
    """
    return token_losses(logits_BxLxV, next_tokens(inputs_BxL))[0][:, :-1]


def next_tokens(inputs_BxL: jax.Array) -> jax.Array:
    """Each position's label, the token after it (B, L); the last wraps round, to be dropped."""
    return jnp.roll(inputs_BxL, -1, axis=1)


def token_losses(logits_BxLxV: jax.Array, labels_BxL: jax.Array,
                 with_log_z: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """Cross-entropy of each position's integer label in float32 (B, L), and, if asked, its
    log normaliser log Z = logsumexp of its logits (B, L) for the z-loss."""
    logits_BxLxV = logits_BxLxV.astype(jnp.float32)
    losses_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, labels_BxL)
    log_z_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1) if with_log_z else None
    return losses_BxL, log_z_BxL


def chunked_token_losses(hidden_BxLxD: jax.Array, head: Callable[[jax.Array], jax.Array],
                         labels_BxL: jax.Array, chunk_size: int, with_log_z: bool = False
                         ) -> tuple[jax.Array, jax.Array | None]:
    """`token_losses(head(hidden_BxLxD), labels_BxL)` with the logits of `chunk_size`
    positions at a time: (B, C, V) instead of (B, L, V).

    The chunks run in a `lax.scan` (one chunk's logits live at a time), each under
    `jax.checkpoint`, so the backward pass recomputes a chunk's logits from its hidden states
    rather than keeping them all. When `chunk_size` does not divide L, the last L mod C
    positions are one smaller chunk after the loop. The per-position results (B, L) are small
    and returned whole, so the caller masks and sums them as it would the unchunked ones."""
    B, L, _ = hidden_BxLxD.shape
    num_full, remainder = divmod(L, chunk_size)

    @jax.checkpoint
    def chunk_losses(x_BxCxD, labels_BxC):
        return token_losses(head(x_BxCxD), labels_BxC, with_log_z)

    def scan_chunk(_, index):
        start = index * chunk_size
        return None, chunk_losses(
            jax.lax.dynamic_slice_in_dim(hidden_BxLxD, start, chunk_size, axis=1),
            jax.lax.dynamic_slice_in_dim(labels_BxL, start, chunk_size, axis=1))

    pieces = []
    if num_full:
        _, per_chunk_NxBxC = jax.lax.scan(scan_chunk, None, jnp.arange(num_full))
        pieces.append(jax.tree.map(
            lambda a_NxBxC: a_NxBxC.swapaxes(0, 1).reshape(B, num_full * chunk_size),
            per_chunk_NxBxC))
    if remainder:
        tail = num_full * chunk_size
        pieces.append(chunk_losses(hidden_BxLxD[:, tail:], labels_BxL[:, tail:]))
    return jax.tree.map(lambda *parts: jnp.concatenate(parts, axis=1), *pieces)


def lm_logits(model, batch, rngs: nnx.Rngs | None = None) -> tuple[jax.Array, jax.Array]:
    """Next-token logits (B, L, V) of a batch of token blocks, and its token ids (B, L). A plain
    (B, L) batch is one sequence per row; a batch with its documents (data/documents.py)
    attends within each document, at positions counted from its start. Either way every
    position predicts the next token of the block: the same targets, each predicted from its
    own document only with document masking."""
    if not isinstance(batch, dict):
        return model(batch, rngs=rngs), batch
    inputs_BxL = batch[INPUT_IDS]
    logits_BxLxV = model(inputs_BxL, rngs=rngs, **_documents(batch))
    return logits_BxLxV, inputs_BxL


def _documents(batch) -> dict[str, jax.Array]:
    return {"segment_ids_BxL": batch[SEGMENT_IDS], "positions_BxL": batch[POSITIONS]}


def lm_token_losses(model, batch, rngs: nnx.Rngs | None = None, chunk_size: int | None = None,
                    with_log_z: bool = False
                    ) -> tuple[jax.Array, jax.Array | None, jax.Array, AuxLosses | None]:
    """Next-token cross-entropy of every position that has a next token (B, L-1), its log Z
    (B, L-1) if asked, the batch's token ids (B, L), and what the model adds to its training
    loss itself (a Mixture-of-Experts router's, `moe.aux_losses`; None for most); the batch as
    `lm_logits` reads it. With `chunk_size` the model's final hidden states go through its LM
    head `chunk_size` positions at a time (`chunked_token_losses`)."""
    aux = None
    if chunk_size is None and not hasattr(model, "hidden_states_and_aux"):
        logits_BxLxV, inputs_BxL = lm_logits(model, batch, rngs)
        losses_BxL, log_z_BxL = token_losses(logits_BxLxV, next_tokens(inputs_BxL), with_log_z)
    else:
        inputs_BxL = batch[INPUT_IDS] if isinstance(batch, dict) else batch
        documents = _documents(batch) if isinstance(batch, dict) else {}
        hidden_BxLxD, aux = hidden_states_and_aux(model, inputs_BxL, rngs, documents)
        if chunk_size is None:
            losses_BxL, log_z_BxL = token_losses(model.lm_head_logits(hidden_BxLxD),
                                                 next_tokens(inputs_BxL), with_log_z)
        else:
            losses_BxL, log_z_BxL = chunked_token_losses(
                hidden_BxLxD, model.lm_head_logits, next_tokens(inputs_BxL), chunk_size,
                with_log_z)
    drop_last = lambda a_BxL: None if a_BxL is None else a_BxL[:, :-1]  # noqa: E731
    return drop_last(losses_BxL), drop_last(log_z_BxL), inputs_BxL, aux


def hidden_states_and_aux(model, inputs_BxL: jax.Array, rngs: nnx.Rngs | None,
                          documents: dict) -> tuple[jax.Array, AuxLosses | None]:
    """The model's final hidden states, and its own training-loss terms where it has any
    (`hidden_states_and_aux`: the llama-family decoders, whose MoE routers have them)."""
    if hasattr(model, "hidden_states_and_aux"):
        return model.hidden_states_and_aux(inputs_BxL, rngs, **documents)
    return model.hidden_states(inputs_BxL, rngs, **documents), None


def lm_objective(model, batch, rngs: nnx.Rngs,
                 settings: LossSettings = LossSettings()) -> tuple[jax.Array, dict]:
    """Causal LM: the mean next-token cross-entropy of a batch of token blocks, plus
    `settings.z_loss` × the mean log²Z, plus what the model adds itself (a Mixture-of-Experts
    router's balancing losses), and the metrics beside it (`z_loss`: that term, when its
    coefficient is not 0; the router's, `moe.aux_losses`)."""
    losses_BxL, log_z_BxL, _, aux = lm_token_losses(model, batch, rngs, settings.chunk_size,
                                                    with_log_z=settings.z_loss > 0)
    weights_BxL = target_weights(batch)
    loss = weighted_mean(losses_BxL, weights_BxL)
    metrics = {}
    if aux is not None:
        aux_loss, metrics = aux
        loss = loss + aux_loss
    if not settings.z_loss:
        return loss, metrics
    z_term = settings.z_loss * weighted_mean(jnp.square(log_z_BxL), weights_BxL)
    return loss + z_term, {**metrics, "z_loss": z_term}


def target_weights(batch) -> jax.Array | None:
    """1.0 where the next token is a target, for the (B, L-1) losses; None: every one is. A
    batch with a target mask (task=sft) scores only its targets' predictions: position t's
    loss counts when token t+1 is a target."""
    if not isinstance(batch, dict) or TARGET_MASK not in batch:
        return None
    return batch[TARGET_MASK][:, 1:].astype(jnp.float32)


def weighted_mean(values_BxL: jax.Array, weights_BxL: jax.Array | None) -> jax.Array:
    """The mean of `values_BxL` over the positions `weights_BxL` selects (all: None), each
    target weighing the same whichever row it is in; 0 for a batch without any."""
    if weights_BxL is None:
        return values_BxL.mean()
    return (values_BxL * weights_BxL).sum() / jnp.maximum(weights_BxL.sum(), 1.0)


def lm_loss(model, batch, rngs: nnx.Rngs) -> jax.Array:
    """Causal LM: the mean next-token cross-entropy of a batch of token blocks (`lm_logits`)."""
    return lm_objective(model, batch, rngs)[0]


def train_step(state: TrainState, batch_K, dropout_key: jax.Array, hyperparams: dict, *,
               graphdef, optimizer: Optimizer, loss_fn: Callable = lm_objective,
               skip_nonfinite: bool = False, layout: Callable = lambda tree: tree,
               trainable: Filter | None = None):
    """One optimizer step on the mean gradient of K micro-batches of B rows.

    `batch_K` is an array or a pytree of arrays (e.g. a dict of input ids, masks and labels),
    each leaf shaped (K, B, ...); `loss_fn(model, micro_batch, rngs)` gives a micro-batch's
    mean loss and a dict of scalar metrics beside it (`lm_objective` for pre-training), both
    averaged over the micro-batches; the metrics join the step's.

    `metrics["finite"]` says whether the loss, the gradients and the new parameters are all
    finite; the loop checks it before it lets a state be checkpointed. With `skip_nonfinite`
    a non-finite step keeps the old parameters and optimizer state (the step still counts, so
    the data and the schedule move on) and reports `skipped` = 1.

    `layout(tree)` pins a tree shaped like the state (gradients, the new state) to the state's
    sharding; the identity outside a mesh.

    `trainable` (an nnx filter, e.g. `nnx.LoRAParam`; None: every parameter) selects what is
    differentiated and updated; the other parameters go through the step unchanged, and no
    gradient or optimizer state of theirs exists.

    `hyperparams`: the optimizer's numbers (`optimizer.arguments()`), arguments rather than
    constants, so that a sweep over them compiles one program (`flaxlm.training.hyperparams`).
    """
    if trainable is None:
        trained, frozen = state.params, None
    else:
        trained, frozen = nnx.split_state(state.params, trainable, ...)

    def micro_batch_loss(trained, micro_batch, key):
        params = (trained,) if frozen is None else (trained, frozen)
        return loss_fn(nnx.merge(graphdef, *params), micro_batch, nnx.Rngs(dropout=key))

    first_micro_batch = state.step * jax.tree.leaves(batch_K)[0].shape[0]
    (loss, loss_metrics), grads = accumulate_gradients(
        micro_batch_loss, trained, batch_K, dropout_key, first_micro_batch, layout
    )
    tx = optimizer.transformation(hyperparams)
    updates, opt_state = tx.update(grads, state.opt_state, trained)
    params = optax.apply_updates(trained, updates)
    if frozen is not None:
        params = nnx.merge_state(params, frozen)
    # An MoE router's per-layer loads move its balancing biases, if it has them; they are
    # not a scalar to report.
    params = moe.rebalanced(params, loss_metrics.pop(moe.LOAD_METRIC, None))
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite(params)
    skipped = jnp.zeros((), jnp.bool_)
    if skip_nonfinite:
        skipped = ~finite
        keep_old = lambda new, old: jnp.where(skipped, old, new)  # noqa: E731
        params = jax.tree.map(keep_old, params, state.params)
        opt_state = jax.tree.map(keep_old, opt_state, state.opt_state)
    new_state = layout(TrainState(step=state.step + 1, params=params, opt_state=opt_state))
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "learning_rate": optimizer.learning_rate(state.step, hyperparams),
        "finite": finite,
        "skipped": skipped,
        **loss_metrics,
    }
    return new_state, metrics


def all_finite(tree) -> jax.Array:
    """One boolean: every element of every floating-point leaf is finite."""
    leaves = [jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(tree)
              if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.ones((), jnp.bool_)


def accumulate_gradients(loss_fn: Callable, params, batch_K, dropout_key: jax.Array,
                         first_micro_batch: jax.Array, layout: Callable = lambda tree: tree):
    """Mean loss and metrics, and mean gradient, over the K micro-batches, one micro-batch at
    a time: `loss_fn(params, micro_batch, key)` returns the loss and a dict of scalar metrics.

    A `lax.scan` inside the jitted step rather than `optax.MultiSteps`: one dispatch per
    optimizer step, so the loop's step, the schedule and the optimizer's counters all count
    optimizer steps unchanged, and no accumulator lives in the optimizer state between calls.
    Only one micro-batch's activations are alive at a time; the sums are kept in float32 whatever
    the parameter dtype; one micro-batch skips the loop (the same numbers). The run's m-th
    micro-batch draws its dropout from `fold_in(dropout_key, m)`: fresh masks for every
    micro-batch, and without accumulation (m = step) one key per step. `layout` keeps the
    sums sharded as the parameters are.
    """
    num_micro = jax.tree.leaves(batch_K)[0].shape[0]
    if num_micro == 1:  # no loop: the compiler sees the whole step as one computation
        key = jax.random.fold_in(dropout_key, first_micro_batch)
        micro_batch = jax.tree.map(lambda leaf: leaf[0], batch_K)
        loss_and_metrics, grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, micro_batch, key)
        return loss_and_metrics, layout(grads)

    def add_micro_batch(sums, index_and_batch):
        index, micro_batch = index_and_batch
        key = jax.random.fold_in(dropout_key, first_micro_batch + index)
        loss_and_metrics, grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, micro_batch, key)
        loss_sums, grad_sums = sums
        loss_sums = jax.tree.map(lambda s, v: s + v.astype(jnp.float32), loss_sums,
                                 loss_and_metrics)
        grad_sums = layout(jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sums,
                                        grads))
        return (loss_sums, grad_sums), None

    first = jax.tree.map(lambda leaf: leaf[0], batch_K)
    loss_shapes = jax.eval_shape(loss_fn, params, first, dropout_key)
    zeros = (jax.tree.map(lambda v: jnp.zeros(v.shape, jnp.float32), loss_shapes),
             layout(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)))
    (loss_sums, grad_sums), _ = jax.lax.scan(
        add_micro_batch, zeros, (jnp.arange(num_micro), batch_K)
    )
    grads = jax.tree.map(lambda s, p: (s / num_micro).astype(p.dtype), grad_sums, params)
    return jax.tree.map(lambda s: s / num_micro, loss_sums), grads


def split_micro_batches(batch_N, num_micro: int, sharding: NamedSharding):
    """(K·B, ...) rows → (K, B, ...) micro-batches, for an array or every leaf of a pytree;
    micro-batch i is rows i, i+K, i+2K, …

    Each device holds a contiguous run of K·B/devices rows; taking every K-th row keeps all of
    them on their device as its B/devices rows of every micro-batch, so no data moves.
    """

    def split(rows_N):
        rows, *rest = rows_N.shape
        rows_KxB = rows_N.reshape(rows // num_micro, num_micro, *rest).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(rows_KxB, sharding)

    return jax.tree.map(split, batch_N)


def eval_step(params, batch, row_mask_B: jax.Array, token_bytes_V: jax.Array,
              *, graphdef, chunk_size: int | None = None,
              position_buckets: tuple[int, ...] = ()) -> dict[str, jax.Array]:
    """Sums, not means: loss summed over real tokens (a batch's targets, when it has a target
    mask), their count and their UTF-8 bytes, so batches (and padding) combine exactly.
    `batch`: as `lm_logits` reads it; the loss is training's cross-entropy (`lm_token_losses`,
    chunked as training chunks it), without the z-loss. With `position_buckets`, the loss and
    the count of each bucket of positions too (`position_sums`)."""
    model = nnx.merge(graphdef, params)
    losses_BxL, _, inputs_BxL, _ = lm_token_losses(model, batch, chunk_size=chunk_size)
    mask_BxL = jnp.broadcast_to(row_mask_B[:, None], losses_BxL.shape).astype(jnp.float32)
    if (weights_BxL := target_weights(batch)) is not None:
        mask_BxL = mask_BxL * weights_BxL
    targets_BxL = inputs_BxL[:, 1:]
    masked_BxL = losses_BxL * mask_BxL
    return {
        "loss_sum": masked_BxL.sum(),
        "tokens": mask_BxL.sum(),
        "bytes": (token_bytes_V[targets_BxL] * mask_BxL).sum(),
        **position_sums(masked_BxL, mask_BxL, batch, inputs_BxL.shape[1], position_buckets),
    }


def position_ranges(boundaries: Sequence[int], block_length: int) -> list[tuple[int, int]]:
    """The buckets [from, to) of positions that `boundaries` cut a block of `block_length`
    tokens into (those at or past the block's length cut nothing); none when they cut it
    into one."""
    cuts = sorted({b for b in boundaries if 0 < b < block_length})
    if not cuts:
        return []
    edges = [0, *cuts, block_length]
    return list(zip(edges[:-1], edges[1:]))


def position_bucket_name(start: int, stop: int) -> str:
    return f"position/{start}-{stop}"


def position_sums(loss_BxL, mask_BxL, batch, block_length: int,
                  boundaries: Sequence[int]) -> dict[str, jax.Array]:
    """Per bucket of `position_ranges`, the masked loss and its count, as
    `position/<from>-<to>/loss_sum` and `.../tokens`. A prediction's position is that of the
    token it is made from in its document (the batch's positions, which count from each
    document's start), or in its row for a plain batch: position p predicts from p + 1 tokens."""
    ranges = position_ranges(boundaries, block_length)
    if not ranges:
        return {}
    if isinstance(batch, dict):
        positions_BxL = batch[POSITIONS][:, :-1]
    else:
        positions_BxL = jnp.broadcast_to(jnp.arange(block_length - 1), loss_BxL.shape)
    sums = {}
    for start, stop in ranges:
        inside_BxL = (positions_BxL >= start) & (positions_BxL < stop)
        name = position_bucket_name(start, stop)
        sums[f"{name}/loss_sum"] = jnp.where(inside_BxL, loss_BxL, 0.0).sum()
        sums[f"{name}/tokens"] = jnp.where(inside_BxL, mask_BxL, 0.0).sum()
    return sums


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """`step(state, batch, dropout_key) -> (state, metrics)`: the jitted train step, called
    with the optimizer's numbers as its last argument. `lower` lowers it as the call runs it."""

    jitted: Callable
    hyperparams: dict

    def __call__(self, state, batch, dropout_key):
        return self.jitted(state, batch, dropout_key, self.hyperparams)

    def lower(self, state, batch, dropout_key):
        return self.jitted.lower(state, batch, dropout_key, self.hyperparams)


@dataclasses.dataclass(frozen=True)
class CompiledSteps:
    train: TrainStep
    eval: Callable


def compile_train_step(mesh: Mesh, graphdef, optimizer: Optimizer,
                       loss_fn: Callable = lm_objective, grad_accum_steps: int = 1,
                       skip_nonfinite: bool = False, trainable: Filter | None = None
                       ) -> TrainStep:
    """`train(state, batch, dropout_key) -> (state, metrics)`, jitted: the batch (an array or
    a pytree of arrays with `grad_accum_steps` micro-batches' rows) sharded over `data` ×
    `fsdp` × `expert`, the state donated (updated in place), the optimizer's numbers
    (`make_optimizer`) replicated arguments. The state comes in as `create_state` laid it out
    on the mesh (its sharding is the argument's own) and goes out the same way, by its logical
    axes.
    `loss_fn(model, micro_batch, rngs) -> (loss, metrics)`; `trainable`: as `train_step`."""
    rep, data = replicated(mesh), batch_sharded(mesh)
    micro_batches = NamedSharding(mesh, PartitionSpec(None, BATCH_AXES))
    jitted = jax.jit(
        traced_on(mesh, lambda state, batch, key, hyperparams: train_step(
            state, split_micro_batches(batch, grad_accum_steps, micro_batches), key,
            hyperparams, graphdef=graphdef, optimizer=optimizer, loss_fn=loss_fn,
            skip_nonfinite=skip_nonfinite, layout=lambda tree: constrain_state(tree, mesh),
            trainable=trainable,
        ), name="train_step"),
        in_shardings=(None, data, rep, rep),
        out_shardings=(None, rep),
        donate_argnums=0,
    )
    return TrainStep(jitted, optimizer.arguments())


def compile_steps(mesh: Mesh, graphdef, optimizer: Optimizer, grad_accum_steps: int = 1,
                  skip_nonfinite: bool = False,
                  loss: LossSettings = LossSettings(),
                  trainable: Filter | None = None,
                  position_buckets: tuple[int, ...] = ()) -> CompiledSteps:
    """The causal-LM train and eval steps, jitted with explicit shardings; `trainable`: what
    trains (`train_step`); `position_buckets`: `eval_step`'s."""
    rep, data = replicated(mesh), batch_sharded(mesh)
    train = compile_train_step(mesh, graphdef, optimizer,
                               functools.partial(lm_objective, settings=loss),
                               grad_accum_steps, skip_nonfinite, trainable)
    evaluate = jax.jit(
        traced_on(mesh, lambda params, inputs, mask, token_bytes: eval_step(
            params, inputs, mask, token_bytes, graphdef=graphdef, chunk_size=loss.chunk_size,
            position_buckets=position_buckets,
        ), name="eval_step"),
        in_shardings=(None, data, data, rep),  # the parameters as the train state holds them
        out_shardings=rep,
    )
    return CompiledSteps(train=train, eval=evaluate)
