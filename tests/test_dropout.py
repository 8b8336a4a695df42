"""Dropout masks: `flaxlm.models.dropout` draws exactly what `jax.random` draws, on any shape,
probability, key and sharding, without the loop that JAX's CPU lowering of Threefry runs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flaxlm.models.dropout import Dropout, bernoulli, dropout, random_bits
from flaxlm.parallel import make_mesh

SOME = settings(max_examples=12, deadline=None)  # each shape compiles anew
shapes = st.lists(st.integers(1, 40), min_size=0, max_size=4).map(tuple)
seeds = st.integers(0, 2**32 - 1)


# Each example draws a new shape, so each compiles anew: ours and jax.random's draws are one
# program (one compile, where each eager call compiles its primitives again for each shape:
# ours ~0.4 s, jax.random's up to a second), compiled without LLVM's optimisations, which
# cannot change integer results and cost ~4/5 of the compile. The masks compiled as training
# compiles them are compared with jax.random's in the tests below.
UNOPTIMISED = {"xla_backend_optimization_level": 0}


@functools.partial(jax.jit, static_argnums=1)
def both_bits(key, shape):
    return random_bits(key, shape), jax.random.bits(key, shape)


@functools.partial(jax.jit, static_argnums=(1, 2))
def both_bernoulli(key, p, shape):
    return bernoulli(key, p, shape), jax.random.bernoulli(key, p, shape)


@pytest.mark.slow
@SOME
@given(seed=seeds, shape=shapes)
def test_bits_equal_jax_random_bits(seed, shape):
    key = jax.random.key(seed)
    ours, theirs = both_bits.lower(key, shape).compile(UNOPTIMISED)(key)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.slow
@SOME
@given(seed=seeds, shape=shapes, p=st.floats(0.0, 1.0) | st.sampled_from([0.9, 0.5, 1 - 2**-24]))
def test_bernoulli_equals_jax_random_bernoulli(seed, shape, p):
    key = jax.random.key(seed)
    ours, theirs = both_bernoulli.lower(key, p, shape).compile(UNOPTIMISED)(key)
    np.testing.assert_array_equal(ours, theirs)


def test_a_key_from_nnx_rngs_and_a_folded_key_give_the_same_masks_as_nnx_dropout():
    x = jnp.arange(1.0, 1 + 6 * 128).reshape(6, 128)
    ours = Dropout(0.1)(x, deterministic=False, rngs=nnx.Rngs(dropout=3))
    theirs = nnx.Dropout(0.1)(x, deterministic=False, rngs=nnx.Rngs(dropout=3))
    np.testing.assert_array_equal(ours, theirs)
    key = jax.random.fold_in(jax.random.key(5), 7)
    np.testing.assert_array_equal(
        dropout(x, 0.25, key), nnx.Dropout(0.25)(x, deterministic=False, rngs=key))
    assert 0.2 < float((dropout(x, 0.25, key) == 0).mean()) < 0.3


def test_rate_zero_one_and_evaluation_leave_no_randomness_behind():
    x = jnp.ones((4, 4))
    key = jax.random.key(0)
    assert dropout(x, 0.0, key) is x
    np.testing.assert_array_equal(dropout(x, 1.0, key), jnp.zeros_like(x))
    assert Dropout(0.5)(x, deterministic=True, rngs=None) is x


def test_other_key_implementations_fall_back_to_jax_random():
    key = jax.random.key(1, impl="rbg")
    np.testing.assert_array_equal(bernoulli(key, 0.9, (16, 16)),
                                  jax.random.bernoulli(key, 0.9, (16, 16)))


def test_a_sharded_mask_is_the_unsharded_one_and_needs_no_communication():
    mesh = make_mesh(8)
    key = jax.random.key(11)
    shape = (8, 4, 32, 32)  # attention probabilities: batch split over the devices
    draw = jax.jit(lambda key: bernoulli(key, 0.9, shape),
                   out_shardings=NamedSharding(mesh, P("data")))
    np.testing.assert_array_equal(draw(key), jax.random.bernoulli(key, 0.9, shape))
    hlo = draw.lower(key).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective" not in hlo


def test_the_rounds_are_written_out_not_looped():
    """Why the module exists: a mask is straight-line code, not a loop over whole arrays."""
    key = jax.random.key(0)
    shape = (2, 4, 64, 64)
    ours = jax.jit(lambda key: bernoulli(key, 0.9, shape)).lower(key).compile().as_text()
    assert " while(" not in ours
