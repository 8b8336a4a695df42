"""The optimizer group as an optax transformation: adamw, adafactor, lion, sgd or muon, driven
by a warmup + decay learning-rate schedule, with optional global-norm clipping in front."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
import optax.contrib

from flaxlm.config import OptimizerConfig, OptimizerName, Schedule
from flaxlm.errors import FlaxlmError


def make_schedule(opt: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then the chosen shape down to `end_lr`
    at `total_steps`."""
    if not 0 <= opt.warmup_steps <= total_steps:
        raise FlaxlmError(
            f"optimizer.warmup_steps={opt.warmup_steps} must be between 0 and the run's "
            f"{total_steps} training steps. Lower optimizer.warmup_steps, or train longer "
            "(trainer.max_steps, trainer.num_epochs)."
        )
    warmup = optax.linear_schedule(0.0, opt.lr, opt.warmup_steps)
    if opt.schedule == Schedule.wsd:
        return _warmup_stable_decay(opt, total_steps, warmup)
    decay_steps = max(total_steps - opt.warmup_steps, 1)
    if opt.schedule == Schedule.linear:
        decay = optax.linear_schedule(opt.lr, opt.end_lr, decay_steps)
    elif opt.schedule == Schedule.cosine:
        decay = optax.cosine_decay_schedule(opt.lr, decay_steps, alpha=opt.end_lr / opt.lr)
    else:
        decay = optax.constant_schedule(opt.lr)
    return optax.join_schedules([warmup, decay], [opt.warmup_steps])


def _warmup_stable_decay(opt: OptimizerConfig, total_steps: int,
                         warmup: optax.Schedule) -> optax.Schedule:
    """Warmup, flat at `lr`, then linear to `end_lr` over the last `decay_fraction` of all
    steps (WSD, as named by MiniCPM, Hu et al. 2024; Hägele et al. 2024 find it matches cosine
    given a long enough cooldown)."""
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
    stable = optax.constant_schedule(opt.lr)
    decay = optax.linear_schedule(opt.lr, opt.end_lr, decay_steps)
    return optax.join_schedules([warmup, stable, decay], [opt.warmup_steps, decay_start])


def decay_mask(params):
    """Weight decay on matrices and embeddings only: biases and LayerNorm scales are exempt."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: parameter_name(path) in ("kernel", "embedding"), params
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


def make_optimizer(opt: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    check_optimizer_settings(opt)
    tx = _OPTIMIZERS[opt.name](opt, schedule)
    if opt.moment_dtype is not None and opt.name != OptimizerName.adafactor:
        tx = moments_stored_in(jnp.dtype(opt.moment_dtype), tx)
    if opt.max_grad_norm is None:
        return tx
    return optax.chain(optax.clip_by_global_norm(opt.max_grad_norm), tx)


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


def _adamw(opt: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    return optax.adamw(
        schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=decay_mask
    )


def _lion(opt: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    return optax.lion(
        schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mask=decay_mask
    )


def _sgd(opt: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """optax.sgd has no weight decay: L2 is added to the gradient first, as torch.optim.SGD
    does, so momentum carries it and the learning rate scales it."""
    return optax.chain(
        optax.add_decayed_weights(opt.weight_decay, mask=decay_mask),
        optax.sgd(schedule, momentum=opt.momentum, nesterov=opt.nesterov),
    )


def _adafactor(opt: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """optax's defaults for everything else (factored second moments with decay exponent 0.8,
    update clipping at RMS 1, steps relative to each parameter's scale). Its weight decay is
    added after the learning rate, so it is not scaled by it; None skips that transformation."""
    return optax.adafactor(
        schedule,
        momentum=opt.momentum,
        # Its momentum only: the factored second moments are small, and their decay,
        # 1 − step^-0.8, nears 1, where a bfloat16 moment would stop moving.
        dtype_momentum=jnp.dtype(opt.moment_dtype or "float32"),
        weight_decay_rate=opt.weight_decay or None,
        weight_decay_mask=decay_mask,
    )


def _muon(opt: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """optax's Muon on the hidden matrices (`muon_labels`), `_adamw` on the rest, one schedule
    and one weight decay for both. Muon's update is the Newton–Schulz orthogonalised momentum
    (optax's default coefficients and 5 steps, Jordan's), rescaled to an RMS of
    MUON_RMS × sqrt(max(fan_in, fan_out)) as Moonlight does, so that AdamW's learning rate and
    weight decay carry over; its decay is decoupled (× the scheduled lr) on every matrix."""
    muon = optax.contrib.muon(schedule, beta=opt.momentum, nesterov=opt.nesterov,
                              weight_decay=opt.weight_decay, consistent_rms=MUON_RMS,
                              muon_weight_dimension_numbers=_per_layer_matrices)
    return optax.partition({"muon": muon, "adamw": _adamw(opt, schedule)}, muon_labels)


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
