"""model.lora: adapters on a frozen base. The adapted model starts as its base and
`adapters_disabled` gives the base back exactly; a train step changes the adapters only and
keeps optimizer state for them only; merging folds them into the weights without changing
the logits; a run's checkpoints hold only what trains, resume exactly, and refuse a changed
base; the run exports a merged HF model and a PEFT adapter that transformers and PEFT load
with flaxlm's logits."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, assert_resumes_as_never_stopped, compose, config_node, mesh_config
from flax import nnx
from numerics import assert_close, transformer

from flaxlm.config import LoraConfig
from flaxlm.errors import FlaxlmError
from flaxlm.models import lora, peft
from flaxlm.models.build import build_lm, lm_from_params
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import make_mesh
from flaxlm.training.optimizer import make_optimizer
from flaxlm.training.step import compile_train_step, create_state

OPTIONS = {"llama": "llama-tiny", "gpt2": "gpt2-tiny"}
INPUTS_BxL = (jnp.arange(2 * 12).reshape(2, 12) * 7) % 200
# tiny_model's logits computed two ways (an adapter beside a kernel or merged into it, ours
# or transformers'/peft's): 2 layers, the vocabulary of 256 the widest reduction, and rotary
# angles (position × frequency) that bring a frequency's rounding back × the position (12).
LOGITS = dict(**transformer(2, 256), amplification=12)


def tiny_model(family: str, rank: int | None = 4, **lora_settings):
    model = config_node("model", [f"model={OPTIONS[family]}"], num_layers=2, hidden_size=32,
                        num_heads=4, vocab_size=256, max_positions=32, mlp_size=64)
    return dataclasses.replace(model, lora=LoraConfig(rank=rank, **lora_settings))


def built(model_config, seed: int = 0):
    return build_lm(TransformerSpec(model_config), nnx.Rngs(params=seed))


@nnx.jit
def logits(model, input_ids_BxL):
    return model(input_ids_BxL)


def randomised_adapters(model, seed: int = 1):
    """`model` with every adapter's B drawn at random (a fresh B is zero: no effect at all)."""
    rng = np.random.default_rng(seed)  # numpy: no compile per shape, as jax.random would
    state = nnx.state(model, nnx.LoRAParam)
    nnx.update(model, jax.tree.map(
        lambda p: jnp.asarray(0.1 * rng.standard_normal(p.shape), p.dtype), state))
    return model


@pytest.mark.parametrize("family", list(OPTIONS))
def test_adapters_start_as_the_base_and_switch_off_exactly(family):
    base = built(tiny_model(family, rank=None))
    adapted = built(tiny_model(family))
    # Adding adapters leaves the random init of the base weights as it is.
    assert jax.tree.all(jax.tree.map(np.array_equal, nnx.to_pure_dict(nnx.state(base)),
                                     lora.merged_params(nnx.to_pure_dict(nnx.state(adapted)),
                                                        0.0)))
    base_logits = np.asarray(logits(base, INPUTS_BxL))
    # B = 0: the base's logits, up to the order in which the compiled sum adds its terms.
    assert_close(np.asarray(logits(adapted, INPUTS_BxL)), base_logits, **transformer(2, 256))
    randomised_adapters(adapted)
    assert not np.allclose(np.asarray(logits(adapted, INPUTS_BxL)), base_logits, atol=1e-3)
    with lora.adapters_disabled(adapted) as reference:
        assert np.array_equal(np.asarray(logits(reference, INPUTS_BxL)), base_logits)
    assert not np.allclose(np.asarray(logits(adapted, INPUTS_BxL)), base_logits, atol=1e-3)


def test_only_the_targets_get_adapters_and_gpt2s_c_proj_is_both():
    llama = built(tiny_model("llama", targets=["q_proj", "v_proj"]))
    paths = {path for path, _ in nnx.to_flat_state(nnx.state(llama, nnx.LoRAParam))}
    assert {path[-3] for path in paths} == {"q_proj", "v_proj"}
    gpt2 = built(tiny_model("gpt2", targets=["c_proj"]))
    paths = {path[-4:-2] for path, _ in nnx.to_flat_state(nnx.state(gpt2, nnx.LoRAParam))}
    assert paths == {("attn", "c_proj"), ("mlp", "c_proj")}


@pytest.mark.parametrize("family,scan", [("llama", False), ("gpt2", True)])
def test_merged_weights_give_the_adapted_logits(family, scan):
    model_config = dataclasses.replace(tiny_model(family), scan_layers=scan)
    adapted = randomised_adapters(built(model_config))
    params = nnx.to_pure_dict(nnx.state(adapted, nnx.Param))
    merged = lora.merged_params(params, lora.adapter_scale(model_config.lora))
    assert not lora.has_adapters(merged)
    plain = lm_from_params(lora.without_adapters(model_config), merged)
    assert_close(np.asarray(logits(plain, INPUTS_BxL)), np.asarray(logits(adapted, INPUTS_BxL)),
                 **transformer(2, 256))


def test_a_train_step_changes_the_adapters_only():
    import optax

    model_config = tiny_model("llama")  # adapter dropout: the resume test's runs
    mesh = make_mesh(2, mesh_config(data=1, fsdp=2))  # the adapters split as their kernels
    tx = make_optimizer(config_node("optimizer", ["optimizer=adamw"], lr=1e-2),
                        optax.constant_schedule(1e-2))
    graphdef, state = create_state(built(model_config), tx, mesh, nnx.LoRAParam)
    adapters = nnx.filter_state(state.params, nnx.LoRAParam)
    lora_a = adapters["model"]["layers"][0]["self_attn"]["q_proj"]["lora"]["lora_a"]
    assert tuple(lora_a[...].sharding.spec)[:1] == ("fsdp",)  # its input width, as q_proj's
    adapter_count = sum(p.size for p in jax.tree.leaves(adapters))
    # Adam's two moments of the adapters, and nothing of the base (and two step counters:
    # Adam's, the schedule's).
    assert sum(leaf.size for leaf in jax.tree.leaves(state.opt_state)) == 2 * adapter_count + 2
    before = jax.device_get(state.params)
    train = compile_train_step(mesh, graphdef, tx, trainable=nnx.LoRAParam)
    batch = INPUTS_BxL
    structure = jax.tree.structure(state)
    for step in range(2):
        state, metrics = train(state, batch, jax.random.key(step))
        assert np.isfinite(float(metrics["loss"]))
    assert jax.tree.structure(state) == structure  # the same state, fed back in
    after = jax.device_get(state.params)
    for (path, old), (_, new) in zip(nnx.to_flat_state(before), nnx.to_flat_state(after),
                                     strict=True):
        if isinstance(old, nnx.LoRAParam):
            assert not np.array_equal(old[...], new[...]), path  # A moves once B has
        else:
            assert np.array_equal(old[...], new[...]), path  # bitwise frozen


def test_peft_names_of_the_adapters():
    llama = randomised_adapters(built(tiny_model("llama", targets=["q_proj", "down_proj"])))
    tensors = peft.adapter_tensors(nnx.to_pure_dict(nnx.state(llama, nnx.Param)),
                                   "LlamaForCausalLM")
    assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"][0] == (4, 32)
    assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"][0] == (32, 4)
    assert len(tensors) == 2 * 2 * 2
    gpt2_config = dataclasses.replace(tiny_model("gpt2", targets=["c_attn"]), scan_layers=True)
    gpt2 = built(gpt2_config)
    tensors = peft.adapter_tensors(nnx.to_pure_dict(nnx.state(gpt2, nnx.Param)),
                                   "GPT2LMHeadModel")
    assert set(tensors) == {f"base_model.model.transformer.h.{i}.attn.c_attn.lora_{m}.weight"
                            for i in range(2) for m in "AB"}
    assert tensors["base_model.model.transformer.h.1.attn.c_attn.lora_B.weight"][0] == (96, 4)
    assert peft.adapter_config(gpt2_config, None)["fan_in_fan_out"] is True


@pytest.mark.parametrize("settings,names", [
    ({"rank": 0}, ["model.lora.rank=0", "at least 1"]),
    ({"targets": ["q_proj", "wq"]}, ["model.lora.targets", "wq", "c_attn, c_proj, c_fc"]),
    ({"targets": []}, ["model.lora.targets", "is empty"]),
    ({"dropout": 1.0}, ["model.lora.dropout=1.0"]),
    ({"alpha": 0.0}, ["model.lora.alpha=0.0"]),
])
def test_bad_lora_settings_name_the_setting_and_the_fix(settings, names):
    model = dataclasses.replace(tiny_model("gpt2"),
                                lora=LoraConfig(**{"rank": 4, **settings}))
    with pytest.raises(FlaxlmError) as raised:
        lora.check_lora(model)
    for name in names:
        assert name in str(raised.value)


# ------------------------------------------------------------------ runs

RUN = ["model=llama-tiny", *TINY, "language.max_train_docs=40", "language.max_eval_docs=4",
       "samples.prompts=[]", "trainer.eval_before_training=false", "trainer.log_every_steps=1",
       "optimizer.warmup_steps=0"]
# Adapter dropout on, so that resuming must restore its random stream too. The runs that train
# adapters all take these settings and 4 steps: the schedule is compiled into the train step,
# so they share one.
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.dropout=0.1"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Llama base: a 1-step run's export."""
    from conftest import trained_run

    return os.path.join(trained_run(tmp_path_factory, "base", [*RUN, "trainer.max_steps=1"]),
                        "model")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base_dir):
    from conftest import trained_run

    return trained_run(tmp_path_factory, "lora", [*RUN, *LORA, "trainer.max_steps=4",
                                                  f"model.init_from={base_dir}"])


@pytest.mark.slow
def test_a_lora_run_checkpoints_its_adapters_and_exports_both_ways(lora_run, base_dir,
                                                                    monkeypatch, capsys):
    from flaxlm.job import train
    from flaxlm.training.checkpoint.manager import restore_params

    params, _, step = restore_params(lora_run)
    assert step == 4
    assert {path[-1] for path, _ in nnx.to_flat_state(nnx.State(params))} == {"lora_a",
                                                                             "lora_b"}
    with open(os.path.join(lora_run, "adapter", "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == base_dir
    assert os.path.isfile(os.path.join(lora_run, "model", "model.safetensors"))
    assert_checkpoint_reads_as_the_export(lora_run)
    # The same run resumed onto its base after the base's weights changed is refused.
    weights = os.path.join(base_dir, "model.safetensors")
    with open(weights, "rb") as f:
        original = f.read()
    monkeypatch.setenv("FLAXLM_CACHE", str(os.path.join(os.path.dirname(lora_run), "cache")))
    overrides = [*RUN, *LORA, "trainer.max_steps=5", f"model.init_from={base_dir}"]
    try:
        with open(weights, "r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(b"\x00\x00\x80\x3f")
        with pytest.raises(FlaxlmError, match="weights SHA-256") as raised:
            train(compose(overrides, run_dir=lora_run))
    finally:
        with open(weights, "wb") as f:
            f.write(original)
    assert "model.init_from" in str(raised.value) and "trainer.resume=never" in str(raised.value)


@pytest.mark.slow
def test_a_lora_run_resumes_exactly(tmp_path, monkeypatch, capsys):
    """4 steps straight, and 2 + a resume: the same adapters and the same metrics. A base of
    random init (no model.init_from) comes back from the seed."""
    from flaxlm.training.checkpoint.manager import restore_params

    monkeypatch.setenv("FLAXLM_CACHE", str(tmp_path / "cache"))
    overrides = [*RUN, *LORA, "trainer.max_steps=4"]
    assert_resumes_as_never_stopped(overrides, tmp_path, monkeypatch, capsys, stop_step=2)
    straight, _, _ = restore_params(str(tmp_path / "straight"))
    resumed, _, _ = restore_params(str(tmp_path / "resumed"))
    assert jax.tree.all(jax.tree.map(np.array_equal, straight, resumed))
    assert_checkpoint_reads_as_the_export(tmp_path / "resumed")


def assert_checkpoint_reads_as_the_export(run_dir):
    """flaxlm-export and flaxlm-generate read a LoRA run's checkpoint (its adapters) onto its
    base, merged: the weights of the run's own merged export."""
    from flaxlm.models import pretrained
    from flaxlm.run_model import load_run_model

    read = load_run_model(str(run_dir))
    assert read.model_config.lora.rank is None
    exported = nnx.eval_shape(lambda: build_lm(TransformerSpec(read.model_config),
                                               nnx.Rngs(0)))
    pretrained.load_pretrained_weights(exported, str(run_dir / "model"))
    expected = nnx.to_pure_dict(nnx.state(exported, nnx.Param))
    for (path, leaf), (_, other) in zip(nnx.to_flat_state(nnx.State(read.params)),
                                        nnx.to_flat_state(nnx.State(expected)), strict=True):
        # W + s·BA merged by two code paths: a product of rank (4, LORA's) terms and a sum.
        assert_close(leaf, other, terms=4, depth=2, err_msg=str(path))


@pytest.mark.slow
@pytest.mark.torch
def test_transformers_and_peft_load_the_exports_with_flaxlms_logits(lora_run, base_dir):
    torch = pytest.importorskip("torch")
    import peft as peft_lib
    import transformers

    ids = [[5, 17, 33, 2, 90, 41, 7, 250]]
    adapted = _flaxlm_adapted(lora_run, base_dir)
    expected = np.asarray(adapted(jnp.asarray(ids)))
    merged = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(lora_run, "model"))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    with_adapter = peft_lib.PeftModel.from_pretrained(base, os.path.join(lora_run, "adapter"))
    for hf_model in (merged.eval(), with_adapter.eval()):
        with torch.no_grad():
            logits = hf_model(torch.tensor(ids)).logits.numpy()
        assert_close(logits, expected, **transformer(2, 512), amplification=len(ids[0]))
    with lora.adapters_disabled(adapted), torch.no_grad(), with_adapter.disable_adapter():
        assert_close(with_adapter(torch.tensor(ids)).logits.numpy(),
                     np.asarray(adapted(jnp.asarray(ids))), **transformer(2, 512),
                     amplification=len(ids[0]))


def _flaxlm_adapted(run_dir, base_dir):
    """The run's adapted model in flaxlm: the base from its directory, the adapters from the
    run's last checkpoint."""
    from omegaconf import OmegaConf

    from flaxlm.config import ModelConfig
    from flaxlm.models import pretrained
    from flaxlm.training.checkpoint.manager import restore_params

    adapters, config, _ = restore_params(run_dir)
    schema = OmegaConf.structured(ModelConfig)
    model_config = OmegaConf.to_object(OmegaConf.merge(schema, config["model"]))
    model_config = pretrained.pretrained_model_config(base_dir, model_config)
    model = build_lm(TransformerSpec(model_config), nnx.Rngs(params=0))
    pretrained.load_pretrained_weights(model, base_dir)
    state = nnx.state(model, nnx.LoRAParam)
    nnx.replace_by_pure_dict(state, adapters)
    nnx.update(model, state)
    return model


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("family", list(OPTIONS))
def test_peft_loads_the_adapter_onto_the_base_with_flaxlms_logits(family, tmp_path):
    """Each family's adapter directory, loaded by PEFT onto the HF base (GPT-2's Conv1D
    projections with fan_in_fan_out), and the merged export, give flaxlm's logits."""
    torch = pytest.importorskip("torch")
    import peft as peft_lib
    import transformers
    from conftest import make_tokenizer

    from flaxlm.export import export_adapter, export_hf

    model_config = tiny_model(family, alpha=8.0, targets=list(lora.TARGETS[lora.ModelFamily(
        family)][:3]))
    adapted = randomised_adapters(built(model_config))
    params = nnx.to_pure_dict(nnx.state(adapted, nnx.Param))
    plain_config = lora.without_adapters(model_config)
    tokenizer = make_tokenizer()
    export_hf(tmp_path / "base", lora.merged_params(params, 0.0), plain_config, tokenizer)
    export_hf(tmp_path / "merged", lora.merged_params(params, lora.adapter_scale(
        model_config.lora)), plain_config, tokenizer)
    export_adapter(tmp_path / "adapter", params, model_config, base_model=str(tmp_path / "base"))
    expected = np.asarray(logits(adapted, INPUTS_BxL))
    ids = torch.tensor(np.asarray(INPUTS_BxL))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with_adapter = peft_lib.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    for hf_model in (with_adapter, merged):
        with torch.no_grad():
            assert_close(hf_model(ids).logits.numpy(), expected, **LOGITS)
