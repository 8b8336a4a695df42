"""The background uploader (flaxlm.background_upload) with copies that a test holds back on an
Event: a request returns while its copy is held, a burst for one file is one more copy (the
newest), flush waits for what was asked and names what is still held when its time is up, and a
failed copy is reported while the later ones still run. No test measures time: each waits on
events, with timeouts only so that a fault fails instead of hanging."""

from __future__ import annotations

import threading

import pytest

from flaxlm.background_upload import BackgroundUploader

WAIT_S = 30  # only ever reached when something is wrong


class Store:
    """A fake bucket: what each copy wrote, in order; a copy blocks while `gate` is clear."""

    def __init__(self):
        self.written: list[tuple[str, str]] = []
        self.gate = threading.Event()
        self.started = threading.Event()  # set as a held copy begins
        self.failures: list[tuple[str, Exception]] = []
        self.uploader = BackgroundUploader(lambda name, err: self.failures.append((name, err)),
                                           thread_name="test-uploader")

    def copy_of(self, name: str, content: str):
        def copy():
            self.started.set()
            assert self.gate.wait(WAIT_S), "the test never let the copy go"
            self.written.append((name, content))
        return copy


@pytest.fixture
def store():
    store = Store()
    yield store
    store.gate.set()
    store.uploader.close(WAIT_S)


def test_a_request_returns_while_its_copy_is_held(store):
    store.uploader.request("metrics.jsonl", store.copy_of("metrics.jsonl", "a"))
    assert store.started.wait(WAIT_S)  # the copy runs, held, in the other thread
    assert store.written == []  # and the caller got here all the same
    store.gate.set()
    assert store.uploader.flush(WAIT_S) == []
    assert store.written == [("metrics.jsonl", "a")]


def test_ten_requests_for_one_file_while_held_make_two_copies_the_last_the_newest(store):
    for version in range(10):
        store.uploader.request("metrics.jsonl", store.copy_of("metrics.jsonl", f"v{version}"))
        if version == 0:
            assert store.started.wait(WAIT_S)  # the first is under way, held
    store.gate.set()
    assert store.uploader.flush(WAIT_S) == []
    assert store.written == [("metrics.jsonl", "v0"), ("metrics.jsonl", "v9")]


def test_copies_go_up_in_the_order_first_asked_a_newer_one_keeping_its_place(store):
    store.uploader.request("held", store.copy_of("held", "0"))
    assert store.started.wait(WAIT_S)
    store.uploader.request("metrics.jsonl", store.copy_of("metrics.jsonl", "1"))
    store.uploader.request("status.json", store.copy_of("status.json", "1"))
    store.uploader.request("metrics.jsonl", store.copy_of("metrics.jsonl", "2"))
    store.gate.set()
    assert store.uploader.flush(WAIT_S) == []
    assert store.written == [("held", "0"), ("metrics.jsonl", "2"), ("status.json", "1")]


def test_flush_waits_for_every_pending_copy_then_returns(store):
    for name in ("a", "b", "c"):
        store.uploader.request(name, store.copy_of(name, name))
    assert store.started.wait(WAIT_S)
    threading.Timer(0.05, store.gate.set).start()  # released while flush waits
    assert store.uploader.flush(WAIT_S) == []
    assert [name for name, _ in store.written] == ["a", "b", "c"]


def test_flush_with_nothing_asked_returns_at_once():
    uploader = BackgroundUploader(lambda name, err: None, thread_name="test-uploader")
    assert uploader.flush(0) == []
    assert uploader.close(0) == []


def test_a_bounded_flush_names_what_is_still_under_way_and_waiting(store):
    store.uploader.request("metrics.jsonl", store.copy_of("metrics.jsonl", "a"))
    assert store.started.wait(WAIT_S)
    store.uploader.request("status.json", store.copy_of("status.json", "b"))
    assert store.uploader.flush(0.01) == ["metrics.jsonl", "status.json"]
    assert store.uploader.close(0.01) == ["metrics.jsonl", "status.json"]
    store.gate.set()  # what close left is still copied while the process lives
    assert store.uploader.flush(WAIT_S) == []
    assert store.written == [("metrics.jsonl", "a"), ("status.json", "b")]


def test_a_failed_copy_is_reported_and_later_copies_still_happen(store):
    def fails():
        raise OSError("connection reset")

    store.gate.set()
    store.uploader.request("metrics.jsonl", fails)
    store.uploader.request("status.json", store.copy_of("status.json", "s"))
    assert store.uploader.flush(WAIT_S) == []
    assert [(name, str(err)) for name, err in store.failures] == [
        ("metrics.jsonl", "connection reset")]
    store.uploader.request("metrics.jsonl", store.copy_of("metrics.jsonl", "m"))
    assert store.uploader.flush(WAIT_S) == []
    assert store.written == [("status.json", "s"), ("metrics.jsonl", "m")]


def test_a_request_after_close_starts_the_thread_again(store):
    store.gate.set()
    store.uploader.request("a", store.copy_of("a", "1"))
    assert store.uploader.close(WAIT_S) == []
    store.uploader.request("a", store.copy_of("a", "2"))
    assert store.uploader.flush(WAIT_S) == []
    assert store.written == [("a", "1"), ("a", "2")]


@pytest.fixture
def run_files(tmp_path, monkeypatch):
    """A run directory with metrics.jsonl and status.json, a fake `upload` for RunMirror (what
    each copy read from the local file, in order; held while `gate` is clear), and a maker of
    RunMirrors whose copies are all done before the fake is taken away."""
    import flaxlm.run_mirror as run_mirror

    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "status.json").write_text('{"status": "running"}')
    fake = Store()
    fake.fail: set[str] = set()

    def upload(local, url, setting):
        name = url.rsplit("/", 1)[-1]
        fake.started.set()
        assert fake.gate.wait(WAIT_S), "the test never let the copy go"
        if name in fake.fail:
            raise run_mirror.FlaxlmError(f"output_url: '{url}' could not be written")
        fake.written.append((name, open(local).read()))

    monkeypatch.setattr(run_mirror, "upload", upload)
    monkeypatch.setattr(run_mirror, "_upload_start_model", lambda run_dir, output_url: None)
    mirrors = []

    def mirror(flush_timeout_s: float = WAIT_S):
        mirrors.append(run_mirror.RunMirror(str(tmp_path), "s3://bkt/run", flush_timeout_s))
        return mirrors[-1]

    yield tmp_path, fake, mirror
    fake.gate.set()
    for made in mirrors:
        made.flush_timeout_s = WAIT_S
        made.finish()


def test_the_run_mirror_copies_the_newest_files_in_the_background_and_at_its_end(run_files):
    run_dir, store, make_mirror = run_files
    mirror = make_mirror()
    mirror.request()  # returns with its copies held
    assert store.started.wait(WAIT_S)
    with open(run_dir / "metrics.jsonl", "a") as lines:
        lines.write('{"step": 1}\n')
    mirror.request()
    (run_dir / "status.json").write_text('{"status": "finished"}')
    store.gate.set()
    mirror.finish()
    assert dict(store.written) == {  # each file's last copy: its newest
        "metrics.jsonl": '{"step": 0}\n{"step": 1}\n', "status.json": '{"status": "finished"}'}


def test_a_failed_background_copy_is_a_warning_and_the_next_copies_it(run_files, capsys):
    _, store, make_mirror = run_files
    store.gate.set()
    store.fail.add("metrics.jsonl")
    mirror = make_mirror()
    mirror.request_and_wait()
    err = capsys.readouterr().err
    assert "flaxlm: warning: could not copy metrics.jsonl to the bucket" in err
    assert "'s3://bkt/run/metrics.jsonl' could not be written" in err
    assert [name for name, _ in store.written] == ["status.json"]
    store.fail.clear()
    mirror.finish()
    assert [name for name, _ in store.written] == ["status.json", "metrics.jsonl", "status.json"]


def test_the_end_of_a_run_waits_a_bounded_time_and_names_what_was_not_copied(run_files,
                                                                              capsys):
    _, store, make_mirror = run_files
    mirror = make_mirror(flush_timeout_s=0.01)
    mirror.finish()  # the store never answers
    err = capsys.readouterr().err
    # model/ was copied (a no-op here); metrics.jsonl is held, status.json waits behind it
    assert ("flaxlm: warning: metrics.jsonl, status.json not yet copied to s3://bkt/run after "
            "0s" in err)
    assert store.written == []


def test_a_copy_retrying_against_a_dead_store_gives_up_when_the_end_of_the_run_does(
        tmp_path, monkeypatch, capsys):
    """storage_retries' tries of one copy last minutes against a store that is gone; the run's
    end waits a bounded time for the copies. The tries end with that wait: the copy fails,
    is reported, and nothing is left retrying behind the run's end (before, the end's wait
    timed out while the copy went on trying for its minutes)."""
    import flaxlm.run_mirror as run_mirror
    from flaxlm import storage_retry

    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    tries = []

    def upload(local, url, setting):  # the store refuses every connection
        def attempt():
            tries.append(url)
            raise ConnectionRefusedError(111, "Connection refused")
        storage_retry.call(attempt, f"put {url}")

    monkeypatch.setattr(run_mirror, "upload", upload)
    monkeypatch.setattr(run_mirror, "_upload_start_model", lambda run_dir, output_url: None)
    # Waits of 0.4 s doubling to 30 s: some 2 minutes of tries in all.
    previous = storage_retry.use(storage_retry.RetryPolicy(attempts=10, first_wait_s=0.4,
                                                           max_wait_s=30))
    try:
        mirror = run_mirror.RunMirror(str(tmp_path), "s3://bkt/run", flush_timeout_s=1.0)
        mirror.finish()
        # Nothing under way or waiting once finish returned: the copy gave up in time.
        assert mirror._uploader.flush(0) == []
    finally:
        storage_retry.use(previous)
    err = capsys.readouterr().err
    assert "not tried again: the wait for it ends before try" in err
    assert "flaxlm: warning: could not copy metrics.jsonl to the bucket" in err
    assert "not yet copied" not in err
    assert 2 <= len(tries) < 10
