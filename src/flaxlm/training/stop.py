"""Stopping a run on request: SIGTERM / SIGINT become a `StopRequest` the loop asks at fixed
points; the loop then saves a checkpoint and raises `Preempted`, whose exit code
(`PREEMPTED_EXIT_CODE`) tells a scheduler that the run can be resumed. An evaluation under way
is cut at its next batch (`unless_stopped` → `EvaluationCut`). On several hosts the processes
agree on the point where they all stop (`AgreedStopRequest`): one that stopped alone would
leave the others waiting for it in a collective.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

import jax

from flaxlm import distributed
from flaxlm.errors import FlaxlmError

T = TypeVar("T")

# Exit status of a run stopped by SIGTERM / SIGINT after saving its checkpoint: BSD sysexits'
# EX_TEMPFAIL ("temporary failure, try again"). It is distinct from a failure (1), a user error
# (2) and a process killed by a signal before saving (128 + signal, e.g. 137, 143): a job
# scheduler that sees 75 knows that the run can be resumed from its run directory.
PREEMPTED_EXIT_CODE = 75


class Preempted(Exception):
    """The run was asked to stop (SIGTERM / SIGINT) and saved a checkpoint at `step`."""

    def __init__(self, step: int, signal_name: str, run_dir: str | None = None):
        self.step, self.signal_name, self.run_dir = step, signal_name, run_dir
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint saved")


class StopRequest:
    """Set by SIGTERM or SIGINT while `catching_signals()` is active: the training loop
    finishes its current step (or evaluation batch), saves a checkpoint and raises `Preempted`.

    Once a stop is requested, a repeated SIGTERM is ignored: schedulers and wrappers often
    deliver it twice (to the process group and to the process), and the grace period it
    announces is what the save needs. A second SIGINT (Ctrl-C: a person at the keyboard) stops
    at once, without the checkpoint: it goes to the previous handler, except Python's own, whose
    KeyboardInterrupt would wait for the save's threads; the process ends by SIGINT instead."""

    def __init__(self):
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    @contextlib.contextmanager
    def catching_signals(self) -> Iterator[StopRequest]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set from the main thread
            return
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

        def put_back() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        def handle(signum, _frame):
            name = signal.Signals(signum).name
            if self.signal_name is None:
                self.signal_name = name
                print(f"\nflaxlm: {name} received; saving a checkpoint after this step "
                      "(Ctrl-C again stops at once, without it)", file=sys.stderr, flush=True)
            elif signum == signal.SIGINT:
                print("\nflaxlm: SIGINT again: stopping at once, without the checkpoint",
                      file=sys.stderr, flush=True)
                put_back()
                if previous[signal.SIGINT] is signal.default_int_handler:
                    signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.raise_signal(signum)
            else:
                print(f"\nflaxlm: {name} again: ignored while the checkpoint is saved "
                      "(Ctrl-C, SIGINT, stops at once)", file=sys.stderr, flush=True)

        for sig in previous:
            signal.signal(sig, handle)
        try:
            yield self
        finally:
            put_back()


class EvaluationCut(Exception):
    """A stop request cut an evaluation short after `done` of its `total` batches: its
    numbers cover part of the data, so they are not the run's evaluation."""

    def __init__(self, done: int, total: int):
        self.done, self.total = done, total
        super().__init__(f"evaluation cut after {done} of {total} batches")


def unless_stopped(batches: Iterable[T], stop: StopRequest | None, total: int) -> Iterator[T]:
    """Each of an evaluation's `total` batch results; raises `EvaluationCut` when `stop` is
    requested before the last one. A preemption's grace period is short, and an evaluation may
    be long. `stop` is asked after each batch but the last, on every process alike, so an
    `AgreedStopRequest` cuts every process's evaluation at the same batch."""
    for done, result in enumerate(batches, start=1):
        yield result
        if stop is not None and done < total and stop.requested:
            raise EvaluationCut(done, total)


class AgreedStopRequest(StopRequest):
    """A stop signal acted on by every process at the same point of the loop: a process that
    stopped alone would leave the others waiting in a collective for it.

    The loop asks `requested` at the same points on every process, so the n-th question is
    the same moment everywhere. The first process to get a signal announces a question a few
    ahead (`STOP_MARGIN`: the processes are never that far apart, as every step waits for the
    previous one's collectives); every process answers yes from that one on. One process:
    a plain `StopRequest`."""

    STOP_MARGIN = 8

    def __init__(self):
        super().__init__()
        self._asked = 0
        self._stop_at: int | None = None

    @property
    def requested(self) -> bool:
        if jax.process_count() == 1:
            return self.signal_name is not None
        self._asked += 1
        if self._stop_at is None:
            if self.signal_name is not None:
                agreed = distributed.announce("stop", [self._asked + self.STOP_MARGIN,
                                                       self.signal_name])
            else:
                agreed = distributed.announced("stop")
            if agreed is not None:
                self._stop_at, self.signal_name = agreed
                if self._asked > self._stop_at:
                    raise FlaxlmError(
                        f"Process {jax.process_index()} learnt of the stop signal too late to "
                        "stop with the others; the run stops without a new checkpoint. Rerun "
                        "the same command to resume from its last checkpoint."
                    )
        return self._stop_at is not None and self._asked >= self._stop_at
