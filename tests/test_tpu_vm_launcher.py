"""`launcher=tpu-vm` against a stand-in `gcloud` on PATH: `describe` tells of the slices the test
made up, and `ssh --worker=I --command=...` runs the command as a local process, as the worker
would. With a stand-in `flaxlm-train` that records what it was given, the launcher's part alone:
each worker's arguments, the jobs of a sweep one after another, worker 0's output streamed, a
failing worker named. With the real one, a two-worker "slice" trains, its processes joined by
jax.distributed on localhost (mode=explicit: JAX's TPU detection needs a TPU VM), in a folder
both see, or each on a disk of its own with output_url in the emulated bucket. Before any
worker starts, missing settings, a missing gcloud and an unknown slice are one paragraph, exit 2.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, metrics_of, trained_run
from numerics import assert_close, transformer_depth

from flaxlm.cli import tpu_vm
from flaxlm.training.checkpoint.manager import finalised_steps

STAND_IN_GCLOUD = f"""#!{sys.executable}
import json, os, sys

args = sys.argv[1:]
with open(os.environ["STAND_IN_GCLOUD_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
verb, name = args[3], args[4]
workers, state = json.loads(os.environ["STAND_IN_SLICES"]).get(name, (None, None))
if workers is None:
    sys.exit(f"ERROR: (gcloud.compute.tpus.tpu-vm.{{verb}}) NOT_FOUND: Resource "
             f"'projects/p/locations/z/nodes/{{name}}' was not found")
if verb == "describe":
    print(json.dumps({{"state": state, "networkEndpoints": [
        {{"ipAddress": f"10.0.0.{{i + 2}}", "port": 8470}} for i in range(workers)]}}))
    sys.exit(0)
[command] = [a.split("=", 1)[1] for a in args if a.startswith("--command=")]
if os.environ.get("STAND_IN_OWN_DISKS"):
    # Each worker's disk of its own, at the same paths, as a slice's hosts have: the shared
    # folder's path becomes a folder of this worker's, its cache too.
    shared, own = json.loads(os.environ["STAND_IN_OWN_DISKS"])
    own = own.format([a.split("=")[1] for a in args if a.startswith("--worker=")][0])
    command = command.replace(shared, own)
    os.environ["FLAXLM_CACHE"] = os.path.join(own, "cache")
os.execvp("bash", ["bash", "-c", command])
"""

# What each worker was given, then its output; exits with FAIL_CODE on worker FAIL_WORKER, and
# there after FAIL_AFTER_S seconds; worker HANG_WORKER never ends by itself; with PREEMPT set,
# every worker exits as a preempted flaxlm-train does.
STAND_IN_TRAIN = """import json, os, sys, time

worker = int(next((a.split("=")[1] for a in sys.argv if "process_id=" in a), "0"))
job = next(a.rsplit("/", 1)[1] for a in sys.argv if a.startswith("hydra.run.dir="))
with open(os.environ["STAND_IN_TRAIN_LOG"], "a") as log:
    log.write(json.dumps({"worker": worker, "job": job, "args": sys.argv[1:], "cwd": os.getcwd(),
                          "start": time.time(), "env": os.environ.get("FROM_LAUNCHER")}) + "\\n")
print(f"worker {worker} says hello", flush=True)
if worker == int(os.environ.get("HANG_WORKER", "-1")):
    time.sleep(600)
if os.environ.get("PREEMPT"):  # as flaxlm-train stopped by SIGTERM, after its checkpoint
    print(f"flaxlm: stopped by SIGTERM on worker {worker}", flush=True)
    sys.exit(75)
if worker == int(os.environ.get("FAIL_WORKER", "-1")):
    time.sleep(float(os.environ.get("FAIL_AFTER_S", "0")))
    sys.exit(f"worker {worker}: something broke")
time.sleep(0.5)
with open(os.environ["STAND_IN_TRAIN_LOG"], "a") as log:
    log.write(json.dumps({"worker": worker, "job": job, "end": time.time()}) + "\\n")
print(f"flaxlm: done on worker {worker}", flush=True)
"""

EXPLICIT = ["hardware.distributed.mode=explicit",
            "hardware.distributed.coordinator_address=localhost:1234"]


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A stand-in gcloud first on PATH knowing a slice `two` of 2 workers (and `gone`, whose 2
    workers were taken away), and a stand-in
    flaxlm-train; returns the logs of both."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(STAND_IN_GCLOUD)
    gcloud.chmod(0o755)
    (tmp_path / "train.py").write_text(STAND_IN_TRAIN)
    logs = {"gcloud": tmp_path / "gcloud.log", "train": tmp_path / "train.log"}
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STAND_IN_SLICES", json.dumps({"two": [2, "READY"],
                                                       "gone": [2, "PREEMPTED"]}))
    monkeypatch.setenv("STAND_IN_GCLOUD_LOG", str(logs["gcloud"]))
    monkeypatch.setenv("STAND_IN_TRAIN_LOG", str(logs["train"]))
    return logs


def launch(train_cli, tmp_path, *args, command=None, slice_name="two"):
    command = command or f"{sys.executable} {tmp_path / 'train.py'}"
    return train_cli("launcher=tpu-vm", f"hydra.launcher.name={slice_name}",
                     "hydra.launcher.zone=europe-west4-a", f"hydra.launcher.workdir={tmp_path}",
                     f"hydra.launcher.train_command={command}",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", *args, cwd=tmp_path)


def on_two_workers(train_cli, tmp_path, run: list[str]):
    """flaxlm-train `run` on the stand-in slice's two workers, 2 CPU devices each, joined by
    jax.distributed: its result (worker 0's output) once it ended well, and the folder of the
    workers' logs."""
    result = launch(train_cli, tmp_path, *run, "hardware.cpu_devices=2",
                    "hardware.num_devices=null", "hardware.distributed.mode=explicit",
                    f"hardware.distributed.coordinator_address=localhost:{free_port()}",
                    "hardware.distributed.timeout_s=120",
                    command=f"{sys.executable} -m flaxlm.cli.train")
    logs = tmp_path / "sweep" / ".tpu-vm" / "0"
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:],
                                    (logs / "worker-1.log").read_text()[-3000:])
    return result, logs


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_each_worker_runs_the_jobs_overrides_and_a_sweep_runs_its_jobs_one_after_another(
        tmp_path, stand_in, train_cli):
    result = launch(train_cli, tmp_path, "optimizer.lr=1e-3,3e-4", *EXPLICIT,
                    "+hydra.launcher.env.FROM_LAUNCHER=a b",
                    "hydra.launcher.ssh_flags=[--internal-ip,--,-o,'ServerAliveInterval=60']")
    assert result.returncode == 0, result.stderr
    sweep = tmp_path / "sweep"
    starts = sorted((r for r in records(stand_in["train"]) if "start" in r),
                    key=lambda r: (r["job"], r["worker"]))
    assert [(r["job"], r["worker"]) for r in starts] == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    for job, lr in enumerate(["0.001", "0.0003"]):
        for worker, record in enumerate(starts[2 * job:2 * job + 2]):
            assert {f"optimizer.lr={lr}", "launcher=local", f"hydra.run.dir={sweep}/{job}",
                    "hardware.distributed.num_processes=2",
                    f"hardware.distributed.process_id={worker}"} <= set(record["args"])
            assert "launcher=tpu-vm" not in record["args"]
            assert record["cwd"] == str(tmp_path)  # hydra.launcher.workdir
            assert record["env"] == "a b"  # hydra.launcher.env, through the shell's quoting
    # One job at a time: the second starts after both workers of the first ended.
    ends = [r["end"] for r in records(stand_in["train"]) if r.get("job") == "0" and "end" in r]
    assert len(ends) == 2 and min(r["start"] for r in starts[2:]) > max(ends)
    # Worker 0's output on the terminal; every worker's in its log.
    assert "worker 0 says hello" in result.stdout
    assert "worker 1 says hello" not in result.stdout
    for job in (0, 1):
        assert "worker 1 says hello" in (sweep / ".tpu-vm" / str(job) / "worker-1.log").read_text()
    assert f"multirun in {sweep}: 2 ok" in result.stdout
    # gcloud was asked about the slice once, then ran one ssh session per worker and job.
    calls = records(stand_in["gcloud"])
    assert [c[:4] for c in calls] == [["compute", "tpus", "tpu-vm", "describe"]] + [
        ["compute", "tpus", "tpu-vm", "ssh"]] * 4
    assert sorted(c[6] for c in calls[1:]) == ["--worker=0", "--worker=0", "--worker=1",
                                               "--worker=1"]
    # The user's flags last: ssh's own after `--`, past gcloud's --command.
    assert all(c[-4:] == ["--internal-ip", "--", "-o", "ServerAliveInterval=60"]
               and c[-5].startswith("--command=") for c in calls[1:])


def test_a_failing_worker_fails_the_job_with_exit_1_naming_the_worker_and_its_log(
        tmp_path, stand_in, train_cli, monkeypatch):
    monkeypatch.setenv("FAIL_WORKER", "1")
    result = launch(train_cli, tmp_path, *EXPLICIT)
    assert result.returncode == 1
    log = tmp_path / "sweep" / ".tpu-vm" / "0" / "worker-1.log"
    assert (f"worker 1 of 2 on slice two exited 1: worker 1: something broke (its output: {log})"
            in result.stderr)
    assert "1 failed" in result.stdout
    status = json.loads((tmp_path / "sweep" / "job-status" / "0.json").read_text())
    assert status["status"] == "failed" and "worker 1 of 2" in status["reason"]


def test_after_a_worker_failed_the_others_are_stopped_once_their_peers_timeout_passed(
        tmp_path, stand_in, train_cli, monkeypatch):
    """A worker whose peer died would stop by itself within hardware.distributed.timeout_s; one
    that does not is ended then (plus STOP_SLACK_S), and named with the one that failed."""
    monkeypatch.setattr(tpu_vm, "STOP_SLACK_S", 0)
    monkeypatch.setenv("HANG_WORKER", "0")
    monkeypatch.setenv("FAIL_WORKER", "1")
    started = time.monotonic()
    result = launch(train_cli, tmp_path, *EXPLICIT, "hardware.distributed.timeout_s=1")
    assert result.returncode == 1
    assert time.monotonic() - started < 60
    assert "worker 1 of 2 on slice two exited 1" in result.stderr
    assert "worker 0 of 2 on slice two exited -15" in result.stderr  # SIGTERM


def test_a_preempted_job_stops_the_sweep_with_exit_75_as_flaxlms_own_jobs_do(
        tmp_path, stand_in, train_cli, monkeypatch):
    monkeypatch.setenv("PREEMPT", "1")
    result = launch(train_cli, tmp_path, "optimizer.lr=1e-3,3e-4", *EXPLICIT)
    assert result.returncode == 75, result.stderr
    assert "1 preempted" in result.stdout
    assert "stopped at job #0 (preempted); the jobs after it were not started" in result.stdout
    assert {r["job"] for r in records(stand_in["train"])} == {"0"}
    status = json.loads((tmp_path / "sweep" / "job-status" / "0.json").read_text())
    assert status["status"] == "preempted" and "stopped by SIGTERM on worker 0" in status["reason"]


def test_a_launcher_stopped_midway_leaves_its_job_recorded_running(
        tmp_path, stand_in, train_cli, monkeypatch):
    """What a sweep started again in that directory marks failed (flaxlm.cli.sweep)."""
    monkeypatch.setenv("HANG_WORKER", "0")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tpu_vm, "_wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        launch(train_cli, tmp_path, *EXPLICIT)
    status = json.loads((tmp_path / "sweep" / "job-status" / "0.json").read_text())
    assert status["status"] == "running"


@pytest.mark.parametrize(("settings", "path", "expected"), [
    (["hydra.launcher.name=null", "hydra.launcher.zone=null"], True,
     "launcher=tpu-vm needs hydra.launcher.name and hydra.launcher.zone"),
    ([], False, "`gcloud` is not on this machine's PATH. Install the Google Cloud SDK"),
    (["hydra.launcher.name=nine"], True,
     "`compute tpus tpu-vm describe nine --zone=europe-west4-a --format=json` failed (ERROR: "
     "(gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND"),
    (["hydra.launcher.name=gone"], True, "slice gone in europe-west4-a is PREEMPTED with 2 "
     "workers; a run needs it READY"),
    (["hardware.distributed.mode=off"], True,
     "hardware.distributed.mode=off on a slice of 2 workers: each would train alone"),
    (["hardware.distributed.mode=explicit"], True, "hardware.distributed.mode=explicit needs "
     "hardware.distributed.coordinator_address: worker 0's internal address and a free port, "
     "e.g. 10.0.0.2:8482"),  # as gcloud described worker 0
    ([*EXPLICIT, "hardware.distributed.num_processes=4"], True,
     "hardware.distributed.num_processes=4, but the slice has 2 workers"),
])
def test_settings_that_cannot_run_are_one_paragraph_and_exit_2_before_any_worker_starts(
        tmp_path, stand_in, train_cli, monkeypatch, settings, path, expected):
    if not path:  # a PATH with python but no gcloud
        monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    result = launch(train_cli, tmp_path, *settings)
    assert result.returncode == 2
    assert result.stderr.startswith("flaxlm: error: ") and expected in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not any(c[3] == "ssh" for c in records(stand_in["gcloud"]))
    assert not stand_in["train"].exists()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_two_worker_slice_trains_joined_by_jax_distributed_with_worker_0s_output_streamed(
        tmp_path, tmp_path_factory, stand_in, train_cli):
    """The real flaxlm-train on both workers: 2 processes of 2 CPU devices each, one run
    directory (here a local folder both see: the slice's shared disk) written by process 0,
    with the metrics of the same run on one process of 4 devices. SGD: its update is linear in
    the gradient, which the devices' shares sum to in another order (see test_multihost)."""
    run = [*TINY, "hardware.per_device_batch_size=2", "trainer.max_steps=4", "optimizer=sgd",
           "optimizer.lr=1e-2", "language.max_train_docs=8", "language.max_eval_docs=2",
           "trainer.log_every_steps=2"]
    result, logs = on_two_workers(train_cli, tmp_path, run)
    assert "flaxlm: process 0 of 2 joined" in result.stdout
    assert "flaxlm: process 1 of 2 joined" in (logs / "worker-1.log").read_text()
    assert "flaxlm: done in" in result.stdout  # worker 0's summary, streamed
    assert f"multirun in {tmp_path / 'sweep'}: 1 ok" in result.stdout
    metrics = metrics_of(tmp_path / "sweep" / "0")
    expected = metrics_of(trained_run(tmp_path_factory, "one-process",
                                      [*run, "hardware.num_devices=4"]))
    assert [sorted(r) for r in metrics] == [sorted(r) for r in expected]
    assert max(r["step"] for r in metrics) == 4 and any("eval/loss" in r for r in metrics)
    for record, reference in zip(metrics, expected):
        for key, value in reference.items():
            if key.endswith("loss"):  # 4 devices x 2 rows x 64 positions per step
                depth = (reference["step"] + 1) * transformer_depth(2, backward=True)
                assert np.isfinite(value)
                assert_close(record[key], value, terms=4 * 2 * 64, depth=depth, err_msg=key)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_two_worker_slice_sharing_only_the_bucket_trains_into_it_and_is_reported_from_it(
        tmp_path, stand_in, train_cli, s3, monkeypatch, capsys):
    """Issue 45's recipe end to end: each worker with a disk of its own (its run folder and
    cache), output_url in the emulated bucket the only place both reach; both write their part
    of each checkpoint there, process 0 the run's files, and flaxlm-report reads the run from
    the bucket. S3 (moto) here: the GCS emulator has two processes' checkpoints in
    test_bucket_runs."""
    from flaxlm.cli.report import main as report

    monkeypatch.setenv("STAND_IN_OWN_DISKS",
                       json.dumps([str(tmp_path / "sweep"), str(tmp_path / "worker-{}")]))
    url = f"{s3.url}/runs/slice"
    run = [*TINY, "hardware.per_device_batch_size=2", "trainer.max_steps=4", "optimizer=sgd",
           "language.max_train_docs=8", "language.max_eval_docs=2", "trainer.log_every_steps=2",
           f"output_url={url}"]
    on_two_workers(train_cli, tmp_path, run)
    assert not (tmp_path / "sweep" / "0").exists()  # nothing of the run on the launcher's disk
    assert not (tmp_path / "worker-1" / "0" / "metrics.jsonl").exists()  # process 0's files
    assert finalised_steps(f"{url}/checkpoints") == [4]
    s3.fs.invalidate_cache()
    step = s3.fs.find(f"{s3.name}/runs/slice/checkpoints/4")
    assert any("process_1" in key for key in step)  # worker 1 wrote its part
    bucket_lines = s3.fs.cat_file(f"{s3.name}/runs/slice/metrics.jsonl").decode()
    assert bucket_lines == (tmp_path / "worker-0" / "0" / "metrics.jsonl").read_text()
    assert s3.fs.exists(f"{s3.name}/runs/slice/model/flaxlm_export.json")

    capsys.readouterr()
    report([url, "--out", str(tmp_path / "report")])
    [row] = [line.split() for line in capsys.readouterr().out.splitlines()[2:3]]
    assert row[0] == "slice" and row[-1] == "finished"
