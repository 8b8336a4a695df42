"""Buckets for the tests: S3 and GCS emulators that the tests start themselves on localhost,
once per session (per pytest-xdist worker), and fixtures that give each test a new bucket.

S3: moto's server (`moto[server]`), which s3fs and tensorstore's `s3` driver both talk to.
GCS: gcp-storage-emulator, a pure-Python server (no Docker, no Go binary: CI installs it with
pip), which gcsfs reaches through STORAGE_EMULATOR_HOST and tensorstore's `gcs` driver through
TENSORSTORE_GCS_HTTP_URL. Every client is pointed at them by the variables the libraries
themselves read, as a user's machine would be: flaxlm's code has no test endpoints in it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import uuid

import pytest

# gcsfs asks the Storage Control API (gRPC) whether a bucket is hierarchical before it lists it,
# which an emulator does not serve: the question waited 60 s twice per bucket. The variable is
# read when gcsfs is imported, hence here, before any test imports it.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@dataclasses.dataclass
class Bucket:
    """A new, empty bucket: `url` is its scheme and name (s3://name), `fs` its filesystem."""

    url: str
    fs: object

    def put(self, key: str, data: str | bytes) -> str:
        """Write the object `key` and return its URL."""
        self.fs.pipe(f"{self.name}/{key}", data.encode() if isinstance(data, str) else data)
        return f"{self.url}/{key}"

    @property
    def name(self) -> str:
        return self.url.partition("://")[2]


@pytest.fixture(scope="session")
def s3_endpoint() -> str:
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request on stderr, where it buries a failing test's own output
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def s3_variables(endpoint: str) -> dict[str, str]:
    """AWS's own variables pointed at the emulator, with credentials it accepts; no config
    files or instance metadata looked up (the latter waits on a network timeout)."""
    return {"AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch) -> dict[str, str]:
    """`s3_variables` set in this process."""
    env = s3_variables(s3_endpoint)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    _forget_filesystems()
    yield env
    _forget_filesystems()


@pytest.fixture
def s3(s3_env) -> Bucket:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    name = f"test-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    return Bucket(f"s3://{name}", fs)


@pytest.fixture(scope="session")
def gcs_endpoint() -> str:
    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
    _send_generation_headers()
    server = create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    # The emulator does not say which port port 0 became; its HTTP server knows.
    port = server._api._httpd.server_address[1]
    _quiet_closed_connections(server._api._httpd)
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _quiet_closed_connections(httpd) -> None:
    """The HTTP server prints a traceback on stderr for each client that hung up before its
    answer was written (a killed test run, a client's timeout), at any moment: in a later
    test's captured stderr, where no traceback may appear. Those alone are not printed."""
    handle_error = httpd.handle_error

    def quiet_handle_error(request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            handle_error(request, client_address)

    httpd.handle_error = quiet_handle_error


def _send_generation_headers() -> None:
    """Real GCS answers every media download with the object's generation in the
    x-goog-generation header; the emulator sends none, and tensorstore, which reads an OCDBT
    checkpoint's manifest that way (orbax's format), then fails on a "Malformed
    StorageGeneration" (now and then: when its cache misses). The emulator's download handler,
    wherever its routes name it (and the object GET that calls it for alt=media), also sends
    the header."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    download = objects.download
    if getattr(download, "sends_generation", False):
        return

    def download_with_generation(request, response, storage, *args, **kwargs):
        download(request, response, storage, *args, **kwargs)
        try:
            obj = storage.get_file_obj(request.params["bucket_name"],
                                       request.params["object_id"])
        except Exception:  # noqa: BLE001 — not found: the handler answered 404 already
            return
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])

    download_with_generation.sends_generation = True
    objects.download = download_with_generation  # what objects.get calls for alt=media
    for _, methods in server.HANDLERS:
        for method, handler in methods.items():
            if handler is download:
                methods[method] = download_with_generation


@pytest.fixture
def gcs_env(gcs_endpoint, monkeypatch) -> dict[str, str]:
    """The emulator's variables for gcsfs (and google-cloud-storage) and for tensorstore, with a
    fixed token so that no client looks for Google credentials (the metadata server's probe
    hung for minutes in this sandbox)."""
    env = {"STORAGE_EMULATOR_HOST": gcs_endpoint, "TENSORSTORE_GCS_HTTP_URL": gcs_endpoint,
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test", "NO_GCE_CHECK": "true",
           "FSSPEC_GCS_TOKEN": "anon"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _forget_filesystems()
    yield env
    _forget_filesystems()


@pytest.fixture
def gcs(gcs_env) -> Bucket:
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)
    name = f"test-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    return Bucket(f"gs://{name}", fs)


def _forget_filesystems() -> None:
    """fsspec keeps one filesystem per set of arguments, made with the environment of its
    time, and reads FSSPEC_* variables once, at import: after the environment changes, they
    are made again."""
    import fsspec
    import fsspec.config

    fsspec.config.conf.clear()
    fsspec.config.set_conf_env(fsspec.config.conf)
    for protocol in ("s3", "gs"):
        try:
            fsspec.get_filesystem_class(protocol).clear_instance_cache()
        except ImportError:
            pass
    # etils.epath (orbax's files) keeps one filesystem per scheme of its own, too.
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()
