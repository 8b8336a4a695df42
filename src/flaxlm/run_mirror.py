"""A copy of the run's small files (metrics.jsonl, status.json, config.yaml, wandb_run_id) in
its bucket folder (output_url), beside the checkpoints, for a run whose hosts share no disk.

An object store has no append: each copy rewrites the whole object, which a reader sees old or
new, never half-written. Process 0 keeps appending to its local files as always and copies them
whole at the moments a resume or a reader depends on: at the start, after each evaluation is
logged, when each checkpoint save starts, and when the run ends, is preempted (after its last
checkpoint is written) or fails.

The copies are made by one background thread (`RunMirror`, `flaxlm.background_upload`), so a
slow store never stalls training; a file asked for again before its copy went up is copied
once, newest. Two moments wait for them, each for a bounded time (a warning names what was not
copied): an asynchronous checkpoint is committed (its commit file written, orbax's own thread)
only once the bucket has the copies made for it, so the bucket holds every line up to the
checkpoint a resume goes back to; and the run's end (finished, preempted or failed) flushes
what is pending before it reports. A run killed outright loses from the bucket only the lines
after its last checkpoint, which a resume drops anyway.
A run resumed on a host without its local files starts from the bucket's metrics.jsonl and
continues its W&B run.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable

from flaxlm import storage_retry
from flaxlm.background_upload import BackgroundUploader
from flaxlm.errors import FlaxlmError
from flaxlm.layout import (
    ADAPTER_SUBDIR,
    CONFIG_FILE,
    EXPORT_MARKER,
    METRICS_FILE,
    MODEL_CONFIG_FILE,
    MODEL_SUBDIR,
    STATUS_FILE,
    WANDB_ID_FILE,
    run_path,
)
from flaxlm.storage import download, exists, move_objects, upload, upload_folder

MIRRORED_FILES = (METRICS_FILE, STATUS_FILE, CONFIG_FILE, MODEL_CONFIG_FILE, WANDB_ID_FILE)
# What a resume on a host without the run's local files takes from the bucket: the lines up to
# the checkpoint, and the W&B run to continue.
RESUMED_FILES = (METRICS_FILE, WANDB_ID_FILE)
SETTING = "output_url"
TOKENIZER_FILE = "tokenizer.json"
# How long a checkpoint's commit, and the run's end, wait for the copies asked for before them:
# long enough for a slow store's few requests, short enough for a preemption's grace period.
# The copies' own tries (storage_retries: one to two minutes of waits by default) end with it.
FLUSH_TIMEOUT_S = 60.0


class RunMirror:
    """Process 0's copies of the run's small files to `output_url`, made in the background: the
    caller's `request` returns at once. A failed copy is a warning, as a synchronous one was."""

    def __init__(self, run_dir: str, output_url: str, flush_timeout_s: float = FLUSH_TIMEOUT_S):
        self.run_dir, self.output_url = run_dir, output_url
        self.flush_timeout_s = flush_timeout_s
        self._uploader = BackgroundUploader(_warn_not_copied, thread_name="flaxlm-run-mirror")

    def request(self) -> None:
        """Queue a copy of model/ as the run starts it (`upload_run_files`) and of each small
        file the run has, read when it goes up: the newest."""
        for name, copy in _copies(self.run_dir, self.output_url):
            self._uploader.request(name, functools.partial(self._within_flush, copy))

    def _within_flush(self, copy: Callable[[], None]) -> None:
        """`copy`, its tries (storage_retries: minutes, against a dead store) ending when a
        flush that waits for it gives up: a flush's bound is then the whole wait, and no copy
        retries on behind the run's end."""
        with storage_retry.deadline(self._uploader.flush_ends):
            copy()

    def request_and_wait(self) -> None:
        """Copy every small file now and wait for the copies (bounded): what an asynchronous
        checkpoint's commit calls, on orbax's thread, so that the bucket holds every metrics
        line up to a checkpoint before the checkpoint counts as complete."""
        self.request()
        self._warn_unfinished(self._uploader.flush(self.flush_timeout_s))

    def finish(self) -> None:
        """The run's last copy (its final status.json and metrics lines), waited for (bounded),
        and the thread let go."""
        self.request()
        self._warn_unfinished(self._uploader.close(self.flush_timeout_s))

    def _warn_unfinished(self, names: list[str]) -> None:
        if names:
            print(f"flaxlm: warning: {', '.join(names)} not yet copied to {self.output_url} "
                  f"after {self.flush_timeout_s:.0f}s (a slow or unreachable store); the bucket "
                  f"may hold older copies, the local ones in {self.run_dir} are whole",
                  file=sys.stderr, flush=True)


def _upload_file(local: str, url: str) -> None:
    upload(local, url, SETTING)  # looked up at each call: tests slow it down


def _warn_not_copied(name: str, err: Exception) -> None:
    cause = err if isinstance(err, FlaxlmError) else f"{type(err).__name__}: {err}"
    print(f"flaxlm: warning: could not copy {name} to the bucket ({cause}); the next "
          "checkpoint copies it again", file=sys.stderr, flush=True)


def upload_run_files(run_dir: str, output_url: str) -> None:
    """Copy the run's small files to `output_url`, each whole, and, once, the model/ folder the
    run starts with (its tokenizer and config, which the tools that read the run's checkpoints
    from the bucket need), here and now: what `RunMirror` does in the background. A failed
    copy is a warning: the next one rewrites every file, and training goes on (the checkpoints
    are what a resume needs, and they fail loudly)."""
    for name, copy in _copies(run_dir, output_url):
        try:
            copy()
        except FlaxlmError as err:
            _warn_not_copied(name, err)


def _copies(run_dir: str, output_url: str) -> list[tuple[str, Callable[[], None]]]:
    """(name, copy) of model/ as the run starts it and of each small file the run has."""
    copies = [(f"{MODEL_SUBDIR}/", functools.partial(_upload_start_model, run_dir, output_url))]
    for name in MIRRORED_FILES:
        local = run_path(run_dir, name)
        if os.path.exists(local):
            copies.append((name, functools.partial(_upload_file, local, f"{output_url}/{name}")))
    return copies


def upload_exports(run_dir: str, output_url: str) -> None:
    """Copy the run's final model/ (and a LoRA run's adapter/) to `<output_url>/model/`
    (`adapter/`), at the end of a run that finished: files first, the export's marker
    (flaxlm_export.json) last, so that a copy cut short is a folder without a marker, never one
    that looks whole (`flaxlm.storage.upload_folder`). Unlike the small files, a copy that
    fails fails the run: the bucket is where its hosts keep what they make."""
    for name in (MODEL_SUBDIR, ADAPTER_SUBDIR):
        local = run_path(run_dir, name)
        if os.path.exists(os.path.join(local, EXPORT_MARKER)):
            upload_folder(local, f"{output_url}/{name}", SETTING, EXPORT_MARKER)
            print(f"flaxlm: copied {name}/ to {output_url}/{name}", flush=True)


def _upload_start_model(run_dir: str, output_url: str) -> None:
    """model/ as the run started it (no export marker yet), if the bucket has no tokenizer
    there: copied without a marker, so it never passes for a final export."""
    local = run_path(run_dir, MODEL_SUBDIR)
    if (not os.path.isfile(os.path.join(local, TOKENIZER_FILE))
            or os.path.exists(os.path.join(local, EXPORT_MARKER))):
        return
    remote = f"{output_url}/{MODEL_SUBDIR}"
    if not exists(f"{remote}/{TOKENIZER_FILE}", SETTING):
        upload_folder(local, remote, SETTING, EXPORT_MARKER)


def keep_stopped_start(output_url: str) -> None:
    """A start of this run stopped before its first checkpoint left its metrics.jsonl in the
    bucket, which this new start (from step 0) would copy over: it is kept beside it as
    metrics.jsonl.stopped-<time>, as on disk (flaxlm.runs)."""
    remote = f"{output_url}/{METRICS_FILE}"
    if not exists(remote, SETTING):
        return
    kept = f"{remote}.stopped-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    move_objects(remote, kept, SETTING)
    print(f"flaxlm: {output_url} holds the metrics of a start without a checkpoint; this run "
          f"starts from step 0 and keeps them in {kept}", flush=True)


def download_resumed_files(output_url: str, run_dir: str) -> None:
    """The bucket's metrics.jsonl and wandb_run_id over the local ones (a new local run_dir's:
    an empty metrics.jsonl) of a run resumed on another host; each one the bucket lacks is left
    as it is."""
    for name in RESUMED_FILES:
        remote = f"{output_url}/{name}"
        if not exists(remote, SETTING):
            continue
        local = run_path(run_dir, name)
        download(remote, f"{local}.tmp", SETTING)
        os.replace(f"{local}.tmp", local)
