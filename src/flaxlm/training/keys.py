"""A run's two keys, derived from its seed on the host: the one that initialises the model and
the one the train step draws its dropout masks from (`fold_in` per micro-batch).

`jax.random.split(jax.random.key(seed))` run eagerly compiles four small programs before the
first real one (a TPU pays each one's compile); the same Threefry hash in numpy gives the same
key data, bit for bit, and wrapping it in a typed key compiles nothing.
"""

from __future__ import annotations

import jax
import numpy as np

from flaxlm.models.dropout import threefry2x32


def _threefry_seed(seed: int) -> np.ndarray:
    """`jax.random.key(seed)`'s data: the seed's high and low 32 bits (JAX, without x64, takes
    the seed as an int32, whose high word is 0)."""
    if not -2**31 <= seed < 2**31:
        raise OverflowError(f"seed={seed} does not fit in an int32")
    return np.array([0, seed & 0xFFFFFFFF], np.uint32)


def seed_key(seed: int) -> jax.Array:
    """`jax.random.key(seed)`, made on the host."""
    return jax.random.wrap_key_data(_threefry_seed(seed), impl="threefry2x32")


def _threefry_split(words: np.ndarray, num: int) -> np.ndarray:
    """`jax.random.split`'s key data for a Threefry key (partitionable counters, JAX's
    default): key i is the hash of the counter (0, i)."""
    high, low = threefry2x32((words[0], words[1]), np.zeros(num, np.uint32),
                             np.arange(num, dtype=np.uint32))
    return np.stack([high, low], axis=1)


def run_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """(init key, dropout key): `jax.random.split(jax.random.key(seed))`, computed on the host."""
    assert jax.config.jax_threefry_partitionable, "the split below is the partitionable one"
    init_words, dropout_words = _threefry_split(_threefry_seed(seed), 2)
    return (jax.random.wrap_key_data(init_words, impl="threefry2x32"),
            jax.random.wrap_key_data(dropout_words, impl="threefry2x32"))
