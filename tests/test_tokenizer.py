"""Tests of `flaxlm.data.tokenizer`: training a byte-level BPE, the cache, loading, and checks."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import datasets
import pytest
import tokenizers
import transformers
from conftest import config_node

from flaxlm.data import tokenizer as tokenizer_module
from flaxlm.data.tables import text_dataset
from flaxlm.data.tokenizer import prepare_tokenizer, token_byte_lengths
from flaxlm.errors import FlaxlmError

MODEL_VOCAB = 512

def settings_with(**changes):
    """conf/train.yaml's tokenizer settings with `changes`."""
    return config_node("tokenizer", **changes)


SETTINGS = settings_with(vocab_size=400)
SPECIAL_IDS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": 4}

_DOCUMENTS = [
    "The ferry left the harbour at dawn, and the gulls followed it out past the lighthouse.",
    "Þórður fór út í búð og keypti smjör, brauð og ost. Hann sagði: «Það er gott veður í dag».",
    "Søren og Åse bor i et lille hus ved fjorden; om sommeren går de tur i skoven.",
    "Café crème, naïve résumé, déjà vu: l'été dernier, nous sommes allés à la mer.",
    "漢字とかなを混ぜた文章です。東京は晴れ、大阪は雨でした。",
    "Emoji too: 🙂🚀🐟 and a family 👨‍👩‍👧 — plus “smart quotes” and a tab\tin between.",
    "Spaces  twice , a space before a comma . and trailing spaces   ",
]
DOCUMENTS = _DOCUMENTS * 4
UNSEEN = ["Ægir ók yfir heiðina 🌋 með 3 € í vasanum.", " leading space", "line\nbreaks\n\n"]


def dataset(documents) -> datasets.Dataset:
    return text_dataset(list(documents))


def trained_dirs(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "tokenizers").iterdir())


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="module")
def tokenizer(cache_dir):
    return prepare_tokenizer(SETTINGS, dataset(DOCUMENTS), MODEL_VOCAB, str(cache_dir))


@pytest.fixture(scope="module")
def saved_dir(tokenizer, cache_dir) -> Path:
    [directory] = trained_dirs(cache_dir)
    return directory


@pytest.fixture
def count_training(monkeypatch) -> list[int]:
    """Record the vocab size of every BPE training run."""
    calls = []
    train_bpe = tokenizer_module.train_bpe

    def counting(settings, texts, vocab_size):
        calls.append(vocab_size)
        return train_bpe(settings, texts, vocab_size)

    monkeypatch.setattr(tokenizer_module, "train_bpe", counting)
    return calls


@pytest.mark.parametrize("text", [*_DOCUMENTS, *UNSEEN])
def test_encode_decode_round_trip_is_exact(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert ids and not set(ids) & set(SPECIAL_IDS.values())
    assert tokenizer.decode(ids) == text


@pytest.mark.slow
def test_saved_directory_loads_with_auto_tokenizer_and_gives_the_same_ids(tokenizer, saved_dir):
    assert (saved_dir / "tokenizer.json").is_file()
    loaded = transformers.AutoTokenizer.from_pretrained(saved_dir)
    for text in [*_DOCUMENTS, *UNSEEN]:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert (loaded.eos_token_id, loaded.pad_token_id) == (2, 1)


def test_no_temporary_directory_is_left_in_the_cache(saved_dir):
    assert [p.name for p in saved_dir.parent.iterdir()] == [saved_dir.name]


@pytest.mark.parametrize(("token", "token_id"), SPECIAL_IDS.items())
def test_special_tokens_have_fixed_ids_and_are_never_split(tokenizer, token, token_id):
    assert tokenizer.convert_tokens_to_ids(token) == token_id
    assert tokenizer(token)["input_ids"] == [token_id]  # one token, never split
    role = {"<s>": "bos", "<pad>": "pad", "</s>": "eos", "<unk>": "unk", "<mask>": "mask"}[token]
    assert getattr(tokenizer, f"{role}_token_id") == token_id


@pytest.mark.parametrize("vocab_size", [270, 300, 400])
def test_vocab_is_at_most_the_requested_size(tmp_path, vocab_size):
    settings = settings_with(vocab_size=vocab_size)
    tokenizer = prepare_tokenizer(settings, dataset(DOCUMENTS), MODEL_VOCAB, str(tmp_path))
    assert 256 + len(SPECIAL_IDS) < len(tokenizer) <= vocab_size


def test_vocab_size_defaults_to_the_models(tmp_path):
    tokenizer = prepare_tokenizer(settings_with(), dataset(DOCUMENTS), 300, str(tmp_path))
    assert 256 + len(SPECIAL_IDS) < len(tokenizer) <= 300


def test_same_text_and_settings_reuse_the_cached_tokenizer(tokenizer, cache_dir, monkeypatch):
    def no_training(*args):
        raise AssertionError("retrained although a cached tokenizer exists")

    monkeypatch.setattr(tokenizer_module, "train_bpe", no_training)
    again = prepare_tokenizer(SETTINGS, dataset(DOCUMENTS), MODEL_VOCAB, str(cache_dir))
    assert again.get_vocab() == tokenizer.get_vocab()
    assert len(trained_dirs(cache_dir)) == 1


@pytest.mark.parametrize(
    ("change", "documents", "settings"),
    [
        ("text", [*DOCUMENTS, "One more document."], SETTINGS),
        ("document split", [" ".join(DOCUMENTS[:2]), *DOCUMENTS[2:]], SETTINGS),
        ("vocab_size", DOCUMENTS, dataclasses.replace(SETTINGS, vocab_size=350)),
        ("min_frequency", DOCUMENTS, dataclasses.replace(SETTINGS, min_frequency=3)),
    ],
)
def test_a_change_of_text_or_setting_retrains(tmp_path, count_training, change, documents,
                                              settings):
    prepare_tokenizer(SETTINGS, dataset(DOCUMENTS), MODEL_VOCAB, str(tmp_path))
    prepare_tokenizer(settings, dataset(documents), MODEL_VOCAB, str(tmp_path))
    assert len(count_training) == 2, f"a changed {change} did not retrain"
    assert len(trained_dirs(tmp_path)) == 2


def cut_in_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def garble(path: Path) -> None:  # the same size, other bytes
    path.write_bytes(path.read_bytes().replace(b'"', b"'", 5))


# What a disk error, an interrupted copy or a quota hit does to a cached tokenizer.
DAMAGE = {
    "tokenizer.json truncated": lambda d: cut_in_half(d / "tokenizer.json"),
    "tokenizer.json garbled": lambda d: garble(d / "tokenizer.json"),
    "tokenizer_config.json lost": lambda d: (d / "tokenizer_config.json").unlink(),
    "record garbled": lambda d: garble(d / tokenizer_module.RECORD_FILE),
    # a tokenizer cached by an older flaxlm (no record) is checked by loading it
    "unrecorded, truncated": lambda d: ((d / tokenizer_module.RECORD_FILE).unlink(),
                                        cut_in_half(d / "tokenizer.json")),
}


@pytest.mark.parametrize("harm", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_cached_tokenizer_is_announced_and_trained_again(tmp_path, capsys, harm):
    first = prepare_tokenizer(SETTINGS, dataset(DOCUMENTS), MODEL_VOCAB, str(tmp_path))
    [directory] = trained_dirs(tmp_path)
    harm(directory)
    capsys.readouterr()
    again = prepare_tokenizer(SETTINGS, dataset(DOCUMENTS), MODEL_VOCAB, str(tmp_path))
    [line] = [line for line in capsys.readouterr().out.splitlines() if "damaged" in line]
    assert line.startswith(f"flaxlm: the cached tokenizer {directory} is damaged (")
    assert "tokenizer.path" not in line  # a setting the user never set
    assert again.get_vocab() == first.get_vocab()
    assert trained_dirs(tmp_path) == [directory]  # no scratch or damaged copy left beside it
    assert {p.name for p in directory.iterdir()} >= {"tokenizer.json", "tokenizer_config.json",
                                                     tokenizer_module.RECORD_FILE}


def test_a_tokenizer_cached_without_a_record_is_kept_and_recorded(tmp_path, count_training):
    prepare_tokenizer(SETTINGS, dataset(DOCUMENTS), MODEL_VOCAB, str(tmp_path))
    [directory] = trained_dirs(tmp_path)
    (directory / tokenizer_module.RECORD_FILE).unlink()
    prepare_tokenizer(SETTINGS, dataset(DOCUMENTS), MODEL_VOCAB, str(tmp_path))
    assert len(count_training) == 1
    assert (directory / tokenizer_module.RECORD_FILE).exists()


def test_a_corrupt_tokenizer_path_of_the_user_is_an_error_not_retrained(saved_dir, tmp_path,
                                                                        count_training):
    """Only flaxlm's own cache entries are rebuilt: the user's file is the user's to fix."""
    path = tmp_path / "tokenizer.json"
    path.write_bytes((saved_dir / "tokenizer.json").read_bytes()[:500])
    with pytest.raises(FlaxlmError, match="tokenizer.path"):
        prepare_tokenizer(settings_with(path=str(path)), dataset(["x"]), MODEL_VOCAB,
                          str(tmp_path))
    assert count_training == []


@pytest.mark.parametrize("target", ["directory", "tokenizer.json"])
def test_tokenizer_path_loads_a_directory_or_a_bare_tokenizer_json(tokenizer, saved_dir, target,
                                                                   count_training):
    path = saved_dir if target == "directory" else saved_dir / "tokenizer.json"
    loaded = prepare_tokenizer(
        settings_with(path=str(path)), dataset(["unused"]), MODEL_VOCAB, "/nonexistent-cache"
    )
    assert count_training == []
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded(UNSEEN[0])["input_ids"] == tokenizer(UNSEEN[0])["input_ids"]
    # Packing separates documents with EOS: a loaded tokenizer must know its special tokens.
    for token, token_id in SPECIAL_IDS.items():
        assert loaded.convert_tokens_to_ids(token) == token_id
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (0, 2, 1)


@pytest.mark.parametrize("target", ["directory", "tokenizer.json"])
def test_eos_token_setting_applies_to_a_loaded_tokenizer(saved_dir, target):
    # The "no end-of-sequence token" error tells the user to set tokenizer.eos_token.
    path = saved_dir if target == "directory" else saved_dir / "tokenizer.json"
    settings = settings_with(path=str(path), eos_token="<mask>")
    loaded = prepare_tokenizer(settings, dataset(["unused"]), MODEL_VOCAB, "/nonexistent-cache")
    assert loaded.eos_token_id == SPECIAL_IDS["<mask>"]


@pytest.mark.parametrize("name", ["missing", "missing/tokenizer.json"])
def test_missing_tokenizer_path_names_the_setting(tmp_path, name):
    with pytest.raises(FlaxlmError) as info:
        prepare_tokenizer(
            settings_with(path=str(tmp_path / name)), dataset(["x"]), MODEL_VOCAB, str(tmp_path)
        )
    assert "tokenizer.path" in str(info.value)
    assert str(tmp_path / name) in str(info.value)


def test_directory_without_a_tokenizer_names_the_setting(tmp_path):
    with pytest.raises(FlaxlmError, match="tokenizer.path"):
        prepare_tokenizer(settings_with(path=str(tmp_path)), dataset(["x"]), MODEL_VOCAB, "/x")


@pytest.mark.parametrize("how", ["trained", "loaded"])
def test_tokenizer_larger_than_the_model_vocab_names_model_vocab_size(tmp_path, saved_dir,
                                                                      tokenizer, how):
    settings = SETTINGS if how == "trained" else settings_with(path=str(saved_dir))
    small = len(tokenizer) - 1
    with pytest.raises(FlaxlmError) as info:
        prepare_tokenizer(settings, dataset(DOCUMENTS), small, str(tmp_path))
    assert f"model.vocab_size={small}" in str(info.value)
    assert str(len(tokenizer)) in str(info.value)


@pytest.mark.parametrize("text", [*_DOCUMENTS, *UNSEEN, "".join(_DOCUMENTS)])
def test_token_byte_lengths_add_up_to_the_utf8_length(tokenizer, text):
    lengths = token_byte_lengths(tokenizer)
    ids = tokenizer(text)["input_ids"]
    assert int(lengths[ids].sum()) == len(text.encode("utf-8"))


def test_token_byte_lengths_are_zero_for_special_tokens_and_positive_otherwise(tokenizer):
    lengths = token_byte_lengths(tokenizer)
    assert len(lengths) == len(tokenizer)
    special = sorted(SPECIAL_IDS.values())
    assert lengths[special].tolist() == [0] * len(special)
    assert (lengths[len(special):] >= 1).all()


@pytest.mark.parametrize(
    ("settings", "model_vocab", "setting"),
    [
        (settings_with(vocab_size=100), MODEL_VOCAB, "tokenizer.vocab_size=100"),
        (settings_with(), 200, "model.vocab_size=200"),
    ],
)
def test_vocab_below_the_byte_alphabet_names_the_setting_and_minimum(tmp_path, settings,
                                                                      model_vocab, setting):
    with pytest.raises(FlaxlmError) as info:
        prepare_tokenizer(settings, dataset(DOCUMENTS), model_vocab, str(tmp_path))
    message = str(info.value)
    assert setting in message and "at least 261" in message, message
    assert not (tmp_path / "tokenizers").exists()  # refused before training


def test_vocab_of_exactly_the_byte_alphabet_is_allowed(tmp_path):
    tokenizer = prepare_tokenizer(settings_with(vocab_size=261), dataset(DOCUMENTS), MODEL_VOCAB,
                                  str(tmp_path))
    assert len(tokenizer) == 256 + len(SPECIAL_IDS)


def test_training_on_a_long_document_sees_bounded_pieces_and_learns_the_same_merges(monkeypatch):
    """The trainer counts pre-tokens, which cutting a document at a space after a non-space
    leaves unchanged; whole, a document of tens of MB took the trainer gigabytes."""
    long_document = " ".join(_DOCUMENTS) * 1500
    assert len(long_document) > 4 * tokenizer_module.PIECE_CHARS
    reference = tokenizers.ByteLevelBPETokenizer()
    reference.train_from_iterator([[long_document]], vocab_size=400,
                                  special_tokens=list(SETTINGS.special_tokens))
    received = []
    original = tokenizers.ByteLevelBPETokenizer.train_from_iterator

    def spy(self, iterator, **kwargs):
        def recorded():
            for batch in iterator:
                received.extend(batch)
                yield batch
        return original(self, recorded(), **kwargs)

    monkeypatch.setattr(tokenizers.ByteLevelBPETokenizer, "train_from_iterator", spy)
    trained = tokenizer_module.train_bpe(SETTINGS, dataset([long_document]), 400)
    assert max(map(len, received)) <= tokenizer_module.PIECE_CHARS
    assert "".join(received) == long_document
    assert trained.backend_tokenizer.to_str() == reference._tokenizer.to_str()
