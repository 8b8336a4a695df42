"""A model larger than one device: on 8 simulated devices with fsdp=8, parameters are created
where they live (the same values as an eager init), `model.init_from` puts each checkpoint
tensor straight onto its shards, and the export gathers one tensor at a time; no device holds
more than about an eighth of the parameters, and no host two copies of them."""

import functools
import re
import tracemalloc

import jax
import numpy as np
import pytest
import safetensors
import transformers
from conftest import config_node, mesh_config, model_config
from flax import nnx
from safetensors.numpy import load_file, save_file

from flaxlm.generate import GenerationSettings, generate_ids
from flaxlm.models import hf, pretrained
from flaxlm.models.bert import BertForSequenceClassification
from flaxlm.models.build import lm_from_params
from flaxlm.models.gpt2 import GPT2LMHeadModel
from flaxlm.models.layers import TransformerSpec
from flaxlm.models.llama import LlamaForCausalLM
from flaxlm.parallel import init_on_mesh, initializer, make_mesh, state_shardings
from flaxlm.training.optimizer import make_optimizer, make_schedule
from flaxlm.training.step import create_state

# Every width divides by 8, so fsdp=8 splits every matrix; the vocabulary table is the largest.
SHAPE = dict(vocab_size=512, max_positions=64, hidden_size=64, num_layers=2, num_heads=4)
BUILDS = {
    "gpt2": lambda key: GPT2LMHeadModel(TransformerSpec(model_config("gpt2", **SHAPE)),
                                        nnx.Rngs(params=key)),
    "llama": lambda key: LlamaForCausalLM(TransformerSpec(model_config("llama", **SHAPE)),
                                          nnx.Rngs(params=key)),
    "bert-classifier": lambda key: BertForSequenceClassification(
        TransformerSpec(model_config("bert", **SHAPE)), 3, nnx.Rngs(params=key)),
}
FSDP = mesh_config(data=1, fsdp=8)


def fsdp_mesh():
    return make_mesh(8, FSDP)


def gpt2(seed=0):
    return lambda: BUILDS["gpt2"](jax.random.key(seed))


@functools.cache
def gpt2_initializer():
    """The GPT-2's init on the fsdp=8 mesh, compiled once for the module."""
    return initializer(gpt2(), fsdp_mesh())


def gpt2_on_mesh() -> nnx.Module:
    """A fresh GPT-2 (seed 0) made on the fsdp=8 mesh."""
    graphdef, init = gpt2_initializer()
    return nnx.merge(graphdef, init())


def params_of(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def param_bytes(build) -> tuple[int, int]:
    """(all the parameters' bytes, the largest parameter's), from shapes alone."""
    sizes = [leaf.size * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(nnx.state(nnx.eval_shape(build), nnx.Param))]
    return sum(sizes), max(sizes)


def device_bytes(device) -> int:
    """Bytes of every live array's part on `device`, each buffer once (a shard's own array
    shares its parent's buffer)."""
    buffers = {}
    for array in jax.live_arrays():
        if array.is_deleted():
            continue
        for shard in array.addressable_shards:
            if shard.device == device:
                buffers[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return sum(buffers.values())


def assert_bitwise_equal(got: dict, want: dict):
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = jax.tree_util.tree_leaves_with_path(want)
    assert [path for path, _ in got_leaves] == [path for path, _ in want_leaves]
    for (path, a), (_, b) in zip(got_leaves, want_leaves):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and np.array_equal(a, b), jax.tree_util.keystr(path)


# ------------------------------------------------------------------------ creation


@pytest.mark.parametrize("name, mesh", [
    ("gpt2", FSDP), ("llama", FSDP), ("bert-classifier", FSDP),
    ("gpt2", mesh_config(data=2, tensor=4)),
], ids=["gpt2 fsdp=8", "llama fsdp=8", "bert-classifier fsdp=8", "gpt2 data=2 tensor=4"])
def test_a_model_made_on_the_mesh_has_the_eager_inits_values_bit_for_bit(name, mesh):
    build = lambda: BUILDS[name](jax.random.key(0))  # noqa: E731
    mesh = make_mesh(8, mesh)
    if name == "gpt2" and mesh.shape["fsdp"] == 8:
        sharded = params_of(gpt2_on_mesh())  # the module's compiled init_on_mesh
    else:
        sharded = params_of(init_on_mesh(build, mesh))
    assert_bitwise_equal(sharded, params_of(build()))
    shardings = state_shardings(nnx.state(nnx.eval_shape(build), nnx.Param), mesh)
    assert [leaf.sharding for leaf in jax.tree.leaves(sharded)] == jax.tree.leaves(
        nnx.to_pure_dict(shardings))


def test_initialisation_keeps_about_an_eighth_of_the_parameters_per_device():
    total, largest = param_bytes(gpt2())
    graphdef, init = gpt2_initializer()
    compiled = init.lower().compile()
    memory = compiled.memory_analysis()
    # What each device keeps: an eighth of every parameter (each one splits on fsdp).
    assert memory.output_size_in_bytes <= total / 8 + 1024
    # What it makes on the way, the random draws of each part: never a whole parameter. CPU's
    # scheduler runs the draws side by side (temporaries ≈ 1.8 × an eighth); an
    # accelerator's, which orders for memory, keeps fewer.
    assert memory.temp_size_in_bytes <= 2 * total / 8
    shapes = re.findall(r"\b[a-z]+\d*\[([\d,]*)\]", compiled.as_text())
    most_elements = max(int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes)
    assert most_elements <= largest / 4 / 8  # float32: the largest parameter's eighth

    before = device_bytes(jax.devices()[0])
    model = nnx.merge(graphdef, compiled())
    assert device_bytes(jax.devices()[0]) - before <= total / 8 + 1024
    del model


def test_the_train_state_is_created_on_the_mesh():
    mesh = fsdp_mesh()
    total, _ = param_bytes(gpt2())
    settings = config_node("optimizer", lr=1e-3)
    tx = make_optimizer(settings, make_schedule(settings, total_steps=10))
    before = device_bytes(jax.devices()[0])
    _, state = create_state(gpt2_on_mesh(), tx, mesh)
    # Parameters and Adam's two moments, an eighth each; the step counters are scalars.
    assert device_bytes(jax.devices()[0]) - before <= 3 * total / 8 + 1024
    assert all(leaf.sharding.spec != () for leaf in jax.tree.leaves(state.params))


# ------------------------------------------------------------------------ model.init_from


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An HF directory of a GPT-2 of the test's shape, seed 1 (a trained model's stand-in)."""
    directory = tmp_path_factory.mktemp("pretrained")
    model_cfg = model_config("gpt2", **SHAPE)
    hf_config = hf.to_lm_config(model_cfg, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    hf.save_pretrained(str(directory), params_of(gpt2(seed=1)()), hf_config)
    return directory


class ReadLog:
    """Wraps `safetensors.safe_open` to record each part read: its bytes, and device 0's
    memory at that moment (the old parameter not yet freed, the new part not yet placed)."""

    def __init__(self, monkeypatch):
        self.part_bytes, self.device_bytes = [], []
        original = safetensors.safe_open
        log = self

        class Part:
            def __init__(self, part):
                self.part = part

            def get_shape(self):
                return self.part.get_shape()

            def __getitem__(self, index):
                array = self.part[index]
                log.part_bytes.append(array.nbytes)
                log.device_bytes.append(device_bytes(jax.devices()[0]))
                return array

        class File:
            def __init__(self, *args, **kwargs):
                self.file = original(*args, **kwargs)

            def __enter__(self):
                self.file.__enter__()
                return self

            def __exit__(self, *exc):
                return self.file.__exit__(*exc)

            def keys(self):
                return self.file.keys()

            def get_slice(self, key):
                return Part(self.file.get_slice(key))

        monkeypatch.setattr(safetensors, "safe_open", File)


def test_init_from_places_each_tensor_on_its_shards_with_an_eighth_per_device(checkpoint,
                                                                               monkeypatch):
    _, largest = param_bytes(gpt2())
    model = gpt2_on_mesh()
    layout = [leaf.sharding for leaf in jax.tree.leaves(params_of(model))]
    log = ReadLog(monkeypatch)
    start = device_bytes(jax.devices()[0])

    report = pretrained.load_pretrained_weights(model, str(checkpoint))

    assert not report.missing and len(report.loaded) == len(layout)
    assert [leaf.sharding for leaf in jax.tree.leaves(params_of(model))] == layout
    # Each device read its own part of each tensor (8 parts), never a whole one.
    assert len(log.part_bytes) == 8 * len(layout)
    assert max(log.part_bytes) <= largest / 8
    # The model's eighth plus, while a tensor arrives, the part of it not yet swapped in.
    assert max(log.device_bytes) - start <= largest / 8 + 1024
    assert device_bytes(jax.devices()[0]) - start <= 1024


def test_init_from_tensor_by_tensor_equals_the_whole_file(checkpoint):
    """The values are those of the whole file read at once (HF's Linear weights transposed)."""
    model = gpt2_on_mesh()
    pretrained.load_pretrained_weights(model, str(checkpoint))
    whole = load_file(str(checkpoint / "model.safetensors"))
    loaded = hf.to_hf_state_dict(params_of(model))
    assert loaded.keys() == whole.keys()
    for key, array in whole.items():
        assert np.array_equal(loaded[key], array), key
    # And as an eagerly built model on one device loads them.
    alone = gpt2()()
    pretrained.load_pretrained_weights(alone, str(checkpoint))
    assert_bitwise_equal(params_of(model), params_of(alone))


def test_init_from_reads_bfloat16_and_transposed_parts(tmp_path):
    """A Llama checkpoint in bfloat16 (HF's Linear layout, transposed into ours), loaded into
    a float32 model on the mesh: each part read and cast as the whole file would be."""
    build = lambda: BUILDS["llama"](jax.random.key(0))  # noqa: E731
    reference = params_of(BUILDS["llama"](jax.random.key(1)))
    tensors = {key: value.astype(jax.numpy.bfloat16)
               for key, value in hf.to_hf_state_dict(reference, "LlamaForCausalLM").items()}
    save_file({key: np.ascontiguousarray(value) for key, value in tensors.items()},
              str(tmp_path / "model.safetensors"))
    model = init_on_mesh(build, fsdp_mesh())
    pretrained.load_pretrained_weights(model, str(tmp_path))
    loaded = hf.to_hf_state_dict(params_of(model), "LlamaForCausalLM")
    for key, value in tensors.items():
        assert np.array_equal(loaded[key], value.astype(np.float32)), key


def test_a_scanned_model_on_the_mesh_reads_each_stack_from_the_per_layer_tensors(tmp_path):
    """model.scan_layers: a stacked parameter's shards are read from HF's per-layer tensors,
    and the export cuts them apart again, with the values of an unrolled model."""
    build = lambda: LlamaForCausalLM(  # noqa: E731
        TransformerSpec(model_config("llama", **SHAPE, scan_layers=True)),
        nnx.Rngs(params=jax.random.key(0)))
    tensors = hf.to_hf_state_dict(params_of(BUILDS["llama"](jax.random.key(1))),
                                  "LlamaForCausalLM")
    save_file({key: np.ascontiguousarray(value) for key, value in tensors.items()},
              str(tmp_path / "model.safetensors"))
    model = init_on_mesh(build, fsdp_mesh())
    layout = [leaf.sharding for leaf in jax.tree.leaves(params_of(model))]

    report = pretrained.load_pretrained_weights(model, str(tmp_path))

    assert not report.missing and len(report.loaded) == len(tensors)
    assert [leaf.sharding for leaf in jax.tree.leaves(params_of(model))] == layout
    stacked = params_of(model)["model"]["layers"]["mlp"]["up_proj"]["kernel"]
    assert stacked.shape[0] == SHAPE["num_layers"]
    assert stacked.sharding.shard_shape(stacked.shape) != stacked.shape
    loaded = hf.to_hf_state_dict(params_of(model), "LlamaForCausalLM")
    assert loaded.keys() == tensors.keys()
    for key, array in tensors.items():
        assert np.array_equal(loaded[key], array), key


# ------------------------------------------------------------------------ export, samples


def test_the_safetensors_writer_writes_what_safetensors_does(tmp_path):
    params = params_of(gpt2_on_mesh())
    state_dict = hf.to_hf_state_dict(params)
    save_file({key: np.ascontiguousarray(value) for key, value in state_dict.items()},
              str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    hf.write_safetensors(str(tmp_path / "ours.safetensors"), hf.hf_tensors(params),
                         metadata={"format": "pt"})
    assert ((tmp_path / "ours.safetensors").read_bytes()
            == (tmp_path / "theirs.safetensors").read_bytes())


@pytest.mark.parametrize("where", ["mesh", "host"])
def test_the_export_holds_one_tensor_at_a_time_on_the_host(tmp_path, where):
    """Sharded parameters are gathered to the host one tensor at a time (the float32 copy of
    a transposed kernel beside it); host ones are written without a second copy of them."""
    params = params_of(gpt2_on_mesh())
    if where == "host":
        params = jax.device_get(params)
    total, largest = param_bytes(gpt2())
    config = hf.to_lm_config(model_config("gpt2", **SHAPE), bos_token_id=0, eos_token_id=0,
                             pad_token_id=0)
    tracemalloc.start()
    try:
        hf.save_pretrained(str(tmp_path), params, config)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 2 * largest + 64 * 1024 < total
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert np.array_equal(model.transformer.wte.weight.detach().numpy(),
                          np.asarray(params["wte"]["embedding"]))


def test_samples_drawn_on_the_mesh_are_those_of_one_device():
    params = params_of(gpt2_on_mesh())
    model_cfg = model_config("gpt2", **SHAPE)
    settings = GenerationSettings(max_new_tokens=8, greedy=True)
    prompts = [[1, 2, 3], [4, 5]]
    on_mesh = generate_ids(lm_from_params(model_cfg, params), prompts, settings,
                           eos_token_id=None)
    alone = generate_ids(lm_from_params(model_cfg, jax.device_get(params)), prompts, settings,
                         eos_token_id=None)
    assert on_mesh == alone
