"""Data parallelism changes nothing but speed: 8 simulated devices equal 1 device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import config_node, model_config
from flax import nnx
from numerics import assert_close, magnitude, transformer_depth

from flaxlm.data.loader import block_loader, block_rows, eval_batches
from flaxlm.models.gpt2 import GPT2LMHeadModel
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import global_batch, make_mesh, replicated
from flaxlm.training.evaluation import LMEvaluator
from flaxlm.training.optimizer import make_optimizer, make_schedule
from flaxlm.training.step import compile_steps, create_state, next_token_losses

MODEL = model_config(name="t", vocab_size=128, max_positions=16, hidden_size=32, num_layers=2,
                     num_heads=4)
# SGD, whose update is linear in the gradient: Adam's first update is about sign(g), which flips
# for a gradient near eps (the key projection's bias has a gradient of exactly 0 in exact
# arithmetic, rounding noise in float32) under any change of summation order.
OPTIMIZER = config_node("optimizer", ["optimizer=sgd"], lr=1e-2)
TOKENS = 16 * 15  # the targets of the one batch: the longest sum in a step's loss and gradients


def build(num_devices):
    mesh = make_mesh(num_devices)
    schedule = make_schedule(OPTIMIZER, total_steps=10)
    tx = make_optimizer(OPTIMIZER, schedule)
    graphdef, state = create_state(GPT2LMHeadModel(TransformerSpec(MODEL), nnx.Rngs(0)), tx)
    state = jax.device_put(state, replicated(mesh))
    return mesh, graphdef, state, compile_steps(mesh, graphdef, tx)


def blocks(num, seed=0):
    return np.random.default_rng(seed).integers(0, 128, (num, 16)).astype(np.int32)


@pytest.mark.slow
def test_one_step_on_8_devices_equals_one_step_on_1_device():
    batch = blocks(16)
    results = []
    for devices in (1, 8):
        mesh, _, state, steps = build(devices)
        inputs = global_batch(batch, mesh)
        assert len(inputs.sharding.device_set) == devices
        state, metrics = steps.train(state, inputs, jax.random.key(0))
        results.append((jax.device_get(metrics), jax.device_get(nnx.to_pure_dict(state.params))))
    (metrics_1, params_1), (metrics_8, params_8) = results
    # The devices' shares are summed in another order: the same sums, reordered.
    assert_close(metrics_8["loss"], metrics_1["loss"], terms=TOKENS,
                 depth=transformer_depth(MODEL.num_layers))
    gradients = dict(terms=TOKENS, depth=transformer_depth(MODEL.num_layers, backward=True))
    assert_close(metrics_8["grad_norm"], metrics_1["grad_norm"], **gradients)
    start = jax.device_get(nnx.to_pure_dict(build(1)[2].params))
    # Each parameter is its start plus lr × its gradient: the step carries the gradient's error.
    steps = jax.tree.map(lambda a, b: a - b, params_1, start)
    jax.tree.map(lambda a, b, step: assert_close(a, b, scale=magnitude(step), **gradients),
                 params_8, params_1, steps)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), params_8, start))
    assert max(moved) > 1e-4  # the step did update the parameters


@pytest.mark.slow
@pytest.mark.parametrize("num_blocks", [1, 13, 37])
def test_eval_on_8_devices_counts_every_token_once(num_blocks):
    """37 blocks over a global eval batch of 16 (8 devices × 2): the last batch is padded."""
    data = blocks(num_blocks, seed=num_blocks)
    token_bytes = np.arange(128, dtype=np.int32) % 5
    mesh, graphdef, state, steps = build(8)
    evaluate = LMEvaluator(steps, data, 16, mesh, jax.device_put(token_bytes, replicated(mesh)))
    result = evaluate(state.params)

    model = nnx.merge(graphdef, jax.device_get(state.params))
    losses = np.asarray(next_token_losses(model(jnp.asarray(data)), jnp.asarray(data)))
    assert losses.size == num_blocks * 15
    # The same forward pass batched otherwise, and its losses summed in another order.
    settings = dict(terms=losses.size, depth=transformer_depth(MODEL.num_layers))
    assert_close(result["eval/loss"], losses.mean(), **settings)
    # exp turns the loss's absolute error into perplexity's relative error: × the loss.
    assert_close(result["eval/perplexity"], np.exp(losses.mean()), **settings,
                 amplification=max(1.0, float(losses.mean())))
    expected_bpb = losses.sum() / (np.log(2) * token_bytes[data[:, 1:]].sum())
    assert_close(result["eval/bits_per_byte"], expected_bpb, **settings)


def test_eval_batches_pad_the_last_batch_and_mask_it():
    mesh = make_mesh(8)
    batches = eval_batches(21, 8, mesh, block_rows(blocks(21), 8, mesh))
    got = [(np.asarray(x), np.asarray(m)) for x, m in batches]
    assert [len(x) for x, _ in got] == [8, 8, 8]
    assert [int(m.sum()) for _, m in got] == [8, 8, 5]
    np.testing.assert_array_equal(np.concatenate([x for x, _ in got])[:21], blocks(21))


def test_train_loader_shuffles_each_epoch_and_drops_the_incomplete_batch():
    data = np.arange(50, dtype=np.int32)[:, None].repeat(4, axis=1)  # row i is all i
    loader = block_loader(data, global_batch_size=8, mesh=make_mesh(8), seed=0)
    assert loader.steps_per_epoch == 6
    epochs = [[np.asarray(b)[:, 0] for b in loader.epoch(e)] for e in range(2)]
    for rows in epochs:
        seen = np.concatenate(rows)
        assert len(seen) == 48 and len(set(seen)) == 48  # no block twice within an epoch
    assert not np.array_equal(np.concatenate(epochs[0]), np.concatenate(epochs[1]))
    again = [np.asarray(b)[:, 0] for b in loader.epoch(1)]
    np.testing.assert_array_equal(np.concatenate(again), np.concatenate(epochs[1]))  # seeded
    resumed = [np.asarray(b)[:, 0] for b in loader.epoch(1, start_step=4)]
    np.testing.assert_array_equal(np.concatenate(resumed), np.concatenate(epochs[1][4:]))
