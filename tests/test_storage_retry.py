"""The retry policy of bucket calls (flaxlm.storage_retry), with a fake sleep: which faults are
retried and which are raised at once, how long each wait is, how many tries, and what is
raised when they run out. tests/test_bucket_retries.py puts it in front of a real S3 server."""

from __future__ import annotations

import dataclasses
import errno

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)
from conftest import compose
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import OmegaConf
from s3fs.errors import translate_boto_error

from flaxlm import storage_retry
from flaxlm.errors import FlaxlmError
from flaxlm.storage_retry import RetryingFilesystem, RetryPolicy, call, is_transient


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": f"the store says {code}"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def s3fs_error(code: str, status: int) -> OSError:
    """What s3fs raises for botocore's ClientError: an OSError, the ClientError its cause."""
    err = client_error(code, status)
    translated = translate_boto_error(err)
    translated.__cause__ = err
    return translated


def gcsfs_error(status: int) -> Exception:
    from gcsfs.retry import HttpError

    return HttpError({"code": status, "message": f"status {status}"})


TRANSIENT = {
    "s3-slow-down": s3fs_error("SlowDown", 503),
    "s3-service-unavailable": s3fs_error("ServiceUnavailable", 503),
    "s3-internal-error": s3fs_error("InternalError", 500),
    "s3-request-timeout": s3fs_error("RequestTimeout", 400),
    "s3-throttling": s3fs_error("ThrottlingException", 400),
    "s3-any-503": s3fs_error("Whatever", 503),
    "s3-429": s3fs_error("TooManyRequests", 429),
    "botocore-client-error-502": client_error("BadGateway", 502),
    "endpoint-refused": EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),
    "connect-timeout": ConnectTimeoutError(endpoint_url="http://127.0.0.1:9"),
    "read-timeout": ReadTimeoutError(endpoint_url="http://127.0.0.1:9"),
    "connection-reset": ConnectionResetError(errno.ECONNRESET, "reset by peer"),
    "socket-timeout": TimeoutError("timed out"),
    "gcs-503": gcsfs_error(503),
    "gcs-429": gcsfs_error(429),
}
PERMANENT = {
    "s3-access-denied": s3fs_error("AccessDenied", 403),
    "s3-no-such-bucket": s3fs_error("NoSuchBucket", 404),
    "s3-no-such-key": s3fs_error("NoSuchKey", 404),
    "s3-invalid-key": s3fs_error("InvalidAccessKeyId", 403),
    "s3-bad-request": s3fs_error("InvalidArgument", 400),
    "botocore-client-error-403": client_error("AccessDenied", 403),
    "no-credentials": NoCredentialsError(),
    "gcs-403": gcsfs_error(403),
    "gcs-404": gcsfs_error(404),
    "file-not-found": FileNotFoundError("no such key"),
    "plain-os-error": OSError("something else"),
    "bug": TypeError("a bug is not retried"),
}


@pytest.mark.parametrize("name", TRANSIENT)
def test_transient_faults_are_retried(name):
    assert is_transient(TRANSIENT[name])


@pytest.mark.parametrize("name", PERMANENT)
def test_permanent_faults_are_not(name):
    assert not is_transient(PERMANENT[name])


def test_a_permanent_fault_caused_by_a_transient_one_is_not_retried():
    err = FileNotFoundError("gone")
    err.__cause__ = ConnectionResetError("reset")
    assert not is_transient(err)


class Flaky:
    """A call that raises each of `faults` in turn, then returns "done"."""

    def __init__(self, *faults):
        self.faults = list(faults)
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        if self.faults:
            raise self.faults.pop(0)
        return "done"


POLICY = RetryPolicy(attempts=4, first_wait_s=0.5, max_wait_s=1.5)


def test_a_call_that_recovers_returns_after_waits_that_double_up_to_the_cap(capsys):
    waits = []
    flaky = Flaky(*[TRANSIENT["s3-slow-down"]] * 3)
    assert call(flaky, "put_file bkt/x", POLICY, sleep=waits.append, fraction=lambda: 1.0) == "done"
    assert flaky.calls == 4
    assert waits == [0.5, 1.0, 1.5]
    err = capsys.readouterr().err
    assert "put_file bkt/x failed (OSError: " in err and "try 4 of 4, storage_retries" in err


def test_the_last_fault_is_raised_once_the_attempts_run_out():
    waits = []
    faults = [ConnectionResetError(f"reset {i}") for i in range(5)]
    flaky = Flaky(*faults)
    with pytest.raises(ConnectionResetError) as raised:
        call(flaky, "get_file", POLICY, sleep=waits.append, fraction=lambda: 0.0)
    assert raised.value is faults[3]
    assert flaky.calls == POLICY.attempts and len(waits) == POLICY.attempts - 1
    assert waits == [0.25, 0.5, 0.75]  # jitter 0: half of each bound


@pytest.mark.parametrize("name", ["s3-access-denied", "s3-no-such-bucket", "no-credentials"])
def test_a_permanent_fault_is_raised_at_once(name):
    waits = []
    flaky = Flaky(PERMANENT[name])
    with pytest.raises(type(PERMANENT[name])):
        call(flaky, "ls", POLICY, sleep=waits.append)
    assert flaky.calls == 1 and waits == []


def test_one_attempt_is_no_retry():
    flaky = Flaky(TRANSIENT["gcs-503"])
    with pytest.raises(type(TRANSIENT["gcs-503"])):
        call(flaky, "ls", RetryPolicy(1, 0.5, 30), sleep=pytest.fail)
    assert flaky.calls == 1


policies = st.builds(
    lambda attempts, first, extra: RetryPolicy(attempts, first, first + extra),
    st.integers(1, 40), st.floats(0, 60, allow_nan=False), st.floats(0, 600, allow_nan=False))


@given(policies, st.integers(0, 200), st.floats(0, 1))
def test_each_wait_lies_in_the_upper_half_of_its_doubling_capped_bound(policy, retry, fraction):
    bound = min(policy.max_wait_s, policy.first_wait_s * 2.0 ** retry)
    wait = policy.wait_s(retry, fraction)
    assert bound / 2 <= wait <= bound <= policy.max_wait_s
    assert policy.wait_s(retry, 0.0) <= policy.wait_s(retry + 1, 0.0)  # never shorter


@given(policies, st.lists(st.floats(0, 1), min_size=40, max_size=40))
def test_a_call_that_never_recovers_tries_attempts_times_and_waits_at_most_longest(policy,
                                                                                  fractions):
    waits = []
    draws = iter(fractions)
    with pytest.raises(ConnectionResetError):
        call(Flaky(*[ConnectionResetError()] * 50), "ls", policy, sleep=waits.append,
             fraction=lambda: next(draws))
    assert len(waits) == policy.attempts - 1
    assert sum(waits) <= policy.longest_s() * (1 + 1e-9)


@pytest.mark.parametrize("values, named", [
    ({"attempts": 0}, "storage_retries.attempts=0"),
    ({"attempts": -3}, "storage_retries.attempts=-3"),
    ({"first_wait_s": -1.0}, "storage_retries.first_wait_s=-1.0"),
    ({"first_wait_s": 60.0}, "storage_retries.first_wait_s=60.0"),
    ({"max_wait_s": float("inf")}, "storage_retries.max_wait_s=inf"),
    ({"max_wait_s": float("nan")}, "storage_retries.max_wait_s=nan"),
])
def test_a_bad_policy_is_one_paragraph_naming_the_setting(values, named):
    with pytest.raises(FlaxlmError) as raised:
        dataclasses.replace(storage_retry.DEFAULT, **values)
    assert named in str(raised.value) and "Fix:" in str(raised.value)


def test_the_tools_default_is_the_configs():
    node = OmegaConf.to_container(compose().storage_retries)
    assert RetryPolicy(**node) == storage_retry.DEFAULT
    assert 60 <= storage_retry.DEFAULT.longest_s() <= 180  # one to a few minutes in all


def test_use_sets_the_process_policy():
    previous = storage_retry.use(POLICY)
    try:
        assert storage_retry.current() is POLICY
    finally:
        storage_retry.use(previous)


class FakeFilesystem:
    def __init__(self, *faults):
        self.rm_file = Flaky(*faults)
        self.ls = Flaky(*faults)
        self.protocol = "s3"


@pytest.fixture
def no_waits():
    previous = storage_retry.use(RetryPolicy(3, 0.0, 0.0))
    yield
    storage_retry.use(previous)


def test_a_retried_filesystem_method(no_waits):
    fs = RetryingFilesystem(FakeFilesystem(TRANSIENT["s3-slow-down"]))
    assert fs.ls("bkt/x") == "done" and fs._fs.ls.calls == 2
    assert fs.protocol == "s3"


def test_a_delete_retried_after_a_lost_answer_finds_the_object_gone_and_is_done(no_waits):
    fs = RetryingFilesystem(FakeFilesystem(TRANSIENT["connection-reset"],
                                           FileNotFoundError("bkt/x")))
    assert fs.rm_file("bkt/x") is None and fs._fs.rm_file.calls == 2
    # Missing at the first try, it was never there: the caller hears so.
    fs = RetryingFilesystem(FakeFilesystem(FileNotFoundError("bkt/x")))
    with pytest.raises(FileNotFoundError):
        fs.rm_file("bkt/x")


def kvstores(spec, driver: str) -> list[dict]:
    """Every kvstore of `driver` in a tensorstore spec, at any depth."""
    if isinstance(spec, dict):
        found = [spec] if spec.get("driver") == driver else []
        return found + [k for value in spec.values() for k in kvstores(value, driver)]
    if isinstance(spec, list):
        return [k for item in spec for k in kvstores(item, driver)]
    return []


@pytest.mark.parametrize("scheme, driver", [("s3", "s3"), ("gs", "gcs")])
def test_checkpoint_requests_retry_as_the_policy_says(scheme, driver):
    from orbax.checkpoint._src.serialization import tensorstore_utils

    from flaxlm.training.checkpoint import s3

    s3.install()
    previous = storage_retry.use(RetryPolicy(attempts=4, first_wait_s=0.25, max_wait_s=8))
    try:
        spec = tensorstore_utils.build_kvstore_tspec(f"{scheme}://bucket-name/run/checkpoints/4",
                                                     "params")
    finally:
        storage_retry.use(previous)
    [kvstore] = kvstores(spec, driver)
    assert kvstore[f"{driver}_request_retries"] == {
        "max_retries": 3, "initial_delay": "0.250000s", "max_delay": "8.000000s"}
