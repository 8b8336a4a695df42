"""The optimizer group as an optax transformation: AdamW with a warmup + decay schedule."""

from __future__ import annotations

import jax
import optax

from flaxlm.config import OptimizerConfig, Schedule
from flaxlm.errors import FlaxlmError


def make_schedule(opt: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then decay to `end_lr` at
    `total_steps` (the seed: no warmup, linear to 0 over all training steps)."""
    if not 0 <= opt.warmup_steps <= total_steps:
        raise FlaxlmError(
            f"optimizer.warmup_steps={opt.warmup_steps} must be between 0 and the run's "
            f"{total_steps} training steps."
        )
    decay_steps = max(total_steps - opt.warmup_steps, 1)
    if opt.schedule == Schedule.linear:
        decay = optax.linear_schedule(opt.lr, opt.end_lr, decay_steps)
    elif opt.schedule == Schedule.cosine:
        decay = optax.cosine_decay_schedule(opt.lr, decay_steps, alpha=opt.end_lr / opt.lr)
    else:
        decay = optax.constant_schedule(opt.lr)
    warmup = optax.linear_schedule(0.0, opt.lr, opt.warmup_steps)
    return optax.join_schedules([warmup, decay], [opt.warmup_steps])


def decay_mask(params):
    """Weight decay on matrices and embeddings only: biases and LayerNorm scales are exempt."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) in ("kernel", "embedding"), params
    )


def make_optimizer(opt: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    if opt.lr <= 0:
        raise FlaxlmError(f"optimizer.lr={opt.lr} must be positive.")
    adamw = optax.adamw(
        schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=decay_mask
    )
    if opt.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(opt.max_grad_norm), adamw)
