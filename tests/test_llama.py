"""The Flax Llama against transformers' PyTorch Llama: logits (GQA, tied and untied, RoPE theta
and linear scaling), the classification head, export and import (sharded included), KV-cache
generation; bad settings; presets; and a tiny training run on 8 devices = 1 device."""

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    TINY,
    assert_same_params,
    compose,
    config_node,
    files_overrides,
    greedy_by_recomputing,
    mesh_config,
    metrics_of,
    stop_at,
    write_pairs,
)
from conftest import model_config as family_config
from flax import nnx
from numerics import assert_close, assert_trees_close, transformer, transformer_depth
from omegaconf import OmegaConf

from flaxlm.config import (
    ModelFamily,
    Remat,
    RopeScaling,
)
from flaxlm.errors import FlaxlmError
from flaxlm.generate import GenerationSettings, generate_ids
from flaxlm.models import hf, pretrained
from flaxlm.models.build import abstract_network, build_classifier, build_lm
from flaxlm.models.layers import TransformerSpec, count_params
from flaxlm.models.llama import LlamaForCausalLM

# 8 query heads sharing 2 key/value heads; init wider than 0.02 so that greedy paths differ.
CONFIG = family_config("llama", name="t", vocab_size=97, max_positions=64,
                     hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, mlp_size=96,
                     activation="silu", attention_dropout=0.0, initializer_range=0.1)
LLAMA_BASE = family_config("llama", name="x")  # what a checkpoint's config.json overwrites
VARIANTS = {
    "gqa-tied": CONFIG,
    "untied-theta-500000": dataclasses.replace(CONFIG, tie_word_embeddings=False,
                                               rope_theta=500000.0),
    "linear-rope-scaling": dataclasses.replace(CONFIG, rope_theta=5000.0,
                                               rope_scaling=RopeScaling("linear", 2.5)),
    "biases": dataclasses.replace(CONFIG, attention_bias=True, mlp_bias=True),
}
BOS, EOS, PAD = 1, 2, 0


def make_model(config=CONFIG, **spec_kwargs):
    return LlamaForCausalLM(TransformerSpec(config, **spec_kwargs), nnx.Rngs(0))


def perturbed(model, seed=1):
    """`model` with noise on every parameter, so zero-initialised biases and unit norm scales
    take part in a comparison too."""
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(model, jax.tree.unflatten(treedef, [
        leaf + 0.05 * jax.random.normal(key, leaf.shape) for leaf, key in zip(leaves, keys)]))
    return model


def params_of(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


# Logits against transformers' (float32 both): 2 layers, an MLP of 96, and rotary angles
# (position × frequency) that bring a frequency's rounding back × the position (up to 24).
AGAINST_TORCH = dict(**transformer(CONFIG.num_layers, CONFIG.mlp_size), amplification=24)


def token_ids(shape=(2, 24), vocab=97, seed=0):
    return np.random.default_rng(seed).integers(3, vocab, shape)


def export(model, config, directory):
    """Our model as an HF directory, the way `flaxlm.export` writes one."""
    hf_config = hf.to_lm_config(config, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    hf.save_pretrained(str(directory), params_of(model), hf_config)
    return str(directory)


def test_parameters_carry_hf_names_and_logical_axes():
    model = make_model(dataclasses.replace(CONFIG, tie_word_embeddings=False))
    flat = hf.to_hf_state_dict(params_of(model), "LlamaForCausalLM")
    assert flat["model.layers.1.self_attn.q_proj.weight"].shape == (64, 64)  # (out, in)
    assert flat["model.layers.1.self_attn.k_proj.weight"].shape == (16, 64)  # 2 heads of 8
    assert flat["model.layers.0.mlp.gate_proj.weight"].shape == (96, 64)
    assert flat["model.layers.0.post_attention_layernorm.weight"].shape == (64,)
    assert flat["lm_head.weight"].shape == (97, 64)
    assert "lm_head.weight" not in hf.to_hf_state_dict(params_of(make_model()),
                                                       "LlamaForCausalLM")  # tied
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = variable.get_metadata()["logical_axes"]
        assert len(names) == variable[...].ndim, path


def test_kv_cache_holds_only_the_key_value_heads():
    cache = make_model().init_cache(3, 10)
    assert cache.keys_BxSxGxH[0].shape == (3, 10, 2, 8)


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_params_and_norms():
    model = make_model(compute_dtype=jnp.bfloat16)
    logits = model(jnp.asarray(token_ids()))
    assert logits.dtype == jnp.bfloat16
    reference = make_model()(jnp.asarray(token_ids()))
    # bfloat16 rounds each stage's output once (the products are summed in float32): one
    # term per stage, bfloat16's epsilon.
    assert_close(np.asarray(logits, np.float32), reference, dtype=jnp.bfloat16,
                 depth=transformer_depth(CONFIG.num_layers))
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))} == {
        jnp.dtype(jnp.float32)}


@pytest.mark.slow
def test_remat_gives_the_same_gradients():
    ids = jnp.asarray(token_ids())

    def grads(remat):
        model = make_model(dataclasses.replace(CONFIG, remat=remat))
        return nnx.grad(lambda m: m(ids).astype(jnp.float32).mean())(model)

    assert_trees_close(nnx.to_pure_dict(grads(Remat.none)), nnx.to_pure_dict(grads(Remat.full)),
                       **transformer(CONFIG.num_layers, CONFIG.mlp_size, backward=True))


def test_bad_kv_heads_and_unsupported_rope_scaling_are_clear_errors():
    with pytest.raises(FlaxlmError, match=r"model\.num_kv_heads=3 must divide model\.num_heads=8"):
        make_model(dataclasses.replace(CONFIG, num_kv_heads=3))
    with pytest.raises(FlaxlmError, match=r"model\.rope_scaling=\{type: longrope"):
        make_model(dataclasses.replace(CONFIG, rope_scaling=RopeScaling("longrope", 4.0)))
    for override, message in (("model.num_kv_heads=3", r"model\.num_kv_heads=3"),
                              ("model.rope_scaling={type: dynamic, factor: 2}",
                               r"model\.rope_scaling=\{type: dynamic")):
        config = OmegaConf.to_object(compose(["model=llama-tiny", override]))
        with pytest.raises(FlaxlmError, match=message):
            build_lm(TransformerSpec(config.model), nnx.Rngs(0))


def test_rope_scaling_is_set_from_the_command_line():
    for overrides in (["model.rope_scaling={type: linear, factor: 4}"],
                      ["model.rope_scaling.type=linear", "model.rope_scaling.factor=4"]):
        config = OmegaConf.to_object(compose(["model=llama-tiny", *overrides]))
        assert config.model.rope_scaling == RopeScaling("linear", 4.0)


@pytest.mark.parametrize(("option", "num_params"), [
    ("smollm-135m", 134_515_008), ("llama-1b", 1_235_814_400), ("llama3-8b", 8_030_261_248),
    ("qwen2.5-0.5b", 494_032_768)])
def test_the_presets_build_the_published_networks(option, num_params):
    """The parameter counts of HuggingFaceTB/SmolLM-135M, meta-llama/Llama-3.2-1B,
    meta-llama/Llama-3.1-8B and Qwen/Qwen2.5-0.5B."""
    model_config = OmegaConf.to_object(compose([f"model={option}"])).model
    model = abstract_network(lambda rngs: build_lm(TransformerSpec(model_config), rngs))
    assert count_params(model) == num_params


def test_llama_tiny_is_about_gpt2_tiny_in_size():
    sizes = {}
    for option in ("gpt2-tiny", "llama-tiny"):
        model_config = OmegaConf.to_object(compose([f"model={option}"])).model
        model = abstract_network(lambda rngs, c=model_config: build_lm(TransformerSpec(c), rngs))
        sizes[option] = count_params(model)
    assert abs(sizes["llama-tiny"] / sizes["gpt2-tiny"] - 1) < 0.03


def test_training_flops_count_the_matrices_that_multiply_whether_tied_or_not():
    """An untied head is a matrix of its own and the token table then only a lookup, so tying
    changes the parameter count but not the FLOPs; GPT-2's position table never multiplies."""
    from flaxlm.models.build import lm_flops_per_token

    flops = {}
    for option, tied in (("llama-tiny", True), ("llama-tiny", False), ("gpt2-tiny", True)):
        model_config = OmegaConf.to_object(compose([f"model={option}"])).model
        model_config = dataclasses.replace(model_config, tie_word_embeddings=tied)
        model = abstract_network(lambda rngs, c=model_config: build_lm(TransformerSpec(c), rngs))
        flops[option, tied] = lm_flops_per_token(model_config, count_params(model), 256)
        if option == "gpt2-tiny":  # the tied head counts once; positions only look up
            matmul = count_params(model) - 256 * model_config.hidden_size
            assert flops[option, tied] == 6 * matmul + 12 * 6 * 256 * 256
    assert flops["llama-tiny", True] == flops["llama-tiny", False]


# ---------------------------------------------------------------- against PyTorch


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_loads_in_transformers_with_nothing_missing_and_equal_logits(variant, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    config = VARIANTS[variant]
    model = perturbed(make_model(config))
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        export(model, config, tmp_path), output_loading_info=True)
    assert type(theirs).__name__ == "LlamaForCausalLM"
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert theirs.config.num_key_value_heads == 2
    ids = token_ids()
    with torch.no_grad():
        expected = theirs.eval()(torch.from_numpy(ids)).logits.numpy()
    assert_close(model(jnp.asarray(ids)), expected, **AGAINST_TORCH)


@pytest.mark.torch
@pytest.mark.parametrize("shard", [False, True])
def test_hf_checkpoints_import_with_equal_logits(shard, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        tie_word_embeddings=False, rms_norm_eps=1e-6, initializer_range=0.1)
    theirs = transformers.LlamaForCausalLM(hf_config).eval()
    theirs.save_pretrained(tmp_path, **({"max_shard_size": "20KB"} if shard else {}))
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == shard

    model_config = pretrained.pretrained_model_config(str(tmp_path), LLAMA_BASE)
    assert (model_config.family, model_config.num_kv_heads, model_config.rope_theta) == (
        ModelFamily.llama, 2, 20000.0)
    model = abstract_network(lambda rngs: build_lm(TransformerSpec(model_config), rngs))
    report = pretrained.load_pretrained_weights(model, str(tmp_path))
    assert not report.missing and not report.unexpected
    ids = token_ids()
    with torch.no_grad():
        expected = theirs(torch.from_numpy(ids)).logits.numpy()
    assert_close(model(jnp.asarray(ids)), expected, **AGAINST_TORCH)


def test_a_classifier_starts_from_a_language_model_with_a_fresh_score(tmp_path):
    lm = make_model(VARIANTS["untied-theta-500000"])
    export(lm, VARIANTS["untied-theta-500000"], tmp_path)
    model_config = pretrained.pretrained_model_config(str(tmp_path), LLAMA_BASE)
    classifier = build_classifier(TransformerSpec(model_config), 2, nnx.Rngs(0))
    report = pretrained.load_pretrained_weights(classifier, str(tmp_path))
    assert (report.missing, report.unexpected) == (["score.weight"], ["lm_head.weight"])
    ids = jnp.asarray(token_ids())
    np.testing.assert_array_equal(classifier.model(ids, None), lm.hidden_states(ids))


def with_rope(directory, **rope_fields) -> str:
    """An exported checkpoint whose config.json states its RoPE as `rope_fields`."""
    export(make_model(), CONFIG, directory)
    raw = json.loads((directory / "config.json").read_text())
    del raw["rope_parameters"]
    (directory / "config.json").write_text(json.dumps({**raw, **rope_fields}))
    return str(directory)


def test_a_checkpoints_rope_settings_are_read_in_both_config_forms(tmp_path):
    for name, rope_fields in {
        "current": {"rope_parameters": {"rope_type": "linear", "rope_theta": 1234.0,
                                        "factor": 2.0}},
        "older": {"rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
    }.items():
        directory = with_rope(tmp_path / name, **rope_fields)
        model_config = pretrained.pretrained_model_config(directory, LLAMA_BASE)
        assert (model_config.rope_theta, model_config.rope_scaling) == (
            1234.0, RopeScaling("linear", 2.0))


def test_a_context_extension_keeps_the_runs_positions_in_place_of_the_checkpoints(tmp_path):
    """model.extend_context: the checkpoint (64 positions, plain RoPE at theta 10000) gives
    the shape, the run its longer context and YaRN; without it the checkpoint's positions
    win; an extension that would shorten the context is refused, naming both lengths."""
    directory = with_rope(tmp_path, rope_parameters={"rope_type": "default",
                                                     "rope_theta": 10000.0})
    yarn = RopeScaling("yarn", 4.0, original_max_positions=64)
    run = dataclasses.replace(LLAMA_BASE, max_positions=256, rope_theta=20000.0,
                              rope_scaling=yarn)
    extended = pretrained.pretrained_model_config(
        directory, dataclasses.replace(run, extend_context=True))
    assert (extended.max_positions, extended.rope_theta, extended.rope_scaling) == (
        256, 20000.0, yarn)
    assert (extended.hidden_size, extended.num_kv_heads) == (64, 2)  # the checkpoint's shape
    as_trained = pretrained.pretrained_model_config(directory, run)
    assert (as_trained.max_positions, as_trained.rope_scaling.type) == (64, "default")
    with pytest.raises(FlaxlmError, match="max_positions=32, but the checkpoint .* 64 pos"):
        pretrained.pretrained_model_config(directory, dataclasses.replace(
            run, max_positions=32, extend_context=True))


def test_an_unsupported_rope_type_in_a_checkpoint_is_a_clear_error(tmp_path):
    directory = with_rope(tmp_path, rope_parameters={"rope_type": "dynamic",
                                                     "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(FlaxlmError, match="rope_type='dynamic'"):
        pretrained.pretrained_model_config(directory, LLAMA_BASE)


@pytest.mark.slow
@pytest.mark.torch
def test_classifier_equals_transformers_on_right_padded_rows(tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    config = VARIANTS["untied-theta-500000"]
    ours = perturbed(build_classifier(TransformerSpec(config), 3, nnx.Rngs(1)))
    hf_config = hf.to_classifier_config(config, num_labels=3, pad_token_id=PAD)
    hf.save_pretrained(str(tmp_path), params_of(ours), hf_config)
    theirs, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path, output_loading_info=True)
    assert type(theirs).__name__ == "LlamaForSequenceClassification"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, lengths = token_ids((3, 12)), [12, 7, 1]
    mask = np.arange(12)[None] < np.asarray(lengths)[:, None]
    ids = np.where(mask, ids, PAD)  # right-padded, with the pad id HF looks for
    with torch.no_grad():
        expected = theirs.eval()(torch.from_numpy(ids),
                                 attention_mask=torch.from_numpy(mask.astype(np.int64))).logits
    got = ours(jnp.asarray(ids), jnp.asarray(mask.astype(np.int32)))
    assert_close(got, expected.numpy(), **AGAINST_TORCH)


# ---------------------------------------------------------------- generation

PROMPTS = [np.random.default_rng(n).integers(3, 97, n).tolist() for n in (3, 9, 1, 14)]
NEW_TOKENS = 8


@pytest.mark.slow
@pytest.mark.torch
def test_greedy_kv_cache_generation_equals_recomputation_and_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    config = VARIANTS["untied-theta-500000"]
    model = make_model(config)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, greedy=True)
    ours = generate_ids(model, PROMPTS, settings, eos_token_id=EOS, pad_token_id=PAD)
    assert ours == [greedy_by_recomputing(model, prompt, NEW_TOKENS, CONFIG.max_positions, EOS)
                    for prompt in PROMPTS]
    assert len({tuple(row) for row in ours}) > 1  # the prompts lead to different paths

    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        export(model, config, tmp_path)).eval()
    width = max(map(len, PROMPTS))
    ids = np.full((len(PROMPTS), width), PAD)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(PROMPTS):  # left-padded, as transformers generates a batch
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    with torch.no_grad():
        out = theirs.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                              do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                              eos_token_id=EOS)
    expected = []
    for row in out[:, width:].tolist():
        expected.append(row[: row.index(EOS)] if EOS in row else row)
    assert ours == expected


# ---------------------------------------------------------------- training


def train_steps(mesh_config, num_steps=3):
    """Three clm steps of a tiny llama on 8 devices laid out as `mesh_config`: the losses and
    the kernel of a key projection (split over `tensor` by its "kv_heads" axis)."""
    from flaxlm.parallel import global_batch, make_mesh
    from flaxlm.training.optimizer import make_optimizer, make_schedule
    from flaxlm.training.step import compile_steps, create_state

    optimizer = config_node("optimizer", lr=1e-3)
    mesh = make_mesh(8, mesh_config)
    schedule = make_schedule(optimizer, total_steps=10)
    tx = make_optimizer(optimizer, schedule)
    config = dataclasses.replace(CONFIG, max_positions=16, attention_dropout=0.1)  # dropout on
    graphdef, state = create_state(make_model(config), tx, mesh)
    steps = compile_steps(mesh, graphdef, tx)
    losses = []
    for step in range(num_steps):
        batch = np.random.default_rng(step).integers(0, 97, (16, 16)).astype(np.int32)
        state, metrics = steps.train(state, global_batch(batch, mesh), jax.random.key(step))
        losses.append(float(metrics["loss"]))
    return losses, state.params["model"]["layers"][0]["self_attn"]["k_proj"]["kernel"]


@pytest.mark.slow
def test_fsdp_and_tensor_parallel_meshes_train_a_llama_like_data_parallelism():
    reference, _ = train_steps(mesh_config(data=8))
    for mesh, spec in ((mesh_config(data=2, tensor=4), (None, "tensor")),
                       (mesh_config(data=1, fsdp=8), ("fsdp",))):
        losses, kernel = train_steps(mesh)
        # 3 steps of the same sums over 16 × 16 tokens, split over the devices otherwise.
        assert_close(losses, reference, terms=16 * 16,
                     depth=3 * transformer_depth(CONFIG.num_layers, backward=True))
        assert tuple(kernel.sharding.spec) == spec



# A tiny llama-tiny run on 8 devices (2 rows each), dropout on, with a checkpoint at step 4 and
# an evaluation at step 3 (of 6 validation documents: 15 batches, not 47): the run the 1-device
# run, the resumed run and the classifier are compared with or start from.
LLAMA_RUN = ["model=llama-tiny", *TINY, "model.num_heads=8", "model.num_kv_heads=2",
             "model.mlp_size=96", "model.attention_dropout=0.1", "hardware.num_devices=8",
             "trainer.max_steps=6", "trainer.log_every_steps=1", "trainer.eval_every_steps=3",
             "checkpoint.every_steps=4", "language.max_train_docs=60",
             "language.max_eval_docs=6", "optimizer.lr=3e-3"]


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    from conftest import trained_run

    return trained_run(tmp_path_factory, "llama-8-devices", LLAMA_RUN)


def losses_of(run_dir, key):
    return [record[key] for record in metrics_of(run_dir) if key in record]


@pytest.mark.slow
def test_a_tiny_llama_trains_the_same_on_8_devices_as_on_1(llama_run, tmp_path):
    """The clm task end to end (`train(cfg)`) with model=llama-tiny, shrunk: the global batch
    of 16 rows on 8 devices of 2 and on 1 device of 16 gives the same losses, dropout
    included."""
    from flaxlm.job import train

    run_dir = tmp_path / "devices-1"
    final = train(compose([*LLAMA_RUN, "hardware.num_devices=1",
                           "hardware.per_device_batch_size=16"], run_dir=run_dir))
    assert math.isfinite(final)
    for run in (llama_run, run_dir):
        assert (run / "model" / "model.safetensors").exists()
    train_8, train_1 = losses_of(llama_run, "train/loss"), losses_of(run_dir, "train/loss")
    eval_8, eval_1 = losses_of(llama_run, "eval/loss"), losses_of(run_dir, "eval/loss")
    assert len(train_8) == 6 and len(eval_8) >= 2  # before training (or at step 3) and after
    # 6 steps of the same sums over a batch of 16 rows, split over the devices otherwise.
    settings = dict(terms=16 * 64, depth=6 * transformer_depth(CONFIG.num_layers, backward=True))
    assert_close(train_8, train_1, **settings)
    assert_close(eval_8, eval_1, **settings)


@pytest.mark.slow
def test_a_stopped_llama_run_resumes_to_the_same_parameters_and_metrics(llama_run, tmp_path,
                                                                         monkeypatch):
    from flaxlm.job import train
    from flaxlm.training.stop import Preempted

    with monkeypatch.context() as patch:
        stop_at(patch, 3)
        with pytest.raises(Preempted):
            train(compose(LLAMA_RUN, run_dir=tmp_path / "run"))
    train(compose(LLAMA_RUN, run_dir=tmp_path / "run"))
    assert metrics_of(tmp_path / "run") == metrics_of(llama_run)
    assert_same_params(tmp_path / "run", llama_run)


@pytest.mark.slow
def test_a_llama_pretrained_here_finetunes_as_a_classifier(llama_run, tmp_path):
    """task=classify with model=llama-tiny from a task=clm run's exported model/."""
    from flaxlm.job import train

    pairs = (write_pairs(tmp_path / "train.tsv", 64, 0),
             write_pairs(tmp_path / "validation.tsv", 16, 1))
    run_dir = tmp_path / "classify"
    train(compose(["task=classify", "model=llama-tiny", f"model.init_from={llama_run}/model",
                   *TINY, "model.num_heads=8", "model.num_kv_heads=2", "model.mlp_size=96",
                   "task.max_seq_length=24", "task.text_pair_column=sentence2",
                   *files_overrides(pairs), "trainer.max_steps=4"], run_dir=run_dir))
    assert "eval/accuracy" in (run_dir / "metrics.jsonl").read_text()
    saved = json.loads((run_dir / "model" / "config.json").read_text())
    assert (saved["architectures"], saved["num_key_value_heads"]) == (
        ["LlamaForSequenceClassification"], 2)
