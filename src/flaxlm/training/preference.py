"""Direct Preference Optimisation (Rafailov et al. 2023): the loss, its metrics, the jitted
steps, the reference model's log-probs and the evaluator over held-out pairs.

A batch holds pairs: `chat_packing`'s keys shaped (B, 2, L), [:, 0] the prompt + chosen
reply and [:, 1] the prompt + rejected one, each with a target mask on its reply, and
`REFERENCE_LOGPS` (B, 2), the reference model's summed log-probs of those targets, computed
once before training (`reference_logps`). With π and r the policy's and the reference's
summed log-probs, the implicit rewards are β·(π − r) and the loss is
−log σ(reward_chosen − reward_rejected). The metrics are named as TRL's DPOTrainer names
them, so that dashboards read the same.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from flaxlm.data.chat_packing import CHAT_KEYS, chat_rows
from flaxlm.data.documents import INPUT_IDS
from flaxlm.data.loader import eval_batches, num_eval_batches
from flaxlm.data.preferences import REFERENCE_LOGPS
from flaxlm.models import lora
from flaxlm.models.moe import AuxLosses
from flaxlm.parallel import batch_sharded, replicated, traced_on
from flaxlm.training.evaluation import predict_rows
from flaxlm.training.inflight import ready_in_order
from flaxlm.training.progress import progress_file
from flaxlm.training.step import (
    CompiledSteps,
    compile_train_step,
    lm_token_losses,
    target_weights,
)
from flaxlm.training.stop import StopRequest, unless_stopped

# Per-pair terms, as TRL's DPOTrainer logs their means (eval/ + these; "loss" is eval/loss).
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def sequence_logps(model, batch, rngs: nnx.Rngs | None = None,
                   chunk_size: int | None = None) -> jax.Array:
    """The summed log-probs of each sequence's target tokens (B, 2), in float32."""
    return sequence_logps_and_aux(model, batch, rngs, chunk_size)[0]


def sequence_logps_and_aux(model, batch, rngs: nnx.Rngs | None = None,
                           chunk_size: int | None = None) -> tuple[jax.Array, AuxLosses | None]:
    """`sequence_logps`, and what the model adds to its training loss itself (a
    Mixture-of-Experts router's, `moe.aux_losses`; None for most)."""
    B, P, L = batch[INPUT_IDS].shape
    rows = {key: batch[key].reshape(B * P, L) for key in CHAT_KEYS}
    losses_NxL, _, _, aux = lm_token_losses(model, rows, rngs, chunk_size)
    return -(losses_NxL * target_weights(rows)).sum(axis=-1).reshape(B, P), aux


def dpo_terms(policy_Bx2: jax.Array, reference_Bx2: jax.Array, beta: float
              ) -> dict[str, jax.Array]:
    """Each pair's loss and metrics (B,) from the two models' summed log-probs."""
    rewards_Bx2 = beta * (policy_Bx2 - reference_Bx2)
    margins_B = rewards_Bx2[:, 0] - rewards_Bx2[:, 1]
    return {
        "loss": -jax.nn.log_sigmoid(margins_B),
        "rewards/chosen": rewards_Bx2[:, 0],
        "rewards/rejected": rewards_Bx2[:, 1],
        "rewards/accuracies": (margins_B > 0).astype(jnp.float32),
        "rewards/margins": margins_B,
        "logps/chosen": policy_Bx2[:, 0],
        "logps/rejected": policy_Bx2[:, 1],
    }


def dpo_objective(model, batch, rngs: nnx.Rngs, *, beta: float,
                  chunk_size: int | None = None) -> tuple[jax.Array, dict]:
    """The mean DPO loss of a batch of pairs, plus what the policy adds itself (a
    Mixture-of-Experts router's balancing losses, as in pre-training), and the means of its
    metrics (the router's among them)."""
    policy_Bx2, aux = sequence_logps_and_aux(model, batch, rngs, chunk_size)
    terms = dpo_terms(policy_Bx2, batch[REFERENCE_LOGPS], beta)
    means = {name: values_B.mean() for name, values_B in terms.items()}
    loss = means.pop("loss")
    if aux is None:
        return loss, means
    aux_loss, router_metrics = aux
    return loss + aux_loss, {**means, **router_metrics}


def dpo_eval_step(params, batch, row_mask_B: jax.Array, *, graphdef, beta: float,
                  chunk_size: int | None = None) -> dict[str, jax.Array]:
    """Sums over the batch's real pairs of the loss and each metric, and their count, so that
    batches (and the last one's padding) combine exactly."""
    model = nnx.merge(graphdef, params)
    terms = dpo_terms(sequence_logps(model, batch, chunk_size=chunk_size),
                      batch[REFERENCE_LOGPS], beta)
    real_B = row_mask_B.astype(jnp.float32)
    return {"pairs": real_B.sum(),
            **{name: (values_B * real_B).sum() for name, values_B in terms.items()}}


def compile_dpo_steps(mesh: Mesh, graphdef, optimizer, *, beta: float,
                      grad_accum_steps: int = 1, skip_nonfinite: bool = False,
                      chunk_size: int | None = None, trainable=None) -> CompiledSteps:
    """The DPO train step (`compile_train_step` with `dpo_objective`) and eval step
    (`dpo_eval_step`), jitted with the LM steps' shardings."""
    train = compile_train_step(
        mesh, graphdef, optimizer,
        functools.partial(dpo_objective, beta=beta, chunk_size=chunk_size),
        grad_accum_steps, skip_nonfinite, trainable)
    evaluate = jax.jit(
        traced_on(mesh, functools.partial(dpo_eval_step, graphdef=graphdef, beta=beta,
                                          chunk_size=chunk_size)),
        in_shardings=(None, batch_sharded(mesh), batch_sharded(mesh)),
        out_shardings=replicated(mesh),
    )
    return CompiledSteps(train=train, eval=evaluate)


def reference_logps(params, graphdef, arrays: dict[str, np.ndarray], global_batch_size: int,
                    mesh: Mesh, chunk_size: int | None = None) -> np.ndarray:
    """The summed log-probs (pairs, 2) of every pair's two replies under `params` with any
    LoRA adapters switched off: the starting weights, whose copy is then no longer needed.
    Every process gets all of them (float32)."""

    def logps(params, batch):
        model = nnx.merge(graphdef, params)
        with lora.adapters_disabled(model):
            return sequence_logps(model, batch, chunk_size=chunk_size)

    step = jax.jit(traced_on(mesh, logps), in_shardings=(None, batch_sharded(mesh)),
                   out_shardings=batch_sharded(mesh))
    gather = chat_rows({key: arrays[key] for key in CHAT_KEYS}, global_batch_size, mesh)
    return predict_rows(lambda batch: step(params, batch), len(arrays[INPUT_IDS]), gather,
                        global_batch_size, mesh).astype(np.float32)


@dataclasses.dataclass
class PreferenceEvaluator:
    """eval/loss and eval/<METRICS> over every held-out pair once: sums over all batches,
    divided once by the number of pairs."""

    steps: CompiledSteps
    arrays: dict[str, np.ndarray]  # CHAT_KEYS and REFERENCE_LOGPS of the held-out pairs
    global_batch_size: int
    mesh: Mesh

    def __call__(self, params, stop: StopRequest | None = None) -> dict[str, float]:
        num_pairs = len(self.arrays[INPUT_IDS])
        gather = chat_rows(self.arrays, self.global_batch_size, self.mesh)
        batches = eval_batches(num_pairs, self.global_batch_size, self.mesh, gather)
        dispatched = (self.steps.eval(params, batch, mask) for batch, mask in batches)
        total = num_eval_batches(num_pairs, self.global_batch_size)
        totals = dict.fromkeys(("pairs", "loss", *METRICS), 0.0)
        for sums in tqdm(unless_stopped(ready_in_order(dispatched), stop, total), total=total,
                         desc="eval", leave=False, file=progress_file()):
            for key, value in jax.device_get(sums).items():
                totals[key] += float(value)
        pairs = totals.pop("pairs")
        return {f"eval/{name}": value / pairs for name, value in totals.items()}
