"""The Mixture-of-Experts MLP (flaxlm.models.moe) and its grouped matmul: every dispatch computes
what the dense reference (every token through every expert, weighted by its routing) computes;
token dropping drops exactly the copies past each expert's capacity; the balancing signals are
their formulas; the loss-free bias moves toward the even load; a scanned MoE model is the
unrolled one; settings that cannot work are refused in one paragraph."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import config_node
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import assert_close, assert_trees_close, transformer

from flaxlm.config import MoeDispatch
from flaxlm.errors import FlaxlmError
from flaxlm.models import moe
from flaxlm.models.build import build_lm
from flaxlm.models.grouped_matmul import (
    MEGABLOX_VMEM_BYTES,
    grouped_matmul,
    megablox_tiling,
    visits,
)
from flaxlm.models.layers import TransformerSpec


def moe_model_config(**moe_fields):
    """moe-tiny, cut to 2 layers of width 32 with 4 experts of width 48: tiny programs."""
    cfg = config_node("model", ["model=moe-tiny"], init_from=None)
    fields = {"num_experts": 4, "top_k": 2, "expert_mlp_size": 48, **moe_fields}
    return dataclasses.replace(cfg, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                               mlp_size=64, vocab_size=97, max_positions=32,
                               moe=dataclasses.replace(cfg.moe, **fields))


def with_moe(cfg, **moe_fields):
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe_fields))


# ---------------------------------------------------------------- the grouped matmul


def per_group_reference(lhs, rhs, sizes):
    """Row block g of lhs times rhs[g], in float64; rows past the groups zero."""
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = lhs[start:start + size].astype(np.float64) @ rhs[g]
        start += size
    return out


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(0, 70), min_size=1, max_size=6),
       spare_rows=st.integers(0, 9), seed=st.integers(0, 2**16))
def test_tiled_grouped_matmul_and_its_gradients_are_each_groups_own_product(sizes, spare_rows,
                                                                            seed):
    """Any group sizes (empty groups, one group holding every row, rows left over past the
    groups, a count no tile divides): each row times its own group's matrix, and the
    gradients those of that product; `ragged_dot` (JAX's reference) agrees."""
    rng = np.random.default_rng(seed)
    M, K, N = sum(sizes) + spare_rows, 8, 5
    if M == 0:
        return
    lhs = rng.standard_normal((M, K)).astype(np.float32)
    rhs = rng.standard_normal((len(sizes), K, N)).astype(np.float32)
    cotangent = rng.standard_normal((M, N)).astype(np.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)

    @jax.jit
    def pulled_back_both(lhs, rhs, cotangent):
        def pulled_back(backend):
            out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, group_sizes, backend), lhs, rhs)
            return out, *vjp(cotangent)

        return pulled_back("tiled"), pulled_back("ragged")

    (out, grad_lhs, grad_rhs), ragged = pulled_back_both(lhs, rhs, cotangent)
    expected = per_group_reference(lhs, rhs, sizes)
    assert_close(out, expected, terms=K)
    # d lhs: each row's cotangent through its group's matrix transposed; d rhs[g]: the sum over
    # the group's rows of lhsᵀ·cotangent.
    grad_lhs_expected = np.zeros_like(lhs, np.float64)
    grad_rhs_expected = np.zeros_like(rhs, np.float64)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        grad_lhs_expected[rows] = cotangent[rows].astype(np.float64) @ rhs[g].T
        grad_rhs_expected[g] = lhs[rows].T.astype(np.float64) @ cotangent[rows]
        start += size
    assert_close(grad_lhs, grad_lhs_expected, terms=N)
    assert_close(grad_rhs, grad_rhs_expected, terms=max(M, 1), scale=np.abs(lhs).max()
                 * np.abs(cotangent).max() * max(M, 1))
    assert_trees_close((out, grad_lhs, grad_rhs), ragged, terms=max(M, K))


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=7), tile=st.sampled_from([1, 4, 8]))
def test_visits_cover_every_row_of_every_group_once(sizes, tile):
    """The tiled matmul's (tile, group) visits: together, each row of each group exactly once,
    and no more visits than tiles + groups - 1 are real."""
    M = max(sum(sizes), 1)
    tile_V, group_V, real_V, starts_G, ends_G = map(np.asarray, visits(
        jnp.asarray(sizes, jnp.int32), M, tile))
    covered = np.zeros(M, int)
    for t, g, real in zip(tile_V, group_V, real_V):
        if real:
            rows = np.arange(t * tile, (t + 1) * tile)
            rows = rows[(rows >= starts_G[g]) & (rows < ends_G[g])]
            assert rows.size, "a real visit holds rows of its group"
            covered[rows] += 1
    np.testing.assert_array_equal(covered[:sum(sizes)], 1)


# ---------------------------------------------------------------- dispatch


def routed_model(cfg, seed=0):
    return build_lm(TransformerSpec(cfg), nnx.Rngs(seed))


@nnx.jit
def loss_and_grads(model, ids):
    """A loss of the logits and the router's own terms, and its gradients (one program: op
    by op, each of the model's operations would compile on its own)."""

    def loss(model):
        hidden, (aux_loss, metrics) = model.hidden_states_and_aux(ids)
        return (model.lm_head_logits(hidden) ** 2).mean() + aux_loss, metrics

    (value, metrics), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return value, metrics, nnx.state(grads, nnx.Param)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 2**17), widths=st.lists(
    st.one_of(st.integers(1, 8).map(lambda n: 128 * n), st.sampled_from([96, 1408, 4096, 7168]),
              st.integers(8, 20000)), min_size=2, max_size=2),
       kernel=st.sampled_from(["gmm", "tgmm"]))
def test_megablox_tiles_divide_their_dimensions_and_fit_the_kernels_vmem(rows, widths, kernel):
    """Each tile is its whole dimension or a multiple of a TPU's (8, 128) that divides it (a
    tile that does not divide is masked or padded, both slow), and the tiles fit megablox's
    VMEM unless neither width has a dividing tile of half its own or less."""
    K, N = widths
    tiles = megablox_tiling(rows, K, N, kernel)
    for tile, size, unit in zip(tiles, (rows, K, N), (8, 128, 128), strict=True):
        assert tile == size or (size % tile == 0 and tile % unit == 0), (tiles, rows, K, N)
    tm, tk, tn = tiles
    accumulator = tm * tn if kernel == "gmm" else tk * tn
    if 4 * (tm * tk + tk * tn + tm * tn) + 4 * accumulator > MEGABLOX_VMEM_BYTES:
        for tile, size in ((tk, K), (tn, N)):
            assert all(size % t for t in range(128, tile // 2 + 1, 128)), (tiles, K, N)


def test_megablox_tiles_are_the_fastest_measured_at_moe_smalls_shapes():
    """docs/benchmarks.md: whole widths, 256 rows, for each product of moe-small's layer."""
    for kernel in ("gmm", "tgmm"):
        assert megablox_tiling(16384, 768, 2048, kernel) == (256, 768, 2048)
        assert megablox_tiling(16384, 2048, 768, kernel) == (256, 2048, 768)


@pytest.mark.slow  # each drawn shape compiles its own operations: 15 s on 2 cores
@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 24), top_k=st.integers(1, 4), num_experts=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_the_dispatchs_moves_and_their_gradients_are_the_repeat_and_permutations_they_replace(
        tokens, top_k, num_experts, seed):
    """`sorting` is the stable argsort of the copies' experts, its inverse, and the weights in
    sorted order; `to_experts` and `combine` (each a gather both ways, with their own
    gradients) compute what repeating every token K times, permuting, unpermuting and
    summing with the weights computes, values and gradients, for any routing. Each output
    is a sum of K products (terms=K)."""
    rng = np.random.default_rng(seed)
    T, K, E, D = tokens, min(top_k, num_experts), num_experts, 5
    experts_TxK = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    order_M, inverse_M, weight_M = moe.sorting(jnp.asarray(experts_TxK.reshape(-1)),
                                               jnp.arange(T * K, dtype=jnp.float32))
    np.testing.assert_array_equal(order_M, np.argsort(experts_TxK.reshape(-1), kind="stable"))
    np.testing.assert_array_equal(np.asarray(order_M)[np.asarray(inverse_M)], np.arange(T * K))
    np.testing.assert_array_equal(weight_M, order_M)  # the payload arange, sorted: the order
    x_TxD = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    weights_TxK = jnp.asarray(rng.random((T, K)), jnp.float32)
    # What the experts would do to each sorted row: a different scale per row.
    scale_M = jnp.asarray(rng.standard_normal(T * K), jnp.float32)[:, None]
    token_M, inverse_TxK = order_M // K, inverse_M.reshape(T, K)

    def ours(x_TxD, weights_TxK):
        sorted_weight_M = jax.lax.stop_gradient(weights_TxK).reshape(-1)[order_M]
        y_MxD = moe.to_experts(x_TxD, token_M, inverse_TxK) * scale_M
        return moe.combine(y_MxD, token_M, inverse_TxK, weights_TxK, sorted_weight_M)

    def reference(x_TxD, weights_TxK):
        y_MxD = jnp.repeat(x_TxD, K, axis=0)[order_M] * scale_M
        return jnp.einsum("tkd,tk->td", y_MxD[inverse_M].reshape(T, K, D), weights_TxK)

    probe_TxD = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    for function in (lambda f: f(x_TxD, weights_TxK),
                     lambda f: jax.grad(lambda x, w: jnp.sum(f(x, w) * probe_TxD), (0, 1))(
                         x_TxD, weights_TxK)):
        for actual, expected in zip(jax.tree.leaves(function(ours)),
                                    jax.tree.leaves(function(reference)), strict=True):
            assert_close(actual, expected, terms=K * D)


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["tiled", "ragged"])
def test_dropless_dispatch_equals_every_token_through_every_expert(dispatch):
    """Sorting copies by expert, the grouped matmuls and unsorting compute what the dense
    reference computes (each expert's output weighted by the token's routing weight, zero off
    its top-k), forward and backward, router terms included."""
    base = moe_model_config(aux_loss_coef=0.01, z_loss_coef=0.001)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 97, (3, 16)))
    dense = loss_and_grads(routed_model(with_moe(base, dispatch=MoeDispatch.dense)), ids)
    sorted_ = loss_and_grads(routed_model(with_moe(base, dispatch=MoeDispatch(dispatch))), ids)
    settings_ = transformer(2, 97, backward=True)
    assert_close(sorted_[0], dense[0], **settings_)
    assert_trees_close(sorted_[2], dense[2], **settings_)
    for name in ("moe/balance_loss", "moe/router_z_loss", moe.LOAD_METRIC):
        assert_close(sorted_[1][name], dense[1][name], **settings_)


def test_capacity_drops_exactly_the_copies_past_each_experts_capacity():
    """With a capacity factor, each expert takes its first C = ⌈factor·T·K/E⌉ copies in token
    order and the others contribute nothing: the output equals the dense reference with the
    dropped copies' weights set to zero, and moe/dropped is their share. A factor that leaves
    room for every copy drops none and is the dropless output."""
    rng = np.random.default_rng(2)
    T, D, E, K, F = 40, 16, 4, 2, 24
    x = jnp.asarray(rng.standard_normal((1, T, D)), jnp.float32)
    # Skewed routing: expert 0 chosen by most tokens, so that it overflows.
    experts = np.stack([np.where(rng.random(T) < 0.8, 0, rng.integers(1, E, T)),
                        rng.integers(1, E, T)], axis=-1)
    experts[:, 1] = np.where(experts[:, 1] == experts[:, 0], (experts[:, 0] + 1) % E,
                             experts[:, 1])
    weights = rng.random((T, K)).astype(np.float32)
    cfg = moe_model_config(num_experts=E, top_k=K, expert_mlp_size=F)
    cfg = dataclasses.replace(cfg, hidden_size=D)
    layer = moe.MoeMLP(TransformerSpec(cfg), nnx.Rngs(0), shared_mlp=None)

    def run(**moe_fields):
        return moe.dispatch(x, jnp.asarray(experts)[None], jnp.asarray(weights)[None],
                            layer.experts, dataclasses.replace(cfg.moe, **moe_fields))

    factor = 1.0
    C = moe.capacity(T * K, E, factor)
    # Which copies fit: per expert, in token order, copy k of token t before copy k' of t' > t.
    seen = np.zeros(E, int)
    kept = np.zeros((T, K), bool)
    for t in range(T):
        for k in range(K):
            e = experts[t, k]
            kept[t, k] = seen[e] < C
            seen[e] += 1
    assert not kept.all(), "the test's routing must overflow an expert"
    out, dropped = run(capacity_factor=factor)
    reference, _ = moe.dispatch(x, jnp.asarray(experts)[None],
                                jnp.asarray(weights * kept)[None], layer.experts,
                                dataclasses.replace(cfg.moe, dispatch=MoeDispatch.dense))
    assert_close(out, reference, terms=F)
    assert float(dropped) == pytest.approx(1 - kept.mean(), abs=1e-7)
    roomy, none_dropped = run(capacity_factor=float(E))
    dropless, _ = run()
    assert float(none_dropped) == 0.0
    assert_close(roomy, dropless, terms=F)


def test_router_statistics_are_their_formulas():
    """Switch's balancing loss E·Σ f_e·P̄_e (f_e: copies to e per token), the z-loss (mean
    log²Z), the loads (shares of the copies), all over the whole batch."""
    rng = np.random.default_rng(3)
    B, L, E, K = 2, 5, 4, 2
    logits = rng.standard_normal((B, L, E)).astype(np.float32)
    experts = np.argsort(-logits, axis=-1)[..., :K]
    stats = moe.router_stats(jnp.asarray(logits), jnp.asarray(experts), jnp.zeros(()))
    flat = logits.reshape(-1, E).astype(np.float64)
    probs = np.exp(flat - flat.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    counts = np.bincount(experts.reshape(-1), minlength=E)
    T = B * L
    assert_close(stats.balance_loss, E * np.sum(counts / T * probs.mean(0)), terms=E * T)
    log_z = np.log(np.exp(flat).sum(-1))
    assert_close(stats.z_loss, np.mean(log_z ** 2), terms=E * T)
    np.testing.assert_allclose(np.asarray(stats.load_E), counts / counts.sum(), rtol=1e-6)


def test_the_even_load_gives_the_balancing_loss_its_minimum_k():
    """Every expert equally loaded and equally probable: E · Σ (K/E)·(1/E) = K."""
    E, K, T = 4, 2, 8
    logits = jnp.zeros((1, T, E))
    experts = jnp.asarray([[(t % E, (t + 1) % E) for t in range(T)]])
    stats = moe.router_stats(logits, experts, jnp.zeros(()))
    assert float(stats.balance_loss) == pytest.approx(K, rel=1e-6)


@pytest.mark.slow
def test_the_loss_free_bias_moves_toward_the_even_load_in_a_train_step():
    """DeepSeek-V3's balancing: after a step each layer's bias went up by the rate for an
    expert below its even share and down for one above; the optimizer itself leaves the bias
    alone (its gradient is zero: it only chooses)."""
    import optax

    from flaxlm.training.optimizer import make_optimizer
    from flaxlm.training.step import create_state, lm_objective, train_step

    rate = 0.125
    cfg = moe_model_config(bias_update_rate=rate)
    model = routed_model(cfg)
    opt = config_node("optimizer")
    optimizer = make_optimizer(opt, optax.constant_schedule(opt.lr))
    graphdef, state = create_state(model, optimizer.transformation(optimizer.arguments()))
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 97, (1, 4, 16)))
    _, metrics = jax.jit(lambda params: lm_objective(nnx.merge(graphdef, params), ids[0],
                                                     nnx.Rngs(0)))(state.params)
    step = jax.jit(lambda state, ids, key, hyperparams: train_step(
        state, ids, key, hyperparams, graphdef=graphdef, optimizer=optimizer))
    new_state, step_metrics = step(state, ids, jax.random.key(0), optimizer.arguments())
    assert moe.LOAD_METRIC not in step_metrics, "the loads are not a scalar to report"
    load = np.asarray(metrics[moe.LOAD_METRIC])
    for index in range(cfg.num_layers):
        before = state.params["model"]["layers"][index]["mlp"]["router_bias"][...]
        after = new_state.params["model"]["layers"][index]["mlp"]["router_bias"][...]
        expected = np.asarray(before) + rate * np.sign(1 / cfg.moe.num_experts - load[index])
        np.testing.assert_allclose(np.asarray(after), expected, rtol=0, atol=1e-7)


@pytest.mark.slow
def test_a_scanned_moe_model_is_the_unrolled_one():
    """model.scan_layers stacks the experts with the rest of a layer: the same loss, the same
    router metrics."""
    cfg = moe_model_config(aux_loss_coef=0.01)
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 97, (2, 16)))
    unrolled = loss_and_grads(routed_model(cfg), ids)
    scanned = loss_and_grads(routed_model(dataclasses.replace(cfg, scan_layers=True)), ids)
    settings_ = transformer(2, 97)
    assert_close(scanned[0], unrolled[0], **settings_)
    assert_close(scanned[1][moe.LOAD_METRIC], unrolled[1][moe.LOAD_METRIC], **settings_)


def test_first_dense_layers_have_a_dense_mlp_and_no_router():
    cfg = dataclasses.replace(moe_model_config(first_dense_layers=1), num_layers=3)
    model = routed_model(cfg)
    assert not model.model.layers[0].sparse and model.model.layers[1].sparse
    ids = jnp.asarray(np.random.default_rng(6).integers(0, 97, (1, 8)))
    _, (_, metrics) = model.hidden_states_and_aux(ids)
    assert metrics[moe.LOAD_METRIC].shape == (2, cfg.moe.num_experts)  # the 2 sparse layers


def test_active_parameters_count_k_experts_per_sparse_layer():
    """What a token meets: all parameters less E − K experts' three matrices per sparse layer."""
    cfg = moe_model_config(first_dense_layers=1)
    cfg = dataclasses.replace(cfg, num_layers=3)
    model = routed_model(cfg)
    total = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    idle = 2 * (cfg.moe.num_experts - cfg.moe.top_k) * 3 * cfg.hidden_size * 48
    assert moe.num_active_params(cfg, total) == total - idle


# ---------------------------------------------------------------- bad settings


@pytest.mark.parametrize("fields, names", [
    ({"top_k": 5}, ["model.moe.top_k=5", "model.moe.num_experts=4"]),
    ({"top_k": 0}, ["model.moe.top_k=0"]),
    ({"capacity_factor": 0.0}, ["model.moe.capacity_factor=0.0", "> 0"]),
    ({"capacity_factor": -1.0}, ["model.moe.capacity_factor=-1.0"]),
    ({"first_dense_layers": 2}, ["model.moe.first_dense_layers=2"]),
    ({"aux_loss_coef": -0.1}, ["model.moe.aux_loss_coef=-0.1"]),
])
def test_expert_settings_that_cannot_work_are_refused_in_one_paragraph(fields, names):
    with pytest.raises(FlaxlmError) as caught:
        routed_model(moe_model_config(**fields))
    message = str(caught.value)
    assert all(name in message for name in names), message
    assert "\n" not in message


def test_experts_on_a_family_without_them_are_refused():
    """A GPT-2 or Llama checkpoint holds one dense MLP per layer: experts there could be
    trained but never exported, so they are refused, naming the MoE families."""
    cfg = config_node("model", ["model=llama-tiny"], init_from=None)
    with pytest.raises(FlaxlmError, match=r"model.moe.num_experts=8 on model.family=llama.*"
                                          r"qwen3_moe"):
        routed_model(with_moe(cfg, num_experts=8))
    with pytest.raises(FlaxlmError, match="model.moe.num_experts is not set"):
        routed_model(with_moe(moe_model_config(), num_experts=None))


def test_scanned_layers_with_leading_dense_ones_are_refused():
    cfg = dataclasses.replace(moe_model_config(first_dense_layers=1), scan_layers=True)
    with pytest.raises(FlaxlmError, match="model.scan_layers=false"):
        routed_model(cfg)


# ---------------------------------------------------------------- a run


@pytest.mark.slow
def test_moe_tiny_trains_offline_with_its_router_signals_logged(train_cli, tmp_path):
    """model=moe-tiny (cut to the suite's tiny shape) trains on the offline corpus: the eval
    loss falls, every logged step carries the router's signals with loads that are shares
    (busiest ≥ 1 ≥ idlest, as multiples of the even share), and with the loss-free bias on the
    run ends without a transformers export, saying why, its checkpoint holding the bias."""
    from conftest import TINY, metrics_of

    run_dir = tmp_path / "run"
    done = train_cli(*TINY, "model=moe-tiny", "model.moe.bias_update_rate=0.01",
                     "trainer.max_steps=12", "trainer.log_every_steps=4",
                     "trainer.eval_every_steps=12", "samples.prompts=[]",
                     f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "no transformers export" in done.stdout and "model.moe.bias_update_rate" in done.stdout
    records = metrics_of(run_dir)
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert evals[-1] < evals[0]
    logged = [r for r in records if "train/loss" in r]
    assert logged
    sparse_layers = range(2)  # the tiny shape's two layers, both sparse
    for record in logged:
        assert record["train/moe/load_max"] >= 1.0 >= record["train/moe/load_min"] >= 0.0
        # Each layer's own: in a step the whole model's are their extremes, and a record
        # averages its steps, so its model-wide busiest load is at least each layer's mean.
        layers_max = [record[f"train/moe/layer_{i}/load_max"] for i in sparse_layers]
        layers_min = [record[f"train/moe/layer_{i}/load_min"] for i in sparse_layers]
        assert record["train/moe/load_max"] >= max(layers_max) >= min(layers_max) >= 1.0
        assert record["train/moe/load_min"] <= min(layers_min) <= max(layers_min) <= 1.0
        assert "train/moe/layer_2/load_max" not in record
        assert record["train/moe/balance_loss"] >= 1.0  # ≥ K·(min share) … K at the even load
        assert record["train/moe/dropped"] == 0.0
        assert "train/moe/load" not in record
    assert not (run_dir / "model" / "model.safetensors").exists()


def test_each_sparse_layers_load_is_logged_under_its_decoder_layers_index():
    """With `first_dense_layers` dense layers first, the sparse layers' loads (S, E) are named
    by their place in the decoder; the model-wide busiest and idlest are their extremes."""
    load_SxE = jnp.array([[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25],
                          [0.125, 0.375, 0.25, 0.25]])
    stats = moe.RouterStats(balance_loss=jnp.ones(3), z_loss=jnp.ones(3), load_E=load_SxE,
                            dropped=jnp.zeros(3))
    settings = config_node("model", ["model=moe-tiny"]).moe
    _, metrics = moe.aux_losses(stats, dataclasses.replace(settings, first_dense_layers=2))
    per_layer = {name: float(value) for name, value in metrics.items() if "/layer_" in name}
    assert per_layer == {"moe/layer_2/load_max": 2.0, "moe/layer_2/load_min": 0.0,
                         "moe/layer_3/load_max": 1.0, "moe/layer_3/load_min": 1.0,
                         "moe/layer_4/load_max": 1.5, "moe/layer_4/load_min": 0.5}
    assert (float(metrics["moe/load_max"]), float(metrics["moe/load_min"])) == (2.0, 0.0)
    assert float(metrics["moe/dead_experts"]) == 1.0
