"""Expert parallelism changes nothing but where the experts live: on 8 simulated CPU devices a
Mixture-of-Experts model's train step with its experts split over the `expert` mesh axis (and
its tokens sent to them by all-to-all) equals the step on one device, and each device holds
1/expert of every sparse layer's experts."""

import dataclasses
import functools
import importlib.util
import re

import jax
import numpy as np
import pytest
from conftest import TINY, assert_names, compose, config_node, mesh_config, model_config
from flax import nnx
from jax.sharding import PartitionSpec
from numerics import assert_close, magnitude, tolerance, transformer_depth
from omegaconf import OmegaConf

from flaxlm import aot
from flaxlm.cli import plan as plan_cli
from flaxlm.models import moe
from flaxlm.models.build import build_lm
from flaxlm.models.gpt2 import GPT2LMHeadModel
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import global_batch, make_mesh, state_shardings
from flaxlm.tasks import base
from flaxlm.training.optimizer import make_optimizer, make_schedule
from flaxlm.training.step import compile_steps, create_state

# moe-tiny's design at a width every mesh axis divides: 8 experts, 2 per token. The router's
# weights drawn wider than the rest (initializer_range), so that each token's second and third
# choices are far apart against the rounding the two layouts differ by (asserted below): a
# near tie, chosen otherwise on another layout, would be a different computation, not a
# rounding error.
MODEL = config_node("model", ["model=moe-tiny"], vocab_size=128, max_positions=16,
                    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_size=64,
                    initializer_range=0.2)
MODEL = dataclasses.replace(MODEL, moe=dataclasses.replace(MODEL.moe, expert_mlp_size=16,
                                                           dispatch="tiled"))
# SGD, whose update is linear in the gradient (tests/test_sharding.py says why not Adam).
OPTIMIZER = config_node("optimizer", ["optimizer=sgd"], lr=1e-2)
ROWS, LENGTH = 16, 16
TOKENS = ROWS * (LENGTH - 1)  # a step's targets: the longest sum in its loss and gradients
MESHES = {"expert=8": mesh_config(data=1, expert=8),
          "expert=4 fsdp=2": mesh_config(data=1, fsdp=2, expert=4),
          "data=2 expert=2 tensor=2": mesh_config(data=2, expert=2, tensor=2),
          "data=8": mesh_config(data=8)}


def model_of(moe_changes=None):
    model = MODEL if not moe_changes else dataclasses.replace(
        MODEL, moe=dataclasses.replace(MODEL.moe, **moe_changes))
    return model


def batch(seed=0):
    return np.random.default_rng(seed).integers(0, 128, (ROWS, LENGTH)).astype(np.int32)


def one_step(mesh, model):
    """One train step of a fresh state on `mesh`: (metrics, parameters after it) on the host."""
    tx = make_optimizer(OPTIMIZER, make_schedule(OPTIMIZER, total_steps=10))
    graphdef, state = create_state(build_lm(TransformerSpec(model), nnx.Rngs(0)), tx, mesh)
    steps = compile_steps(mesh, graphdef, tx)
    state, metrics = steps.train(state, global_batch(batch(), mesh), jax.random.key(0))
    return jax.device_get(metrics), jax.device_get(nnx.to_pure_dict(state.params))


@functools.cache
def reference(moe_changes=()):
    """The step on one device."""
    return one_step(make_mesh(1), model_of(dict(moe_changes)))


def start_params(model):
    return jax.device_get(nnx.to_pure_dict(nnx.state(build_lm(TransformerSpec(model),
                                                              nnx.Rngs(0)), nnx.Param)))


def assert_same_step(result, expected, model):
    (metrics, params), (metrics_1, params_1) = result, expected
    forward = dict(terms=TOKENS, depth=transformer_depth(model.num_layers))
    backward = dict(terms=TOKENS, depth=transformer_depth(model.num_layers, backward=True))
    assert_close(metrics["loss"], metrics_1["loss"], **forward)
    assert_close(metrics["grad_norm"], metrics_1["grad_norm"], **backward)
    # The router's choices: exact counts, the same tokens sent to the same experts.
    for name in ("moe/load_max", "moe/load_min", "moe/dead_experts"):
        assert metrics[name] == metrics_1[name], name
    # Each parameter is its start plus lr × its gradient: the step carries the gradient's error.
    start = start_params(model)
    jax.tree.map(lambda a, b, s: assert_close(a, b, scale=magnitude(b - s), **backward),
                 params, params_1, start)
    moved = jax.tree.leaves(jax.tree.map(lambda a, s: np.abs(a - s).max(), params_1, start))
    assert max(moved) > 1e-4  # the step did update the parameters


@pytest.mark.slow
def test_the_router_s_choices_are_far_from_ties():
    """What makes the comparisons below rounding comparisons: each token's K-th and K+1-th
    routing probabilities differ by far more than two layouts' roundings can move them."""
    recorded = []
    route = moe.MoeMLP.route

    def recording(self, logits_BxLxE):
        recorded.append(np.asarray(jax.nn.softmax(logits_BxLxE, axis=-1)))
        return route(self, logits_BxLxE)

    model = build_lm(TransformerSpec(MODEL), nnx.Rngs(0))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe.MoeMLP, "route", recording)
        model(batch())
    assert len(recorded) == MODEL.num_layers
    K = MODEL.moe.top_k
    for probs in recorded:
        ranked = -np.sort(-probs, axis=-1)
        gap = (ranked[..., K - 1] - ranked[..., K]).min()
        # Each probability may move by the forward pass's tolerance (the last layer's come
        # after nearly all of it): two can swap places only if they are within twice that.
        allowed = tolerance(terms=TOKENS, depth=transformer_depth(MODEL.num_layers))
        assert gap > 2 * allowed * magnitude(probs), (gap, allowed)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["expert=8", "expert=4 fsdp=2", "data=2 expert=2 tensor=2"])
def test_a_step_with_experts_split_over_the_expert_axis_equals_one_device(name):
    mesh = make_mesh(8, MESHES[name])
    assert_same_step(one_step(mesh, MODEL), reference(), MODEL)


@pytest.mark.slow
def test_an_moe_step_with_rows_split_over_the_context_axis_equals_one_device():
    """Under a context axis each device routes and dispatches the tokens of its slice of the
    rows (the dispatch's shard_map splits positions too): the same step, the same routing."""
    mesh = make_mesh(8, mesh_config(data=2, context=4))
    assert_same_step(one_step(mesh, MODEL), reference(), MODEL)


def test_each_device_holds_its_share_of_the_experts():
    for name, share in [("expert=8", 8), ("expert=4 fsdp=2", 8)]:
        mesh = make_mesh(8, MESHES[name])
        tx = make_optimizer(OPTIMIZER, make_schedule(OPTIMIZER, total_steps=10))
        _, state = create_state(build_lm(TransformerSpec(MODEL), nnx.Rngs(0)), tx, mesh)
        matrices = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(
            nnx.to_pure_dict(state.params)) if path[-1].key in moe.EXPERT_MATRICES]
        assert len(matrices) == 3 * MODEL.num_layers
        E = MODEL.moe.num_experts
        expert = mesh.shape["expert"]
        for path, leaf in matrices:
            whole = leaf.size * leaf.dtype.itemsize
            for shard in leaf.addressable_shards:
                assert shard.data.shape[0] == E // expert, path
                assert shard.data.nbytes * share == whole, path


@pytest.mark.slow
def test_with_a_capacity_the_expert_axis_drops_what_each_device_would_drop():
    """Token dropping decides per device (each expert takes its first C of the device's own
    copies), so the reference is data parallelism on as many devices, not one device: the
    same copies dropped, the same step."""
    changes = (("capacity_factor", 1.0),)
    model = model_of(dict(changes))
    data_parallel = one_step(make_mesh(8, MESHES["data=8"]), model)
    assert data_parallel[0]["moe/dropped"] > 0  # the capacity does drop copies here
    experts = one_step(make_mesh(8, MESHES["expert=8"]), model)
    assert experts[0]["moe/dropped"] == data_parallel[0]["moe/dropped"]
    assert_same_step(experts, data_parallel, model)


def test_a_dense_model_takes_the_expert_axis_as_data_parallelism():
    """No parameter of a dense model names the experts' axis: all stay whole, and the
    expert axis splits the batch as `data` does."""
    mesh = make_mesh(8, mesh_config(data=1, expert=8))
    model = GPT2LMHeadModel(TransformerSpec(model_config(name="t", vocab_size=128,
                                                         max_positions=16, hidden_size=32,
                                                         num_layers=1, num_heads=4)),
                            nnx.Rngs(0))
    shardings = jax.tree.leaves(state_shardings(nnx.state(model, nnx.Param), mesh))
    assert shardings and all(s.spec == PartitionSpec() for s in shardings)
    rows = global_batch(batch(), mesh)
    assert {shard.data.shape for shard in rows.addressable_shards} == {(ROWS // 8, LENGTH)}


def test_experts_that_do_not_divide_by_the_expert_axis_are_refused_before_compiling(
        tmp_path, train_cli):
    result = train_cli(*TINY, "model=moe-tiny", "model.moe.num_experts=6",
                       "hardware.mesh.expert=4", "trainer.max_steps=1",
                       f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    first = result.stderr.strip().splitlines()[0]
    assert_names(first, "model.moe.num_experts=6", "hardware.mesh.expert=4",
                 "hardware.mesh.expert=2")
    assert "Traceback" not in result.stderr
    # Refused before the run began (only Hydra's own record is there): nothing compiled.
    assert [p.name for p in (tmp_path / "run").iterdir()] == [".hydra"]


# ---------------------------------------------------------------- flaxlm-plan

# moe-tiny cut to one layer and short rows: what the plan's tests compile.
PLANNED = ["model=moe-tiny", "model.num_layers=1", "task.max_seq_length=64",
           "hardware.per_device_batch_size=2", "logger=none"]


def expert_bytes(state) -> int:
    """Per-device bytes of the experts' matrices in an abstract train state: the parameters
    and every optimizer moment of them."""
    leaves = jax.tree_util.tree_leaves_with_path(state)
    return aot.per_device_bytes([leaf for path, leaf in leaves
                                 if any(getattr(key, "key", None) in moe.EXPERT_MATRICES
                                        for key in path)])


def abstract_state(overrides):
    return aot.abstract_run(OmegaConf.to_object(compose(overrides))).state


def test_fit_tries_the_expert_axis_first_for_an_mixture_of_experts():
    """The memory ladder of an MoE on 8 devices, all data-parallel, starts with the experts
    split over all 8 (no cost in quality): its state per chip is the run's less 7/8 of the
    experts' matrices and their optimizer moments; a dense model has no such rung."""
    overrides = [*TINY, *PLANNED]
    config = OmegaConf.to_object(compose(overrides))
    ladder = aot.recipe_ladder(config, 8, lambda extra: compose(aot.override(overrides, extra)))
    assert ladder[0].added == ("hardware.mesh.expert=8",)
    whole = abstract_state(overrides)
    state_bytes = aot.per_device_bytes(whole.params) + aot.per_device_bytes(
        (whole.step, whole.opt_state))
    assert expert_bytes(whole) > 0
    assert ladder[0].state_bytes == state_bytes - expert_bytes(whole) * 7 // 8
    assert expert_bytes(abstract_state([*overrides, *ladder[0].added])) * 8 == \
        expert_bytes(whole)
    dense = OmegaConf.to_object(compose(TINY))
    assert aot.expert_axis_overrides(dense, 8) == ((), None)


def test_the_expert_axis_suggested_keeps_the_mesh_valid():
    config = OmegaConf.to_object(compose([*TINY, *PLANNED, "hardware.mesh.data=2",
                                          "hardware.mesh.fsdp=4"]))
    overrides, mesh = aot.expert_axis_overrides(config, 8)
    assert overrides == ("hardware.mesh.expert=8", "hardware.mesh.data=-1",
                         "hardware.mesh.fsdp=1")
    assert (mesh.data, mesh.fsdp, mesh.expert) == (-1, 1, 8)
    # With a tensor axis of 2, 4 devices are left for the experts; 8 experts split over 4.
    config = OmegaConf.to_object(compose([*TINY, *PLANNED, "hardware.mesh.tensor=2"]))
    assert aot.expert_axis_overrides(config, 8)[0] == ("hardware.mesh.expert=4",)


@pytest.mark.slow  # several seconds: make test runs it
def test_a_plan_that_does_not_fit_names_the_expert_axis_with_its_figure():
    """On the CPU's devices, with a chip memory set below the step's need: the paragraph
    names the expert axis first, with the per-chip state it leaves."""
    run = aot.plan(compose([*TINY, *PLANNED, "hardware.hbm_gib_per_device=0.0001"]))
    assert run.mesh["expert"] == 1 and run.expert_overrides == ("hardware.mesh.expert=8",)
    split = abstract_state([*TINY, *PLANNED, "hardware.mesh.expert=8"])
    assert run.expert_state_bytes == aot.per_device_bytes(split.params) + aot.per_device_bytes(
        (split.step, split.opt_state))
    paragraph = aot.verdict(run)
    assert_names(paragraph, "hardware.mesh.expert=8",
                 f"{aot.gib(run.state_bytes)} → {aot.gib(run.expert_state_bytes)} per chip")


@pytest.mark.slow
@pytest.mark.libtpu
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (the `tpu` extra): no TPU compiler")
def test_an_mixture_of_experts_with_an_expert_axis_is_planned_for_a_tpu_slice(capsys):
    """`flaxlm-plan model=moe-tiny hardware=tpu-v5e-8 hardware.mesh.expert=4`: the train and
    eval steps, their all-to-alls and the megablox kernel, compile for the slice's 8 chips,
    each holding a quarter of the experts."""
    overrides = [*PLANNED, "hardware=tpu-v5e-8", "hardware.mesh.expert=4"]
    plan_cli.main(overrides)
    out = capsys.readouterr().out
    assert "mesh data=2 fsdp=1 expert=4 context=1 tensor=1" in out and "flaxlm: fits" in out
    # The TPU's dispatch, not this CPU's: the kernel hides the experts' FLOPs from the
    # compiler's count, and the roofline's MFU still stays below the whole chip.
    assert "megablox dispatch" in out.splitlines()[0]
    assert 0 < float(re.search(r"MFU ([\d.]+)%", out).group(1)) <= 100
    split, whole = abstract_state(overrides), abstract_state(PLANNED + ["hardware=tpu-v5e-8"])
    assert expert_bytes(split) * 4 == expert_bytes(whole)


@pytest.mark.parametrize("hardware, dispatch", [("cpu", "tiled"), ("tpu-v5e-8", "megablox")])
def test_auto_dispatch_is_the_one_of_the_hardware_the_run_is_compiled_for(hardware, dispatch):
    """A plan compiled on this CPU for a TPU slice traces the TPU's kernel: model.moe.dispatch
    =auto is made concrete from the run's hardware, not from the devices JAX runs on here."""
    config = OmegaConf.to_object(compose([*PLANNED, f"hardware={hardware}"]))
    spec = base.model_spec(config, config.model, pads_rows=False)
    assert spec.model.moe.dispatch == dispatch


def test_a_config_saved_before_the_expert_and_context_axes_reads_as_none():
    from flaxlm.config import upgrade_saved_config

    saved = {"hardware": {"mesh": {"data": 1, "fsdp": -1, "tensor": 1}}}
    assert upgrade_saved_config(saved)["hardware"]["mesh"] == {
        "data": 1, "fsdp": -1, "tensor": 1, "expert": 1, "context": 1,
        "balance_context": False}
