"""task=dpo: Direct Preference Optimisation (Rafailov et al. 2023) of a causal LM on pairs of
replies, one preferred.

preference pairs (files, a Hub dataset, or generated pairs) → the tokenizer with its chat
template (as task=sft's) → one row per pair, prompt + chosen and prompt + rejected, a target
mask on each reply → the reference model's log-probs of every train and held-out pair,
computed once from the starting weights (LoRA's adapters switched off), so no second copy of
the weights is kept → the DPO train step (training/preference.py) → evaluation over the
held-out pairs with TRL's metric names → an HF-loadable model/ that keeps the chat template
(with model.lora, the adapter directory beside it).
"""

from __future__ import annotations

import os
import tempfile
from typing import NamedTuple

import numpy as np

from flaxlm.config import TrainConfig
from flaxlm.data.chat_packing import chat_rows
from flaxlm.data.fingerprint import arrays_fingerprint
from flaxlm.data.loader import RowLoader
from flaxlm.data.preferences import (
    NO_DATA,
    REFERENCE_LOGPS,
    PreferenceRows,
    encode_pairs,
    load_preferences,
)
from flaxlm.data.tokenizer import keeps_own_conventions, prompt_tokenizer
from flaxlm.errors import FlaxlmError
from flaxlm.generate import log_samples, settings_from_samples
from flaxlm.models import build, hf, lora
from flaxlm.models.build import lm_from_params
from flaxlm.tasks import base
from flaxlm.tasks.base import JobContext
from flaxlm.tasks.language_model import (
    chat_tokenizer,
    check_block_length,
    check_downstream,
    downstream_hooks,
    export_lm,
    lm_start,
)
from flaxlm.training.plan import global_batch_size
from flaxlm.training.preference import (
    METRICS,
    PreferenceEvaluator,
    compile_dpo_steps,
    reference_logps,
)

EVAL_METRICS = ("eval/loss", *(f"eval/{name}" for name in METRICS))
# The reference log-probs of the training and held-out pairs, kept in the run directory: a
# resumed run without LoRA no longer has the starting weights to compute them from.
REFERENCE_FILE = "reference_logps.npz"


class DirectPreferenceOptimisation:
    """The DPO task: `check_settings` → the row length, `run` → the final metrics."""

    pads_rows = False  # rows are causal sequences; padding is a segment no target attends to

    def check_settings(self, config: TrainConfig) -> int:
        build.check_lm_family(config.model)
        lora.check_lora(config.model)
        task = config.task
        if config.language is not None:
            raise FlaxlmError(
                f"task=dpo reads preference pairs from task.files, task.hub_path or "
                f"task.drills, so language={config.language.name} (a corpus for task=clm) "
                "would be ignored. Drop the language override.")
        if task.drills <= 0 and task.hub_path is None and not task.files:
            raise FlaxlmError(NO_DATA)
        if task.eval_files and not task.files:
            raise FlaxlmError("task.eval_files is set but task.files is empty: give the "
                              "training pairs too, task.files=[train.jsonl].")
        if task.streaming:
            raise FlaxlmError(
                "task=dpo does not stream (task.streaming=true): the reference model's "
                "log-probs of every pair are computed once before training, which needs the "
                "pairs at hand. Set task.streaming=false.")
        if not task.beta > 0:
            raise FlaxlmError(
                f"task.beta={task.beta} must be a positive number: it scales the implicit "
                "reward β·(log π − log π_ref), and a larger β keeps the model closer to its "
                "start. DPO's usual values are 0.1 (the default) to 0.5.")
        seq_len = task.max_seq_length or config.model.max_positions
        check_block_length(config, seq_len)
        check_downstream(config)
        return seq_len

    def eval_metrics(self, config: TrainConfig) -> base.EvalMetrics:
        return base.EvalMetrics(EVAL_METRICS, "eval/loss")

    def run(self, job: JobContext, seq_len: int) -> dict[str, float]:
        config, start, seq_len = lm_start(job.config, seq_len)
        task = config.task
        batch_size = global_batch_size(config, job.mesh.size)
        data = _data(config, start, seq_len, batch_size, job.mesh)
        tokenizer = data.tokenizer
        sample_settings = settings_from_samples(config.samples)  # a bad setting fails now

        graphdefs = []  # the model's graph, for the reference pass

        def compile_steps(mesh, graphdef, tx, schedule):
            graphdefs.append(graphdef)
            return compile_dpo_steps(mesh, graphdef, tx, schedule, beta=task.beta,
                                     grad_accum_steps=config.trainer.grad_accum_steps,
                                     skip_nonfinite=config.trainer.skip_nonfinite,
                                     chunk_size=config.trainer.loss_chunk_size,
                                     trainable=lora.trainable(config.model))

        training = base.prepare_training(job, start, build.build_lm, compile_steps, data.loader,
                                         tokenizer, data.fingerprint, pads_rows=self.pads_rows)
        eval_batch = base.eval_batch_size(config.hardware, job.mesh.size)
        _add_reference(job, training, graphdefs[0], data, eval_batch)
        hf_config = hf.to_lm_config(config.model, bos_token_id=tokenizer.bos_token_id,
                                    eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.pad_token_id)
        own = keeps_own_conventions(config.tokenizer.convention, config.model.init_from)
        base.start_model_dir(job, config.model, prompt_tokenizer(tokenizer, own), hf_config)

        evaluator = PreferenceEvaluator(training.steps, data.eval_rows.arrays, eval_batch,
                                        job.mesh)
        flops = build.lm_flops_per_token(
            config.model, training.num_params, seq_len,
            training.num_trainable if training.trainable is not None else None)
        speed = base.throughput(job, batch_size * 2 * seq_len, flops)
        policy = task.long_conversations
        print(base.banner(job, training, config.model, f"DPO β={task.beta}",
                          f"{data.train_rows.describe('train', policy)} / "
                          f"{data.eval_rows.describe('held-out', policy)}, each reply with its "
                          f"prompt in a row of {seq_len} tokens, scored on the reply | from "
                          f"{data.origin} | global batch {batch_size} pairs"))
        state, last_eval = base.run_loop(job, training, data.loader, evaluator, speed,
                                         hooks=downstream_hooks(job, config.model, tokenizer, own))
        final = {**last_eval, "steps": int(state.step),
                 "tokens_seen": int(state.step) * batch_size * 2 * seq_len}
        model, params = export_lm(job, config.model, base.model_params(state), tokenizer, final,
                                  generation=sample_settings, own_conventions=own)
        log_samples(lm_from_params(model, params), tokenizer, config.samples.prompts,
                    sample_settings, job.tracker, step=final["steps"], chat=True)
        return final


class PreferenceData(NamedTuple):
    tokenizer: object
    loader: RowLoader
    train_rows: PreferenceRows
    eval_rows: PreferenceRows
    origin: str
    fingerprint: dict[str, str]


def _data(config: TrainConfig, start: base.Start, seq_len: int, batch_size: int,
          mesh) -> PreferenceData:
    """Every pair read, checked and laid out in rows up front."""
    task = config.task
    pairs = load_preferences(task, config.cache_dir)
    tokenizer = chat_tokenizer(config, start, [[*pair.prompt, *pair.chosen, *pair.rejected]
                                               for pair in pairs.train])
    pad_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
              else tokenizer.eos_token_id)
    train_rows, eval_rows = (
        encode_pairs(tokenizer, rows, seq_len, task.long_conversations, where, pad_id)
        for rows, where in ((pairs.train, "the training pairs"),
                            (pairs.eval, "the held-out pairs")))
    if len(eval_rows) == 0:
        raise FlaxlmError(
            f"No held-out preference pair is left to evaluate on ({eval_rows.dropped} dropped "
            f"as longer than task.max_seq_length={seq_len} tokens with task.long_conversations="
            f"{task.long_conversations.value}, or with no reply token left once cut; "
            f"{eval_rows.identical} with identical replies). Raise "
            "task.max_seq_length, set task.long_conversations=truncate, or hold out more.")
    if len(train_rows) < batch_size:
        raise FlaxlmError(
            f"The training preference pairs make {len(train_rows)} row(s) of {seq_len} tokens "
            f"({train_rows.dropped} dropped as too long or with no reply token left, "
            f"{train_rows.identical} with identical replies), fewer than one global batch of "
            f"{batch_size} (per-device batch × devices × trainer.grad_accum_steps). Use more "
            "pairs, raise task.max_seq_length, or lower hardware.per_device_batch_size.")
    fingerprint = {"training pairs": arrays_fingerprint(train_rows.arrays),
                   "held-out pairs": arrays_fingerprint(eval_rows.arrays)}
    # The loader reads `train_rows.arrays` at each batch: the reference log-probs join them
    # once the starting weights exist (`_add_reference`), before the first batch.
    loader = RowLoader(len(train_rows), batch_size, config.seed,
                       chat_rows(train_rows.arrays, batch_size, mesh),
                       kind="preference pairs", rows_key="num_examples")
    return PreferenceData(tokenizer, loader, train_rows, eval_rows, pairs.origin, fingerprint)


def _add_reference(job: JobContext, training: base.Training, graphdef,
                   data: PreferenceData, eval_batch: int) -> None:
    """The reference log-probs of every pair into its rows. From the starting weights (with
    model.lora, the base under the adapters, exactly so even when resumed); a resumed run
    without LoRA reads back those its start computed."""
    splits = {"train": data.train_rows, "eval": data.eval_rows}
    path = job.path(REFERENCE_FILE)
    if training.resume is not None and training.trainable is None:
        if not os.path.exists(path):
            raise FlaxlmError(
                f"Cannot resume the DPO run in {job.run.path}: {REFERENCE_FILE}, the reference "
                "model's log-probs its start computed from the starting weights, is missing, "
                "and the checkpoint holds only trained weights. Start a new run "
                "(trainer.resume=never), or train LoRA adapters (model.lora.rank), whose base "
                "is the reference.")
        with np.load(path) as saved:
            for name, rows in splits.items():
                if saved[name].shape != (len(rows), 2):
                    raise FlaxlmError(
                        f"{path} holds reference log-probs of {len(saved[name])} {name} pairs; "
                        f"the data now makes {len(rows)}. Resume on the same data, or start "
                        "a new run.")
                rows.arrays[REFERENCE_LOGPS] = saved[name]
        return
    for rows in splits.values():
        rows.arrays[REFERENCE_LOGPS] = reference_logps(
            training.state.params, graphdef, rows.arrays, eval_batch, job.mesh,
            job.config.trainer.loss_chunk_size)
    job.write(_save_reference, path, {name: rows.arrays[REFERENCE_LOGPS]
                                      for name, rows in splits.items()})


def _save_reference(path: str, logps: dict[str, np.ndarray]) -> None:
    """Written to a temporary name and renamed into place: never a half-file."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=directory, suffix=".npz.tmp")
    with os.fdopen(descriptor, "wb") as file:
        np.savez(file, **logps)
    os.replace(temporary, path)
