"""`train(cfg)`: the whole pre-training job, from a composed config to a trained model.

corpus → tokenizer → packed blocks → mesh and sharded batches → jitted steps → evaluation →
W&B + metrics.jsonl → an HF-loadable model directory. This is the config edge: the composed
config becomes typed objects here, and everything below receives plain arguments.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import secrets
import sys
import time

import datasets
import jax
import jax.numpy as jnp
from flax import nnx
from omegaconf import DictConfig, OmegaConf

from flaxlm.config import CheckpointConfig, ResumeMode, TrainConfig
from flaxlm.data.corpus import load_corpus, load_corpus_stream
from flaxlm.data.loader import TrainLoader
from flaxlm.data.packing import tokenize_and_pack
from flaxlm.data.streaming import StreamingLoader, process_shard
from flaxlm.data.tokenizer import prepare_tokenizer, token_byte_lengths
from flaxlm.errors import FlaxlmError
from flaxlm.export import build_lm, export_hf
from flaxlm.generate import log_samples, settings_from_samples
from flaxlm.models import hf
from flaxlm.models.gpt2 import GPT2LMHeadModel, GPT2Spec, count_params
from flaxlm.parallel import configure_platform, make_mesh, replicated
from flaxlm.tracking import start_tracker
from flaxlm.training.checkpoint import (
    CHECKPOINT_SUBDIR,
    PREEMPTED_EXIT_CODE,
    Checkpointer,
    Preempted,
    StopRequest,
    finalised_steps,
    key_from_json,
    key_to_json,
)
from flaxlm.training.loop import Evaluator, LoopState, Plan, Throughput, fit
from flaxlm.training.optimizer import make_optimizer, make_schedule
from flaxlm.training.step import compile_steps, create_state


def train(cfg: DictConfig, *, choices: dict[str, str] | None = None,
          run_name: str | None = None, run_group: str | None = None) -> float:
    """Run one training job; return the final eval loss (what a sweeper minimises).

    `choices` (the option picked in each config group), `run_name` and `run_group` label the
    W&B run; the Hydra entrypoint fills them in. A run directory with a checkpoint is resumed
    (trainer.resume). SIGTERM / SIGINT save a checkpoint and raise `Preempted`, whose exit code
    is `PREEMPTED_EXIT_CODE`.
    """
    config: TrainConfig = OmegaConf.to_object(cfg)
    started = time.perf_counter()
    configure_platform(config.hardware)
    enable_compilation_cache(config.cache_dir)
    mesh = make_mesh(config.hardware.num_devices)
    seq_len = check_settings(config, mesh.size)  # before claiming run_dir: a retry can reuse it
    resolved = OmegaConf.to_container(cfg, resolve=True)
    run = open_run_dir(config, resolved)
    tracker_config = {**resolved, "choices": choices or {}}
    checkpointer = tracker = None
    try:
        tracker = start_tracker(config.logger, run.path, tracker_config, name=run_name,
                                group=run_group, run_id=run.wandb_run_id)
        checkpointer = make_checkpointer(run.path, config.checkpoint)
        stop = StopRequest()
        with stop.catching_signals():
            final = _train(config, resolved, run, mesh, seq_len, tracker, checkpointer, stop)
        checkpointer.close()
        final["wall_time_s"] = time.perf_counter() - started
        tracker.summary(final)
        _print_summary(final, run.path)
    except Preempted as stopped:
        stopped.run_dir = run.path
        _close_quietly(checkpointer)  # the preemption checkpoint must be on disk before exit
        if tracker is not None:
            tracker.finish(exit_code=PREEMPTED_EXIT_CODE, preempted=True)
        print(f"flaxlm: {stopped}; to continue, run the same overrides plus "
              f"resume_from={run.path} (or the same command, if it set run_dir or "
              f"hydra.run.dir); exit code {PREEMPTED_EXIT_CODE}", file=sys.stderr, flush=True)
        raise
    except BaseException:
        _close_quietly(checkpointer)  # let good checkpoints already started finish writing
        if tracker is not None:
            tracker.finish(exit_code=1)
        raise
    finally:
        run.release()
    tracker.finish()
    return final["eval/loss"]


def _train(config: TrainConfig, resolved: dict, run: "RunDir", mesh, seq_len: int, tracker,
           checkpointer: Checkpointer, stop: StopRequest) -> dict:
    batch_size = global_batch_size(config, mesh.size)
    prepare = _streamed_data if config.language.streaming else _packed_data
    tokenizer, loader, eval_blocks, train_size = prepare(config, mesh, seq_len, batch_size)
    sample_settings = settings_from_samples(config.samples)  # a bad setting fails now
    tokenizer_hash = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()

    plan = make_plan(config, loader.steps_per_epoch)
    schedule = make_schedule(config.optimizer, plan.total_steps)
    tx = make_optimizer(config.optimizer, schedule)
    spec = GPT2Spec(
        config.model,
        compute_dtype=jnp.dtype(config.hardware.compute_dtype),
        param_dtype=jnp.dtype(config.model.param_dtype or config.hardware.param_dtype),
    )
    init_key, dropout_key = jax.random.split(jax.random.key(config.seed))
    model = GPT2LMHeadModel(spec, nnx.Rngs(params=init_key))
    graphdef, state = create_state(model, tx)
    state = jax.device_put(state, replicated(mesh))
    steps = compile_steps(mesh, graphdef, tx, schedule, config.trainer.grad_accum_steps,
                          skip_nonfinite=config.trainer.skip_nonfinite)
    metadata = {"config": resolved, "tokenizer_sha256": tokenizer_hash,
                "dropout_key": key_to_json(dropout_key), "wandb_run_id": run.wandb_run_id}
    resume = None
    if run.resuming:  # before model/ is written: a resume that is refused changes nothing
        state, dropout_key, resume = restore_run(checkpointer, state, dropout_key, loader,
                                                 tokenizer_hash, tracker, run.path)

    model_dir = os.path.join(run.path, "model")
    tokenizer.save_pretrained(model_dir)
    gpt2_config = hf.to_gpt2_config(
        config.model,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    gpt2_config.save_pretrained(model_dir)

    eval_batch = config.hardware.per_device_eval_batch_size or config.hardware.per_device_batch_size
    token_bytes = jax.device_put(jnp.asarray(token_byte_lengths(tokenizer)), replicated(mesh))
    evaluator = Evaluator(steps, eval_blocks, eval_batch * mesh.size, mesh, token_bytes)
    num_params = count_params(model)
    throughput = Throughput(
        tokens_per_step=batch_size * seq_len,
        flops_per_token=flops_per_token(config, num_params, seq_len),
        peak_flops=config.hardware.peak_tflops_per_device * 1e12 * mesh.size,
    )
    print(
        f"flaxlm: {config.model.name} ({num_params / 1e6:.2f}M params) on {mesh.size} "
        f"{jax.default_backend()} device(s) | {train_size} train / {len(eval_blocks)} eval "
        f"blocks of {seq_len} tokens | global batch {batch_size} "
        f"({batch_size * seq_len} tokens/step) | {plan.total_steps} steps "
        f"({plan.steps_per_epoch}/epoch) | run dir {run.path}"
    )
    saver = CheckpointSaver(checkpointer, loader, metadata)
    state, last_eval = fit(state, steps, loader, evaluator, plan, throughput, tracker, dropout_key,
                           save=saver, resume=resume, stop=stop)
    print(f"flaxlm: {saver.describe()}")
    final = {**last_eval, "tokens_seen": int(state.step) * batch_size * seq_len,
             "steps": int(state.step)}
    # The final export: an HF model directory with a model card. model/ is this run's own, so
    # the tokenizer and config written there at the start are replaced (overwrite=True).
    params = jax.device_get(nnx.to_pure_dict(state.params))
    export_hf(model_dir, params, config.model, tokenizer, run_config=resolved,
              eval_metrics=final, generation=sample_settings,
              source=f"{run.path}, step {final['steps']}", overwrite=True)
    log_samples(build_lm(config.model, params), tokenizer, config.samples.prompts,
                sample_settings, tracker, step=final["steps"])
    return final


def restore_run(checkpointer: Checkpointer, state, dropout_key, loader, tokenizer_hash: str,
                tracker, run_dir: str):
    """The run's latest complete checkpoint: (state, dropout key, loop state), after checking
    that the tokenizer and the loader's data order are the run's own; `loader` continues from
    the checkpoint's position and metrics.jsonl is cut back to the checkpoint's step. Any
    train loop whose checkpoints carry `tokenizer_sha256`, `dropout_key` and `loop` metadata
    (as `CheckpointSaver` + `fit` write them) can resume with it."""
    restored = checkpointer.restore_latest(state)
    if restored is None:
        raise FlaxlmError(
            f"run_dir={run_dir} has checkpoints, but none of them could be read (see the "
            "messages above), so the run cannot be continued. Start a new run "
            "(trainer.resume=never with a new run_dir)."
        )
    saved_hash = restored.metadata.get("tokenizer_sha256")
    if saved_hash != tokenizer_hash:
        raise FlaxlmError(
            f"The tokenizer differs from the one run_dir={run_dir} was trained with (hash "
            f"{str(saved_hash)[:12]} → {tokenizer_hash[:12]}): its token ids would mean other "
            "words. Resume with the run's tokenizer settings (tokenizer.*, language.*), or "
            "start a new run (trainer.resume=never with a new run_dir)."
        )
    loader.load_state_dict(restored.loader_state)
    dropout_key = key_from_json(restored.metadata["dropout_key"], dropout_key)
    resume = LoopState.from_json(restored.metadata["loop"])
    dropped = tracker.rewind(restored.step)
    print(f"flaxlm: resuming {run_dir} from its checkpoint at step {restored.step} "
          f"(epoch {resume.epoch + 1}, step {resume.step_in_epoch} of it); "
          f"{dropped} metrics.jsonl line(s) after it dropped", flush=True)
    return restored.state, dropout_key, resume


class CheckpointSaver:
    """The loop's `save`: adds the loader's position and the run's metadata to each
    checkpoint, and times how long the loop waits for each save."""

    def __init__(self, checkpointer: Checkpointer, loader, metadata: dict):
        self.checkpointer, self.loader, self.metadata = checkpointer, loader, metadata
        self.seconds: list[float] = []

    def __call__(self, step: int, state, loop_state: LoopState, metrics) -> None:
        began = time.perf_counter()
        loader_state = {**self.loader.state_dict(), "epoch": loop_state.epoch,
                        "step_in_epoch": loop_state.step_in_epoch}
        self.checkpointer.save(step, state, loader_state,
                               {**self.metadata, "loop": loop_state.to_json()}, metrics)
        self.seconds.append(time.perf_counter() - began)

    def describe(self) -> str:
        if not self.seconds:
            return "no checkpoint saved by this process"
        return (f"{len(self.seconds)} checkpoint(s) in {self.checkpointer.directory}; the loop "
                f"waited {sum(self.seconds):.2f}s for them (longest {max(self.seconds):.2f}s)")


def make_checkpointer(run_dir: str, settings: CheckpointConfig) -> Checkpointer:
    if settings.every_steps is not None and settings.every_steps < 1:
        raise FlaxlmError(f"checkpoint.every_steps={settings.every_steps} must be at least 1 "
                          "(or null: only at epoch ends, the last step and on SIGTERM).")
    return Checkpointer(os.path.join(run_dir, CHECKPOINT_SUBDIR), keep_last=settings.keep_last,
                        keep_best=settings.keep_best, async_save=settings.async_save)


def _close_quietly(checkpointer: Checkpointer | None) -> None:
    if checkpointer is None:
        return
    try:
        checkpointer.close()
    except Exception as err:  # noqa: BLE001 — already failing; say so, keep the first error
        print(f"flaxlm: closing the checkpointer failed too: {err}", file=sys.stderr)


def _packed_data(config: TrainConfig, mesh, seq_len: int, batch_size: int):
    """The whole corpus tokenised and packed (cached), shuffled per epoch."""
    corpus = load_corpus(config.language)
    tokenizer = prepare_tokenizer(
        config.tokenizer, corpus.train, config.model.vocab_size, config.cache_dir
    )
    train_blocks = tokenize_and_pack(corpus.train, tokenizer, seq_len, config.cache_dir, "tokenize train")
    eval_blocks = tokenize_and_pack(
        corpus.validation, tokenizer, seq_len, config.cache_dir, "tokenize validation"
    )
    check_corpus_size(config, len(train_blocks), len(eval_blocks), seq_len, batch_size)
    loader = TrainLoader(train_blocks, batch_size, mesh, seed=config.seed)
    return tokenizer, loader, eval_blocks, len(train_blocks)


def _streamed_data(config: TrainConfig, mesh, seq_len: int, batch_size: int):
    """language.streaming: a small validation head packed like above; training packed on the
    fly from this process's shard of the rest of the stream."""
    validation, train_stream = load_corpus_stream(config.language)
    sample = datasets.Dataset.from_dict(
        {"text": [row["text"] for row in train_stream.take(config.tokenizer.train_docs)]},
        features=datasets.Features({"text": datasets.Value("string")}),
    )
    tokenizer = prepare_tokenizer(
        config.tokenizer, sample, config.model.vocab_size, config.cache_dir
    )
    eval_blocks = tokenize_and_pack(
        validation, tokenizer, seq_len, config.cache_dir, "tokenize validation"
    )
    check_eval_size(config, len(eval_blocks), seq_len)
    loader = StreamingLoader(
        process_shard(train_stream, jax.process_index(), jax.process_count()),
        tokenizer,
        seq_len,
        batch_size,
        mesh,
        seed=config.seed,
        shuffle_buffer=config.language.shuffle_buffer,
        max_steps=config.trainer.max_steps,
    )
    return tokenizer, loader, eval_blocks, "streamed"


def enable_compilation_cache(cache_dir: str) -> None:
    """Keep compiled steps in `<cache_dir>/xla`: a second run of the same shapes skips XLA
    compilation, the largest part of its start-up."""
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser(cache_dir), "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def claim_run_dir(run_dir: str) -> str:
    """Create `run_dir` for this run alone: a directory that already holds a run is never
    written into (Hydra may have created it and put its .hydra/ folder there; that is fine)."""
    run_dir = os.path.abspath(os.path.expanduser(run_dir))
    os.makedirs(run_dir, exist_ok=True)
    try:
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
        os.close(os.open(os.path.join(run_dir, "metrics.jsonl"), flags, 0o644))
    except FileExistsError:
        raise FlaxlmError(
            f"run_dir={run_dir} already holds a run (it has a metrics.jsonl) without a "
            "checkpoint to continue, and a new run never writes into an existing one. Leave "
            "run_dir / hydra.run.dir at its default (a fresh timestamped folder under outputs/) "
            "or choose a new directory."
        ) from None
    return run_dir


# Settings a resumed run may change: how often it logs, evaluates and checkpoints, how long
# it trains, where it logs (and the text samples it logs), and how the same global batch is
# spread over devices. Anything else (model, tokenizer, data, optimizer, seed, ...) would make
# it another run.
RESUMABLE_CHANGES = (
    "run_dir", "resume_from", "cache_dir", "logger.", "checkpoint.", "samples.",
    "trainer.log_every", "trainer.eval_every", "trainer.max_steps", "trainer.num_epochs",
    "trainer.eval_before_training", "trainer.resume", "trainer.skip_nonfinite",
    "hardware.name", "hardware.cpu_devices", "hardware.num_devices",
    "hardware.per_device_batch_size", "hardware.per_device_eval_batch_size",
    "hardware.peak_tflops_per_device",
)
WANDB_ID_FILE = "wandb_run_id"


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
    path = os.path.abspath(os.path.expanduser(config.resume_from or config.run_dir))
    if config.resume_from and mode == ResumeMode.never:
        raise FlaxlmError(
            f"resume_from={config.resume_from} asks to continue a run, but trainer.resume=never "
            "forbids it. Drop one of the two settings."
        )
    if mode != ResumeMode.never and has_checkpoint(path):
        lock = _lock(path)
        check_resumable(os.path.join(path, "config.yaml"), resolved)
        return RunDir(path, True, _wandb_run_id(path), lock)
    if mode == ResumeMode.must or config.resume_from:
        raise FlaxlmError(
            f"There is no complete checkpoint in {os.path.join(path, CHECKPOINT_SUBDIR)} to "
            f"resume (trainer.resume={mode.value}"
            + (f", resume_from={config.resume_from}" if config.resume_from else "")
            + "). Point resume_from at the directory of a run that saved a checkpoint, or set "
            "trainer.resume=auto to start a new run when there is none."
        )
    path = claim_run_dir(path)
    lock = _lock(path)
    OmegaConf.save(OmegaConf.create(resolved), os.path.join(path, "config.yaml"))
    return RunDir(path, False, _wandb_run_id(path), lock)


def has_checkpoint(run_dir: str) -> bool:
    return bool(finalised_steps(os.path.join(run_dir, CHECKPOINT_SUBDIR)))


def check_resumable(saved_config_path: str, resolved: dict) -> None:
    """Resuming with a config that would train something else fails, naming each difference."""
    if not os.path.exists(saved_config_path):
        raise FlaxlmError(f"{saved_config_path} is missing, so this run cannot be checked "
                          "before resuming it. Restore the file, or start a new run.")
    saved = _flatten(OmegaConf.to_container(OmegaConf.load(saved_config_path), resolve=True))
    current = _flatten(resolved)
    # Keys only one side has are settings added (or removed) by a flaxlm upgrade in between:
    # the run did not use them, so they do not make it another run.
    changed = [
        f"{key}: {saved[key]!r} → {current[key]!r}"
        for key in sorted(set(saved) & set(current))
        if saved[key] != current[key] and not key.startswith(RESUMABLE_CHANGES)
    ]
    if changed:
        raise FlaxlmError(
            f"Cannot resume the run in {os.path.dirname(saved_config_path)}: this config changes "
            "what it trains (" + "; ".join(changed) + "). A resumed run may only change "
            "logging, evaluation and checkpoint cadence, trainer.max_steps / num_epochs, the "
            "logger and how the batch is spread over devices. Resume with the run's own "
            "settings, or start a new run (trainer.resume=never, or a new run_dir)."
        )


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        flat = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: tree}


def _lock(run_dir: str) -> int:
    """One process at a time in a run directory: two resumes of one run would interleave."""
    descriptor = os.open(os.path.join(run_dir, ".lock"), os.O_CREAT | os.O_RDWR, 0o644)
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
    resumed run continues the same W&B run."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    run_id = secrets.token_hex(4)  # W&B's own ids are 8 lowercase alphanumerics
    with open(path, "w", encoding="utf-8") as f:
        f.write(run_id + "\n")
    return run_id


def check_settings(config: TrainConfig, num_devices: int) -> int:
    """Settings that can be checked before any data is read; returns the block length."""
    seq_len = config.task.max_seq_length or config.model.n_positions
    if not 2 <= seq_len <= config.model.n_positions:
        raise FlaxlmError(
            f"task.max_seq_length={seq_len} must be between 2 and the model's context length "
            f"model.n_positions={config.model.n_positions} ({config.model.name}). Lower "
            "task.max_seq_length, or pick a model with more positions."
        )
    for key, value in [
        ("hardware.per_device_batch_size", config.hardware.per_device_batch_size),
        ("trainer.num_epochs", config.trainer.num_epochs),
        ("trainer.log_every", config.trainer.log_every),
        ("trainer.grad_accum_steps", config.trainer.grad_accum_steps),
    ]:
        if value < 1:
            raise FlaxlmError(f"{key}={value} must be at least 1.")
    for key, value in [("trainer.max_steps", config.trainer.max_steps),
                       ("trainer.eval_every", config.trainer.eval_every),
                       ("hardware.per_device_eval_batch_size",
                        config.hardware.per_device_eval_batch_size)]:
        if value is not None and value < 1:
            raise FlaxlmError(f"{key}={value} must be at least 1 (or null).")
    global_batch_size(config, num_devices)
    if config.language.streaming:
        check_streaming_settings(config)
    return seq_len


def check_streaming_settings(config: TrainConfig) -> None:
    if config.trainer.max_steps is None:
        raise FlaxlmError(
            "language.streaming=true needs trainer.max_steps: a streamed corpus has no known "
            "length, so trainer.num_epochs cannot say how long to train. Set "
            "trainer.max_steps, e.g. trainer.max_steps=10000."
        )
    for key, value in [("language.shuffle_buffer", config.language.shuffle_buffer),
                       ("tokenizer.train_docs", config.tokenizer.train_docs)]:
        if value < 1:
            raise FlaxlmError(f"{key}={value} must be at least 1.")


def global_batch_size(config: TrainConfig, num_devices: int) -> int:
    """Rows per optimizer step, all trainer.grad_accum_steps micro-batches together:
    trainer.global_batch_size if set (it must split evenly into the micro-batches and each over
    the devices), else hardware.per_device_batch_size × devices × grad_accum_steps, as in the
    seed (which did not accumulate: × 1)."""
    wanted = config.trainer.global_batch_size
    accum = config.trainer.grad_accum_steps
    if wanted is None:
        return config.hardware.per_device_batch_size * num_devices * accum
    split = num_devices * accum
    if wanted < 1 or wanted % split:
        raise FlaxlmError(
            f"trainer.global_batch_size={wanted} does not divide evenly into "
            f"trainer.grad_accum_steps={accum} micro-batch(es) over the {num_devices} "
            f"devices of the mesh (hardware={config.hardware.name}). Use a multiple of "
            f"{split}, e.g. {max(1, round(wanted / split)) * split}, or set it to null to use "
            "hardware.per_device_batch_size × devices × trainer.grad_accum_steps."
        )
    return wanted


def check_corpus_size(config: TrainConfig, train_blocks: int, eval_blocks: int, seq_len: int,
                      batch_size: int) -> None:
    check_eval_size(config, eval_blocks, seq_len)
    where = f"language={config.language.name}"
    if train_blocks < batch_size:
        raise FlaxlmError(
            f"The training split of {where} makes {train_blocks} block(s) of {seq_len} tokens, "
            f"fewer than one global batch of {batch_size} (per-device batch × devices × "
            "trainer.grad_accum_steps). Use more text (or a larger language.max_train_docs), "
            "or lower hardware.per_device_batch_size, trainer.grad_accum_steps or "
            "task.max_seq_length."
        )


def check_eval_size(config: TrainConfig, eval_blocks: int, seq_len: int) -> None:
    if eval_blocks == 0:
        raise FlaxlmError(
            f"The validation split of language={config.language.name} is shorter than one block "
            f"of task.max_seq_length={seq_len} tokens, so there is nothing to evaluate on. Use "
            "more text, a larger language.validation_fraction / max_eval_docs, or a smaller "
            "task.max_seq_length."
        )


def make_plan(config: TrainConfig, steps_per_epoch: int) -> Plan:
    trainer = config.trainer
    total = trainer.max_steps or trainer.num_epochs * steps_per_epoch
    return Plan(
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        eval_every=trainer.eval_every,
        log_every=trainer.log_every,
        eval_before_training=trainer.eval_before_training,
        checkpoint_every=config.checkpoint.every_steps,
        checkpoint_at_epoch_end=config.checkpoint.at_epoch_end,
        count_skipped=trainer.skip_nonfinite,
    )


def flops_per_token(config: TrainConfig, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight that multiplies (the position table is a lookup,
    the tied token table counts once, as the LM head) plus attention's 12·layers·width·length
    (PaLM, appendix B)."""
    model = config.model
    matmul_params = num_params - model.n_positions * model.n_embd
    return 6 * matmul_params + 12 * model.n_layer * model.n_embd * seq_len


def _print_summary(final: dict, run_dir: str) -> None:
    print(
        f"flaxlm: done in {final['wall_time_s']:.0f}s | {final['steps']} steps, "
        f"{final['tokens_seen']:,} tokens | final eval loss {final['eval/loss']:.4f}, "
        f"perplexity {final['eval/perplexity']:.2f}, bits/byte {final['eval/bits_per_byte']:.3f}"
        f" | run dir {run_dir}"
    )
