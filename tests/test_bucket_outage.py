"""The bucket gone in the middle of a run (issue 55, point 3): a fault-injecting proxy
(tests/faulty_proxy.py) in front of moto's S3 server drops every request from the first write of
a checkpoint on, as a store that went away would. orbax writes that checkpoint in a background
thread; its failure surfaces at a later step or at the run's final wait. The run then stops with
the resumable exit code (75) once storage_retries' tries are spent, saying in one paragraph that
the bucket could not be written, which checkpoint is the last complete one and that the same
command resumes from it; the checkpoint it could not finish is never counted as complete. Run
again with the bucket back, it ends as the run that never stopped."""

from __future__ import annotations

import fsspec
import pytest
from conftest import assert_same_final_weights, metrics_of, trained_run
from faulty_proxy import FaultyProxy, Outage

from flaxlm.training.checkpoint.manager import COMMIT_FILE
from flaxlm.training.stop import PREEMPTED_EXIT_CODE

# test_faults' run: checkpoints at 4, 6, 8 and 12 (its last step), evaluations at 0, 6 and 12.
from test_faults import RUN  # noqa: E402  isort: skip

# Three quick tries of every bucket call (flaxlm's, and tensorstore's for the arrays).
QUICK = ["storage_retries.attempts=3", "storage_retries.first_wait_s=0.001",
         "storage_retries.max_wait_s=0.01"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run that never failed, with its checkpoints on disk."""
    return trained_run(tmp_path_factory, "reference", RUN)


@pytest.fixture
def through_proxy(s3, s3_endpoint, monkeypatch):
    """Start a proxy with a fault pattern in front of moto and point the run's S3 clients (s3fs
    and tensorstore's, which read AWS's variables) at it; `back()` points them at moto again.
    The test's own `s3.fs` talks to moto directly."""

    class Proxied:
        proxy: FaultyProxy | None = None

        def start(self, fault) -> FaultyProxy:
            self.proxy = FaultyProxy(s3_endpoint, fault).__enter__()
            monkeypatch.setenv("AWS_ENDPOINT_URL_S3", self.proxy.url)
            fsspec.get_filesystem_class("s3").clear_instance_cache()
            return self.proxy

        def back(self) -> None:
            monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
            fsspec.get_filesystem_class("s3").clear_instance_cache()

    proxied = Proxied()
    yield proxied
    if proxied.proxy is not None:
        proxied.proxy.__exit__(None, None, None)
    fsspec.get_filesystem_class("s3").clear_instance_cache()


def committed_steps(bucket, key: str) -> list[int]:
    """The steps under `key` with orbax's commit file, read from moto directly."""
    bucket.fs.invalidate_cache()
    names = [path.rsplit("/", 1)[-1] for path in bucket.fs.ls(f"{bucket.name}/{key}")]
    return sorted(int(name) for name in names if name.isdigit() and bucket.fs.exists(
        f"{bucket.name}/{key}/{name}/{COMMIT_FILE}"))


@pytest.mark.slow  # two short runs
@pytest.mark.parametrize(("lost", "last"), [(8, 6), (12, 8)], ids=["mid-run", "last-save"])
def test_a_bucket_gone_mid_save_stops_the_run_resumably_and_it_resumes_exactly(
        lost, last, s3, through_proxy, tmp_path, reference, train_cli):
    """The store goes away at the first write of step `lost`'s checkpoint (8: the failure
    surfaces while training goes on; 12, the last step: at the run's final wait)."""
    url = f"{s3.url}/runs/a"
    command = [*RUN, *QUICK, f"output_url={url}", f"hydra.run.dir={tmp_path / 'run'}"]
    outage = Outage(starts_at=f"/runs/a/checkpoints/{lost}/")
    proxy = through_proxy.start(outage)
    stopped = train_cli(*command, cwd=tmp_path)

    assert outage.down and proxy.faults, "the outage never began"
    assert stopped.returncode == PREEMPTED_EXIT_CODE, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    paragraph = stopped.stderr[stopped.stderr.index("flaxlm: error: "):]
    assert f"could not write the checkpoint of step {lost} to {url}/checkpoints" in paragraph
    assert f"last complete checkpoint is step {last}" in paragraph
    assert "run the same command" in paragraph
    # The step it could not finish does not look complete; the one named is.
    assert committed_steps(s3, "runs/a/checkpoints")[-1] == last

    outage.end()
    through_proxy.back()
    resumed = train_cli(*command, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from its checkpoint at step {last}" in resumed.stdout
    assert committed_steps(s3, "runs/a/checkpoints")[-1] == 12
    assert metrics_of(tmp_path / "run") == metrics_of(reference)
    assert_same_final_weights(tmp_path / "run", reference)
