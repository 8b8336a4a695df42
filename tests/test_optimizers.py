"""Optimizers, schedules, clipping and gradient accumulation.

Every optimizer × schedule trains the TINY model on a fixed batch; the schedules have the values
they promise; weight decay skips biases and LayerNorm scales; clipping sits in front of every
optimizer; and k accumulated micro-batches make exactly the step of one k-times larger batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY, compose, config_node
from flax import nnx
from hydra.errors import ConfigCompositionException
from numerics import NEWTON_SCHULZ_SLOPE, assert_close, magnitude, transformer_depth
from omegaconf import OmegaConf

from flaxlm.config import OptimizerName, Schedule
from flaxlm.errors import FlaxlmError
from flaxlm.job import check_settings
from flaxlm.models.gpt2 import GPT2LMHeadModel
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import global_batch, make_mesh, replicated
from flaxlm.training.optimizer import decay_mask, make_optimizer, make_schedule, muon_labels
from flaxlm.training.plan import global_batch_size
from flaxlm.training.step import (
    accumulate_gradients,
    compile_steps,
    create_state,
    next_token_losses,
)

NO_DROPOUT = ["model.hidden_dropout=0", "model.embedding_dropout=0", "model.attention_dropout=0"]


@pytest.fixture(scope="module")
def configs():
    """The TINY run composed with each shipped optimizer option, dropout off."""
    return {
        kind: OmegaConf.to_object(compose([*TINY, *NO_DROPOUT, f"optimizer={kind.value}"]))
        for kind in OptimizerName
    }


@pytest.fixture(scope="module")
def tiny(configs):
    """The TINY model's parameters, a fixed batch and its jitted loss-and-gradient."""
    model = GPT2LMHeadModel(TransformerSpec(configs[OptimizerName.adamw].model), nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 512, (8, 32)), jnp.int32)

    def loss(params):
        return next_token_losses(nnx.merge(graphdef, params)(batch), batch).mean()

    return params, jax.jit(jax.value_and_grad(loss))


def named_leaves(tree) -> list[tuple[str, np.ndarray]]:
    """(parameter name, value) per leaf, the name read from the printed path
    (`['h'][0]['mlp']['c_fc']['kernel'].value`), independently of decay_mask's reading."""
    return [(jax.tree_util.keystr(path).removesuffix(".value").split("'")[-2], np.asarray(v))
            for path, v in jax.tree_util.tree_leaves_with_path(tree)]


# --- optimizers ----------------------------------------------------------------------------------


def test_every_optimizer_option_composes_to_its_kind(configs):
    for kind, config in configs.items():
        assert config.optimizer.name == kind


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
@pytest.mark.parametrize("kind", list(OptimizerName), ids=lambda k: k.value)
def test_every_optimizer_and_schedule_lowers_the_loss_on_a_fixed_batch(configs, tiny, kind,
                                                                      schedule):
    """Each option's own YAML values (lr included), with 2 warmup steps of 6."""
    params, loss_and_grads = tiny
    opt = dataclasses.replace(configs[kind].optimizer, schedule=schedule, warmup_steps=2)
    tx = make_optimizer(opt, make_schedule(opt, total_steps=6))
    opt_state, losses, update = tx.init(params), [], jax.jit(tx.update)  # muon: slow eagerly
    for _ in range(6):
        loss, grads = loss_and_grads(params)
        updates, opt_state = update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    losses.append(float(loss_and_grads(params)[0]))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.03, losses  # lion, the slowest here, drops 0.07


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(OptimizerName), ids=lambda k: k.value)
def test_weight_decay_skips_biases_and_layernorm_scales(tiny, kind):
    """With zero gradients only weight decay moves the parameters: kernels and embeddings
    shrink towards 0, biases and LayerNorm scales stay exactly as they were."""
    params = jax.tree.map(lambda p: p + 1.0, tiny[0])  # no zeros: biases start at 0
    opt = config_node("optimizer", [f"optimizer={kind.value}"], lr=0.1, weight_decay=0.1,
                      momentum=0.9)
    tx = make_optimizer(opt, optax.constant_schedule(opt.lr))
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    after = optax.apply_updates(params, updates)

    decayed = exempt = 0
    for (name, before), (_, now) in zip(named_leaves(params), named_leaves(after)):
        if name in ("kernel", "embedding"):
            assert np.all(np.abs(now) < np.abs(before)), name
            decayed += 1
        else:
            assert name in ("bias", "scale"), name
            np.testing.assert_array_equal(now, before, err_msg=name)
            exempt += 1
    assert decayed and exempt


def newton_schulz_reference(m_hat: np.ndarray, steps: int = 5) -> np.ndarray:
    """Muon's orthogonalisation as optax documents it (Jordan's quintic iteration): X = M /
    (‖M‖_F + eps), the wide way round; `steps` × X ← aX + (bA + cA²)X with A = XXᵀ."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = m_hat / (np.linalg.norm(m_hat) + 1e-8)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def test_one_muon_step_on_a_matrix_is_the_reference_formula():
    """A hidden layer's 6 × 4 kernel and its bias, one step from a zero momentum: the kernel
    moves by −lr × (NS₅(m̂) × 0.2 × √6 + weight_decay × W), m̂ being Nesterov's bias-corrected
    momentum (1 + β(1 − β)/(1 − β²)) g after one gradient g; the bias by AdamW's first step,
    −lr × sign(g) (bias correction makes |m̂/√v̂| = 1; no decay on biases)."""
    rng = np.random.default_rng(0)
    params = {"h": {"mlp": {"c_fc": {"kernel": rng.normal(size=(6, 4)),
                                     "bias": rng.normal(size=4)}}}}
    grads = {"h": {"mlp": {"c_fc": {"kernel": rng.normal(size=(6, 4)),
                                    "bias": rng.normal(size=4)}}}}
    params, grads = (jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), t) for t in (params,
                                                                                      grads))
    opt = config_node("optimizer", ["optimizer=muon"], lr=0.05)
    tx = make_optimizer(opt, optax.constant_schedule(opt.lr))
    updates, _ = tx.update(grads, tx.init(params), params)

    beta, kernel, g = opt.momentum, params["h"]["mlp"]["c_fc"]["kernel"], grads["h"]["mlp"]["c_fc"]
    m_hat = (beta * (1 - beta) / (1 - beta**2) + 1) * np.asarray(g["kernel"], np.float64)
    expected = -opt.lr * (newton_schulz_reference(m_hat) * 0.2 * np.sqrt(6)
                          + opt.weight_decay * np.asarray(kernel))
    # float32 against float64: 5 Newton–Schulz steps of 3 products of width 6, each step
    # magnifying an error along a small singular value by up to a = 3.4445 (its slope at 0).
    assert_close(updates["h"]["mlp"]["c_fc"]["kernel"], expected, terms=6, depth=5 * 3,
                 amplification=NEWTON_SCHULZ_SLOPE**5)
    # |m̂/√v̂| = |g|/(|g| + eps) is 1 to within eps/|g| and a few roundings, but v̂'s bias
    # correction 1 − β₂ in float32 carries β₂'s rounding magnified by 1/(1 − β₂).
    assert_close(updates["h"]["mlp"]["c_fc"]["bias"], -opt.lr * np.sign(g["bias"]), depth=4,
                 amplification=1 / (1 - opt.b2))


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    """GPT-2 (tied head) and Llama with an LM head of its own: Muon gets exactly the attention
    and MLP projections' kernels; embeddings, the LM head, norms and biases go to AdamW."""
    from conftest import model_config

    from flaxlm.models.build import abstract_network, build_lm

    shape = dict(vocab_size=64, max_positions=16, hidden_size=16, num_layers=1, num_heads=2)
    muon_modules = {}
    for family, extra in [("gpt2", {}), ("llama", dict(num_kv_heads=1, mlp_size=24,
                                                         tie_word_embeddings=False))]:
        spec = TransformerSpec(model_config(family, **shape, **extra))
        model = abstract_network(lambda rngs, spec=spec: build_lm(spec, rngs))
        params = nnx.state(model, nnx.Param)
        muon_paths = [jax.tree_util.keystr(path).removesuffix(".value").split("'")
                      for path, label in jax.tree_util.tree_leaves_with_path(muon_labels(params))
                      if label == "muon"]
        assert {names[-2] for names in muon_paths} == {"kernel"}
        muon_modules[family] = {names[-4] for names in muon_paths}
        assert {"lm_head", "embed_tokens", "wte", "wpe"}.isdisjoint(muon_modules[family])
    assert muon_modules == {"gpt2": {"c_attn", "c_proj", "c_fc"},
                            "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"}}


def test_muon_without_momentum_is_named():
    config = OmegaConf.to_object(compose([*TINY, "optimizer=muon", "optimizer.momentum=null"]))
    with pytest.raises(FlaxlmError, match="optimizer.momentum=null"):
        check_settings(config, num_devices=8)


def test_decay_mask_names_matrices_and_embeddings_only(tiny):
    masked_in = {name for (name, _), keep in zip(named_leaves(tiny[0]),
                                                 jax.tree.leaves(decay_mask(tiny[0]))) if keep}
    assert masked_in == {"kernel", "embedding"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(OptimizerName), ids=lambda k: k.value)
def test_gradient_clipping_comes_before_every_optimizer(tiny, kind):
    """Two steps, a large gradient then a small one: the clipping optimizer does exactly what the
    plain one does on the clipped gradients, and not what it does on the raw ones."""
    params, loss_and_grads = tiny
    grads = loss_and_grads(params)[1]
    norm = float(optax.tree.norm(grads))
    large = jax.tree.map(lambda g: g * 100 / norm, grads)  # norm 100: clipped to 1
    small = jax.tree.map(lambda g: -0.5 * g / norm, grads)  # norm 0.5, the other way: kept
    opt = config_node("optimizer", [f"optimizer={kind.value}"], lr=1e-2, momentum=0.9)

    def two_steps(tx, first):
        state, out, update = tx.init(params), [], jax.jit(tx.update)
        for g in (first, small):
            updates, state = update(g, state, params)
            out.append(updates)
        return out

    schedule = optax.constant_schedule(opt.lr)
    clipped = two_steps(make_optimizer(dataclasses.replace(opt, max_grad_norm=1.0), schedule),
                        large)
    plain = make_optimizer(opt, schedule)
    by_hand = two_steps(plain, jax.tree.map(lambda g: g / 100, large))
    unclipped = two_steps(plain, large)
    # Clipping multiplies by 1/norm where by_hand divides by 100: each gradient differs by a
    # rounding, and all by one factor (the norm's error, which no optimizer here is sensitive
    # to: Adam and Lion divide it out, Newton–Schulz normalises). Two steps carry it on; muon's
    # Newton–Schulz (5 steps of 3 products as wide as a matrix, each magnifying an error along a
    # small singular value by up to its slope) magnifies it.
    width = max(max(leaf.shape) for leaf in jax.tree.leaves(params))
    settings = dict(terms=width, depth=2 * (1 + 5 * 3) if kind == OptimizerName.muon else 2,
                    amplification=NEWTON_SCHULZ_SLOPE**5 if kind == OptimizerName.muon else 1)
    jax.tree.map(lambda a, b: assert_close(a, b, **settings), clipped, by_hand)
    differences = jax.tree.map(lambda a, b: np.abs(a - b).max(), clipped, unclipped)
    assert max(jax.tree.leaves(differences)) > 1e-6


# --- schedules -----------------------------------------------------------------------------------

# lr 1 → end_lr 0.1 over 110 steps, the first 10 warming up from 0; wsd decays over the last 20%.
SCHEDULE_VALUES = {
    Schedule.linear: {60: 0.55, 85: 0.325, 110: 0.1},
    Schedule.cosine: {35: 0.1 + 0.9 * (1 + np.cos(np.pi / 4)) / 2, 60: 0.55, 110: 0.1},
    Schedule.constant: {60: 1.0, 110: 1.0},
    Schedule.wsd: {60: 1.0, 88: 1.0, 99: 0.55, 110: 0.1},
}


@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_schedule_warms_up_then_takes_its_shape(schedule):
    opt = config_node("optimizer", lr=1.0, end_lr=0.1, warmup_steps=10, schedule=schedule,
                          decay_fraction=0.2)
    lr = make_schedule(opt, total_steps=110)
    expected = {0: 0.0, 5: 0.5, 10: 1.0, **SCHEDULE_VALUES[schedule]}
    for step, value in expected.items():
        # A few float32 operations (a cosine, a product, a sum) on numbers up to 1.
        assert_close(float(lr(step)), value, depth=4, scale=1.0, err_msg=f"step {step}")


def test_wsd_is_flat_until_its_last_decay_fraction_then_decays_every_step():
    opt = config_node("optimizer", lr=1.0, end_lr=0.0, warmup_steps=10,
                          schedule=Schedule.wsd, decay_fraction=0.2)
    lr = make_schedule(opt, total_steps=110)
    values = np.array([float(lr(step)) for step in range(111)])
    assert np.all(values[10:89] == 1.0)
    assert np.all(np.diff(values[88:]) < 0)
    assert values[110] == 0.0


def test_without_warmup_every_schedule_starts_at_the_full_learning_rate():
    for schedule in Schedule:
        opt = config_node("optimizer", lr=3e-4, schedule=schedule)
        assert_close(float(make_schedule(opt, total_steps=100)(0)), 3e-4)  # 3e-4 in float32


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"warmup_steps": 95}, ["optimizer.warmup_steps=95", "optimizer.decay_fraction=0.1",
                                "step 90"]),
        ({"decay_fraction": 0.0}, ["optimizer.decay_fraction=0.0"]),
        ({"decay_fraction": 1.5}, ["optimizer.decay_fraction=1.5"]),
    ],
)
def test_impossible_wsd_settings_are_named(changes, fragments):
    opt = config_node("optimizer", schedule=Schedule.wsd, **changes)
    with pytest.raises(FlaxlmError) as info:
        make_schedule(opt, total_steps=100)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("optimizer=adam", ["Could not find 'optimizer/adam'", "adafactor", "lion", "sgd"]),
        ("optimizer.name=adam", ["optimizer.name", "adam"]),
        ("optimizer.schedule=warmup_cosine", ["optimizer.schedule", "warmup_cosine"]),
    ],
)
def test_unknown_optimizer_or_schedule_fails_at_composition_naming_it(override, fragments):
    with pytest.raises(ConfigCompositionException) as info:
        compose([override])
    message = f"{info.value} {info.value.__cause__}"
    for fragment in fragments:
        assert fragment in message


# --- gradient accumulation -----------------------------------------------------------------------


def test_grad_accum_steps_below_one_is_named():
    config = OmegaConf.to_object(compose([*TINY, "trainer.grad_accum_steps=0"]))
    with pytest.raises(FlaxlmError, match="trainer.grad_accum_steps=0"):
        check_settings(config, num_devices=8)


def test_global_batch_counts_every_micro_batch():
    """TINY: 2 per device on 8 devices; 4 micro-batches make 64 rows per optimizer step."""
    config = OmegaConf.to_object(compose([*TINY, "trainer.grad_accum_steps=4"]))
    assert global_batch_size(config, 8) == 64
    fixed = OmegaConf.to_object(
        compose([*TINY, "trainer.grad_accum_steps=4", "trainer.global_batch_size=512"])
    )
    assert global_batch_size(fixed, 8) == 512  # GPT-2's batch, 16 rows per device at a time
    uneven = dataclasses.replace(fixed, trainer=dataclasses.replace(fixed.trainer,
                                                                    global_batch_size=48))
    with pytest.raises(FlaxlmError) as info:
        global_batch_size(uneven, 8)
    for fragment in ("trainer.global_batch_size=48", "trainer.grad_accum_steps=4", "8 devices",
                     "multiple of 32"):
        assert fragment in str(info.value)


def test_each_micro_batch_draws_its_own_dropout_key():
    """A loss that is only its key's random draw, at optimizer step 2 of 4 micro-batches each:
    the mean over the micro-batches is the mean of the draws of the run's micro-batches 8-11;
    a metric beside the loss (its square) is averaged the same way."""
    dropout_key = jax.random.key(3)
    draws = [float(jax.random.uniform(jax.random.fold_in(dropout_key, m))) for m in range(8, 12)]
    assert len(set(draws)) == 4

    def loss_fn(params, inputs, key):
        draw = jax.random.uniform(key)
        return params["w"] * draw, {"square": draw**2}

    (loss, metrics), grads = accumulate_gradients(
        loss_fn, {"w": jnp.float32(1.0)}, jnp.zeros((4, 2, 3), jnp.int32), dropout_key,
        first_micro_batch=jnp.int32(8),
    )
    assert_close(float(loss), np.mean(draws), terms=4)  # float32 means of 4 against float64
    assert_close(float(metrics["square"]), np.mean(np.square(draws)), terms=4, depth=2)
    assert_close(float(grads["w"]), np.mean(draws), terms=4)


@pytest.mark.slow
def test_four_accumulated_micro_batches_equal_one_step_on_the_four_times_batch(configs):
    """On 8 devices, no dropout: 4 micro-batches of 16 rows (2 per device) make the same loss,
    gradient norm and parameters as one step on all 64 rows, and the step counts as one.

    SGD, whose update is linear in the gradient: Adam's first update is about sign(g), which
    flips for a gradient near eps under any change of summation order.
    """
    config = configs[OptimizerName.sgd]
    schedule = make_schedule(config.optimizer, total_steps=10)  # linear from 0.1 to 0
    tx = make_optimizer(config.optimizer, schedule)
    graphdef, start = create_state(GPT2LMHeadModel(TransformerSpec(config.model), nnx.Rngs(0)), tx)
    mesh = make_mesh(8)
    start = jax.device_get(start)
    rows = np.random.default_rng(1).integers(0, 512, (64, 16)).astype(np.int32)
    inputs, key = global_batch(rows, mesh), jax.random.key(0)

    def first_step(accum):
        state = jax.device_put(start, replicated(mesh))
        train = compile_steps(mesh, graphdef, tx, accum).train
        compiled = train.lower(state, inputs, key).compile()
        state, metrics = compiled(state, inputs, key, train.hyperparams)
        params = nnx.to_pure_dict(jax.device_get(state.params))
        return compiled, state, jax.device_get(metrics), params

    _, _, metrics_1, params_1 = first_step(1)
    compiled, state, metrics_4, params_4 = first_step(4)
    # The same sums over 64 rows' targets, in 4 parts and then added: reordered.
    layers, tokens = config.model.num_layers, rows[:, 1:].size
    assert_close(metrics_4["loss"], metrics_1["loss"], terms=tokens,
                 depth=transformer_depth(layers))
    gradients = dict(terms=tokens, depth=transformer_depth(layers, backward=True))
    assert_close(metrics_4["grad_norm"], metrics_1["grad_norm"], **gradients)
    start_params = nnx.to_pure_dict(start.params)
    # Each parameter is its start plus lr × its gradient: the step carries the gradient's error.
    jax.tree.map(lambda a, b, s: assert_close(a, b, scale=magnitude(b - s), **gradients),
                 params_4, params_1, start_params)
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), params_4, start_params)
    assert max(jax.tree.leaves(moved)) > 1e-4  # the step did update the parameters

    # One call is one optimizer step: the counter and the schedule advance by one, not by 4.
    state, metrics = compiled(state, inputs, key, tx.arguments())
    assert int(state.step) == 2
    assert float(metrics["learning_rate"]) == float(schedule(1))  # the same float32 schedule
    # The micro-batches are cut where each device's rows already are: no rows move.
    hlo = compiled.as_text()
    assert "all-to-all" not in hlo and "collective-permute" not in hlo


@pytest.mark.parametrize(
    "override",
    ["optimizer.lr=nan", "optimizer.lr=inf", "optimizer.lr=0", "optimizer.b1=nan",
     "optimizer.b2=1.0", "optimizer.eps=-inf", "optimizer.weight_decay=nan",
     "optimizer.weight_decay=-0.1", "optimizer.end_lr=inf", "optimizer.max_grad_norm=nan",
     "optimizer.max_grad_norm=0", "optimizer.decay_fraction=nan"],
)
def test_non_finite_or_impossible_optimizer_numbers_fail_before_any_data(override):
    config = OmegaConf.to_object(compose([*TINY, override]))
    with pytest.raises(FlaxlmError) as info:
        check_settings(config, num_devices=8)
    assert override.split("=")[0] in str(info.value)


def test_non_finite_momentum_is_named():
    config = OmegaConf.to_object(compose([*TINY, "optimizer=sgd", "optimizer.momentum=inf"]))
    with pytest.raises(FlaxlmError, match="optimizer.momentum=inf"):
        check_settings(config, num_devices=8)


# --- optimizer.moment_dtype ----------------------------------------------------------------------


def floating_leaves(tree) -> list[tuple[str, jax.Array]]:
    return [(jax.tree_util.keystr(path), leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
            if jnp.issubdtype(leaf.dtype, jnp.floating)]


@pytest.mark.parametrize("kind", list(OptimizerName), ids=lambda k: k.value)
def test_bfloat16_moments_are_stored_in_bfloat16_after_a_step(configs, tiny, kind):
    """Every moment of every optimizer, after init and after a step (an update computed in
    float32 must be rounded back down); adafactor's momentum only, its factored second
    moments staying float32."""
    params, loss_and_grads = tiny
    opt = dataclasses.replace(configs[kind].optimizer, moment_dtype="bfloat16",
                              momentum=configs[kind].optimizer.momentum or 0.9)
    tx = make_optimizer(opt, optax.constant_schedule(opt.lr))
    state = tx.init(params)
    _, state = jax.jit(tx.update)(loss_and_grads(params)[1], state, params)
    dtypes = {path: leaf.dtype for path, leaf in floating_leaves(state)}
    if kind == OptimizerName.adafactor:
        momentum = {path: dtype for path, dtype in dtypes.items() if ".ema" in path}
        assert momentum and set(momentum.values()) == {jnp.dtype(jnp.bfloat16)}, momentum
        assert jnp.dtype(jnp.float32) in dtypes.values()  # the second moments
    else:
        assert dtypes and set(dtypes.values()) == {jnp.dtype(jnp.bfloat16)}, dtypes
    # Half the bytes of the float32 moments, which the parameters' dtype gives by default.
    default = make_optimizer(configs[kind].optimizer if kind != OptimizerName.adafactor
                             else dataclasses.replace(opt, moment_dtype=None),
                             optax.constant_schedule(opt.lr))
    assert (sum(leaf.nbytes for _, leaf in floating_leaves(default.init(params)))
            > sum(leaf.nbytes for _, leaf in floating_leaves(state)))


def test_the_optimizer_state_is_made_in_one_compiled_program(configs):
    """create_state without a mesh (the benchmarks', the tests') starts the optimizer inside
    jit, as with one: run eagerly, optax's init would make each float32 moment before
    moments_stored_in rounds it to bfloat16, a peak of twice the parameters' bytes more than
    the state kept (llama-1b's did not fit one 16 GiB chip that way, its step did)."""
    traced = []
    adamw = make_optimizer(dataclasses.replace(configs[OptimizerName.adamw].optimizer,
                                               moment_dtype="bfloat16"),
                           optax.constant_schedule(1e-3))

    def init(params):
        traced.extend(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(params))
        return adamw.init(params)

    model = GPT2LMHeadModel(TransformerSpec(configs[OptimizerName.adamw].model), nnx.Rngs(0))
    _, state = create_state(model, optax.GradientTransformation(init, adamw.update))
    assert traced and all(traced)
    assert {leaf.dtype for _, leaf in floating_leaves(state.opt_state)} == {
        jnp.dtype(jnp.bfloat16)}


def test_float32_moments_are_optax_adamw_bit_for_bit(configs, tiny):
    """moment_dtype=float32 on float32 parameters only casts float32 to float32: the update
    and the state are exactly optax.adamw's (moment_dtype=null)."""
    params, loss_and_grads = tiny
    opt = configs[OptimizerName.adamw].optimizer
    plain = make_optimizer(opt, optax.constant_schedule(opt.lr))
    wrapped = make_optimizer(dataclasses.replace(opt, moment_dtype="float32"),
                             optax.constant_schedule(opt.lr))
    states = [plain.init(params), wrapped.init(params)]
    for _ in range(2):
        grads = loss_and_grads(params)[1]
        (u_plain, s_plain), (u_wrapped, s_wrapped) = (
            jax.jit(tx.update)(grads, state, params)
            for tx, state in zip((plain, wrapped), states))
        assert all(np.array_equal(a, b) for a, b in
                   zip(jax.tree.leaves(u_wrapped), jax.tree.leaves(u_plain), strict=True))
        states = [s_plain, s_wrapped]
        params = optax.apply_updates(params, u_plain)
    assert all(np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(states[1]), jax.tree.leaves(states[0]), strict=True))


def test_adamw_with_bfloat16_moments_steps_as_float32_within_their_rounding(configs, tiny):
    """Three AdamW steps on one gradient sequence: the updates with bfloat16 moments against
    float32 ones. The first update is computed before any moment is stored, so it is equal;
    each later one reads moments rounded to bfloat16 once per step (mu's rounding enters the
    update as is, nu's halved by the square root), so they differ by bfloat16's tolerance with
    depth = the steps, on the scale of the update (≈ lr: Adam's steps are normalised). A
    moment kept in bfloat16 arithmetic, or never cast back, is caught by the dtype test."""
    params, loss_and_grads = tiny
    opt = dataclasses.replace(configs[OptimizerName.adamw].optimizer, weight_decay=0.0)
    schedule = optax.constant_schedule(opt.lr)
    f32, bf16 = (make_optimizer(dataclasses.replace(opt, moment_dtype=d), schedule)
                 for d in ("float32", "bfloat16"))
    state32, state16 = f32.init(params), bf16.init(params)
    steps = 3
    for step in range(steps):
        grads = loss_and_grads(params)[1]
        u32, state32 = jax.jit(f32.update)(grads, state32, params)
        u16, state16 = jax.jit(bf16.update)(grads, state16, params)
        if step == 0:
            assert all(np.array_equal(a, b) for a, b in
                       zip(jax.tree.leaves(u16), jax.tree.leaves(u32), strict=True))
        else:
            assert_close(np.concatenate([np.ravel(x) for x in jax.tree.leaves(u16)]),
                         np.concatenate([np.ravel(x) for x in jax.tree.leaves(u32)]),
                         dtype=jnp.bfloat16, depth=step + 1, scale=opt.lr)
        params = optax.apply_updates(params, u32)  # one gradient sequence for both
    # ... and the two did differ: bfloat16's rounding is there to be bounded.
    assert not all(np.array_equal(a, b) for a, b in
                   zip(jax.tree.leaves(u16), jax.tree.leaves(u32), strict=True))


@pytest.mark.parametrize(("overrides", "fragments"), [
    (["optimizer.moment_dtype=float16"], ["optimizer.moment_dtype=float16", "bfloat16"]),
    (["optimizer.moment_dtype=bf16"], ["optimizer.moment_dtype=bf16"]),
    (["optimizer.moment_dtype=bfloat16", "optimizer.b2=0.999"],
     ["optimizer.b2=0.999", "moment_dtype=bfloat16", "2^-8"]),
    (["optimizer=sgd", "optimizer.moment_dtype=bfloat16", "optimizer.momentum=0.998"],
     ["optimizer.momentum=0.998"]),
])
def test_impossible_moment_dtypes_are_named(overrides, fragments):
    config = OmegaConf.to_object(compose([*TINY, *overrides]))
    with pytest.raises(FlaxlmError) as info:
        check_settings(config, num_devices=8)
    assert all(fragment in str(info.value) for fragment in fragments), str(info.value)
    # ... while the rates bfloat16 can decay by pass.
    check_settings(OmegaConf.to_object(compose(
        [*TINY, "optimizer.moment_dtype=bfloat16", "optimizer.b2=0.99"])), num_devices=8)
