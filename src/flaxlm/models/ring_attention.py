"""Ring attention: self-attention under the mesh's `context` axis without gathering the row.

`model.context_attention=ring`. Each device of the axis holds a contiguous slice of every row's
queries, keys and values (slice c: the row's places c·S … c·S + S - 1, S = L / C). The keys
and values (with the slice's segment ids) travel round the axis by `jax.lax.ppermute`, one
slice a step: at step t a device attends from its queries to the slice of device c - t while
it passes that slice on to device c + 1, so the next slice is in flight while this one is
computed. The softmax is accumulated online (flash attention's running maximum, sum and
weighted values, in float32), so a device holds one slice of keys and values and one S × S
block of scores at a time, never the row's keys and values or its S × L scores (what the
all-gather variant, `flaxlm.models.attention.context_attention`, holds).

Causal: a slice entirely in the queries' future is skipped (`lax.cond`: neither its scores nor
its products are computed), the slice's own keys are masked by place, earlier slices are seen
whole (but for documents). With contiguous slices the work is unbalanced: the last device of
the axis attends to C slices, the first to one; every device still waits for the ring's C - 1
steps.

The gradient is JAX's, through the loop: each step is rematerialised (`jax.checkpoint`), so the
backward pass keeps per step only what enters it — the slice of keys and values and segment
ids received, and the running statistics (B×N×S float32 twice, B×S×N×H float32) — and computes
the S × S scores again. Over the C steps that is the row's keys and values once (as the
all-gather variant keeps them) and C times one slice's output in float32; no S × L scores.
A custom backward pass that sends the keys and values round the ring again would keep one
slice only.

Shapes are in the names: B batch, S a slice's length (L / C), N query heads, G key/value heads
(G divides N; query head n reads key head n // (N/G)), R = N / G, H head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from flaxlm.parallel import BATCH_AXES, CONTEXT_AXIS

# Scores a query may not see: the most negative finite float32 rather than -inf, so that a
# block in which a query sees no key gives exp(0) = 1 to each of them without a NaN, and those
# ones vanish (times exp(min - max) = 0) as soon as the query sees one real key; a causal
# query always sees its own key.
_UNSEEN = jnp.finfo(jnp.float32).min


def ring_attention(q_BxLxNxH, k_BxLxGxH, v_BxLxGxH, is_causal: bool,
                   segment_ids_BxL: jax.Array | None, head_axis: str | None) -> jax.Array:
    """Self-attention over rows split along the traced mesh's `context` axis, by the ring
    (module docstring). `head_axis` is the mesh axis the projections split the heads over
    (tensor), or None. Rows split over the batch axes, as everywhere."""
    mesh = jax.sharding.get_abstract_mesh()
    context = dict(mesh.shape)[CONTEXT_AXIS]
    slices = PartitionSpec(BATCH_AXES, CONTEXT_AXIS, head_axis)
    segments = None if segment_ids_BxL is None else PartitionSpec(BATCH_AXES, CONTEXT_AXIS)

    def per_device(q_BxSxNxH, k_BxSxGxH, v_BxSxGxH, segment_ids_BxS):
        return _ring(q_BxSxNxH, k_BxSxGxH, v_BxSxGxH, segment_ids_BxS, is_causal, context)

    return jax.shard_map(per_device, mesh=mesh, in_specs=(slices, slices, slices, segments),
                         out_specs=slices, check_vma=False)(
        q_BxLxNxH, k_BxLxGxH, v_BxLxGxH, segment_ids_BxL)


def _ring(q_BxSxNxH, k_BxSxGxH, v_BxSxGxH, segment_ids_BxS, is_causal: bool, context: int):
    """One device's part: its queries against each slice as the slices come round."""
    B, S, N, H = q_BxSxNxH.shape
    G = k_BxSxGxH.shape[2]
    # Query head n = g·R + r reads key head g: the heads split into (G, R) as they lie.
    q_BxSxGxRxH = q_BxSxNxH.reshape(B, S, G, N // G, H)
    here = jax.lax.axis_index(CONTEXT_AXIS)
    # Every device passes its slice to the next one round the axis.
    forward = [(device, (device + 1) % context) for device in range(context)]
    # No segment ids: every key is in the query's one document.
    if segment_ids_BxS is None:
        segment_ids_BxS = jnp.zeros((B, S), jnp.int32)
    stats = (jnp.full((B, G, N // G, S), _UNSEEN),          # running maximum score
             jnp.zeros((B, G, N // G, S), jnp.float32),      # running sum of exp(score - max)
             jnp.zeros((B, S, G, N // G, H), jnp.float32))  # running Σ exp(score - max)·value

    @jax.checkpoint
    def attend(stats, block, step):
        """`stats` updated with the slice that came from device here - step (`block`)."""
        source = (here - step) % context

        def seen(stats):
            return _online_softmax_step(stats, q_BxSxGxRxH, segment_ids_BxS, block,
                                        queries_from=here * S, keys_from=source * S,
                                        is_causal=is_causal)

        if not is_causal:
            return seen(stats)
        # A slice from a later device lies wholly in the queries' future.
        return jax.lax.cond(source <= here, seen, lambda stats: stats, stats)

    def step(carry, index):
        stats, block = carry
        # Sent before this slice is used: nothing here waits for it, so it travels while the
        # scores are computed.
        incoming = jax.lax.ppermute(block, CONTEXT_AXIS, forward)
        return (attend(stats, block, index), incoming), None

    block = (k_BxSxGxH, v_BxSxGxH, segment_ids_BxS)
    # C - 1 steps that pass the slice on, then the last slice, which goes nowhere. Unrolled:
    # each transfer its own instruction, which XLA's scheduler can start under the previous
    # block's attention, and which a plan's count of collectives sees each time.
    (stats, block), _ = jax.lax.scan(step, (stats, block), jnp.arange(context - 1),
                                    unroll=True)
    _, total_BxGxRxS, out_BxSxGxRxH = attend(stats, block, context - 1)
    out_BxSxGxRxH = out_BxSxGxRxH / jnp.moveaxis(total_BxGxRxS, 3, 1)[..., None]
    return out_BxSxGxRxH.reshape(B, S, N, H).astype(q_BxSxNxH.dtype)


def _online_softmax_step(stats, q_BxSxGxRxH, query_segments_BxS, block, *, queries_from,
                         keys_from, is_causal: bool):
    """Flash attention's update: the running maximum, sum and weighted values of each query
    after one more block of keys (places keys_from …), rescaled to the new maximum."""
    max_BxGxRxS, total_BxGxRxS, out_BxSxGxRxH = stats
    k_BxTxGxH, v_BxTxGxH, key_segments_BxT = block
    S, T, H = q_BxSxGxRxH.shape[1], k_BxTxGxH.shape[1], q_BxSxGxRxH.shape[-1]
    scores_BxGxRxSxT = jnp.einsum("bsgrh,btgh->bgrst", q_BxSxGxRxH, k_BxTxGxH,
                                  preferred_element_type=jnp.float32) / jnp.sqrt(H)
    seen_BxSxT = query_segments_BxS[:, :, None] == key_segments_BxT[:, None, :]
    if is_causal:
        places_S = queries_from + jnp.arange(S)
        places_T = keys_from + jnp.arange(T)
        seen_BxSxT = seen_BxSxT & (places_S[:, None] >= places_T[None, :])[None]
    scores_BxGxRxSxT = jnp.where(seen_BxSxT[:, None, None], scores_BxGxRxSxT, _UNSEEN)
    new_max_BxGxRxS = jnp.maximum(max_BxGxRxS, scores_BxGxRxSxT.max(axis=-1))
    # exp(old max - new max) ≤ 1: what the sums so far are worth at the new maximum.
    rescale_BxGxRxS = jnp.exp(max_BxGxRxS - new_max_BxGxRxS)
    probs_BxGxRxSxT = jnp.exp(scores_BxGxRxSxT - new_max_BxGxRxS[..., None])
    total_BxGxRxS = total_BxGxRxS * rescale_BxGxRxS + probs_BxGxRxSxT.sum(axis=-1)
    values_BxSxGxRxH = jnp.einsum("bgrst,btgh->bsgrh", probs_BxGxRxSxT.astype(v_BxTxGxH.dtype),
                                  v_BxTxGxH, preferred_element_type=jnp.float32)
    out_BxSxGxRxH = (out_BxSxGxRxH * jnp.moveaxis(rescale_BxGxRxS, 3, 1)[..., None]
                     + values_BxSxGxRxH)
    return new_max_BxGxRxS, total_BxGxRxS, out_BxSxGxRxH
