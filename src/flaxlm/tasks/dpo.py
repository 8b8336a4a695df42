"""task=dpo: Direct Preference Optimisation (Rafailov et al. 2023) of a causal LM on pairs of
replies, one preferred.

preference pairs (files, a Hub dataset, or generated pairs) → the tokenizer with its chat
template (as task=sft's) → one row per pair, prompt + chosen and prompt + rejected, a target
mask on each reply (tasks/pairs.py) → the reference model's log-probs of every train and
held-out pair, computed once from the starting weights (LoRA's adapters switched off), so no
second copy of the weights is kept → the DPO train step (training/preference.py) → evaluation
over the held-out pairs with TRL's metric names → an HF-loadable model/ that keeps the chat
template (with model.lora, the adapter directory beside it).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from collections.abc import Callable

import numpy as np

from flaxlm.config import TrainConfig
from flaxlm.data.preferences import NO_DATA, REFERENCE_LOGPS
from flaxlm.errors import FlaxlmError
from flaxlm.models import lora
from flaxlm.tasks import base
from flaxlm.tasks.language_model import LanguageModelTask, check_chat_source
from flaxlm.tasks.pairs import PairData, pair_data
from flaxlm.tasks.pipeline import Network, Run
from flaxlm.training.evaluation import Evaluate
from flaxlm.training.preference import (
    METRICS,
    PreferenceEvaluator,
    compile_dpo_steps,
    reference_logps,
)
from flaxlm.training.step import CompiledSteps

EVAL_METRICS = ("eval/loss", *(f"eval/{name}" for name in METRICS))
# The reference log-probs of the training and held-out pairs, kept in the run directory: a
# resumed run without LoRA no longer has the starting weights to compute them from.
REFERENCE_FILE = "reference_logps.npz"


class DirectPreferenceOptimisation(LanguageModelTask):
    """The DPO task: the pairs (tasks/pairs.py), its own steps, the reference log-probs once
    the starting weights exist, evaluation with TRL's metric names; the rest is
    `LanguageModelTask`'s."""

    pads_rows = False  # rows are causal sequences; padding is a segment no target attends to
    batches_before_state = False  # each pair's reference log-probs join its row after the init

    def check_data_settings(self, config: TrainConfig) -> None:
        check_chat_source(config, "preference pairs", NO_DATA)
        task = config.task
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

    def eval_metrics(self, config: TrainConfig) -> base.EvalMetrics:
        return base.EvalMetrics(EVAL_METRICS, "eval/loss")

    def data(self, run: Run) -> PairData:
        return pair_data(run)

    def steps_compiler(self, run: Run) -> Callable[..., CompiledSteps]:
        config = run.config
        return functools.partial(compile_dpo_steps, beta=config.task.beta,
                                 grad_accum_steps=config.trainer.grad_accum_steps,
                                 skip_nonfinite=config.trainer.skip_nonfinite,
                                 chunk_size=config.trainer.loss_chunk_size,
                                 trainable=lora.trainable(config.model))

    def network(self, run: Run) -> Network:
        return dataclasses.replace(super().network(run), about=f"DPO β={run.config.task.beta}",
                                   sequences_per_row=2)

    def with_state(self, run: Run) -> None:
        _add_reference(run)

    def evaluator(self, run: Run) -> Evaluate:
        return PreferenceEvaluator(run.training.steps, run.data.eval_rows.arrays,
                                   run.eval_batch_size, run.job.mesh)


def _add_reference(run: Run) -> None:
    """The reference log-probs of every pair into its rows. From the starting weights (with
    model.lora, the base under the adapters, exactly so even when resumed); a resumed run
    without LoRA reads back those its start computed."""
    job, training = run.job, run.training
    splits = {"train": run.data.train_rows, "eval": run.data.eval_rows}
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
            training.state.params, training.graphdef, rows.arrays, run.eval_batch_size,
            job.mesh, run.config.trainer.loss_chunk_size)
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
