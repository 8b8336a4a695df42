"""Documents stay apart in packed blocks (task.document_masking): packing records where each
document starts (cached blocks and streamed ones alike), a block's segment ids and positions
follow, and the models attend within a document with positions restarting at it, so a packed
block's logits are each document's (or each piece's, for a document cut by a block boundary)
logits run alone, for GPT-2 and Llama. Evaluation counts the same predictions. Off, nothing
changes: the batch is the plain token array, and the cache keys are the ones runs already have.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SHORT, TINY, compose, documents, make_tokenizer, metrics_of, write
from conftest import model_config as family_config
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numerics import approx, assert_close, transformer

from flaxlm.config import upgrade_saved_config
from flaxlm.data.documents import block_starts, layout, with_documents
from flaxlm.data.packing import pack_blocks, tokenize_and_pack
from flaxlm.data.streaming import pack_stream
from flaxlm.data.tables import text_dataset
from flaxlm.errors import FlaxlmError
from flaxlm.models.attention import attention
from flaxlm.models.build import build_lm
from flaxlm.models.layers import TransformerSpec
from flaxlm.training.step import eval_step, next_token_losses

FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EOS = 2
BLOCK = 16  # one packed shape: each example compiles only the pieces it runs alone
# Both models' logits, packed or alone: 2 layers, GPT-2's MLP (4 × 32) the widest reduction.
LOGITS = transformer(2, 4 * 32)

# Document lengths (EOS included) of a stream long enough for a block and a cut document.
lengths = st.lists(st.integers(1, 2 * BLOCK), min_size=1, max_size=8).filter(
    lambda ls: sum(ls) >= BLOCK)


def reference_layout(doc_lengths: list[int], first: int, length: int, prefixed: bool = True):
    """Segment ids and positions of the stream's tokens [first, first+length), spelt out: a
    new segment at every document and at the block's first token. A document's tokens are
    its own, but for its closing EOS, which opens the next document unless documents are
    `prefixed` (their prefix opens them)."""
    owner = [doc + (i == n - 1 and not prefixed) for doc, n in enumerate(doc_lengths)
             for i in range(n)][first:first + length]
    segments, positions = [], []
    for i, doc in enumerate(owner):
        new = i == 0 or doc != owner[i - 1]
        segments.append(0 if i == 0 else segments[-1] + new)
        positions.append(0 if new else positions[-1] + 1)
    return segments, positions


def starts_of(doc_lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]).astype(np.int64)


# --- the layout ----------------------------------------------------------------------------------


@FEW
@given(doc_lengths=lengths, block_length=st.integers(1, 12))
def test_segment_ids_and_positions_restart_at_each_document_and_each_block(doc_lengths,
                                                                          block_length):
    num_blocks = sum(doc_lengths) // block_length
    rows = np.arange(num_blocks)
    segment_ids, positions = layout(block_starts(starts_of(doc_lengths), rows, block_length))
    for row in rows:
        expected = reference_layout(doc_lengths, row * block_length, block_length)
        assert (segment_ids[row].tolist(), positions[row].tolist()) == expected


def test_the_second_piece_of_a_cut_document_starts_a_segment_at_position_0():
    # Documents of 5, 9 and 4 tokens in blocks of 8: the second's tokens 3..8 open block 1.
    segment_ids, positions = layout(block_starts(starts_of([5, 9, 4]), np.arange(2), 8))
    assert segment_ids.tolist() == [[0] * 5 + [1] * 3, [0] * 6 + [1] * 2]
    assert positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]]


words = st.lists(st.sampled_from(["the", "cat", "sat", "on", "mat", "a", "dog", "ate"]),
                 max_size=12).map(" ".join)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(words, min_size=1, max_size=10), block_length=st.integers(2, 9))
def test_streamed_and_cached_packing_agree_on_segment_ids_and_positions(tmp_path_factory, texts,
                                                                        block_length):
    tokenizer = make_tokenizer()
    cache_dir = str(tmp_path_factory.mktemp("cache"))
    packed = pack_blocks(text_dataset(texts), tokenizer, block_length,
                         cache_dir, documents=True)
    streamed = list(pack_stream(texts, tokenizer, block_length))
    assert len(streamed) == len(packed)
    if not streamed:
        return
    cached_starts = block_starts(packed.document_starts, np.arange(len(packed)), block_length)
    streamed_starts = np.stack([starts for _, starts, _, _ in streamed])
    np.testing.assert_array_equal(layout(cached_starts), layout(streamed_starts))
    # ... and both are where the documents really start in the stream.
    doc_lengths = [len(tokenizer(text, add_special_tokens=False).input_ids) + 1 for text in texts]
    for row in range(len(packed)):
        expected = reference_layout(doc_lengths, row * block_length, block_length, False)
        assert [list(a[row]) for a in layout(cached_starts)] == list(expected)


def test_a_document_is_read_after_the_eos_before_it_as_a_prompt_is(tmp_path):
    """flaxlm's convention joins documents with EOS alone, and generation reads a prompt after
    an EOS: so the EOS before a document opens its segment, at position 0."""
    tokenizer = make_tokenizer()
    texts = ["the cat sat on the mat", "a dog", "the dog ate the cat"]
    ids = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    block = sum(len(doc) + 1 for doc in ids)  # the whole stream in one block
    packed = pack_blocks(text_dataset(texts), tokenizer, block,
                         str(tmp_path), documents=True)
    [tokens] = packed.tokens
    [segment_ids], [positions] = layout(block_starts(packed.document_starts, np.arange(1), block))
    eos = tokenizer.eos_token_id
    segments = [tokens[segment_ids == s].tolist() for s in range(segment_ids.max() + 1)]
    assert segments == [ids[0], [eos, *ids[1]], [eos, *ids[2]], [eos]]
    assert [positions[segment_ids == s][0] for s in range(len(segments))] == [0] * 4


def test_the_cache_key_changes_with_document_masking_and_stays_without(tmp_path):
    tokenizer = make_tokenizer()
    texts = text_dataset(["the cat sat", "a dog ate the mat"] * 4)
    plain = pack_blocks(texts, tokenizer, 4, str(tmp_path))
    recorded = pack_blocks(texts, tokenizer, 4, str(tmp_path), documents=True)
    assert plain.document_starts is None and recorded.document_starts is not None
    np.testing.assert_array_equal(plain.tokens, recorded.tokens)
    assert plain.tokens.filename != recorded.tokens.filename
    # Without documents, the key (the file) is the one tokenize_and_pack always used.
    assert tokenize_and_pack(texts, tokenizer, 4, str(tmp_path)).filename == plain.tokens.filename
    assert sorted(os.listdir(tmp_path / "blocks")) == sorted(
        [os.path.basename(plain.tokens.filename), os.path.basename(recorded.tokens.filename),
         os.path.basename(recorded.document_starts.filename),
         *[os.path.splitext(os.path.basename(p.filename))[0] + ".json"
           for p in (plain.tokens, recorded.tokens)]])


def test_damaged_document_starts_are_packed_again(tmp_path, capsys):
    tokenizer = make_tokenizer()
    texts = text_dataset(["the cat sat", "a dog ate the mat"] * 4)
    first = pack_blocks(texts, tokenizer, 4, str(tmp_path), documents=True)
    expected = np.array(first.document_starts)
    with open(first.document_starts.filename, "r+b") as f:
        f.truncate(os.path.getsize(first.document_starts.filename) - 8)
    again = pack_blocks(texts, tokenizer, 4, str(tmp_path), documents=True)
    assert "damaged" in capsys.readouterr().out
    np.testing.assert_array_equal(again.document_starts, expected)


# --- the models ----------------------------------------------------------------------------------


MODELS = {
    "gpt2": family_config("gpt2", vocab_size=97, max_positions=2 * BLOCK, hidden_size=32,
                          num_layers=2, num_heads=4, initializer_range=0.2),
    "llama": family_config("llama", vocab_size=97, max_positions=2 * BLOCK, hidden_size=32,
                           num_layers=2, num_heads=4, num_kv_heads=2, mlp_size=48,
                           initializer_range=0.2),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return build_lm(TransformerSpec(MODELS[request.param]), nnx.Rngs(0))


def packed_block(doc_lengths: list[int], offset: int, seed: int = 0):
    """Block [offset, offset + BLOCK) of a stream of random documents, as a batch of one
    with its documents (`with_documents`)."""
    stream = np.random.default_rng(seed).integers(3, 97, sum(doc_lengths)).astype(np.int32)
    rows = np.array([0])
    starts = block_starts(starts_of(doc_lengths) - offset, rows, BLOCK)
    return with_documents(stream[None, offset:offset + BLOCK], starts)


def pieces(batch) -> list[slice]:
    """Where each segment of a one-row batch lies."""
    segment_ids = batch["segment_ids"][0]
    edges = [0, *np.flatnonzero(np.diff(segment_ids)) + 1, len(segment_ids)]
    return [slice(a, b) for a, b in zip(edges, edges[1:])]


def run_alone(model, batch):
    """Each piece of a one-row batch run alone, (piece slice, its logits). Each is the first
    tokens of a row of its own, filled up to the block with EOS: causal attention keeps the
    filler out of the piece's logits, and one shape for every piece compiles once."""
    rows = np.full((BLOCK, BLOCK), EOS, np.int32)
    for row, piece in enumerate(pieces(batch)):
        tokens = batch["input_ids"][0, piece]
        rows[row, : len(tokens)] = tokens
    logits = model(jnp.asarray(rows))
    return [(piece, rows[row, : piece.stop - piece.start], logits[row, : piece.stop - piece.start])
            for row, piece in enumerate(pieces(batch))]


@pytest.mark.slow
@FEW
@given(doc_lengths=lengths, offset=st.integers(0, BLOCK))
def test_a_packed_blocks_logits_are_each_documents_logits_run_alone(model, doc_lengths, offset):
    offset = min(offset, sum(doc_lengths) - BLOCK)  # cuts the first document anywhere
    batch = packed_block(doc_lengths, offset)
    packed = model(jnp.asarray(batch["input_ids"]), segment_ids_BxL=batch["segment_ids"],
                   positions_BxL=batch["positions"])
    for piece, _, alone in run_alone(model, batch):
        assert_close(packed[0, piece], alone, **LOGITS)


def test_one_document_filling_the_block_is_the_plain_block(model):
    batch = packed_block([3 * BLOCK], 5)
    plain = model(jnp.asarray(batch["input_ids"]))
    masked = model(jnp.asarray(batch["input_ids"]), segment_ids_BxL=batch["segment_ids"],
                   positions_BxL=batch["positions"])
    np.testing.assert_array_equal(masked, plain)


@pytest.mark.slow
def test_attention_with_dropout_keeps_to_the_segment_as_the_fused_path_does():
    """The spelled-out path (training with attention dropout) masks as the fused one: at a
    vanishing rate the two agree."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 8, 4, 8)), jnp.float32) for _ in range(3))
    segment_ids = jnp.asarray([[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8])
    fused = attention(q, k, v, dropout_rate=0.0, rngs=None, is_causal=True,
                      segment_ids_BxL=segment_ids)
    spelled = attention(q, k, v, dropout_rate=1e-9, rngs=nnx.Rngs(dropout=0), is_causal=True,
                        segment_ids_BxL=segment_ids)
    assert_close(spelled, fused, terms=8, depth=3)  # scores, softmax, values: 8 wide


def test_evaluation_scores_every_target_from_its_own_document(model):
    """Eval sums over a packed block: every next token of the block is a target, as without
    masking (the same count and bytes), each scored from the logits of its predictor's
    document run alone."""
    batch = packed_block([5, 9, 4, 11], 3, seed=1)
    graphdef, params = nnx.split(model, nnx.Param)
    token_bytes = jnp.arange(97, dtype=jnp.float32) % 3 + 1
    sums = eval_step(params, {k: jnp.asarray(v) for k, v in batch.items()}, jnp.ones(1),
                     token_bytes, graphdef=graphdef)
    plain = eval_step(params, jnp.asarray(batch["input_ids"]), jnp.ones(1), token_bytes,
                      graphdef=graphdef)
    alone_logits = jnp.concatenate([logits for _, _, logits in run_alone(model, batch)])
    ids = jnp.asarray(batch["input_ids"])
    assert float(sums["tokens"]) == float(plain["tokens"]) == BLOCK - 1
    assert float(sums["bytes"]) == float(plain["bytes"])
    assert float(sums["loss_sum"]) == approx(
        float(next_token_losses(alone_logits[None], ids).sum()), **LOGITS)


# --- the runs ------------------------------------------------------------------------------------




@pytest.mark.slow
def test_a_run_with_document_masking_trains_and_evaluates(tmp_path, capsys):
    """llama-tiny on cached blocks (gpt2-tiny trains streamed, below)."""
    from flaxlm.job import train

    corpus = write(tmp_path / "corpus.txt", "\n\n".join(documents(300, seed=3)))
    run_dir = tmp_path / "run"
    train(compose([*SHORT, "model=llama-tiny", *TINY, "trainer.max_steps=2",
                   "language=files", f"language.files=[{corpus}]",
                   "language.text_splitting=paragraph", "task.max_seq_length=32",
                   "task.document_masking=true",
                   "samples.prompts=[]"], run_dir=run_dir))
    banner = next(line for line in capsys.readouterr().out.splitlines() if "params" in line)
    assert "each document attending to itself only" in banner
    assert "attention xla (auto on cpu) |" in banner  # llama-tiny has no attention dropout
    final = [record for record in metrics_of(run_dir) if "eval/loss" in record][-1]
    assert np.isfinite(final["eval/loss"]) and np.isfinite(final["eval/bits_per_byte"])


@pytest.mark.slow
def test_a_streamed_run_with_document_masking_trains(tmp_path):
    from conftest import streaming_run

    from flaxlm.job import train

    train(streaming_run(tmp_path, "task.document_masking=true", "trainer.max_steps=2"))
    evaluations = [r for r in metrics_of(tmp_path / "run") if "eval/loss" in r]
    assert len(evaluations) == 2 and np.isfinite(evaluations[-1]["eval/loss"])


# --- runs saved before the setting ---------------------------------------------------------------


def test_a_saved_config_without_the_setting_reads_as_masking_off():
    saved = {"task": {"name": "clm", "max_seq_length": 64}, "seed": 0}
    assert upgrade_saved_config(saved)["task"]["document_masking"] is False
    kept = {"task": {"name": "clm", "document_masking": True}}
    assert upgrade_saved_config(kept)["task"]["document_masking"] is True


def test_an_earlier_run_resumed_with_masking_on_is_refused_naming_it(tmp_path):
    from omegaconf import OmegaConf

    from flaxlm.runs import check_resumable

    resolved = OmegaConf.to_container(compose(["task.document_masking=true"]), resolve=True)
    saved = {**resolved, "task": {k: v for k, v in resolved["task"].items()
                                  if k != "document_masking"}}
    path = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create(saved), path)
    with pytest.raises(FlaxlmError, match=r"task\.document_masking: False → True"):
        check_resumable(str(path), resolved)
    check_resumable(str(path), {**resolved, "task": {**resolved["task"],
                                                      "document_masking": False}})



@pytest.mark.parametrize(("experiment", "masking"), [
    ("quickstart", False),  # its published figure was measured with blocks as one sequence
    ("oscar-is-distilgpt2", False), ("distilgpt2-en-builtin", False), ("gpt2-no", False),
    ("llama-tiny-en-builtin", True),  # a preset of flaxlm's own: documents on their own
])
def test_presets_that_reproduce_group_texts_recipes_attend_across_documents(experiment,
                                                                            masking):
    from omegaconf import OmegaConf

    assert OmegaConf.to_object(compose([f"experiment={experiment}"])).task.document_masking \
        is masking
