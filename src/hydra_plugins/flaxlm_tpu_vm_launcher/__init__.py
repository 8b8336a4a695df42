"""Hydra's launcher `hydra/launcher=tpu_vm` (flaxlm's `launcher=tpu-vm`): each job of a run or a
sweep on every worker of a TPU VM slice. Hydra finds launchers only in the `hydra_plugins`
namespace package; the work is done in flaxlm.cli.tpu_vm."""
