"""task=sft: supervised fine-tuning of a causal LM on conversations.

conversations (files, a Hub chat dataset, or generated drills) → the tokenizer with its chat
template (model.init_from's, else a BPE with flaxlm's ChatML markers) → rows of conversations
with a target mask on the assistant's tokens (packed with document masking, else padded) →
the LM's jitted steps, whose loss counts only the targets → evaluation over the held-out
conversations' assistant tokens → an HF-loadable model/ that keeps the chat template, and
replies to samples.prompts before and after training.
"""

from __future__ import annotations

import dataclasses
import json

import jax

from flaxlm.config import TrainConfig
from flaxlm.data.chat import load_conversations, open_conversation_stream
from flaxlm.data.chat_packing import ChatRows, chat_loader, chat_rows, encode_conversations
from flaxlm.data.chat_stream import ChatStreamLoader
from flaxlm.data.chat_template import CHATML_TEMPLATE
from flaxlm.data.fingerprint import arrays_fingerprint, documents_fingerprint
from flaxlm.data.streaming import process_shard
from flaxlm.errors import FlaxlmError
from flaxlm.generate import log_samples, settings_from_samples
from flaxlm.models.build import lm_from_params
from flaxlm.tasks import base
from flaxlm.tasks.base import Start
from flaxlm.tasks.language_model import (
    LanguageModelTask,
    chat_tokenizer,
    check_chat_source,
    pad_id,
    token_bytes,
)
from flaxlm.tasks.pipeline import Network, Run, TaskData
from flaxlm.training.evaluation import ChatEvaluator, Evaluate

EVAL_METRICS = ("eval/loss", "eval/perplexity", "eval/bits_per_byte")
NO_CONVERSATIONS = (
    "task=sft needs conversations: set task.files=[chats.jsonl] (a `messages` column of "
    "{role, content} turns, or `prompt` and `response` columns), task.hub_path (e.g. "
    "experiment=sft-smollm-ultrachat), or task.drills=2000 (generated offline drills, "
    "experiment=sft-llama-tiny-drills).")
_LAYOUT = {True: "packed, each conversation attending to itself only",
           False: "one conversation per row, padded"}


class SupervisedFineTuning(LanguageModelTask):
    """The SFT task: conversations in rows with a target mask on the assistant's tokens,
    evaluated on the held-out conversations' assistant tokens, and samples from the model
    before it learns; the rest is `LanguageModelTask`'s."""

    pads_rows = False  # rows are causal sequences; padding is a segment no target attends to

    def check_data_settings(self, config: TrainConfig) -> None:
        check_chat_source(config, "conversations", NO_CONVERSATIONS)
        if config.task.streaming and config.trainer.max_steps is None:
            raise FlaxlmError(
                "task.streaming=true needs trainer.max_steps: a stream of conversations has no "
                "known length, so trainer.num_epochs cannot say how long to train. Set "
                "trainer.max_steps, e.g. trainer.max_steps=10000.")

    def eval_metrics(self, config: TrainConfig) -> base.EvalMetrics:
        return base.EvalMetrics(EVAL_METRICS, "eval/loss", lower_is_better=EVAL_METRICS)

    def data(self, run: Run) -> ChatData:
        read = _streamed_data if run.config.task.streaming else _data
        return read(run.config, run.start, run.seq_len, run.batch_size, run.job.mesh)

    def network(self, run: Run) -> Network:
        return dataclasses.replace(super().network(run),
                                   about=_template_name(run.config, run.data.tokenizer))

    def with_state(self, run: Run) -> None:
        if run.training.resume is None:  # what the model says before it learns, to compare with
            config = run.config
            log_samples(lm_from_params(config.model, base.model_params(run.training.state)),
                        run.data.tokenizer, config.samples.prompts,
                        settings_from_samples(config.samples), run.job.tracker, step=0,
                        chat=True)

    def evaluator(self, run: Run) -> Evaluate:
        eval_rows = run.data.eval_rows
        return ChatEvaluator(run.training.steps, len(eval_rows),
                             chat_rows(eval_rows.arrays, run.eval_batch_size, run.job.mesh),
                             run.eval_batch_size, run.job.mesh, token_bytes(run))


def _template_name(config: TrainConfig, tokenizer) -> str:
    """Which chat template the run renders with, for the banner."""
    if config.task.chat_template:
        return "chat template task.chat_template"
    if tokenizer.chat_template == CHATML_TEMPLATE:
        return "chat template ChatML"
    return "the tokenizer's chat template"


@dataclasses.dataclass(kw_only=True)
class ChatData(TaskData):
    """What the task trains and evaluates on."""

    eval_rows: ChatRows


def _data(config: TrainConfig, start: Start, seq_len: int, batch_size: int, mesh) -> ChatData:
    """Every conversation read, checked and laid out in rows up front."""
    task = config.task
    conversations = load_conversations(task, config.cache_dir)
    tokenizer = chat_tokenizer(config, start, conversations.train)
    train_rows, eval_rows = (
        encode_conversations(tokenizer, rows, seq_len, task.long_conversations, where,
                             pad_id(tokenizer), task.document_masking)
        for rows, where in ((conversations.train, "the training conversations"),
                            (conversations.eval, "the held-out conversations")))
    check_rows(train_rows, eval_rows, batch_size, seq_len)
    fingerprint = {"training conversations": arrays_fingerprint(train_rows.arrays),
                   "held-out conversations": arrays_fingerprint(eval_rows.arrays)}
    return ChatData(tokenizer=tokenizer,
                    loader=chat_loader(train_rows, batch_size, mesh, seed=config.seed),
                    fingerprint=fingerprint, eval_rows=eval_rows,
                    trains_on=_trains_on(config, seq_len, eval_rows, conversations.origin,
                                         train_rows.describe("train", task.long_conversations)))


def _streamed_data(config: TrainConfig, start: Start, seq_len: int, batch_size: int,
                   mesh) -> ChatData:
    """task.streaming: the held-out conversations read whole; the training ones laid out in
    rows as this process's shard of the stream is read (data/chat_stream.py). A BPE trains on
    the stream's first tokenizer.train_docs conversations."""
    task = config.task
    evaluation, stream, turns_of = open_conversation_stream(task, config.cache_dir)
    head = [turns_of(row, f"the training stream, conversation {index + 1}")
            for index, row in enumerate(stream.take(config.tokenizer.train_docs))]
    tokenizer = chat_tokenizer(config, start, head)
    eval_rows = encode_conversations(tokenizer, evaluation, seq_len, task.long_conversations,
                                     "the held-out conversations", pad_id(tokenizer),
                                     task.document_masking)
    check_rows(None, eval_rows, batch_size, seq_len)
    loader = ChatStreamLoader(process_shard(stream, jax.process_index(), jax.process_count()),
                              turns_of, tokenizer, seq_len, task.long_conversations,
                              pad_id(tokenizer), task.document_masking, batch_size, mesh,
                              config.trainer.max_steps)
    head_key = f"training conversations (the first {len(head)} of the stream)"
    fingerprint = {head_key: documents_fingerprint(json.dumps(turns) for turns in head),
                   "held-out conversations": arrays_fingerprint(eval_rows.arrays)}
    return ChatData(tokenizer=tokenizer, loader=loader, fingerprint=fingerprint,
                    eval_rows=eval_rows,
                    trains_on=_trains_on(config, seq_len, eval_rows,
                                         f"{task.hub_path or 'task.files'} (streamed)",
                                         "streamed train conversations"))


def _trains_on(config: TrainConfig, seq_len: int, eval_rows: ChatRows, origin: str,
               train_size: str) -> str:
    """For the banner: the conversations, their rows, and where they come from."""
    task = config.task
    return (f"{train_size} / {eval_rows.describe('held-out', task.long_conversations)} of "
            f"{seq_len} tokens, {_LAYOUT[task.document_masking]}, loss on assistant tokens | "
            f"from {origin}")


def check_rows(train: ChatRows | None, evaluation: ChatRows, batch_size: int,
               seq_len: int) -> None:
    if len(evaluation) == 0:
        raise FlaxlmError(
            f"No held-out conversation is left to evaluate on: {evaluation.dropped} were "
            f"dropped (longer than task.max_seq_length={seq_len} tokens with "
            "task.long_conversations=drop, or no assistant token left once cut). Raise "
            "task.max_seq_length, set task.long_conversations=truncate, or hold out more.")
    if train is not None and len(train) < batch_size:
        raise FlaxlmError(
            f"The training conversations make {len(train)} row(s) of {seq_len} tokens "
            f"({train.dropped} dropped), fewer than one global batch of {batch_size} "
            "(per-device batch × devices × trainer.grad_accum_steps). Use more conversations, "
            "or lower hardware.per_device_batch_size or trainer.grad_accum_steps.")
