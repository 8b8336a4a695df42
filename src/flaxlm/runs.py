"""A run's directory and what it keeps between starts: claiming a fresh directory, resuming a
stopped run in its own (after checking the config still describes the same run), the W&B run
id, and the glue between the train loop and the checkpointer (what a checkpoint holds beside
the train state, and restoring it all).

A new run never writes into another run's directory; a resumed run continues its own, under a
lock, so two runs never interleave in one directory. On several hosts process 0 opens the
directory (claim, lock, config.yaml, W&B run id, the resume decision) and the others follow it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import secrets
import shutil
import sys
import time
from typing import Any, NamedTuple

import jax
import yaml
from omegaconf import OmegaConf

from flaxlm import distributed
from flaxlm.config import (
    CheckpointConfig,
    ResumeMode,
    TrainConfig,
    dotted,
    upgrade_saved_config,
)
from flaxlm.data.loader import DATA_SIZE_KEYS
from flaxlm.errors import FlaxlmError, writable_dir, yaml_error_text
from flaxlm.layout import (
    CHECKPOINT_SUBDIR,
    CONFIG_FILE,
    LOCK_FILE,
    METRICS_FILE,
    WANDB_ID_FILE,
    run_path,
)
from flaxlm.training.checkpoint import (
    Checkpointer,
    disk_full_cause,
    disk_full_text,
    finalised_steps,
    key_from_json,
)
from flaxlm.training.loop import LoopState


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
# over devices, hosts and the mesh, and what it recomputes (a run may move between slice sizes).
# Anything else (model, tokenizer, data, optimizer, seed, ...) would make it another run.
RESUMABLE_CHANGES = (
    "run_dir", "resume_from", "cache_dir", "logger.", "checkpoint.", "samples.",
    "trainer.log_every_steps", "trainer.eval_every_steps", "trainer.max_steps",
    "trainer.num_epochs", "trainer.eval_before_training", "trainer.resume",
    "trainer.resume_on_changed_data", "trainer.skip_nonfinite",
    "trainer.objective",
    "hardware.name", "hardware.cpu_devices", "hardware.num_devices",
    "hardware.per_device_batch_size", "hardware.per_device_eval_batch_size",
    "hardware.peak_tflops_per_device", "hardware.distributed.", "hardware.mesh.", "model.remat",
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
    if not (config.resume_from or config.run_dir):
        raise FlaxlmError("run_dir is not set, so the run has no directory to write. Run "
                          "through flaxlm-train (Hydra sets it), or set run_dir=<directory>.")
    path = os.path.abspath(os.path.expanduser(config.resume_from or config.run_dir))
    if config.resume_from and mode == ResumeMode.never:
        raise FlaxlmError(
            f"resume_from={config.resume_from} asks to continue a run, but trainer.resume=never "
            "forbids it. Drop one of the two settings."
        )
    resuming = mode != ResumeMode.never and has_checkpoint(path)
    if not resuming and (mode == ResumeMode.must or config.resume_from):
        raise FlaxlmError(_nothing_to_resume(path, config.resume_from, mode))
    if config.resume_from:
        path = writable_dir(path, "resume_from", "A run continues in its own directory: make "
                            "it writable, or resume from a writable copy of it.")
    else:
        path = writable_dir(path, "run_dir", "Set hydra.run.dir (or run_dir) to a directory "
                            "you can write to.")
    lock = _lock(path)
    try:
        if resuming:
            check_resumable(run_path(path, CONFIG_FILE), resolved)
        else:
            if mode != ResumeMode.never:
                _set_aside_start_without_checkpoint(path, resolved)
            claim_run_dir(path)
            OmegaConf.save(OmegaConf.create(resolved), run_path(path, CONFIG_FILE))
        return RunDir(path, resuming, _wandb_run_id(path), lock)
    except BaseException:
        os.close(lock)
        raise


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


def _nothing_to_resume(path: str, resume_from: str | None, mode: ResumeMode) -> str:
    checkpoints = run_path(path, CHECKPOINT_SUBDIR)
    missing = "" if os.path.isdir(path) else f" ({path} does not exist)"
    if resume_from:
        return (f"resume_from={resume_from} has no complete checkpoint to resume in "
                f"{checkpoints}{missing}. Point resume_from at the directory of a run that "
                "saved a checkpoint, or drop resume_from to start a new run.")
    return (f"trainer.resume={mode.value}, but there is no complete checkpoint in "
            f"{checkpoints}{missing}. Point run_dir (or resume_from) at the directory of a run "
            "that saved a checkpoint, or set trainer.resume=auto to start a new run when there "
            "is none.")


def has_checkpoint(run_dir: str) -> bool:
    return bool(finalised_steps(run_path(run_dir, CHECKPOINT_SUBDIR)))


def check_resumable(saved_config_path: str, resolved: dict) -> None:
    """Resuming with a config that would train something else fails, naming each difference."""
    changed = _config_changes(saved_config_path, resolved)
    if changed is None:
        raise FlaxlmError(f"{saved_config_path} is missing, so this run cannot be checked "
                          "before resuming it. " + _config_restore_advice(saved_config_path))
    if changed:
        raise FlaxlmError(
            f"Cannot resume the run in {os.path.dirname(saved_config_path)}: this config changes "
            "what it trains (" + "; ".join(changed) + "). A resumed run may only change "
            "logging, evaluation and checkpoint cadence, trainer.max_steps / num_epochs, the "
            "logger and how the batch is spread over devices. Resume with the run's own "
            "settings, or start a new run (trainer.resume=never, or a new run_dir)."
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
        saved = dotted(upgrade_saved_config(
            OmegaConf.to_container(OmegaConf.load(saved_config_path), resolve=True)))
    except yaml.YAMLError as err:
        raise FlaxlmError(
            f"Cannot resume the run in {os.path.dirname(saved_config_path)}: the config it is "
            f"checked against is damaged ({yaml_error_text(err)}). Restore the file, or start a "
            "new run."
        ) from None
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


def _wandb_run_id(run_dir: str) -> str:
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


# The checkpoint metadata that fingerprints the run's data: {what: content hash}, e.g.
# {"training data": ..., "validation data": ...}, as the task names them.
DATA_FINGERPRINT_KEY = "data_fingerprint"
# The metrics.jsonl record (and W&B table) of a resume that accepted changed data.
CHANGED_DATA_RECORD = "resume/changed_data"


class Resumed(NamedTuple):
    """A stopped run as its latest checkpoint left it."""

    state: Any
    dropout_key: jax.Array
    loop: LoopState
    saved_config: dict  # the resolved config of the start that wrote the checkpoint


def restore_run(checkpointer: Checkpointer, state, dropout_key, loader, tokenizer_hash: str,
                tracker, run_dir: str, *, data_fingerprint: dict[str, str],
                accept_changed_data: bool = False) -> Resumed:
    """The run's latest complete checkpoint, after checking that the data (`data_fingerprint`
    against the checkpoint's), the tokenizer and the loader's data order are the run's own;
    `loader` continues from the checkpoint's position and metrics.jsonl is cut back to the
    checkpoint's step. Changed data stops the resume unless `accept_changed_data`
    (trainer.resume_on_changed_data); then the change is recorded in metrics.jsonl. Any train
    loop whose checkpoints carry `tokenizer_sha256`, `dropout_key`, `loop` and
    `data_fingerprint` metadata (as `CheckpointSaver` + `fit` write them) can resume with it."""
    restored = checkpointer.restore_latest(state)
    if restored is None:
        raise FlaxlmError(
            f"run_dir={run_dir} has checkpoints, but none of them could be read (see the "
            "messages above), so the run cannot be continued. Start a new run "
            "(trainer.resume=never with a new run_dir)."
        )
    saved_data = restored.metadata.get(DATA_FINGERPRINT_KEY) or {}
    changed = [what for what, fingerprint in data_fingerprint.items()
               if what in saved_data and saved_data[what] != fingerprint]
    _check_same_tokenizer(restored.metadata.get("tokenizer_sha256"), tokenizer_hash, run_dir,
                         changed)
    if changed and not accept_changed_data:
        raise FlaxlmError(_changed_data_message(changed, saved_data, data_fingerprint,
                                                restored.step, run_dir))
    saved_loader = own_loader_state(restored.loader_state, run_dir)
    if changed:  # accepted: the data's size may have changed with it (the loop counts steps)
        current_loader = loader.state_dict()
        saved_loader.update({key: current_loader[key] for key in DATA_SIZE_KEYS
                             if key in current_loader})
    loader.load_state_dict(saved_loader)
    dropout_key = key_from_json(restored.metadata["dropout_key"], dropout_key)
    resume = LoopState.from_json(restored.metadata["loop"])
    dropped = tracker.rewind(restored.step, evaluates_again=resume.eval_due is not None)
    print(f"flaxlm: resuming {run_dir} from its checkpoint at step {restored.step} "
          f"(epoch {resume.epoch + 1}, step {resume.step_in_epoch} of it); "
          f"{dropped} metrics.jsonl line(s) after it dropped", flush=True)
    unchecked = [what for what in data_fingerprint if what not in saved_data]
    if unchecked:
        print(f"flaxlm: the checkpoint at step {restored.step} records no fingerprint of the "
              f"{' and '.join(unchecked)} (an earlier flaxlm wrote it), so this resume cannot "
              "check that the data is the run's own; the checkpoints it writes record it",
              flush=True)
    if changed:
        _record_changed_data(tracker, changed, saved_data, data_fingerprint, restored.step)
    return Resumed(restored.state, dropout_key, resume, restored.metadata.get("config") or {})


def _check_same_tokenizer(saved_hash: str | None, tokenizer_hash: str, run_dir: str,
                          changed_data: list[str]) -> None:
    """Token ids must mean the same words as in the checkpoint; no setting accepts otherwise."""
    if saved_hash == tokenizer_hash:
        return
    cause = (f" The {' and '.join(changed_data)} changed too, and a tokenizer trained on the "
             "training data changes with it." if changed_data else "")
    raise FlaxlmError(
        f"The tokenizer differs from the one run_dir={run_dir} was trained with (hash "
        f"{str(saved_hash)[:12]} → {tokenizer_hash[:12]}): its token ids would mean other "
        f"words.{cause} Resume with the run's tokenizer settings (tokenizer.*, language.*) and "
        "data, or start a new run (trainer.resume=never with a new run_dir)."
    )


def _changed_data_message(changed: list[str], saved: dict, current: dict, step: int,
                          run_dir: str) -> str:
    fingerprints = "; ".join(f"{what}: {saved[what][:12]} → {current[what][:12]}"
                             for what in changed)
    return (
        f"Cannot resume the run in {run_dir}: its {' and '.join(changed)} changed since its "
        f"checkpoint at step {step} was written (content fingerprint {fingerprints}), although "
        "the config is the same: a file was edited or the dataset has a new version. Resuming "
        "would continue the run on other data than it started with, and its later "
        "evaluations would not compare with the earlier ones. Restore the run's data; or "
        "resume on the changed data knowingly with trainer.resume_on_changed_data=true "
        f"(recorded as {CHANGED_DATA_RECORD} in metrics.jsonl); or start a new run "
        "(trainer.resume=never with a new run_dir)."
    )


def _record_changed_data(tracker, changed: list[str], saved: dict, current: dict,
                         step: int) -> None:
    """Say it, and keep it where the run's curves are read: the steps after `step` are
    trained (and evaluated) on changed data."""
    print(f"flaxlm: trainer.resume_on_changed_data=true: the run continues from step {step} on "
          f"changed {' and '.join(changed)}; recorded as {CHANGED_DATA_RECORD} in "
          "metrics.jsonl", flush=True)
    tracker.log_table(CHANGED_DATA_RECORD, ["data", "checkpoint fingerprint", "new fingerprint"],
                      [[what, saved[what], current[what]] for what in changed], step=step + 1)


# A multi-process checkpoint's loader state holds every process's own position under this key
# (by process index), beside process 0's: orbax writes JSON items from process 0 only.
PER_PROCESS_KEY = "per_process"


def own_loader_state(saved: dict, run_dir: str) -> dict:
    """This process's loader position in a checkpoint's loader state. A stream's position
    belongs to the process that read it: a run that changed its number of processes cannot
    continue it (packed blocks are read by (epoch, step), the same on every process)."""
    per_process = saved.get(PER_PROCESS_KEY, {"0": saved})
    mine = per_process.get(str(jax.process_index()))
    if saved.get("kind") == "stream" and (mine is None
                                           or len(per_process) != jax.process_count()):
        raise FlaxlmError(
            f"The checkpoint in run_dir={run_dir} holds the stream positions of "
            f"{len(per_process)} process(es), and this run has {jax.process_count()}: each "
            "process reads its own share of a streamed corpus, so the shares would change. "
            "Resume on as many processes (hosts) as the run was saved with, or start a new run."
        )
    return {k: v for k, v in (mine or saved).items() if k != PER_PROCESS_KEY}


class CheckpointSaver:
    """The loop's `save`: adds the loader's position (every process's, on several hosts) and
    the run's metadata to each checkpoint, and times how long the loop waits for each save."""

    def __init__(self, checkpointer: Checkpointer, loader, metadata: dict):
        self.checkpointer, self.loader, self.metadata = checkpointer, loader, metadata
        self.seconds: list[float] = []

    def __call__(self, step: int, state, loop_state: LoopState, metrics) -> None:
        began = time.perf_counter()
        loader_state = {**self.loader.state_dict(), "epoch": loop_state.epoch,
                        "step_in_epoch": loop_state.step_in_epoch}
        if jax.process_count() > 1:
            positions = distributed.all_gather(f"the loader positions at step {step}",
                                               loader_state)
            loader_state = {**positions[0], PER_PROCESS_KEY: {
                str(index): position for index, position in enumerate(positions)}}
        self.checkpointer.save(step, state, loader_state,
                               {**self.metadata, "loop": loop_state.to_json()}, metrics)
        self.seconds.append(time.perf_counter() - began)

    def raise_failed(self) -> None:
        self.checkpointer.raise_failed_save()

    def describe(self) -> str:
        if not self.seconds:
            return "no checkpoint saved by this process"
        return (f"{len(self.seconds)} checkpoint(s) in {self.checkpointer.directory}; the loop "
                f"waited {sum(self.seconds):.2f}s for them (longest {max(self.seconds):.2f}s)")


def make_checkpointer(run_dir: str, settings: CheckpointConfig) -> Checkpointer:
    if settings.every_steps is not None and settings.every_steps < 1:
        raise FlaxlmError(f"checkpoint.every_steps={settings.every_steps} must be at least 1 "
                          "(or null: only at epoch ends, the last step and on SIGTERM).")
    return Checkpointer(run_path(run_dir, CHECKPOINT_SUBDIR), keep_last=settings.keep_last,
                        keep_best=settings.keep_best, async_save=settings.async_save)


def close_quietly(checkpointer: Checkpointer | None) -> None:
    if checkpointer is None:
        return
    try:
        checkpointer.close()
    except Exception as err:  # noqa: BLE001 — already failing; say so, keep the first error
        if disk_full_cause(err) is None:  # a full disk is reported once, by disk_full_error
            print(f"flaxlm: closing the checkpointer failed too: {err}", file=sys.stderr)


def disk_full_error(err: BaseException, run_dir: str) -> FlaxlmError | None:
    """A full disk or quota, met anywhere in the run (a checkpoint, metrics.jsonl, the
    export, a cache), as a message saying what is kept and how to go on; None for any other
    error. orbax saves a step under a temporary name, so a save that ran out of space never
    replaces the last complete checkpoint."""
    text = disk_full_text(err)
    if text is None:
        return None
    steps = finalised_steps(run_path(run_dir, CHECKPOINT_SUBDIR))
    kept = (f"Its last complete checkpoint, step {steps[-1]}, is intact: free some space and "
            "run the same command to resume."
            if steps else "It had saved no checkpoint yet: free some space and run the same "
            "command, which starts it again from step 0.")
    return FlaxlmError(f"A disk is full (or over its quota), so the run in {run_dir} stopped: "
                       f"{text}. {kept}")
