"""The collective bytes a plan reports (`flaxlm.training.collectives`), read from compiled HLO:
each kind counted by its result, an asynchronous pair once, a loop's body as often as the
loop runs; on 8 simulated CPU devices the two context-parallel attentions' transfers are
exactly the keys and values they move."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import mesh_config
from jax.sharding import NamedSharding, PartitionSpec

from flaxlm.config import AttentionBackend
from flaxlm.models.attention import context_attention
from flaxlm.models.ring_attention import ring_attention
from flaxlm.parallel import BATCH_AXES, CONTEXT_AXIS, make_mesh, traced_on
from flaxlm.training.collectives import collective_bytes

# A program in the compiler's text: an all-reduce in the entry, and a loop of 5 trips whose
# body gathers 1 KiB asynchronously (a start and a done) and permutes a tuple of 64 bytes.
LOOP = """\
HloModule loop

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %x = f32[64]{0:T(256)} get-tuple-element(%p), index=1
  %ags = (f32[64]{0:T(256)}, f32[256]{0:T(256)}) all-gather-start(%x), dimensions={0}
  %agd = f32[256]{0:T(256)} all-gather-done(%ags)
  %cps = (bf16[4,8]{1,0}, bf16[4,8]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%y)
  %cpd = bf16[4,8]{1,0} collective-permute-done(%cps)
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %agd)
}

%cond (p: (s32[], f32[256])) -> pred[] {
  %p = (s32[], f32[256]{0}) parameter(0)
  %bound = s32[]{:T(128)} constant(5)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %bound), direction=LT
}

ENTRY %main (a: f32[256]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  %ar = f32[16,16]{1,0} all-reduce(%a), to_apply=%add
  %w = (s32[], f32[256]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[256]{0} get-tuple-element(%w), index=1
}
"""


def test_loops_count_in_full_and_a_start_once():
    assert collective_bytes(LOOP) == {"all-gather": 5 * 1024, "all-reduce": 1024,
                                      "reduce-scatter": 0, "all-to-all": 0,
                                      "collective-permute": 5 * 64}


@pytest.mark.parametrize("variant", ["ring", "all_gather"])
def test_the_context_attentions_move_exactly_the_keys_and_values(variant):
    """At context=8, one row of L = 512 positions, G = 2 key/value heads of 8 in float32: the
    ring passes each slice of keys, values (and segment ids) on 7 times; the all-gather
    variant gathers the row's keys, values and segment ids once."""
    B, L, N, G, H, C = 1, 512, 4, 2, 8, 8
    mesh = make_mesh(8, mesh_config(data=1, context=C))
    slices = NamedSharding(mesh, PartitionSpec(BATCH_AXES, CONTEXT_AXIS))
    shapes = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=slices)
              for shape in ((B, L, N, H), (B, L, G, H), (B, L, G, H))]
    segments = jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=slices)
    if variant == "ring":
        attend = lambda q, k, v, s: ring_attention(q, k, v, True, s, None)  # noqa: E731
    else:
        attend = lambda q, k, v, s: context_attention(  # noqa: E731
            q, k, v, True, s, AttentionBackend.xla)
    text = jax.jit(traced_on(mesh, attend)).lower(*shapes, segments).compile().as_text()
    moved = collective_bytes(text)
    key_slice, segment_slice = B * (L // C) * G * H * 4, B * (L // C) * 4
    if variant == "ring":
        assert moved["collective-permute"] == (C - 1) * (2 * key_slice + segment_slice)
        assert moved["all-gather"] == 0
    else:
        # The row's keys and values, and its segment ids, which arrive split as the batch is.
        assert moved["all-gather"] == C * (2 * key_slice + segment_slice)
        assert moved["collective-permute"] == 0
