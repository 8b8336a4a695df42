"""Sharded models change nothing but where the bytes live: on 8 simulated devices, FSDP and
tensor-parallel meshes train like plain data parallelism, remat gives the same gradients, and a
checkpoint moves between meshes."""

import dataclasses
import functools
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import config_node, mesh_config, model_config, user_env
from flax import nnx
from numerics import assert_close, assert_trees_close, magnitude, transformer, transformer_depth
from omegaconf import OmegaConf

from flaxlm.config import ModelFamily, Remat
from flaxlm.errors import FlaxlmError
from flaxlm.models.bert import BertForSequenceClassification
from flaxlm.models.gpt2 import GPT2ForSequenceClassification, GPT2LMHeadModel
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import global_batch, make_mesh
from flaxlm.training.checkpoint.manager import Checkpointer
from flaxlm.training.optimizer import make_optimizer, make_schedule
from flaxlm.training.step import compile_steps, create_state, lm_loss

# Every width divides by 8, so fsdp=8 splits every parameter; dropout stays on.
MODEL = model_config(name="t", vocab_size=128, max_positions=16, hidden_size=32, num_layers=2,
                     num_heads=4)
# SGD with momentum, whose update is linear in the gradient: Adam's first update is about
# sign(g), which flips for a gradient near eps (the key projection's bias has a gradient of
# exactly 0 in exact arithmetic, rounding noise in float32) under any change of summation order.
OPTIMIZER = config_node("optimizer", ["optimizer=sgd"], lr=1e-2)
TOKENS = 16 * 15  # a step's targets: the longest sum in its loss and gradients
MESHES = {
    "data=8": mesh_config(data=8),
    "fsdp=8": mesh_config(data=1, fsdp=8),
    "data=2 fsdp=4": mesh_config(data=2, fsdp=4),
    "data=2 tensor=4": mesh_config(data=2, tensor=4),
}


def rows(num=16, seed=0):
    return np.random.default_rng(seed).integers(0, 128, (num, 16)).astype(np.int32)


def setup(mesh, grad_accum_steps=1):
    """A fresh train state laid out on `mesh`, and the compiled steps."""
    tx, steps = optimizer_and_steps(mesh, grad_accum_steps)
    _, state = create_state(GPT2LMHeadModel(TransformerSpec(MODEL), nnx.Rngs(0)), tx, mesh)
    return state, steps


@functools.cache
def optimizer_and_steps(mesh, grad_accum_steps):
    """The optimizer and the jitted steps, one pair per mesh: the tests that train on the same
    mesh (data=8 for the reference and the checkpoint's first mesh, fsdp=8) share its
    compile. Each test's state is its own (`setup`): the steps donate it."""
    schedule = make_schedule(OPTIMIZER, total_steps=10)
    tx = make_optimizer(OPTIMIZER, schedule)
    graphdef, _ = create_state(GPT2LMHeadModel(TransformerSpec(MODEL), nnx.Rngs(0)), tx, mesh)
    return tx, compile_steps(mesh, graphdef, tx, grad_accum_steps)


def train(mesh_config, num_steps=3, grad_accum_steps=1):
    """`num_steps` steps on 8 devices laid out as `mesh_config`: (state, losses)."""
    mesh = make_mesh(8, mesh_config)
    state, steps = setup(mesh, grad_accum_steps)
    losses = []
    for step in range(num_steps):
        state, metrics = steps.train(state, global_batch(rows(seed=step), mesh),
                                     jax.random.key(step))
        losses.append(float(metrics["loss"]))
    return state, losses


def host(params):
    return jax.device_get(nnx.to_pure_dict(params))


def assert_trained_alike(params, reference, num_steps):
    """Parameters after `num_steps` steps on two meshes: each is its start plus lr × its
    gradients, so the steps taken (not the parameters' size) carry the gradients' error."""
    start = host(nnx.state(GPT2LMHeadModel(TransformerSpec(MODEL), nnx.Rngs(0)), nnx.Param))
    settings = dict(terms=TOKENS, depth=num_steps * transformer_depth(MODEL.num_layers,
                                                                      backward=True))
    jax.tree.map(lambda a, b, s: assert_close(a, b, scale=magnitude(b - s), **settings),
                 params, reference, start)


def assert_same_losses(losses, reference):
    """Losses of steps 1, 2, ...: the same sums, each after one more step, split otherwise."""
    for step, (loss, expected) in enumerate(zip(losses, reference, strict=True)):
        assert_close(loss, expected, terms=TOKENS,
                     depth=(step + 1) * transformer_depth(MODEL.num_layers, backward=True))


@pytest.fixture(scope="module")
def data_parallel():
    """Three steps of plain data parallelism on 8 devices: (losses, final parameters)."""
    state, losses = train(MESHES["data=8"])
    return losses, host(state.params)


def test_hardware_mesh_names_the_axis_sizes():
    assert dict(make_mesh(8).shape) == {"data": 8, "fsdp": 1, "expert": 1, "context": 1,
                                        "tensor": 1}
    assert dict(make_mesh(8, mesh_config(data=2, fsdp=-1)).shape) == {
        "data": 2, "fsdp": 4, "expert": 1, "context": 1, "tensor": 1}
    assert dict(make_mesh(4, mesh_config(data=-1, tensor=2)).shape) == {
        "data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 2}
    assert dict(make_mesh(8, mesh_config(data=-1, expert=4)).shape) == {
        "data": 2, "fsdp": 1, "expert": 4, "context": 1, "tensor": 1}
    assert dict(make_mesh(8, mesh_config(data=-1, context=4)).shape) == {
        "data": 2, "fsdp": 1, "expert": 1, "context": 4, "tensor": 1}


@pytest.mark.parametrize("mesh_config, named", [
    (mesh_config(data=3), "hardware.mesh.data=3"),
    (mesh_config(data=-1, fsdp=-1), "hardware.mesh.fsdp=-1"),
    (mesh_config(data=2, fsdp=2, tensor=1), "hardware.mesh.fsdp=2"),
    (mesh_config(data=-1, tensor=0), "hardware.mesh.tensor=0"),
])
def test_a_mesh_that_does_not_fit_the_devices_is_a_clear_error(mesh_config, named):
    with pytest.raises(FlaxlmError, match="does not fit 8 device") as err:
        make_mesh(8, mesh_config)
    assert named in str(err.value)


@pytest.mark.parametrize("build", [
    lambda spec: GPT2LMHeadModel(spec, nnx.Rngs(0)),
    lambda spec: GPT2ForSequenceClassification(spec, 3, nnx.Rngs(0)),
    lambda spec: BertForSequenceClassification(
        TransformerSpec(dataclasses.replace(spec.model, family=ModelFamily.bert)), 3,
        nnx.Rngs(0)),
], ids=["gpt2-lm", "gpt2-classifier", "bert-classifier"])
def test_every_parameter_names_its_logical_axes(build):
    params = nnx.state(build(TransformerSpec(MODEL)), nnx.Param)
    for path, variable in nnx.to_flat_state(params):
        names = variable.get_metadata().get("logical_axes")
        assert names is not None and len(names) == variable.ndim, path


@pytest.mark.slow
def test_fsdp_keeps_one_eighth_of_parameters_and_optimizer_state_per_device():
    sizes = {}
    for name in ("data=8", "fsdp=8"):
        state, _ = setup(make_mesh(8, MESHES[name]))
        leaves = jax.tree.leaves(state)
        sizes[name] = sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards
                          if shard.device == jax.devices()[0])
    arrays = sum(leaf.nbytes for leaf in leaves if leaf.ndim)  # parameters, momentum
    scalars = sum(leaf.nbytes for leaf in leaves if not leaf.ndim)  # step counters
    assert sizes["data=8"] == arrays + scalars
    assert sizes["fsdp=8"] == arrays // 8 + scalars


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp=8", "data=2 fsdp=4", "data=2 tensor=4"])
def test_sharded_meshes_train_like_data_parallelism(name, data_parallel):
    reference_losses, reference_params = data_parallel
    state, losses = train(MESHES[name])
    assert_same_losses(losses, reference_losses)
    assert_trained_alike(host(state.params), reference_params, num_steps=3)
    kernel = state.params["h"][0]["mlp"]["c_fc"]["kernel"]
    assert tuple(kernel.sharding.spec) == {
        "fsdp=8": ("fsdp",), "data=2 fsdp=4": ("fsdp",), "data=2 tensor=4": (None, "tensor"),
    }[name]  # the state stays laid out as placed, step after step


@pytest.mark.slow
def test_fsdp_with_gradient_accumulation_trains_like_data_parallelism():
    reference_state, reference_losses = train(MESHES["data=8"], num_steps=2,
                                              grad_accum_steps=2)
    state, losses = train(MESHES["data=2 fsdp=4"], num_steps=2, grad_accum_steps=2)
    assert_same_losses(losses, reference_losses)
    assert_trained_alike(host(state.params), host(reference_state.params), num_steps=2)


def gradients(model_config, family_loss):
    """The loss, its gradients (dropout on, one key) and the jaxpr of the gradient."""
    model = family_loss.build(TransformerSpec(model_config))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params):
        return family_loss.loss(nnx.merge(graphdef, params), nnx.Rngs(dropout=7))

    grad_fn = jax.jit(jax.value_and_grad(loss))
    return grad_fn(params), str(jax.make_jaxpr(grad_fn)(params))


@functools.cache
def plain_gradients(family_loss):
    """`gradients` of MODEL in `family_loss`'s family without remat: what each remat policy's
    gradients are compared with, computed once per family."""
    family = ModelFamily.gpt2 if family_loss is GPT2Loss else ModelFamily.bert
    return gradients(dataclasses.replace(MODEL, family=family), family_loss)


class GPT2Loss:
    build = staticmethod(lambda spec: GPT2LMHeadModel(spec, nnx.Rngs(0)))
    loss = staticmethod(lambda model, rngs: lm_loss(model, rows(4), rngs))


class BertLoss:
    build = staticmethod(lambda spec: BertForSequenceClassification(spec, 2, nnx.Rngs(0)))

    @staticmethod
    def loss(model, rngs):
        ids = rows(4)
        mask = (np.arange(16) < 12)[None].repeat(4, axis=0).astype(np.int32)  # padded keys
        return model(ids, mask, np.zeros_like(ids), rngs=rngs).sum()


@pytest.mark.slow
@pytest.mark.parametrize("family_loss", [GPT2Loss, BertLoss], ids=["gpt2", "bert"])
@pytest.mark.parametrize("remat", [Remat.block, Remat.full])
def test_remat_gives_the_same_gradients(family_loss, remat):
    family = ModelFamily.gpt2 if family_loss is GPT2Loss else ModelFamily.bert
    (loss, grads), plain_jaxpr = plain_gradients(family_loss)
    (remat_loss, remat_grads), remat_jaxpr = gradients(
        dataclasses.replace(MODEL, family=family, remat=remat), family_loss)
    assert "remat" not in plain_jaxpr and remat_jaxpr.count("remat") >= MODEL.num_layers
    assert_close(remat_loss, loss, **transformer(MODEL.num_layers, 4 * MODEL.hidden_size))
    # BERT's key bias has a gradient of exactly 0 (softmax ignores what it adds to every score
    # of a query alike): rounding noise of the whole network's gradients, their scale.
    assert_trees_close(host(remat_grads), host(grads), scale=magnitude(host(grads)),
                       **transformer(MODEL.num_layers, 4 * MODEL.hidden_size, backward=True))


REMAT_MEMORY = """
import dataclasses, json, sys
from omegaconf import OmegaConf
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from flaxlm.config import HardwareConfig, ModelConfig, Remat
from flaxlm.models.gpt2 import GPT2LMHeadModel
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import configure_platform
from flaxlm.training.step import lm_loss

def typed(schema, values):
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), json.loads(values)))

configure_platform(typed(HardwareConfig, sys.argv[3]), Remat(sys.argv[1]))
model = typed(ModelConfig, sys.argv[2])
ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (4, 128)), jnp.int32)
for remat in (Remat.none, Remat.full):
    config = dataclasses.replace(model, remat=remat)
    graphdef, params = nnx.split(GPT2LMHeadModel(TransformerSpec(config), nnx.Rngs(0)),
                                 nnx.Param)
    step = jax.jit(jax.grad(lambda p: lm_loss(nnx.merge(graphdef, p), ids,
                                              nnx.Rngs(dropout=0))))
    print(remat.value, step.lower(params).compile().memory_analysis().temp_size_in_bytes)
"""


@pytest.mark.slow
@pytest.mark.parametrize("requested", [Remat.none, Remat.full])
def test_remat_saves_memory_on_a_cpu(requested):
    """On a CPU, XLA's default scheduler runs the recomputation early and keeps the activations
    anyway; configure_platform picks the scheduler that frees them when the run asks for remat
    (a fresh process: the scheduler is fixed when JAX starts)."""
    env = user_env()
    model = model_config(name="t", num_layers=4, hidden_size=64, num_heads=2, max_positions=128,
                         vocab_size=512)
    hardware = config_node("hardware", cpu_devices=1)
    settings = [json.dumps(OmegaConf.to_container(OmegaConf.structured(node)))
                for node in (model, hardware)]
    done = subprocess.run([sys.executable, "-c", REMAT_MEMORY, requested.value, *settings],
                          env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    temp = dict(line.split() for line in done.stdout.splitlines())
    saved = 1 - int(temp["full"]) / int(temp["none"])
    if requested is Remat.none:  # the fast scheduler: remat recomputes and saves nothing
        assert saved < 0.05, temp
    else:
        assert saved > 0.1, temp


@pytest.mark.slow
def test_a_checkpoint_moves_between_meshes(tmp_path, data_parallel):
    """data=8 → fsdp=8 → 4 devices: each restore holds the saved values in the new layout and
    trains on exactly as the run that saved it would have."""
    state, _ = train(MESHES["data=8"], num_steps=1)
    moves = [(8, MESHES["fsdp=8"], ("fsdp",)), (4, mesh_config(data=2, fsdp=2), ("fsdp",))]
    checkpointer = Checkpointer(str(tmp_path), async_save=False)
    try:
        for step, (num_devices, mesh, spec) in enumerate(moves, start=1):
            checkpointer.save(step, state, {}, {})
            saved = host(state.params)
            mesh = make_mesh(num_devices, mesh)
            target, steps = setup(mesh)
            restored = checkpointer.restore(step, target).state
            kernel = restored.params["h"][0]["mlp"]["c_fc"]["kernel"]
            assert tuple(kernel.sharding.spec) == spec and kernel.sharding.mesh == mesh
            jax.tree.map(np.testing.assert_array_equal, host(restored.params), saved)
            state, _ = steps.train(restored, global_batch(rows(seed=step), mesh),
                                   jax.random.key(step))
    finally:
        checkpointer.close()
    assert_trained_alike(host(state.params), data_parallel[1], num_steps=3)


@pytest.mark.parametrize("tensor", [1, 2])
def test_the_llama_mlp_keeps_each_devices_rows_of_its_hidden_units(tensor):
    """Under fsdp the MLP's hidden units (B × L × F) stay split over the batch's rows (and
    over `tensor` along F): left free, the compiler split them as the weights are, over fsdp,
    and gathered every row of the batch onto each device (llama2-7b on a TPU v5p slice)."""
    from flaxlm.models.llama import LlamaMLP
    from flaxlm.parallel import BATCH_AXES, TENSOR_AXIS, traced_on

    spec = TransformerSpec(model_config("llama", hidden_size=32, mlp_size=64, num_heads=4))
    mlp = LlamaMLP(spec, nnx.Rngs(0))
    mesh = make_mesh(None, mesh_config(data=1, fsdp=8 // tensor, tensor=tensor))
    jaxpr = jax.make_jaxpr(traced_on(mesh, lambda x: mlp(x)))(np.zeros((8, 4, 32), np.float32))
    constraints = [tuple(eqn.params["sharding"].spec) for eqn in jaxpr.eqns
                   if eqn.primitive.name == "sharding_constraint"]
    assert (BATCH_AXES, None, TENSOR_AXIS) in constraints, jaxpr
