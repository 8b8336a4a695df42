"""A run compiles one program per role: the model's initialisation and its optimizer state's, the
train step, the eval step and, with samples, the generation; nothing else. Each stray eager
operation on a device array (a key split, a `jnp.asarray`, a `jnp.zeros`) is a program of its
own, which a TPU takes a second or more to compile before the first step (issue 52)."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest
from conftest import TINY, compose
from jax import monitoring

from flaxlm.errors import FlaxlmError
from flaxlm.job import train
from flaxlm.training.keys import run_keys, seed_key

# JAX records this event around every XLA compilation (or persistent-cache load), with the
# jitted function's name.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

ROLES = collections.Counter({
    "jit(init_model)": 1,  # the parameters, made on the mesh (flaxlm.parallel.initializer)
    "jit(init_optimizer)": 1,  # the optimizer state, laid out like them (create_state)
    "jit(eval_step)": 1,
    "jit(train_step)": 1,
    "jit(_generate_tokens)": 1,  # the samples at the end: prompt and decoding in one program
})


@pytest.mark.slow
def test_the_quickstart_compiles_one_program_per_role(tmp_path):
    compiled = collections.Counter()

    def count(event: str, duration: float, **metadata) -> None:
        if event == COMPILE_EVENT:
            compiled[metadata.get("fun_name")] += 1

    # Whatever the tests before compiled is compiled again: a program an earlier test left in
    # JAX's caches would otherwise go uncounted here.
    jax.clear_caches()
    monitoring.register_event_duration_secs_listener(count)
    try:
        train(compose([*TINY, "trainer.max_steps=2", "trainer.eval_every_steps=1",
                       "samples.prompts=['', 'The']", "samples.max_new_tokens=3"],
                      run_dir=tmp_path / "run"))
    finally:
        monitoring.unregister_event_duration_listener(count)
    assert compiled == ROLES


def data(key: jax.Array) -> np.ndarray:
    return np.asarray(jax.random.key_data(key))


@pytest.mark.parametrize("seed", [0, 1, 42, -7, 2**31 - 1, -2**31])
def test_the_keys_made_on_the_host_are_jax_randoms_own(seed):
    """The run's keys, made with numpy to spare the programs, are those it made before."""
    init_key, dropout_key = jax.random.split(jax.random.key(seed))
    ours = run_keys(seed)
    np.testing.assert_array_equal(data(ours[0]), data(init_key))
    np.testing.assert_array_equal(data(ours[1]), data(dropout_key))
    np.testing.assert_array_equal(data(seed_key(seed)), data(jax.random.key(seed)))


def test_a_seed_past_32_bits_is_refused_naming_the_setting():
    with pytest.raises(FlaxlmError, match=r"seed=4294967296 does not fit .* set seed between"):
        run_keys(2**32)
