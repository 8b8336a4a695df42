"""The tokenizer: a byte-level BPE trained on the training text, or an existing one loaded.

Text reaches the tokenizer in bounded pieces (`document_pieces`), whatever a document's length:
while `tokenizers` encodes one string it holds alignments, offsets and token strings for every
character, many times the string's size, so a one-line file of tens of MB would need gigabytes.

A trained tokenizer is cached under `<cache_dir>/tokenizers/<hash>/`, the hash covering the training
text and every setting that shapes the result, so a second run on the same corpus reuses it and any
change retrains. On several hosts process 0 trains it while the others wait. It is saved as a
transformers tokenizer directory (`tokenizer.json` + `tokenizer_config.json`), loadable with
`AutoTokenizer.from_pretrained`, with a record of its files (data/cache.py) that is checked, with
loading it, on every use; a damaged one is trained again.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import tokenizers

from flaxlm import distributed
from flaxlm.config import TokenConvention, TokenizerConfig
from flaxlm.data import cache
from flaxlm.data.fingerprint import settings_fingerprint, text_fingerprint
from flaxlm.errors import FlaxlmError, first_line
from flaxlm.lazy_imports import lazy_module
from flaxlm.storage import cached_copy, is_url

datasets = lazy_module("datasets")
transformers = lazy_module("transformers")

PIECE_CHARS = 1 << 16  # the longest string handed to the tokenizer: a piece of a long document
ENCODE_CHARS = 1 << 20  # characters tokenised (or counted for training) together
RECORD_FILE = "flaxlm-record.json"  # in a cached tokenizer: its files' sizes and checksums
# Cut at every space after a non-space: a tokenizer whose ids of these pieces, joined, equal the
# whole text's can have long documents cut at such spaces without changing a token.
_PROBE = "Hello, world!  Two  spaces,\ta tab\nand a line; it's 3.14 € — ðæ 漢字 ok   end"


def prepare_tokenizer(
    settings: TokenizerConfig,
    train_texts: datasets.Dataset,
    model_vocab_size: int,
    cache_dir: str,
) -> transformers.PreTrainedTokenizerFast:
    """Load `settings.path`, or train (or reuse from the cache) a BPE on `train_texts`."""
    if settings.path is not None:
        path = (cached_copy(settings.path, cache_dir, "tokenizer.path")
                if is_url(settings.path) else settings.path)  # a bucket's: copied to the cache
        tokenizer = load_tokenizer(path, settings)
    else:
        vocab_size = _bpe_vocab_size(settings, model_vocab_size)
        key = settings_fingerprint(
            # train_docs only chooses the text, which the text fingerprint already covers;
            # leaving it out keeps the keys of existing caches valid.
            {**_shaping_settings(settings), "path": None, "vocab_size": vocab_size},
            tokenizers.__version__, transformers.__version__, text_fingerprint(train_texts),
        )
        directory = os.path.join(os.path.expanduser(cache_dir), "tokenizers", key[:20])
        loaded = []

        def build() -> None:  # once in every process: process 0 first
            loaded.append(_cached_tokenizer(
                directory, settings, lambda: train_bpe(settings, train_texts, vocab_size)))

        distributed.primary_first("training the tokenizer", build)
        tokenizer = loaded[0]
    check_fits_model(tokenizer, model_vocab_size, settings)
    return tokenizer


def _bpe_vocab_size(settings: TokenizerConfig, model_vocab_size: int) -> int:
    """The size to train a BPE to: tokenizer.vocab_size, or null → model.vocab_size. Below
    the byte alphabet plus the special tokens the trainer would quietly return that many tokens
    anyway, with no merge learnt, so a smaller size is an error naming the setting behind it."""
    minimum = 256 + len(set(settings.special_tokens))
    vocab_size = settings.vocab_size or model_vocab_size
    if vocab_size < minimum:
        setting = (f"tokenizer.vocab_size={settings.vocab_size}" if settings.vocab_size else
                   f"model.vocab_size={model_vocab_size} (which tokenizer.vocab_size=null follows)")
        raise FlaxlmError(
            f"{setting} is too small for a byte-level BPE: its alphabet alone is 256 byte "
            f"tokens plus {minimum - 256} tokenizer.special_tokens, so it needs at least "
            f"{minimum} before it learns any merge. Set tokenizer.vocab_size (and "
            f"model.vocab_size) to at least {minimum}, typically a few thousand, or load an "
            "existing tokenizer with tokenizer.path."
        )
    return vocab_size


def _shaping_settings(settings: TokenizerConfig) -> dict:
    fields = dataclasses.asdict(settings)
    # train_docs only chooses the text; convention is how a run uses the tokenizer.
    fields.pop("train_docs")
    fields.pop("convention")
    return fields


def train_bpe(
    settings: TokenizerConfig, texts: datasets.Dataset, vocab_size: int
) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE: every byte is in the alphabet, so no text is
    ever unknown, and merges need `min_frequency` occurrences."""
    bpe = tokenizers.ByteLevelBPETokenizer()
    documents = (text for i in range(0, len(texts), 1000) for text in texts[i : i + 1000]["text"])
    # Pieces, not whole documents: the trainer counts the words (pre-tokens) of each string,
    # which are the same whether a document is cut at a space after a non-space or not.
    batches = ([piece for _, piece, _ in group] for group in piece_groups(documents))
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


def document_pieces(text: str, piece_chars: int) -> Iterator[tuple[str, bool]]:
    """`text` in pieces of at most `piece_chars` characters, each with whether the cut before it
    is clean: the first piece, or one that starts at a space after a non-space character.
    Byte-level BPE (the GPT-2 split pattern: a pre-token holds a space only as its first
    character or among spaces) and whitespace-splitting pre-tokenizers end a pre-token there,
    and no token spans two pre-tokens, so the pieces' ids joined are the whole text's. Only a
    stretch of `piece_chars` characters without such a space is cut where it ends, mid-word."""
    start, clean = 0, True
    while len(text) - start > piece_chars:
        end = text.rfind(" ", start + 1, start + piece_chars + 1)
        while end > start and text[end - 1].isspace():  # inside a run of spaces: look before it
            end = text.rfind(" ", start + 1, end)
        clean_end = end > start
        if not clean_end:
            end = start + piece_chars
        yield text[start:end], clean
        start, clean = end, clean_end
    yield text[start:], clean


def piece_groups(documents: Iterable[str]) -> Iterator[list[tuple[int, str, bool]]]:
    """(document index, piece, clean cut) of `documents`' pieces of at most PIECE_CHARS
    characters, in groups of at most ENCODE_CHARS characters: what one call of the tokenizer
    receives."""
    group: list[tuple[int, str, bool]] = []
    chars = 0
    for index, text in enumerate(documents):
        for piece, clean in document_pieces(text, PIECE_CHARS):
            if group and chars + len(piece) > ENCODE_CHARS:
                yield group
                group, chars = [], 0
            group.append((index, piece, clean))
            chars += len(piece)
    if group:
        yield group


class DocumentEncoder:
    """The token ids of whole documents (no special tokens, no padding, never truncated), each
    tokenised in pieces of bounded length (`document_pieces`), so memory does not grow with a
    document's length.

    For byte-level BPE (as trained here, and GPT-2's) and whitespace-splitting tokenizers the
    ids are exactly those of tokenising each document whole. A tokenizer that adds something to
    every string it gets (a `Prepend` normalizer, as in Llama-2's tokenizer.json) would tokenise
    a cut differently; `inexact_cuts` counts the cuts where this tokenizer's ids may differ
    (checked once on a probe sentence), for the caller to report."""

    def __init__(self, backend: tokenizers.Tokenizer):
        self.backend = _unpadded(backend)
        self.inexact_cuts = 0
        self._clean_cuts_exact: bool | None = None  # probed at the first cut

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """int32 token ids of each of `texts`."""
        parts: list[list[np.ndarray]] = [[] for _ in texts]
        for group in piece_groups(texts):
            encodings = self.backend.encode_batch(
                [piece for _, piece, _ in group], add_special_tokens=False
            )
            for (index, _, clean), encoding in zip(group, encodings):
                if parts[index]:  # a piece after a cut
                    self.inexact_cuts += not (clean and self._cuts_exact())
                parts[index].append(np.array(encoding.ids, dtype=np.int32))
            del encodings  # free them before the next group is encoded, not after
        return [pieces[0] if len(pieces) == 1 else np.concatenate(pieces) for pieces in parts]

    def _cuts_exact(self) -> bool:
        if self._clean_cuts_exact is None:
            pieces = re.split(r"(?<=\S)(?= )", _PROBE)
            encodings = self.backend.encode_batch([_PROBE, *pieces], add_special_tokens=False)
            joined = [i for encoding in encodings[1:] for i in encoding.ids]
            self._clean_cuts_exact = encodings[0].ids == joined
        return self._clean_cuts_exact

    def inexact_cuts_warning(self) -> str | None:
        if not self.inexact_cuts:
            return None
        return (
            f"flaxlm: warning: {self.inexact_cuts} cut(s) of documents longer than "
            f"{PIECE_CHARS} characters, tokenised in pieces to bound memory, may give other "
            "tokens than the whole document would (a cut mid-word, where no space was near, or a "
            "tokenizer that adds a token to every string)."
        )


def _unpadded(backend: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """`backend`, or a copy of it without padding and truncation. Set by a tokenizer.json or
    left by an earlier call, they would pad every text to a batch length and cut it at
    max_length; switched off in a copy, as the tokenizer itself is also saved and exported."""
    if backend.padding or backend.truncation:
        backend = tokenizers.Tokenizer.from_str(backend.to_str())
        backend.no_padding()
        backend.no_truncation()
    return backend


def load_tokenizer(path: str, settings: TokenizerConfig) -> transformers.PreTrainedTokenizerFast:
    """A tokenizer directory (anything `AutoTokenizer` loads) or a bare tokenizer.json file.

    The special-token roles of `settings` (bos, eos, ...) are assigned wherever the token is in
    the vocabulary: a bare tokenizer.json carries no roles, and a directory's may differ.
    """
    path = os.path.expanduser(path)
    try:
        if os.path.isfile(path):
            tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
        elif os.path.isdir(path) and _tokenizer_class(path) in _GENERIC_TOKENIZER_CLASSES:
            # What AutoTokenizer would build, without importing its registry of every model's
            # tokenizer (which pulls in PyTorch where installed: seconds at every start).
            tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(path)
        elif os.path.isdir(path):
            tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        else:
            tokenizer = None
    except Exception as err:  # noqa: BLE001 — `tokenizers` raises a bare Exception on bad JSON
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


# tokenizer_config.json's `tokenizer_class` of a tokenizer with no model-specific class, as
# flaxlm saves its own.
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as file:
            return json.load(file).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None  # AutoTokenizer finds out what it is, or says what is wrong


def _cached_tokenizer(directory: str, settings: TokenizerConfig,
                      train: Callable[[], transformers.PreTrainedTokenizerFast]):
    """The tokenizer cached in `directory`, trained and cached first when it is absent or
    damaged: its files differ from their record, or it does not load. One cached before
    records existed is checked by loading it, then recorded."""
    cache.remove_stale_scratch(os.path.dirname(directory))
    if os.path.isdir(directory):
        record = os.path.join(directory, RECORD_FILE)
        unrecorded = not os.path.exists(record)
        problem = None if unrecorded else cache.damage(record)
        if problem is None:
            try:
                tokenizer = load_tokenizer(directory, settings)
            except FlaxlmError as err:  # its message names tokenizer.path, not set here
                problem = f"it does not load: {first_line(err.__cause__ or err)}"
            else:
                if unrecorded:
                    cache.write_record(record, _entry_files(directory))
                return tokenizer
        print(f"flaxlm: the cached tokenizer {directory} is damaged ({problem}); training it "
              "again", flush=True)
    _save_atomically(train(), directory)
    return load_tokenizer(directory, settings)


def _entry_files(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory)
                  if name != RECORD_FILE and os.path.isfile(os.path.join(directory, name)))



def _save_atomically(tokenizer: transformers.PreTrainedTokenizerFast, directory: str) -> None:
    """Save and record it in a scratch folder, then rename it into place: a killed run leaves
    no half-written tokenizer that a later run would trust. A damaged tokenizer at `directory`
    is moved into the scratch folder (removed with it); one that a concurrent run cached first
    is kept."""
    with cache.scratch_folder(os.path.dirname(directory)) as scratch:
        entry = os.path.join(scratch, "tokenizer")
        tokenizer.save_pretrained(entry)
        cache.write_record(os.path.join(entry, RECORD_FILE), _entry_files(entry))
        if os.path.isdir(directory):
            if cache.damage(os.path.join(directory, RECORD_FILE)) is None:
                return
            os.rename(directory, os.path.join(scratch, "damaged"))
        try:
            os.rename(entry, directory)
        except OSError:  # a concurrent run renamed its copy in first
            if cache.damage(os.path.join(directory, RECORD_FILE)) is not None:
                raise


def keeps_own_conventions(convention: TokenConvention | str, init_from: str | None) -> bool:
    """Whether a run frames documents and prompts with the tokenizer's own special tokens
    (`tokenizer.convention`): auto does so for a model started from someone else's weights
    (`model.init_from`), which learnt them; a model flaxlm trains learns flaxlm's."""
    convention = TokenConvention(convention)
    if convention is TokenConvention.auto:
        return bool(init_from)
    return convention is TokenConvention.tokenizer


def document_prefix(tokenizer: transformers.PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The special tokens `tokenizer` puts in front of every text it encodes (a BOS), which
    packing puts in front of every document when the tokenizer keeps its own conventions.
    Nothing for `with_document_start`'s EOS: that is the EOS packing puts after each
    document."""
    if has_document_start(tokenizer):
        return ()
    encoding = _unpadded(tokenizer.backend_tokenizer).encode(_PROBE)
    return tuple(encoding.ids[:encoding.sequence_ids.index(0)])


def glues_pairs(tokenizer: transformers.PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer` encodes a pair of texts with no special token between them (no
    post-processor; GPT-2's; a Llama tokenizer's `<s> $A $B` or `$A $B`), so that the model
    cannot see where the first ends."""
    encoding = _unpadded(tokenizer.backend_tokenizer).encode(_PROBE, _PROBE)
    sequences = encoding.sequence_ids
    last_of_first = len(sequences) - 1 - sequences[::-1].index(0)
    return sequences.index(1) == last_of_first + 1


def prompt_tokenizer(tokenizer: transformers.PreTrainedTokenizerBase, own_conventions: bool):
    """The tokenizer that reads a prompt as the model read the start of a document: as it is,
    when it keeps its own conventions (`keeps_own_conventions`), else `with_document_start`."""
    return tokenizer if own_conventions else with_document_start(tokenizer)


def with_document_start(tokenizer: transformers.PreTrainedTokenizerBase):
    """`tokenizer`, or a copy of it, that reads a text as the start of a document, the way a
    language model trained by flaxlm saw every document: after the EOS token. (Packing encodes
    documents without special tokens and puts EOS after each, `join_documents`.) This is
    flaxlm's convention (`tokenizer.convention=flaxlm`), not that of a model from someone
    else's weights.

    Its post-processor puts EOS in front (`</s> $A`; a pair is two documents in a row,
    `</s> $A </s> $B`), so `tokenizer(prompt)` gives the ids flaxlm-generate feeds the model,
    in transformers too once exported, and `add_special_tokens=False` the bare ids. A tokenizer
    without an EOS token is returned as it is.
    """
    if tokenizer.eos_token_id is None or has_document_start(tokenizer):
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)  # the caller's may be packing with add_special_tokens
    set_post_processor(tokenizer, _document_template(tokenizer))
    return tokenizer


def has_document_start(tokenizer: transformers.PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer`'s post-processor ends with `with_document_start`'s template."""
    if tokenizer.eos_token_id is None:
        return False
    processors = _post_processor_states(tokenizer.backend_tokenizer.post_processor)
    return bool(processors) and processors[-1] == _state(_document_template(tokenizer))


def set_post_processor(tokenizer: transformers.PreTrainedTokenizerBase,
                       template: tokenizers.processors.TemplateProcessing) -> None:
    """Make `template` what `tokenizer` adds to the texts it encodes. A ByteLevel
    post-processor, which only trims offsets, stays in front of it; any other is replaced."""
    backend = tokenizer.backend_tokenizer
    byte_level = [state for state in _post_processor_states(backend.post_processor)
                  if state["type"] == "ByteLevel"]
    if byte_level:
        options = {key: value for key, value in byte_level[0].items() if key != "type"}
        template = tokenizers.processors.Sequence(
            [tokenizers.processors.ByteLevel(**options), template])
    backend.post_processor = template


def _document_template(tokenizer) -> tokenizers.processors.TemplateProcessing:
    eos = tokenizer.eos_token
    return tokenizers.processors.TemplateProcessing(
        single=f"{eos} $A", pair=f"{eos} $A {eos} $B",
        special_tokens=[(eos, tokenizer.eos_token_id)],
    )


def _post_processor_states(processor) -> list[dict]:
    """A post-processor as the JSON states of the processors it applies, in order."""
    if processor is None:
        return []
    state = _state(processor)
    return state["processors"] if state["type"] == "Sequence" else [state]


def _state(processor) -> dict:
    return json.loads(processor.__getstate__())
