"""Checkpoints in an s3:// bucket, through the same orbax and tensorstore as gs:// ones.

orbax 0.12 reaches tensorstore's object-store drivers for gs:// URLs only: every array's
kvstore spec is built by `tensorstore_utils.build_kvstore_tspec`, which normalises the
directory with `os.path.normpath` (s3://bucket/key becomes s3:/bucket/key), finds it not
absolute and refuses it; its gs:// branch is the one for object stores (tensorstore's own
driver, object-sized OCDBT data files). tensorstore itself has an `s3` kvstore driver (its
docs: https://google.github.io/tensorstore/kvstore/s3/index.html). So an s3:// directory is
given to orbax's builder as the gs:// URL of the same bucket and key, and each `gcs` kvstore
in the spec it returns is turned into the `s3` one: the rest of the spec (OCDBT, its options)
is what orbax builds for a bucket. Everything else orbax does with the path (metadata files,
listing, the commit file, deleting) goes through etils.epath, which already serves s3:// by
s3fs.

Where a step counts as complete there is orbax's choice for gs://, made explicit
(`ATOMICITY` in the Checkpointer's options): an object store has no rename, so `<step>/` is
written in place and `commit_success.txt` last.

The endpoint: tensorstore's `s3` driver reads the AWS credentials' variables but not the
endpoint ones, and without an endpoint it asks AWS itself where the bucket is. The spec gets
the endpoint AWS's tools read (AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL: another
S3-compatible store, an emulator) and the region (AWS_REGION, else AWS_DEFAULT_REGION) when
they are set, as s3fs and the aws CLI take them; credentials are AWS's default chain
(variables, profile files, the instance's role).

Retries: tensorstore retries a failed request itself (32 tries by default); every s3 and gcs
kvstore in orbax's specs is given the process's storage_retries instead
(`flaxlm.storage_retry`), the one policy of flaxlm's bucket calls; orbax's metadata and commit
files, which it writes through etils.epath, are retried by the same policy (`epath_files`).
"""

from __future__ import annotations

import functools
import os

import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import tensorstore_utils

from flaxlm import storage_retry
from flaxlm.training.checkpoint import epath_files

# A step in a bucket is complete once its commit_success.txt is written (orbax's gs:// rule).
ATOMICITY = ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)


def is_s3(path) -> bool:
    return str(path).startswith(("s3://", "s3a://"))


def kvstore_endpoint() -> dict:
    """The `s3` kvstore's endpoint, region and credentials from AWS's own variables, those
    set."""
    spec: dict = {}
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        # What AWS's default chain takes first anyway; named, the chain's other providers
        # (profile files, web identity) are not tried, each of which logs an error line from
        # C++ on every bucket tensorstore opens when it finds nothing.
        spec["aws_credentials"] = {"type": "environment"}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    return spec


def request_retries() -> dict:
    """tensorstore's retries of a bucket request (its `s3_request_retries` and
    `gcs_request_retries`) as the process's storage_retries says: the same tries, first wait
    and longest wait as every other bucket call of flaxlm (tensorstore's own default: 32
    tries)."""
    policy = storage_retry.current()
    return {"max_retries": policy.attempts - 1, "initial_delay": f"{policy.first_wait_s:.6f}s",
            "max_delay": f"{policy.max_wait_s:.6f}s"}


def _with_gcs_retries(spec):
    """`spec` with `request_retries()` in each gcs kvstore in it, at any depth."""
    if isinstance(spec, dict):
        if spec.get("driver") == "gcs":
            return {**spec, "gcs_request_retries": request_retries()}
        return {key: _with_gcs_retries(value) for key, value in spec.items()}
    if isinstance(spec, list):
        return [_with_gcs_retries(item) for item in spec]
    return spec


def _as_s3(spec):
    """`spec` with each gcs (or gcs_grpc) kvstore in it, at any depth, made the s3 one of the
    same bucket and key."""
    if isinstance(spec, dict):
        if spec.get("driver") in ("gcs", "gcs_grpc"):
            return {"driver": "s3", "bucket": spec["bucket"], "path": spec.get("path", ""),
                    **kvstore_endpoint(), "s3_request_retries": request_retries()}
        return {key: _as_s3(value) for key, value in spec.items()}
    if isinstance(spec, list):
        return [_as_s3(item) for item in spec]
    if isinstance(spec, str) and spec.startswith("gs://"):  # a kvstore given as a URL
        raise ValueError(f"flaxlm's s3 checkpoints met a gs:// URL in orbax's spec: {spec}")
    return spec


@functools.cache
def install() -> None:
    """Have orbax's kvstore specs for s3:// directories use tensorstore's s3 driver, and those
    of gs:// and s3:// ones retry as storage_retries says. orbax calls the builder through its
    module, so replacing it there reaches every caller (array writes and reads, OCDBT's
    merge). orbax's own small files go through flaxlm's retried filesystem
    (`epath_files`)."""
    epath_files.install()
    build = tensorstore_utils.build_kvstore_tspec

    @functools.wraps(build)
    def build_kvstore_tspec(directory, name=None, **kwargs):
        if not is_s3(directory):
            return _with_gcs_retries(build(directory, name, **kwargs))
        key = str(directory).partition("://")[2]
        return _as_s3(build(f"gs://{key}", name, **kwargs))

    tensorstore_utils.build_kvstore_tspec = build_kvstore_tspec
