"""A fault-injecting HTTP proxy for the bucket tests: it listens on 127.0.0.1, forwards each
request to an S3 server (moto's, tests/buckets.py) and answers some of them itself, as a
throttled or failing store does: `fault(n)` of the n-th request (from 0) says "503" (S3's
ServiceUnavailable), "slowdown" (503 SlowDown), "500" (InternalError), "drop" (the connection
closed without an answer) or None (forwarded). Deterministic: the same requests meet the same
faults. `Outage` is such a `fault`: the store gone from a chosen request on, until it is back.
`delay_s` holds every request that long before it is forwarded: a store far away (each
request on a thread of its own, so requests in flight together wait together, as over a
network)."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_ANSWERS = {"503": (503, "ServiceUnavailable"), "slowdown": (503, "SlowDown"),
            "500": (500, "InternalError")}
# Hop-by-hop headers, and the length, which the proxy sets itself for the body it read whole.
_NOT_FORWARDED = {"transfer-encoding", "connection", "keep-alive", "content-length"}


class Outage:
    """A fault pattern for `FaultyProxy`: every request from the first one whose path holds
    `starts_at` (a PUT: a write under way) on is dropped, as by a store that went away in the
    middle of that write, until `end()` (the store back)."""

    def __init__(self, starts_at: str, how: str = "drop"):
        self.starts_at, self.how = starts_at, how
        self.down = self.over = False

    def watch(self, method: str, path: str) -> None:
        if method == "PUT" and self.starts_at in path and not self.over:
            self.down = True

    def end(self) -> None:
        self.over = True

    def __call__(self, n: int) -> str | None:
        return self.how if self.down and not self.over else None


class FaultyProxy:
    def __init__(self, upstream: str, fault: Callable[[int], str | None] = lambda n: None,
                 delay_s: float = 0.0):
        host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
        self.upstream = (host, int(port))
        self.fault, self.delay_s = fault, delay_s
        self.requests = 0
        self.faults: list[tuple[int, str, str, str]] = []  # (n, fault, method, path)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FaultyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _next(self, method: str, path: str) -> str | None:
        with self._lock:
            n, self.requests = self.requests, self.requests + 1
            watch = getattr(self.fault, "watch", None)  # a fault that waits for a request
            if watch is not None:
                watch(method, path)
            fault = self.fault(n)
            if fault:
                self.faults.append((n, fault, method, path))
            return fault


def _handler(proxy: FaultyProxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a store serves its clients

        def log_message(self, *args):  # quiet: one line per request would bury a failure
            pass

        def _body(self) -> bytes:
            """The request's body as sent (chunked bodies with their framing, which the
            upstream reads the same way)."""
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                raw = b""
                while True:
                    line = self.rfile.readline()
                    raw += line
                    size = int(line.split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while True:  # trailers, up to the blank line
                            trailer = self.rfile.readline()
                            raw += trailer
                            if trailer in (b"\r\n", b"\n", b""):
                                return raw
                    raw += self.rfile.read(size + 2)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _relay(self):
            body = self._body()
            fault = proxy._next(self.command, self.path)
            if proxy.delay_s:
                time.sleep(proxy.delay_s)
            if fault == "drop":
                self.close_connection = True  # the server closes it: no answer at all
                return
            if fault:
                status, code = _ANSWERS[fault]
                xml = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                       f"<Message>injected by the test's proxy</Message></Error>").encode()
                self.send_response_only(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(xml)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(xml)
                return
            upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
            try:
                upstream.putrequest(self.command, self.path, skip_host=True,
                                    skip_accept_encoding=True)
                for name, value in self.headers.items():
                    upstream.putheader(name, value)
                upstream.endheaders()
                if body:
                    upstream.send(body)
                response = upstream.getresponse()
                data = response.read()
                self.send_response_only(response.status, response.reason)
                for name, value in response.getheaders():
                    if name.lower() not in _NOT_FORWARDED:
                        self.send_header(name, value)
                length = (response.getheader("Content-Length", "0")
                          if self.command == "HEAD" else str(len(data)))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
            finally:
                upstream.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

    return Handler
