"""The memory breakdown's accounting (benchmarks/memory.py --breakdown): the train state per
device by kind on a replicated and on a split mesh, XLA's record of the compiled train step
against it, and the sampler that gives each phase of a run its peak RSS."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, mesh_config, model_config
from flax import nnx

from flaxlm.models.gpt2 import GPT2LMHeadModel
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import global_batch, make_mesh
from flaxlm.training.step import compile_steps, create_state

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import memory  # noqa: E402

TINY = model_config(name="t", num_layers=2, hidden_size=64, num_heads=4, max_positions=32,
                    vocab_size=256)
MESHES = {"data=8": mesh_config(), "fsdp=8": mesh_config(data=1, fsdp=8)}


def setup(mesh_name: str):
    """A tiny GPT-2's AdamW train state laid out on the mesh, and its compiled steps."""
    mesh = make_mesh(8, MESHES[mesh_name])
    tx = memory.optimizer()
    model = GPT2LMHeadModel(TransformerSpec(TINY, jnp.float32, jnp.float32), nnx.Rngs(params=0))
    graphdef, state = create_state(model, tx, mesh)
    return mesh, state, compile_steps(mesh, graphdef, tx)


def param_bytes(state) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state.params))


def test_replicated_state_is_three_copies_of_the_parameters_on_every_device():
    _, state, _ = setup("data=8")
    kinds = memory.state_bytes_by_kind(state)
    whole = param_bytes(state)
    assert kinds["params"] == kinds["mu"] == kinds["nu"] == whole  # AdamW, float32
    assert 0 < kinds["other"] < 64  # the step and the optimizer's counters
    assert memory.state_bytes_by_kind(memory.abstract(state)) == kinds


@pytest.mark.slow
def test_fsdp_splits_every_divisible_array_eight_ways():
    _, state, _ = setup("fsdp=8")
    kinds = memory.state_bytes_by_kind(state)
    whole = param_bytes(state)
    whole_on_each = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state.params)
                        if leaf.sharding.is_fully_replicated)  # none divides 8 ways
    assert whole_on_each < whole / 4
    assert kinds["params"] * 8 == whole + 7 * whole_on_each
    assert kinds["mu"] == kinds["nu"] == kinds["params"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", MESHES)
def test_the_train_step_holds_its_state_and_batch_and_writes_over_the_state(mesh_name):
    mesh, state, steps = setup(mesh_name)
    rows = np.random.default_rng(0).integers(0, TINY.vocab_size, (16, 32), dtype=np.int32)
    args = (state, global_batch(rows, mesh), jax.random.key(0))
    stats = memory.step_memory(steps.train, memory.abstract(args))
    state_bytes = sum(memory.state_bytes_by_kind(state).values())
    batch_bytes = rows.nbytes // 8
    assert stats["arguments"] >= state_bytes + batch_bytes
    assert stats["aliased"] == state_bytes  # donated: the new state in the old one's buffers
    assert stats["outputs"] >= state_bytes
    assert stats["temp"] > 0
    new_state, _ = steps.train(*args)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_state))


def test_the_sampler_gives_each_phase_its_own_peak():
    sampler = memory.PhaseSampler(interval=0.001).start()
    sampler.enter("small")
    sampler.enter("large")
    block = np.ones(128 * 2**20 // 8)  # 128 MB, touched (other threads move RSS by a few MB)
    sampler.enter("freed")
    del block
    sampler.stop()
    phases = {phase: (peak, end) for phase, peak, end in sampler.table()}
    assert list(phases)[1:] == ["small", "large", "freed"]
    assert phases["large"][0] - phases["small"][0] > 100 * 2**20
    assert phases["freed"][1] < phases["large"][1]
    # The kernel's counters lag by a few pages per thread: the peak is the sampled one, nearly.
    assert memory.peak_rss() >= phases["large"][0] - 2**20
    assert memory.device_bytes(jax.ShapeDtypeStruct((4, 8), jnp.float32)) == 128
