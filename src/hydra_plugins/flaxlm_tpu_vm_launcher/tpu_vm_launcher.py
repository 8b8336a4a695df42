"""Hydra's Launcher for `launcher=tpu-vm`: the jobs one after another, each on every worker of
the slice (flaxlm.cli.tpu_vm), recorded in the sweep's job statuses as flaxlm's own jobs are."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict


class TpuVmLauncher(Launcher):
    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.workers: list[str] | None = None  # the slice's, asked of gcloud once

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        # task_function is not called here: the job runs on the workers.
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        from flaxlm.errors import FlaxlmError

        try:
            return self._launch(job_overrides, initial_job_idx)
        except FlaxlmError as err:  # before a worker of the job started
            print(f"flaxlm: error: {err}", file=sys.stderr, flush=True)
            sys.exit(err.exit_code)

    def _launch(self, job_overrides: Sequence[Sequence[str]],
                initial_job_idx: int) -> list[JobReturn]:
        from flaxlm.cli import tpu_vm
        from flaxlm.cli.sweep import print_summary
        from flaxlm.layout import JOB_FAILED, JOB_PREEMPTED, JOB_RUNNING, job_status_path
        from flaxlm.run_records import job_status_record, write_job_status

        settings = tpu_vm.Slice(**{**self.settings, "env": dict(self.settings.get("env") or {}),
                                   "ssh_flags": tuple(self.settings.get("ssh_flags") or ())})
        gcloud = tpu_vm.check_slice(settings)
        if self.workers is None:
            self.workers = tpu_vm.slice_workers(settings, gcloud)
        sweep_dir = os.path.abspath(str(self.config.hydra.sweep.dir))
        returns = []
        for number, overrides in enumerate(job_overrides, start=initial_job_idx):
            config = self.hydra_context.config_loader.load_sweep_config(self.config,
                                                                         list(overrides))
            with open_dict(config):
                config.hydra.job.id = config.hydra.job.num = number
            HydraConfig.instance().set_config(config)
            run_dir = os.path.join(str(config.hydra.sweep.dir), str(config.hydra.sweep.subdir))
            distributed = OmegaConf.to_container(config.hardware.distributed, resolve=True,
                                                 enum_to_str=True)
            commands = [tpu_vm.ssh_command(settings, gcloud, worker, arguments)
                        for worker, arguments in enumerate(tpu_vm.worker_overrides(
                            overrides, run_dir, distributed, self.workers))]
            status_path = job_status_path(sweep_dir, run_dir, number)
            # "running" until the workers end: a record left so names a job whose launcher
            # was stopped, as for flaxlm's own jobs (flaxlm.cli.sweep).
            write_job_status(status_path, job_status_record(number, JOB_RUNNING, "started",
                                                            [*overrides], run_dir))
            print(f"flaxlm: job #{number} ({' '.join(filter_overrides(overrides))}) on the "
                  f"{len(commands)} workers of slice {settings.name}; worker 0's output "
                  "follows", flush=True)
            ends = tpu_vm.run_workers(
                commands, os.path.join(sweep_dir, tpu_vm.LOG_SUBDIR, str(number)),
                stop_after_s=distributed["timeout_s"] + tpu_vm.STOP_SLACK_S)
            status, reason = tpu_vm.outcome(ends, settings.name)
            if status == JOB_FAILED:
                print(f"flaxlm: error: job #{number}: {reason}", file=sys.stderr, flush=True)
            write_job_status(status_path, job_status_record(number, status, reason,
                                                            [*overrides], run_dir))
            if status == JOB_PREEMPTED:  # the slice is being taken away: as a job of flaxlm's
                print_summary(sweep_dir, stopped_after=number)
                sys.exit(tpu_vm.PREEMPTED_EXIT_CODE)
            # The objective stays on the slice: a sweeper that needs each job's value
            # (Optuna) gets None, as for a failed job; a grid needs none.
            returns.append(JobReturn(overrides=list(overrides), cfg=config,
                                     hydra_cfg=config, working_dir=os.getcwd(),
                                     task_name=config.hydra.job.name,
                                     status=JobStatus.COMPLETED, _return_value=None))
        return returns
