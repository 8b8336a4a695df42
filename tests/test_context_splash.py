"""The splash kernel under the `context` mesh axis, and the balanced order of a row's positions
(`flaxlm.models.context_parallel`): the order and its inverse are exact and give every device
the same causal work; a step with the kernel (Pallas' interpret mode on the CPU) over rows in
that order equals the step on one device at every token, with and without document masking;
a boundary token's position and label are its own; `choose_backend` lets splash run under the
axis where its blocks divide each device's slice."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_config
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec
from numerics import assert_close, magnitude, tolerance, transformer_depth
from test_context_parallel import MODEL, OPTIMIZER, assert_same_step, batch, on_mesh

from flaxlm.config import AttentionBackend
from flaxlm.data.documents import INPUT_IDS, POSITIONS, SEGMENT_IDS
from flaxlm.errors import FlaxlmError
from flaxlm.models.attention import choose_backend
from flaxlm.models.build import build_lm
from flaxlm.models.context_parallel import (
    balanced_order,
    balanced_rows,
    causal_work,
    contiguous_rows,
    row_order,
    whole_row_contiguous,
)
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import Accelerator, make_mesh, traced_on
from flaxlm.training.optimizer import make_optimizer, make_schedule
from flaxlm.training.step import compile_steps, create_state, lm_token_losses

# ------------------------------------------------------------------- the order, in numpy


@settings(max_examples=60, deadline=None)
@given(context=st.integers(1, 16), chunk=st.integers(1, 24), block=st.sampled_from([1, 2, 4]))
def test_the_balanced_order_is_undone_exactly_and_gives_every_device_the_same_work(
        context, chunk, block):
    """The order is a permutation of the row's places that `whole_row_contiguous` (what a
    device does to the keys it gathered) undoes; each device's queries see as many keys
    under the causal mask, and as many blocks of a block-skipping kernel hold work for it,
    where a contiguous split gives the last device the most."""
    length = 2 * context * chunk * block
    order = balanced_order(length, context)
    assert sorted(order.tolist()) == list(range(length))
    row = np.random.default_rng(context).integers(0, 1 << 30, (3, length))
    in_order = row[:, order]
    np.testing.assert_array_equal(np.asarray(whole_row_contiguous(in_order, context, 1)), row)
    np.testing.assert_array_equal(in_order[:, np.argsort(order)], row)
    work = causal_work(order, context)
    assert (work == work[0]).all(), work
    contiguous = causal_work(np.arange(length), context)
    assert context == 1 or contiguous[-1] > contiguous[0]
    # The kernel's view: blocks of `block` queries × `block` keys with any pair to compute.
    q_blocks = order.reshape(context, -1, block)
    sees = q_blocks.max(axis=2)[:, :, None] >= np.arange(0, length, block)[None, None]
    blocks = sees.sum(axis=(1, 2))
    assert (blocks == blocks[0]).all(), blocks


def test_device_c_holds_chunks_c_and_2c_minus_1_minus_c():
    """The layout the docs promise, spelt out for C = 4 (8 chunks of 2)."""
    order = balanced_order(16, 4)
    assert order.reshape(4, 2, 2)[:, :, 0].tolist() == [[0, 14], [2, 12], [4, 10], [6, 8]]


# --------------------------------------------------------------- the order on a mesh


def test_rows_reach_each_device_in_the_balanced_order_and_come_back_contiguous():
    """On 8 simulated devices at context=8: a row's positions in the balanced order
    (`balanced_rows`, as the model's entry does it) put places c and 2C−1−c on device c, and
    `contiguous_rows` (the model's exit: two exchanges of chunks) gives the row back, split
    over the axis in the row's order, and its gradient (the exchanges reversed) too."""
    mesh = make_mesh(8, mesh_config(data=1, context=8))
    length, width = 64, 3

    def there_and_back(x_BxLxD, positions_BxL):
        order = row_order(length, True)
        positions = balanced_rows(positions_BxL, order)
        return contiguous_rows(jnp.take(x_BxLxD, order, axis=1), order), positions

    whole = NamedSharding(mesh, PartitionSpec())
    x_host = np.arange(2 * length * width, dtype=np.float32).reshape(2, length, width)
    x = jax.device_put(x_host, whole)
    positions = jax.device_put(np.broadcast_to(np.arange(length, dtype=np.int32),
                                               (2, length)), whole)
    back, placed = jax.jit(traced_on(mesh, there_and_back),
                           out_shardings=(NamedSharding(mesh, PartitionSpec(None, "context")),
                                          whole))(x, positions)
    np.testing.assert_array_equal(np.asarray(back), x_host)
    # The slices are the row's: each device holds its contiguous part.
    for shard in back.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), x_host[shard.index])
    np.testing.assert_array_equal(np.asarray(placed)[0], balanced_order(length, 8))
    weights = np.arange(x_host.size, dtype=np.float32).reshape(x_host.shape)
    grad = jax.jit(traced_on(mesh, jax.grad(
        lambda x: (there_and_back(x, positions)[0] * weights).sum())), out_shardings=whole)
    np.testing.assert_array_equal(np.asarray(grad(x)), weights)


# ----------------------------------------------------------- steps against one device

# llama-tiny's shape (two layers, 8 heads over 4 key/value heads) at 512 positions: at
# context=4 chunks of 64 and device slices of 128, the splash kernel's smallest blocks.
LENGTH = 512
ROWS = 2


def one_step(model, mesh, rows, balance: bool = True):
    """As tests/test_context_parallel.py's: a fresh state's metrics, parameters after an SGD
    step, and every token's loss before it, with the rows in the balanced order or not."""
    spec = TransformerSpec(model, balance_context=balance)
    tx = make_optimizer(OPTIMIZER, make_schedule(OPTIMIZER, total_steps=10))
    graphdef, state = create_state(build_lm(spec, nnx.Rngs(0)), tx, mesh)
    rows = on_mesh(rows, mesh)
    losses = jax.jit(traced_on(mesh, lambda params, rows: lm_token_losses(
        nnx.merge(graphdef, params), rows)[0]))(state.params, rows)
    state, metrics = compile_steps(mesh, graphdef, tx).train(state, rows, jax.random.key(0))
    return (jax.device_get(metrics), jax.device_get(nnx.to_pure_dict(state.params)),
            np.asarray(losses))


@functools.cache
def one_device(documents: bool):
    return one_step(MODEL, make_mesh(1), batch(documents, LENGTH, ROWS))


SPLASH_CASES = [("context=4", True, True), ("context=4", False, True),
                ("data=2 context=2 tensor=2", True, True), ("data=2 context=4", True, False)]
SPLASH_MESHES = {"context=4": (4, mesh_config(data=1, context=4)),
                 "data=2 context=2 tensor=2": (8, mesh_config(data=2, context=2, tensor=2)),
                 "data=2 context=4": (8, mesh_config(data=2, context=4))}


@pytest.mark.slow
@pytest.mark.parametrize("name,documents,balance", SPLASH_CASES,
                         ids=[f"{n}-{'documents' if d else 'rows'}-"
                              f"{'balanced' if b else 'contiguous'}" for n, d, b in SPLASH_CASES])
def test_a_step_with_the_splash_kernel_under_the_context_axis_equals_one_device(
        name, documents, balance):
    """The splash kernel (interpreted) on each device's slice of queries, the rows in the
    balanced order (and once in contiguous slices), against XLA's attention on one device:
    a query shown a key of a later place or of another document, a place or a label off by
    one at a chunk's edge, changes that token's loss by far more than the tolerance."""
    devices, mesh = SPLASH_MESHES[name]
    model = dataclasses.replace(MODEL, attention=AttentionBackend.splash)
    got = one_step(model, make_mesh(devices, mesh), batch(documents, LENGTH, ROWS), balance)
    assert_same_step(got, one_device(documents), tokens=ROWS * (LENGTH - 1))


# ------------------------------------------------------------- the chunks' boundaries

# A small llama (two layers of width 64) on 8 devices at context=8: 16 chunks of 8 positions,
# so 15 chunk boundaries in 128 tokens, through XLA's attention (seconds, not minutes). Its
# weights drawn ten times wider than llama's init, so that its attention is peaked and a
# position moved by one moves a loss by far more than round-off (at llama's 0.02, by 2e-4,
# below the comparison's tolerance of 3e-4: such a model hardly reads positions).
SMALL = dataclasses.replace(MODEL, hidden_size=64, num_heads=4, num_kv_heads=2, mlp_size=128,
                            max_positions=128, initializer_range=0.2,
                            attention=AttentionBackend.xla)


def token_losses(mesh, rows):
    return np.asarray(_token_losses(mesh)(on_mesh(rows, mesh)))


@functools.cache
def _token_losses(mesh):
    """SMALL's every token's loss on `mesh`, compiled once for the rows it is given."""
    graphdef, params = nnx.split(build_lm(TransformerSpec(SMALL), nnx.Rngs(0)), nnx.Param)
    losses = jax.jit(traced_on(mesh, lambda params, rows: lm_token_losses(
        nnx.merge(graphdef, params), rows)[0]))
    return functools.partial(losses, params)


@pytest.mark.slow  # 5 s alone, 8-11 s beside another worker: two programs compiled
def test_a_boundary_tokens_position_and_label_are_its_own_in_the_balanced_order():
    """Every token's loss at context=8 in the balanced order equals one device's within the
    derived tolerance, and that comparison sees one token off by one at a chunk's edge: the
    rows with one boundary token's position moved by one (what a misplaced chunk does to
    RoPE) or with the label of the token before it taken from one place further (a label
    shifted inside the permuted row instead of the row) miss those tokens' losses by
    hundreds of times the tolerance."""
    length = SMALL.max_positions
    ids = np.random.default_rng(1).integers(0, SMALL.vocab_size, (2, length)).astype(np.int32)
    rows = {INPUT_IDS: ids, SEGMENT_IDS: np.ones((2, length), np.int32),  # one document:
            POSITIONS: np.broadcast_to(np.arange(length, dtype=np.int32), (2, length))}
    one = token_losses(make_mesh(1), rows)
    split = token_losses(make_mesh(8, mesh_config(data=1, context=8)), rows)
    settings_ = dict(terms=2 * (length - 1), depth=transformer_depth(SMALL.num_layers))
    assert_close(split, one, **settings_)

    allowed = tolerance(**settings_) * magnitude(one)
    boundary = 7 * length // 16  # the first place of chunk 7, device 7's first chunk
    moved = {**rows, POSITIONS: rows[POSITIONS].copy()}
    moved[POSITIONS][:, boundary] += 1
    off = token_losses(make_mesh(1), moved)
    assert (np.abs(off - one)[:, boundary] > 100 * allowed).all()
    np.testing.assert_array_equal(off[:, :boundary], one[:, :boundary])  # causal: only later

    relabelled = {**rows, INPUT_IDS: ids.copy()}
    relabelled[INPUT_IDS][:, boundary] = ids[:, boundary + 1]
    off = token_losses(make_mesh(1), relabelled)
    assert (np.abs(off - one)[:, boundary - 1] > 100 * allowed).all()


# ---------------------------------------------------------------- choosing the backend

V5E = Accelerator("tpu", "TPU v5 lite")


def test_splash_runs_under_a_context_axis_where_its_blocks_divide_each_slice():
    """auto picks splash on a TPU under a context axis, XLA where a device's slice of a row
    is not a multiple of the kernel's 128-position blocks (and names why, asked for splash);
    cuDNN is refused under the axis, also on a GPU where auto would pick it."""
    choose = functools.partial(choose_backend, compute_dtype=jnp.bfloat16, head_width=64)
    assert choose("auto", V5E, seq_len=16384, context=8).backend is AttentionBackend.splash
    assert choose("splash", V5E, seq_len=4096, context=8).backend is AttentionBackend.splash
    assert choose("auto", V5E, seq_len=1024, context=16).backend is AttentionBackend.xla
    with pytest.raises(FlaxlmError, match="hardware.mesh.context=16 each device's slice of a "
                                          "row of 1024 is 64 positions"):
        choose("splash", V5E, seq_len=1024, context=16)
    with pytest.raises(FlaxlmError, match="model.attention=cudnn with hardware.mesh.context=4"):
        choose("cudnn", Accelerator("gpu", "NVIDIA H100", "9.0"), seq_len=4096, context=4)
    gpu = choose("auto", Accelerator("gpu", "NVIDIA H100", "9.0"), seq_len=4096, context=4)
    assert gpu.backend is AttentionBackend.xla and "context axis" in gpu.reason
