"""The optimizer's numbers are arguments of the compiled train step (issue 52, goal 6): a sweep
over them compiles its train step once, and every step is what it was with the numbers as
constants, to the bit."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, config_node, user_env
from flax import nnx

from flaxlm.models.gpt2 import GPT2LMHeadModel
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import global_batch, make_mesh
from flaxlm.training.hyperparams import Rate
from flaxlm.training.optimizer import make_optimizer, make_schedule
from flaxlm.training.step import compile_steps, create_state


@pytest.mark.slow
def test_every_optimizer_and_schedule_steps_as_with_constants_to_the_bit():
    """tests/constant_optimizers.py, with a user's compiler settings: every schedule's learning
    rate at every step, each optimizer's steps (losses, parameters, optimizer state and its
    layout) and adamw's compiled train step (every metric) equal those of the optimizers
    built with Python constants, bit for bit."""
    script = Path(__file__).with_name("constant_optimizers.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=user_env(XLA_FLAGS="", JAX_PLATFORMS="cpu"), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_a_rate_answers_only_the_complement_it_was_given():
    """optax's `1 - b2` of a Rate is the host's float64 1 − b2 rounded once, as a constant's
    was, not float32's 1 − f32(b2); anything else is the rate itself."""
    b2 = Rate(jnp.asarray(0.95), jnp.asarray(1 - 0.95))
    assert float(1 - b2) == np.float32(1 - 0.95)
    assert float(1 - b2) != float(1 - jnp.float32(0.95))
    assert float(b2 * 2.0) == float(2.0 * b2) == np.float32(0.95) * 2
    assert float(jax.jit(lambda rate: rate**2)(b2)) == np.float32(0.95) ** 2  # a pytree
    with pytest.raises(TypeError, match="only 1 - rate"):
        _ = 2 - b2


def test_a_weight_decay_of_0_from_the_command_line_is_a_float():
    """`optimizer.weight_decay=0` arrives as the integer 0: passed as such it would be an
    int32 argument, another program than 0.1's."""
    opt = config_node("optimizer", ["optimizer=adamw"], weight_decay=0, warmup_steps=0)
    arguments = make_optimizer(opt, make_schedule(opt, total_steps=4)).arguments()
    assert arguments["weight_decay"].dtype == jnp.float32
    assert all(value.weak_type for value in arguments.values())


@pytest.mark.slow  # several seconds: make test runs it
def test_runs_that_differ_only_in_optimizer_numbers_lower_to_one_program():
    """lr, weight decay, warmup, b2, eps, end_lr and clipping's norm are the step's arguments:
    two runs that differ in all of them give the jitted train step the same HLO, which JAX's
    persistent cache compiles once; their learning rates differ, so the numbers reach it."""
    mesh = make_mesh(1)
    rows = global_batch(np.random.default_rng(0).integers(0, 512, (2, 16)).astype(np.int32),
                        mesh)
    base = config_node("optimizer", ["optimizer=adamw"], max_grad_norm=1.0)
    variants = [base, dataclasses.replace(base, lr=1e-3, weight_decay=0, warmup_steps=2,
                                          b2=0.95, eps=1e-6, end_lr=1e-5, max_grad_norm=0.5)]
    programs, rates = [], []
    for opt in variants:
        tx = make_optimizer(opt, make_schedule(opt, total_steps=10))
        model = GPT2LMHeadModel(TransformerSpec(config_node("model", TINY)), nnx.Rngs(0))
        graphdef, state = create_state(model, tx, mesh)
        train = compile_steps(mesh, graphdef, tx).train
        programs.append(train.lower(state, rows, jax.random.key(0)).as_text())
        rates.append(float(train(state, rows, jax.random.key(0))[1]["learning_rate"]))
    assert programs[0] == programs[1]
    assert rates == [float(np.float32(0.0003)), 0.0]  # the second run's first warmup step
