"""task=reward: a reward model trained on preference pairs (the step between SFT and RL that
TRL's RewardTrainer does).

preference pairs, read and laid out as task=dpo's (tasks/pairs.py) → a causal LM (GPT-2 or
Llama, from model.init_from or fresh, LoRA allowed) with a one-output sequence-scoring head:
the score of a sequence is the head's output at its last non-pad token, as transformers'
*ForSequenceClassification reads it → the Bradley–Terry loss −log σ(r_chosen − r_rejected) →
held-out accuracy and margin over every pair once → model/ as transformers'
AutoModelForSequenceClassification with one label, keeping the chat template.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from flaxlm.config import ModelConfig, TrainConfig
from flaxlm.data.chat_packing import chat_rows
from flaxlm.data.documents import INPUT_IDS
from flaxlm.errors import FlaxlmError
from flaxlm.models import build, hf, lora
from flaxlm.parallel import batch_sharded, traced_on
from flaxlm.tasks import base
from flaxlm.tasks.language_model import (
    check_block_length,
    check_chat_source,
    lm_sequence_length,
    pad_id,
)
from flaxlm.tasks.pairs import PairData, pair_data
from flaxlm.tasks.pipeline import Network, Run, Task
from flaxlm.training.evaluation import predict_rows
from flaxlm.training.step import CompiledSteps, compile_train_step
from flaxlm.training.stop import StopRequest

EVAL_METRICS = ("eval/loss", "eval/accuracy", "eval/margin")
NO_DATA = (
    "task=reward needs preference pairs, as task=dpo reads them: set task.files=[pairs.jsonl] "
    "(JSON lines or parquet with `prompt`, `chosen` and `rejected` columns, each a string or a "
    "list of {role, content} turns), task.hub_path to a Hub preference dataset (e.g. "
    "task.hub_path=HuggingFaceH4/ultrafeedback_binarized task.hub_split=train_prefs "
    "task.hub_eval_split=test_prefs), or task.drills=4000 for generated offline pairs "
    "(experiment=reward-llama-tiny-offline).")


class RewardModelling(Task):
    """The reward-model task: task=dpo's pairs, a one-output classifier of a causal LM's family,
    the Bradley–Terry loss, accuracy and margin on the held-out pairs, a sequence classifier
    exported."""

    # A score is read at the last real token, which causal attention keeps from the padding
    # after it: the rows need no padding mask, so every causal attention backend runs them.
    pads_rows = False

    def check_settings(self, config: TrainConfig) -> int:
        task = config.task
        check_scorer(config.model)
        lora.check_lora(config.model)
        check_chat_source(config, "preference pairs", NO_DATA)
        if task.streaming:
            raise FlaxlmError(
                "task=reward does not stream (task.streaming=true): its pairs are read, checked "
                "and laid out in rows up front, as task=dpo's. Set task.streaming=false.")
        if config.eval.harness.tasks:
            raise FlaxlmError(
                f"eval.harness.tasks={list(config.eval.harness.tasks)} evaluates a language "
                "model, and task=reward trains a scorer of replies, which writes no text. Drop "
                "eval.harness (eval.harness.tasks=[]).")
        seq_len = task.max_seq_length or config.model.max_positions
        check_block_length(config, seq_len)
        return seq_len

    def eval_metrics(self, config: TrainConfig) -> base.EvalMetrics:
        return base.EvalMetrics(EVAL_METRICS, "eval/accuracy")

    def sequence_length(self, config: TrainConfig, seq_len: int) -> int:
        check_scorer(config.model)  # model.init_from's family is known only now
        return lm_sequence_length(config, seq_len)

    def data(self, run: Run) -> PairData:
        return pair_data(run)

    def network(self, run: Run) -> Network:
        config, tokenizer, seq_len = run.config, run.data.tokenizer, run.seq_len
        model = config.model
        pad = pad_id(tokenizer)

        def build_scorer(spec, rngs):
            return build.build_classifier(spec, 1, rngs)

        def flops_per_token(training: base.Training) -> float:
            flops = build.classifier_flops_per_token(model, training.num_params, seq_len)
            if training.trainable is None:
                return flops
            # A frozen weight costs 4 FLOPs a token, not 6: no gradient of its own is made.
            lookups = hf.classifier_architecture(model.family).model_class.lookup_params(model)
            return flops - 2 * (training.num_params - training.num_trainable - lookups)

        # transformers finds the token it scores by the config's pad id: the rows' own.
        hf_config = hf.to_classifier_config(model, num_labels=1, pad_token_id=pad,
                                            bos_token_id=tokenizer.bos_token_id,
                                            eos_token_id=tokenizer.eos_token_id)
        steps = functools.partial(compile_reward_steps, pad_id=pad,
                                  grad_accum_steps=config.trainer.grad_accum_steps,
                                  skip_nonfinite=config.trainer.skip_nonfinite,
                                  trainable=trainable(model))
        return Network(build=build_scorer, compile_steps=steps, flops_per_token=flops_per_token,
                       hf_config=hf_config, tokenizer=tokenizer, trainable=trainable(model),
                       about="a reward head, Bradley–Terry loss", sequences_per_row=2)

    def evaluator(self, run: Run) -> RewardEvaluator:
        return RewardEvaluator(run.training.steps, run.data.eval_rows.arrays[INPUT_IDS],
                               run.eval_batch_size, run.job.mesh)

    def export(self, run: Run, params: dict, final: dict) -> None:
        """model/ as a one-label sequence classifier; with model.lora the adapters merged into
        the weights they adapt (a PEFT adapter has no place for the fresh head)."""
        model = run.config.model
        if lora.enabled(model):
            params = lora.merged_params(params, lora.adapter_scale(model.lora))
            model = lora.without_adapters(model)
        base.export_model(run.job, params, model, run.data.tokenizer, final,
                          hf_config=run.network.hf_config, generation=None)


def check_scorer(model: ModelConfig) -> None:
    """A reward model reads a causal LM's last token: an encoder family has none to read."""
    build.check_lm_family(model, "task=reward scores a reply with a causal language model (its "
                                 "last token's hidden state)")
    build.check_classifier_family(model, "task=reward trains a sequence classifier's score head")


def trainable(model: ModelConfig):
    """The nnx filter of what trains: every parameter (None), or with model.lora the adapters
    and the score head, which is fresh and has no weights of its own to adapt."""
    return nnx.Any(nnx.LoRAParam, nnx.PathContains("score")) if lora.enabled(model) else None


# ------------------------------------------------------------------ the loss and its steps


def pair_scores(model, batch, pad_id: int, rngs: nnx.Rngs | None = None) -> jax.Array:
    """The score of each pair's two sequences (B, 2), in float32: the head's output at each
    sequence's rightmost token that is not `pad_id`, the token transformers scores."""
    B, P, L = batch[INPUT_IDS].shape
    ids_NxL = batch[INPUT_IDS].reshape(B * P, L)
    scores_Nx1 = model(ids_NxL, (ids_NxL != pad_id).astype(jnp.int32), None, rngs=rngs)
    return scores_Nx1[:, 0].astype(jnp.float32).reshape(B, P)


def bradley_terry(scores_Bx2: jax.Array) -> dict[str, jax.Array]:
    """Each pair's loss −log σ(r_chosen − r_rejected), whether it is ranked right, and its
    margin (B,). A tie is not right: the model has not told the replies apart."""
    margin_B = scores_Bx2[:, 0] - scores_Bx2[:, 1]
    return {"loss": -jax.nn.log_sigmoid(margin_B),
            "accuracy": (margin_B > 0).astype(jnp.float32), "margin": margin_B}


def reward_objective(model, batch, rngs: nnx.Rngs, *, pad_id: int) -> tuple[jax.Array, dict]:
    """The mean loss of a batch of pairs, and the means of its accuracy and margin."""
    means = {name: values_B.mean()
             for name, values_B in bradley_terry(pair_scores(model, batch, pad_id, rngs)).items()}
    return means.pop("loss"), means


def compile_reward_steps(mesh: Mesh, graphdef, optimizer, *, pad_id: int,
                         grad_accum_steps: int = 1, skip_nonfinite: bool = False,
                         trainable=None) -> CompiledSteps:
    """The train step (`compile_train_step` with `reward_objective`) and an eval step that
    returns the scores of a batch of pairs, sharded as the batch is."""
    train = compile_train_step(mesh, graphdef, optimizer,
                               functools.partial(reward_objective, pad_id=pad_id),
                               grad_accum_steps, skip_nonfinite, trainable)

    def scores(params, batch):
        return pair_scores(nnx.merge(graphdef, params), batch, pad_id)

    evaluate = jax.jit(traced_on(mesh, scores), in_shardings=(None, batch_sharded(mesh)),
                       out_shardings=batch_sharded(mesh))
    return CompiledSteps(train=train, eval=evaluate)


# ------------------------------------------------------------------ evaluation


def held_out_scores(score, input_ids: np.ndarray, global_batch_size: int, mesh: Mesh,
                    stop: StopRequest | None = None) -> np.ndarray:
    """The scores (pairs, 2) of every pair of `input_ids` (pairs, 2, L) exactly once, in order,
    on every process (`predict_rows`)."""
    gather = chat_rows({INPUT_IDS: input_ids}, global_batch_size, mesh)
    return predict_rows(score, len(input_ids), gather, global_batch_size, mesh, stop,
                        progress="eval")


def reward_metrics(scores_Nx2: np.ndarray) -> dict[str, float]:
    """eval/loss, eval/accuracy and eval/margin: means over the pairs, in float64, once."""
    margins = scores_Nx2[:, 0].astype(np.float64) - scores_Nx2[:, 1]
    return {"eval/loss": float(np.mean(np.logaddexp(0.0, -margins))),
            "eval/accuracy": float(np.mean(margins > 0)), "eval/margin": float(np.mean(margins))}


@dataclasses.dataclass
class RewardEvaluator:
    """The metrics of every held-out pair, each scored once."""

    steps: CompiledSteps
    input_ids: np.ndarray  # (pairs, 2, L), chosen first
    global_batch_size: int
    mesh: Mesh

    def __call__(self, params, stop: StopRequest | None = None) -> dict[str, float]:
        return reward_metrics(held_out_scores(lambda batch: self.steps.eval(params, batch),
                                              self.input_ids, self.global_batch_size,
                                              self.mesh, stop))
