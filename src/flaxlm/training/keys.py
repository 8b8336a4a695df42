"""A run's two keys, derived from its seed on the host: the one that initialises the model and
the one the train step draws its dropout masks from (`fold_in` per micro-batch).

`jax.random.split(jax.random.key(seed))` run eagerly compiles four small programs before the
first real one (a TPU pays each one's compile); the same Threefry hash in numpy gives the same
key data, bit for bit, and wrapping it in a typed key compiles nothing.

The dropout key's generator is `hardware.dropout_rng`. Threefry, JAX's default, draws the
same masks on every platform and layout; on a TPU its hash, written out for the CPU
(`flaxlm.models.dropout`), costs the train step 25-29 s of compile. The chip's own
RngBitGenerator (`rbg`, `unsafe_rbg`) compiles in a fraction of that, and draws other masks
than the CPU would: a run gives up bit-equality with the same run elsewhere.
"""

from __future__ import annotations

import jax
import numpy as np

from flaxlm.config import DropoutRng
from flaxlm.errors import FlaxlmError
from flaxlm.models.dropout import threefry2x32

# hardware.dropout_rng → JAX's name of the key implementation.
IMPLEMENTATIONS = {DropoutRng.threefry: "threefry2x32", DropoutRng.rbg: "rbg",
                   DropoutRng.unsafe_rbg: "unsafe_rbg"}


def dropout_impl(setting: DropoutRng | str, platform: str) -> str:
    """The key implementation hardware.dropout_rng comes to on `platform`: auto is unsafe_rbg
    on a TPU and threefry elsewhere, so that a CPU's or a GPU's masks stay those of JAX's
    default key. On a v5e the quickstart's train step compiled in 33.5 s with threefry
    dropout, 27.0 s with rbg (whose fold_in, once per dropout layer, is still a Threefry hash),
    20.6 s with unsafe_rbg and 18.5 s without dropout (docs/benchmarks.md); MaxText's default
    key is unsafe_rbg too."""
    setting = DropoutRng(setting)
    if setting is DropoutRng.auto:
        setting = DropoutRng.unsafe_rbg if platform == "tpu" else DropoutRng.threefry
    return IMPLEMENTATIONS[setting]


def _threefry_seed(seed: int) -> np.ndarray:
    """`jax.random.key(seed)`'s data: the seed's high and low 32 bits (JAX, without x64, takes
    the seed as an int32, whose high word is 0)."""
    if not -2**31 <= seed < 2**31:
        raise FlaxlmError(
            f"seed={seed} does not fit in a 32-bit signed integer, which JAX's keys are made "
            f"from: set seed between {-2**31} and {2**31 - 1}.")
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


def run_keys(seed: int, dropout_rng: str = "threefry2x32") -> tuple[jax.Array, jax.Array]:
    """(init key, dropout key): `jax.random.split(jax.random.key(seed))`, computed on the host.
    The dropout key is of the implementation `dropout_rng` (`dropout_impl`); an rbg key is
    what `jax.random.split(jax.random.key(seed, impl="rbg"))[1]` gives (rbg seeds and splits
    each half of its four words as a Threefry key), and unsafe_rbg is given the same words."""
    assert jax.config.jax_threefry_partitionable, "the split below is the partitionable one"
    init_words, dropout_words = _threefry_split(_threefry_seed(seed), 2)
    if dropout_rng != "threefry2x32":
        dropout_words = np.concatenate([dropout_words, dropout_words])
    return (jax.random.wrap_key_data(init_words, impl="threefry2x32"),
            jax.random.wrap_key_data(dropout_words, impl=dropout_rng))


def key_impl_name(key: jax.Array) -> str:
    """JAX's name of a typed key's implementation ("threefry2x32", "rbg", "unsafe_rbg")."""
    return str(jax.random.key_impl(key))
