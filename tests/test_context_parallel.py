"""Context parallelism changes nothing but where each row's positions live: on 8 simulated CPU
devices a step with every row's positions split over the `context` mesh axis (attention
gathering the row's keys and values, `flaxlm.models.attention.context_attention`) equals the
step on one device, with and without document masking, at every token; bad settings are
refused before anything compiles (tests/test_bad_input_table.py)."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from conftest import SHORT, TINY, compose, config_node, mesh_config
from flax import nnx
from numerics import assert_close, magnitude, transformer_depth

from flaxlm.config import ContextAttention
from flaxlm.data.documents import INPUT_IDS, POSITIONS, SEGMENT_IDS
from flaxlm.errors import FlaxlmError
from flaxlm.models.build import build_lm
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import context_size, global_batch, make_mesh, traced_on
from flaxlm.tasks.base import attention_choice, eval_batch_size
from flaxlm.training.optimizer import make_optimizer, make_schedule
from flaxlm.training.step import compile_steps, create_state, lm_token_losses

# llama-tiny's shape (8 heads, 4 key/value), two layers of its six, at up to 4096 positions:
# a row whose attention a device would hold whole is what the axis splits.
LENGTH = 4096
MODEL = config_node("model", ["model=llama-tiny"], max_positions=LENGTH, num_layers=2,
                    vocab_size=512, attention="xla")
OPTIMIZER = config_node("optimizer", ["optimizer=sgd"], lr=1e-2)
MESHES = {"context=8": mesh_config(data=1, context=8),
          "context=4 data=2": mesh_config(data=2, context=4),
          "data=2 context=2 tensor=2": mesh_config(data=2, context=2, tensor=2)}


def batch(documents: bool, length: int = LENGTH, rows: int = 2):
    """`rows` rows of random tokens; with `documents`, each row cut into documents of random
    lengths (some crossing every slice boundary of every mesh above), positions counted from
    each document's start."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, MODEL.vocab_size, (rows, length)).astype(np.int32)
    if not documents:
        return ids
    starts = rng.random((rows, length)) < 1 / 150
    starts[:, 0] = True
    places = np.arange(length)
    positions = places - np.maximum.accumulate(np.where(starts, places, 0), axis=1)
    return {INPUT_IDS: ids, SEGMENT_IDS: np.cumsum(starts, axis=1).astype(np.int32),
            POSITIONS: positions.astype(np.int32)}


def on_mesh(rows, mesh):
    return jax.tree.map(lambda a: global_batch(a, mesh), rows)


def one_step(mesh, rows, model=MODEL):
    """A fresh state's train step on `mesh` over `rows`: its metrics, parameters after it,
    and the per-token losses before it (B, L-1), on the host."""
    tx = make_optimizer(OPTIMIZER, make_schedule(OPTIMIZER, total_steps=10))
    graphdef, state = create_state(build_lm(TransformerSpec(model), nnx.Rngs(0)), tx, mesh)
    rows = on_mesh(rows, mesh)
    losses = jax.jit(traced_on(mesh, lambda params, rows: lm_token_losses(
        nnx.merge(graphdef, params), rows)[0]))(state.params, rows)
    steps = compile_steps(mesh, graphdef, tx)
    state, metrics = steps.train(state, rows, jax.random.key(0))
    return (jax.device_get(metrics), jax.device_get(nnx.to_pure_dict(state.params)),
            np.asarray(losses))


@functools.cache
def reference(documents: bool, length: int, rows: int):
    return one_step(make_mesh(1), batch(documents, length, rows))


# (mesh, document masking, positions, rows): the 4096 positions at context=8 with
# documents, the other layouts at 1024 (a sixteenth of the attention's work on the CPU).
CASES = [("context=8", True, 4096, 1), ("context=8", False, 1024, 2),
         ("context=4 data=2", True, 1024, 2), ("context=4 data=2", False, 1024, 2),
         ("data=2 context=2 tensor=2", True, 1024, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("name,documents,length,rows", CASES,
                         ids=[f"{n}-{'documents' if d else 'rows'}-{length}"
                              for n, d, length, _ in CASES])
def test_a_step_with_rows_split_over_the_context_axis_equals_one_device(name, documents,
                                                                        length, rows):
    """Loss, gradient norm, the parameters after an SGD step (the gradient, lr times), and
    every token's loss before it. A boundary token given the wrong position or label, or a
    query shown a key of the next slice or another document, changes that token's loss by
    far more than the tolerance: the per-token comparison is what sees one such token among
    thousands."""
    assert_step_equals_one_device(MODEL, name, documents, length, rows)


# The ring (model.context_attention=ring): rows of 256 positions, slices of 32 or 64, so that
# documents (one in 150 tokens starts one) cross slice boundaries and the ring's every step
# (a slice skipped, seen whole, masked by documents) runs.
RING = dataclasses.replace(MODEL, context_attention=ContextAttention.ring)
RING_CASES = [(name, documents, 256, 2) for name in ("context=8", "context=4 data=2")
              for documents in (True, False)]


@pytest.mark.slow
@pytest.mark.parametrize("name,documents,length,rows", RING_CASES,
                         ids=[f"{n}-{'documents' if d else 'rows'}"
                              for n, d, _, _ in RING_CASES])
def test_a_step_under_ring_attention_equals_one_device(name, documents, length, rows):
    """As above, with the keys and values passed round the context axis (their gradients
    JAX's, through the ring's loop)."""
    assert_step_equals_one_device(RING, name, documents, length, rows)


def assert_step_equals_one_device(model, name, documents, length, rows):
    """`model`'s step on the mesh `name` equals the step on one device (the tolerances: the
    step's longest sum, its targets, through the depth of the forward or backward pass)."""
    metrics, params, losses = one_step(make_mesh(8, MESHES[name]),
                                       batch(documents, length, rows), model)
    assert_same_step((metrics, params, losses), reference(documents, length, rows),
                     tokens=rows * (length - 1))


def assert_same_step(got, expected, tokens: int):
    """Two steps' (metrics, parameters after it, per-token losses) equal within the tolerances
    tests/numerics.py derives: `tokens` the longest sum (the step's targets), through the depth
    of the forward or backward pass; parameters at the scale of their change from the start."""
    (metrics, params, losses), (metrics_1, params_1, losses_1) = got, expected
    forward = dict(terms=tokens, depth=transformer_depth(MODEL.num_layers))
    backward = dict(terms=tokens, depth=transformer_depth(MODEL.num_layers, backward=True))
    assert_close(losses, losses_1, **forward)
    assert_close(metrics["loss"], metrics_1["loss"], **forward)
    assert_close(metrics["grad_norm"], metrics_1["grad_norm"], **backward)
    start = jax.device_get(nnx.to_pure_dict(nnx.state(
        build_lm(TransformerSpec(MODEL), nnx.Rngs(0)), nnx.Param)))
    jax.tree.map(lambda a, b, s: assert_close(a, b, scale=magnitude(b - s), **backward),
                 params, params_1, start)


def step_temporaries(mesh, rows: int) -> int:
    """The bytes of temporaries one device holds in a train step on `mesh` of `rows` rows
    (XLA's memory analysis of the compiled step): its activations, mostly."""
    tx = make_optimizer(OPTIMIZER, make_schedule(OPTIMIZER, total_steps=10))
    graphdef, state = create_state(build_lm(TransformerSpec(MODEL), nnx.Rngs(0)), tx, mesh)
    steps = compile_steps(mesh, graphdef, tx)
    compiled = steps.train.lower(state, on_mesh(batch(False, rows=rows), mesh),
                                 jax.random.key(0)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_a_device_holds_an_eighth_of_a_rows_activations_at_context_8():
    """The issue's figure: a device's temporaries in a step over one row of 4096 positions at
    context=8 are at most 1.2/8 of one device's holding the whole row (what stays whole on
    every device: the gradients of the replicated parameters, a row's token ids)."""
    whole = step_temporaries(make_mesh(1), rows=1)
    split = step_temporaries(make_mesh(8, MESHES["context=8"]), rows=1)
    assert split <= 1.2 / 8 * whole, (split, whole, split / whole)


@pytest.mark.slow
@pytest.mark.parametrize("family", [[], ["model=llama-tiny", "model.num_layers=2",
                                         "model.hidden_size=64", "model.num_heads=4",
                                         "model.num_kv_heads=2", "model.vocab_size=512",
                                         "model.max_positions=64",
                                         "task.document_masking=true"]],
                         ids=["gpt2", "llama-documents"])
def test_a_run_trains_and_evaluates_with_a_context_axis(train_cli, tmp_path, family):
    """flaxlm-train end to end with context=8 on 8 devices: GPT-2 (attention dropout: the
    reference path, laid out by the compiler) and Llama with document masking (the gathered
    keys and values), through training, evaluation and the checkpoint."""
    from conftest import metrics_of

    run_dir = tmp_path / "run"
    done = train_cli(*SHORT, *family, "hardware.mesh.data=1", "hardware.mesh.context=8",
                     "trainer.max_steps=2", "trainer.eval_every_steps=2",
                     f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    evals = [r for r in metrics_of(run_dir) if "eval/loss" in r]
    assert evals and np.isfinite(evals[-1]["eval/loss"])


def test_the_global_batch_counts_row_shards_not_devices():
    """The devices of a context (or tensor) axis share their rows: with context=4 on 8
    devices the rows split 2 ways, so 2 rows per device make 4 rows a step (each device holds
    2 rows of a quarter of their positions), and a global batch of 2 splits evenly."""
    from omegaconf import OmegaConf

    from flaxlm.training.plan import global_batch_size

    split = ["hardware.mesh.data=2", "hardware.mesh.context=4"]
    config = OmegaConf.to_object(compose([*TINY, *split]))
    assert global_batch_size(config, 8) == 2 * 2
    fixed = OmegaConf.to_object(compose([*TINY, *split, "trainer.global_batch_size=2"]))
    assert global_batch_size(fixed, 8) == 2
    uneven = OmegaConf.to_object(compose([*TINY, *split, "trainer.global_batch_size=3"]))
    with pytest.raises(FlaxlmError, match="2 row shard.*8 devices.*multiple of 2"):
        global_batch_size(uneven, 8)
    tensor = OmegaConf.to_object(compose([*TINY, "hardware.mesh.data=2",
                                          "hardware.mesh.context=2", "hardware.mesh.tensor=2"]))
    assert global_batch_size(tensor, 8) == 2 * 2
    assert eval_batch_size(tensor.hardware, 8) == 2 * 2


@pytest.mark.parametrize("data,context_axis", [(1, True), (8, False)])
def test_a_context_of_minus_1_is_the_devices_left(data, context_axis):
    """hardware.mesh.context=-1 takes the devices the other axes leave: with data=1 all 8 (an
    axis, which `auto` attention meets with xla), with data=8 one (no axis at all)."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_object(compose([*TINY, "model=llama-tiny", "model.max_positions=64",
                                          f"hardware.mesh.data={data}",
                                          "hardware.mesh.context=-1"]))
    assert context_size(config.hardware) == (8 if context_axis else 1)
    choice = attention_choice(config, config.model, pads_rows=False)
    assert ("under a context axis" in choice.describe()) is context_axis, choice.describe()
