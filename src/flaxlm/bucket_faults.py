"""What went wrong when an object store's client failed, read from what the client raised: its
error code (botocore's ClientError, gcsfs's HttpError) or the kind of connection failure, found
anywhere along the exception's chain. s3fs turns S3's codes into plain Python exceptions
(PermissionError for a refused key and for a denied write alike) but keeps the client's
exception as `__cause__`, which is where the code is read; aiohttp's connection errors keep the
socket's below them. The text of a message is read only where no client gives a code (gcsfs's
"Forbidden" for HTTP 403).

A fault that is not one of these (an internal error, a malformed request) is None: the caller
says what the client said.
"""

from __future__ import annotations

import enum
import socket
import sys


class Fault(enum.Enum):
    UNREACHABLE = "endpoint unreachable"
    CREDENTIALS_REFUSED = "credentials refused"
    NO_BUCKET = "bucket missing"
    DENIED = "permission denied"
    THROTTLED = "throttled"


# S3's error codes (and those of the S3-compatible stores and AWS's token services) by fault.
_CODES = {
    Fault.CREDENTIALS_REFUSED: {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                                "InvalidToken", "TokenRefreshRequired", "InvalidClientTokenId",
                                "AuthFailure", "UnrecognizedClientException"},
    Fault.NO_BUCKET: {"NoSuchBucket"},
    Fault.DENIED: {"AccessDenied", "AllAccessDisabled", "AccountProblem", "Forbidden"},
    Fault.THROTTLED: {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                      "TooManyRequests", "TooManyRequestsException", "ServiceUnavailable",
                      "RequestThrottled", "ProvisionedThroughputExceededException"},
}
# An HTTP status with no more telling code (a HEAD request's answer has no body; gcsfs's
# HttpError carries only the status).
_STATUSES = {401: Fault.CREDENTIALS_REFUSED, 403: Fault.DENIED, 429: Fault.THROTTLED,
             503: Fault.THROTTLED}


def classify(err: BaseException) -> Fault | None:
    """The fault `err` (or an exception it was raised from or during) reports, or None. A code
    anywhere in the chain decides first: s3fs's PermissionError above an InvalidAccessKeyId is a
    refused key, not a denied write."""
    chain = _chain(err)
    for link in chain:
        code, status = _code_and_status(link)
        for fault, codes in _CODES.items():
            if code in codes:
                return fault
        if status in _STATUSES:
            return _STATUSES[status]
        if code or status:  # the store answered, with something else (s3fs raises
            return None     # TimeoutError for RequestTimeout: a slow upload, not no answer)
    if any(_is_connection_failure(link) for link in chain):
        return Fault.UNREACHABLE
    if any(isinstance(link, PermissionError) or str(link).startswith("Forbidden")
           for link in chain):
        return Fault.DENIED
    return None


def _chain(err: BaseException) -> list[BaseException]:
    links: list[BaseException] = []
    while err is not None and all(err is not seen for seen in links):
        links.append(err)
        err = err.__cause__ or err.__context__
    return links


def _code_and_status(err: BaseException) -> tuple[str | None, int | None]:
    """botocore's ClientError: the code and HTTP status of S3's answer; gcsfs's HttpError: the
    status alone. Each client's exception class is looked up only if its module is loaded
    (an exception of it cannot exist otherwise), so classifying imports nothing."""
    botocore = sys.modules.get("botocore.exceptions")
    if botocore is not None and isinstance(err, botocore.ClientError):
        response = err.response or {}
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = response.get("Error", {}).get("Code")
        if code is not None and str(code).isdigit():  # HEAD: the status as the code
            status, code = status or int(code), None
        return code, status
    gcsfs = sys.modules.get("gcsfs.retry")
    if gcsfs is not None and isinstance(err, gcsfs.HttpError):
        return None, err.code if isinstance(err.code, int) else None
    return None, None


def _is_connection_failure(err: BaseException) -> bool:
    """A refused or reset connection, a name that does not resolve, a connection or read that
    timed out: the store was not reached, whatever the bucket."""
    if isinstance(err, (ConnectionError, socket.gaierror, TimeoutError)):
        return True
    botocore = sys.modules.get("botocore.exceptions")
    return botocore is not None and isinstance(
        err, (botocore.EndpointConnectionError, botocore.ConnectTimeoutError,
              botocore.ReadTimeoutError, botocore.ConnectionClosedError))
