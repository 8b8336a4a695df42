"""Bucket calls through a store that fails now and then (issue 55, point 2): a fault-injecting
proxy (tests/faulty_proxy.py) in front of moto's S3 server answers bursts of requests with 503s,
a 500 and a dropped connection, and what flaxlm does with a bucket (a folder uploaded with its
marker, files read back, listed, globbed, copied into the cache, moved; a run's small files
mirrored) ends with the same bytes as through a proxy that injects nothing. With retries off
(storage_retries.attempts=1) the first fault fails the call with the caller's paragraph, as
every fault did before flaxlm retried (botocore's own five tries do not outlast a burst of
five)."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest
from faulty_proxy import FaultyProxy

from flaxlm import storage, storage_retry
from flaxlm.errors import FlaxlmError
from flaxlm.layout import CONFIG_FILE, METRICS_FILE, MODEL_SUBDIR, STATUS_FILE
from flaxlm.run_mirror import upload_run_files
from flaxlm.storage_retry import RetryPolicy

SETTING = "output_url"
MARKER = "flaxlm_export.json"
# Of every 14 requests, the 4th to the 11th fail, one way or another: a burst of eight in a row,
# more than the clients' own retries outlast (botocore's five tries in its default mode, each
# cut connection sent again once by aiohttp, s3fs's tries again on SlowDown), which were all
# the retrying there was before storage_retries.
BURST = ("503", "slowdown", "500", "drop", "503", "500", "503", "500")
PERIOD = 14


def bursts(n: int) -> str | None:
    return BURST[n % PERIOD - 3] if 3 <= n % PERIOD < 3 + len(BURST) else None


@pytest.fixture
def through_proxy(s3, s3_endpoint, monkeypatch):
    """A function that starts a proxy with a fault pattern in front of moto and points flaxlm's
    S3 clients at it; the test's own `s3.fs` still talks to moto directly."""
    started = []

    def start(fault) -> FaultyProxy:
        proxy = FaultyProxy(s3_endpoint, fault).__enter__()
        started.append(proxy)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        fsspec.get_filesystem_class("s3").clear_instance_cache()
        return proxy

    yield start
    for proxy in started:
        proxy.__exit__(None, None, None)
    fsspec.get_filesystem_class("s3").clear_instance_cache()


@pytest.fixture
def quick_retries():
    """The default policy's ten tries, with waits of milliseconds."""
    previous = storage_retry.use(RetryPolicy(attempts=10, first_wait_s=0.001, max_wait_s=0.01))
    yield
    storage_retry.use(previous)


def local_files(root: Path) -> Path:
    """A model folder and a run's small files, as a run leaves them."""
    model = root / "run" / MODEL_SUBDIR
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(os.urandom(300_000))
    (model / "config.json").write_text('{"model_type": "gpt2"}\n')
    (model / "tokenizer.json").write_text('{"version": "1.0"}\n')
    (model / MARKER).write_text('{"flaxlm": true}\n')
    (root / "run" / METRICS_FILE).write_text('{"step": 1, "loss": 3.5}\n' * 50)
    (root / "run" / STATUS_FILE).write_text('{"status": "running"}\n')
    (root / "run" / CONFIG_FILE).write_text("seed: 0\n")
    return root / "run"


def what_flaxlm_does(url: str, run: Path, scratch: Path) -> dict:
    """Every kind of bucket call of flaxlm.storage on `url`, and what each returned or read."""
    seen: dict = {}
    scratch.mkdir()
    storage.upload_folder(str(run / MODEL_SUBDIR), f"{url}/export/{MODEL_SUBDIR}", SETTING,
                          MARKER)
    storage.upload(str(run / METRICS_FILE), f"{url}/{METRICS_FILE}", SETTING)
    seen["exists"] = (storage.exists(f"{url}/{METRICS_FILE}", SETTING),
                      storage.exists(f"{url}/nothing.txt", SETTING))
    seen["names"] = sorted(storage.list_names(f"{url}/export/{MODEL_SUBDIR}", SETTING))
    seen["glob"] = [u.rsplit("/", 1)[-1]
                    for u in storage.glob_objects(f"{url}/export/*/*.json", SETTING)]
    storage.download(f"{url}/{METRICS_FILE}", str(scratch / "metrics.jsonl"), SETTING)
    seen["downloaded"] = (scratch / "metrics.jsonl").read_bytes()
    storage.download_folder(f"{url}/export/{MODEL_SUBDIR}", str(scratch / "model"), SETTING)
    seen["folder"] = {p.name: p.read_bytes() for p in sorted((scratch / "model").iterdir())}
    copy = Path(storage.cached_copy(f"{url}/export/{MODEL_SUBDIR}", str(scratch / "cache"),
                                    SETTING))
    seen["cached"] = {p.name: p.read_bytes() for p in sorted(copy.iterdir())}
    storage.move_objects(f"{url}/{METRICS_FILE}", f"{url}/{METRICS_FILE}.kept", SETTING)
    upload_run_files(str(run), f"{url}/mirror")
    return seen


def bucket_contents(fs, name: str) -> dict[str, bytes]:
    """Every object in the bucket `name`, by key, read from moto directly."""
    fs.invalidate_cache()
    return {key[len(name) + 1:]: fs.cat_file(key) for key in sorted(fs.find(name))}


def test_bucket_calls_through_bursts_of_faults_end_as_without_faults(
        s3, through_proxy, quick_retries, tmp_path, capsys):
    run = local_files(tmp_path / "local")
    s3.fs.mkdir(f"{s3.name}-calm")
    through_proxy(lambda n: None)
    calm = what_flaxlm_does(f"{s3.url}-calm", run, Path(tmp_path / "calm"))
    assert "trying again" not in capsys.readouterr().err

    proxy = through_proxy(bursts)
    stormy = what_flaxlm_does(s3.url, run, Path(tmp_path / "stormy"))

    assert {fault for _, fault, _, _ in proxy.faults} == set(BURST)
    assert len(proxy.faults) >= 3 * len(BURST), proxy.faults  # three bursts at least
    retried = capsys.readouterr().err
    # Each fault met flaxlm's retries, but for the dropped connections: aiohttp itself sends an
    # idempotent request again once, which then met the next fault of the burst.
    assert retried.count("trying again") >= sum(f != "drop" for _, f, _, _ in proxy.faults)
    assert "warning" not in retried  # not one run file left behind
    assert stormy == calm
    expected = bucket_contents(s3.fs, f"{s3.name}-calm")
    assert bucket_contents(s3.fs, s3.name) == expected
    assert expected[f"export/{MODEL_SUBDIR}/model.safetensors"] == (
        run / MODEL_SUBDIR / "model.safetensors").read_bytes()
    assert sorted(expected) == sorted([
        *(f"export/{MODEL_SUBDIR}/{n}" for n in ("config.json", MARKER, "model.safetensors",
                                                 "tokenizer.json")),
        f"{METRICS_FILE}.kept",  # (model/, exported, is upload_exports' to copy)
        *(f"mirror/{n}" for n in (CONFIG_FILE, METRICS_FILE, STATUS_FILE))])


# What each fault is named once the tries run out (flaxlm.bucket_faults): a 500 is not one of
# the faults a user can act on, and keeps the generic paragraph.
NAMED = {"503": "the store is throttling requests to", "slowdown": "the store is throttling "
         "requests to", "500": "could not write to", "drop": "could not reach the store that "
         "holds"}


@pytest.mark.parametrize("fault", sorted(NAMED))
def test_without_retries_one_fault_fails_the_call_with_its_paragraph(fault, s3, through_proxy,
                                                                      tmp_path):
    run = local_files(tmp_path)
    # Twice: aiohttp sends an idempotent request cut off without an answer again, once.
    through_proxy(lambda n: fault if n < 2 else None)
    previous = storage_retry.use(RetryPolicy(attempts=1, first_wait_s=0, max_wait_s=0))
    try:
        with pytest.raises(FlaxlmError) as raised:
            storage.upload(str(run / METRICS_FILE), f"{s3.url}/{METRICS_FILE}", SETTING)
    finally:
        storage_retry.use(previous)
    assert str(raised.value).startswith(f"{SETTING}: {NAMED[fault]} '{s3.url}/{METRICS_FILE}'")


def test_a_permanent_fault_is_not_retried(s3, through_proxy, quick_retries, tmp_path, capsys):
    proxy = through_proxy(lambda n: None)
    with pytest.raises(FlaxlmError, match="does not exist"):
        storage.download(f"{s3.url}/no-such-key", str(tmp_path / "x"), SETTING)
    assert proxy.requests <= 2 and "trying again" not in capsys.readouterr().err


@pytest.mark.slow  # two short runs: about 25 s
def test_a_run_through_bursts_of_faults_ends_as_a_run_without(s3, through_proxy, tmp_path,
                                                              train_cli):
    """A run with output_url (its checkpoints, small files and final model/ in the bucket)
    through the same bursts of faults as above: every metric the same as a calm run's."""
    from conftest import metrics_of
    from test_faults import RUN

    previous = storage_retry.current()
    # Saves in the loop's thread, so that the order of requests (and which meet a fault) is
    # the same every time.
    command = [*RUN, "trainer.max_steps=6", "checkpoint.async_save=false",
               "storage_retries.first_wait_s=0.001", "storage_retries.max_wait_s=0.01"]
    try:
        through_proxy(lambda n: None)
        calm = train_cli(*command, f"output_url={s3.url}/runs/calm",
                         f"hydra.run.dir={tmp_path / 'calm'}", cwd=tmp_path)
        assert calm.returncode == 0, calm.stderr[-3000:]
        proxy = through_proxy(bursts)
        stormy = train_cli(*command, f"output_url={s3.url}/runs/stormy",
                           f"hydra.run.dir={tmp_path / 'stormy'}", cwd=tmp_path)
    finally:
        storage_retry.use(previous)
    assert stormy.returncode == 0, stormy.stderr[-3000:]
    assert len(proxy.faults) >= 3 * len(BURST)
    assert "trying again" in stormy.stderr and "warning" not in stormy.stderr
    calm_metrics, stormy_metrics = metrics_of(tmp_path / "calm"), metrics_of(tmp_path / "stormy")
    assert [m for m in calm_metrics if "eval/loss" in m][-1]["step"] == 6
    assert stormy_metrics == calm_metrics
    # The final weights in the bucket, bitwise (its README and marker name each run's URL).
    weights = [s3.fs.cat_file(f"{s3.name}/runs/{run}/model/model.safetensors")
               for run in ("calm", "stormy")]
    assert weights[0] == weights[1]


class FailingPuts:
    """A fault pattern for the proxy: 503 for the first `times` PUTs of each object whose key
    holds one of `names`; every other request forwarded."""

    def __init__(self, names: tuple[str, ...], times: int):
        self.names, self.times = names, times
        self.failed: dict[str, int] = {}
        self._fail_next = False

    def watch(self, method: str, path: str) -> None:
        key = path.partition("?")[0]
        self._fail_next = (method == "PUT" and any(name in key for name in self.names)
                           and self.failed.get(key, 0) < self.times)
        if self._fail_next:
            self.failed[key] = self.failed.get(key, 0) + 1

    def __call__(self, n: int) -> str | None:
        return "503" if self._fail_next else None


def test_orbax_s_own_files_are_retried_as_storage_retries_says(s3, through_proxy, quick_retries,
                                                               capsys):
    """orbax writes a step's _CHECKPOINT_METADATA and the commit_success.txt that makes it
    complete through etils.epath, whose own S3 client tried five times (botocore's default)
    and failed the save on a sixth 503 in a row: now storage_retries' ten tries, as for
    every other bucket call."""
    import jax.numpy as jnp
    import numpy as np

    from flaxlm.training.checkpoint.manager import COMMIT_FILE, Checkpointer, finalised_steps

    faults = FailingPuts(("_CHECKPOINT_METADATA", COMMIT_FILE), times=6)
    through_proxy(faults)
    directory = f"{s3.url}/checkpoints"
    state = {"params": {"w": jnp.arange(8.0)}}
    checkpointer = Checkpointer(directory, async_save=False)
    checkpointer.save(1, state, {"epoch": 0}, {"config": {}})
    checkpointer.close()

    # Both kinds of file met their six faults (the commit files of the step and of each item).
    assert any(key.endswith(f"/1/{COMMIT_FILE}") for key in faults.failed), faults.failed
    assert any(key.endswith("/1/_CHECKPOINT_METADATA") for key in faults.failed), faults.failed
    assert set(faults.failed.values()) == {6}
    assert "trying again" in capsys.readouterr().err
    assert finalised_steps(directory) == [1]
    restored = Checkpointer(directory, read_only=True).restore(1, state)
    assert np.array_equal(restored.state["params"]["w"], np.arange(8.0))


# --- gs://, against the GCS emulator -------------------------------------------------------------


@pytest.fixture
def gcs_through_proxy(gcs, gcs_endpoint, monkeypatch):
    """`through_proxy` for gs://: the proxy in front of the GCS emulator, flaxlm's gcsfs
    pointed at it (STORAGE_EMULATOR_HOST); the test's own `gcs.fs` talks to the emulator."""
    from buckets import _forget_filesystems

    started = []

    def start(fault) -> FaultyProxy:
        proxy = FaultyProxy(gcs_endpoint, fault).__enter__()
        started.append(proxy)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        _forget_filesystems()
        return proxy

    yield start
    for proxy in started:
        proxy.__exit__(None, None, None)
    _forget_filesystems()


# gcsfs's uploads take several requests each (an upload begun, then its data): bursts of four,
# which gcsfs's own tries alone outlasted before, every one of which must now meet flaxlm's.
SHORT_BURST = ("503", "500", "drop", "503")


def short_bursts(n: int) -> str | None:
    return SHORT_BURST[n % PERIOD - 3] if 3 <= n % PERIOD < 3 + len(SHORT_BURST) else None


def test_gs_bucket_calls_through_bursts_of_faults_end_as_without_faults(
        gcs, gcs_endpoint, gcs_through_proxy, quick_retries, tmp_path, capsys, monkeypatch):
    """The same calls as for s3:// above, against the GCS emulator, through bursts: every fault
    meets storage_retries (gcsfs's own six tries, with waits of 1 to 17 s, no longer come
    inside each of them), and the bucket ends with the same bytes as without faults."""
    run = local_files(tmp_path / "local")
    gcs.fs.mkdir(f"{gcs.name}-calm")
    gcs_through_proxy(lambda n: None)
    calm = what_flaxlm_does(f"{gcs.url}-calm", run, Path(tmp_path / "calm"))
    assert "trying again" not in capsys.readouterr().err

    proxy = gcs_through_proxy(short_bursts)
    stormy = what_flaxlm_does(gcs.url, run, Path(tmp_path / "stormy"))

    assert len(proxy.faults) >= 3 * len(SHORT_BURST), proxy.faults
    retried = capsys.readouterr().err
    # Each fault but the dropped connections (aiohttp sends an idempotent request again once)
    # met one of flaxlm's tries: none was spent in gcsfs's own.
    assert retried.count("trying again") >= sum(f != "drop" for _, f, _, _ in proxy.faults)
    assert "warning" not in retried
    assert stormy == calm
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)  # gcsfs reads it at each call
    assert bucket_contents(gcs.fs, gcs.name) == bucket_contents(gcs.fs, f"{gcs.name}-calm")
