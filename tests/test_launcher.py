"""Launching through conf/launcher: `local` is Hydra's basic launcher and needs no plugin;
`slurm` submits through Hydra's submitit plugin. A sweep on the plugin's local executor runs
each point end to end in a process of its own (so each job picks its own device count), and
`launcher=slurm` hands a stand-in `sbatch` one array job, one task per host, with the settings
the user gave. The cluster hardware presets join their hosts and fit their meshes."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY, compose
from omegaconf import OmegaConf

from flaxlm.config import DistributedMode
from flaxlm.parallel import mesh_shape

TRAIN = [sys.executable, "-m", "flaxlm.cli.train"]
# Needs the `slurm` extra (hydra-submitit-launcher), which the `test` extra installs.
needs_plugin = pytest.mark.slurm


def flaxlm_train(*args, env=None, timeout=600):
    return subprocess.run([*TRAIN, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.mark.slow
def test_the_default_launcher_is_hydras_basic_one_and_needs_no_submitit():
    # submitit made unimportable: the CLI and the job module must not need it to start.
    blocked = ("import sys; sys.modules['submitit'] = None; import flaxlm.job; "
               "from flaxlm.cli.train import main; main()")
    result = subprocess.run([sys.executable, "-c", blocked, "--cfg", "hydra"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    hydra = yaml.safe_load(result.stdout)["hydra"]
    assert hydra["launcher"]["_target_"].endswith("BasicLauncher")
    assert hydra["runtime"]["choices"]["launcher"] == "local"


@pytest.mark.parametrize(("preset", "devices", "mesh"), [
    ("tpu-v4-32", 16, (1, 16, 1, 1, 1)),  # 4 hosts x 4 chips, fsdp over the slice
    ("gpu-slurm", 4 * 8, (4, 8, 1, 1, 1)),  # 4 nodes x 8 GPUs, fsdp within a node
])
def test_the_cluster_presets_join_their_hosts_and_fit_their_meshes(preset, devices, mesh):
    hardware = OmegaConf.to_object(compose([f"hardware={preset}"])).hardware
    assert hardware.distributed.mode == DistributedMode.auto
    assert hardware.num_devices is None  # every device of every host
    assert mesh_shape(hardware.mesh, devices) == mesh


@needs_plugin
def test_launcher_slurm_composes_with_the_nodes_gpus_time_and_partition_given():
    result = flaxlm_train("launcher=slurm", "hydra.launcher.nodes=4",
                          "hydra.launcher.gpus_per_node=4", "hydra.launcher.timeout_min=90",
                          "hydra.launcher.partition=a100", "--cfg", "hydra")
    assert result.returncode == 0, result.stderr[-3000:]
    hydra = yaml.safe_load(result.stdout)["hydra"]
    launcher = hydra["launcher"]
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert hydra["runtime"]["choices"]["hydra/launcher"] == "submitit_slurm"
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (4, 1, 4)
    assert (launcher["timeout_min"], launcher["partition"]) == (90, "a100")
    assert hydra["mode"] == "MULTIRUN"  # a plain command is a one-job submission


@pytest.fixture
def submitit_in_this_process(monkeypatch):
    """submitit imported without the logging set-up it does on import: a `dictConfig` that
    closes every handler there is, absl's with the stream it was made with (pytest's capture
    of an earlier moment). Its logger then passes its records to the root logger."""
    monkeypatch.setenv("SUBMITIT_LOG_LEVEL", "NOCONFIG")
    import submitit  # noqa: F401


def stand_in_slurm(bin_dir: Path, capture: Path) -> dict:
    """`sbatch` that keeps the script it is given, `sacct` that reports the jobs failed (there is
    no cluster to run them) and an `srun` whose presence is all submitit checks for."""
    bin_dir.mkdir()
    scripts = {
        "sbatch": f'cp "$1" "{capture}.$(ls {capture.parent} | wc -l)"\n'
                  'echo "Submitted batch job 4242"\n',
        "sacct": "printf 'JobID|State|NodeList\\n4242_0|FAILED|n1\\n4242_1|FAILED|n1\\n'\n",
        "srun": "exit 1\n",
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.slow
@needs_plugin
def test_launcher_slurm_submits_one_array_job_a_task_per_host_a_point_per_array_task(
        tmp_path, train_cli, monkeypatch, submitit_in_this_process):
    from submitit.core.utils import UncompletedJobError
    from submitit.slurm.slurm import SlurmJob

    captures = tmp_path / "submitted"
    captures.mkdir()
    for name, value in stand_in_slurm(tmp_path / "bin", captures / "job.sh").items():
        monkeypatch.setenv(name, value)
    # submitit waits this long for the results of a job the cluster reports ended, for a slow
    # shared filesystem; the stand-in's jobs never ran, so none will come.
    monkeypatch.setattr(SlurmJob, "_results_timeout_s", 0)
    with pytest.raises(UncompletedJobError, match="state: FAILED"):  # what the stand-in reports
        train_cli("launcher=slurm", "optimizer.lr=1e-3,3e-4", "hydra.launcher.nodes=2",
                  "hydra.launcher.gpus_per_node=4", "hydra.launcher.timeout_min=90",
                  "hydra.launcher.partition=a100", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                  cwd=tmp_path)
    [script] = [path.read_text() for path in captures.iterdir()]  # one sbatch for the sweep
    flags = set(re.findall(r"^#SBATCH (\S+)$", script, re.M))
    assert {"--array=0-1%2", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4",
            "--time=90", "--partition=a100", "--signal=TERM@120"} <= flags
    # The setup lines run before srun starts the tasks: each sees all 4 GPUs of its host.
    setup = script.split("# setup\n")[1].split("\n\n")[0]
    shown = subprocess.run(["bash", "-c", f"{setup}\necho $JAX_LOCAL_DEVICE_IDS"],
                           capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "0,1,2,3"


@pytest.mark.slow
@needs_plugin
def test_a_sweep_on_submitits_local_executor_runs_each_point_in_a_fresh_process(tmp_path):
    """Each job is its own process, so each sets its own device count: with Hydra's basic
    launcher the first job of a sweep fixes it for all."""
    sweep_dir = tmp_path / "sweep"
    result = flaxlm_train(
        "-m", "hydra/launcher=submitit_local", "hardware.cpu_devices=2,4",
        "hardware.num_devices=null", *TINY, "trainer.max_steps=1",
        "trainer.eval_before_training=false", "samples.prompts=[]",
        "language.max_train_docs=40", "language.max_eval_docs=10",
        "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"multirun in {sweep_dir}: 2 ok" in result.stdout
    for job in ("0", "1"):
        with open(sweep_dir / job / "metrics.jsonl") as f:
            assert any("eval/loss" in json.loads(line) for line in f)
    # Each job's own output, in submitit's log folder: its devices and its run dir.
    devices = {}
    for log in glob.glob(str(sweep_dir / ".submitit" / "*" / "*_0_log.out")):
        text = Path(log).read_text(errors="replace")
        found = re.search(r" on (\d+) cpu device.*\| run dir (\S+)$", text, re.M)
        devices[os.path.basename(found.group(2))] = int(found.group(1))
    assert devices == {"0": 2, "1": 4}
