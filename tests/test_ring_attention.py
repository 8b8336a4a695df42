"""Ring attention (`flaxlm.models.ring_attention`, model.context_attention=ring) computes the
reference's attention, forward and backward, on 8 simulated CPU devices: causal or not, with
documents or without, grouped-query heads, the heads split over `tensor` or not; and no device
holds the row's S × L scores. The whole train step under it: tests/test_context_parallel.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from conftest import mesh_config
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec
from numerics import assert_close
from test_attention import attention_settings, packed_segments, qkv

from flaxlm.models.attention import reference_attention
from flaxlm.models.ring_attention import ring_attention
from flaxlm.parallel import BATCH_AXES, CONTEXT_AXIS, TENSOR_AXIS, make_mesh, traced_on

MESHES = {"context=8": mesh_config(data=1, context=8),
          "context=4 data=2": mesh_config(data=2, context=4),
          "context=2 data=2 tensor=2": mesh_config(data=2, context=2, tensor=2)}


def ring_and_reference(mesh_name: str, seed: int, causal: bool, max_docs: int,
                       heads: tuple[int, int]):
    """The ring's output and its gradients with respect to q, k and v (of the output's dot
    product with random cotangents) on `mesh_name`, and the reference's on one device."""
    N, G = heads
    q, k, v = qkv(seed, 2, 64, N, G, 8)
    segments = None if max_docs == 1 else packed_segments(seed, 2, 64, max_docs)
    cotangent = jax.random.normal(jax.random.key(seed + 1), q.shape)
    mesh = make_mesh(8, MESHES[mesh_name])
    tensor = TENSOR_AXIS if dict(mesh.shape)[TENSOR_AXIS] > 1 else None

    def loss(ring: bool, q, k, v):
        if ring:
            out = ring_attention(q, k, v, causal, segments, tensor)
        else:
            out = reference_attention(q, k, v, is_causal=causal, segment_ids_BxL=segments)
        return jnp.vdot(out, cotangent), out

    slices = NamedSharding(mesh, PartitionSpec(BATCH_AXES, CONTEXT_AXIS, tensor))
    ring_step = jax.jit(traced_on(mesh, jax.grad(lambda *a: loss(True, *a), argnums=(0, 1, 2),
                                                 has_aux=True)))
    ring = ring_step(*(jax.device_put(x, slices) for x in (q, k, v)))
    reference = jax.grad(lambda *a: loss(False, *a), argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (q, k), ring, reference


@settings(max_examples=4, deadline=None)
@given(mesh_name=st.sampled_from(sorted(MESHES)), seed=st.integers(0, 2**16),
       causal=st.booleans(), max_docs=st.sampled_from([1, 3, 9]),
       heads=st.sampled_from([(4, 2), (2, 2), (4, 1)]))
def test_ring_attention_equals_the_reference(mesh_name, seed, causal, max_docs, heads):
    """Every query's output and every gradient: a query shown a key of the future or of
    another document, a slice attended twice or skipped, or a statistic not rescaled moves
    some element by far more than the tolerance (softmax weights of order 1/L)."""
    if mesh_name.endswith("tensor=2") and heads[1] % 2:
        heads = (4, 2)  # the heads split over tensor only where both counts divide
    (q, k), (ring_grads, ring_out), (grads, out) = ring_and_reference(mesh_name, seed, causal,
                                                                      max_docs, heads)
    assert_close(ring_out, out, **attention_settings(q, k))
    for ring_grad, grad in zip(ring_grads, grads):
        assert_close(ring_grad, grad, **attention_settings(q, k, backward=True))


def test_no_device_holds_a_rows_scores():
    """The ring's compiled step at context=8 (no grad): a device's temporaries stay below one
    S × L block of float32 scores per head, which the all-gather variant holds (B·N·S·L·4
    bytes); the ring's are B·N·S·S·4 per step."""
    B, L, N, G, H = 1, 2048, 4, 2, 8
    mesh = make_mesh(8, MESHES["context=8"])
    slices = NamedSharding(mesh, PartitionSpec(BATCH_AXES, CONTEXT_AXIS))
    shapes = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=slices)
              for shape in ((B, L, N, H), (B, L, G, H), (B, L, G, H))]
    compiled = jax.jit(traced_on(mesh, lambda q, k, v: ring_attention(
        q, k, v, True, None, None))).lower(*shapes).compile()
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    row_scores = B * N * (L // 8) * L * 4
    assert temporaries < row_scores / 2, (temporaries, row_scores)
