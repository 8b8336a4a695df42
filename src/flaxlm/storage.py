"""Paths that may be object-store URLs (s3://, gs://, any fsspec URL): which ones are, the
filesystem that reads them, and what object stores say when something is wrong, as one
paragraph naming the URL and the fix.

Credentials and endpoints are never settings of flaxlm: each library finds its own (AWS's
variables and ~/.aws files for s3fs, Application Default Credentials for gcsfs, and the
endpoint variables AWS_ENDPOINT_URL_S3 / STORAGE_EMULATOR_HOST that also point them at an
emulator), so a machine set up for `aws s3` or `gcloud storage` reads its buckets here too.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import socket
import tempfile

from flaxlm.bucket_faults import Fault, classify
from flaxlm.errors import FlaxlmError
from flaxlm.storage_retry import retrying

# The fsspec packages of the common stores, all installed by flaxlm's `cloud` extra.
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}

# Clients whose own retries are switched off, so that storage_retries is the one policy of
# flaxlm's bucket calls: botocore's (5 tries with waits up to 8 s in its default "legacy" mode,
# or AWS_MAX_ATTEMPTS) and s3fs's around it would otherwise multiply flaxlm's tries; gcsfs's
# (`_gcsfs_one_try`) too.
_S3_ONE_TRY = {"config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}}}
_CLIENT_RETRIES_OFF = {"s3": _S3_ONE_TRY, "s3a": _S3_ONE_TRY}

# Fields of fsspec's `info()` that change when an object is rewritten: S3's ETag and time,
# GCS's generation and hashes, a file's mtime. Any present, with the size, identify a version.
_VERSION_FIELDS = ("ETag", "etag", "VersionId", "generation", "md5Hash", "crc32c",
                   "LastModified", "updated", "mtime", "size")


def is_url(path: str) -> bool:
    """A URL with a scheme (s3://bucket/key), as against a local path ('~/data/*.txt')."""
    scheme, sep, _ = str(path).partition("://")
    return bool(sep) and scheme.isidentifier() and scheme.lower() != "file"


def filesystem(url: str, setting: str):
    """The fsspec filesystem for `url`'s scheme, its calls retried on transient faults as the
    config's storage_retries says (`flaxlm.storage_retry`); a scheme without its package
    installed, or one fsspec does not know, is one paragraph naming the package or extra."""
    import fsspec

    scheme = url.partition("://")[0].lower()
    try:
        if scheme in _CLIENT_RETRIES_OFF:
            fs = fsspec.filesystem(scheme, **_CLIENT_RETRIES_OFF[scheme])
            fs.retries = 1  # s3fs's own loop (SlowDown, timeouts) around botocore's
        else:
            if scheme in ("gs", "gcs"):
                _gcsfs_one_try()
            fs = fsspec.filesystem(scheme)
        return retrying(fs)
    except ImportError as err:
        package = _PACKAGES.get(scheme)
        fix = (f"pip install 'flaxlm[cloud]', which installs {package} (in a checkout: "
               ".venv/bin/pip install -e '.[cloud]')" if package else str(err).rstrip("."))
        raise FlaxlmError(
            f"{setting}: reading {url!r} needs the fsspec package for {scheme}://, which is not "
            f"installed. Fix: {fix}."
        ) from None
    except ValueError as err:  # "Protocol not known"
        raise FlaxlmError(
            f"{setting}: {url!r} has the scheme {scheme}://, which no fsspec filesystem serves "
            f"({err}). Use s3://, gs:// or a local path."
        ) from None


@functools.cache
def _gcsfs_one_try() -> None:
    """gcsfs tries each request six times itself, waiting 1-2, 2-3, 4-5, 8-9 and 16-17 s
    between (over 30 s), whatever storage_retries says, and takes no setting for it: its
    request methods are made again from the same functions with one try each (gcsfs makes
    them with `retry_request(retries=6)`, which keeps the function as `__wrapped__`). A
    gcsfs without those names is left as it is: its tries then come inside each of flaxlm's,
    as before."""
    try:
        from gcsfs import core, retry
    except ImportError:
        return
    for name in ("_request", "_get_file_request", "_get_file_concurrent"):
        method = getattr(core.GCSFileSystem, name, None)
        inner = getattr(method, "__wrapped__", None)
        if inner is not None and hasattr(retry, "retry_request"):
            setattr(core.GCSFileSystem, name, retry.retry_request(retries=1)(inner))


def glob_objects(pattern: str, setting: str) -> list[str]:
    """The objects `pattern` (a URL, with *, ** or ?) matches, as URLs, sorted. No match is an
    error that says whether the bucket itself is missing."""
    fs = filesystem(pattern, setting)
    scheme, _, rest = pattern.partition("://")
    # A run reads its data once; a listing cached by fsspec from earlier in the process could
    # hide an object rewritten since.
    fs.invalidate_cache()
    try:
        matches = [m for m, info in fs.glob(rest, detail=True).items()
                   if info.get("type") != "directory"]
    except FileNotFoundError:  # gcsfs, listing a bucket that does not exist; s3fs finds none
        matches = []
    except Exception as err:
        raise storage_error(err, pattern, setting) from None
    if matches:
        return sorted(f"{scheme}://{m}" for m in matches)
    check_bucket(pattern, setting)
    bucket = rest.split("/", 1)[0]
    raise FlaxlmError(
        f"{setting}: the pattern {pattern!r} matches no object in the bucket "
        f"'{scheme}://{bucket}'. Fix the key or glob (list the bucket with "
        f"`{_lister(scheme)} {scheme}://{bucket}/`); * stays within one folder, ** reaches "
        "into subfolders."
    )


def object_version(url: str, setting: str) -> str:
    """What identifies the version of the object at `url` (ETag or generation, size, time) as
    one string: equal strings, the same bytes."""
    fs = filesystem(url, setting)
    try:
        info = fs.info(url.partition("://")[2])
    except Exception as err:
        raise storage_error(err, url, setting) from None
    return json.dumps({k: str(info[k]) for k in _VERSION_FIELDS if k in info}, sort_keys=True)


def cached_copy(url: str, cache_dir: str | None, setting: str) -> str:
    """A local copy of the object or the folder at `url` (a checkpoint, a tokenizer), kept in
    `<cache_dir>/objects/<key>/<scheme>/<bucket>/<key path>`, where the key hashes the URL with
    the version of every object under it: a rewritten one is copied again. Downloaded into a
    scratch folder and renamed into place, so a killed copy never looks whole."""
    if cache_dir is None:
        raise FlaxlmError(f"{setting}: {url!r} is in a bucket, and copies of bucket files are "
                          "kept in flaxlm's cache: set cache_dir (or FLAXLM_CACHE).")
    url = url.rstrip("/")
    fs = filesystem(url, setting)
    scheme, _, rest = url.partition("://")
    fs.invalidate_cache()
    try:
        found = fs.find(rest, detail=True, withdirs=False)
    except FileNotFoundError:  # gcsfs, in a bucket that does not exist
        found = {}
    except Exception as err:
        raise storage_error(err, url, setting) from None
    if not found:
        check_bucket(url, setting)
        raise storage_error(FileNotFoundError(f"no object at or under {url}"), url, setting)
    versions = {key: {k: str(info[k]) for k in _VERSION_FIELDS if k in info}
                for key, info in found.items()}
    digest = hashlib.sha256(json.dumps([url, versions], sort_keys=True).encode()).hexdigest()
    root = os.path.join(os.path.expanduser(cache_dir), "objects")
    target = os.path.join(root, digest[:20], scheme, *rest.split("/"))
    if os.path.exists(target):
        return target
    os.makedirs(root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    try:
        single = list(found) == [rest]  # the URL names one object, not a folder
        copy = os.path.join(scratch, "copy")
        for key in found:
            local = copy if single else os.path.join(copy, *key[len(rest) + 1:].split("/"))
            os.makedirs(os.path.dirname(local), exist_ok=True)
            try:
                fs.get_file(key, local)
            except Exception as err:
                raise storage_error(err, f"{scheme}://{key}", setting) from None
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.replace(copy, target)
        except OSError:  # another process put the same copy there first
            if not os.path.exists(target):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def download(url: str, local_path: str, setting: str) -> None:
    """Copy the object at `url` to the local file `local_path`."""
    fs = filesystem(url, setting)
    try:
        fs.get_file(url.partition("://")[2], local_path)
    except Exception as err:
        raise storage_error(err, url, setting) from None


def list_names(url: str, setting: str) -> list[str]:
    """The names directly under the folder `url` (objects and prefixes), none if it has
    none. Read afresh: fsspec's cached listing could miss what another host wrote since."""
    fs = filesystem(url, setting)
    fs.invalidate_cache()
    try:
        entries = fs.ls(url.partition("://")[2].rstrip("/"), detail=False)
    except FileNotFoundError:
        return []
    except Exception as err:
        raise storage_error(err, url, setting) from None
    return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]


def upload(local_path: str, url: str, setting: str) -> None:
    """Copy the local file `local_path` to the object `url`, replacing it whole."""
    fs = filesystem(url, setting)
    try:
        fs.put_file(local_path, url.partition("://")[2])
    except Exception as err:
        raise storage_error(err, url, setting, action="write") from None


def upload_folder(local_dir: str, url: str, setting: str, marker: str) -> None:
    """Copy the files of the local folder `local_dir` (no subfolders) to the folder `url`,
    replacing what it held, so that it counts as complete exactly when its object `marker`
    exists: an object store has no rename, so the marker of what was there is deleted first,
    every other file is uploaded, objects the new folder lacks are deleted, and `marker` is
    uploaded last. A copy cut short leaves a folder without its marker, which readers refuse
    and the next copy replaces."""
    fs = filesystem(url, setting)
    root = url.partition("://")[2].rstrip("/")
    names = sorted(name for name in os.listdir(local_dir)
                   if os.path.isfile(os.path.join(local_dir, name)))
    try:
        fs.invalidate_cache()
        if fs.exists(f"{root}/{marker}"):
            fs.rm_file(f"{root}/{marker}")
        for name in names:
            if name != marker:
                fs.put_file(os.path.join(local_dir, name), f"{root}/{name}")
        fs.invalidate_cache()
        stale = [key for key in fs.find(root) if key[len(root) + 1:] not in names]
        for key in stale:
            fs.rm_file(key)
        if marker in names:
            fs.put_file(os.path.join(local_dir, marker), f"{root}/{marker}")
    except Exception as err:
        raise storage_error(err, url, setting, action="write") from None
    forget_listings(url)


def download_folder(url: str, local_dir: str, setting: str) -> None:
    """Copy every object under the folder `url` into the local folder `local_dir` (made if
    missing), keeping their relative paths."""
    fs = filesystem(url, setting)
    root = url.partition("://")[2].rstrip("/")
    try:
        fs.invalidate_cache()
        keys = fs.find(root)
        if not keys:
            raise FileNotFoundError(f"no object under {url}")
        for key in keys:
            target = os.path.join(local_dir, *key[len(root) + 1:].split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fs.get_file(key, target)
    except Exception as err:
        raise storage_error(err, url, setting) from None


def exists(url: str, setting: str) -> bool:
    fs = filesystem(url, setting)
    try:
        return fs.exists(url.partition("://")[2])
    except Exception as err:
        raise storage_error(err, url, setting) from None


def move_objects(source: str, target: str, setting: str) -> None:
    """Move the object `source`, or every object under the folder `source`, to the same key
    under `target`. An object store
    copies and deletes, object by object: not atomic, which is why flaxlm moves only what it
    no longer trusts (a damaged checkpoint set aside). Every object is copied before any is
    deleted, so a move cut short loses nothing. (fsspec's own recursive `mv` ignores the
    errors of each object's copy, and gcsfs's uses GCS's moveTo, which not every bucket or
    emulator serves.)"""
    fs = filesystem(source, setting)
    source_key, target_key = source.partition("://")[2], target.partition("://")[2]
    try:
        fs.invalidate_cache()
        for key in fs.find(source_key):
            fs.copy(key, target_key + key[len(source_key):])
        fs.rm(source_key, recursive=True)
    except Exception as err:
        raise storage_error(err, source, setting, action="write") from None
    forget_listings(source)


def forget_listings(url: str) -> None:
    """Drop the folder listings cached by every fsspec filesystem of `url`'s scheme: orbax
    lists a bucket through etils' own instance, which would still show what was moved (here,
    or by another host)."""
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(url.partition("://")[0].lower())
    except (ImportError, ValueError):
        return
    for instance in list(getattr(cls, "_cache", {}).values()):
        instance.invalidate_cache()


# What the clients raise when they find no credentials (botocore; google-auth, under gcsfs).
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError",
                   "RefreshError")


def probe_write(url: str, setting: str) -> None:
    """Write and delete a small object under `url`, so that an endpoint that does not answer, a
    bucket that does not exist, a missing or refused credential, a denied write or a throttled
    store is found before a run trains, not at its first checkpoint, each named for what it
    is. Every host probes: each has its own credentials."""
    fs = filesystem(url, setting)
    fs.invalidate_cache()
    rest = url.partition("://")[2].rstrip("/")
    key = f"{rest}/.flaxlm-write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        fs.pipe_file(key, b"flaxlm checks that it may write here; delete me if left behind\n")
        fs.rm_file(key)
    except Exception as err:
        if classify(err) is None and not _denied(err):
            # A failure with no code that names it (gcsfs answers a write to a missing bucket
            # with a bare 404): ask whether the bucket is there. Not for an unreachable
            # endpoint, which s3fs's exists() answers with False, nor a denied write (the
            # bucket exists, though these credentials may not even see it).
            scheme, bucket = url.partition("://")[0], rest.split("/", 1)[0]
            try:
                bucket_exists = _bucket_exists(fs, bucket)
            except Exception:  # noqa: BLE001 — the write's own error says more
                bucket_exists = True
            if not bucket_exists:
                raise _no_bucket(url, f"{scheme}://{bucket}", setting) from None
        raise storage_error(err, url, setting, action="write") from None


def storage_error(err: BaseException, url: str, setting: str,
                  action: str = "read") -> FlaxlmError:
    """What an object store's client raised about `url`, as one paragraph with the fix;
    `action` ("read" or "write") is what was denied or failed."""
    scheme = url.partition("://")[0].lower()
    bucket = f"{scheme}://{url.partition('://')[2].split('/', 1)[0]}"
    cause = _cause(err)
    verb = "read" if action == "read" else "write to"
    if type(err).__name__ in _NO_CREDENTIALS:
        return FlaxlmError(f"{setting}: no credentials to {verb} {url!r} ({cause}). "
                           f"{_credentials_fix(scheme)}")
    fault = classify(err)
    if fault is Fault.UNREACHABLE:
        return FlaxlmError(
            f"{setting}: could not reach the store that holds {url!r} ({cause}): the "
            "connection was refused, timed out or its host name did not resolve, so nothing is "
            f"known yet of the bucket or the credentials. Fix: {_endpoint_fix(scheme)}, and "
            "check this machine's network; then start again."
        )
    if fault is Fault.CREDENTIALS_REFUSED:
        return FlaxlmError(
            f"{setting}: the store refused the credentials used for {url!r} ({cause}): it does "
            "not know the access key, the secret does not match it, or the token has expired. "
            f"Fix: give a valid key. {_credentials_fix(scheme)}"
        )
    if fault is Fault.NO_BUCKET:
        return _no_bucket(url, bucket, setting)
    if fault is Fault.THROTTLED:
        return FlaxlmError(
            f"{setting}: the store is throttling requests to {url!r} ({cause}): too many "
            "requests at once, or it is briefly unavailable; the URL and the credentials are "
            "not at fault. Fix: start again in a minute; if it persists, write from fewer hosts "
            "at once or ask the store's operator for a higher request rate."
        )
    if fault is Fault.DENIED or _denied(err):
        return FlaxlmError(
            f"{setting}: access to {url!r} was denied ({cause}). The credentials found may not "
            f"{verb} {bucket}: grant them {action} access, or use others. "
            f"{_credentials_fix(scheme)}"
        )
    if isinstance(err, FileNotFoundError) and action == "read":
        return FlaxlmError(f"{setting}: {url!r} does not exist ({cause}). Fix the URL, or list "
                           f"the bucket with `{_lister(scheme)} {bucket}/`.")
    return FlaxlmError(
        f"{setting}: could not {verb} {url!r} ({cause}). Check the URL, this machine's access to "
        f"the store (network, endpoint variables) and its credentials. "
        f"{_credentials_fix(scheme)}"
    )


def _cause(err: BaseException) -> str:
    """What the client raised, for the message: s3fs's translation of an S3 error keeps only
    the text, so the code it came from (InvalidAccessKeyId, SlowDown) is added."""
    text = f"{type(err).__name__}: {err}".strip()
    response = getattr(err.__cause__, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return f"{text} [{code}]" if code and code not in text else text


def _endpoint_fix(scheme: str) -> str:
    """Where this machine's client was told to find the store, for an unreachable one."""
    if scheme in ("s3", "s3a"):
        names = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        default = "AWS's own endpoint for the bucket's region"
    elif scheme in ("gs", "gcs"):
        names = ("STORAGE_EMULATOR_HOST",)
        default = "Google Cloud Storage's own endpoint"
    else:
        return "check that the store's endpoint is up and reachable from this machine"
    given = [f"{name}={os.environ[name]}" for name in names if os.environ.get(name)]
    where = given[0] if given else f"no {' or '.join(names)} set: {default}"
    return (f"check that the store is running and reachable at the endpoint this machine uses "
            f"({where}), or set {names[0]} to the one it should use")


def _bucket_exists(fs, bucket: str) -> bool:
    """Whether `bucket` exists, an error raised as the client raises it: s3fs's exists()
    answers False for a bucket on any error, a refused connection included, so S3 is asked
    with HeadBucket itself (404: missing)."""
    if hasattr(fs, "call_s3"):
        try:
            fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            return False
        return True
    return fs.exists(bucket)


def _denied(err: BaseException) -> bool:
    """Whether a store's client said access was denied: s3fs raises PermissionError for S3's
    AccessDenied; gcsfs an OSError("Forbidden: ...")."""
    return isinstance(err, PermissionError) or str(err).startswith(("Forbidden", "Unauthorized"))


def check_bucket(url: str, setting: str) -> None:
    """Raise the paragraph for a bucket that does not exist, if `url`'s does not."""
    fs = filesystem(url, setting)
    scheme, rest = url.partition("://")[0], url.partition("://")[2]
    bucket = rest.split("/", 1)[0]
    try:
        bucket_exists = _bucket_exists(fs, bucket)
    except Exception as err:
        raise storage_error(err, f"{scheme}://{bucket}", setting) from None
    if not bucket_exists:
        raise _no_bucket(url, f"{scheme}://{bucket}", setting)


def _no_bucket(url: str, bucket: str, setting: str) -> FlaxlmError:
    return FlaxlmError(
        f"{setting}: {url!r} names the bucket {bucket!r}, which does not exist (or is not "
        f"visible to these credentials). Fix the bucket's name in {setting}, or create it "
        f"(`{_lister(bucket.partition('://')[0])} {bucket}` lists it once it exists)."
    )


def _lister(scheme: str) -> str:
    """The command that lists a bucket of `scheme`, for the messages."""
    if scheme in ("s3", "s3a"):
        return "aws s3 ls"
    return "gcloud storage ls" if scheme in ("gs", "gcs") else "fsspec's ls"


def _credentials_fix(scheme: str) -> str:
    if scheme in ("s3", "s3a"):
        return ("Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or an "
                "instance role); for another S3-compatible store, AWS_ENDPOINT_URL_S3.")
    if scheme in ("gs", "gcs"):
        return ("Run `gcloud auth application-default login`, or set "
                "GOOGLE_APPLICATION_CREDENTIALS to a service account's key file (a TPU VM "
                "uses its service account).")
    return "Give the credentials as the fsspec package for this scheme expects them."
