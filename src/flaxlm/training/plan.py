"""How much a run trains per step and in all, from the typed config: the global batch and the
loop's plan (steps, evaluation, logging and checkpoint cadence). Shared by every task."""

from __future__ import annotations

import dataclasses
import math

from flaxlm.config import TrainConfig
from flaxlm.errors import FlaxlmError
from flaxlm.parallel import row_shards


@dataclasses.dataclass(frozen=True)
class Plan:
    """How long to train and how often to evaluate, log and checkpoint, in steps."""

    steps_per_epoch: int
    total_steps: int
    eval_every: int | None
    log_every: int
    eval_before_training: bool
    checkpoint_every: int | None = None  # also at epoch ends (if below), the last step, on stop
    checkpoint_at_epoch_end: bool = True
    count_skipped: bool = False  # trainer.skip_nonfinite: log train/skipped_steps

    @property
    def num_epochs(self) -> int:
        return math.ceil(self.total_steps / self.steps_per_epoch)


def global_batch_size(config: TrainConfig, num_devices: int) -> int:
    """Rows per optimizer step, all trainer.grad_accum_steps micro-batches together:
    trainer.global_batch_size if set (it must split evenly into the micro-batches and each over
    the mesh's row shards), else hardware.per_device_batch_size × row shards ×
    grad_accum_steps. The row shards (`row_shards`) are the devices / (context × tensor): the
    devices of a context or tensor axis share their rows, so a device holds
    per_device_batch_size rows (of 1/context of their positions) either way."""
    wanted = config.trainer.global_batch_size
    accum = config.trainer.grad_accum_steps
    shards = row_shards(config.hardware.mesh, num_devices)
    if wanted is None:
        return config.hardware.per_device_batch_size * shards * accum
    if wanted < 1:
        raise FlaxlmError(
            f"trainer.global_batch_size={wanted} must be at least 1 (rows per optimizer step), "
            "or null to use hardware.per_device_batch_size × row shards × "
            "trainer.grad_accum_steps."
        )
    split = shards * accum
    if wanted % split:
        shared = num_devices // shards
        among = (f"the {shards} row shard(s) of the mesh (its {num_devices} devices, "
                 f"{shared} to a row: context × tensor)" if shared > 1
                 else f"the {num_devices} devices of the mesh")
        raise FlaxlmError(
            f"trainer.global_batch_size={wanted} does not divide evenly into "
            f"trainer.grad_accum_steps={accum} micro-batch(es) over {among} "
            f"(hardware={config.hardware.name}). Use a multiple of {split}, e.g. "
            f"{max(1, round(wanted / split)) * split}, or set it to null to use "
            "hardware.per_device_batch_size × row shards × trainer.grad_accum_steps."
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
