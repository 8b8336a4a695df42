"""The balanced order of a row's positions over the `context` mesh axis, and what undoes it.

Under a context axis of C devices each device holds 1/C of every row's positions. With the
causal mask a contiguous split gives device c the keys of c + 1 slices to attend over: the
last device does C times the first one's work, and with a block-skipping kernel (splash) the
step waits for it. The balanced (head–tail, "zig-zag") order cuts the row into 2C chunks and
gives device c chunks c and 2C−1−c: an early chunk, which sees few keys, and a late one,
which sees many, so every device's queries see the same number of keys (`causal_work`).

The model puts its rows in this order where it starts (token ids, positions and segment ids:
small integer rows that every device of the axis holds whole, so reordering them moves no
data) and takes its final hidden states out of it where it ends (`contiguous_rows`: each
device sends one chunk to each of two devices), so the positions the model sees are the
tokens' own (RoPE and learned position tables need nothing else) and what comes out (logits,
the loss over the shifted labels, a DPO policy's log-probabilities) is in the row's order.
Between the two, attention is the one place the order shows: it masks by `places`, each
query's and key's place in the row.

`hardware.mesh.balance_context` (default true) picks this order; false keeps contiguous
slices. Both compute the same function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from flaxlm.parallel import BATCH_AXES, CONTEXT_AXIS, sequence_axis


def balanced_order(length: int, context: int) -> np.ndarray:
    """The place in the row of each position of the balanced layout (int32, `length`): chunk
    c and chunk 2C−1−c of 2C, for each device c of the axis in turn. `context` times two
    must divide `length`."""
    chunks = np.arange(length, dtype=np.int32).reshape(2 * context, length // (2 * context))
    devices = np.arange(context)
    return chunks[np.stack([devices, 2 * context - 1 - devices], axis=1).reshape(-1)].reshape(-1)


def row_order(length: int, balance: bool) -> np.ndarray | None:
    """Inside a step traced on a mesh: the balanced order (`balanced_order`) of rows of
    `length` positions when the mesh splits them over its context axis, `balance` asks for
    it and the axis' 2C chunks divide the row; None for contiguous slices, and everywhere
    else. The model and its attention both ask this, so they agree."""
    if not balance or sequence_axis(length) is None:
        return None
    context = dict(jax.sharding.get_abstract_mesh().shape)[CONTEXT_AXIS]
    return None if length % (2 * context) else balanced_order(length, context)


def places(length: int, order: np.ndarray | None) -> np.ndarray:
    """Each position's place in the row: `order`, or 0 … length−1 for contiguous slices."""
    return np.arange(length, dtype=np.int32) if order is None else order


def balanced_rows(x_BxL: jax.Array | None, order: np.ndarray | None) -> jax.Array | None:
    """A whole-row array (token ids, positions, segment ids) in the balanced order."""
    if x_BxL is None or order is None:
        return x_BxL
    return jnp.take(x_BxL, order, axis=1)


def whole_row_contiguous(x: jax.Array, context: int, axis: int) -> jax.Array:
    """A whole row held by one device (the keys and values an all-gather brought) in the
    balanced order, back in the row's order: the first of each device's pair of chunks is
    chunks 0 … C−1, the second, from the last device back, chunks C … 2C−1. A reshape and a
    copy, no gather."""
    shape = x.shape
    pairs = x.reshape(*shape[:axis], context, 2, shape[axis] // (2 * context), *shape[axis + 1:])
    before = (slice(None),) * axis
    early, late = pairs[(*before, slice(None), 0)], pairs[(*before, slice(None, None, -1), 1)]
    # A host array stays on the host (each new shape through jnp compiles a program).
    concatenate = np.concatenate if isinstance(x, np.ndarray) else jnp.concatenate
    return concatenate([early, late], axis=axis).reshape(shape)


def contiguous_rows(x_BxLxD: jax.Array, order: np.ndarray | None) -> jax.Array:
    """`x_BxLxD` (the final hidden states, positions split over the context axis in the
    balanced order) in the row's order, still split over the axis: contiguous slices.

    Device c holds chunks c and 2C−1−c, whose sum is odd: one even chunk, one odd. Chunk k
    belongs to device k // 2, first if k is even. So two exchanges, each a permutation of
    the devices (`jax.lax.ppermute`), move every chunk: each device's even chunk to its new
    device's first half, then its odd chunk to the second half. Its gradient runs them back."""
    if order is None:
        return x_BxLxD
    mesh = jax.sharding.get_abstract_mesh()
    context = mesh.shape[CONTEXT_AXIS]
    devices = np.arange(context)
    held = np.stack([devices, 2 * context - 1 - devices], axis=1)  # (C, 2) chunks of device c
    even_half = held[:, 0] % 2  # which of its halves holds device c's even chunk
    even_to = [(c, int(held[c, even_half[c]]) // 2) for c in devices]
    odd_to = [(c, int(held[c, 1 - even_half[c]]) // 2) for c in devices]
    slices = PartitionSpec(BATCH_AXES, CONTEXT_AXIS)

    def per_device(x_BxSxD):
        halves = jnp.stack(jnp.split(x_BxSxD, 2, axis=1))  # (2, B, S/2, D)
        mine = jax.lax.axis_index(CONTEXT_AXIS)
        even = jnp.asarray(even_half)[mine]
        first = jax.lax.ppermute(halves[even], CONTEXT_AXIS, even_to)
        second = jax.lax.ppermute(halves[1 - even], CONTEXT_AXIS, odd_to)
        return jnp.concatenate([first, second], axis=1)

    return jax.shard_map(per_device, mesh=mesh, in_specs=slices, out_specs=slices,
                         check_vma=False)(x_BxLxD)


def causal_work(order: np.ndarray, context: int) -> np.ndarray:
    """The (query, key) pairs the causal mask lets each device's queries see, when the row's
    positions are at `order`'s places and each device holds 1/`context` of them: (C,)."""
    queries_CxS = order.reshape(context, -1)
    # The query at place p sees the keys at places 0 … p.
    return (queries_CxS + 1).sum(axis=1)


def splash_causal_mask(length: int, order: np.ndarray | None):
    """Splash's causal mask for queries at `order`'s places (the whole row's, split over the
    devices by the kernel's `q_seq_shards`) over keys in the row's order: splash's own lazy
    causal mask, evaluated at the queries' places instead of their indices. The kernel and
    its block map both read the queries' places (`q_sequence`), so blocks that the order
    empties are skipped as they are for a contiguous row."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mask = splash.CausalMask((length, length))
    if order is not None:
        mask.q_sequence = np.asarray(order, dtype=np.int32)
    return mask
