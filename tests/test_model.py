"""The Flax GPT-2 against transformers' PyTorch GPT2LMHeadModel, through the name mapping."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import config_node, model_config
from flax import nnx
from numerics import assert_close, transformer

from flaxlm.models import hf
from flaxlm.models.gpt2 import GPT2LMHeadModel
from flaxlm.models.layers import TransformerSpec, count_params

CONFIG = model_config(name="t", vocab_size=97, max_positions=32, hidden_size=64, num_layers=2,
                      num_heads=4)


def make_model(config=CONFIG, **spec_kwargs):
    return GPT2LMHeadModel(TransformerSpec(config, **spec_kwargs), nnx.Rngs(0))


def token_ids(shape=(2, 32), vocab=97, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def test_parameter_names_and_shapes_follow_hf():
    params = nnx.to_pure_dict(nnx.state(make_model(), nnx.Param))
    flat = hf.to_hf_state_dict(params)
    assert flat["transformer.h.1.attn.c_attn.weight"].shape == (64, 192)  # Conv1D: (in, out)
    assert flat["transformer.h.0.mlp.c_fc.weight"].shape == (64, 256)
    assert flat["transformer.wte.weight"].shape == (97, 64)
    assert flat["transformer.ln_f.weight"].shape == (64,)
    assert sum(v.size for v in flat.values()) == count_params(make_model())


@pytest.mark.slow
def test_eval_mode_is_deterministic_and_train_mode_uses_dropout():
    model, ids = make_model(), jnp.asarray(token_ids())
    np.testing.assert_array_equal(model(ids), model(ids))
    train_a = model(ids, rngs=nnx.Rngs(dropout=1))
    train_b = model(ids, rngs=nnx.Rngs(dropout=2))
    assert not np.allclose(train_a, train_b)
    assert not np.allclose(train_a, model(ids))


@pytest.mark.slow
def test_causal_logits_do_not_see_the_future():
    model, ids = make_model(), token_ids()
    changed = ids.copy()
    changed[:, 20:] = (changed[:, 20:] + 1) % 97
    a, b = model(jnp.asarray(ids)), model(jnp.asarray(changed))
    assert_close(a[:, :20], b[:, :20], **transformer(CONFIG.num_layers, 4 * CONFIG.hidden_size))
    assert not np.allclose(a[:, 20:], b[:, 20:])


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_params():
    model = make_model(compute_dtype=jnp.bfloat16)
    logits = model(jnp.asarray(token_ids()))
    assert logits.dtype == jnp.bfloat16
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.float32)}


@pytest.mark.torch
def test_logits_match_pytorch_gpt2(tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    model = make_model()
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    config = hf.to_lm_config(CONFIG, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    hf.save_pretrained(str(tmp_path), params, config)
    torch_model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    ids = token_ids()
    with torch.no_grad():
        expected = torch_model(torch.from_numpy(ids)).logits.numpy()
    assert_close(np.asarray(model(jnp.asarray(ids))), expected,
                 **transformer(CONFIG.num_layers, 4 * CONFIG.hidden_size))
    assert json.loads((tmp_path / "config.json").read_text())["n_layer"] == 2


@pytest.mark.slow
def test_bfloat16_parameters_stay_bfloat16_through_training_and_the_loss_falls():
    """hardware.param_dtype=bfloat16: parameters (and AdamW moments) in bfloat16 train."""
    from flaxlm.parallel import global_batch, make_mesh, replicated
    from flaxlm.training.optimizer import make_optimizer, make_schedule
    from flaxlm.training.step import compile_steps, create_state

    optimizer = config_node("optimizer", lr=1e-3)
    schedule = make_schedule(optimizer, total_steps=4)
    tx = make_optimizer(optimizer, schedule)
    model = make_model(compute_dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    graphdef, state = create_state(model, tx)
    mesh = make_mesh(8)
    steps = compile_steps(mesh, graphdef, tx)
    state = jax.device_put(state, replicated(mesh))
    inputs = global_batch(token_ids((8, 32)).astype(np.int32), mesh)
    losses = []
    for _ in range(3):
        state, metrics = steps.train(state, inputs, jax.random.key(0))
        losses.append(float(metrics["loss"]))
    leaves = jax.tree.leaves(state.params)
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
