"""task=clm: pre-train (or continue pre-training) a causal language model.

corpus → tokenizer (trained byte-level BPE, a given one, or model.init_from's) → packed blocks
(cached; or packed on the fly from a stream) → jitted data-parallel steps → evaluation (loss,
perplexity, bits per byte over every validation token once) → an HF-loadable model/ with text
samples.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from flaxlm.config import CorpusSource, LanguageConfig, TrainConfig
from flaxlm.data.corpus import load_corpus, load_corpus_stream, read_without_datasets
from flaxlm.data.fingerprint import documents_fingerprint, text_fingerprint
from flaxlm.data.loader import block_loader
from flaxlm.data.mixture import (
    MixtureSchedule,
    check_mixture_settings,
    describe_weights,
    mixture_weights,
    source_error,
    stage_weights,
    text_bytes,
    tokenizer_sample,
)
from flaxlm.data.mixture_loader import MixtureLoader, PackedSource, StreamedSource
from flaxlm.data.packing import PackedBlocks, pack_blocks
from flaxlm.data.streaming import StreamingLoader, process_shard
from flaxlm.data.tables import text_dataset
from flaxlm.data.texts import Texts
from flaxlm.data.tokenizer import document_prefix, prepare_tokenizer
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module
from flaxlm.models import pretrained
from flaxlm.tasks import base
from flaxlm.tasks.language_model import LanguageModelTask, own_conventions, token_bytes
from flaxlm.tasks.pipeline import Run, TaskData
from flaxlm.training.evaluation import (
    Evaluate,
    LMEvaluator,
    MixtureEvaluator,
    source_metrics,
)
from flaxlm.training.step import position_bucket_name, position_ranges

datasets = lazy_module("datasets")

# Training documents of a streamed corpus that its fingerprint covers, from the stream's start.
STREAM_CHECKED_DOCS = 1000
# What its evaluation (the LM `Evaluator`) logs: every one of them is better lower.
EVAL_METRICS = ("eval/loss", "eval/perplexity", "eval/bits_per_byte")


def position_metrics(config: TrainConfig) -> tuple[str, ...]:
    """The loss and perplexity by position bucket (`eval.position_buckets`) that a run of
    `task.max_seq_length` blocks (null: the model's context) logs; a bucket no token
    reaches logs nothing."""
    block_length = config.task.max_seq_length or config.model.max_positions
    return tuple(f"eval/{position_bucket_name(*bucket)}/{metric}"
                 for bucket in position_ranges(config.eval.position_buckets, block_length)
                 for metric in ("loss", "perplexity"))


# What the banner says of the blocks, by task.document_masking.
_DOCUMENTS = {True: ", each document attending to itself only",
              False: ", documents attending across their boundaries"}
# A default block length (the model's max_positions) above this is announced: activation memory
# grows with it, and a checkpoint's context (8,192 positions is common) can exhaust a host.
LONG_BLOCK = 2048


class CausalLM(LanguageModelTask):
    """The causal-LM task: its corpus packed into blocks, evaluated on every validation token
    (per source, for a mixture); the rest is `LanguageModelTask`'s."""

    chat = False

    def libraries(self, config: TrainConfig) -> list[str]:
        reads_itself = (not is_mixture(config) and config.language is not None
                        and read_without_datasets(config.language))
        return ["transformers.PreTrainedTokenizerFast", *([] if reads_itself else ["datasets"])]

    def check_data_settings(self, config: TrainConfig) -> None:
        if config.language is None:
            raise FlaxlmError(
                "task=clm needs a corpus, and language is null. Pick one, e.g. "
                "language=en-builtin (offline English) or language=files "
                "'language.files=[data/*.txt]'."
            )
        if is_mixture(config):
            check_mixture_settings(config.mixture)
            if config.language.streaming:
                raise FlaxlmError(
                    "language.streaming=true streams one corpus; a mixture's sources stream "
                    "each on its own: set mixture.sources.<language>.streaming=true.")
        if any(language.streaming for language in corpora(config).values()):
            check_streaming_settings(config)

    def eval_metrics(self, config: TrainConfig) -> base.EvalMetrics:
        logged = (EVAL_METRICS + position_metrics(config)
                  + (source_metrics(corpora(config)) if is_mixture(config) else ()))
        return base.EvalMetrics(logged, "eval/loss", lower_is_better=logged)

    def sequence_length(self, config: TrainConfig, seq_len: int) -> int:
        seq_len = super().sequence_length(config, seq_len)
        announce_long_blocks(config, seq_len)
        return seq_len

    def data(self, run: Run) -> LMData:
        config, seq_len = run.config, run.seq_len
        fixed_tokenizer = (pretrained.load_pretrained_tokenizer(run.start.checkpoint_dir)
                           if run.start.checkpoint_dir and config.tokenizer.path is None
                           else None)
        prepare = (_mixed_data if is_mixture(config) else
                   _streamed_data if config.language.streaming else _packed_data)
        data = prepare(config, run.job.mesh, seq_len, run.batch_size, fixed_tokenizer,
                       own_conventions(config))
        if data.weights is not None and config.mixture.weights is None:
            # The weights the temperature gave, from the sources' sizes: what the run trains by.
            run.job.record_in_config("mixture", {"weights": data.weights})
        eval_size = sum(len(blocks) for blocks in data.eval_blocks.values())
        mixed = (f" | mixture {describe_weights(data.weights)}" + "".join(
            f", from step {stage.start_step} {describe_weights(weights)}"
            for stage, weights in zip(config.mixture.stages,
                                      stage_weights(config.mixture, data.weights)))
                 if data.weights is not None else "")
        data.trains_on = (f"{data.train_size} train / {eval_size} eval blocks of {seq_len} "
                          f"tokens{_DOCUMENTS[config.task.document_masking]}{mixed}")
        return data

    def evaluator(self, run: Run) -> Evaluate:
        data, bytes_of_tokens = run.data, token_bytes(run)
        evaluators = {name: LMEvaluator(run.training.steps, blocks.tokens, run.eval_batch_size,
                                        run.job.mesh, bytes_of_tokens, blocks.document_starts)
                      for name, blocks in data.eval_blocks.items()}
        return (MixtureEvaluator(evaluators) if data.weights is not None
                else next(iter(evaluators.values())))


@dataclasses.dataclass(kw_only=True)
class LMData(TaskData):
    """What the task trains and evaluates on."""

    eval_blocks: dict[str, PackedBlocks]  # by language: one, or each source of a mixture
    train_size: int | str  # training blocks, or "streamed"
    weights: dict[str, float] | None = None  # a mixture's, by source, before any stage
    trains_on: str = ""  # said once the blocks are counted (`CausalLM.data`)


def _packed_data(config: TrainConfig, mesh, seq_len: int, batch_size: int, tokenizer=None,
                 own_conventions: bool = False) -> LMData:
    """The whole corpus tokenised (by `tokenizer`, or one prepared from the config) and packed
    (cached), shuffled per epoch. Its fingerprint is the text's content hash, which keys the
    block cache too (hashed once per process)."""
    corpus = load_corpus(config.language, config.cache_dir)
    tokenizer = tokenizer or prepare_tokenizer(
        config.tokenizer, corpus.train, config.model.vocab_size, config.cache_dir
    )
    prefix = _document_prefix(tokenizer, own_conventions)
    documents = config.task.document_masking
    train_blocks = pack_blocks(corpus.train, tokenizer, seq_len, config.cache_dir,
                               "tokenize train", prefix, documents)
    eval_blocks = pack_blocks(corpus.validation, tokenizer, seq_len, config.cache_dir,
                              "tokenize validation", prefix, documents)
    check_corpus_size(config, len(train_blocks), len(eval_blocks), seq_len, batch_size)
    loader = block_loader(train_blocks.tokens, batch_size, mesh, seed=config.seed,
                          document_starts=train_blocks.document_starts)
    fingerprint = {"training data": text_fingerprint(corpus.train),
                   "validation data": text_fingerprint(corpus.validation)}
    return LMData(tokenizer=tokenizer, loader=loader, fingerprint=fingerprint,
                  eval_blocks={config.language.name: eval_blocks}, train_size=len(train_blocks))


def _streamed_data(config: TrainConfig, mesh, seq_len: int, batch_size: int, tokenizer=None,
                   own_conventions: bool = False) -> LMData:
    """language.streaming: a small validation head packed like above; training packed on the
    fly from this process's shard of the rest of the stream. Its fingerprint: the validation
    head's text and the first STREAM_CHECKED_DOCS training documents (reading the whole
    stream would cost a pass over it at every start)."""
    validation, train_stream = load_corpus_stream(config.language, config.cache_dir)
    if tokenizer is None:
        sample = text_dataset(
            [row["text"] for row in train_stream.take(config.tokenizer.train_docs)])
        tokenizer = prepare_tokenizer(
            config.tokenizer, sample, config.model.vocab_size, config.cache_dir
        )
    prefix = _document_prefix(tokenizer, own_conventions)
    eval_blocks = pack_blocks(validation, tokenizer, seq_len, config.cache_dir,
                              "tokenize validation", prefix, config.task.document_masking)
    check_eval_size(config, len(eval_blocks), seq_len)
    loader = StreamingLoader(
        process_shard(train_stream, jax.process_index(), jax.process_count()),
        tokenizer,
        seq_len,
        batch_size,
        mesh,
        seed=config.seed,
        shuffle_buffer=config.language.shuffle_buffer,
        max_steps=config.trainer.max_steps,
        prefix=prefix,
        documents=config.task.document_masking,
    )
    head = documents_fingerprint(row["text"] for row in train_stream.take(STREAM_CHECKED_DOCS))
    fingerprint = {f"training data (first {STREAM_CHECKED_DOCS} documents of the stream)": head,
                   "validation data": text_fingerprint(validation)}
    return LMData(tokenizer=tokenizer, loader=loader, fingerprint=fingerprint,
                  eval_blocks={config.language.name: eval_blocks}, train_size="streamed")


def is_mixture(config: TrainConfig) -> bool:
    """Whether the run mixes several corpora (`language=[is,no]`, language.source=mixture)."""
    return config.language.source == CorpusSource.mixture


def corpora(config: TrainConfig) -> dict[str, LanguageConfig]:
    """The corpora the run reads, by name: a mixture's sources, or the one language."""
    if is_mixture(config):
        return dict(config.mixture.sources) if config.mixture else {}
    return {config.language.name: config.language}


class _Source(NamedTuple):
    """One source of a mixture as read: its validation documents, its training documents (a
    stream's whole stream: each process's shard is taken when the loader is made), and the
    text its share of the tokenizer's sample comes from."""

    language: LanguageConfig
    validation: datasets.Dataset
    train: datasets.Dataset | datasets.IterableDataset
    tokenizer_text: datasets.Dataset


def _read_source(name: str, language: LanguageConfig, config: TrainConfig) -> _Source:
    """A source's corpus loaded and checked (an error names the source)."""
    try:
        if not language.streaming:
            corpus = load_corpus(language, config.cache_dir)
            # A mixture weighs and samples its sources with Arrow's string kernels.
            train, validation = (split.as_dataset() if isinstance(split, Texts) else split
                                 for split in (corpus.train, corpus.validation))
            return _Source(language, validation, train, train)
        validation, train = load_corpus_stream(language, config.cache_dir)
        head = text_dataset([row["text"] for row in train.take(config.tokenizer.train_docs)])
        if not len(head):
            raise FlaxlmError(f"{name}'s training stream holds no document after its "
                              "validation head. Add text, or lower language.max_eval_docs.")
        return _Source(language, validation, train, head)
    except FlaxlmError as err:
        raise source_error(name, language, err) from err


def _mixed_data(config: TrainConfig, mesh, seq_len: int, batch_size: int, tokenizer=None,
                own_conventions: bool = False) -> LMData:
    """language=[...]: every source read and checked first; then one tokenizer, trained on a
    sample drawn with the weights (data/mixture.py); then each source packed on its own (a
    streamed one on the fly), its validation blocks evaluated on their own. Its fingerprint:
    each source's, as a single corpus's."""
    mixture = config.mixture
    read = {name: _read_source(name, language, config)
            for name, language in mixture.sources.items()}
    sizes = {name: int(text_bytes(source.train).sum()) for name, source in read.items()
             if not source.language.streaming}
    weights = mixture_weights(mixture, sizes)
    if tokenizer is None:
        sample = tokenizer_sample({name: s.tokenizer_text for name, s in read.items()}, weights)
        tokenizer = prepare_tokenizer(config.tokenizer, sample, config.model.vocab_size,
                                      config.cache_dir)
    prefix = _document_prefix(tokenizer, own_conventions)
    documents = config.task.document_masking
    sources, eval_blocks, fingerprint = [], {}, {}
    for name, source in read.items():
        eval_blocks[name] = pack_blocks(source.validation, tokenizer, seq_len, config.cache_dir,
                                        f"tokenize validation ({name})", prefix, documents)
        fingerprint[f"validation data ({name})"] = text_fingerprint(source.validation)
        try:
            check_eval_size(config, len(eval_blocks[name]), seq_len, source.language)
        except FlaxlmError as err:
            raise source_error(name, source.language, err) from err
        if source.language.streaming:
            sources.append(StreamedSource(
                name, process_shard(source.train, jax.process_index(), jax.process_count()),
                tokenizer, seq_len, config.seed, source.language.shuffle_buffer, prefix))
            fingerprint[f"training data ({name}, first {STREAM_CHECKED_DOCS} documents of "
                        "the stream)"] = documents_fingerprint(
                row["text"] for row in source.train.take(STREAM_CHECKED_DOCS))
            continue
        blocks = pack_blocks(source.train, tokenizer, seq_len, config.cache_dir,
                             f"tokenize train ({name})", prefix, documents)
        if weights[name] > 0 and len(blocks) == 0:
            raise source_error(name, source.language, FlaxlmError(
                f"its training split is shorter than one block of {seq_len} tokens, and the "
                "mixture weighs it. Use more text, or a smaller task.max_seq_length."))
        sources.append(PackedSource(name, blocks.tokens, blocks.document_starts, config.seed))
        fingerprint[f"training data ({name})"] = text_fingerprint(source.train)
    schedule = MixtureSchedule.of(list(read), weights, zip(
        (stage.start_step for stage in mixture.stages), stage_weights(mixture, weights)))
    loader = MixtureLoader(sources, schedule, batch_size, mesh, config.seed,
                           config.trainer.max_steps, documents=documents)
    packed = sum(len(s.blocks) for s in sources if isinstance(s, PackedSource))
    if loader.steps_per_epoch == 0:
        raise FlaxlmError(
            f"The sources of language={config.language.name} make {packed} training block(s) "
            f"of {seq_len} tokens together, fewer than one global batch of {batch_size} "
            "(per-device batch × devices × trainer.grad_accum_steps), which is one epoch of "
            "a mixture. Use more text, or lower hardware.per_device_batch_size, "
            "trainer.grad_accum_steps or task.max_seq_length.")
    return LMData(tokenizer=tokenizer, loader=loader, fingerprint=fingerprint,
                  eval_blocks=eval_blocks, train_size="streamed" if loader.streamed else packed,
                  weights=weights)


def _document_prefix(tokenizer, own_conventions: bool) -> tuple[int, ...]:
    """What packing puts in front of every document: the tokenizer's own special tokens (its
    BOS) when the model keeps its conventions, said in one line; nothing with flaxlm's."""
    if not own_conventions:
        return ()
    prefix = document_prefix(tokenizer)
    before = "".join(tokenizer.convert_ids_to_tokens(list(prefix))) if prefix else "nothing"
    print(f"flaxlm: documents and prompts keep the tokenizer's own special tokens "
          f"(tokenizer.convention): {before} before and {tokenizer.eos_token} after each "
          "document, prompts as the tokenizer encodes them")
    return prefix


def announce_long_blocks(config: TrainConfig, seq_len: int) -> None:
    """One line when the default block length, the model's context, is long."""
    if config.task.max_seq_length is None and seq_len > LONG_BLOCK:
        origin = "from model.init_from's config.json" if config.model.init_from else "the preset's"
        print(f"flaxlm: note: blocks of {seq_len} tokens, model.max_positions ({origin}), since "
              "task.max_seq_length is null; activation memory grows with the block length. "
              "Set task.max_seq_length (e.g. 1024) for shorter blocks.")


def check_streaming_settings(config: TrainConfig) -> None:
    if config.trainer.max_steps is None:
        raise FlaxlmError(
            "language.streaming=true needs trainer.max_steps: a streamed corpus has no known "
            "length, so trainer.num_epochs cannot say how long to train. Set "
            "trainer.max_steps, e.g. trainer.max_steps=10000."
        )
    for key, value in [("language.shuffle_buffer", config.language.shuffle_buffer),
                       ("tokenizer.train_docs", config.tokenizer.train_docs)]:
        if value < 1:
            raise FlaxlmError(f"{key}={value} must be at least 1.")


def check_corpus_size(config: TrainConfig, train_blocks: int, eval_blocks: int, seq_len: int,
                      batch_size: int) -> None:
    check_eval_size(config, eval_blocks, seq_len)
    if train_blocks < batch_size:
        raise FlaxlmError(
            f"The training split of language={config.language.name} makes {train_blocks} "
            f"block(s) of {seq_len} tokens, fewer than one global batch of {batch_size} "
            "(per-device batch × devices × trainer.grad_accum_steps). Use more text (or a "
            "larger language.max_train_docs), or lower hardware.per_device_batch_size, "
            "trainer.grad_accum_steps or task.max_seq_length."
        )


def check_eval_size(config: TrainConfig, eval_blocks: int, seq_len: int,
                    language: LanguageConfig | None = None) -> None:
    if eval_blocks == 0:
        raise FlaxlmError(
            f"The validation split of language={(language or config.language).name} is shorter "
            "than one block "
            f"of task.max_seq_length={seq_len} tokens, so there is nothing to evaluate on. Use "
            "more text, a larger language.validation_fraction / max_eval_docs, or a smaller "
            "task.max_seq_length."
        )
