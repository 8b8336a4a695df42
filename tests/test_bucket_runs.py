"""A run's checkpoints in a bucket (issue 45, output_url), against the GCS and S3 emulators of
tests/buckets.py: orbax writes them through tensorstore's gcs or s3 driver, a step counts only once
its commit_success.txt is written (a killed save stays invisible), a damaged newest one is set
aside, a run resumes from the bucket exactly, and a bucket it cannot write to stops it before
training with one paragraph (exit 2)."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    SHORT,
    assert_names,
    assert_same_final_weights,
    bumped,
    cache_with_builtin,
    leaves_equal,
    metrics_of,
    save_steps,
    trained_run,
)

import flaxlm.run_mirror
from flaxlm.errors import FlaxlmError
from flaxlm.run_mirror import RunMirror
from flaxlm.storage import probe_write
from flaxlm.training.checkpoint.manager import (
    COMMIT_FILE,
    Checkpointer,
    disk_full_error,
    finalised_steps,
)
from flaxlm.training.stop import PREEMPTED_EXIT_CODE

# test_faults' run (checkpoints at 4, 6, 8, 12; evaluations at 0, 6, 12), its packed data shared.
import test_multihost as multihost  # noqa: E402  isort: skip
from test_faults import RUN, wait_for_logged_step  # noqa: E402  isort: skip


def names_under(bucket, key: str) -> list[str]:
    bucket.fs.invalidate_cache()
    return sorted(path.rsplit("/", 1)[-1] for path in bucket.fs.ls(f"{bucket.name}/{key}"))


@pytest.fixture(params=["gcs", "s3"])
def bucket(request):
    """A new bucket in each emulator: orbax writes to gs:// through tensorstore's gcs driver,
    to s3:// through its s3 driver (flaxlm.training.checkpoint.s3)."""
    return request.getfixturevalue(request.param)


@pytest.mark.slow  # several seconds: make test runs it
def test_checkpoints_in_a_bucket_restore_and_a_damaged_newest_is_set_aside(bucket, train_state,
                                                                           capsys, tmp_path):
    gcs = bucket
    directory = f"{gcs.url}/run/checkpoints"
    save_steps(directory, train_state, [4, 8]).close()
    assert finalised_steps(directory) == [4, 8]
    assert gcs.fs.exists(f"{gcs.name}/run/checkpoints/8/{COMMIT_FILE}")
    # Damage step 8's arrays, as a lost or truncated upload would: it is still listed.
    for path in gcs.fs.find(f"{gcs.name}/run/checkpoints/8/state"):
        if "/d/" in path:
            gcs.fs.pipe_file(path, b"not an array")
    checkpointer = Checkpointer(directory)
    restored = checkpointer.restore_latest(train_state)
    assert restored.step == 4 and leaves_equal(restored.state, bumped(train_state, 4))
    [aside] = [n for n in names_under(gcs, "run/checkpoints") if not n.isdigit()]
    assert aside.startswith("8.damaged-")
    assert f"aside to {directory}/{aside}" in capsys.readouterr().err
    assert checkpointer.steps() == [4] and finalised_steps(directory) == [4]

    checkpointer.save(8, bumped(train_state, 9), {"step": 8}, {})  # saved anew
    checkpointer.close()
    again = Checkpointer(directory)
    try:
        resaved = again.restore_latest(train_state)
    finally:
        again.close()
    assert resaved.step == 8 and leaves_equal(resaved.state, bumped(train_state, 9))
    assert aside in names_under(gcs, "run/checkpoints")  # kept, never deleted
    # A full local disk (metrics.jsonl, the export) names the bucket's last checkpoint as kept.
    full = disk_full_error(OSError(errno.ENOSPC, "No space left on device"), str(tmp_path),
                           f"{gcs.url}/run")
    assert_names(full, "step 8, is intact", str(tmp_path))


# Saves steps 4 and 8 of a small state into argv[1]; SIGKILL just before orbax writes step 8's
# commit_success.txt, when all of its items are in the bucket.
KILLED_SAVE = r"""
import os, signal, sys
import jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
from flaxlm.training.checkpoint.manager import Checkpointer

finalize = atomicity.CommitFileTemporaryPath.finalize

async def finalize_killing(self, *args, **kwargs):
    if self.get_final().name == "8":
        print("fault: SIGKILL before the commit file of step 8", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return await finalize(self, *args, **kwargs)

atomicity.CommitFileTemporaryPath.finalize = finalize_killing
checkpointer = Checkpointer(sys.argv[1])
for step in (4, 8):
    checkpointer.save(step, {"params": jnp.full((4,), float(step))}, {"step": step}, {})
    checkpointer.wait()
"""


@pytest.mark.slow  # several seconds: make test runs it
def test_a_save_killed_before_its_commit_file_leaves_no_visible_checkpoint(gcs):
    directory = f"{gcs.url}/run/checkpoints"
    killed = subprocess.run([sys.executable, "-c", KILLED_SAVE, directory],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert "fault: SIGKILL" in killed.stdout
    written = gcs.fs.find(f"{gcs.name}/run/checkpoints/8")
    assert any("/state/" in path for path in written)  # the items were written...
    assert not any(path.endswith(f"/8/{COMMIT_FILE}") for path in written)  # ...not the commit
    assert finalised_steps(directory) == [4]
    import jax.numpy as jnp

    checkpointer = Checkpointer(directory)
    try:
        # The unfinished step is removed when a checkpointer opens the folder (a tmp folder
        # on disk is): the step can be saved again.
        assert names_under(gcs, "run/checkpoints") == ["4"]
        assert checkpointer.steps() == [4]
        restored = checkpointer.restore_latest({"params": jnp.zeros((4,))})
        assert restored.step == 4 and float(restored.state["params"][0]) == 4.0
        checkpointer.save(8, {"params": jnp.full((4,), 9.0)}, {"step": 8}, {})
    finally:
        checkpointer.close()
    assert finalised_steps(directory) == [4, 8]


# --- a run whose checkpoints are in the bucket ---------------------------------------------------

# test_faults' planted faults, with orbax's commit file (a bucket's) in place of its rename.
RUN_KILLED_AT_COMMIT = r"""
import os, signal, sys
from orbax.checkpoint._src.path import atomicity

step, overrides = sys.argv[1], sys.argv[2:]
finalize = atomicity.CommitFileTemporaryPath.finalize

async def finalize_killing(self, *args, **kwargs):
    if self.get_final().name == step:
        print(f"fault: SIGKILL before the commit file of step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return await finalize(self, *args, **kwargs)

atomicity.CommitFileTemporaryPath.finalize = finalize_killing
sys.argv = ["flaxlm-train", *overrides]
from flaxlm.cli.train import main
main()
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run that never failed, with its checkpoints on disk."""
    return trained_run(tmp_path_factory, "reference", RUN)


@pytest.mark.slow
def test_a_run_killed_mid_save_resumes_from_the_bucket_on_a_new_host_to_the_same_run(
        bucket, tmp_path, reference, train_cli):
    """The run is killed while saving step 8 (its items written, its commit file not), and
    continued with resume_from=<its output_url> in a new local folder, as another host would:
    the bucket's step 8 was never visible, the run goes on from step 6 and ends bitwise as the
    run that never stopped, with the same metrics."""
    gcs = bucket
    url = f"{gcs.url}/runs/a"
    killed = subprocess.run(
        [sys.executable, "-c", RUN_KILLED_AT_COMMIT, "8", *RUN, f"output_url={url}",
         f"hydra.run.dir={tmp_path / 'first'}"],
        capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert finalised_steps(f"{url}/checkpoints") == [4, 6]
    assert not (tmp_path / "first" / "checkpoints").exists()  # none on this host's disk

    resumed = train_cli(*RUN, f"resume_from={url}", f"hydra.run.dir={tmp_path / 'second'}",
                        cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from its checkpoint at step 6" in resumed.stdout
    # orbax removed the unfinished step 8 when the run opened the bucket's checkpoints, as it
    # removes a killed save's tmp folder on disk; the run saved step 8 anew.
    assert all(name.isdigit() for name in names_under(gcs, "runs/a/checkpoints"))
    assert finalised_steps(f"{url}/checkpoints")[-1] == 12
    # The new folder started from the bucket's metrics.jsonl (copied at each save), cut back
    # to step 6: the whole run's lines, as in the run that never stopped; the bucket's too.
    assert metrics_of(tmp_path / "second") == metrics_of(reference)
    wandb_run = (tmp_path / "first" / "wandb_run_id").read_text()
    assert (tmp_path / "second" / "wandb_run_id").read_text() == wandb_run  # the same W&B run
    (tmp_path / "bucket").mkdir()
    gcs.fs.get_file(f"{gcs.name}/runs/a/metrics.jsonl", str(tmp_path / "bucket" / "metrics.jsonl"))
    assert metrics_of(tmp_path / "bucket") == metrics_of(reference)
    assert_same_final_weights(tmp_path / "second", reference)


@pytest.mark.slow
def test_a_preempted_run_leaves_every_metrics_line_and_its_status_in_the_bucket(gcs, tmp_path):
    url, run_dir = f"{gcs.url}/runs/p", tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "flaxlm.cli.train", *RUN, "checkpoint.every_steps=null",
         f"output_url={url}", f"hydra.run.dir={run_dir}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_logged_step(run_dir, 3, process)  # past its first lines, before any save
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    stopped = int(re.search(r"stopped by SIGTERM after step (\d+)", err)[1])
    assert finalised_steps(f"{url}/checkpoints")[-1] == stopped
    gcs.fs.invalidate_cache()
    bucket_lines = gcs.fs.cat_file(f"{gcs.name}/runs/p/metrics.jsonl").decode()
    assert bucket_lines == (run_dir / "metrics.jsonl").read_text()  # not a line lost
    # lines logged since the start's copy (an empty file), before the preemption's checkpoint
    assert max(json.loads(line)["step"] for line in bucket_lines.splitlines()) >= 3
    status = json.loads(gcs.fs.cat_file(f"{gcs.name}/runs/p/status.json"))
    assert status["status"] == "preempted"
    assert f"to continue, run the same command (output_url={url} continues it" in err
    assert gcs.fs.exists(f"{gcs.name}/runs/p/config.yaml")


@pytest.mark.slow  # several seconds: make test runs it
def test_the_bucket_gets_the_small_files_after_each_evaluation_and_checkpoint(
        bucket, tmp_path, train_cli, monkeypatch):
    """What metrics.jsonl held at each copy: the start's (empty), the evaluation before
    training, the checkpoint's, the end's."""
    gcs = bucket

    copied = []
    request = RunMirror.request

    def record_and_request(mirror):
        lines = (Path(mirror.run_dir) / "metrics.jsonl").read_text().splitlines()
        copied.append([sorted(k for k in json.loads(line) if k.startswith(("eval/", "train/")))[0]
                       for line in lines])
        request(mirror)

    monkeypatch.setattr(RunMirror, "request", record_and_request)
    result = train_cli(*RUN, "trainer.max_steps=2", f"output_url={gcs.url}/runs/e",
                       f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert copied[0] == []  # the start
    assert ["eval/bits_per_byte"] in copied  # the evaluation before training, on its own
    assert finalised_steps(f"{gcs.url}/runs/e/checkpoints") == [2]
    assert bucket_metrics(gcs, "runs/e/metrics.jsonl") == metrics_of(tmp_path / "run")
    gcs.fs.invalidate_cache()
    assert gcs.fs.exists(f"{gcs.name}/runs/e/model/flaxlm_export.json")  # the final model/


@pytest.mark.slow  # several seconds: make test runs it
def test_a_slow_store_gets_the_small_files_in_the_background_each_checkpoint_after_its_lines(
        s3, tmp_path, train_cli, monkeypatch):
    """Every copy of a small file held back 0.2 s (a slow endpoint): the copies are made by
    the mirror's thread, never the training thread; each checkpoint is committed once the
    bucket holds its metrics lines; and the end's flush leaves the bucket's metrics.jsonl and
    status.json equal to the local ones."""
    upload = flaxlm.run_mirror.upload
    threads, at_commits = set(), []

    def slow_upload(local, url, setting):
        threads.add(threading.current_thread().name)
        time.sleep(0.2)
        upload(local, url, setting)

    def record_bucket_at_commit(mirror):
        request_and_wait(mirror)  # before orbax writes the step's commit file
        steps = [line["step"] for line in bucket_metrics(s3, "runs/slow/metrics.jsonl")]
        at_commits.append((max(steps), finalised_steps(f"{s3.url}/runs/slow/checkpoints")))

    request_and_wait = RunMirror.request_and_wait
    monkeypatch.setattr(flaxlm.run_mirror, "upload", slow_upload)
    monkeypatch.setattr(RunMirror, "request_and_wait", record_bucket_at_commit)
    run_dir = tmp_path / "run"
    result = train_cli(*RUN, "trainer.max_steps=6", f"output_url={s3.url}/runs/slow",
                       f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert threads == {"flaxlm-run-mirror"}
    assert finalised_steps(f"{s3.url}/runs/slow/checkpoints") == [4, 6]
    # at each commit: the checkpoints before it complete, its own not yet, and the bucket
    # holding its lines (and maybe later ones, which a resume drops)
    assert [complete for _, complete in at_commits] == [[], [4]], at_commits
    assert [top >= step for (top, _), step in zip(at_commits, [4, 6])] == [True, True]
    assert_mirrored(s3, "runs/slow", run_dir, "finished")


@pytest.mark.slow  # several seconds: make test runs it
def test_a_sigterm_flushes_the_copies_still_pending_to_a_slow_store(s3, tmp_path, train_cli,
                                                                     monkeypatch):
    """SIGTERM raised as the save of step 4 starts, every copy held back 0.2 s: the run saves
    its preemption checkpoint and exits 75 with the bucket's metrics.jsonl and status.json
    equal to the local ones."""
    import flaxlm.job

    upload, make_checkpointer = flaxlm.run_mirror.upload, flaxlm.job.make_checkpointer

    def slow_upload(local, url, setting):
        time.sleep(0.2)
        upload(local, url, setting)

    def make_then_stop(*args, after_save, **kwargs):
        def after(step):
            after_save(step)
            if step == 4:
                signal.raise_signal(signal.SIGTERM)  # to the run's handler (main thread)
        return make_checkpointer(*args, after_save=after, **kwargs)

    monkeypatch.setattr(flaxlm.run_mirror, "upload", slow_upload)
    monkeypatch.setattr(flaxlm.job, "make_checkpointer", make_then_stop)
    run_dir = tmp_path / "run"
    result = train_cli(*RUN, f"output_url={s3.url}/runs/t", f"hydra.run.dir={run_dir}",
                       cwd=tmp_path)
    assert result.returncode == PREEMPTED_EXIT_CODE, result.stderr[-3000:]
    assert "not yet copied" not in result.stderr
    assert_mirrored(s3, "runs/t", run_dir, "preempted")


def assert_mirrored(bucket, prefix: str, run_dir: Path, status: str) -> None:
    """The bucket's metrics.jsonl and status.json under `prefix` equal the run's local ones,
    and the run ended with `status`."""
    assert bucket_metrics(bucket, f"{prefix}/metrics.jsonl") == metrics_of(run_dir)
    bucket.fs.invalidate_cache()
    assert (bucket.fs.cat_file(f"{bucket.name}/{prefix}/status.json")
            == (run_dir / "status.json").read_bytes())
    assert json.loads((run_dir / "status.json").read_text())["status"] == status


@pytest.mark.slow  # several seconds: make test runs it
def test_a_start_without_checkpoint_in_the_bucket_is_kept_not_copied_over(gcs, tmp_path,
                                                                        train_cli):
    old = '{"step": 2, "train/loss": 6.0}\n'
    gcs.put("runs/s/metrics.jsonl", old)  # a start killed before its first checkpoint
    result = train_cli(*SHORT, f"output_url={gcs.url}/runs/s",
                       f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [kept] = [n for n in names_under(gcs, "runs/s") if n.startswith("metrics.jsonl.stopped-")]
    assert gcs.fs.cat_file(f"{gcs.name}/runs/s/{kept}").decode() == old
    assert f"keeps them in {gcs.url}/runs/s/{kept}" in result.stdout
    assert bucket_metrics(gcs, "runs/s/metrics.jsonl") == metrics_of(tmp_path / "run")


# --- two hosts that share nothing but the bucket -------------------------------------------------


def two_hosts_sharing_only(url: str, tmp_path, tag: str, port: int,
                           env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """The same command on two "hosts" joined by jax.distributed: each with its own cache and
    its own timestamped local run_dir, the bucket folder `url` their only shared storage. Each
    cache holds the builtin corpus already (the tokenizer and the blocks are still each host's
    own to make): parsing it again costs each process 2 s of CPU time. `env`: variables set
    for both, over this process's."""
    processes = []
    for index, command in enumerate(multihost.two_hosts(port)):
        host = tmp_path / f"host{index}"
        if not (host / "cache").exists():  # a host started again keeps its cache
            cache_with_builtin(host / "cache")
        processes.append(subprocess.Popen(
            [*command, *QUICK, f"output_url={url}",
             f"hydra.run.dir={host}/{tag}-" + "${now:%H-%M-%S_%f}"],
            env={**os.environ, **(env or {}), "FLAXLM_CACHE": str(host / "cache")},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return processes


# Three quick tries of every bucket call: a store gone is found out in milliseconds.
QUICK = ["storage_retries.attempts=3", "storage_retries.first_wait_s=0.001",
         "storage_retries.max_wait_s=0.01"]


def bucket_metrics(bucket, key: str) -> list[dict]:
    bucket.fs.invalidate_cache()
    lines = bucket.fs.cat_file(f"{bucket.name}/{key}").decode().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in multihost.VOLATILE}
            for line in lines]


def host0_run(tmp_path, tag: str) -> Path:
    [metrics] = (tmp_path / "host0").glob(f"{tag}-*/metrics.jsonl")
    return metrics.parent


@pytest.fixture(scope="module")
def two_hosts_never_stopped(s3_endpoint, tmp_path_factory):
    """The two hosts' run never stopped, in a bucket of moto's: (its metrics in the bucket,
    host 0's local run folder with the final model/). The tests below compare theirs with
    it: where a run keeps its checkpoints changes no number it computes."""
    import s3fs
    from buckets import Bucket, _forget_filesystems, s3_variables

    env = s3_variables(s3_endpoint)
    fs = s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                           client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    bucket = Bucket("s3://never-stopped", fs)
    fs.mkdir(bucket.name)
    tmp_path = tmp_path_factory.mktemp("never-stopped")
    with pytest.MonkeyPatch.context() as patch:  # the session's cache, as each test's
        patch.setenv("FLAXLM_CACHE", str(tmp_path_factory.getbasetemp() / "flaxlm-cache"))
        whole = two_hosts_sharing_only(f"{bucket.url}/run", tmp_path, "whole",
                                       multihost.free_port(), env)
    for process, output in zip(whole, multihost.finish(whole)):
        assert process.returncode == 0, output[-3000:]
    _forget_filesystems()
    expected = bucket_metrics(bucket, "run/metrics.jsonl")
    assert [m["step"] for m in expected if "eval/loss" in m] == [0, 6, 12]
    return expected, host0_run(tmp_path, "whole")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_hosts_sharing_only_the_bucket_killed_and_resumed_train_as_if_never_stopped(
        gcs, tmp_path, two_hosts_never_stopped):
    """Issue 45's case: two processes, nothing shared but the bucket, killed (SIGKILL) mid-run
    and started again with the same command (new local folders) end with the metrics of the
    same two processes never stopped, exactly."""
    expected, _ = two_hosts_never_stopped
    port = multihost.free_port()
    url = f"{gcs.url}/runs/stopped"
    first = two_hosts_sharing_only(url, tmp_path, "first", port)
    run_dir = multihost.the_run_dir(tmp_path / "host0", first)
    multihost.wait_for_step(run_dir, first, 8)
    for process in first:
        process.kill()
    multihost.finish(first)
    assert finalised_steps(f"{url}/checkpoints")[-1] < 12

    again = two_hosts_sharing_only(url, tmp_path, "again", port)
    for process, output in zip(again, multihost.finish(again)):
        assert process.returncode == 0, output[-3000:]
        assert "from its checkpoint at step" in output
    assert bucket_metrics(gcs, "runs/stopped/metrics.jsonl") == expected
    assert multihost.metric_lines(host0_run(tmp_path, "again")) == expected


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_hosts_whose_store_goes_away_mid_save_both_stop_resumably_and_resume_exactly(
        s3, s3_endpoint, tmp_path, two_hosts_never_stopped):
    """Issue 55, point 3 with two processes: the S3 server goes away (every request dropped)
    from the first write of step 8's checkpoint on, while both hosts write their parts. Both
    stop with the resumable exit code within their retries (no process waits forever on the
    other or on the store), step 8 never looks complete, and with the store back the same
    command ends bitwise where the two hosts that never stopped end."""
    from faulty_proxy import FaultyProxy, Outage

    expected, never_stopped = two_hosts_never_stopped
    port = multihost.free_port()
    url = f"{s3.url}/runs/a"
    outage = Outage(starts_at="/runs/a/checkpoints/8/")
    with FaultyProxy(s3_endpoint, outage) as proxy:
        first = two_hosts_sharing_only(url, tmp_path, "first", port,
                                       {"AWS_ENDPOINT_URL_S3": proxy.url})
        outputs = multihost.finish(first, timeout=300)
    assert outage.down, "the outage never began"
    for process, output in zip(first, outputs):
        assert process.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    assert "could not write the checkpoint of step 8" in outputs[0]
    assert "last complete checkpoint is step 6" in outputs[0]
    assert finalised_steps(f"{url}/checkpoints")[-1] == 6

    again = two_hosts_sharing_only(url, tmp_path, "again", port)
    for process, output in zip(again, multihost.finish(again)):
        assert process.returncode == 0, output[-3000:]
        assert "from its checkpoint at step 6" in output
    assert finalised_steps(f"{url}/checkpoints")[-1] == 12
    assert bucket_metrics(s3, "runs/a/metrics.jsonl") == expected
    assert_same_final_weights(host0_run(tmp_path, "again"), never_stopped)


# --- a bucket the run cannot write to: one paragraph before training, exit 2 ---------------------


def error_line(result) -> str:
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if line.startswith("flaxlm: error:")]
    return line


def test_a_bucket_that_does_not_exist_stops_the_run_before_it_starts(gcs_env, tmp_path,
                                                                      train_cli):
    result = train_cli(*SHORT, "output_url=gs://no-such-bucket/runs/a",
                       f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2
    assert_names(error_line(result), "output_url", "'gs://no-such-bucket'", "does not exist",
                 "gcloud storage ls")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # the run directory untouched


@pytest.mark.parametrize(("url", "fragments"), [
    ("az://bucket/runs/a", ("output_url=az://bucket/runs/a", "gs:// and s3://", "run_dir")),
    ("/mnt/runs/a", ("output_url=/mnt/runs/a", "not a URL", "run_dir")),
])
def test_an_output_url_orbax_cannot_write_is_refused(url, fragments, tmp_path, train_cli):
    result = train_cli(*SHORT, f"output_url={url}", f"hydra.run.dir={tmp_path / 'run'}",
                       cwd=tmp_path)
    assert result.returncode == 2
    assert_names(error_line(result), *fragments)


# What an IAM user may do to the test's bucket: read it (moto names the permissions by S3's
# operations, HeadBucket, ListObjectsV2, GetObject, where AWS has s3:ListBucket and
# s3:GetObject: the wildcards cover both), or nothing at all.
READ_ONLY = ["s3:Get*", "s3:List*", "s3:Head*"]


@pytest.fixture(params=[READ_ONLY, []], ids=["read-only", "no-access"])
def s3_keys_that_may_not_write(request, s3, s3_endpoint, monkeypatch):
    """The AWS variables of an IAM user who may not write to the `s3` bucket, with moto's
    server checking every request's credentials against IAM (as S3 does) until the test
    ends: a denied write is the store's own answer, not a planted error."""
    import boto3
    import requests
    from buckets import _forget_filesystems

    iam = boto3.client("iam", endpoint_url=s3_endpoint)
    user = f"user-{s3.name}"
    iam.create_user(UserName=user)
    if request.param:
        iam.put_user_policy(UserName=user, PolicyName="read", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": request.param,
                           "Resource": [f"arn:aws:s3:::{s3.name}", f"arn:aws:s3:::{s3.name}/*"]}],
        }))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    _forget_filesystems()
    # moto's own switch: requests after the first 0 are authenticated and authorised
    requests.post(f"{s3_endpoint}/moto-api/reset-auth", data=b"0", timeout=30).raise_for_status()
    try:
        yield s3
    finally:
        requests.post(f"{s3_endpoint}/moto-api/reset-auth", data=b"inf", timeout=30)
        _forget_filesystems()


def test_a_denied_write_stops_the_run_before_it_starts(s3_keys_that_may_not_write, tmp_path,
                                                      train_cli):
    """Whether the credentials may read the bucket or not even see it, the paragraph says the
    write was denied (failed before for the second: the bucket "does not exist")."""
    bucket = s3_keys_that_may_not_write
    url = f"{bucket.url}/runs/a"
    result = train_cli(*SHORT, f"output_url={url}", f"hydra.run.dir={tmp_path / 'run'}",
                       cwd=tmp_path)
    assert result.returncode == 2
    assert_names(error_line(result), f"output_url: access to '{url}' was denied", "Access Denied",
                 f"may not write to {bucket.url}", "grant them write access",
                 "AWS_ACCESS_KEY_ID")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before the run began


def test_a_denied_write_names_the_url_and_the_fix(gcs, monkeypatch):
    import fsspec

    def denied(*args, **kwargs):
        raise OSError("Forbidden: caller does not have storage.objects.create access")

    monkeypatch.setattr(fsspec.filesystem("gs"), "pipe_file", denied)
    with pytest.raises(FlaxlmError) as error:
        probe_write(f"{gcs.url}/runs/a", "output_url")
    assert_names(error.value, "output_url", f"'{gcs.url}/runs/a'", "denied",
                 "may not write to", "grant them write access", "gcloud auth")


def test_a_writable_bucket_passes_the_probe_and_keeps_nothing_of_it(gcs):
    probe_write(f"{gcs.url}/runs/a", "output_url")
    assert gcs.fs.find(gcs.name) == []
