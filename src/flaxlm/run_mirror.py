"""A copy of the run's small files (metrics.jsonl, status.json, config.yaml, wandb_run_id) in
its bucket folder (output_url), beside the checkpoints, for a run whose hosts share no disk.

An object store has no append: each copy rewrites the whole object, which a reader sees old or
new, never half-written. Process 0 keeps appending to its local files as always and copies them
whole at the moments a resume or a reader depends on: at the start, after each evaluation is
logged, when each checkpoint save starts (so the bucket holds every line up to the checkpoint a
resume goes back to), and when the run ends, is preempted (after its last checkpoint is
written) or fails. A run killed outright
loses from the bucket only the lines after its last checkpoint, which a resume drops anyway.
A run resumed on a host without its local files starts from the bucket's metrics.jsonl and
continues its W&B run.
"""

from __future__ import annotations

import os
import sys
import time

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


def upload_run_files(run_dir: str, output_url: str) -> None:
    """Copy the run's small files to `output_url`, each whole, and, once, the model/ folder the
    run starts with (its tokenizer and config, which the tools that read the run's checkpoints
    from the bucket need). A failed copy is a warning: the next one rewrites every file, and
    training goes on (the checkpoints are what a resume needs, and they fail loudly)."""
    try:
        _upload_start_model(run_dir, output_url)
    except FlaxlmError as err:
        print(f"flaxlm: warning: could not copy model/ to the bucket ({err}); the next "
              "checkpoint copies it again", file=sys.stderr, flush=True)
    for name in MIRRORED_FILES:
        local = run_path(run_dir, name)
        if not os.path.exists(local):
            continue
        try:
            upload(local, f"{output_url}/{name}", SETTING)
        except FlaxlmError as err:
            print(f"flaxlm: warning: could not copy {name} to the bucket ({err}); the next "
                  "checkpoint copies it again", file=sys.stderr, flush=True)


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
