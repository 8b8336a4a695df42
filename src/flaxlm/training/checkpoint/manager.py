"""Checkpoints that let a run be stopped anywhere and continued as if it never stopped.

One `Checkpointer` per run, over `<run_dir>/checkpoints/` (an orbax `CheckpointManager`). A
checkpoint at step s holds three items:

- `state`: the train-state pytree (parameters, optimizer state, step; any pytree of arrays with
  a top-level `params` field or key, which `restore_params` reads);
- `loader`: the data loader's position as a JSON dict (epoch, step in epoch, shuffle seed; a
  stream's `StreamState`), whatever the caller's loader needs to yield the same next batch;
- `meta`: JSON metadata (the resolved config, the tokenizer's hash, the data's fingerprint, RNG
  keys, the loop's unfinished metric window, ...).

It is generic over all three, so the pre-training loop and the fine-tuning loop share it.

Atomicity comes from orbax (0.12.8). On a filesystem a step is written into
`<step>.orbax-checkpoint-tmp*/` and renamed to `<step>/` only once every item is on disk, so a
process killed mid-save leaves only a tmp folder, which is never listed as a step (tested with a
real SIGKILL) and is removed when the next run opens the directory. A finalised folder damaged
afterwards (a truncated copy, a full disk, a deleted file) fails to restore: `restore_latest`
then says so, falls back to the next older checkpoint and renames the damaged folder to
`<step>.damaged-<time>` (kept, never deleted), so that the resumed run can save that step anew.
In a bucket (output_url: gs://, or s3:// through `flaxlm.training.checkpoint.s3`) there is no
rename: orbax writes `<step>/` in place, each item then the step's `commit_success.txt` last,
once every process has written its part; a step
without it is not listed (`finalised_steps` reads the same), so a killed save stays invisible;
orbax removes such a step when the next run opens the folder (`cleanup_tmp_directories`).
Setting a step aside there moves its objects one by one (copy, then delete).

Asynchronous saves: `save` returns once the arrays are copied off the device, and a background
thread writes the files; the state's buffers may be donated to the next step at once (tested).

Retention: the last `keep_last` checkpoints, plus the `keep_best` with the lowest eval loss among
those saved with eval metrics: two orbax preservation policies, either of which keeps a step.
orbax's `max_to_keep` + `best_fn` alone ranks only checkpoints that have metrics; the ones
saved between evaluations, which a resume needs, would be kept forever or dropped at once.

Replicated arrays: orbax splits a replicated array among its replicas, each writing a slice
(replica-parallel saving), only where a slice holds at least `REPLICA_PARALLEL_MIN_BYTES`.
Below that, one slice per replica costs more to cut, copy and write than the whole array from
one replica.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import operator
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies
from orbax.checkpoint._src.metadata import array_metadata_store

from flaxlm import bucket_faults, storage_retry
from flaxlm.config import CheckpointConfig
from flaxlm.errors import FlaxlmError, causes, first_line
from flaxlm.layout import CHECKPOINT_SUBDIR, checkpoint_dir
from flaxlm.storage import exists, forget_listings, is_url, list_names, move_objects
from flaxlm.training.checkpoint import s3
from flaxlm.training.stop import PREEMPTED_EXIT_CODE

BEST_METRIC = "eval/loss"  # lower is better
SET_ASIDE_TIMEOUT_S = 300  # how long other processes wait for process 0 to set a step aside
REPLICA_PARALLEL_MIN_BYTES = 1 << 20
BUCKET_SETTING = "output_url"  # the setting that names a bucket's checkpoints, for messages
# What orbax writes last into a step saved in a bucket (its CommitFileTemporaryPath).
COMMIT_FILE = "commit_success.txt"


class Restored(NamedTuple):
    state: Any  # the train-state pytree, laid out like the abstract state given to restore
    loader_state: dict
    metadata: dict
    step: int


class CheckpointNotWritten(FlaxlmError):
    """A checkpoint could not be written to a bucket once storage_retries' tries were spent
    (the store gone, or refusing): the run stops there, resumable from its last complete
    checkpoint, as a preempted run is (the same exit code)."""

    exit_code = PREEMPTED_EXIT_CODE


class Checkpointer:
    """Saves and restores (train state, loader state, metadata) by step under `directory`."""

    def __init__(self, directory: str, *, keep_last: int = 3, keep_best: int = 1,
                 async_save: bool = True, read_only: bool = False,
                 after_save: Callable[[int], None] | None = None,
                 before_commit: Callable[[], None] | None = None):
        if keep_last < 1 or keep_best < 0:
            raise FlaxlmError(
                f"checkpoint.keep_last={keep_last} must be at least 1 (the checkpoint a resume "
                f"needs) and checkpoint.keep_best={keep_best} at least 0."
            )
        # A bucket's URL is orbax's and tensorstore's own to write (every process, its
        # shards); s3:// through flaxlm.training.checkpoint.s3.
        self.directory = directory if is_url(directory) else os.path.abspath(directory)
        self.after_save = after_save  # called with the step once each save has started
        # An asynchronous save calls `before_commit` on process 0, in orbax's thread, once its
        # files are written and before the step counts as complete (orbax's post-finalization
        # callback precedes the commit): what must be in place before a resume can pick the
        # step. A synchronous save is complete when `save` returns; orbax takes no callback.
        async_options = (ocp.AsyncOptions(post_finalization_callback=before_commit)
                         if async_save and before_commit is not None else None)
        keep = [policies.LatestN(n=keep_last)]
        if keep_best:
            keep.append(policies.BestN(
                get_metric_fn=lambda metrics: metrics[BEST_METRIC],
                reverse=True,  # sorted high → low; BestN keeps the last n: the lowest losses
                n=keep_best,
                keep_checkpoints_without_metrics=False,
            ))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(keep),
            enable_async_checkpointing=async_save,
            async_options=async_options,
            cleanup_tmp_directories=not read_only,  # leftovers of a save that was killed
            read_only=read_only,
            create=not read_only,
            # in any bucket, orbax's gs:// rule: complete once commit_success.txt is written
            atomicity_options=s3.ATOMICITY if is_url(self.directory) else None,
        )
        s3.install()
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "loader", "meta")
        )
        # orbax removes those leftovers in a thread that neither close() nor process exit
        # waits for: a run that stops at once (an input error) would end with that thread's
        # traceback ("cannot schedule new futures after interpreter shutdown"). Wait for it.
        self._manager._maybe_await_cleanup_tmp_directory()
        # The newest step known complete, and the one an asynchronous save is writing: a save
        # that fails in the bucket is reported with the step a resume goes back to, which the
        # bucket itself cannot be asked for then.
        self._last_complete: int | None = max(self.steps(), default=None)
        self._writing: int | None = None
        self._failed = False  # a failed save was reported: the run is stopping
        if is_url(self.directory):
            _release_peers_when_a_save_fails(self._manager)
        _quiet_disk_full_logs()
        _quiet_closed_loop_callbacks()
        _split_only_large_replicated_arrays()

    def steps(self) -> list[int]:
        """Steps of finalised checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state, loader_state: dict, metadata: dict,
             metrics: dict[str, float] | None = None) -> None:
        """Start saving; with async_save this returns once the arrays are copied off the
        device, and the files are written in a background thread. `metrics` with an
        `eval/loss` make the checkpoint a candidate for the best ones kept."""
        best = None
        if metrics and BEST_METRIC in metrics:
            best = {BEST_METRIC: float(metrics[BEST_METRIC])}
        self._settle()  # the previous save's failure, if any, first (orbax would raise it here)
        self._writing = step
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    loader=ocp.args.JsonSave(loader_state),
                    meta=ocp.args.JsonSave({**metadata, "step": step}),
                ),
                metrics=best,
                force=True,  # the caller decides when to save
            )
        except Exception as err:
            if (not_written := self._not_written(err)) is None:
                raise
            raise not_written from err
        if not self._manager.is_saving_in_progress():  # a synchronous save: complete now
            self._settle()
        if self.after_save is not None:
            self.after_save(step)

    def restore(self, step: int, abstract_state) -> Restored:
        """The checkpoint at `step`, arrays laid out (shape, dtype, sharding) as
        `abstract_state` (a pytree of arrays or `jax.ShapeDtypeStruct`s). The shardings are
        the reader's, not the writer's: a checkpoint saved on one mesh (say data=8) restores
        onto another (fsdp=8, or fewer devices), each process reading only its own shards."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target),
            loader=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore(),
        ))
        if restored.meta.get("step") != step:
            raise FlaxlmError(
                f"checkpoint {step} in {self.directory} has the metadata of step "
                f"{restored.meta.get('step')}: the folder was renamed or copied over."
            )
        return Restored(restored.state, dict(restored.loader), dict(restored.meta), step)

    def restore_latest(self, abstract_state) -> Restored | None:
        """The newest checkpoint that restores whole, or None if there is none. A damaged one
        is skipped with a message naming it and the reason; once an older one restored, every
        step folder newer than it is set aside (`set_aside`), since the resumed run would fail
        to save when it reaches that step again. When none restores, nothing is moved: the
        fault may lie in `abstract_state`, not in the checkpoints."""
        for step in reversed(self.steps()):
            try:
                restored = self.restore(step, abstract_state)
            except Exception as err:  # noqa: BLE001 — any failure means: not usable
                print(
                    f"flaxlm: checkpoint step {step} in {self.directory} is incomplete or "
                    f"unreadable ({type(err).__name__}: {first_line(err)}); falling back to "
                    "the previous checkpoint", file=sys.stderr, flush=True,
                )
                continue
            self._set_aside_newer_than(step)
            self._last_complete = step
            return restored
        return None

    def _set_aside_newer_than(self, step: int) -> None:
        if jax.process_index() == 0:  # one process renames; the others wait for it
            for name in _step_names(self.directory, after=step):
                set_aside(os.path.join(self.directory, name))
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"flaxlm_set_aside_after_{step}",
                                                timeout=SET_ASIDE_TIMEOUT_S)
        if is_url(self.directory):
            forget_listings(self.directory)
        self._manager.reload()  # its list of steps still holds the ones moved

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self._settle()

    def raise_failed_save(self) -> None:
        """Raise the error of an asynchronous save that failed; never waits for one still being
        written. orbax itself reports it only at the next save, which may be many steps (all
        of them lost) later."""
        if not self._manager.is_saving_in_progress():
            self._settle()  # a finished save: returns or raises at once

    def close(self) -> None:
        """Wait for pending saves, then release orbax's threads."""
        self._settle()
        self._manager.close()

    def _settle(self) -> None:
        """Wait for the save under way; it is complete then, or its failure is raised (in a
        bucket, as `CheckpointNotWritten`)."""
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            if self._failed:  # reported once already; the run is stopping
                return
            if (not_written := self._not_written(err)) is None:
                raise
            raise not_written from err
        if self._writing is not None:
            self._last_complete, self._writing = self._writing, None

    def _not_written(self, err: Exception) -> CheckpointNotWritten | None:
        """What a failed save raises: on a disk, None: orbax's error as it came (a full disk
        has its own report, `disk_full_error`); in a bucket, a paragraph naming the last complete
        checkpoint, which a resume goes back to. orbax commits a step in a bucket only once
        all of it is written, so the failed one never counts as complete."""
        failed, self._writing = self._writing, None
        if not is_url(self.directory):
            return None
        self._failed = True
        _release_waiting_save_threads()
        fault = bucket_faults.classify(err)
        what = f"{fault.value}: " if fault is not None else ""
        tries = storage_retry.current().attempts
        kept = (f"Its last complete checkpoint is step {self._last_complete} (step {failed} was "
                "never committed, so no run takes it for one); once the store answers again, "
                f"run the same command: it resumes from step {self._last_complete}."
                if self._last_complete is not None else
                "It had no complete checkpoint yet; once the store answers again, run the same "
                "command: it starts again from step 0.")
        return CheckpointNotWritten(
            f"{BUCKET_SETTING}: could not write the checkpoint of step {failed} to "
            f"{self.directory} ({what}{type(err).__name__}: {first_line(err)}), after "
            f"{tries} tries ({storage_retry.SETTING}), so the run stopped rather than train on "
            f"with nothing saved. {kept} (exit code {PREEMPTED_EXIT_CODE}: resumable.)")


def _release_peers_when_a_save_fails(manager: ocp.CheckpointManager) -> None:
    """A save that failed in the bucket releases, as it fails, the other processes' threads
    that wait for a part of it that will never come (the step's folder, which process 0 could
    not make). Without it, with several processes, process 0's save ends at orbax's barrier
    with the others while they wait for that part, each side for orbax's async timeout (20 min),
    before either says anything. Released (`_release_waiting_save_threads`: the signals are
    keys of jax.distributed's store, the same for every process), the others' parts run,
    fail on the same store, and every process reaches the barrier with its error: all stop
    with the paragraph. Wrapped around the two waits of orbax 0.12's finalize thread that
    raise a failed save before its barrier (the step's metadata file, `_non_blocking_metadata_
    store`, and the items, `_wait_for_checkpointers`; which one fails first is a race), private
    names read defensively: another orbax without them waits out its timeout, as before."""
    store = getattr(manager, "_non_blocking_metadata_store", None)
    for owner, name in ((manager, "_wait_for_checkpointers"), (store, "wait_until_finished")):
        wait = getattr(owner, name, None)
        if wait is not None:
            setattr(owner, name, _releasing_on_failure(wait))


def _releasing_on_failure(wait: Callable[[], None]) -> Callable[[], None]:
    def releasing_wait():
        try:
            wait()
        except Exception:
            _release_waiting_save_threads()
            raise

    return releasing_wait


def _release_waiting_save_threads() -> None:
    """Cancel orbax's threads of a failed save that still wait for a signal from a part of it
    that failed (the step's folder, never created): they would wait out orbax's timeout (300 s)
    and hold the process from exiting that long, then log a traceback each. Cancelled and
    signalled, each returns at once without running its part. These are orbax 0.12's private
    names: where another orbax lacks them, nothing is released, and the process waits out the
    timeout as it did before (the run still stops with its paragraph)."""
    try:
        from orbax.checkpoint._src.futures import future as orbax_futures
    except ImportError:
        return
    signaling = getattr(orbax_futures, "_SignalingThread", None)
    set_signals = getattr(orbax_futures, "set_signals", None)
    if signaling is None or set_signals is None:
        return
    for thread in threading.enumerate():
        if isinstance(thread, signaling) and thread.is_alive():
            signals = getattr(thread, "_receive_signals", None)
            operation = getattr(thread, "_operation_id", None)
            if signals is None or operation is None:
                continue
            thread.cancel()
            set_signals(signals, operation_id=operation)


def restore_params(run_dir: str, step: int | None = None,
                   layout: Callable[[dict], dict] | None = None,
                   directory: str | None = None) -> tuple[dict, dict, int]:
    """(parameters, resolved config, step) of a run's checkpoint: the latest complete one, or
    `step`. Parameters are a nested dict, as `nnx.to_pure_dict` gives (layer indices as ints);
    the config is the run's resolved config as a plain dict. Without `layout` it needs no
    model: the arrays are read as saved, as numpy arrays on the host. `layout(config)` gives
    the shardings (a nested dict like the parameters) that each parameter is read onto
    instead, every device reading its own part: never the whole model on one device or
    host. `directory`: where the checkpoints are, if not in `run_dir` (a bucket run's
    `<output_url>/checkpoints`)."""
    if directory is None:
        directory = os.path.join(os.path.abspath(os.path.expanduser(run_dir)), CHECKPOINT_SUBDIR)
    steps = finalised_steps(directory)
    if not steps:
        raise FlaxlmError(
            f"{run_dir} has no complete checkpoint in {CHECKPOINT_SUBDIR}/. Pass the directory "
            "of a run that trained with checkpointing (every run writes one at its end)."
        )
    if step is not None and step not in steps:
        raise FlaxlmError(f"{run_dir} has no checkpoint for step {step}; it has steps {steps}. "
                          "Pass one of those as --step, or leave it out for the latest.")
    candidates = [step] if step is not None else list(reversed(steps))
    for candidate in candidates:
        try:
            return _read_params(os.path.join(directory, str(candidate)), candidate,
                                layout)
        except Exception as err:  # noqa: BLE001
            if step is not None:
                raise
            print(f"flaxlm: checkpoint step {candidate} in {directory} is unreadable "
                  f"({first_line(err)}); trying the previous one", file=sys.stderr, flush=True)
    raise FlaxlmError(
        f"No checkpoint in {directory} could be read (steps {steps}; the messages above say "
        "why). If the run also finished, its final model is in model/ beside checkpoints/: move "
        "checkpoints/ aside to use it."
    )


def set_aside(path: str) -> str:
    """Rename a checkpoint folder to `<path>.damaged-<UTC time>`, a name neither orbax nor
    `finalised_steps` takes for a step, and say so; nothing is deleted. Returns the new path."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = f"{path}.damaged-{stamp}"
    taken = ((lambda name: exists(name, BUCKET_SETTING)) if is_url(path) else os.path.lexists)
    for count in itertools.count(2):
        if not taken(target):
            break
        target = f"{path}.damaged-{stamp}-{count}"
    if is_url(path):
        move_objects(path, target, BUCKET_SETTING)
    else:
        os.rename(path, target)
    print(f"flaxlm: moved the unusable checkpoint {path} aside to {target} (kept for "
          "inspection; delete it when no longer needed)", file=sys.stderr, flush=True)
    return target


def _step_names(directory: str, after: int) -> list[str]:
    """Entries of `directory` named like a step later than `after` (finalised or not: orbax
    could not save that step while any of them is there), oldest first."""
    names = list_names(directory, BUCKET_SETTING) if is_url(directory) else os.listdir(directory)
    return sorted((name for name in names if name.isdigit() and int(name) > after), key=int)


def finalised_steps(directory: str) -> list[int]:
    """Steps with a finalised folder (orbax renames `<step>.orbax-checkpoint-tmp-*` into
    `<step>` only once it is whole), read without orbax. In a bucket, which has no
    rename, orbax writes `<step>/` in place and its `commit_success.txt` last, once every
    process's items are written: a step without that object is not finalised."""
    if is_url(directory):
        return sorted(int(name) for name in list_names(directory, BUCKET_SETTING)
                      if name.isdigit() and exists(f"{directory}/{name}/{COMMIT_FILE}",
                                                   BUCKET_SETTING))
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory)
                  if name.isdigit() and os.path.isdir(os.path.join(directory, name)))


def _read_params(step_dir: str, step: int,
                 layout: Callable[[dict], dict] | None = None) -> tuple[dict, dict, int]:
    s3.install()
    atomicity = s3.ATOMICITY if is_url(step_dir) else None
    meta = ocp.Checkpointer(ocp.JsonCheckpointHandler(), atomicity_options=atomicity).restore(
        os.path.join(step_dir, "meta"), args=ocp.args.JsonRestore()
    )
    handler = ocp.PyTreeCheckpointHandler()
    reader = ocp.Checkpointer(handler, atomicity_options=atomicity)
    state_dir = os.path.join(step_dir, "state")
    # The handler's own metadata: the Checkpointer's would also look for the step's metadata
    # file inside this item folder (it lies one up) and warn that it is missing.
    tree = handler.metadata(epath.Path(state_dir)).tree
    # Only the parameters, as numpy; the optimizer state (2× the parameters for Adam) stays
    # on disk.
    if layout is None:
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    else:
        restore_args = {"params": _restore_args_on(tree["params"], layout(meta["config"]))}
    restored = reader.restore(state_dir, args=ocp.args.PyTreeRestore(
        item={"params": tree["params"]},
        restore_args={"params": restore_args["params"]},
        partial_restore=True,
    ))
    return _pure_dict(restored["params"]), meta["config"], step


def _restore_args_on(tree, shardings: dict):
    """orbax's arguments that read each array of `tree` (the saved parameters' metadata) onto
    its sharding in `shardings` (keyed as `_pure_dict` keys the parameters)."""

    def restore_arg(path, _):
        keys = [int(key.key) if key.key.isdigit() else key.key for key in path]
        if keys[-1] == "value":  # the variable's own level, not BERT's attention `value`
            keys = keys[:-1]
        return ocp.ArrayRestoreArgs(sharding=functools.reduce(operator.getitem, keys, shardings))

    return jax.tree_util.tree_map_with_path(restore_arg, tree)


def _pure_dict(tree):
    """The saved `nnx.State` as `nnx.to_pure_dict` gives it: orbax stores each variable as
    {"value": array} and every dict key as a string, where list indices are ints."""
    if not isinstance(tree, dict):
        return tree
    if set(tree) == {"value"} and not isinstance(tree["value"], dict):
        return tree["value"]
    return {int(k) if isinstance(k, str) and k.isdigit() else k: _pure_dict(v)
            for k, v in tree.items()}


def key_to_json(key: jax.Array) -> list[int]:
    """A typed PRNG key as JSON-safe integers (its raw key data), exact."""
    return np.asarray(jax.random.key_data(key)).astype(np.int64).ravel().tolist()


def key_from_json(data: list[int], like: jax.Array) -> jax.Array:
    raw = np.asarray(data, dtype=np.asarray(jax.random.key_data(like)).dtype)
    return jax.random.wrap_key_data(raw.reshape(jax.random.key_data(like).shape),
                                    impl=jax.random.key_impl(like))


# How an error says that a disk or a quota is full: an OSError's errno, or the status text of
# tensorstore, which orbax writes arrays through and whose errors arrive as ValueError.
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXTS = tuple(os.strerror(code) for code in _DISK_FULL_ERRNOS) + tuple(
    f"os_error_code='{code}'" for code in _DISK_FULL_ERRNOS)


def disk_full_cause(err: BaseException | None) -> BaseException | None:
    """The error in `err`'s chain (itself, its cause or context) that says a disk is full. A
    FlaxlmError's text is flaxlm's own account of it: the system's words lie further down."""
    for cause in causes(err):
        if isinstance(cause, OSError) and cause.errno in _DISK_FULL_ERRNOS:
            return cause
        if not isinstance(cause, FlaxlmError) and any(text in str(cause)
                                                       for text in _DISK_FULL_TEXTS):
            return cause
    return None


def disk_full_text(err: BaseException) -> str | None:
    """What `disk_full_cause` says, in one line short enough for a message; None when nothing
    in `err`'s chain says a disk is full."""
    cause = disk_full_cause(err)
    if cause is None:
        return None
    text = str(cause).strip().splitlines()[0]
    if len(text) > 400:  # tensorstore's text: the file and the reason come last
        text = "…" + text[-400:]
    return text


class _DropDiskFullTracebacks(logging.Filter):
    """orbax's background threads log a full disk's error with its traceback, several times
    over, before the main thread raises it; flaxlm reports it once, as a message."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and disk_full_cause(record.exc_info[1]))


@functools.cache
def _split_only_large_replicated_arrays() -> None:
    """orbax's own array handler (its other settings the defaults) with a floor under
    replica-parallel slices: cutting each of a small model's replicated arrays into one slice
    per device compiles a slice program per array shape and copies each slice on its own,
    which costs more than writing the array from one replica."""
    ocp.type_handlers.register_type_handler(
        jax.Array,
        ocp.type_handlers.ArrayHandler(
            array_metadata_store=array_metadata_store.Store(),
            min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES,
        ),
        override=True,
    )


class _StoreFaultsInOneLine(logging.Filter):
    """orbax's threads log a bucket write that failed (the store gone, refusing) as an error
    with its traceback, in each thread that meets it (the step's metadata, each item, the
    commit, the finalize thread: a dozen tracebacks a process), before the run stops with
    flaxlm's paragraph. Their lines stay; the tracebacks of such a store fault go."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and (
                bucket_faults.classify(record.exc_info[1]) is not None
                or storage_retry.is_transient(record.exc_info[1])):
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_disk_full_logs() -> None:
    for name in ("absl", "asyncio"):  # orbax's logger; asyncio's "exception never retrieved"
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropDiskFullTracebacks) for f in logger.filters):
            logger.addFilter(_DropDiskFullTracebacks())
        if not any(isinstance(f, _StoreFaultsInOneLine) for f in logger.filters):
            logger.addFilter(_StoreFaultsInOneLine())


class _DropClosedLoopCallbacks:
    """`sys.unraisablehook` less the noise of a failed read or write. orbax runs a checkpoint's
    array writes (or reads) concurrently in an event loop of its own, which it closes as soon
    as one of them fails; each one still under way calls back into that closed loop when it
    ends, and tensorstore reports the `RuntimeError: Event loop is closed` as unraisable, one
    traceback per array, around the failure flaxlm reports. Those alone are dropped; anything
    else goes to the hook there was."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        if not _is_closed_loop_callback(unraisable):
            self.previous(unraisable)


def _is_closed_loop_callback(unraisable) -> bool:
    """The closed loop's complaint, whichever callback (and so whichever `object`, if any)
    tensorstore reports it for: asyncio raises it from `call_soon_threadsafe`, or from the
    check that method makes first."""
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"):
        return False
    frames = {frame.f_code.co_name for frame, _ in traceback.walk_tb(unraisable.exc_traceback)}
    return not frames or bool(frames & {"call_soon_threadsafe", "_check_closed"})


def _quiet_closed_loop_callbacks() -> None:
    if not isinstance(sys.unraisablehook, _DropClosedLoopCallbacks):
        sys.unraisablehook = _DropClosedLoopCallbacks(sys.unraisablehook)


def make_checkpointer(run_dir: str, settings: CheckpointConfig,
                      output_url: str | None = None,
                      after_save: Callable[[int], None] | None = None,
                      before_commit: Callable[[], None] | None = None) -> Checkpointer:
    if settings.every_steps is not None and settings.every_steps < 1:
        raise FlaxlmError(f"checkpoint.every_steps={settings.every_steps} must be at least 1 "
                          "(or null: only at epoch ends, the last step and on SIGTERM).")
    return Checkpointer(checkpoint_dir(run_dir, output_url), keep_last=settings.keep_last,
                        keep_best=settings.keep_best, async_save=settings.async_save,
                        after_save=after_save, before_commit=before_commit)


def close_quietly(checkpointer: Checkpointer | None) -> None:
    if checkpointer is None:
        return
    try:
        checkpointer.close()
    except Exception as err:  # noqa: BLE001 — already failing; say so, keep the first error
        if disk_full_cause(err) is None:  # a full disk is reported once, by disk_full_error
            print(f"flaxlm: closing the checkpointer failed too: {err}", file=sys.stderr)


def disk_full_error(err: BaseException, run_dir: str,
                    output_url: str | None = None) -> FlaxlmError | None:
    """A full disk or quota, met anywhere in the run (a checkpoint, metrics.jsonl, the
    export, a cache), as a message saying what is kept and how to go on; None for any other
    error. orbax saves a step under a temporary name, so a save that ran out of space never
    replaces the last complete checkpoint. With output_url the checkpoints are in the bucket."""
    text = disk_full_text(err)
    if text is None:
        return None
    try:
        steps = finalised_steps(checkpoint_dir(run_dir, output_url))
    except FlaxlmError:  # the bucket does not answer now: say nothing about its checkpoints
        steps = []
    kept = (f"Its last complete checkpoint, step {steps[-1]}, is intact: free some space and "
            "run the same command to resume."
            if steps else "It had saved no checkpoint yet: free some space and run the same "
            "command, which starts it again from step 0.")
    return FlaxlmError(f"A disk is full (or over its quota), so the run in {run_dir} stopped: "
                       f"{text}. {kept}")
