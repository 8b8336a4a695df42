"""Mixture-of-Experts models in and out of transformers: Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE
checkpoints saved by transformers' PyTorch classes load (per expert, or fused as transformers 5
holds them; scanned or unrolled) with transformers' logits; what we export loads back in
transformers with ours; cached decoding equals the full forward pass; LoRA trains the
attention's adapters only; the presets are the released shapes; what no family holds is
refused in one paragraph naming the setting."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, config_node, greedy_by_recomputing, mesh_config, trained_run
from flax import nnx
from numerics import assert_close, tolerance, transformer_depth

from flaxlm.config import LoraConfig, ModelFamily, MoeConfig, QKNorm
from flaxlm.errors import FlaxlmError
from flaxlm.generate import GenerationSettings, generate_ids
from flaxlm.models import hf, pretrained
from flaxlm.models.build import abstract_network, build_lm
from flaxlm.models.layers import TransformerSpec, count_params

BOS, EOS, PAD = 1, 2, 0
VOCAB, WIDTH, LAYERS, EXPERTS, TOP_K = 97, 32, 2, 4, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=48,
              num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
              initializer_range=0.1, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
              num_experts_per_tok=TOP_K)
# Each family's own settings: Qwen3-MoE renormalises its top-k; Qwen2-MoE has a shared
# expert and here a dense first layer (mlp_only_layers); Mixtral and OLMoE size their experts
# by intermediate_size.
HF_CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=EXPERTS, moe_intermediate_size=24,
                                         norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=EXPERTS, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=40,
                                         mlp_only_layers=[0])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=EXPERTS)),
    "olmoe": ("OlmoeConfig", dict(num_experts=EXPERTS)),
}
# What a checkpoint's config.json overwrites: a dense preset, so that every expert setting
# the test sees comes from the checkpoint.
BASE = config_node("model", ["model=llama-tiny"])
IDS = np.random.default_rng(0).integers(3, VOCAB, (2, 16))
# Logits computed by transformers and by us (float32 both): per layer the transformer's
# stages plus the router's matmul, its softmax and the weighted sum of the experts; the widest
# reduction the MLP's 48; rotary angles bring a frequency's rounding back × the position (16).
AGAINST_TORCH = dict(terms=48, depth=transformer_depth(LAYERS) + 3 * LAYERS, amplification=16)


def torch_checkpoint(family: str, directory, fused: bool = False):
    """A random-initialised tiny `family` model of transformers', saved in `directory` (in
    transformers 5's fused expert layout if `fused`), and the model."""
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    class_name, own = HF_CONFIGS[family]
    config = getattr(transformers, class_name)(**COMMON, **own)
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    theirs.save_pretrained(directory, save_original_format=not fused)
    return theirs


def torch_logits(theirs, ids=IDS, width=WIDTH):
    """transformers' logits, after checking that no token's top-k choice is a near tie: a
    choice that float32's rounding could flip would route a token to other experts in the
    two implementations, and the logits would differ for a reason that is no error."""
    import torch

    with torch.no_grad():
        out = theirs(torch.from_numpy(ids), output_router_logits=True)
    for router_logits in out.router_logits:
        logits_TxE = router_logits.numpy().astype(np.float64)
        probs_TxE = np.exp(logits_TxE - logits_TxE.max(-1, keepdims=True))
        probs_TxE /= probs_TxE.sum(-1, keepdims=True)
        sorted_TxE = -np.sort(-probs_TxE, axis=-1)
        margin = float((sorted_TxE[:, TOP_K - 1] - sorted_TxE[:, TOP_K]).min())
        # Each of the two probabilities may move by the rounding of every stage before the
        # router, relative to the largest probability (at most 1): apart by more, no flip.
        assert margin > 2 * tolerance(terms=width, depth=transformer_depth(LAYERS)), margin
    return out.logits.numpy()


def imported(directory, scan: bool = False):
    model_config = dataclasses.replace(
        pretrained.pretrained_model_config(str(directory), BASE), scan_layers=scan)
    model = build_lm(TransformerSpec(model_config), nnx.Rngs(0))
    report = pretrained.load_pretrained_weights(model, str(directory))
    assert not report.missing and not report.unexpected
    return model, model_config


def params_of(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def perturbed(model, seed=1):
    """`model` with noise on every parameter, so that an export copies what we hold, not
    bytes it read (and the unit norm scales take part too)."""
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    nnx.update(model, jax.tree.unflatten(treedef, [
        leaf + 0.02 * rng.standard_normal(leaf.shape).astype(np.float32) for leaf in leaves]))
    return model


@pytest.mark.torch
@pytest.mark.parametrize("family,scan,fused", [
    ("qwen3_moe", True, False),
    pytest.param("qwen2_moe", False, False, marks=pytest.mark.slow),  # its shared expert: 12 s
    ("mixtral", True, True),
    ("olmoe", False, True)])
def test_transformers_checkpoints_import_with_equal_logits(family, scan, fused, tmp_path):
    theirs = torch_checkpoint(family, tmp_path, fused)
    keys = set(json.loads((tmp_path / "model.safetensors").read_bytes()[
        8:8 + int.from_bytes((tmp_path / "model.safetensors").read_bytes()[:8], "little")]))
    assert any(".experts.gate_up_proj" in key for key in keys) == fused
    model, model_config = imported(tmp_path, scan)
    assert model_config.family is ModelFamily(family)
    settings = model_config.moe
    assert (settings.num_experts, settings.top_k) == (EXPERTS, TOP_K)
    assert settings.normalize_top_k == (family in ("qwen3_moe", "mixtral"))
    assert settings.first_dense_layers == (1 if family == "qwen2_moe" else 0)
    assert settings.shared_expert_size == (40 if family == "qwen2_moe" else None)
    assert model_config.qk_norm is {"qwen3_moe": QKNorm.head,
                                    "olmoe": QKNorm.width}.get(family, QKNorm.none)
    assert_close(model(jnp.asarray(IDS)), torch_logits(theirs), **AGAINST_TORCH)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("family,scan", [("qwen3_moe", False), ("qwen2_moe", False),
                                         ("mixtral", False), ("olmoe", True)])
def test_exports_load_in_transformers_with_nothing_missing_and_equal_logits(family, scan,
                                                                            tmp_path):
    import transformers

    torch_checkpoint(family, tmp_path / "theirs")
    model, model_config = imported(tmp_path / "theirs", scan)
    perturbed(model)
    hf_config = hf.to_lm_config(model_config, bos_token_id=BOS, eos_token_id=EOS,
                                pad_token_id=PAD)
    hf.save_pretrained(str(tmp_path / "ours"), params_of(model), hf_config)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", output_loading_info=True)
    assert type(theirs).__name__ == hf_config.architectures[0]
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert_close(model(jnp.asarray(IDS)), torch_logits(theirs.eval()), **AGAINST_TORCH)


def test_mixtral_is_written_under_its_own_names_and_experts_one_by_one():
    model_config = dataclasses.replace(
        config_node("model", ["model=mixtral-8x7b"], vocab_size=VOCAB, hidden_size=WIDTH,
                    num_layers=LAYERS, num_heads=4, num_kv_heads=2, mlp_size=48,
                    max_positions=64, scan_layers=True),
        moe=dataclasses.replace(config_node("model", ["model=mixtral-8x7b"]).moe,
                                num_experts=EXPERTS))
    model = build_lm(TransformerSpec(model_config), nnx.Rngs(0))
    tensors = hf.to_hf_state_dict(params_of(model), "MixtralForCausalLM")
    w1 = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    assert tensors[w1].shape == (48, WIDTH)  # (out, in), as an nn.Linear
    gate_ExDxF = np.asarray(model.model.layers.mlp.experts.gate_proj[...])
    np.testing.assert_array_equal(tensors[w1], gate_ExDxF[1, 3].T)  # layer 1, expert 3
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"].shape == (EXPERTS, WIDTH)
    assert not any(".mlp." in key or "gate_proj" in key for key in tensors)


def moe_model(option="moe-tiny", **changes):
    """A small model of `option`'s family: 2 layers of width 32, 4 experts."""
    model_config = config_node("model", [f"model={option}"], vocab_size=VOCAB,
                               hidden_size=WIDTH, num_layers=LAYERS, num_heads=4,
                               num_kv_heads=2, mlp_size=48, max_positions=64,
                               initializer_range=0.1, **changes)
    return dataclasses.replace(model_config, moe=dataclasses.replace(
        model_config.moe, num_experts=EXPERTS, expert_mlp_size=24))


PROMPTS = [np.random.default_rng(n).integers(3, VOCAB, n).tolist() for n in (3, 9, 1, 14)]


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_cached_greedy_generation_equals_recomputing_the_whole_sequence(scan):
    model = build_lm(TransformerSpec(moe_model(scan_layers=scan)), nnx.Rngs(0))
    settings = GenerationSettings(max_new_tokens=6, greedy=True)
    ours = generate_ids(model, PROMPTS, settings, eos_token_id=EOS, pad_token_id=PAD)
    assert ours == [greedy_by_recomputing(model, prompt, 6, 32, EOS) for prompt in PROMPTS]
    assert len({tuple(row) for row in ours}) > 1  # the prompts lead to different paths


@pytest.mark.slow  # several seconds: make test runs it
def test_lora_on_an_moe_model_trains_the_attention_adapters_only():
    import optax

    from flaxlm.parallel import make_mesh
    from flaxlm.training.optimizer import make_optimizer
    from flaxlm.training.step import compile_train_step, create_state

    model_config = dataclasses.replace(moe_model(), lora=LoraConfig(rank=4, alpha=8.0))
    model = build_lm(TransformerSpec(model_config), nnx.Rngs(0))
    adapted = {path[-3] for path, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    mesh = make_mesh(1, mesh_config(data=1))
    tx = make_optimizer(config_node("optimizer", ["optimizer=adamw"], lr=1e-2),
                        optax.constant_schedule(1e-2))
    graphdef, state = create_state(model, tx, mesh, nnx.LoRAParam)
    before = jax.device_get(state.params)
    train = compile_train_step(mesh, graphdef, tx, trainable=nnx.LoRAParam)
    for step in range(2):
        state, metrics = train(state, jnp.asarray(IDS[:1]), jax.random.key(step))
        assert np.isfinite(float(metrics["loss"]))
    after = jax.device_get(state.params)
    for (path, old), (_, new) in zip(nnx.to_flat_state(before), nnx.to_flat_state(after),
                                     strict=True):
        if isinstance(old, nnx.LoRAParam):
            assert not np.array_equal(old[...], new[...]), path
        else:  # the experts, the router and the attention's own weights: bitwise frozen
            assert np.array_equal(old[...], new[...]), path


@pytest.mark.parametrize("option,total,active", [
    ("olmoe-1b-7b", 6_919_161_856, 1_282_017_280),
    ("qwen1.5-moe-a2.7b", 14_315_784_192, 2_689_173_504),
    pytest.param("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704,
                 marks=pytest.mark.slow),  # 48 layers of 128 experts: 4 s to trace
    ("mixtral-8x7b", 46_702_792_704, 12_879_925_248)])
def test_the_presets_build_the_released_networks(option, total, active):
    """The parameter counts of allenai/OLMoE-1B-7B-0924 (6.9B, 1.3B active),
    Qwen/Qwen1.5-MoE-A2.7B (14.3B, 2.7B), Qwen/Qwen3-30B-A3B
    (30.5B, 3.3B) and mistralai/Mixtral-8x7B-v0.1 (46.7B, 12.9B), as transformers' classes
    count them for the HF config we export (PyTorch's meta device: no memory)."""
    from flaxlm.models import moe

    model_config = config_node("model", [f"model={option}"])
    model = abstract_network(lambda rngs: build_lm(TransformerSpec(model_config), rngs))
    assert count_params(model) == total
    assert moe.num_active_params(model_config, total) == active


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("option", ["moe-small", "olmoe-1b-7b", "qwen1.5-moe-a2.7b",
                                    "qwen3-30b-a3b", "mixtral-8x7b"])
def test_transformers_counts_the_presets_exported_config_as_we_do(option):
    import torch
    import transformers

    model_config = config_node("model", [f"model={option}"])
    hf_config = hf.to_lm_config(model_config, bos_token_id=BOS, eos_token_id=EOS,
                                pad_token_id=PAD)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(hf_config)
    model = abstract_network(lambda rngs: build_lm(TransformerSpec(model_config), rngs))
    assert sum(p.numel() for p in theirs.parameters()) == count_params(model)


MOE_RUN = ["model=moe-tiny", *TINY, "model.moe.num_experts=4", "model.moe.expert_mlp_size=32",
           "trainer.max_steps=2", "trainer.eval_before_training=false",
           "language.max_train_docs=20", "language.max_eval_docs=4"]


@pytest.mark.slow
@pytest.mark.torch
def test_an_moe_runs_end_of_run_export_loads_in_transformers_with_its_logits(tmp_path_factory):
    """`flaxlm-train model=moe-tiny` (on 8 devices, the dispatch per device) ends with an HF
    export that transformers loads, nothing missing, with the logits of the run's checkpoint."""
    import transformers

    from flaxlm.run_model import load_run_model

    run_dir = trained_run(tmp_path_factory, "moe-tiny", MOE_RUN)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        run_dir / "model", output_loading_info=True)
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ours = load_run_model(str(run_dir)).model()
    ids = np.random.default_rng(0).integers(3, 512, (2, 16))
    expected = torch_logits(theirs.eval(), ids, width=64)
    # 2 layers of width 64, an MLP (expert) of 32, the vocabulary of 512 the widest reduction.
    assert_close(ours(jnp.asarray(ids)), expected, terms=512,
                 depth=transformer_depth(2) + 3 * 2, amplification=16)


# ---------------------------------------------------------------- bad input


def edited(directory, **fields):
    """The checkpoint in `directory` with its config.json's `fields` changed."""
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return str(directory)


@pytest.mark.torch
@pytest.mark.parametrize("family,fields,named", [
    ("qwen3_moe", {"decoder_sparse_step": 3}, "decoder_sparse_step=3"),  # no experts left
    ("qwen2_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
    ("mixtral", {"sliding_window": 16}, "sliding_window=16"),
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=true"),
])
def test_checkpoint_variants_we_cannot_hold_are_named(family, fields, named, tmp_path):
    torch_checkpoint(family, tmp_path)
    with pytest.raises(FlaxlmError, match="does not implement") as error:
        pretrained.pretrained_model_config(edited(tmp_path, **fields), BASE)
    assert named in str(error.value)


@pytest.mark.parametrize("option,changes,named", [
    ("mixtral-8x7b", {"shared_expert_size": 16}, "model.moe.shared_expert_size=16"),
    ("mixtral-8x7b", {"normalize_top_k": False}, "model.moe.normalize_top_k=false"),
    ("olmoe-1b-7b", {"first_dense_layers": 1}, "model.moe.first_dense_layers=1"),
    ("moe-tiny", {"shared_expert_size": 16}, "model.family=qwen2_moe has one"),
])
def test_a_model_its_family_cannot_hold_is_refused_when_its_hf_config_is_made(
        option, changes, named):
    model_config = config_node("model", [f"model={option}"])
    model_config = dataclasses.replace(model_config,
                                       moe=dataclasses.replace(model_config.moe, **changes))
    with pytest.raises(FlaxlmError, match="cannot hold this model") as error:
        hf.to_lm_config(model_config, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    assert named in str(error.value)


def test_qwen2_moe_needs_its_shared_expert_and_olmoe_its_qk_norm():
    qwen2 = dataclasses.replace(moe_model(), family=ModelFamily.qwen2_moe, qkv_bias=True,
                                qk_norm=QKNorm.none)
    with pytest.raises(FlaxlmError, match="model.moe.shared_expert_size is not set"):
        hf.to_lm_config(qwen2, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    olmoe = dataclasses.replace(moe_model(), family=ModelFamily.olmoe)
    with pytest.raises(FlaxlmError, match=r"model.qk_norm=head.*model.qk_norm=width"):
        hf.to_lm_config(olmoe, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def test_the_loss_free_balancing_bias_is_refused_on_export_and_fresh_on_import(tmp_path):
    model_config = dataclasses.replace(moe_model(), moe=dataclasses.replace(
        moe_model().moe, bias_update_rate=1e-3))
    model = build_lm(TransformerSpec(model_config), nnx.Rngs(0))
    with pytest.raises(FlaxlmError, match="model.moe.bias_update_rate"):
        hf.to_hf_state_dict(params_of(model), "Qwen3MoeForCausalLM")
    plain = build_lm(TransformerSpec(dataclasses.replace(model_config, moe=dataclasses.replace(
        model_config.moe, bias_update_rate=0.0))), nnx.Rngs(1))
    hf_config = hf.to_lm_config(model_config, bos_token_id=BOS, eos_token_id=EOS,
                                pad_token_id=PAD)
    hf.save_pretrained(str(tmp_path), params_of(plain), hf_config)
    report = pretrained.load_pretrained_weights(model, str(tmp_path))
    assert not report.missing and not report.unexpected
    np.testing.assert_array_equal(model.model.layers[0].mlp.router_bias[...], 0.0)
    np.testing.assert_array_equal(model.model.layers[1].mlp.gate.kernel[...],
                                  plain.model.layers[1].mlp.gate.kernel[...])


def test_a_dense_checkpoint_into_an_moe_preset_turns_the_experts_off(tmp_path):
    llama = config_node("model", ["model=llama-tiny"], num_layers=2, hidden_size=32,
                        num_heads=4, vocab_size=VOCAB)
    hf.save_pretrained(str(tmp_path), params_of(build_lm(TransformerSpec(llama), nnx.Rngs(0))),
                       hf.to_lm_config(llama, bos_token_id=BOS, eos_token_id=EOS,
                                       pad_token_id=PAD))
    loaded = pretrained.pretrained_model_config(str(tmp_path),
                                                config_node("model", ["model=moe-tiny"]))
    assert (loaded.family, loaded.moe.num_experts, loaded.qk_norm) == (
        ModelFamily.llama, None, QKNorm.none)
    assert loaded.moe == dataclasses.replace(config_node("model", ["model=moe-tiny"]).moe,
                                             num_experts=None)
    assert isinstance(loaded.moe, MoeConfig)
