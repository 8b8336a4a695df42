"""Property-based tests (hypothesis) of the contracts that are exact: packing keeps every token
once, in order, with EOS between documents (whole-split and streamed, and long documents cut
into pieces tokenise as if whole); the training loaders read every row at most once per epoch,
all but the incomplete last batch, on any device count, and resume to the same rest; the
evaluation batches see every block and every classification example exactly once, in order.

Shapes that reach JAX come from small sets (device counts 1/2/4/8, a few per-device batch
sizes), so each new example rarely compiles anything."""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import config_node
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numerics import assert_close, magnitude

from flaxlm.config import Padding
from flaxlm.data import tokenizer as tokenizer_module
from flaxlm.data.encoding import example_loader
from flaxlm.data.loader import block_loader, block_rows, eval_batches
from flaxlm.data.packing import cut_blocks, join_documents, tokenize_and_pack
from flaxlm.data.streaming import pack_stream
from flaxlm.data.tables import text_dataset
from flaxlm.data.tokenizer import DocumentEncoder, document_pieces, prepare_tokenizer
from flaxlm.parallel import make_mesh
from flaxlm.training.evaluation import predict

EOS = 2
FEW = settings(max_examples=100, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MESHES = {n: make_mesh(n) for n in (1, 2, 4, 8)}

token_lists = st.lists(st.integers(3, 999), max_size=12)  # ids above EOS, so EOS is visible
documents = st.lists(token_lists, max_size=12)
device_counts = st.sampled_from(sorted(MESHES))
per_device = st.sampled_from([1, 2, 3])
# Text that puts spaces of every kind, digits, punctuation, contractions and non-ASCII letters
# next to the cuts, plus any other character now and then.
text_chars = st.one_of(
    st.sampled_from(list("  aeiou st'sdlm0179.,;-!?\t\n\r\x0b\x0c\x1c\x85\xa0\u2003\u3000"
                         "ðæé漢字🙂—")),
    st.characters(exclude_categories=["Cs"]),
)
texts = st.text(text_chars, max_size=120)


def stream_of(docs: list[list[int]]) -> list[int]:
    """The reference: each document's tokens, then EOS."""
    return [token for doc in docs for token in [*doc, EOS]]


# --- packing -------------------------------------------------------------------------------------


@FEW
@given(docs=documents, max_seq_length=st.integers(1, 20))
def test_packing_keeps_every_token_once_in_order_with_eos_between_documents(docs,
                                                                           max_seq_length):
    blocks = cut_blocks(join_documents(docs, EOS), max_seq_length)
    reference = stream_of(docs)
    num_blocks = len(reference) // max_seq_length
    assert blocks.dtype == np.int32 and blocks.shape == (num_blocks, max_seq_length)
    assert blocks.ravel().tolist() == reference[: num_blocks * max_seq_length]
    assert len(reference) - blocks.size < max_seq_length  # only an incomplete tail is dropped


class WordIds:
    """A whitespace tokenizer whose ids are the words themselves: a document "5 17 3" is
    [5, 17, 3], so packed streams can be compared with the token lists they came from."""

    padding = truncation = None

    def encode_batch(self, texts, add_special_tokens=False):
        return [SimpleNamespace(ids=[int(w) if w.isdecimal() else 1 for w in text.split()])
                for text in texts]


WORDS = SimpleNamespace(backend_tokenizer=WordIds(), eos_token_id=EOS)


@FEW
@given(docs=documents, max_seq_length=st.integers(1, 12), restart=st.integers(0, 10**6))
def test_the_stream_packs_as_the_split_and_resumes_from_any_block(docs, max_seq_length, restart):
    texts = [" ".join(map(str, doc)) for doc in docs]
    packed = list(pack_stream(texts, WORDS, max_seq_length))
    expected = cut_blocks(join_documents(docs, EOS), max_seq_length)
    assert [block.tolist() for block, _, _, _ in packed] == expected.tolist()
    if not packed:
        return
    # Restart from the position recorded after block k: the same blocks after it.
    k = restart % len(packed)
    _, _, document, offset = packed[k]
    rest = list(pack_stream(texts[document:], WORDS, max_seq_length, document, offset))
    assert [(b.tolist(), s.tolist(), d, o) for b, s, d, o in rest] == [
        (b.tolist(), s.tolist(), d, o) for b, s, d, o in packed[k + 1 :]]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    corpus = ["It's a small corpus, with 12 numbers, tabs\tand ðæ 漢字 — enough for merges."] * 5
    return prepare_tokenizer(config_node("tokenizer", vocab_size=300),
                             text_dataset(corpus), 512,
                             str(tmp_path_factory.mktemp("tokenizer")))


@FEW
@given(text=texts, piece_chars=st.integers(1, 40))
def test_pieces_join_to_the_text_and_clean_cuts_keep_every_id(tokenizer, text, piece_chars):
    pieces = list(document_pieces(text, piece_chars))
    assert "".join(piece for piece, _ in pieces) == text
    assert all(0 < len(piece) <= piece_chars for piece, _ in pieces[:-1])
    assert len(pieces[-1][0]) <= piece_chars
    for (before, _), (piece, clean) in zip(pieces, pieces[1:]):
        assert clean == (piece[0] == " " and not before[-1].isspace())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tokenizer_module, "PIECE_CHARS", piece_chars)
        patch.setattr(tokenizer_module, "ENCODE_CHARS", 2 * piece_chars)
        encoder = DocumentEncoder(tokenizer.backend_tokenizer)
        [ids] = encoder.encode([text])
    assert encoder.inexact_cuts == sum(not clean for _, clean in pieces)
    if encoder.inexact_cuts == 0:
        whole = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        assert ids.tolist() == whole


# Words of at most 8 characters between single spaces: every 10 characters hold a clean cut.
spaced_texts = st.lists(st.text(text_chars.filter(lambda c: not c.isspace()), min_size=1,
                                 max_size=8), max_size=30).map(" ".join)


@settings(max_examples=30, deadline=None)
@given(corpus=st.lists(spaced_texts, max_size=8), max_seq_length=st.integers(1, 16))
def test_tokenize_and_pack_in_pieces_equals_the_whole_documents_packed(tokenizer, corpus,
                                                                       max_seq_length):
    backend = tokenizer.backend_tokenizer
    docs = [backend.encode(text, add_special_tokens=False).ids for text in corpus]
    with tempfile.TemporaryDirectory() as cache, pytest.MonkeyPatch.context() as patch:
        patch.setattr(tokenizer_module, "PIECE_CHARS", 10)
        patch.setattr(tokenizer_module, "ENCODE_CHARS", 25)
        blocks = tokenize_and_pack(text_dataset(corpus), tokenizer,
                                   max_seq_length, cache)
        expected = cut_blocks(join_documents(docs, tokenizer.eos_token_id), max_seq_length)
        assert blocks.tolist() == expected.tolist()


# --- the training loaders ------------------------------------------------------------------------


def check_epoch_and_resume(make_loader, first_tokens, num_rows, batch_size, epoch, start):
    """One epoch of `make_loader()` holds every row at most once, all but the incomplete last
    batch; a new loader given the first one's state, started at any step, yields the rest."""
    loader = make_loader()
    batches = [first_tokens(batch).tolist() for batch in loader.epoch(epoch)]
    seen = [row for batch in batches for row in batch]
    assert len(batches) == loader.steps_per_epoch == num_rows // batch_size
    assert all(len(batch) == batch_size for batch in batches)
    assert len(set(seen)) == len(seen) == num_rows - num_rows % batch_size
    assert set(seen) <= set(range(num_rows))
    # A checkpoint holds (epoch, step) and the loader's state: a new loader from it continues.
    step = start % (len(batches) + 1)
    resumed = make_loader()
    resumed.load_state_dict(loader.state_dict())
    rest = [first_tokens(batch).tolist() for batch in resumed.epoch(epoch, start_step=step)]
    assert rest == batches[step:]


@FEW
@given(num_blocks=st.integers(0, 40), devices=device_counts, rows_per_device=per_device,
       seed=st.integers(0, 2**31 - 1), epoch=st.integers(0, 3), start=st.integers(0, 10**6))
@pytest.mark.slow
def test_train_loader_reads_every_block_at_most_once_per_epoch_and_resumes_to_the_same_rest(
    num_blocks, devices, rows_per_device, seed, epoch, start
):
    blocks = np.arange(num_blocks, dtype=np.int32)[:, None].repeat(2, axis=1)  # row i is all i
    batch_size = devices * rows_per_device
    check_epoch_and_resume(lambda: block_loader(blocks, batch_size, MESHES[devices], seed=seed),
                           lambda batch: np.asarray(batch)[:, 0], num_blocks, batch_size, epoch,
                           start)


@pytest.mark.slow
@FEW
@given(lengths=st.lists(st.integers(1, 24), max_size=40), devices=device_counts,
       rows_per_device=per_device, seed=st.integers(0, 2**31 - 1), epoch=st.integers(0, 3),
       start=st.integers(0, 10**6), padding=st.sampled_from(list(Padding)))
def test_classification_loader_reads_every_example_at_most_once_per_epoch_and_resumes(
    lengths, devices, rows_per_device, seed, epoch, start, padding
):
    arrays = classification_arrays(lengths, width=24)
    batch_size = devices * rows_per_device
    check_epoch_and_resume(
        lambda: example_loader(arrays, batch_size, MESHES[devices], seed=seed, padding=padding),
        lambda batch: np.asarray(batch["input_ids"])[:, 0], len(lengths), batch_size, epoch,
        start,
    )


def classification_arrays(lengths: list[int], width: int) -> dict[str, np.ndarray]:
    """Example i starts with token i and has lengths[i] real tokens."""
    lengths = np.asarray(lengths, np.int32).reshape(-1)
    mask = (np.arange(width) < lengths[:, None]).astype(np.int32)
    ids = mask * 7
    ids[:, 0] = np.arange(len(lengths))
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": 0 * mask,
            "labels": np.zeros(len(lengths), np.int32), "lengths": lengths}


# --- evaluation ----------------------------------------------------------------------------------


@FEW
@given(num_blocks=st.integers(0, 40), devices=device_counts, rows_per_device=per_device)
def test_lm_eval_batches_hold_every_block_once_in_order(num_blocks, devices, rows_per_device):
    blocks = np.arange(num_blocks, dtype=np.int32)[:, None].repeat(2, axis=1)
    batch_size = devices * rows_per_device
    real = []
    mesh = MESHES[devices]
    for inputs, mask in eval_batches(num_blocks, batch_size, mesh,
                                     block_rows(blocks, batch_size, mesh)):
        inputs, mask = np.asarray(inputs), np.asarray(mask)
        assert inputs.shape == (batch_size, 2) and mask.shape == (batch_size,)
        assert (inputs[mask == 0] == 0).all()  # padding rows are zeros
        assert np.all(np.diff(mask) <= 0)  # padding only at the end
        real.extend(inputs[mask == 1, 0].tolist())
    assert real == list(range(num_blocks))


@jax.jit
def index_and_length(batch):
    """Each row's index (its first token) and its count of real tokens."""
    return jnp.stack([batch["input_ids"][:, 0], batch["attention_mask"].sum(1)], axis=1)


@FEW
@given(lengths=st.lists(st.integers(1, 24), max_size=70), devices=device_counts,
       rows_per_device=st.sampled_from([1, 4]), padding=st.sampled_from(list(Padding)))
def test_classification_eval_predicts_every_example_once_in_order(lengths, devices,
                                                                  rows_per_device, padding):
    arrays = classification_arrays(lengths, width=24)
    outputs = predict(index_and_length, arrays, devices * rows_per_device, MESHES[devices],
                      padding)
    assert outputs.shape[0] == len(lengths)
    if lengths:
        assert outputs[:, 0].tolist() == list(range(len(lengths)))
        assert outputs[:, 1].tolist() == lengths  # bucketing never trims a real token


# --- the next-token loss -------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(2, 9), vocab=st.integers(2, 17),
       seed=st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_next_token_losses_are_each_position_predicting_the_next(batch, length, vocab, seed):
    """Position t's loss is -log softmax(logits[t])[token t+1]; the last position, which has no
    next token, has none. The reference log-softmax is numpy's (float64), and the loss runs
    jitted, as in the train step: eagerly, JAX compiles each of its primitives for each new
    shape (a second an example, against a tenth jitted)."""
    from flaxlm.training.step import next_token_losses

    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(batch, length, vocab)).astype(np.float32)
    ids = rng.integers(0, vocab, (batch, length))
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    expected = -np.take_along_axis(log_probs[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
    # log-sum-exp over the vocabulary minus a logit, float32 against float64: a loss near 0
    # carries the rounding of the logits it is a difference of.
    assert_close(jax.jit(next_token_losses)(logits, ids), expected, terms=vocab, depth=2,
                 scale=max(magnitude(expected), magnitude(logits)))
