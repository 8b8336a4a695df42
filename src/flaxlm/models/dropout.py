"""Dropout whose masks are exactly `jax.random.bernoulli`'s, computed faster on a CPU.

JAX lowers the Threefry-2x32 hash behind `jax.random` to a five-iteration loop on CPUs (to
keep compiling fast), so each iteration reads and writes the whole counter array: the loop is
memory-bound, where the same twenty rounds written out fuse into one pass. Attention dropout
draws a mask as large as the attention probabilities in every layer, so on a CPU that loop is
a large share of a small model's training step (docs/benchmarks.md has the figures).

`bernoulli` writes the rounds out and reproduces `jax.random.bernoulli` bit for bit for
Threefry keys (JAX's default, with its default partitionable counters): a training run's
masks, and so its losses, do not depend on which of the two computed them. Other key
implementations, and arrays of 2**32 elements or more, go to `jax.random.bernoulli` itself.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

# Threefry-2x32's rotation schedule and key-schedule parity constant (Salmon et al., 2011).
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)
_MANTISSA_BITS = 23  # float32: jax.random.uniform keeps the top 23 of 32 random bits


def _rotate_left(x, bits: int):
    # Operators, not lax: uint32 shifts are logical in JAX and numpy alike, so the same hash
    # runs traced (masks) and on the host (the run's keys, flaxlm.training.keys).
    return (x << np.uint32(bits)) | (x >> np.uint32(32 - bits))


def threefry2x32(key_words: tuple[jax.Array, jax.Array], x0: jax.Array, x1: jax.Array):
    """The Threefry-2x32 hash of the counter pairs (x0, x1) under a two-word key, 20 rounds
    written out so that the compiler fuses them. numpy uint32 arrays in give numpy out."""
    k0, k1 = key_words
    schedule = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0, x1 = x0 + schedule[0], x1 + schedule[1]
    for block in range(5):
        for bits in _ROTATIONS[block % 2]:
            x0 = x0 + x1
            x1 = _rotate_left(x1, bits) ^ x0
        x0 = x0 + schedule[(block + 1) % 3]
        x1 = x1 + schedule[(block + 2) % 3] + np.uint32(block + 1)
    return x0, x1


def _is_threefry(key: jax.Array) -> bool:
    return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and \
        str(jax.random.key_impl(key)) == "threefry2x32"


def random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 bits equal to `jax.random.bits(key, shape)` for a Threefry key of fewer than
    2**32 elements: each element hashes its own row-major index (as the partitionable scheme
    does), so a sharded array's devices each compute only their part."""
    words = jax.random.key_data(key)
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):  # the row-major index, one iota per axis
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        stride *= shape[axis]
    high, low = threefry2x32((words[0], words[1]), jnp.zeros(shape, jnp.uint32), index)
    return high ^ low


def bernoulli(key: jax.Array, p: float, shape: tuple[int, ...]) -> jax.Array:
    """`jax.random.bernoulli(key, p, shape)`, the same booleans, for a float `p`."""
    shape = tuple(shape)
    if not _is_threefry(key) or math.prod(shape) >= 2**32:
        return jax.random.bernoulli(key, p, shape)
    # jax.random.uniform is (bits >> 9) · 2**-23 in float32, so `uniform < p` is an integer
    # comparison with p · 2**23 rounded up (p as the float32 it becomes).
    threshold = math.ceil(float(np.float32(p)) * 2**_MANTISSA_BITS)
    mantissa = lax.shift_right_logical(random_bits(key, shape), np.uint32(32 - _MANTISSA_BITS))
    return mantissa < np.uint32(min(threshold, 2**_MANTISSA_BITS))


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    """Zero each element of `x` with probability `rate`, scale the rest by 1 / (1 - rate)."""
    if rate <= 0:
        return x
    if rate >= 1:
        return jnp.zeros_like(x)
    keep = bernoulli(key, 1.0 - rate, x.shape)
    return lax.select(keep, x / (1.0 - rate), jnp.zeros_like(x))


class Dropout(nnx.Module):
    """`nnx.Dropout(rate)` (the same masks from the same key) through `bernoulli`."""

    def __init__(self, rate: float):
        self.rate = rate

    def __call__(self, x: jax.Array, *, deterministic: bool, rngs: nnx.Rngs | None) -> jax.Array:
        if deterministic or self.rate <= 0:
            return x
        return dropout(x, self.rate, rngs.dropout())
