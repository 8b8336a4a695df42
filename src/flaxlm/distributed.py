"""Several processes (hosts) training one model on JAX's multi-controller runtime.

`initialize` starts `jax.distributed` from `hardware.distributed` before JAX starts its
backend. After it, every process runs the same program; what only one of them may do (claim
the run directory, build a cache, write a file) is done by process 0, and the others learn the
outcome through the coordination service's key-value store. Every wait on another process is
bounded by `hardware.distributed.timeout_s` and ends in a `PeerError`, never in a hang: a
peer that died never answers.

JAX's coordination client does not raise when the processes fail to join or one of them dies: it
aborts the process from C++ (SIGABRT), where no Python `except` runs. So what can be checked
before it starts is checked first (the coordinator answers, from every other process), and a
command-line run (`supervise_joins`) forks as it joins: the child goes on as the run, the
original process waits for it and turns JAX's abort into flaxlm's paragraph and exit code.

The waits here are host-side messages through the coordinator, not device collectives, so they
need no device, cost no compilation, and can time out.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from flaxlm.config import DistributedConfig, DistributedMode, HardwareConfig
from flaxlm.errors import PEER_EXIT_CODE, FlaxlmError, PeerError, first_line

T = TypeVar("T")
_FIX = ("Check that every process runs the same command with the same hardware.distributed.* "
        "settings and can reach the coordinator, or raise hardware.distributed.timeout_s.")


@dataclasses.dataclass
class _Run:
    """The processes of this run, as `initialize` left them: one per Python process, like JAX's
    own distributed state."""

    timeout_s: int = 300
    job: int = 0  # jobs of a multirun share the processes; their messages must not mix
    messages: itertools.count = dataclasses.field(default_factory=itertools.count)
    supervise: bool = False  # fork a supervising parent when joining (see `supervise_joins`)


_run = _Run()


def initialize(hardware: HardwareConfig) -> None:
    """Join the run's other processes as `hardware.distributed` says; must run before anything
    starts JAX's backend. off: one process. auto: JAX's cluster detection (TPU pod slice,
    SLURM, Open MPI, Kubernetes), one process when it finds no cluster. explicit: the given
    coordinator, process count and process id."""
    settings = hardware.distributed
    _check(settings)
    _run.timeout_s = settings.timeout_s
    _run.job += 1
    mode = DistributedMode(settings.mode)
    if mode == DistributedMode.off or jax.distributed.is_initialized():
        return  # a second run in one process (a multirun) keeps the first one's processes
    if mode == DistributedMode.auto and not _cluster_detected():
        print("flaxlm: hardware.distributed.mode=auto found no cluster (TPU pod slice, SLURM, "
              "Open MPI, Kubernetes); training as one process", flush=True)
        return
    if hardware.platform == "cpu":
        # Collectives between processes on CPU devices (what the two-process tests run on).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    explicit = mode == DistributedMode.explicit
    if explicit and settings.process_id != 0:
        _wait_for_coordinator(settings)
    joined = _supervise(settings, mode) if _run.supervise else lambda: None
    try:
        jax.distributed.initialize(
            settings.coordinator_address if explicit else None,
            num_processes=settings.num_processes if explicit else None,
            process_id=settings.process_id if explicit else None,
            initialization_timeout=settings.timeout_s,
            heartbeat_timeout_seconds=settings.timeout_s,
            shutdown_timeout_seconds=settings.timeout_s,
        )
    except Exception as err:  # noqa: BLE001 — JAX raises RuntimeError, ValueError, XlaRuntimeError
        raise _join_error(settings, mode, first_line(err)) from None
    joined()
    print(f"flaxlm: process {jax.process_index()} of {jax.process_count()} joined "
          f"(hardware.distributed.mode={mode.value})", flush=True)


def supervise_joins() -> None:
    """Have `initialize` supervise the process it joins to others (see `_supervise`). For the
    command line, whose exit code a user or a scheduler reads; a library caller (a notebook)
    keeps its one process."""
    _run.supervise = True


def _join_error(settings: DistributedConfig, mode: DistributedMode, reason: str) -> PeerError:
    where = (f"coordinator {settings.coordinator_address}, process {settings.process_id} of "
             f"{settings.num_processes}" if mode == DistributedMode.explicit
             else "the cluster JAX detected")
    return PeerError(
        f"hardware.distributed.mode={mode.value} could not join the run's processes "
        f"({where}) within hardware.distributed.timeout_s={settings.timeout_s}s: {reason}. "
        "Start every process (process 0 first listens at the coordinator address), check that "
        "the address and port are reachable from every host, or set "
        "hardware.distributed.mode=off to train on this host alone."
    )


def _wait_for_coordinator(settings: DistributedConfig) -> None:
    """Connect to the coordinator until it answers or the timeout passes, before JAX's client
    (which aborts the process when it gives up) starts."""
    host, _, port = settings.coordinator_address.rpartition(":")
    deadline = time.monotonic() + settings.timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1):
                return
        except OSError as err:
            failure = err
        if time.monotonic() >= deadline:
            raise _join_error(settings, DistributedMode.explicit,
                              f"nothing answers at {settings.coordinator_address} "
                              f"({failure.strerror or failure})")
        time.sleep(0.2)


def _supervise(settings: DistributedConfig, mode: DistributedMode) -> Callable[[], None]:
    """Fork before JAX's client starts. The child returns and goes on as the run; this process
    waits for it and exits as it did, except that a native abort (what JAX's client does when a
    process never comes or a joined one dies or stops answering) becomes flaxlm's paragraph and
    `PEER_EXIT_CODE`. Returns, in the child, what to call once the processes joined.

    Forking, rather than starting the command anew, keeps what this process already composed
    and decided (the config, the run directory, a multirun's place); JAX has started no thread
    yet (its backend starts after the join)."""
    sys.stdout.flush()
    sys.stderr.flush()
    news, note = os.pipe()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        os.close(news)
        _die_with_parent(parent)

        def joined() -> None:
            os.write(note, b"joined")
            os.close(note)

        return joined
    os.close(note)
    status = _wait_forwarding_signals(child)
    os.set_blocking(news, False)
    try:
        has_joined = os.read(news, 16) == b"joined"
    except BlockingIOError:  # a forked grandchild holds the pipe; nothing was written
        has_joined = False
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGABRT:
        print(f"flaxlm: error: {_abort_message(settings, mode, has_joined)}", file=sys.stderr,
              flush=True)
        os._exit(PEER_EXIT_CODE)
    if os.WIFSIGNALED(status):  # end as the child ended, for whoever reads the status
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _abort_message(settings: DistributedConfig, mode: DistributedMode, has_joined: bool) -> str:
    ended = "JAX's coordination client ended this process (a native abort; its message is above)"
    if not has_joined:
        return str(_join_error(settings, mode, f"a process did not come in time, and {ended}"))
    who = "This process" if settings.process_id is None else f"Process {settings.process_id}"
    return (f"{who} lost contact with another process of the run: {ended}, which it does "
            "when a process of the run stops, crashes or does not answer within "
            f"hardware.distributed.timeout_s={settings.timeout_s}s; that process's own log "
            "says why. Rerun the same command on every host to resume from the last "
            "checkpoint.")


def _die_with_parent(parent: int) -> None:
    """The run must not outlive its supervisor (killed with SIGKILL): the scheduler that ended
    the job would see it gone."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        return  # no prctl: another OS; the run then ends when its peers' heartbeats stop
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _wait_forwarding_signals(child: int) -> int:
    """The child's wait status. SIGTERM and SIGINT sent to this process (a scheduler, a `kill`)
    are passed on, but not a SIGINT typed at the terminal: the child, in the same foreground
    process group, got it too, and a second Ctrl-C would stop it at once. Polls rather than
    blocking in `waitpid`: a signal that lands on another thread of this process does not
    interrupt a blocking wait, and Python runs its handler only when the main thread next runs
    Python code."""
    def forward(signum: int, _frame) -> None:
        if signum == signal.SIGINT and _in_terminal_foreground():
            return
        os.kill(child, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            return status
        time.sleep(0.1)


def _in_terminal_foreground() -> bool:
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return True
        except OSError:
            continue
    return False


def _check(settings: DistributedConfig) -> None:
    if settings.timeout_s < 1:
        raise FlaxlmError(f"hardware.distributed.timeout_s={settings.timeout_s} must be at "
                          "least 1 (seconds).")
    if DistributedMode(settings.mode) != DistributedMode.explicit:
        return
    missing = [key for key in ("coordinator_address", "num_processes", "process_id")
               if getattr(settings, key) is None]
    if missing:
        raise FlaxlmError(
            "hardware.distributed.mode=explicit needs " + ", ".join(
                f"hardware.distributed.{key}" for key in missing) + ": the coordinator's "
            "host:port (process 0's), how many processes and which one this is, e.g. "
            "hardware.distributed.coordinator_address=10.0.0.1:1234 "
            "hardware.distributed.num_processes=2 hardware.distributed.process_id=0. Or use "
            "mode=auto on a cluster JAX detects."
        )
    host, _, port = settings.coordinator_address.rpartition(":")
    if not host or not port.isdigit():
        raise FlaxlmError(
            f"hardware.distributed.coordinator_address={settings.coordinator_address!r} must be "
            "host:port (process 0's), e.g. 10.0.0.1:1234."
        )
    if not 0 <= settings.process_id < settings.num_processes:
        raise FlaxlmError(
            f"hardware.distributed.process_id={settings.process_id} must be between 0 and "
            f"hardware.distributed.num_processes - 1 = {settings.num_processes - 1}."
        )


def _cluster_detected() -> bool:
    """Whether `jax.distributed.initialize()` without arguments would find its settings."""
    from jax._src import clusters

    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    return any(not env.opt_in_only_method and env.is_env_present()
               for env in clusters.ClusterEnv._cluster_types)


def is_primary() -> bool:
    """Process 0: the one that writes the run's files (any process, before the processes
    joined or without several: asking must not start JAX's backend)."""
    return not jax.distributed.is_initialized() or jax.process_index() == 0


def from_primary(name: str, decide: Callable[[], T], *, patient: bool = False) -> T:
    """Process 0 runs `decide` and every process gets its JSON-able result. An error on
    process 0 is raised there and, as a FlaxlmError saying so, on every other process; a
    process 0 that does not answer within the timeout is an error too, unless `patient` (work
    that may take longer, such as building a cache): then the others wait on, saying so every
    timeout, for as long as process 0 is alive. All processes must call this in the same order
    (the message is numbered by the calls)."""
    if jax.process_count() == 1:
        return decide()
    key = _key(name)
    if is_primary():
        try:
            value = decide()
        except BaseException as err:
            _client().key_value_set(key, json.dumps({"error": str(err) or type(err).__name__}))
            raise
        _client().key_value_set(key, json.dumps({"value": value}))
        return value
    answer = json.loads(_get(key, f"process 0 to finish {name}", patient))
    if "error" in answer:
        raise FlaxlmError(f"Process 0 failed while {name}, so this process stops too: "
                          f"{answer['error']}")
    return answer["value"]


def primary_first(name: str, build: Callable[[], Any]) -> None:
    """Process 0 runs `build` (write a cache file) while the others wait; then the others run
    it too, which on a filesystem all hosts share finds the file and writes nothing, and on a
    host's own disk builds that host's copy. No two processes write one file at once."""
    def build_on_primary() -> None:
        build()

    from_primary(name, build_on_primary, patient=True)
    if not is_primary():
        build()


def all_gather(name: str, value: Any) -> list[Any]:
    """Every process's JSON-able `value`, in process order, on every process."""
    if jax.process_count() == 1:
        return [value]
    key = _key(name)
    _client().key_value_set(f"{key}/{jax.process_index()}", json.dumps(value))
    return [json.loads(_get(f"{key}/{index}", f"process {index} to reach {name}"))
            for index in range(jax.process_count())]


def announce(name: str, value: Any) -> Any:
    """Post `value` under `name` for every process unless one was posted first; returns the
    value that holds. Needs no partner: any process may announce at any time."""
    key = f"flaxlm/{_run.job}/{name}"
    try:
        _client().key_value_set(key, json.dumps(value))
        return value
    except Exception:  # noqa: BLE001 — ALREADY_EXISTS: another process announced first
        return json.loads(_get(key, f"the announcement {name!r}"))


def announced(name: str) -> Any | None:
    """The value announced under `name`, or None if none was yet; does not wait."""
    try:
        text = _client().key_value_try_get(f"flaxlm/{_run.job}/{name}")
    except Exception:  # noqa: BLE001 — NOT_FOUND
        return None
    return json.loads(text)


def lost_peer_error(err: BaseException, run_dir: str) -> PeerError | None:
    """A collective that failed because another process of the run is gone, as one message;
    None for any other error."""
    if jax.process_count() == 1 or isinstance(err, FlaxlmError):
        return None
    text = str(err)
    if not any(sign in text for sign in _LOST_PEER_SIGNS):
        return None
    return PeerError(
        f"Process {jax.process_index()} of {jax.process_count()} lost contact with another "
        f"process of the run in {run_dir} ({text.strip().splitlines()[0][:300]}): it stopped "
        "or crashed; its own log says why. Rerun the same command on every host to resume from "
        "the last checkpoint."
    )


# What a collective's error says when a peer process is gone: gloo's (CPU) socket errors and
# the coordination service's verdict.
_LOST_PEER_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Gloo",
                    "heartbeat", "tasks are unhealthy")


def _key(name: str) -> str:
    return f"flaxlm/{_run.job}/{next(_run.messages)}/{name}"


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def _get(key: str, waiting_for: str, patient: bool = False) -> str:
    """The value under `key` once it is set. A process that died ends any wait: its peers'
    coordination service reports it within the timeout (heartbeats)."""
    waited = 0
    while True:
        try:
            return _client().blocking_key_value_get(key, _run.timeout_s * 1000)
        except Exception as err:  # noqa: BLE001 — XlaRuntimeError: DEADLINE_EXCEEDED, ...
            failure = err
        waited += _run.timeout_s
        if not (patient and "DEADLINE_EXCEEDED" in str(failure)):
            break
        print(f"flaxlm: process {jax.process_index()} has waited {waited}s for {waiting_for}",
              flush=True)
    raise PeerError(
        f"Process {jax.process_index()} waited hardware.distributed.timeout_s="
        f"{_run.timeout_s}s for {waiting_for}, in vain ({first_line(failure)}): a process "
        f"stopped or is stuck. {_FIX}"
    ) from None

