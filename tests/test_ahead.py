"""The train step compiled ahead (flaxlm.training.ahead): the same results as the jitted step,
the jitted step for arguments it was not compiled for, and a compile error where the step's own
would have been raised."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxlm.training.ahead import CompiledAhead, abstract


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:4]), ("data",))


def _step(mesh):
    rows = NamedSharding(mesh, PartitionSpec("data"))
    return jax.jit(lambda state, batch, key: (state + batch.sum(), batch * state
                                              * jax.random.uniform(key, batch.shape)),
                   in_shardings=(None, rows, None), donate_argnums=0)


def test_compiled_ahead_gives_the_jitted_steps_results(mesh):
    rows = NamedSharding(mesh, PartitionSpec("data"))
    batch = jax.device_put(jnp.arange(8.0), rows)
    state = jnp.float32(3.0)
    key = jax.random.key(1)  # a typed key, as the train step's dropout key is
    ahead = CompiledAhead(_step(mesh), (abstract(state), abstract(batch), abstract(key)))
    expected = _step(mesh)(jnp.float32(3.0), batch, key)
    got = ahead(state, batch, key)
    assert ahead.ready()
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_array_equal(np.asarray(want), np.asarray(have))
    assert got[1].sharding == rows


def test_other_arguments_go_to_the_jitted_step(mesh, capsys):
    rows = NamedSharding(mesh, PartitionSpec("data"))
    planned = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=rows)
    key = jax.random.key(0)
    ahead = CompiledAhead(_step(mesh), (abstract(jnp.float32(0)), planned, abstract(key)))
    longer = jax.device_put(jnp.arange(16.0), rows)
    state, out = ahead(jnp.float32(1.0), longer, key)
    assert float(state) == 1.0 + float(jnp.arange(16.0).sum())
    assert out.shape == (16,)
    assert "does not take these arguments" in capsys.readouterr().out
    assert ahead(jnp.float32(1.0), longer, key)[1].shape == (16,)  # and stays with it


def test_a_compile_error_is_raised_at_the_first_call(mesh, monkeypatch):
    rows = NamedSharding(mesh, PartitionSpec("data"))
    batch = jax.device_put(jnp.arange(8.0), rows)

    class Refused(RuntimeError):
        pass

    def refuse(self):
        raise Refused("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
    key = jax.random.key(0)
    ahead = CompiledAhead(_step(mesh), (abstract(jnp.float32(0)), abstract(batch),
                                        abstract(key)))
    with pytest.raises(Refused, match="RESOURCE_EXHAUSTED"):
        ahead(jnp.float32(0), batch, key)
