"""Each way a bucket can fail at a run's start, named for what it is (issue 55, point 1): an
endpoint that does not answer, credentials the store refuses, a bucket that does not exist, a
write the credentials may not make, a store that throttles. Against moto's S3 server (a port
nothing listens on for the first), and, for throttling, botocore's own exception as s3fs
raises it."""

from __future__ import annotations

import json
import socket

import pytest
from buckets import _forget_filesystems
from conftest import SHORT, assert_names

from flaxlm import storage_retry
from flaxlm.bucket_faults import Fault, classify
from flaxlm.errors import FlaxlmError
from flaxlm.storage import check_bucket, probe_write, storage_error
from flaxlm.storage_retry import RetryPolicy

# moto names the permissions by S3's operations (HeadBucket, ListObjectsV2, GetObject), where
# AWS has s3:ListBucket and s3:GetObject: the wildcards cover both.
READ_ONLY = ["s3:Get*", "s3:List*", "s3:Head*"]


@pytest.fixture
def stopped_endpoint(s3_env, monkeypatch):
    """AWS's variables pointed at a port on localhost that nothing listens on (as a stopped S3
    server's), with one attempt per request: botocore and s3fs would otherwise retry a refused
    connection for seconds before the error the test reads."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setattr("s3fs.S3FileSystem.retries", 1)
    # flaxlm's own tries too (storage_retries), which wait a minute or two by default.
    previous = storage_retry.use(RetryPolicy(attempts=1, first_wait_s=0, max_wait_s=0))
    _forget_filesystems()
    yield endpoint
    storage_retry.use(previous)


@pytest.fixture
def iam_key(s3, s3_endpoint):
    """`iam_key(actions)`: the access key of a new IAM user allowed `actions` on the `s3`
    bucket, with moto's server checking every request's credentials against IAM from then on
    (as S3 does) until the test ends."""
    import boto3
    import requests

    def make(actions: list[str]) -> dict:
        iam = boto3.client("iam", endpoint_url=s3_endpoint)
        user = f"user-{s3.name}"
        iam.create_user(UserName=user)
        if actions:
            iam.put_user_policy(UserName=user, PolicyName="policy", PolicyDocument=json.dumps({
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": actions,
                               "Resource": [f"arn:aws:s3:::{s3.name}",
                                            f"arn:aws:s3:::{s3.name}/*"]}],
            }))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        # moto's own switch: requests after the first 0 are authenticated and authorised
        requests.post(f"{s3_endpoint}/moto-api/reset-auth", data=b"0",
                      timeout=30).raise_for_status()
        return key

    try:
        yield make
    finally:
        requests.post(f"{s3_endpoint}/moto-api/reset-auth", data=b"inf", timeout=30)
        _forget_filesystems()


def use_keys(monkeypatch, key_id: str, secret: str) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    _forget_filesystems()


# --- endpoint unreachable ------------------------------------------------------------------------


def test_a_stopped_s3_server_is_named_unreachable_not_a_missing_bucket(stopped_endpoint,
                                                                      tmp_path, train_cli):
    """The issue's trial: a stopped server made flaxlm-train say the bucket does not exist."""
    url = "s3://bkt/runs/a"
    result = train_cli(*SHORT, f"output_url={url}", f"hydra.run.dir={tmp_path / 'run'}",
                       "storage_retries.attempts=1", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if line.startswith("flaxlm: error:")]
    assert_names(line, f"output_url: could not reach the store that holds '{url}'",
                 "EndpointConnectionError", f"AWS_ENDPOINT_URL_S3={stopped_endpoint}",
                 "check that the store is running")
    assert "names the bucket" not in line  # the paragraph of old
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before the run began


def test_a_bucket_check_on_a_stopped_server_says_unreachable(stopped_endpoint):
    """s3fs's exists() answers False for a bucket on any error: check_bucket asks S3 itself."""
    with pytest.raises(FlaxlmError) as error:
        check_bucket("s3://bkt/data/*.txt", "language.files")
    assert_names(error.value, "language.files: could not reach", "'s3://bkt'",
                 "AWS_ENDPOINT_URL_S3")


# --- credentials refused -------------------------------------------------------------------------


@pytest.mark.parametrize("wrong", ["key id", "secret"])
def test_a_key_the_store_refuses_is_named_so(wrong, s3, iam_key, monkeypatch):
    """A key id S3 does not know (InvalidAccessKeyId) or a wrong secret (SignatureDoesNotMatch):
    before, the write was refused, the bucket then looked missing, and the paragraph said so."""
    key = iam_key(["s3:*"])
    if wrong == "key id":
        use_keys(monkeypatch, "AKIA0000000000000000", key["SecretAccessKey"])
    else:
        use_keys(monkeypatch, key["AccessKeyId"], "not-the-secret")
    url = f"{s3.url}/runs/a"
    with pytest.raises(FlaxlmError) as error:
        probe_write(url, "output_url")
    assert_names(error.value, f"output_url: the store refused the credentials used for '{url}'",
                 "InvalidAccessKeyId" if wrong == "key id" else "SignatureDoesNotMatch",
                 "give a valid key", "AWS_ACCESS_KEY_ID")
    assert "names the bucket" not in str(error.value)  # the paragraph of old


# --- bucket missing, permission denied -----------------------------------------------------------


def test_a_missing_bucket_is_named_missing(s3_env):
    with pytest.raises(FlaxlmError) as error:
        probe_write("s3://no-such-bucket-b55/runs/a", "output_url")
    assert_names(error.value, "output_url", "'s3://no-such-bucket-b55'", "does not exist",
                 "aws s3 ls")


def test_a_read_only_policy_is_named_a_denied_write(s3, iam_key, monkeypatch):
    key = iam_key(READ_ONLY)
    use_keys(monkeypatch, key["AccessKeyId"], key["SecretAccessKey"])
    url = f"{s3.url}/runs/a"
    with pytest.raises(FlaxlmError) as error:
        probe_write(url, "output_url")
    assert_names(error.value, f"output_url: access to '{url}' was denied", "AccessDenied",
                 f"may not write to {s3.url}", "grant them write access")


# --- throttled, and the classifier itself --------------------------------------------------------


def client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "Please reduce your request rate."},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


@pytest.mark.parametrize(("code", "status"), [("SlowDown", 503), ("503", 503),
                                              ("TooManyRequests", 429)])
def test_a_throttling_store_is_named_throttled(code, status):
    """As s3fs raises it: a plain OSError whose cause is botocore's ClientError."""
    from s3fs.errors import translate_boto_error

    err = translate_boto_error(client_error(code, status))
    assert classify(err) is Fault.THROTTLED
    message = str(storage_error(err, "s3://bkt/runs/a", "output_url", action="write"))
    assert_names(message, "output_url: the store is throttling requests to 's3://bkt/runs/a'",
                 "start again in a minute")


@pytest.mark.parametrize(("code", "status", "fault"), [
    ("InvalidAccessKeyId", 403, Fault.CREDENTIALS_REFUSED),
    ("SignatureDoesNotMatch", 403, Fault.CREDENTIALS_REFUSED),
    ("AccessDenied", 403, Fault.DENIED),
    ("403", 403, Fault.DENIED),  # a HEAD request's answer: no body, the status as the code
    ("NoSuchBucket", 404, Fault.NO_BUCKET),
    ("InternalError", 500, None),
    ("RequestTimeout", 400, None),  # s3fs raises TimeoutError for it: the store did answer
])
def test_the_code_decides_the_fault_whatever_s3fs_made_of_it(code, status, fault):
    from s3fs.errors import translate_boto_error

    assert classify(translate_boto_error(client_error(code, status))) is fault


def test_a_connection_failure_deep_in_the_chain_is_unreachable():
    try:
        try:
            raise ConnectionRefusedError(111, "Connect call failed")
        except ConnectionRefusedError as refused:
            raise RuntimeError("the client's wrapper") from refused
    except RuntimeError as err:
        assert classify(err) is Fault.UNREACHABLE
    assert classify(socket.gaierror(-2, "Name or service not known")) is Fault.UNREACHABLE
    assert classify(ValueError("something else")) is None


@pytest.mark.parametrize(("status", "fault"), [(401, Fault.CREDENTIALS_REFUSED),
                                               (429, Fault.THROTTLED), (503, Fault.THROTTLED),
                                               (500, None)])
def test_gcsfs_http_errors_are_classified_by_their_status(status, fault):
    from gcsfs.retry import HttpError

    assert classify(HttpError({"code": status, "message": "from GCS"})) is fault


def test_a_stopped_gcs_endpoint_is_named_unreachable(gcs_env, monkeypatch):
    """gs:// with its endpoint down (STORAGE_EMULATOR_HOST at a port nothing listens on): the
    probe at the start names the store unreachable and the variable that points at it, after
    one try (gcsfs's own six, 30 s of waits, are off)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    _forget_filesystems()
    previous = storage_retry.use(RetryPolicy(attempts=1, first_wait_s=0, max_wait_s=0))
    try:
        with pytest.raises(FlaxlmError) as error:
            probe_write("gs://bkt/runs/a", "output_url")
    finally:
        storage_retry.use(previous)
        _forget_filesystems()
    assert_names(error.value, "output_url: could not reach the store that holds "
                 "'gs://bkt/runs/a'", f"STORAGE_EMULATOR_HOST=http://127.0.0.1:{port}",
                 "check that the store is running")
    assert "names the bucket" not in str(error.value)
