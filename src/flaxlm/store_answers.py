"""What an object store answered when a call failed, and what each answer means: the one table
of S3's (and S3-compatible stores') error codes and of HTTP statuses that both of flaxlm's
readers of store faults use, `flaxlm.bucket_faults` (what to call the fault in a message) and
`flaxlm.storage_retry` (whether trying again can help). A new code is added here once, and
the name and the retry stay in step.

Nothing is imported to read an answer: a client's exception is read by the attributes it
carries (botocore's ClientError its `response`, gcsfs's HttpError its `code`).
"""

from __future__ import annotations

import enum


class Fault(enum.Enum):
    UNREACHABLE = "endpoint unreachable"
    CREDENTIALS_REFUSED = "credentials refused"
    NO_BUCKET = "bucket missing"
    DENIED = "permission denied"
    THROTTLED = "throttled"


_REFUSED = (Fault.CREDENTIALS_REFUSED, False)
_DENIED = (Fault.DENIED, False)
_THROTTLED = (Fault.THROTTLED, True)
_SERVER_SIDE = (None, True)  # worth another try, and not one of the faults a user acts on

# An S3 error code → (the fault it names or None, whether trying again can help).
CODES: dict[str, tuple[Fault | None, bool]] = {
    **dict.fromkeys(("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                     "InvalidToken", "TokenRefreshRequired", "InvalidClientTokenId",
                     "AuthFailure", "UnrecognizedClientException"), _REFUSED),
    "NoSuchBucket": (Fault.NO_BUCKET, False),
    **dict.fromkeys(("AccessDenied", "AllAccessDisabled", "AccountProblem", "Forbidden"),
                    _DENIED),
    **dict.fromkeys(("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                     "TooManyRequests", "TooManyRequestsException", "ServiceUnavailable",
                     "RequestThrottled", "ProvisionedThroughputExceededException"), _THROTTLED),
    # s3fs raises TimeoutError for RequestTimeout: a slow upload, the store did answer.
    **dict.fromkeys(("RequestTimeout", "InternalError", "ThrottledException",
                     "BandwidthLimitExceeded", "RequestThrottledException"), _SERVER_SIDE),
}
# An HTTP status with no more telling code (a HEAD request's answer has no body; gcsfs's
# HttpError carries only the status) → the fault it names. Any 429 or 5xx is worth retrying.
STATUSES: dict[int, Fault] = {401: Fault.CREDENTIALS_REFUSED, 403: Fault.DENIED,
                              429: Fault.THROTTLED, 503: Fault.THROTTLED}


def code_and_status(err: BaseException) -> tuple[str | None, int | None]:
    """The error code and HTTP status of the store's answer that `err` reports (botocore's
    ClientError: both; gcsfs's HttpError: the status alone); (None, None) for anything else.
    A HEAD request's answer has no body: botocore gives its status as the code."""
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = response.get("Error", {}).get("Code")
        status = int(status) if status else None
        code = str(code) if code else None
        if code is not None and code.isdigit():
            status, code = status or int(code), None
        return code, status
    code = getattr(err, "code", None)
    if type(err).__name__ == "HttpError" and isinstance(code, int):
        return None, code
    return None, None


def fault_of(code: str | None, status: int | None) -> Fault | None:
    """The fault an answer names: its code's, else its status's."""
    named = CODES.get(code, (None, False))[0] if code else None
    return named or STATUSES.get(status)


def is_transient(code: str | None, status: int | None) -> bool:
    """Whether trying again can mend the fault an answer reports: a code that says so, or a
    429 or a 5xx, whatever its code."""
    return (CODES.get(code, (None, False))[1] if code else False) or status == 429 or (
        status or 0) >= 500
