"""Tests of `flaxlm.data.packing`: joining documents with EOS, cutting blocks, and the cache."""

from __future__ import annotations

import random
from pathlib import Path

import datasets
import numpy as np
import pytest
import transformers

from flaxlm.config import TokenizerConfig
from flaxlm.data import packing
from flaxlm.data.packing import cut_blocks, join_documents, tokenize_and_pack
from flaxlm.data.tokenizer import prepare_tokenizer

EOS = 2
PARAGRAPHS = [
    "The river rose through the night, and by morning the lower fields were under water.",
    "She kept the letters in a tin box under the stairs, tied with string, in order of date.",
    "Nobody on the committee had read the report, but everyone had an opinion about it.",
    "Fold the egg whites into the batter gently; stirring knocks out the air.",
    "Þetta er stutt málsgrein á íslensku, með ð, þ og æ.",
    "",
    "A very short one.",
]


def reference_blocks(documents: list[list[int]], eos_id: int, max_seq_length: int) -> list:
    """The seed's group_texts, naively: concatenate, EOS after each document, drop the tail."""
    stream = []
    for ids in documents:
        stream = stream + list(ids) + [eos_id]
    n = len(stream) // max_seq_length
    return [stream[i * max_seq_length : (i + 1) * max_seq_length] for i in range(n)]


def random_documents(seed: int, max_seq_length: int) -> list[list[int]]:
    """Random-length documents, some empty, one longer than several blocks."""
    rng = random.Random(seed)
    documents = [
        [rng.randrange(5, 500) for _ in range(rng.choice([0, 0, 1, 2, rng.randrange(3, 40)]))]
        for _ in range(rng.randrange(1, 30))
    ]
    long_document = [rng.randrange(5, 500) for _ in range(5 * max_seq_length + 3)]
    documents.insert(rng.randrange(len(documents) + 1), long_document)
    return documents


def pack_naively(documents: list[list[int]], max_seq_length: int) -> np.ndarray:
    return cut_blocks(join_documents(documents, EOS), max_seq_length)


def dataset(texts) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": list(texts)})


def cache_files(cache_dir: Path, pattern: str = "*") -> list[Path]:
    """Entries of the block cache, hidden ones (a leftover scratch directory) included."""
    blocks = cache_dir / "blocks"
    return sorted(p for p in blocks.iterdir() if p.match(pattern)) if blocks.exists() else []


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> transformers.PreTrainedTokenizerFast:
    cache = tmp_path_factory.mktemp("tokenizer")
    return prepare_tokenizer(TokenizerConfig(vocab_size=320), dataset(PARAGRAPHS * 3), 512,
                             str(cache))


@pytest.mark.parametrize("max_seq_length", [1, 7, 16, 64])
@pytest.mark.parametrize("seed", range(5))
def test_join_and_cut_equal_the_naive_reference(seed, max_seq_length):
    documents = random_documents(seed, max_seq_length)
    blocks = pack_naively(documents, max_seq_length)
    expected = reference_blocks(documents, EOS, max_seq_length)
    assert blocks.dtype == np.int32
    assert blocks.shape == (len(expected), max_seq_length)
    assert blocks.tolist() == expected
    assert len(expected) >= 5  # the long document alone fills five blocks


def test_join_puts_eos_after_every_document_including_empty_ones():
    stream = join_documents([[7, 8], [], [9]], EOS)
    assert stream.tolist() == [7, 8, EOS, EOS, 9, EOS]
    assert stream.dtype == np.int32


@pytest.mark.parametrize("documents", [[], [[]], [[5, 6, 7]], [[5], [], [6, 7, 8]]])
def test_shorter_than_one_block_gives_zero_blocks(documents):
    blocks = pack_naively(documents, 8)
    assert blocks.shape == (0, 8)
    assert reference_blocks(documents, EOS, 8) == []


def test_exactly_full_blocks_drop_nothing():
    blocks = pack_naively([[10, 11, 12], [13, 14, 15, 16]], 3)  # 9 tokens with the EOS
    assert blocks.tolist() == [[10, 11, 12], [EOS, 13, 14], [15, 16, EOS]]


@pytest.mark.parametrize("encode_batch", [1000, 2])  # one batch, and several
@pytest.mark.parametrize("max_seq_length", [4, 16])
def test_tokenize_and_pack_equals_the_reference_from_the_backend_tokenizer(
    tokenizer, tmp_path, monkeypatch, encode_batch, max_seq_length
):
    monkeypatch.setattr(packing, "ENCODE_BATCH", encode_batch)
    texts = PARAGRAPHS * 2
    backend = tokenizer.backend_tokenizer
    documents = [backend.encode(text, add_special_tokens=False).ids for text in texts]
    expected = reference_blocks(documents, tokenizer.eos_token_id, max_seq_length)

    blocks = tokenize_and_pack(dataset(texts), tokenizer, max_seq_length, str(tmp_path))
    assert blocks.dtype == np.int32
    assert blocks.tolist() == expected
    assert len(expected) > 10


def test_packing_an_empty_split_gives_zero_blocks(tokenizer, tmp_path):
    blocks = tokenize_and_pack(dataset([]), tokenizer, 16, str(tmp_path))
    assert blocks.shape == (0, 16)


def test_second_call_loads_the_cached_blocks(tokenizer, tmp_path, monkeypatch):
    first = tokenize_and_pack(dataset(PARAGRAPHS), tokenizer, 8, str(tmp_path))
    [path] = cache_files(tmp_path, "*.npy")

    def no_packing(*args):
        raise AssertionError("packed again although the blocks are cached")

    monkeypatch.setattr(packing, "_pack", no_packing)
    second = tokenize_and_pack(dataset(PARAGRAPHS), tokenizer, 8, str(tmp_path))
    np.testing.assert_array_equal(second, first)
    np.testing.assert_array_equal(np.load(path), first)


@pytest.mark.parametrize(
    ("texts", "max_seq_length"),
    [
        (PARAGRAPHS, 9),  # another block length
        ([*PARAGRAPHS, "One more paragraph."], 8),  # more text
        ([PARAGRAPHS[1], PARAGRAPHS[0], *PARAGRAPHS[2:]], 8),  # the same text, reordered
    ],
)
def test_other_text_or_block_length_gets_its_own_cache_file(tokenizer, tmp_path, texts,
                                                            max_seq_length):
    tokenize_and_pack(dataset(PARAGRAPHS), tokenizer, 8, str(tmp_path))
    blocks = tokenize_and_pack(dataset(texts), tokenizer, max_seq_length, str(tmp_path))
    assert len(cache_files(tmp_path, "*.npy")) == 2
    documents = [tokenizer.backend_tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    assert blocks.tolist() == reference_blocks(documents, tokenizer.eos_token_id, max_seq_length)


def test_another_separator_token_is_not_served_from_the_cache(tokenizer, tmp_path):
    # Same text, same backend tokenizer, same block length, but documents separated by another
    # token (tokenizer.eos_token=<s>): the cached blocks hold the old separator.
    tokenize_and_pack(dataset(PARAGRAPHS), tokenizer, 8, str(tmp_path))
    other_eos = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, eos_token="<s>"
    )
    assert other_eos.eos_token_id == 0
    blocks = tokenize_and_pack(dataset(PARAGRAPHS), other_eos, 8, str(tmp_path))
    documents = [tokenizer.backend_tokenizer.encode(t, add_special_tokens=False).ids
                 for t in PARAGRAPHS]
    assert blocks.tolist() == reference_blocks(documents, 0, 8)


def test_no_temporary_file_is_left_in_the_cache(tokenizer, tmp_path):
    for max_seq_length in (4, 8):
        tokenize_and_pack(dataset(PARAGRAPHS), tokenizer, max_seq_length, str(tmp_path))
    names = [p.name for p in cache_files(tmp_path)]
    assert len(names) == 2
    assert all(name.endswith(".npy") and ".tmp" not in name for name in names)


def test_interrupted_write_leaves_no_file_at_the_final_path(tokenizer, tmp_path, monkeypatch):
    real_batches = packing._token_batches

    def one_batch_then_fail(*args):
        batches = real_batches(*args)
        yield next(batches)
        raise OSError("No space left on device")

    monkeypatch.setattr(packing, "ENCODE_BATCH", 2)
    monkeypatch.setattr(packing, "_token_batches", one_batch_then_fail)
    with pytest.raises(OSError, match="No space left"):
        tokenize_and_pack(dataset(PARAGRAPHS), tokenizer, 8, str(tmp_path))
    assert cache_files(tmp_path) == []  # neither the final .npy nor a scratch file

    monkeypatch.setattr(packing, "_token_batches", real_batches)
    blocks = tokenize_and_pack(dataset(PARAGRAPHS), tokenizer, 8, str(tmp_path))
    [path] = cache_files(tmp_path)
    np.testing.assert_array_equal(np.load(path), blocks)


def test_packing_copies_the_stream_in_chunks(tokenizer, tmp_path, monkeypatch):
    """Blocks are laid out a few rows at a time (bounded memory) with the same result."""
    texts = PARAGRAPHS * 3
    expected = tokenize_and_pack(dataset(texts), tokenizer, 8, str(tmp_path / "one-go"))
    monkeypatch.setattr(packing, "COPY_TOKENS", 20)  # two blocks of 8 per copy
    monkeypatch.setattr(packing, "ENCODE_BATCH", 2)
    chunked = tokenize_and_pack(dataset(texts), tokenizer, 8, str(tmp_path / "chunked"))
    np.testing.assert_array_equal(chunked, expected)
    assert len(expected) > 4
