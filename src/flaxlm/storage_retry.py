"""Transient object-store faults retried: one policy (the config's `storage_retries`), bounded
exponential backoff with jitter, for every call flaxlm makes to a bucket through fsspec.

Object stores fail in ordinary ways every day: a connection reset, a timeout, throttling (429,
S3's SlowDown) or a 5xx from a regional blip. A call that failed that way is made again after a
wait that doubles from `first_wait_s` up to `max_wait_s`, at most `attempts` times in all; each
wait is drawn from the upper half of its bound ("equal jitter"), so that the hosts of a pod
throttled together do not come back together, and yet every wait is at least half its bound.
A fault that retrying cannot mend (access denied, no such bucket or key, no credentials, a bad
argument) is raised at once. When the attempts run out, the last fault is raised as it came,
and the caller names it in its own words (`flaxlm.storage.storage_error`).

The policy is process-wide: `flaxlm-train` sets it from its config (`use`) before it touches a
bucket; the tools without a config (report, generate, export, eval) keep `DEFAULT`, which is
conf/train.yaml's value (tests/test_storage_retry.py holds the two equal).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from flaxlm import store_answers
from flaxlm.errors import FlaxlmError

T = TypeVar("T")

SETTING = "storage_retries"


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """At most `attempts` tries of a call (1: no retry); the wait before retry n (0-based)
    lies in [b/2, b] with b = min(max_wait_s, first_wait_s * 2**n)."""

    attempts: int
    first_wait_s: float
    max_wait_s: float

    def __post_init__(self):
        if (isinstance(self.attempts, bool) or not isinstance(self.attempts, int)
                or self.attempts < 1):
            raise FlaxlmError(
                f"{SETTING}.attempts={self.attempts!r} must be a whole number of at least 1 "
                f"(the tries of a bucket call in all; 1: no retry). Fix: "
                f"{SETTING}.attempts=10, the default."
            )
        if not 0 <= self.first_wait_s <= self.max_wait_s < math.inf:
            raise FlaxlmError(
                f"{SETTING}.first_wait_s={self.first_wait_s!r} and "
                f"{SETTING}.max_wait_s={self.max_wait_s!r}: the waits between a bucket call's "
                "tries start at first_wait_s and double up to max_wait_s, so they need "
                "0 <= first_wait_s <= max_wait_s, a number of seconds. Fix: e.g. "
                f"{SETTING}.first_wait_s=0.5 {SETTING}.max_wait_s=30, the defaults."
            )

    def wait_s(self, retry: int, fraction: float) -> float:
        """The wait before retry `retry` (0 for the first), `fraction` in [0, 1] its jitter."""
        try:
            grown = math.ldexp(self.first_wait_s, retry)  # first_wait_s * 2**retry
        except OverflowError:
            grown = math.inf
        bound = min(self.max_wait_s, grown)
        return bound / 2 + bound / 2 * fraction

    def longest_s(self) -> float:
        """The most a call can spend waiting between its tries."""
        return sum(self.wait_s(retry, 1.0) for retry in range(self.attempts - 1))


# conf/train.yaml's storage_retries: ten tries over one to two minutes of waits (0.5 s
# doubling to 30 s), which rides out throttling and a regional blip; an outage longer than
# that is an outage, and the caller says so.
DEFAULT = RetryPolicy(attempts=10, first_wait_s=0.5, max_wait_s=30.0)

_policy = DEFAULT


def use(policy: RetryPolicy) -> RetryPolicy:
    """Make `policy` the process's one for bucket calls; returns the one it replaces."""
    global _policy
    previous, _policy = _policy, policy
    return previous


def current() -> RetryPolicy:
    return _policy


# Exception classes (by name, anywhere in the class's MRO: botocore, aiohttp and urllib3 need
# not be installed) raised for a connection refused, reset or cut, or a response that never
# came or came cut short.
_TRANSIENT_CLASSES = frozenset({
    "ConnectionError", "TimeoutError",  # builtins: refused, reset, broken pipe; socket timeouts
    "HTTPClientError", "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
    "ConnectTimeoutError", "ResponseParserError", "IncompleteRead",  # botocore, http.client
    "FSTimeoutError",  # fsspec
    "ClientConnectionError", "ClientPayloadError", "ServerDisconnectedError",
    "ServerTimeoutError",  # aiohttp (gcsfs)
    "ProtocolError",  # urllib3: connection aborted mid-response
})
# What retrying cannot mend: denied, missing, no credentials, a bad argument. Checked first,
# so that a FileNotFoundError whose cause happens to be a timeout is not retried.
_PERMANENT_CLASSES = (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError,
                      NotADirectoryError, ValueError, TypeError, KeyError)
_PERMANENT_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError",
                              "DefaultCredentialsError", "RefreshError"})


def is_transient(err: BaseException) -> bool:
    """Whether `err`, raised by an fsspec call to a bucket, is a fault worth retrying. s3fs
    turns botocore's ClientError into an OSError (EBUSY for SlowDown, TimeoutError for
    RequestTimeout) with the ClientError as its cause: the chain of causes is read. What each
    code or status means is `flaxlm.store_answers`' table, the one the messages read."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        names = {cls.__name__ for cls in type(err).__mro__}
        if isinstance(err, _PERMANENT_CLASSES) or names & _PERMANENT_NAMES:
            return False
        if names & _TRANSIENT_CLASSES:
            return True
        code, status = store_answers.code_and_status(err)
        if store_answers.is_transient(code, status):
            return True
        if status is not None:  # a 4xx answer: the request itself was refused
            return False
        err = err.__cause__
    return False


# The time (time.monotonic) past which this thread's calls make no more tries: `deadline`.
_deadline = threading.local()


@contextlib.contextmanager
def deadline(ends: Callable[[], float | None]) -> Iterator[None]:
    """Within it, on this thread, a call whose next try would begin after `ends()` (a
    time.monotonic value, read before each wait; None: no bound) raises its fault instead of
    waiting for it: what a wait with a bound of its own (a background copy flushed at the
    run's end, a preemption's grace period) uses, so that the tries it waits for end within
    that bound rather than run on behind it for the policy's minutes."""
    previous = getattr(_deadline, "ends", None)
    _deadline.ends = ends
    try:
        yield
    finally:
        _deadline.ends = previous


def _past_deadline(wait: float) -> bool:
    ends = getattr(_deadline, "ends", None)
    limit = ends() if ends is not None else None
    return limit is not None and time.monotonic() + wait > limit


def call(operation: Callable[[], T], what: str, policy: RetryPolicy | None = None, *,
         sleep: Callable[[float], None] = time.sleep,
         fraction: Callable[[], float] = random.random) -> T:
    """`operation()`, tried again after each transient fault as `policy` (the process's, by
    default) allows, and within this thread's `deadline`; `what` names it in the line each
    retry prints. The last fault, or the first one that is not transient, is raised as it
    came."""
    policy = policy or _policy
    for retry in range(policy.attempts):
        try:
            return operation()
        except Exception as err:
            if retry + 1 >= policy.attempts or not is_transient(err):
                raise
            wait = policy.wait_s(retry, fraction())
            if _past_deadline(wait):
                print(f"flaxlm: {what} failed ({type(err).__name__}: {err}); not tried again: "
                      f"the wait for it ends before try {retry + 2} could begin",
                      file=sys.stderr, flush=True)
                raise
            print(f"flaxlm: {what} failed ({type(err).__name__}: {err}); trying again in "
                  f"{wait:.1f} s (try {retry + 2} of {policy.attempts}, {SETTING})",
                  file=sys.stderr, flush=True)
            sleep(wait)
    raise AssertionError("unreachable: the last attempt returns or raises")


# fsspec methods that delete: one retried after a transient fault may find the object already
# gone (the first try deleted it, and only its answer was lost), which is what it was for.
_DELETIONS = frozenset({"rm", "rm_file"})


class RetryingFilesystem:
    """An fsspec filesystem whose every public method is retried by `call`: what
    `flaxlm.storage` calls on a bucket (each one idempotent: whole objects put, read, listed,
    copied or deleted)."""

    def __init__(self, fs):
        self._fs = fs

    def __getattr__(self, name: str):
        attribute = getattr(self._fs, name)
        if name.startswith("_") or not callable(attribute):
            return attribute

        def retried(*args, **kwargs):
            failed_before = False

            def attempt():
                nonlocal failed_before
                try:
                    return attribute(*args, **kwargs)
                except FileNotFoundError:
                    if failed_before and name in _DELETIONS:
                        return None
                    raise
                except Exception:
                    failed_before = True
                    raise

            target = f" {args[0]}" if args and isinstance(args[0], str) else ""
            return call(attempt, f"{name}{target}")

        return retried


def retrying(fs) -> RetryingFilesystem:
    return fs if isinstance(fs, RetryingFilesystem) else RetryingFilesystem(fs)
