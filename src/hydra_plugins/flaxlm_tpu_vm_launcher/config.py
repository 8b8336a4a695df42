"""The launcher's settings, `hydra.launcher.*` (docs/scaling-out.md: TPU pod slices). No
`from __future__ import annotations`: Hydra's plugin scan runs this module before it is in
sys.modules, where dataclasses look string annotations up."""

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore


@dataclass
class TpuVmLauncherConf:
    _target_: str = "hydra_plugins.flaxlm_tpu_vm_launcher.tpu_vm_launcher.TpuVmLauncher"
    # The slice, as `gcloud compute tpus tpu-vm list --zone ZONE` names it (a queued resource's
    # slice: its node id), its zone, and its project (None: gcloud's configured one).
    name: Optional[str] = None
    zone: Optional[str] = None
    project: Optional[str] = None
    # On every worker: the checkout to run in (relative to the home directory) and the command,
    # whose arguments are the job's overrides.
    workdir: str = "flaxlm"
    train_command: str = ".venv/bin/flaxlm-train"
    # Variables each worker's command is given (ssh passes none of this machine's), e.g.
    # WANDB_API_KEY, FLAXLM_CACHE.
    env: dict[str, str] = field(default_factory=dict)
    # More flags for `gcloud compute tpus tpu-vm ssh`, last, e.g. [--internal-ip],
    # [--tunnel-through-iap], or ssh's own after `--`: [--, -o, ServerAliveInterval=60].
    ssh_flags: list[str] = field(default_factory=list)
    gcloud: str = "gcloud"


# Hydra's own launchers are named with underscores (submitit_slurm); flaxlm's
# conf/launcher/tpu-vm.yaml selects this one.
ConfigStore.instance().store(group="hydra/launcher", name="tpu_vm", node=TpuVmLauncherConf,
                             provider="flaxlm")
