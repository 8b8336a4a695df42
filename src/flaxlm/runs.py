"""A run's directory and what it keeps between starts: claiming a fresh directory, deciding
whether a stopped run resumes in its own (after checking the config still describes the same
run), the lock, and the W&B run id. What a checkpoint holds and how a run continues from it is
`flaxlm.training.checkpoint`.

A new run never writes into another run's directory; a resumed run continues its own, under a
lock, so two runs never interleave in one directory. On several hosts process 0 opens the
directory (claim, lock, config.yaml, W&B run id, the resume decision) and the others follow it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
import shutil
import time

import fsspec
import jax
import yaml
from omegaconf import OmegaConf

from flaxlm import distributed
from flaxlm.config import ResumeMode, TrainConfig, dotted, upgrade_saved_config
from flaxlm.errors import FlaxlmError, writable_dir, yaml_error_text
from flaxlm.layout import (
    CHECKPOINT_SUBDIR,
    CONFIG_FILE,
    LOCK_FILE,
    METRICS_FILE,
    WANDB_ID_FILE,
    checkpoint_dir,
    run_path,
)
from flaxlm.run_mirror import download_resumed_files, keep_stopped_start
from flaxlm.storage import is_url
from flaxlm.training.checkpoint.manager import finalised_steps


def claim_run_dir(run_dir: str) -> str:
    """Create `run_dir` for this run alone: a directory that already holds a run is never
    written into (Hydra may have created it and put its .hydra/ folder there; that is fine).

    A start that failed before its first step (its metrics.jsonl empty, no checkpoint) left
    nothing to keep: this run takes its place, with a W&B run of its own. The caller holds the
    directory's lock (`open_run_dir` does), so a start that is still running is never taken
    for a failed one."""
    run_dir = os.path.abspath(os.path.expanduser(run_dir))
    os.makedirs(run_dir, exist_ok=True)
    try:
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
        os.close(os.open(run_path(run_dir, METRICS_FILE), flags, 0o644))
    except FileExistsError:
        if not _failed_start(run_dir):
            raise FlaxlmError(
                f"run_dir={run_dir} already holds a run (it has a metrics.jsonl) without a "
                "checkpoint to continue, and a new run never writes into an existing one. Leave "
                "run_dir / hydra.run.dir at its default (a fresh timestamped folder under "
                "outputs/) or choose a new directory."
            ) from None
        print(f"flaxlm: run_dir={run_dir} holds a start that failed before its first step "
              "(empty metrics.jsonl, no checkpoint); this run starts afresh in it", flush=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(run_path(run_dir, WANDB_ID_FILE))
    return run_dir


def _failed_start(run_dir: str) -> bool:
    """A run that stopped before logging a metric or starting a checkpoint: nothing in it is
    worth keeping (config.yaml and model/ are rewritten by the next start)."""
    checkpoints = run_path(run_dir, CHECKPOINT_SUBDIR)
    return (os.path.getsize(run_path(run_dir, METRICS_FILE)) == 0
            and not (os.path.isdir(checkpoints) and os.listdir(checkpoints)))


# Settings a resumed run may change: how often it logs, evaluates and checkpoints, how long it
# trains, where it logs (and the text samples it logs), and how the same global batch is spread
# over devices, hosts and the mesh, what it recomputes and which attention kernel computes the
# same function (a run may move between slice sizes, and between GPUs and TPUs).
# Anything else (model, tokenizer, data, optimizer, seed, ...) would make it another run.
RESUMABLE_CHANGES = (
    "run_dir", "resume_from", "output_url", "storage_retries.", "cache_dir", "logger.",
    "checkpoint.", "samples.",
    "trainer.log_every_steps", "trainer.eval_every_steps", "trainer.max_steps",
    "trainer.num_epochs", "trainer.eval_before_training", "trainer.resume",
    "trainer.resume_on_changed_data", "trainer.skip_nonfinite",
    "trainer.objective", "eval.",
    "hardware.name", "hardware.cpu_devices", "hardware.num_devices",
    "hardware.per_device_batch_size", "hardware.per_device_eval_batch_size",
    "hardware.peak_tflops_per_device", "hardware.hbm_gib_per_device",
    "hardware.hbm_gbps_per_device", "hardware.topology.", "hardware.distributed.",
    "hardware.mesh.", "model.remat", "model.attention",
    # The same attention under a context axis, computed another way (ring or all-gather).
    "model.context_attention",
    # The generator it comes to on the devices is checked against the checkpoint's instead
    # (auto is unsafe_rbg on a TPU, threefry elsewhere): flaxlm.training.checkpoint.resume.
    "hardware.dropout_rng",
    # Where the compiled steps come from: the same programs either way.
    "compiled_steps", "keep_compiled_steps",
)


@dataclasses.dataclass
class RunDir:
    """The run directory this process writes, held under an exclusive lock."""

    path: str
    resuming: bool
    wandb_run_id: str
    lock: int | None = None  # the lock file's descriptor

    def release(self) -> None:
        if self.lock is not None:
            os.close(self.lock)  # closing drops the flock
            self.lock = None


def open_run_dir(config: TrainConfig, resolved: dict) -> RunDir:
    """The directory to write: a fresh run's own (claimed), or, when it holds a checkpoint and
    trainer.resume allows, the stopped run's, after checking that the config still describes
    the same run."""
    mode = ResumeMode(config.trainer.resume)
    bucket = output_url_of(config)
    # resume_from=<URL> names the bucket's run; this host's files go to a new local run_dir.
    local_resume_from = None if bucket and config.resume_from == bucket else config.resume_from
    if not (local_resume_from or config.run_dir):
        raise FlaxlmError("run_dir is not set, so the run has no directory to write. Run "
                          "through flaxlm-train (Hydra sets it), or set run_dir=<directory>.")
    path = os.path.abspath(os.path.expanduser(local_resume_from or config.run_dir))
    if config.resume_from and mode == ResumeMode.never:
        raise FlaxlmError(
            f"resume_from={config.resume_from} asks to continue a run, but trainer.resume=never "
            "forbids it. Drop one of the two settings."
        )
    resuming = mode != ResumeMode.never and has_checkpoint(path, bucket)
    if not resuming and (mode == ResumeMode.must or config.resume_from):
        raise FlaxlmError(_nothing_to_resume(path, config.resume_from, mode, bucket))
    if bucket and mode == ResumeMode.never and has_checkpoint(path, bucket):
        raise FlaxlmError(
            f"output_url={bucket} already holds checkpoints of a run, and trainer.resume=never "
            "never writes over them. Choose a new output_url for a new run, or drop "
            "trainer.resume=never to continue that one."
        )
    if local_resume_from:
        path = writable_dir(path, "resume_from", "A run continues in its own directory: make "
                            "it writable, or resume from a writable copy of it.")
    else:
        path = writable_dir(path, "run_dir", "Set hydra.run.dir (or run_dir) to a directory "
                            "you can write to.")
    lock = _lock(path)
    try:
        if resuming and bucket and not os.path.exists(run_path(path, CONFIG_FILE)):
            # The run goes on on a host that has none of its local files: its checkpoints
            # hold the config it was started with.
            check_resumable_with(_bucket_config(bucket), bucket, resolved)
            claim_run_dir(path)
            save_config(path, resolved)
            # metrics.jsonl (the resume cuts it back to the checkpoint) and the W&B run id
            download_resumed_files(bucket, path)
        elif resuming:
            check_resumable(run_path(path, CONFIG_FILE), resolved)
        else:
            if mode != ResumeMode.never:
                _set_aside_start_without_checkpoint(path, resolved)
            claim_run_dir(path)
            save_config(path, resolved)
            if bucket:  # no checkpoint there (or resume=never refused above)
                keep_stopped_start(bucket)
        return RunDir(path, resuming, wandb_run_id(path), lock)
    except BaseException:
        os.close(lock)
        raise


def save_config(run_dir: str, resolved: dict) -> None:
    """The run's config.yaml, written to a temporary name and renamed into place: a run killed
    while it rewrites the file (`JobContext.record_in_config`) leaves the old one whole."""
    path = run_path(run_dir, CONFIG_FILE)
    OmegaConf.save(OmegaConf.create(resolved), f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


def open_shared_run_dir(config: TrainConfig, resolved: dict) -> RunDir:
    """`open_run_dir` on process 0; every other process gets its outcome (the directory,
    whether it resumes, the W&B run id), since `${now:}` in Hydra's run dir differs per host,
    and holds no lock of its own."""
    if jax.process_count() == 1:
        return open_run_dir(config, resolved)
    opened: list[RunDir] = []

    def open_on_primary() -> list:
        opened.append(open_run_dir(config, resolved))
        return [opened[0].path, opened[0].resuming, opened[0].wandb_run_id]

    path, resuming, run_id = distributed.from_primary("opening the run directory",
                                                      open_on_primary)
    if opened:
        return opened[0]
    if config.run_dir and not config.resume_from:
        _remove_own_hydra_dir(config.run_dir, path)
    return RunDir(path, resuming, run_id)


def _remove_own_hydra_dir(own: str, shared: str) -> None:
    """The folder Hydra made for this process alone (its own timestamp), when it holds only
    Hydra's files: the run's files are in `shared`."""
    own = os.path.abspath(os.path.expanduser(own))
    if own == shared or not os.path.isdir(own):
        return
    if all(name == ".hydra" or name.endswith(".log") for name in os.listdir(own)):
        shutil.rmtree(own, ignore_errors=True)


def _set_aside_start_without_checkpoint(run_dir: str, resolved: dict) -> None:
    """This same run, stopped (killed, out of memory) after logging metrics but before its
    first checkpoint, has nothing to continue from: it starts again from step 0, as a scheduler
    that requeues the same command expects. Its metrics.jsonl is kept under another name, and
    the new start gets a W&B run of its own. A directory with another config is left alone
    (`claim_run_dir` refuses it)."""
    metrics = run_path(run_dir, METRICS_FILE)
    if (not os.path.isfile(metrics) or os.path.getsize(metrics) == 0 or has_checkpoint(run_dir)
            or _config_changes(run_path(run_dir, CONFIG_FILE), resolved) != []):
        return
    kept = f"{metrics}.stopped-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    os.replace(metrics, kept)
    with contextlib.suppress(FileNotFoundError):
        os.remove(run_path(run_dir, WANDB_ID_FILE))
    print(f"flaxlm: run_dir={run_dir} holds this run stopped before its first checkpoint, so "
          f"it starts again from step 0; the metrics it had logged are kept in {kept}",
          flush=True)


def output_url_of(config: TrainConfig) -> str | None:
    """The run's folder in a bucket: output_url, or resume_from when that is a URL (the
    output_url of the run to continue); None when the run keeps everything in run_dir.
    Checkpoints in a bucket go through orbax and tensorstore's gcs or s3 driver."""
    url = config.output_url
    if config.resume_from and is_url(config.resume_from):
        if url and url.rstrip("/") != config.resume_from.rstrip("/"):
            raise FlaxlmError(
                f"resume_from={config.resume_from} and output_url={url} name two different "
                "runs in a bucket. Give one of them: the run's own output_url continues it."
            )
        url = config.resume_from
    if not url:
        return None
    if not is_url(url):
        raise FlaxlmError(
            f"output_url={url} is not a URL. output_url takes the run's folder in a bucket "
            "(gs://bucket/runs/name); a folder on a disk (a shared one too: NFS, a gcsfuse "
            "mount) is run_dir (hydra.run.dir)."
        )
    scheme = url.partition("://")[0].lower()
    if scheme not in ("gs", "s3"):
        raise FlaxlmError(
            f"output_url={url}: checkpoints in a bucket are written through tensorstore, "
            "which flaxlm points at gs:// and s3:// buckets only. Use one of those, or mount "
            "the bucket on every host at the same path and give that path as run_dir."
        )
    return url.rstrip("/")


def _bucket_config(bucket: str) -> dict | None:
    """The resolved config in the newest readable checkpoint under `bucket` (its `meta` item,
    JSON), None when no checkpoint's can be read."""
    directory = checkpoint_dir("", bucket)
    for step in reversed(finalised_steps(directory)):
        try:
            with fsspec.open(f"{directory}/{step}/meta/metadata", "r", encoding="utf-8") as f:
                return json.load(f)["config"]
        except Exception:  # noqa: BLE001 — a damaged one: restore_latest says why, later
            continue
    return None


def _nothing_to_resume(path: str, resume_from: str | None, mode: ResumeMode,
                       bucket: str | None = None) -> str:
    checkpoints = checkpoint_dir(path, bucket)
    missing = "" if bucket or os.path.isdir(path) else f" ({path} does not exist)"
    if resume_from:
        return (f"resume_from={resume_from} has no complete checkpoint to resume in "
                f"{checkpoints}{missing}. Point resume_from at the directory of a run that "
                "saved a checkpoint, or drop resume_from to start a new run.")
    return (f"trainer.resume={mode.value}, but there is no complete checkpoint in "
            f"{checkpoints}{missing}. Point run_dir (or resume_from) at the directory of a run "
            "that saved a checkpoint, or set trainer.resume=auto to start a new run when there "
            "is none.")


def has_checkpoint(run_dir: str, output_url: str | None = None) -> bool:
    return bool(finalised_steps(checkpoint_dir(run_dir, output_url)))


def check_resumable(saved_config_path: str, resolved: dict) -> None:
    """Resuming with a config that would train something else fails, naming each difference."""
    changed = _config_changes(saved_config_path, resolved)
    if changed is None:
        raise FlaxlmError(f"{saved_config_path} is missing, so this run cannot be checked "
                          "before resuming it. " + _config_restore_advice(saved_config_path))
    _refuse_changes(changed, os.path.dirname(saved_config_path))


def check_resumable_with(saved: dict | None, where: str, resolved: dict) -> None:
    """`check_resumable` against `saved`, the config of the run in `where` (a bucket's run,
    read from its checkpoint)."""
    if saved is None:
        raise FlaxlmError(f"No checkpoint in {where} holds a readable config, so this run "
                          "cannot be checked before resuming it. Start a new run with a new "
                          "output_url.")
    _refuse_changes(_changes(saved, resolved), where)


def _refuse_changes(changed: list[str], where: str) -> None:
    layout = [change for change in changed if change.startswith("model.scan_layers:")]
    if layout:
        raise FlaxlmError(_other_layout_message(where, layout[0]))
    if changed:
        raise FlaxlmError(
            f"Cannot resume the run in {where}: this config changes "
            "what it trains (" + "; ".join(changed) + "). A resumed run may only change "
            "logging, evaluation and checkpoint cadence, trainer.max_steps / num_epochs, the "
            "logger and how the batch is spread over devices. Resume with the run's own "
            "settings, or start a new run (trainer.resume=never, or a new run_dir)."
        )


def _other_layout_message(run_dir: str, change: str) -> str:
    """A resume in the other parameter layout (`change`: "model.scan_layers: old → new"):
    the checkpoints hold the parameters and the optimizer state in the old one."""
    saved, wanted = (side.strip().lower() for side in change.split(":", 1)[1].split("→"))
    layout = "stacked, one array per parameter for all layers" if saved == "true" \
        else "one entry per layer"
    return (
        f"Cannot resume the run in {run_dir} with model.scan_layers={wanted}: its checkpoints "
        f"hold the parameters and the optimizer state in the layout of "
        f"model.scan_layers={saved} ({layout}), and a resume continues in it. Resume with "
        f"model.scan_layers={saved}; or, to go on in the other layout without the optimizer "
        f"state, export the run (flaxlm-export {run_dir} --out <dir>) and start a new run with "
        f"model.init_from=<dir> model.scan_layers={wanted}."
    )


def _config_restore_advice(saved_config_path: str) -> str:
    """How to get a run's config.yaml back: every checkpoint holds the resolved config of the
    start that wrote it (`meta/metadata`, JSON, key "config")."""
    run_dir = os.path.dirname(saved_config_path)
    steps = finalised_steps(run_path(run_dir, CHECKPOINT_SUBDIR))
    if not steps:
        return "Restore the file, or start a new run."
    metadata = os.path.join(run_path(run_dir, CHECKPOINT_SUBDIR), str(steps[-1]), "meta",
                            "metadata")
    return (
        f"Its checkpoint at step {steps[-1]} holds the run's config ({metadata}, key "
        "\"config\"): restore the file from it with\n"
        f"  python -c \"import json, yaml; yaml.safe_dump(json.load(open('{metadata}'))"
        f"['config'], open('{saved_config_path}', 'w'))\"\n"
        "then run the same command again; or start a new run."
    )


def _config_changes(saved_config_path: str, resolved: dict) -> list[str] | None:
    """Each setting that differs from the saved config and would make it another run, as
    "key: old → new"; None when there is no saved config."""
    if not os.path.exists(saved_config_path):
        return None
    try:
        saved = OmegaConf.to_container(OmegaConf.load(saved_config_path), resolve=True)
    except yaml.YAMLError as err:
        raise FlaxlmError(
            f"Cannot resume the run in {os.path.dirname(saved_config_path)}: the config it is "
            f"checked against is damaged ({yaml_error_text(err)}). Restore the file, or start a "
            "new run."
        ) from None
    return _changes(saved, resolved)


def _changes(saved_config: dict, resolved: dict) -> list[str]:
    saved = dotted(upgrade_saved_config(saved_config))
    current = dotted(resolved)
    # Keys only one side has are settings added (or removed) by a flaxlm upgrade in between:
    # the run did not use them, so they do not make it another run.
    return [
        f"{key}: {saved[key]!r} → {current[key]!r}"
        for key in sorted(set(saved) & set(current))
        if saved[key] != current[key] and not key.startswith(RESUMABLE_CHANGES)
    ]


def _lock(run_dir: str) -> int:
    """One process at a time in a run directory: two resumes of one run would interleave."""
    descriptor = os.open(run_path(run_dir, LOCK_FILE), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise FlaxlmError(
            f"Another process is training in run_dir={run_dir} right now. Wait for it to stop, "
            "or start a new run in another directory."
        ) from None
    return descriptor


@contextlib.contextmanager
def held_run_dir(run_dir: str):
    """The run directory's lock for a tool that writes into a finished run (flaxlm-eval
    logging its results): yields True while held, or False at once if a run is training
    there, whose files the tool must then leave alone."""
    descriptor = os.open(run_path(run_dir, LOCK_FILE), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(descriptor)  # which releases the lock


def wandb_run_id(run_dir: str) -> str:
    """The W&B run id of this run directory, made once and kept in the directory, so that a
    resumed run continues the same W&B run. Started by a W&B sweep agent, the run takes the id
    the agent assigned (WANDB_RUN_ID): a run under another id would not belong to the sweep."""
    path = run_path(run_dir, WANDB_ID_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    agent_id = os.environ.get("WANDB_RUN_ID") if os.environ.get("WANDB_SWEEP_ID") else None
    run_id = agent_id or secrets.token_hex(4)  # W&B's own ids are 8 lowercase alphanumerics
    with open(path, "w", encoding="utf-8") as f:
        f.write(run_id + "\n")
    return run_id
