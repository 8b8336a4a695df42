"""What went wrong when an object store's client failed, read from what the client raised: its
error code (botocore's ClientError, gcsfs's HttpError; the codes' table is
`flaxlm.store_answers`, which `flaxlm.storage_retry` reads too) or the kind of connection
failure, found anywhere along the exception's chain. s3fs turns S3's codes into plain Python
exceptions (PermissionError for a refused key and for a denied write alike) but keeps the
client's exception as `__cause__`, which is where the code is read; aiohttp's connection errors
keep the socket's below them. The text of a message is read only where no client gives a code
(gcsfs's "Forbidden" for HTTP 403).

A fault that is not one of these (an internal error, a malformed request) is None: the caller
says what the client said.
"""

from __future__ import annotations

import socket
import sys

from flaxlm.store_answers import Fault, code_and_status, fault_of

__all__ = ["Fault", "classify"]


def classify(err: BaseException) -> Fault | None:
    """The fault `err` (or an exception it was raised from or during) reports, or None. A code
    anywhere in the chain decides first: s3fs's PermissionError above an InvalidAccessKeyId is a
    refused key, not a denied write."""
    chain = _chain(err)
    for link in chain:
        code, status = code_and_status(link)
        if (fault := fault_of(code, status)) is not None:
            return fault
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


def _is_connection_failure(err: BaseException) -> bool:
    """A refused or reset connection, a name that does not resolve, a connection or read that
    timed out: the store was not reached, whatever the bucket."""
    if isinstance(err, (ConnectionError, socket.gaierror, TimeoutError)):
        return True
    botocore = sys.modules.get("botocore.exceptions")
    return botocore is not None and isinstance(
        err, (botocore.EndpointConnectionError, botocore.ConnectTimeoutError,
              botocore.ReadTimeoutError, botocore.ConnectionClosedError))
