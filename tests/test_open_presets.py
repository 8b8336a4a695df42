"""Today's common open shapes: Llama 3's RoPE scaling (`rope_scaling.type=llama3`, which
llama3-8b and llama-1b use) and Qwen2's biases on q/k/v (`model.family=qwen2`), each against
transformers' PyTorch models: frequencies, logits, `model.init_from` of a checkpoint saved by
transformers and export back into it; the presets' settings and bad settings."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compose
from conftest import model_config as family_config
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st
from numerics import approx, assert_close, transformer
from omegaconf import OmegaConf

from flaxlm.config import ModelFamily, RopeScaling
from flaxlm.errors import FlaxlmError
from flaxlm.models import hf, pretrained
from flaxlm.models.build import abstract_network, build_classifier, build_lm
from flaxlm.models.layers import TransformerSpec
from flaxlm.models.llama import inverse_frequencies

BOS, EOS, PAD = 1, 2, 0
SHAPE = dict(name="t", vocab_size=97, max_positions=64, hidden_size=64, num_layers=2,
             num_heads=8, num_kv_heads=2, mlp_size=96, initializer_range=0.1)
# Head width 8 at theta 500000 gives wavelengths of 6, 167, 4443 and 118,000 tokens: with an
# original context of 256, the first is kept, the second interpolated, the others stretched.
LLAMA3 = RopeScaling("llama3", 8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_positions=256)
LLAMA_CONFIG = family_config("llama", **SHAPE, rope_theta=500000.0, rope_scaling=LLAMA3,
                             tie_word_embeddings=False)
QWEN2_CONFIG = family_config("qwen2", **SHAPE, rope_theta=1000000.0)
# Head width 8 at theta 10000 over an original context of 16 tokens: the four dimension pairs
# turn 2.5, 0.25, 0.025 and 0.0025 times, so with beta 2 and 0.05 the ramp crosses them.
YARN = RopeScaling("yarn", 4.0, original_max_positions=16, beta_fast=2.0, beta_slow=0.05)
BASE = {"llama": family_config("llama", name="x"), "qwen2": family_config("qwen2", name="x")}


def rotary(length: int) -> dict:
    """Settings for SHAPE's logits against transformers': 2 layers, an MLP of 96; a rotary
    angle is position × frequency, so a frequency's rounding comes back × the position."""
    return dict(**transformer(2, 96), amplification=length)


def token_ids(shape=(2, 24), seed=0):
    return np.random.default_rng(seed).integers(3, 97, shape)


def hf_rope(theta, scaling: RopeScaling):
    """HF's `rope_parameters` for a RoPE setting, written by hand (export writes its own)."""
    return {"rope_type": scaling.type, "rope_theta": theta, "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_positions}


def perturbed_torch(model, seed=0):
    """`model` with noise on every parameter: HF initialises biases to zero, and a zero bias
    would pass a comparison whatever was done with it."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model.eval()


def import_checkpoint(directory, family):
    """What `model.init_from=<directory>` builds: the config from config.json, then weights."""
    config = pretrained.pretrained_model_config(str(directory), BASE[family])
    model = abstract_network(lambda rngs: build_lm(TransformerSpec(config), rngs))
    report = pretrained.load_pretrained_weights(model, str(directory))
    assert not report.missing and not report.unexpected
    return config, model


def torch_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


# ---------------------------------------------------------------- llama3 RoPE scaling


@pytest.mark.torch
@pytest.mark.parametrize(("head_width", "theta", "scaling"), [
    (64, 500000.0, RopeScaling("llama3", 32.0)),  # Llama-3.2-1B's
    (128, 500000.0, RopeScaling("llama3", 8.0)),  # Llama-3.1-8B's
    (8, 500000.0, LLAMA3),
])
def test_llama3_frequencies_equal_transformers_for_the_published_models(head_width, theta,
                                                                        scaling):
    torch = pytest.importorskip("torch")
    assert torch  # transformers' rope functions compute in torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=head_width * 4, num_attention_heads=4,
                         max_position_embeddings=131072, rope_parameters=hf_rope(theta, scaling))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = inverse_frequencies(head_width, theta, scaling)
    # θ^(−2i/d) is exp of a number up to log θ: its rounding, times log θ, lands in the result.
    assert_close(ours, theirs.numpy(), depth=4, amplification=np.log(theta))
    unscaled = inverse_frequencies(head_width, theta, RopeScaling("default", 1.0))
    assert ours[0] == unscaled[0] and ours[-1] == approx(unscaled[-1] / scaling.factor, depth=2)


@pytest.mark.torch
@settings(max_examples=30, deadline=None)
@given(head_width=st.integers(1, 64).map(lambda half: 2 * half),
       theta=st.floats(100.0, 1e7), factor=st.floats(1.0, 64.0),
       low=st.floats(0.5, 4.0), gap=st.floats(0.5, 8.0),
       original=st.integers(16, 65536))
@example(head_width=110, theta=100.0, factor=12.0, low=3.203125, gap=0.5, original=55)
def test_llama3_frequencies_equal_transformers_for_any_setting(head_width, theta, factor, low,
                                                               gap, original):
    pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = RopeScaling("llama3", factor, low_freq_factor=low, high_freq_factor=low + gap,
                          original_max_positions=original)
    config = LlamaConfig(hidden_size=head_width * 2, num_attention_heads=2,
                         max_position_embeddings=2 * original,
                         rope_parameters=hf_rope(theta, scaling))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    # Float32 rounding apart (torch divides a scalar by a tensor as a reciprocal times it). An
    # interpolated frequency is the unscaled one times (1 - s) / factor + s, where s, computed
    # from the wavelength and divided by high - low (≥ 0.5 here), is off by a few units in the
    # last place of a number up to high: compared as fractions of the unscaled frequency, where
    # that error lands, not relative to the result, which can be factor times smaller.
    unscaled = inverse_frequencies(head_width, theta, RopeScaling("default", 1.0))
    assert_close(inverse_frequencies(head_width, theta, scaling) / unscaled,
                 theirs.numpy() / unscaled, depth=4, scale=1.0,
                 amplification=np.log(theta) * (low + gap) / gap)


@pytest.mark.torch
def test_a_llama3_scaled_checkpoint_from_transformers_imports_with_equal_logits(tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
        rope_parameters=hf_rope(500000.0, LLAMA3), tie_word_embeddings=False,
        initializer_range=0.1)
    theirs = perturbed_torch(transformers.LlamaForCausalLM(hf_config))
    theirs.save_pretrained(tmp_path)

    config, model = import_checkpoint(tmp_path, "llama")
    assert (config.rope_theta, config.rope_scaling) == (500000.0, LLAMA3)
    ids = token_ids((2, 48))
    expected = torch_logits(theirs, ids)
    assert_close(model(jnp.asarray(ids)), expected, **rotary(ids.shape[1]))
    # The scaling matters: the same weights with unscaled RoPE are another function.
    unscaled = dataclasses.replace(config, rope_scaling=RopeScaling("default", 1.0))
    other = nnx.merge(nnx.graphdef(build_lm(TransformerSpec(unscaled), nnx.Rngs(0))),
                      nnx.state(model))
    assert np.abs(np.asarray(other(jnp.asarray(ids))) - expected).max() > 1e-3


@pytest.mark.torch
def test_a_llama3_scaled_export_loads_in_transformers_with_equal_logits(tmp_path):
    pytest.importorskip("torch")
    import transformers

    model = build_lm(TransformerSpec(LLAMA_CONFIG), nnx.Rngs(1))
    hf_config = hf.to_lm_config(LLAMA_CONFIG, bos_token_id=BOS, eos_token_id=EOS,
                                pad_token_id=PAD)
    hf.save_pretrained(str(tmp_path), nnx.to_pure_dict(nnx.state(model, nnx.Param)), hf_config)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_parameters"] == hf_rope(500000.0, LLAMA3)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = token_ids((2, 48))
    assert_close(model(jnp.asarray(ids)), torch_logits(theirs, ids), **rotary(ids.shape[1]))
    # ... and it reads back as it was written.
    assert pretrained.pretrained_model_config(str(tmp_path), BASE["llama"]).rope_scaling == LLAMA3


def test_llama_3_2s_published_config_json_reads_as_llama_1b(tmp_path):
    """meta-llama/Llama-3.2-1B's config.json (transformers 4's `rope_scaling` form) gives the
    llama-1b preset's network and RoPE."""
    published = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "vocab_size": 128256,
    }
    (tmp_path / "config.json").write_text(json.dumps(published))
    loaded = pretrained.pretrained_model_config(str(tmp_path), BASE["llama"])
    preset = OmegaConf.to_object(compose(["model=llama-1b"])).model
    same = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "mlp_size",
            "rope_theta", "rope_scaling", "layer_norm_eps", "tie_word_embeddings", "family")
    assert {key: getattr(loaded, key) for key in same} == {key: getattr(preset, key)
                                                           for key in same}


@pytest.mark.parametrize(("scaling", "changes", "setting"), [
    ("llama3", dict(low_freq_factor=4.0, high_freq_factor=1.0),
     r"model\.rope_scaling\.low_freq_factor"),
    ("llama3", dict(low_freq_factor=0.0), r"model\.rope_scaling\.low_freq_factor"),
    ("llama3", dict(original_max_positions=0), r"model\.rope_scaling\.original_max_positions=0"),
    ("llama3", dict(factor=-2.0), r"model\.rope_scaling=\{type: llama3, factor: -2\.0\}"),
    ("yarn", dict(beta_fast=1.0, beta_slow=2.0), r"model\.rope_scaling\.beta_slow=2\.0"),
    ("yarn", dict(beta_slow=0.0), r"model\.rope_scaling\.beta_slow=0\.0"),
    ("yarn", dict(original_max_positions=0), r"model\.rope_scaling\.original_max_positions=0"),
    ("yarn", dict(attention_factor=-1.0), r"model\.rope_scaling\.attention_factor=-1\.0"),
    ("yarn", dict(factor=0.0), r"model\.rope_scaling=\{type: yarn, factor: 0\.0\}"),
])
def test_bad_rope_scaling_is_a_clear_error_naming_the_setting(scaling, changes, setting):
    base = {"llama3": (LLAMA_CONFIG, LLAMA3), "yarn": (QWEN2_CONFIG, YARN)}[scaling]
    config = dataclasses.replace(base[0], rope_scaling=dataclasses.replace(base[1], **changes))
    with pytest.raises(FlaxlmError, match=setting):
        build_lm(TransformerSpec(config), nnx.Rngs(0))


def test_llama3_scaling_is_set_from_the_command_line():
    overrides = ["model=llama-tiny", "model.rope_scaling.type=llama3",
                 "model.rope_scaling.factor=8", "model.rope_scaling.original_max_positions=256"]
    model = OmegaConf.to_object(compose(overrides)).model
    assert model.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 256)


# ---------------------------------------------------------------- YaRN


def hf_yarn(theta, scaling: RopeScaling) -> dict:
    """HF's `rope_parameters` for a yarn setting, written by hand (export writes its own)."""
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_positions,
            "beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow,
            "truncate": scaling.truncate}
    rope.update({name: getattr(scaling, name) for name in
                 ("attention_factor", "mscale", "mscale_all_dim")
                 if getattr(scaling, name) is not None})
    return rope


@pytest.mark.torch
@settings(max_examples=40, deadline=None)
@given(head_width=st.integers(1, 64).map(lambda half: 2 * half),
       theta=st.floats(100.0, 1e7), factor=st.floats(1.0, 64.0),
       beta_slow=st.floats(0.01, 4.0), gap=st.floats(0.5, 64.0),
       original=st.integers(16, 65536), truncate=st.booleans(),
       mscales=st.one_of(st.none(), st.tuples(st.floats(0.1, 2.0), st.floats(0.1, 2.0))))
@example(head_width=8, theta=10000.0, factor=4.0, beta_slow=0.05, gap=1.95, original=16,
         truncate=True, mscales=None)
def test_yarn_frequencies_and_attention_scale_equal_transformers_for_any_setting(
        head_width, theta, factor, beta_slow, gap, original, truncate, mscales):
    pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from flaxlm.models.llama import rope_attention_scale

    mscale, mscale_all_dim = mscales or (None, None)
    scaling = RopeScaling("yarn", factor, original_max_positions=original, beta_slow=beta_slow,
                          beta_fast=beta_slow + gap, truncate=truncate, mscale=mscale,
                          mscale_all_dim=mscale_all_dim)
    config = LlamaConfig(hidden_size=head_width * 2, num_attention_heads=2,
                         max_position_embeddings=int(factor * original),
                         rope_parameters=hf_yarn(theta, scaling))
    theirs, their_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    # Each frequency blends the kept and the stretched one: float32 rounding of θ^(-2i/H)
    # (its exponent up to log θ) and of the blend, as fractions of the unscaled frequency.
    unscaled = inverse_frequencies(head_width, theta, RopeScaling("default", 1.0))
    assert_close(inverse_frequencies(head_width, theta, scaling) / unscaled,
                 theirs.numpy() / unscaled, depth=4, scale=1.0, amplification=np.log(theta))
    assert rope_attention_scale(scaling) == approx(their_scale, depth=2)


@pytest.mark.torch
def test_a_yarn_qwen2_checkpoint_imports_and_exports_with_equal_logits_past_its_window(
        tmp_path):
    """A Qwen2 checkpoint with YaRN (transformers' PyTorch model, saved by it) imports with its
    scaling and gives transformers' logits at positions three times its original window; the
    export of it writes the same `rope_parameters` back, and transformers' logits again."""
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters=hf_yarn(10000.0, YARN), tie_word_embeddings=True,
        rms_norm_eps=1e-6, initializer_range=0.1)
    theirs = perturbed_torch(transformers.Qwen2ForCausalLM(hf_config))
    theirs.save_pretrained(tmp_path / "hf")

    config, model = import_checkpoint(tmp_path / "hf", "qwen2")
    assert (config.rope_theta, config.rope_scaling) == (10000.0, YARN)
    ids = token_ids((2, 48))  # 3 × the original 16 positions
    expected = torch_logits(theirs, ids)
    assert_close(model(jnp.asarray(ids)), expected, **rotary(ids.shape[1]))
    # Neither part of YaRN is idle here: plain linear scaling is another function.
    linear = dataclasses.replace(config, rope_scaling=RopeScaling("linear", YARN.factor))
    other = nnx.merge(nnx.graphdef(build_lm(TransformerSpec(linear), nnx.Rngs(0))),
                      nnx.state(model))
    assert np.abs(np.asarray(other(jnp.asarray(ids))) - expected).max() > 1e-3

    values = hf.lm_config_json(config, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    hf.save_pretrained(str(tmp_path / "out"), nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                       values)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["rope_parameters"] == hf_yarn(10000.0, YARN)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_close(model(jnp.asarray(ids)), torch_logits(again, ids), **rotary(ids.shape[1]))


def test_deepseeks_yarn_without_a_factor_takes_the_contexts_growth():
    """DeepSeek's checkpoints give YaRN's mscales and leave the factor to max_position_embeddings
    / original_max_position_embeddings, as transformers reads them."""
    from types import SimpleNamespace

    from flaxlm.models.llama import _rope_from_hf, rope_attention_scale

    config = SimpleNamespace(max_position_embeddings=163840, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    scaling = _rope_from_hf(config)["rope_scaling"]
    assert (scaling.factor, scaling.mscale, scaling.mscale_all_dim) == (40.0, 1.0, 1.0)
    assert rope_attention_scale(scaling) == 1.0  # equal mscales: no sharpening


def test_yarn_is_set_from_the_command_line():
    overrides = ["model=qwen2.5-0.5b", "model.rope_scaling.type=yarn",
                 "model.rope_scaling.factor=4", "model.rope_scaling.original_max_positions=32768"]
    model = OmegaConf.to_object(compose(overrides)).model
    assert model.rope_scaling == RopeScaling("yarn", 4.0, original_max_positions=32768)


# ---------------------------------------------------------------- Qwen2


@pytest.mark.torch
def test_a_qwen2_checkpoint_from_transformers_imports_with_equal_logits(tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True, rms_norm_eps=1e-6, initializer_range=0.1)
    theirs = perturbed_torch(transformers.Qwen2ForCausalLM(hf_config))
    theirs.save_pretrained(tmp_path)

    config, model = import_checkpoint(tmp_path, "llama")  # the checkpoint picks the family
    assert (config.family, config.qkv_bias, config.attention_bias, config.mlp_bias) == (
        ModelFamily.qwen2, True, False, False)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None
    ids = token_ids()
    assert_close(model(jnp.asarray(ids)), torch_logits(theirs, ids), **rotary(ids.shape[1]))


@pytest.mark.torch
def test_a_qwen2_export_loads_in_transformers_with_nothing_missing_and_equal_logits(tmp_path):
    pytest.importorskip("torch")
    import transformers

    model = build_lm(TransformerSpec(QWEN2_CONFIG), nnx.Rngs(1))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    rng = np.random.default_rng(0)  # q/k/v biases start at zero: make them count
    for layer in params["model"]["layers"].values():
        for name in ("q_proj", "k_proj", "v_proj"):
            bias = layer["self_attn"][name]["bias"]
            layer["self_attn"][name]["bias"] = rng.normal(0, 0.5, bias.shape).astype(np.float32)
    nnx.update(model, params)
    hf_config = hf.to_lm_config(QWEN2_CONFIG, bos_token_id=BOS, eos_token_id=EOS,
                                pad_token_id=PAD)
    hf.save_pretrained(str(tmp_path), params, hf_config)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == ("qwen2", ["Qwen2ForCausalLM"])
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True)
    assert type(theirs).__name__ == "Qwen2ForCausalLM"
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids = token_ids()
    assert_close(model(jnp.asarray(ids)), torch_logits(theirs.eval(), ids),
                 **rotary(ids.shape[1]))
    # ... and back: the same network, with the same parameters.
    config, again = import_checkpoint(tmp_path, "qwen2")
    assert config.qkv_bias and config.family is ModelFamily.qwen2
    np.testing.assert_array_equal(again(jnp.asarray(ids)), model(jnp.asarray(ids)))


@pytest.mark.torch
def test_a_qwen2_classifier_exports_as_qwen2s_with_equal_logits(tmp_path):
    pytest.importorskip("torch")
    import torch
    import transformers

    ours = build_classifier(TransformerSpec(QWEN2_CONFIG), 3, nnx.Rngs(1))
    hf_config = hf.to_classifier_config(QWEN2_CONFIG, num_labels=3, pad_token_id=PAD)
    hf.save_pretrained(str(tmp_path), nnx.to_pure_dict(nnx.state(ours, nnx.Param)), hf_config)
    theirs, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path, output_loading_info=True)
    assert type(theirs).__name__ == "Qwen2ForSequenceClassification"
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids, mask = token_ids((2, 12)), np.ones((2, 12), np.int64)
    with torch.no_grad():
        expected = theirs.eval()(torch.from_numpy(ids),
                                 attention_mask=torch.from_numpy(mask)).logits.numpy()
    assert_close(ours(jnp.asarray(ids), jnp.asarray(mask)), expected, **rotary(ids.shape[1]))


@pytest.mark.parametrize(("family", "changes", "message"), [
    ("qwen2", dict(qkv_bias=False), r"model\.family=qwen2 with model\.qkv_bias=False"),
    ("qwen2", dict(mlp_bias=True), r"model\.family=qwen2 .*model\.mlp_bias=True"),
    ("llama", dict(qkv_bias=True), r"model\.family=llama with model\.qkv_bias=True.*qwen2"),
])
def test_biases_a_familys_checkpoint_cannot_hold_are_a_clear_error(family, changes, message):
    config = dataclasses.replace(family_config(family, **SHAPE), **changes)
    with pytest.raises(FlaxlmError, match=message):
        build_lm(TransformerSpec(config), nnx.Rngs(0))


def test_a_qwen2_checkpoint_windowed_in_early_layers_only_is_a_clear_error(tmp_path):
    """flaxlm slides the window in the last layers (after model.full_attention_layers), as
    max_window_layers does; layer_types may say otherwise, and is then refused."""
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=64, num_attention_heads=8, num_hidden_layers=3, use_sliding_window=True,
        sliding_window=16, layer_types=["sliding_attention", "full_attention", "full_attention"])
    config.save_pretrained(tmp_path)
    with pytest.raises(FlaxlmError, match=r"sliding-window attention in layers \[0\] only"):
        pretrained.pretrained_model_config(str(tmp_path), BASE["qwen2"])


# ---------------------------------------------------------------- the presets


def test_the_presets_carry_their_published_settings():
    llama3 = OmegaConf.to_object(compose(["model=llama3-8b"])).model
    assert (llama3.rope_theta, llama3.rope_scaling, llama3.max_positions) == (
        500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), 131072)
    assert not llama3.tie_word_embeddings
    qwen = OmegaConf.to_object(compose(["model=qwen2.5-0.5b"])).model
    assert (qwen.family, qwen.qkv_bias, qwen.attention_bias, qwen.mlp_bias) == (
        ModelFamily.qwen2, True, False, False)
    assert (qwen.rope_theta, qwen.layer_norm_eps, qwen.tie_word_embeddings) == (1e6, 1e-6, True)
