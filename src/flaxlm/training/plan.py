"""How much a run trains per step and in all, from the typed config: the global batch and the
loop's plan (steps, evaluation, logging and checkpoint cadence). Shared by every task."""

from __future__ import annotations

from flaxlm.config import TrainConfig
from flaxlm.errors import FlaxlmError
from flaxlm.training.loop import Plan


def global_batch_size(config: TrainConfig, num_devices: int) -> int:
    """Rows per optimizer step, all trainer.grad_accum_steps micro-batches together:
    trainer.global_batch_size if set (it must split evenly into the micro-batches and each over
    the devices), else hardware.per_device_batch_size × devices × grad_accum_steps."""
    wanted = config.trainer.global_batch_size
    accum = config.trainer.grad_accum_steps
    if wanted is None:
        return config.hardware.per_device_batch_size * num_devices * accum
    if wanted < 1:
        raise FlaxlmError(
            f"trainer.global_batch_size={wanted} must be at least 1 (rows per optimizer step), "
            "or null to use hardware.per_device_batch_size × devices × "
            "trainer.grad_accum_steps."
        )
    split = num_devices * accum
    if wanted % split:
        raise FlaxlmError(
            f"trainer.global_batch_size={wanted} does not divide evenly into "
            f"trainer.grad_accum_steps={accum} micro-batch(es) over the {num_devices} "
            f"devices of the mesh (hardware={config.hardware.name}). Use a multiple of "
            f"{split}, e.g. {max(1, round(wanted / split)) * split}, or set it to null to use "
            "hardware.per_device_batch_size × devices × trainer.grad_accum_steps."
        )
    return wanted


def make_plan(config: TrainConfig, steps_per_epoch: int) -> Plan:
    trainer = config.trainer
    total = trainer.max_steps or trainer.num_epochs * steps_per_epoch
    return Plan(
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        eval_every=trainer.eval_every_steps,
        log_every=trainer.log_every_steps,
        eval_before_training=trainer.eval_before_training,
        checkpoint_every=config.checkpoint.every_steps,
        checkpoint_at_epoch_end=config.checkpoint.at_epoch_end,
        count_skipped=trainer.skip_nonfinite,
    )
