"""One thread that makes copies for the thread that asks for them, so that a slow store (every
request 200 ms away, say) never stalls the caller: training asks for a copy and goes on.

A copy is named (the object it writes) and is a function that writes it whole when called.
Copies run one at a time, oldest request first. A copy asked for again while the first is still
waiting replaces it in its place in the line: only the newest goes up, so a burst of requests
for one file costs at most the copy under way plus one. `flush` waits, for a bounded time, until
nothing is waiting or under way, and names what is left when the time is up; a copy that fails
is handed to `on_failure` and the later ones still run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BackgroundUploader:
    """Copies made in order by one daemon thread, started at the first request and stopped by
    `close` once idle (a later request starts it again). Daemon, so that a copy hung on a dead
    endpoint never keeps the process alive: the owner's `flush` / `close` is what makes sure
    the copies it needs are done, and that wait is bounded."""

    def __init__(self, on_failure: Callable[[str, Exception], None], thread_name: str):
        self._on_failure = on_failure
        self._thread_name = thread_name
        self._changed = threading.Condition()
        self._waiting: dict[str, Callable[[], None]] = {}  # insertion order: request order
        self._running: str | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._flush_ends: float | None = None  # time.monotonic() at which a flush gives up

    def request(self, name: str, copy: Callable[[], None]) -> None:
        """Queue `copy` (which writes the object `name` whole) and return at once; a copy of
        `name` still waiting is replaced by this one."""
        with self._changed:
            self._waiting[name] = copy  # an existing key keeps its place in the line
            self._closing = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._thread_name,
                                                daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def flush(self, timeout_s: float) -> list[str]:
        """Wait until every copy requested so far is done (or failed), at most `timeout_s`
        seconds; the names of those still waiting or under way then, oldest first ([]: all
        done)."""
        ends = time.monotonic() + timeout_s
        with self._changed:
            self._flush_ends = ends
            try:
                self._changed.wait_for(self._idle, timeout=timeout_s)
                return self._unfinished()
            finally:
                if self._flush_ends == ends:  # not a later flush's
                    self._flush_ends = None

    def flush_ends(self) -> float | None:
        """When the flush under way gives up (time.monotonic), or None when none is: a copy
        that retries reads it, so that its tries end with the flush that waits for them."""
        return self._flush_ends

    def close(self, timeout_s: float) -> list[str]:
        """`flush`, then let the thread end once idle: what is left after `timeout_s` is still
        copied while the process lives, and named in the answer."""
        unfinished = self.flush(timeout_s)
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        return unfinished

    def _idle(self) -> bool:
        return not self._waiting and self._running is None

    def _unfinished(self) -> list[str]:
        return ([self._running] if self._running is not None else []) + list(self._waiting)

    def _work(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._waiting or self._closing)
                if not self._waiting:  # closing, and nothing left to copy
                    self._thread = None
                    return
                name = next(iter(self._waiting))
                copy = self._waiting.pop(name)
                self._running = name
            try:
                copy()
            except Exception as err:  # noqa: BLE001 — a failed copy is the owner's to report
                self._report(name, err)
            finally:
                with self._changed:
                    self._running = None
                    self._changed.notify_all()

    def _report(self, name: str, err: Exception) -> None:
        try:
            self._on_failure(name, err)
        except Exception:  # noqa: BLE001 — a broken report must not end the copies after it
            pass
