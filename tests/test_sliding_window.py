"""Sliding-window attention (`model.sliding_window`, Qwen2's first full-attention layers
`model.full_attention_layers`): the window is transformers' count (query i sees keys
i - W + 1 … i); every backend that takes it computes the windowed reference, with documents
packed in the row and under a context axis; cached decoding sees what the uncached pass sees;
Mistral and Qwen2 checkpoints read and write it with transformers' logits at rows longer than
the window; bad settings are one paragraph (and rows of tests/test_bad_input_table.py)."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import full_forward, mesh_config, model_config
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from numerics import assert_close, transformer
from test_attention import attention_settings, packed_segments, qkv
from test_open_presets import perturbed_torch, rotary, token_ids, torch_logits

from flaxlm.config import ModelFamily
from flaxlm.errors import FlaxlmError
from flaxlm.generate import left_pad
from flaxlm.models import hf, pretrained
from flaxlm.models.attention import attention, choose_backend, reference_attention, window_mask
from flaxlm.models.build import build_lm
from flaxlm.models.layers import (
    TransformerSpec,
    check_sliding_window,
    decode_step,
    empty_cache,
    windowed,
)
from flaxlm.parallel import BATCH_AXES, CONTEXT_AXIS, Accelerator, make_mesh, traced_on

BOS, EOS, PAD = 1, 2, 0
# test_open_presets' shape (2 layers of 64, 8 heads on 2 key/value heads) with a window of 8:
# its rows of 24 and 48 tokens are 3 and 6 windows long.
WINDOW = 8
SHAPE = dict(name="t", vocab_size=97, max_positions=64, hidden_size=64, num_layers=2,
             num_heads=8, num_kv_heads=2, mlp_size=96, initializer_range=0.1)
MISTRAL = dataclasses.replace(model_config("llama", **SHAPE, sliding_window=WINDOW,
                                           tie_word_embeddings=False),
                              family=ModelFamily.mistral)
# Qwen2 with its first layer attending to the whole row, the second windowed.
QWEN2 = model_config("qwen2", **SHAPE, sliding_window=WINDOW, full_attention_layers=1)
BASE = model_config("llama", name="x")


def run(backend, q, k, v, segment_ids=None, window=None):
    return attention(q, k, v, dropout_rate=0.0, rngs=None, is_causal=True,
                     segment_ids_BxL=segment_ids, backend=backend, window=window)


@functools.partial(jax.jit, static_argnames=("backend", "window"))
def loss_and_grads(q, k, v, segment_ids, *, backend, window):
    """The output, and the gradients wrt q, k, v of a fixed random projection of it."""
    probe = jax.random.normal(jax.random.key(99), q.shape, jnp.float32)

    def loss(q, k, v):
        return jnp.sum(run(backend, q, k, v, segment_ids, window) * probe)

    return run(backend, q, k, v, segment_ids, window), jax.grad(loss, (0, 1, 2))(q, k, v)


# ------------------------------------------------------------------------ the function


@pytest.mark.torch
def test_the_window_is_the_one_transformers_slides():
    """transformers' own mask function, at every (query, key) of a row, for windows of one
    token, a few, and longer than the row."""
    import torch
    from transformers.masking_utils import sliding_window_causal_mask_function

    places = np.arange(12)
    queries, keys = torch.arange(12)[:, None], torch.arange(12)[None, :]
    for window in (1, 3, 12, 20):
        theirs = sliding_window_causal_mask_function(window)
        expected = theirs(torch.tensor(0), torch.tensor(0), queries, keys).numpy()
        np.testing.assert_array_equal(window_mask(jnp.asarray(places), jnp.asarray(places),
                                                  window), expected)


def test_the_reference_attends_to_the_last_window_keys_only():
    """Each query's output is the softmax over exactly its window's keys (and its document's),
    spelled out here key by key; and the window changes the result (a wider one would not
    pass)."""
    q, k, v = qkv(0, 1, 20, 2, 2, 8)
    segments = jnp.asarray([[0] * 7 + [1] * 13])
    windowed_reference = jax.jit(functools.partial(reference_attention, is_causal=True),
                                 static_argnames="window")
    out = windowed_reference(q, k, v, segment_ids_BxL=segments, window=4)
    expected = np.zeros(out.shape)
    q_, k_, v_, documents = (np.asarray(x, np.float64)[0] for x in (q, k, v, segments))
    for i in range(20):
        seen = [j for j in range(max(0, i - 3), i + 1) if documents[j] == documents[i]]
        for n in range(2):
            scores = k_[seen, n] @ q_[i, n] / np.sqrt(8)
            weights = np.exp(scores - scores.max())
            expected[0, i, n] = (weights / weights.sum()) @ v_[seen, n]
    assert_close(out, expected, **attention_settings(q, k))
    wider = windowed_reference(q, k, v, segment_ids_BxL=segments, window=5)
    assert np.abs(np.asarray(wider) - expected).max() > 1e-2


@pytest.mark.parametrize("backend,length,heads", [
    ("xla", 40, (4, 2)),
    # The kernel's blocks are 128 keys: at 256 its window of 40 cuts through the block of
    # queries 128-255 over keys 0-127 (query 128 sees keys 89-128) and the diagonal ones.
    pytest.param("splash", 256, (4, 2), marks=pytest.mark.slow),
])
def test_each_backend_computes_the_windowed_reference(backend, length, heads):
    """Forward and gradients, grouped-query heads and packed documents, against the reference
    with the same window."""
    N, G = heads
    window = 40 if backend == "splash" else 9
    q, k, v = qkv(1, 1, length, N, G, 16)
    segments = packed_segments(2, 1, length, max_docs=2)  # documents longer than the window
    out, grads = loss_and_grads(q, k, v, segments, backend=backend, window=window)
    ref_out, ref_grads = loss_and_grads(q, k, v, segments, backend="reference", window=window)
    assert_close(out, ref_out, **attention_settings(q, k))
    for grad, ref_grad in zip(grads, ref_grads):
        assert_close(grad, ref_grad, **attention_settings(q, k, backward=True))
    unwindowed = run("reference", q, k, v, segments)
    assert np.abs(np.asarray(unwindowed) - np.asarray(ref_out)).max() > 1e-2


def test_the_window_under_a_context_axis_equals_one_device():
    """Each device of a context axis holds a quarter of each row's queries and gathers the
    row's keys: the window is measured from the queries' places in the row, also across
    slices and documents."""
    mesh = make_mesh(8, mesh_config(data=2, context=4))
    q, k, v = qkv(3, 2, 32, 4, 2, 8)
    segments = packed_segments(3, 2, 32, max_docs=3)
    slices = NamedSharding(mesh, PartitionSpec(BATCH_AXES, CONTEXT_AXIS))
    placed = [jax.device_put(x, slices) for x in (q, k, v)]
    rows = jax.device_put(segments, NamedSharding(mesh, PartitionSpec(BATCH_AXES)))
    step = traced_on(mesh, lambda q, k, v, s: run("xla", q, k, v, s, window=6))
    assert "all_gather" in str(jax.make_jaxpr(step)(*placed, rows))
    assert_close(jax.jit(step)(*placed, rows), run("reference", q, k, v, segments, window=6),
                 **attention_settings(q, k))


# ------------------------------------------------------------------------ decoding


def test_a_decoding_query_sees_its_last_window_tokens_whatever_lies_between_their_slots():
    """Left padding and another branch of a tree (`flaxlm.scoring`) sit between a query's
    slots: the window counts the tokens it sees, not slots."""
    cache = empty_cache(1, 10, 1, 1, 2, jnp.float32)
    ids_mask = jnp.asarray([[False, True, True, True, True, True, True, True, True]])
    branches = jnp.asarray([[0, 0, 0, 1, 1, 1, 2, 2, 2]])  # slot 0 is padding
    positions, _, mask = decode_step(cache, ids_mask, 9, branches)
    seen = np.asarray(windowed(mask, 3))[0]
    # Branch 2's second token (slot 7): itself, branch 2's first (slot 6), the trunk's last
    # (slot 2); not branch 1's slots 3-5 between them.
    assert np.flatnonzero(seen[7]).tolist() == [2, 6, 7]
    assert np.flatnonzero(seen[4]).tolist() == [2, 3, 4]
    assert np.flatnonzero(seen[1]).tolist() == [1]  # the first real token: itself only
    # A real token sees min(its position + 1, 3) tokens; the padding (slot 0), none.
    assert seen[1:].sum(axis=1).tolist() == np.minimum(np.asarray(positions)[0, 1:] + 1,
                                                       3).tolist()


@pytest.mark.slow
def test_cached_decoding_with_a_window_equals_the_full_forward_pass():
    """Qwen2 with a full-attention layer and a windowed one, left-padded prompts longer than
    the window, then new tokens one by one: each step's logits are the uncached pass's."""
    model = build_lm(TransformerSpec(QWEN2), nnx.Rngs(0))
    ids = jnp.asarray(token_ids((2, 24)))
    full = full_forward(model, ids)
    lengths = (20, 13)
    padded, mask = left_pad([ids[0, :20].tolist(), ids[1, :13].tolist()], 0)
    cache = model.init_cache(2, padded.shape[1] + 3)
    decode = nnx.jit(lambda m, *args: m.decode(*args))
    logits, cache = decode(model, jnp.asarray(padded), cache, jnp.asarray(mask))
    settings = transformer(QWEN2.num_layers, QWEN2.mlp_size)
    for row, length in enumerate(lengths):
        assert_close(logits[row, -length:], full[row, :length], **settings)
    for step in range(3):
        logits, cache = decode(model, jnp.asarray([[int(ids[row, length + step])]
                                                    for row, length in enumerate(lengths)]),
                               cache)
        for row, length in enumerate(lengths):
            assert_close(logits[row, 0], full[row, length + step], **settings)
    # Without the window the last token would see 21 tokens instead of 8: another result.
    unwindowed = dataclasses.replace(QWEN2, sliding_window=None, full_attention_layers=0)
    other = nnx.merge(nnx.graphdef(nnx.eval_shape(
        lambda: build_lm(TransformerSpec(unwindowed), nnx.Rngs(0)))), nnx.state(model))
    assert np.abs(np.asarray(full_forward(other, ids)) - np.asarray(full)).max() > 1e-3


# ------------------------------------------------------------------------ transformers


def save_torch(tmp_path, config_class: str, model_class: str, **fields):
    """A random PyTorch model of transformers' `model_class`, with noise on every weight,
    saved in `tmp_path`."""
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, initializer_range=0.1, **fields)
    theirs = perturbed_torch(getattr(transformers, model_class)(config))
    theirs.save_pretrained(tmp_path)
    return theirs


def import_export_round_trip(tmp_path, theirs, family: str):
    """`model.init_from` of the checkpoint in tmp_path/hf: logits at a row 6 windows long as
    transformers'; its export read back by transformers: the same again. The config, the
    model and its export's config.json."""
    config = pretrained.pretrained_model_config(str(tmp_path / "hf"), BASE)
    assert config.family is ModelFamily(family)
    model = nnx.eval_shape(lambda: build_lm(TransformerSpec(config), nnx.Rngs(0)))
    report = pretrained.load_pretrained_weights(model, str(tmp_path / "hf"))
    assert not report.missing and not report.unexpected
    ids = token_ids((2, 48))
    ours = np.asarray(full_forward(model, jnp.asarray(ids)))
    assert_close(ours, torch_logits(theirs, ids), **rotary(ids.shape[1]))
    values = hf.lm_config_json(config, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    hf.save_pretrained(str(tmp_path / "out"), nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                       values)
    import transformers

    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_close(ours, torch_logits(again, ids), **rotary(ids.shape[1]))
    # The window is at work: the same weights attending to the whole row differ.
    whole = dataclasses.replace(config, sliding_window=None, full_attention_layers=0)
    other = nnx.merge(nnx.graphdef(nnx.eval_shape(
        lambda: build_lm(TransformerSpec(whole), nnx.Rngs(0)))), nnx.state(model))
    assert np.abs(np.asarray(full_forward(other, jnp.asarray(ids))) - ours).max() > 1e-3
    return config, json.loads((tmp_path / "out" / "config.json").read_text())


@pytest.mark.torch
def test_a_mistral_checkpoint_with_a_window_imports_and_exports_with_equal_logits(tmp_path):
    theirs = save_torch(tmp_path / "hf", "MistralConfig", "MistralForCausalLM",
                        sliding_window=WINDOW, tie_word_embeddings=False)
    config, saved = import_export_round_trip(tmp_path, theirs, "mistral")
    assert (config.sliding_window, config.full_attention_layers) == (WINDOW, 0)
    assert (config.qkv_bias, config.attention_bias, config.mlp_bias) == (False, False, False)
    assert (saved["model_type"], saved["sliding_window"]) == ("mistral", WINDOW)


@pytest.mark.torch
def test_a_qwen2_checkpoint_with_a_window_past_its_first_layer_round_trips(tmp_path):
    theirs = save_torch(tmp_path / "hf", "Qwen2Config", "Qwen2ForCausalLM",
                        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                        tie_word_embeddings=True)
    assert theirs.config.layer_types == ["full_attention", "sliding_attention"]
    config, saved = import_export_round_trip(tmp_path, theirs, "qwen2")
    assert (config.sliding_window, config.full_attention_layers) == (WINDOW, 1)
    assert {key: saved[key] for key in ("use_sliding_window", "sliding_window",
                                        "max_window_layers")} == {
        "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}


def test_an_export_without_a_window_says_so_where_the_config_class_would_slide_one():
    """MistralConfig slides a window of 4096 unless config.json says null; Qwen2Config slides
    none unless use_sliding_window, so a windowless Qwen2 export writes what it always did."""
    mistral = dataclasses.replace(MISTRAL, sliding_window=None)
    values = hf.lm_config_json(mistral, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    assert "sliding_window" in values and values["sliding_window"] is None
    qwen2 = dataclasses.replace(QWEN2, sliding_window=None, full_attention_layers=0)
    values = hf.lm_config_json(qwen2, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    assert not {"use_sliding_window", "sliding_window", "max_window_layers"} & set(values)


# ------------------------------------------------------------------------ bad settings


@pytest.mark.parametrize("family,fields,named", [
    ("mistral", dict(sliding_window=0), "model.sliding_window=0"),
    ("qwen2", dict(sliding_window=-4), "model.sliding_window=-4"),
    ("gpt2", dict(sliding_window=16), "model.family=gpt2, which has no sliding window"),
    ("bert", dict(sliding_window=16), "model.family=bert, which has no sliding window"),
    ("llama", dict(sliding_window=16), "model.family=llama, which has no sliding window"),
    ("qwen2", dict(sliding_window=16, full_attention_layers=6),
     "model.full_attention_layers=6"),
    ("qwen2", dict(full_attention_layers=1), "0 without model.sliding_window"),
    ("qwen2", dict(sliding_window=16, full_attention_layers=1, scan_layers=True),
     "model.scan_layers=true"),
])
def test_a_window_the_model_cannot_slide_is_one_paragraph(family, fields, named):
    if family == "mistral":
        config = dataclasses.replace(MISTRAL, num_layers=6, **fields)
    else:
        config = model_config(family, num_layers=6, **fields)
    with pytest.raises(FlaxlmError, match="model.") as error:
        check_sliding_window(config)
    assert named in str(error.value) and "\n" not in str(error.value)


def test_cudnn_is_refused_for_a_window_and_auto_takes_what_slides_one():
    gpu = Accelerator("gpu", "NVIDIA H100 80GB HBM3", "9.0")
    tpu = Accelerator("tpu", "TPU v5 lite")
    with pytest.raises(FlaxlmError, match="model.attention=cudnn .*model.sliding_window=64"):
        choose_backend("cudnn", gpu, "bfloat16", 2048, 64, window=64)
    assert choose_backend("cudnn", gpu, "bfloat16", 2048, 64).backend.value == "cudnn"
    assert choose_backend("auto", gpu, "bfloat16", 2048, 64, window=64).backend.value == "xla"
    assert choose_backend("auto", tpu, "bfloat16", 2048, 64, window=64).backend.value == \
        "splash"


def test_the_flops_count_a_windowed_layers_pairs_as_palms_formula_counts_the_causal_ones():
    """PaLM's 12·N·H·L per layer counts all L×L pairs, twice the causal ones; a windowed
    layer's pairs, counted on the mask, twice as well: what `attended_length` gives."""
    from flaxlm.models.layers import attended_length, training_flops_per_token

    for seq_len, window in [(64, 8), (64, 63), (64, 64), (64, 100), (4096, 512)]:
        pairs = int(window_mask(jnp.arange(seq_len), jnp.arange(seq_len), window).sum())
        causal = seq_len * (seq_len + 1) // 2
        # The formula's are the continuous ones: a mask's diagonal adds 1/L to each count.
        assert attended_length(seq_len, window) / seq_len == pytest.approx(pairs / causal,
                                                                           rel=1.0 / seq_len)
    # Qwen2's first layer at the whole row, the second windowed: the attention term's half.
    whole = dataclasses.replace(QWEN2, sliding_window=None, full_attention_layers=0)
    attention_term = (training_flops_per_token(whole, 0, 64)
                      - training_flops_per_token(dataclasses.replace(whole, num_layers=1), 0, 64))
    assert training_flops_per_token(QWEN2, 0, 64) == pytest.approx(
        attention_term * (1 + attended_length(64, WINDOW) / 64))
