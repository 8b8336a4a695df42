"""Dispatching a loop of jitted programs without letting the host run far ahead of the devices.

JAX dispatches asynchronously: a call to a jitted step queues the program and returns at once,
so a loop that never waits queues as many programs as it has batches whenever a batch computes
slower than the host dispatches it (a loaded CPU, a big eval batch). On CPU devices that kills
the process. XLA's CPU client queues at most 32 programs per device; launching one more blocks a
worker of its thread pool until a slot frees. That pool has one thread per device when there
are at least as many devices as cores, which is what `hardware=cpu` sets up. With the workers
blocked in launches, one device's part of a queued program with a cross-device all-reduce
starts and waits in the rendezvous for its partner, which never gets a thread; after
`--xla_cpu_collective_call_terminate_timeout_seconds` (40 s by default) XLA aborts ("only 1 of them
arrived"). Waiting for each result soon after the next is dispatched keeps the queue a few
programs deep on any backend, and the devices still compute while the host builds a batch.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import TypeVar

import jax

T = TypeVar("T")

AHEAD = 1  # programs dispatched beyond the one being waited for, as the train loop does


def ready_in_order(results: Iterable[T], ahead: int = AHEAD) -> Iterator[T]:
    """Each of `results` (a pytree of arrays) in order, ready, while at most `ahead` later ones
    are dispatched.

    `results` must be lazy, e.g. a generator of jitted calls over the batches: advancing it
    dispatches one more program. Result b is waited for right after result b + `ahead` is
    dispatched, so fetching it (`jax.device_get`) never waits.
    """
    pending: collections.deque[T] = collections.deque()
    for result in results:
        pending.append(result)
        if len(pending) > ahead:
            yield jax.block_until_ready(pending.popleft())
    while pending:
        yield jax.block_until_ready(pending.popleft())
