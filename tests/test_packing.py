"""Tests of `flaxlm.data.packing`: joining documents with EOS, cutting blocks, the cache, and
long documents tokenised in bounded pieces."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import transformers
from conftest import config_node

from flaxlm.data import packing
from flaxlm.data import tokenizer as tokenizer_module
from flaxlm.data.packing import cut_blocks, join_documents, tokenize_and_pack
from flaxlm.data.tables import text_dataset
from flaxlm.data.tokenizer import DocumentEncoder, prepare_tokenizer

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
    return text_dataset(list(texts))


def cache_files(cache_dir: Path, pattern: str = "*") -> list[Path]:
    """Entries of the block cache, hidden ones (a leftover scratch directory) included."""
    blocks = cache_dir / "blocks"
    return sorted(p for p in blocks.iterdir() if p.match(pattern)) if blocks.exists() else []


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> transformers.PreTrainedTokenizerFast:
    cache = tmp_path_factory.mktemp("tokenizer")
    return prepare_tokenizer(config_node("tokenizer", vocab_size=320), dataset(PARAGRAPHS * 3), 512,
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
    assert len(names) == 4  # the blocks and their record, twice
    assert all(name.endswith((".npy", ".json")) and ".tmp" not in name for name in names)


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
    [record, path] = cache_files(tmp_path)
    assert (record.suffix, path.suffix) == (".json", ".npy")
    np.testing.assert_array_equal(np.load(path), blocks)


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


# What a disk error, an interrupted copy or a quota hit does to cached blocks.
DAMAGE = {
    "truncated": lambda path: os.truncate(path, os.path.getsize(path) // 2),
    "emptied": lambda path: os.truncate(path, 0),
    "header": lambda path: overwrite(path, 20, b"'shape': (9999, 8)"),
    "middle": lambda path: overwrite(path, os.path.getsize(path) // 2, b"\xff\xff\xff\x7f"),
    "grown": lambda path: open(path, "ab").write(b"\0" * 64),
    "record": lambda path: Path(path).with_suffix(".json").write_text("{"),
}


@pytest.mark.parametrize("harm", DAMAGE.values(), ids=DAMAGE.keys())
def test_damaged_cached_blocks_are_announced_and_packed_again(tokenizer, tmp_path, capsys, harm):
    expected = tokenize_and_pack(dataset(PARAGRAPHS * 4), tokenizer, 8, str(tmp_path)).copy()
    [path] = cache_files(tmp_path, "*.npy")
    harm(str(path))
    capsys.readouterr()
    blocks = tokenize_and_pack(dataset(PARAGRAPHS * 4), tokenizer, 8, str(tmp_path))
    [line] = [line for line in capsys.readouterr().out.splitlines() if "damaged" in line]
    assert line.startswith(f"flaxlm: the cached token blocks {path} are damaged (")
    np.testing.assert_array_equal(blocks, expected)
    assert [p.name for p in cache_files(tmp_path)] == [path.with_suffix(".json").name, path.name]
    assert packing._damage(str(path)) is None


def test_blocks_cached_without_a_record_are_kept_when_whole_and_recorded(tokenizer, tmp_path,
                                                                         monkeypatch):
    """Blocks an older flaxlm packed, with no record: kept (no packing again) and recorded."""
    expected = tokenize_and_pack(dataset(PARAGRAPHS), tokenizer, 8, str(tmp_path)).copy()
    [record] = cache_files(tmp_path, "*.json")
    record.unlink()
    monkeypatch.setattr(packing, "_pack", lambda *args: pytest.fail("packed again"))
    np.testing.assert_array_equal(tokenize_and_pack(dataset(PARAGRAPHS), tokenizer, 8,
                                                    str(tmp_path)), expected)
    assert record.exists()


def test_unrecorded_blocks_of_the_wrong_size_are_packed_again(tokenizer, tmp_path, capsys):
    expected = tokenize_and_pack(dataset(PARAGRAPHS), tokenizer, 8, str(tmp_path)).copy()
    [record] = cache_files(tmp_path, "*.json")
    record.unlink()
    [path] = cache_files(tmp_path, "*.npy")
    os.truncate(path, os.path.getsize(path) - 4)
    blocks = tokenize_and_pack(dataset(PARAGRAPHS), tokenizer, 8, str(tmp_path))
    assert "where its header implies" in capsys.readouterr().out
    np.testing.assert_array_equal(blocks, expected)


def test_packing_copies_the_stream_in_chunks(tokenizer, tmp_path, monkeypatch):
    """Blocks are laid out a few rows at a time (bounded memory) with the same result."""
    texts = PARAGRAPHS * 3
    expected = tokenize_and_pack(dataset(texts), tokenizer, 8, str(tmp_path / "one-go"))
    monkeypatch.setattr(packing, "COPY_TOKENS", 20)  # two blocks of 8 per copy
    monkeypatch.setattr(packing, "ENCODE_BATCH", 2)
    chunked = tokenize_and_pack(dataset(texts), tokenizer, 8, str(tmp_path / "chunked"))
    np.testing.assert_array_equal(chunked, expected)
    assert len(expected) > 4


# --- a long document is tokenised in bounded pieces, with the ids of the whole ----------------

# Spaces in runs, tabs, newlines, digits, a contraction and non-ASCII text around the cuts.
TRICKY = "It's  2 spaces,\tA tab\nand a line;   3 more   (1987) é ð 漢字 — ok.  "


class SpyBackend:
    """A backend tokenizer that records the strings of every encode call."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def encode_batch(self, texts, **kwargs):
        self.calls.append(list(texts))
        return self.backend.encode_batch(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def whole_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def test_a_long_document_reaches_the_tokenizer_in_bounded_pieces_with_the_same_ids(tokenizer,
                                                                                   tmp_path):
    long_document = " ".join(PARAGRAPHS + [TRICKY]) * 600  # ~4 pieces
    assert len(long_document) > 3 * tokenizer_module.PIECE_CHARS
    texts = [PARAGRAPHS[0], long_document, PARAGRAPHS[1]]
    spy = SpyBackend(tokenizer.backend_tokenizer)
    spied = SimpleNamespace(backend_tokenizer=spy, eos_token_id=tokenizer.eos_token_id)

    blocks = tokenize_and_pack(dataset(texts), spied, 16, str(tmp_path))

    documents = [whole_ids(tokenizer, text) for text in texts]
    assert blocks.tolist() == reference_blocks(documents, tokenizer.eos_token_id, 16)
    strings = [text for call in spy.calls for text in call]
    assert max(map(len, strings)) <= tokenizer_module.PIECE_CHARS
    assert all(sum(map(len, call)) <= tokenizer_module.ENCODE_CHARS for call in spy.calls)


@pytest.mark.parametrize("piece_chars", [24, 41, 100])
def test_cuts_at_a_space_after_a_non_space_keep_every_id(tokenizer, monkeypatch, piece_chars):
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", piece_chars)
    monkeypatch.setattr(tokenizer_module, "ENCODE_CHARS", 3 * piece_chars)
    texts = [TRICKY * 7, "", " ".join(PARAGRAPHS), PARAGRAPHS[0], " leading and trailing "]
    encoder = DocumentEncoder(tokenizer.backend_tokenizer)
    encoded = encoder.encode(texts)
    assert [ids.tolist() for ids in encoded] == [whole_ids(tokenizer, text) for text in texts]
    assert all(ids.dtype == np.int32 for ids in encoded)
    assert encoder.inexact_cuts == 0 and encoder.inexact_cuts_warning() is None


def test_a_stretch_without_a_space_is_cut_mid_word_and_reported(tokenizer, tmp_path, monkeypatch,
                                                                capsys):
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 16)
    text = "x" * 50 + " and then words"  # cut at 16, 32 and 48; then at the space before "and"
    blocks = tokenize_and_pack(dataset([text, PARAGRAPHS[0]]), tokenizer, 4, str(tmp_path))
    assert len(blocks) > 0
    [warning] = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert warning.startswith("flaxlm: warning: 3 cut(s) of documents longer than 16 characters")


def test_a_tokenizer_that_prepends_to_every_string_has_its_cuts_reported(tokenizer, monkeypatch):
    """Llama-2's tokenizer.json prepends "▁" to every string, so a cut adds a token there."""
    import tokenizers

    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 30)
    prepending = tokenizers.Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    prepending.normalizer = tokenizers.normalizers.Prepend("▁")
    text = " ".join(PARAGRAPHS[:2])
    plain, other = DocumentEncoder(tokenizer.backend_tokenizer), DocumentEncoder(prepending)
    plain.encode([text])
    other.encode([text])
    assert plain.inexact_cuts == 0
    pieces = list(tokenizer_module.document_pieces(text, 30))
    assert all(clean for _, clean in pieces) and len(pieces) > 3
    assert other.inexact_cuts == len(pieces) - 1  # every cut, although each is at a space
    assert other.inexact_cuts_warning().startswith(f"flaxlm: warning: {other.inexact_cuts} cut(s)")


_PEAK_MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys, tempfile
    from omegaconf import OmegaConf
    from flaxlm.config import TokenizerConfig
    from flaxlm.data.packing import tokenize_and_pack
    from flaxlm.data.tables import text_dataset
    from flaxlm.data.tokenizer import prepare_tokenizer

    settings, paragraphs = json.loads(sys.argv[1]), sys.argv[2:]
    cache = tempfile.mkdtemp()
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TokenizerConfig), settings))
    tokenizer = prepare_tokenizer(config, text_dataset(paragraphs), 512, cache)
    line = " ".join(paragraphs * 20_000)  # one document of ~8 MB on one line
    texts = text_dataset([*paragraphs, line, *paragraphs])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    blocks = tokenize_and_pack(texts, tokenizer, 64, cache)
    growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
    print(len(line), len(blocks), growth_mb)
""")


@pytest.mark.slow
def test_packing_one_long_line_takes_memory_bounded_by_the_pieces_not_the_line():
    """Tokenising ~8 MB as one string took the tokenizer over 1 GB; in pieces it takes a working
    set of one encode group plus the int32 ids."""
    settings = json.dumps(dataclasses.asdict(config_node("tokenizer", vocab_size=320)))
    done = subprocess.run([sys.executable, "-c", _PEAK_MEMORY_SCRIPT, settings, *PARAGRAPHS[:5]],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    chars, num_blocks, growth_mb = map(int, done.stdout.split()[-3:])
    assert chars > 7_000_000 and num_blocks > 10_000
    assert growth_mb < 500, f"peak RSS grew by {growth_mb} MB while packing"


def test_padding_and_truncation_set_in_a_loaded_tokenizer_never_reach_the_blocks(tokenizer,
                                                                                 tmp_path):
    """A tokenizer.json may carry them (sentence-transformers' pad and cut at 128 tokens);
    packing must still see whole documents, and the tokenizer itself stays as it was."""
    import tokenizers

    backend = tokenizers.Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.enable_truncation(max_length=4)
    backend.enable_padding(pad_id=1, pad_token="<pad>", length=32)
    loaded = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    assert loaded.backend_tokenizer.truncation and loaded.backend_tokenizer.padding

    blocks = tokenize_and_pack(dataset(PARAGRAPHS), loaded, 8, str(tmp_path))

    documents = [whole_ids(tokenizer, text) for text in PARAGRAPHS]
    assert blocks.tolist() == reference_blocks(documents, tokenizer.eos_token_id, 8)
    assert loaded.backend_tokenizer.truncation["max_length"] == 4
    assert loaded.backend_tokenizer.padding["length"] == 32
