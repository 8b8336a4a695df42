"""The tokenizer: a byte-level BPE trained on the training text, or an existing one loaded.

A trained tokenizer is cached under `<cache_dir>/tokenizers/<hash>/`, the hash covering the
training text and every setting that shapes the result, so a second run on the same corpus
reuses it and any change retrains. It is saved as a transformers tokenizer directory
(`tokenizer.json` + `tokenizer_config.json`), loadable with `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

import datasets
import numpy as np
import tokenizers
import transformers

from flaxlm.config import TokenizerConfig
from flaxlm.data.fingerprint import settings_fingerprint, text_fingerprint
from flaxlm.errors import FlaxlmError


def prepare_tokenizer(
    settings: TokenizerConfig,
    train_texts: datasets.Dataset,
    model_vocab_size: int,
    cache_dir: str,
) -> transformers.PreTrainedTokenizerFast:
    """Load `settings.path`, or train (or reuse from the cache) a BPE on `train_texts`."""
    if settings.path is not None:
        tokenizer = load_tokenizer(settings.path, settings)
    else:
        vocab_size = settings.vocab_size or model_vocab_size
        key = settings_fingerprint(
            # train_docs only chooses the text, which the text fingerprint already covers;
            # leaving it out keeps the keys of existing caches valid.
            {**_shaping_settings(settings), "path": None, "vocab_size": vocab_size},
            tokenizers.__version__, transformers.__version__, text_fingerprint(train_texts),
        )
        directory = os.path.join(os.path.expanduser(cache_dir), "tokenizers", key[:20])
        if not os.path.exists(os.path.join(directory, "tokenizer.json")):
            _save_atomically(train_bpe(settings, train_texts, vocab_size), directory)
        tokenizer = load_tokenizer(directory, settings)
    check_fits_model(tokenizer, model_vocab_size, settings)
    return tokenizer


def _shaping_settings(settings: TokenizerConfig) -> dict:
    fields = dataclasses.asdict(settings)
    fields.pop("train_docs")
    return fields


def train_bpe(
    settings: TokenizerConfig, texts: datasets.Dataset, vocab_size: int
) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE as in the seed notebook: every byte is in the alphabet, so no text is
    ever unknown, and merges need `min_frequency` occurrences."""
    bpe = tokenizers.ByteLevelBPETokenizer()
    batches = (texts[i : i + 1000]["text"] for i in range(0, len(texts), 1000))
    bpe.train_from_iterator(
        batches,
        vocab_size=vocab_size,
        min_frequency=settings.min_frequency,
        special_tokens=list(settings.special_tokens),
        length=len(texts),
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token=settings.bos_token,
        eos_token=settings.eos_token,
        unk_token=settings.unk_token,
        pad_token=settings.pad_token,
        mask_token=settings.mask_token,
    )


def load_tokenizer(path: str, settings: TokenizerConfig) -> transformers.PreTrainedTokenizerFast:
    """A tokenizer directory (anything `AutoTokenizer` loads) or a bare tokenizer.json file.

    The special-token roles of `settings` (bos, eos, ...) are assigned wherever the token is in
    the vocabulary: a bare tokenizer.json carries no roles, and a directory's may differ.
    """
    path = os.path.expanduser(path)
    try:
        if os.path.isfile(path):
            tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
        elif os.path.isdir(path):
            tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        else:
            tokenizer = None
    except (OSError, ValueError, TypeError) as err:
        raise FlaxlmError(
            f"tokenizer.path={path!r} could not be loaded as a tokenizer ({err}). Point it at a "
            "directory written by `save_pretrained` or at a tokenizer.json file, or set "
            "tokenizer.path=null to train one on the corpus."
        ) from err
    if tokenizer is None:
        raise FlaxlmError(
            f"tokenizer.path={path!r} does not exist. Point it at a tokenizer directory or "
            "tokenizer.json file, or set tokenizer.path=null to train one on the corpus."
        )
    vocab = tokenizer.get_vocab()
    roles = {
        f"{role}_token": getattr(settings, f"{role}_token")
        for role in ("bos", "eos", "unk", "pad", "mask")
        if getattr(settings, f"{role}_token") in vocab
    }
    tokenizer.add_special_tokens(roles)
    return tokenizer


def check_fits_model(tokenizer, model_vocab_size: int, settings: TokenizerConfig) -> None:
    if len(tokenizer) > model_vocab_size:
        raise FlaxlmError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's embedding has only "
            f"model.vocab_size={model_vocab_size} rows, so some token ids would have no "
            f"embedding. Raise model.vocab_size to at least {len(tokenizer)}, or use a smaller "
            "tokenizer (tokenizer.vocab_size, or another tokenizer.path)."
        )
    if tokenizer.eos_token_id is None:
        raise FlaxlmError(
            f"The tokenizer has no end-of-sequence token ({settings.eos_token!r} is not in its "
            "vocabulary), and packing needs one to separate documents. Use a tokenizer that "
            "defines eos_token, or set tokenizer.eos_token to one of its special tokens."
        )


def token_byte_lengths(tokenizer: transformers.PreTrainedTokenizerFast) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens): the denominator of
    bits per byte, which compares models across tokenizers."""
    lengths = np.zeros(len(tokenizer), dtype=np.int32)
    backend = tokenizer.backend_tokenizer
    byte_level = isinstance(backend.decoder, tokenizers.decoders.ByteLevel)
    special = set(tokenizer.all_special_ids)
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in special or token_id >= len(lengths):
            continue
        if byte_level:  # every character of a byte-level token stands for one byte
            lengths[token_id] = len(token)
        else:
            lengths[token_id] = len(backend.decode([token_id]).encode("utf-8"))
    return lengths


def _save_atomically(tokenizer: transformers.PreTrainedTokenizerFast, directory: str) -> None:
    """Write into a temporary sibling, then rename: a killed run leaves no half-written
    tokenizer that a later run would trust; a concurrent run that finished first wins."""
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        tokenizer.save_pretrained(tmp)
        if os.path.isdir(directory):  # left incomplete by an older, killed version: replace it
            shutil.rmtree(directory)
        os.rename(tmp, directory)
    except OSError:
        if not os.path.exists(os.path.join(directory, "tokenizer.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
