"""What a run's checkpoint holds beside the train state, written and read back: the loader's
position (every process's), the dropout key, the loop's state, the tokenizer's hash and the
data's fingerprint. `CheckpointSaver` is the loop's `save`; `restore_run` resumes a stopped run
from its latest checkpoint after checking that its tokenizer and data are the run's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from flaxlm import distributed
from flaxlm.data.loader import DATA_SIZE_KEYS
from flaxlm.errors import FlaxlmError
from flaxlm.training.checkpoint.manager import Checkpointer, key_from_json
from flaxlm.training.keys import IMPLEMENTATIONS, key_impl_name
from flaxlm.training.loop import LoopState

# The checkpoint metadata that fingerprints the run's data: {what: content hash}, e.g.
# {"training data": ..., "validation data": ...}, as the task names them.
DATA_FINGERPRINT_KEY = "data_fingerprint"
# The checkpoint metadata that names the dropout key's implementation (hardware.dropout_rng
# as the run's platform resolved it); absent: JAX's default, threefry2x32.
DROPOUT_RNG_KEY = "dropout_rng"
# The metrics.jsonl record (and W&B table) of a resume that accepted changed data.
CHANGED_DATA_RECORD = "resume/changed_data"


class Resumed(NamedTuple):
    """A stopped run as its latest checkpoint left it."""

    state: Any
    dropout_key: jax.Array
    loop: LoopState
    saved_config: dict  # the resolved config of the start that wrote the checkpoint
    metadata: dict  # the checkpoint's metadata, whole


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
    _check_same_dropout_rng(restored.metadata.get(DROPOUT_RNG_KEY, "threefry2x32"),
                            key_impl_name(dropout_key), run_dir, restored.step)
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
    return Resumed(restored.state, dropout_key, resume, restored.metadata.get("config") or {},
                   restored.metadata)


def _check_same_dropout_rng(saved: str, current: str, run_dir: str, step: int) -> None:
    """A resumed run draws its dropout masks from its checkpoint's key: a key of one generator
    cannot continue as another's (other masks, another key size)."""
    if saved == current:
        return
    setting = {impl: option.value for option, impl in IMPLEMENTATIONS.items()}
    raise FlaxlmError(
        f"run_dir={run_dir} draws its dropout masks with the {saved} generator (its checkpoint "
        f"at step {step}), and this start's hardware.dropout_rng comes to {current} on these "
        "devices (auto: unsafe_rbg on a TPU, threefry elsewhere). The checkpoint's dropout key "
        "continues only in its own generator. Resume with "
        f"hardware.dropout_rng={setting.get(saved, saved)}, or start a new run "
        "(trainer.resume=never with a new run_dir)."
    )


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
    continue it (packed blocks are read by (epoch, step), or a mixture's schedule position,
    the same on every process)."""
    per_process = saved.get(PER_PROCESS_KEY, {"0": saved})
    mine = per_process.get(str(jax.process_index()))
    # A mixture's streamed sources (`streams`) are read per process as one stream is.
    per_process_stream = saved.get("kind") == "stream" or bool(saved.get("streams"))
    if per_process_stream and (mine is None or len(per_process) != jax.process_count()):
        raise FlaxlmError(
            f"The checkpoint in run_dir={run_dir} holds the stream positions of "
            f"{len(per_process)} process(es), and this run has {jax.process_count()}: each "
            "process reads its own share of a streamed corpus, so the shares would change. "
            "Resume on as many processes (hosts) as the run was saved with, or start a new run."
        )
    return {k: v for k, v in (mine or saved).items() if k != PER_PROCESS_KEY}


class CheckpointSaver:
    """The loop's `save`: adds the loader's position (every process's, on several hosts) and
    the run's metadata to each checkpoint (of the train state, what `select` takes: with
    model.lora, what trains), and times how long the loop waits for each save."""

    def __init__(self, checkpointer: Checkpointer, loader, metadata: dict,
                 select: Callable[[Any], Any] = lambda state: state):
        self.checkpointer, self.loader, self.metadata = checkpointer, loader, metadata
        self.select = select  # what of the train state a checkpoint holds
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
        self.checkpointer.save(step, self.select(state), loader_state,
                               {**self.metadata, "loop": loop_state.to_json()}, metrics)
        self.seconds.append(time.perf_counter() - began)

    def raise_failed(self) -> None:
        self.checkpointer.raise_failed_save()

    def describe(self) -> str:
        if not self.seconds:
            return "no checkpoint saved by this process"
        return (f"{len(self.seconds)} checkpoint(s) in {self.checkpointer.directory}; the loop "
                f"waited {sum(self.seconds):.2f}s for them (longest {max(self.seconds):.2f}s)")
