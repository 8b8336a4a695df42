"""task=sft: supervised fine-tuning of a causal LM on conversations.

conversations (files, a Hub chat dataset, or generated drills) → the tokenizer with its chat
template (model.init_from's, else a BPE with flaxlm's ChatML markers) → rows of conversations
with a target mask on the assistant's tokens (packed with document masking, else padded) →
the LM's jitted steps, whose loss counts only the targets → evaluation over the held-out
conversations' assistant tokens → an HF-loadable model/ that keeps the chat template, and
replies to samples.prompts before and after training.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import jax
import jax.numpy as jnp
import transformers

from flaxlm.config import TrainConfig
from flaxlm.data.chat import load_conversations, open_conversation_stream
from flaxlm.data.chat_packing import ChatRows, chat_loader, chat_rows, encode_conversations
from flaxlm.data.chat_stream import ChatStreamLoader
from flaxlm.data.chat_template import CHATML_TEMPLATE
from flaxlm.data.fingerprint import arrays_fingerprint, documents_fingerprint
from flaxlm.data.loader import BatchSource
from flaxlm.data.streaming import process_shard
from flaxlm.data.tokenizer import (
    keeps_own_conventions,
    prompt_tokenizer,
    token_byte_lengths,
)
from flaxlm.errors import FlaxlmError
from flaxlm.generate import log_samples, settings_from_samples
from flaxlm.models import build, hf, lora
from flaxlm.models.build import lm_from_params
from flaxlm.parallel import replicated
from flaxlm.tasks import base
from flaxlm.tasks.base import JobContext, Start
from flaxlm.tasks.language_model import (
    chat_tokenizer,
    check_block_length,
    check_downstream,
    downstream_hooks,
    export_lm,
    lm_start,
    lm_steps_compiler,
)
from flaxlm.training.evaluation import ChatEvaluator
from flaxlm.training.plan import global_batch_size

EVAL_METRICS = ("eval/loss", "eval/perplexity", "eval/bits_per_byte")
_LAYOUT = {True: "packed, each conversation attending to itself only",
           False: "one conversation per row, padded"}


class SupervisedFineTuning:
    """The SFT task: `check_settings` → the row length, `run` → the final metrics."""

    pads_rows = False  # rows are causal sequences; padding is a segment no target attends to

    def check_settings(self, config: TrainConfig) -> int:
        build.check_lm_family(config.model)
        lora.check_lora(config.model)
        task = config.task
        if config.language is not None:
            raise FlaxlmError(
                f"task=sft reads conversations from task.files, task.hub_path or task.drills, "
                f"so language={config.language.name} (a corpus for task=clm) would be ignored. "
                "Drop the language override.")
        if task.drills <= 0 and task.hub_path is None and not task.files:
            raise FlaxlmError(
                "task=sft needs conversations: set task.files=[chats.jsonl] (a `messages` "
                "column of {role, content} turns, or `prompt` and `response` columns), "
                "task.hub_path (e.g. experiment=sft-smollm-ultrachat), or task.drills=2000 "
                "(generated offline drills, experiment=sft-llama-tiny-drills).")
        if task.streaming and config.trainer.max_steps is None:
            raise FlaxlmError(
                "task.streaming=true needs trainer.max_steps: a stream of conversations has no "
                "known length, so trainer.num_epochs cannot say how long to train. Set "
                "trainer.max_steps, e.g. trainer.max_steps=10000.")
        if task.eval_files and not task.files:
            raise FlaxlmError("task.eval_files is set but task.files is empty: give the "
                              "training conversations too, task.files=[train.jsonl].")
        seq_len = task.max_seq_length or config.model.max_positions
        check_block_length(config, seq_len)
        check_downstream(config)
        return seq_len

    def eval_metrics(self, config: TrainConfig) -> base.EvalMetrics:
        return base.EvalMetrics(EVAL_METRICS, "eval/loss", lower_is_better=EVAL_METRICS)

    def run(self, job: JobContext, seq_len: int) -> dict[str, float]:
        config, start, seq_len = lm_start(job.config, seq_len)
        task = config.task
        batch_size = global_batch_size(config, job.mesh.size)
        data = (_streamed_data if task.streaming else _data)(config, start, seq_len, batch_size,
                                                             job.mesh)
        tokenizer, loader, eval_rows = data.tokenizer, data.loader, data.eval_rows
        sample_settings = settings_from_samples(config.samples)  # a bad setting fails now
        training = base.prepare_training(job, start, build.build_lm, lm_steps_compiler(config),
                                         loader, tokenizer, data.fingerprint,
                                         pads_rows=self.pads_rows)
        hf_config = hf.to_lm_config(config.model, bos_token_id=tokenizer.bos_token_id,
                                    eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.pad_token_id)
        own = keeps_own_conventions(config.tokenizer.convention, config.model.init_from)
        base.start_model_dir(job, config.model, prompt_tokenizer(tokenizer, own), hf_config)

        token_bytes = jax.device_put(jnp.asarray(token_byte_lengths(tokenizer)),
                                     replicated(job.mesh))
        eval_batch = base.eval_batch_size(config.hardware, job.mesh.size)
        evaluator = ChatEvaluator(training.steps, len(eval_rows),
                                  chat_rows(eval_rows.arrays, eval_batch, job.mesh), eval_batch,
                                  job.mesh, token_bytes)
        flops = build.lm_flops_per_token(
            config.model, training.num_params, seq_len,
            training.num_trainable if training.trainable is not None else None)
        speed = base.throughput(job, batch_size * seq_len, flops)
        print(base.banner(job, training, config.model, _template_name(config, tokenizer),
                          f"{data.train_size} / "
                          f"{eval_rows.describe('held-out', task.long_conversations)} of "
                          f"{seq_len} tokens, {_LAYOUT[task.document_masking]}, loss on "
                          f"assistant tokens | from {data.origin} | global batch {batch_size}"))
        if training.resume is None:  # what the model says before it learns, to compare with
            log_samples(lm_from_params(config.model, base.model_params(training.state)),
                        tokenizer, config.samples.prompts, sample_settings, job.tracker, step=0,
                        chat=True)
        state, last_eval = base.run_loop(job, training, loader, evaluator, speed,
                                         hooks=downstream_hooks(job, config.model, tokenizer, own))
        final = {**last_eval, "steps": int(state.step),
                 "tokens_seen": int(state.step) * batch_size * seq_len}
        model, params = export_lm(job, config.model, base.model_params(state), tokenizer, final,
                                  generation=sample_settings, own_conventions=own)
        log_samples(lm_from_params(model, params), tokenizer, config.samples.prompts,
                    sample_settings, job.tracker, step=final["steps"], chat=True)
        return final


def _template_name(config: TrainConfig, tokenizer) -> str:
    """Which chat template the run renders with, for the banner."""
    if config.task.chat_template:
        return "chat template task.chat_template"
    if tokenizer.chat_template == CHATML_TEMPLATE:
        return "chat template ChatML"
    return "the tokenizer's chat template"


class ChatData(NamedTuple):
    """What the task trains and evaluates on."""

    tokenizer: transformers.PreTrainedTokenizerFast
    loader: BatchSource
    eval_rows: ChatRows
    train_size: str  # for the banner: "5700 train conversations in 1314 rows (...)"
    origin: str  # where the training conversations come from
    fingerprint: dict[str, str]  # what a checkpoint records of the data


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _data(config: TrainConfig, start: Start, seq_len: int, batch_size: int, mesh) -> ChatData:
    """Every conversation read, checked and laid out in rows up front."""
    task = config.task
    conversations = load_conversations(task, config.cache_dir)
    tokenizer = chat_tokenizer(config, start, conversations.train)
    train_rows, eval_rows = (
        encode_conversations(tokenizer, rows, seq_len, task.long_conversations, where,
                             _pad_id(tokenizer), task.document_masking)
        for rows, where in ((conversations.train, "the training conversations"),
                            (conversations.eval, "the held-out conversations")))
    check_rows(train_rows, eval_rows, batch_size, seq_len)
    fingerprint = {"training conversations": arrays_fingerprint(train_rows.arrays),
                   "held-out conversations": arrays_fingerprint(eval_rows.arrays)}
    return ChatData(tokenizer, chat_loader(train_rows, batch_size, mesh, seed=config.seed),
                    eval_rows, train_rows.describe("train", task.long_conversations),
                    conversations.origin, fingerprint)


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
                                     "the held-out conversations", _pad_id(tokenizer),
                                     task.document_masking)
    check_rows(None, eval_rows, batch_size, seq_len)
    loader = ChatStreamLoader(process_shard(stream, jax.process_index(), jax.process_count()),
                              turns_of, tokenizer, seq_len, task.long_conversations,
                              _pad_id(tokenizer), task.document_masking, batch_size, mesh,
                              config.trainer.max_steps)
    head_key = f"training conversations (the first {len(head)} of the stream)"
    fingerprint = {head_key: documents_fingerprint(json.dumps(turns) for turns in head),
                   "held-out conversations": arrays_fingerprint(eval_rows.arrays)}
    return ChatData(tokenizer, loader, eval_rows, "streamed train conversations",
                    f"{task.hub_path or 'task.files'} (streamed)", fingerprint)


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
