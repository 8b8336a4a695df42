"""The held-out loss by position bucket (`eval.position_buckets`): which predictions fall in
which bucket, that the buckets partition the whole, and that a run logs them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from conftest import SHORT, compose, model_config
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import assert_close

from flaxlm.data.documents import INPUT_IDS, POSITIONS, SEGMENT_IDS
from flaxlm.models.build import build_lm
from flaxlm.models.layers import TransformerSpec
from flaxlm.tasks.clm import position_metrics
from flaxlm.training.step import eval_step, lm_token_losses, position_ranges


@given(boundaries=st.lists(st.integers(-4, 80), max_size=5), length=st.integers(1, 64))
def test_position_ranges_cut_the_block_at_the_boundaries_inside_it(boundaries, length):
    ranges = position_ranges(boundaries, length)
    cuts = sorted({b for b in boundaries if 0 < b < length})
    if not cuts:
        assert ranges == []
        return
    assert ranges[0][0] == 0 and ranges[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert [start for start, _ in ranges[1:]] == cuts


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), boundaries=st.lists(st.integers(1, 20), max_size=3))
def test_the_eval_steps_bucket_sums_are_its_predictions_by_position_in_their_document(
        seed, boundaries):
    """Each bucket's loss sum and count are those of the predictions made from a token at a
    position (counted from its document's start) inside the bucket, real rows only; the
    buckets together are the whole. A plain batch counts positions along the row."""
    rng = np.random.default_rng(seed)
    B, L, V = 3, 16, 64
    cfg = model_config("llama", num_layers=1, hidden_size=32, num_heads=2, vocab_size=V,
                       max_positions=L)
    graphdef, params = nnx.split(build_lm(TransformerSpec(cfg), nnx.Rngs(seed)))
    ids = rng.integers(0, V, (B, L))
    # Documents: each row cut at random places; positions count from each document's start.
    starts = rng.random((B, L)) < 0.2
    starts[:, 0] = True
    segments = np.cumsum(starts, axis=1)
    positions = np.stack([np.arange(L) - np.maximum.accumulate(np.where(row, np.arange(L), 0))
                          for row in starts])
    row_mask = np.array([1.0, 1.0, 0.0])  # the last row is padding
    token_bytes = jnp.ones(V)
    documents = {INPUT_IDS: jnp.asarray(ids), SEGMENT_IDS: jnp.asarray(segments),
                 POSITIONS: jnp.asarray(positions)}
    rows = np.tile(np.arange(L), (B, 1))
    for batch, at_BxL in ((documents, positions), (jnp.asarray(ids), rows)):
        sums = eval_step(params, batch, jnp.asarray(row_mask), token_bytes, graphdef=graphdef,
                         position_buckets=tuple(boundaries))
        losses = np.asarray(lm_token_losses(nnx.merge(graphdef, params), batch)[0], np.float64)
        real = np.broadcast_to(row_mask[:, None], losses.shape)
        ranges = position_ranges(boundaries, L)
        assert {k for k in sums if k.startswith("position/")} == {
            f"position/{a}-{b}/{s}" for a, b in ranges for s in ("loss_sum", "tokens")}
        for start, stop in ranges:
            inside = (at_BxL[:, :-1] >= start) & (at_BxL[:, :-1] < stop) & (real > 0)
            assert float(sums[f"position/{start}-{stop}/tokens"]) == inside.sum()
            assert_close(sums[f"position/{start}-{stop}/loss_sum"], (losses * inside).sum(),
                         terms=B * L, scale=np.abs(losses).sum())
        if ranges:
            assert sum(float(sums[f"position/{a}-{b}/tokens"]) for a, b in ranges) == float(
                sums["tokens"])


def test_a_long_block_run_logs_its_loss_and_perplexity_by_position(train_cli, tmp_path):
    """A run of 64-token blocks with boundaries at 16 and 40 logs the three buckets' loss
    and perplexity at each evaluation (the names its objective may choose among), and the
    overall loss is their mean weighted by tokens: between the smallest and the largest."""
    from conftest import metrics_of

    run_dir = tmp_path / "run"
    overrides = [*SHORT, "eval.position_buckets=[16,40,4096]"]
    result = train_cli(*overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    names = position_metrics(compose(overrides))
    assert names == tuple(f"eval/position/{r}/{m}" for r in ("0-16", "16-40", "40-64")
                          for m in ("loss", "perplexity"))
    last = [r for r in metrics_of(run_dir) if "eval/loss" in r][-1]
    losses = [last[name] for name in names if name.endswith("/loss")]
    assert min(losses) <= last["eval/loss"] <= max(losses)
    for name in names:
        if name.endswith("/perplexity"):
            assert_close(last[name], np.exp(last[name.replace("perplexity", "loss")]))
