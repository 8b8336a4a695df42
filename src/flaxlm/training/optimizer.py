"""The optimizer group as an optax transformation: adamw, adafactor, lion, sgd or muon, driven
by a warmup + decay learning-rate schedule, with optional global-norm clipping in front. Its
numbers are arguments of the compiled step, so a sweep over them compiles once
(`flaxlm.training.hyperparams`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
import optax.contrib

from flaxlm.config import OptimizerConfig, OptimizerName, Schedule
from flaxlm.errors import FlaxlmError
from flaxlm.models.moe import EXPERT_MATRICES
from flaxlm.training.hyperparams import (
    LearningRateSchedule,
    as_arguments,
    cosine_numbers,
    rate,
    rate_numbers,
    reciprocal,
)


def make_schedule(opt: OptimizerConfig, total_steps: int) -> LearningRateSchedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then the chosen shape down to `end_lr`
    at `total_steps`; its numbers become arguments of the compiled step (`hyperparams`)."""
    if not 0 <= opt.warmup_steps <= total_steps:
        raise FlaxlmError(
            f"optimizer.warmup_steps={opt.warmup_steps} must be between 0 and the run's "
            f"{total_steps} training steps. Lower optimizer.warmup_steps, or train longer "
            "(trainer.max_steps, trainer.num_epochs)."
        )
    lr, end_lr = float(opt.lr), float(opt.end_lr)
    numbers: dict[str, float | int] = {"lr": lr, "minus_lr": -lr,
                                       "warmup_steps": int(opt.warmup_steps),
                                       "warmup_reciprocal": reciprocal(opt.warmup_steps)}
    if opt.schedule == Schedule.wsd:
        decay_steps, decay_start = _wsd_decay(opt, total_steps)
        numbers.update(decay_start=decay_start)
    else:
        decay_steps = max(total_steps - opt.warmup_steps, 1)
    if opt.schedule == Schedule.cosine:
        numbers.update(cosine_numbers(lr, end_lr, decay_steps))
    elif opt.schedule in (Schedule.linear, Schedule.wsd):
        numbers.update(decay_steps=decay_steps, decay_reciprocal=reciprocal(decay_steps),
                       end_lr=end_lr, lr_drop=lr - end_lr)
    return LearningRateSchedule(Schedule(opt.schedule), numbers)


def _wsd_decay(opt: OptimizerConfig, total_steps: int) -> tuple[int, int]:
    """Warmup-stable-decay (WSD, as named by MiniCPM, Hu et al. 2024; Hägele et al. 2024 find
    it matches cosine given a long enough cooldown) decays linearly to `end_lr` over the last
    `decay_fraction` of all steps: their number, and the step they start at."""
    if not 0 < opt.decay_fraction <= 1:
        raise FlaxlmError(
            f"optimizer.decay_fraction={opt.decay_fraction} must be in (0, 1]: the share of "
            "the run's steps that the wsd schedule spends decaying."
        )
    decay_steps = max(round(opt.decay_fraction * total_steps), 1)
    decay_start = total_steps - decay_steps
    if opt.warmup_steps > decay_start:
        raise FlaxlmError(
            f"optimizer.warmup_steps={opt.warmup_steps} overlaps the wsd decay: "
            f"optimizer.decay_fraction={opt.decay_fraction} of the run's {total_steps} steps "
            f"starts decaying at step {decay_start}. Lower one of them."
        )
    return decay_steps, decay_start


def decay_mask(params):
    """Weight decay on matrices and embeddings only (an MoE's experts' stacked matrices
    included): biases, norm scales and a router's balancing bias are exempt."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: parameter_name(path) in ("kernel", "embedding", *EXPERT_MATRICES), params
    )


def parameter_name(path) -> str | None:
    """The last dict key on a leaf's path: `kernel` in ['h'][0]['mlp']['c_fc']['kernel'].value.
    Not simply the path's last entry, which for an nnx.State leaf is the `.value` attribute."""
    names = [key.key for key in path if isinstance(key, jax.tree_util.DictKey)]
    return names[-1] if names else None


# Modules whose matrix is a network's output layer (the LM head when untied, a classifier's).
OUTPUT_HEADS = ("lm_head", "score", "classifier")


def muon_labels(params):
    """`muon` for the hidden layers' weight matrices (2-D `kernel`s; 3-D in a scanned model,
    one matrix per layer stacked), `adamw` for the rest:
    embeddings (a lookup table, and GPT-2's tied LM head), untied LM heads and classifiers
    (output layers), biases and norm scales (vectors). Muon's recipe (Jordan 2024) and
    Moonlight's (Liu et al. 2025) both leave these to AdamW."""

    def label(path, leaf) -> str:
        modules = {key.key for key in path if isinstance(key, jax.tree_util.DictKey)}
        hidden_matrix = (leaf.ndim in (2, 3) and parameter_name(path) == "kernel"
                         and not modules & set(OUTPUT_HEADS))
        return "muon" if hidden_matrix else "adamw"

    return jax.tree_util.tree_map_with_path(label, params)


def check_optimizer_settings(opt: OptimizerConfig) -> None:
    """The optimizer's numbers, checked before any data is read. nan fails no comparison
    (`nan <= 0` is False), so finiteness comes first: a nan or inf would otherwise surface
    only as a loss that diverges at step 1."""
    optimizer = OptimizerName(opt.name).value
    for name in ("lr", "b1", "b2", "eps", "weight_decay", "momentum", "end_lr",
                 "decay_fraction", "max_grad_norm"):
        value = getattr(opt, name)
        if value is not None and not math.isfinite(value):
            raise FlaxlmError(
                f"optimizer.{name}={value} is not a finite number (optimizer={optimizer}). Set "
                f"optimizer.{name} to a real value, or drop the override to use the default."
            )
    if opt.lr <= 0:
        raise FlaxlmError(f"optimizer.lr={opt.lr} must be positive, e.g. optimizer.lr=3e-4.")
    for name in ("b1", "b2", "momentum"):
        value = getattr(opt, name)
        if value is not None and not 0 <= value < 1:
            raise FlaxlmError(
                f"optimizer.{name}={value} must be in [0, 1): it is a moving average's decay "
                "rate (e.g. 0.9)."
            )
    for name in ("eps", "weight_decay", "end_lr"):
        if getattr(opt, name) < 0:
            raise FlaxlmError(f"optimizer.{name}={getattr(opt, name)} must not be negative.")
    if opt.name == OptimizerName.muon and opt.momentum is None:
        raise FlaxlmError(
            "optimizer.momentum=null: muon orthogonalises a momentum, so it needs one; set "
            "optimizer.momentum (0.95 in conf/optimizer/muon.yaml)."
        )
    if opt.max_grad_norm is not None and opt.max_grad_norm <= 0:
        raise FlaxlmError(
            f"optimizer.max_grad_norm={opt.max_grad_norm} must be positive (e.g. 1.0), or null "
            "for no gradient clipping."
        )
    _check_moment_dtype(opt)


MOMENT_DTYPES = ("float32", "bfloat16")

# What each optimizer's stored moments decay by, per step (lion's b1 only interpolates).
_MOMENT_DECAYS = {
    OptimizerName.adamw: ("b1", "b2"),
    OptimizerName.lion: ("b2",),
    OptimizerName.sgd: ("momentum",),
    OptimizerName.adafactor: ("momentum",),
    OptimizerName.muon: ("momentum", "b1", "b2"),
}

# A moment stored in bfloat16 and decayed by β moves by (1 − β) of itself when nothing is added:
# below half a bfloat16 step of it (2^-8 of a value just above a power of two) the round to
# nearest gives back the same number, and the moment never decays.
BFLOAT16_SMALLEST_DECAY = 2.0**-8


def _check_moment_dtype(opt: OptimizerConfig) -> None:
    if opt.moment_dtype is None:
        return
    if opt.moment_dtype not in MOMENT_DTYPES:
        raise FlaxlmError(
            f"optimizer.moment_dtype={opt.moment_dtype} is not a dtype the optimizer's moments "
            f"can be stored in: use one of {', '.join(MOMENT_DTYPES)} (bfloat16 halves their "
            "memory), or null for the parameters' dtype. float16 is not offered: a second "
            "moment (a squared gradient) below 6e-8 is zero in it."
        )
    if opt.moment_dtype != "bfloat16":
        return
    for name in _MOMENT_DECAYS[opt.name]:
        rate = getattr(opt, name)
        if rate is not None and 1 - rate < BFLOAT16_SMALLEST_DECAY:
            raise FlaxlmError(
                f"optimizer.{name}={rate} with optimizer.moment_dtype=bfloat16: a moment decayed "
                f"by {rate} per step changes by less than bfloat16 can represent (1 − {name} "
                f"must be at least 2^-8, {name} at most {1 - BFLOAT16_SMALLEST_DECAY:.4f}), so "
                f"it would stop decaying. Lower optimizer.{name} (e.g. 0.98), or keep the "
                "moments in float32 (optimizer.moment_dtype=float32)."
            )


def make_optimizer(opt: OptimizerConfig, schedule: optax.Schedule) -> Optimizer:
    check_optimizer_settings(opt)
    return Optimizer(opt, schedule)


@dataclasses.dataclass(frozen=True, eq=False)
class Optimizer:
    """The optimizer group as an optax transformation whose numbers are arguments: `numbers`
    (the schedule's, when it is a `make_schedule`, and b1, b2, eps, weight_decay, momentum,
    max_grad_norm) go into the compiled step as `arguments()`, and the step builds its
    transformation from them (`transformation`, `learning_rate`). Its structure (which
    optimizer, clipping or not, moment dtypes, nesterov, adafactor's weight decay or none, the
    schedule's kind) is fixed here. `init` and `update` are optax's, at its own numbers."""

    config: OptimizerConfig
    schedule: optax.Schedule  # a LearningRateSchedule; any other is a constant of the step

    @property
    def numbers(self) -> dict[str, float | int]:
        opt = self.config
        numbers = dict(self.schedule.numbers) if isinstance(
            self.schedule, LearningRateSchedule) else {}
        numbers.update(eps=float(opt.eps), weight_decay=float(opt.weight_decay))
        for name in _RATES[opt.name]:
            if getattr(opt, name) is not None:
                numbers.update(rate_numbers(name, getattr(opt, name)))
        if opt.max_grad_norm is not None:
            numbers.update(max_grad_norm=float(opt.max_grad_norm))
        return numbers

    def arguments(self) -> dict[str, jax.Array]:
        return as_arguments(self.numbers)

    def learning_rate(self, step, numbers) -> jax.Array:
        if isinstance(self.schedule, LearningRateSchedule):
            return self.schedule.at(step, numbers)
        return self.schedule(step)

    def transformation(self, numbers) -> optax.GradientTransformation:
        """The optax transformation at `numbers` (`arguments()`, traced inside the step)."""
        opt = self.config
        settings = {**numbers, **{name: rate(numbers, name) for name in _RATES[opt.name]
                                  if getattr(opt, name) is not None}}
        tx = _OPTIMIZERS[opt.name](opt, lambda step: self.learning_rate(step, numbers),
                                   settings)
        if opt.moment_dtype is not None and opt.name != OptimizerName.adafactor:
            tx = moments_stored_in(jnp.dtype(opt.moment_dtype), tx)
        if opt.max_grad_norm is None:
            return tx
        return optax.chain(optax.clip_by_global_norm(settings["max_grad_norm"]), tx)

    def init(self, params):
        return self.transformation(self.arguments()).init(params)

    def update(self, updates, state, params=None):
        return self.transformation(self.arguments()).update(updates, state, params)


# The rates each optimizer's optax code mixes as `(1 - r) * g + r * m` (`hyperparams.Rate`).
_RATES = {
    OptimizerName.adamw: ("b1", "b2"),
    OptimizerName.lion: ("b1", "b2"),
    OptimizerName.sgd: ("momentum",),
    OptimizerName.adafactor: ("momentum",),
    OptimizerName.muon: ("momentum", "b1", "b2"),
}


def moments_stored_in(dtype, tx: optax.GradientTransformation
                      ) -> optax.GradientTransformationExtraArgs:
    """`tx` with every floating-point leaf of its state (Adam's mu and nu, a momentum) stored in
    `dtype` between steps, and cast to float32 before each update: the moments' arithmetic and
    the update it makes stay float32, only what is kept is rounded. optax's `mu_dtype` stores
    the first moment alone (Adam's nu keeps the parameters' dtype) and decays it in that dtype
    before adding the gradient; wrapping the whole optimizer covers every optimizer's moments
    alike and keeps optax's state layout, so a checkpoint names the same leaves."""

    def cast(tree, to):
        return jax.tree.map(
            lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def init(params):
        return cast(tx.init(params), dtype)

    def update(updates, state, params=None, **extra_args):
        updates, state = optax.with_extra_args_support(tx).update(
            updates, cast(state, jnp.float32), params, **extra_args)
        return updates, cast(state, dtype)

    return optax.GradientTransformationExtraArgs(init, update)


def _adamw(opt: OptimizerConfig, schedule: optax.Schedule, hp) -> optax.GradientTransformation:
    return optax.adamw(
        schedule, b1=hp["b1"], b2=hp["b2"], eps=hp["eps"], weight_decay=hp["weight_decay"],
        mask=decay_mask
    )


def _lion(opt: OptimizerConfig, schedule: optax.Schedule, hp) -> optax.GradientTransformation:
    return optax.lion(
        schedule, b1=hp["b1"], b2=hp["b2"], weight_decay=hp["weight_decay"], mask=decay_mask
    )


def _sgd(opt: OptimizerConfig, schedule: optax.Schedule, hp) -> optax.GradientTransformation:
    """optax.sgd has no weight decay: L2 is added to the gradient first, as torch.optim.SGD
    does, so momentum carries it and the learning rate scales it."""
    return optax.chain(
        optax.add_decayed_weights(hp["weight_decay"], mask=decay_mask),
        optax.sgd(schedule, momentum=hp.get("momentum"), nesterov=opt.nesterov),
    )


def _adafactor(opt: OptimizerConfig, schedule: optax.Schedule, hp
               ) -> optax.GradientTransformation:
    """optax's defaults for everything else (factored second moments with decay exponent 0.8,
    update clipping at RMS 1, steps relative to each parameter's scale). Its weight decay is
    added after the learning rate, so it is not scaled by it; None skips that transformation."""
    return optax.adafactor(
        schedule,
        momentum=hp.get("momentum"),
        # Its momentum only: the factored second moments are small, and their decay,
        # 1 − step^-0.8, nears 1, where a bfloat16 moment would stop moving.
        dtype_momentum=jnp.dtype(opt.moment_dtype or "float32"),
        weight_decay_rate=hp["weight_decay"] if opt.weight_decay else None,
        weight_decay_mask=decay_mask,
    )


def _muon(opt: OptimizerConfig, schedule: optax.Schedule, hp) -> optax.GradientTransformation:
    """optax's Muon on the hidden matrices (`muon_labels`), `_adamw` on the rest, one schedule
    and one weight decay for both. Muon's update is the Newton–Schulz orthogonalised momentum
    (optax's default coefficients and 5 steps, Jordan's), rescaled to an RMS of
    MUON_RMS × sqrt(max(fan_in, fan_out)) as Moonlight does, so that AdamW's learning rate and
    weight decay carry over; its decay is decoupled (× the scheduled lr) on every matrix."""
    muon = optax.contrib.muon(schedule, beta=hp["momentum"], nesterov=opt.nesterov,
                              weight_decay=hp["weight_decay"], consistent_rms=MUON_RMS,
                              muon_weight_dimension_numbers=_per_layer_matrices)
    return optax.partition({"muon": muon, "adamw": _adamw(opt, schedule, hp)}, muon_labels)


def _per_layer_matrices(params):
    """Muon's matrices are each kernel's last two axes (in, out): a scanned model's leading
    layer axis is a batch of matrices, each orthogonalised on its own."""
    return jax.tree.map(
        lambda leaf: optax.contrib.MuonDimensionNumbers(leaf.ndim - 2, leaf.ndim - 1), params)


# Moonlight's match of Muon's update RMS to AdamW's typical 0.2-0.4 (Liu et al. 2025).
MUON_RMS = 0.2


_OPTIMIZERS: dict[OptimizerName, Callable[..., optax.GradientTransformation]] = {
    OptimizerName.adamw: _adamw,
    OptimizerName.adafactor: _adafactor,
    OptimizerName.lion: _lion,
    OptimizerName.sgd: _sgd,
    OptimizerName.muon: _muon,
}
