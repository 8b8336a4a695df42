"""`train(cfg)`: one job, from a composed config to a trained model, for either task.

The job (this function): platform and mesh, the run directory (fresh, or a stopped run
resumed), W&B, the checkpointer and the SIGTERM / SIGINT handler, around the task's body:
`task=clm` here (corpus → tokenizer → packed blocks → jitted steps → evaluation → an
HF-loadable model directory with samples), `task=classify` in `flaxlm.finetune`. This is the
config edge: the composed config becomes typed objects here, and everything below receives
plain arguments.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time

import datasets
import jax
import jax.numpy as jnp
from flax import nnx
from omegaconf import DictConfig, OmegaConf

from flaxlm.config import TrainConfig
from flaxlm.data.corpus import load_corpus, load_corpus_stream
from flaxlm.data.loader import TrainLoader
from flaxlm.data.packing import tokenize_and_pack
from flaxlm.data.streaming import StreamingLoader, process_shard
from flaxlm.data.tokenizer import prepare_tokenizer, token_byte_lengths, with_document_start
from flaxlm.errors import FlaxlmError
from flaxlm.export import build_lm, export_hf
from flaxlm.finetune import check_task_settings, finetune
from flaxlm.generate import log_samples, settings_from_samples
from flaxlm.models import build, hf, pretrained
from flaxlm.models.gpt2 import GPT2Spec, count_params
from flaxlm.parallel import configure_platform, make_mesh, replicated
from flaxlm.runs import (
    CheckpointSaver,
    RunDir,
    close_quietly,
    disk_full_error,
    make_checkpointer,
    open_run_dir,
    restore_run,
    writable_dir,
)
from flaxlm.tracking import start_tracker
from flaxlm.training.checkpoint import (
    PREEMPTED_EXIT_CODE,
    Checkpointer,
    Preempted,
    StopRequest,
    key_to_json,
)
from flaxlm.training.loop import Evaluator, Throughput, describe, fit
from flaxlm.training.optimizer import check_optimizer_settings, make_optimizer, make_schedule
from flaxlm.training.plan import global_batch_size, make_plan
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
    writable_dir(config.cache_dir, "cache_dir", "Set cache_dir (or the FLAXLM_CACHE environment "
                 "variable) to a directory you can write to: tokenizers, packed data and "
                 "compiled steps are kept there.")
    enable_compilation_cache(config.cache_dir)
    mesh = make_mesh(config.hardware.num_devices)
    body = task_body(config.task.name)
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
            final = body(config, resolved, run, mesh, seq_len, tracker, checkpointer, stop)
        checkpointer.close()
        final["wall_time_s"] = time.perf_counter() - started
        tracker.summary(final)
        _print_summary(final, run.path)
    except Preempted as stopped:
        stopped.run_dir = run.path
        close_quietly(checkpointer)  # the preemption checkpoint must be on disk before exit
        if tracker is not None:
            tracker.finish(exit_code=PREEMPTED_EXIT_CODE, preempted=True)
        print(f"flaxlm: {stopped}; to continue, run the same overrides plus "
              f"resume_from={run.path} (or the same command, if it set run_dir or "
              f"hydra.run.dir); exit code {PREEMPTED_EXIT_CODE}", file=sys.stderr, flush=True)
        raise
    except BaseException as err:
        close_quietly(checkpointer)  # let good checkpoints already started finish writing
        if tracker is not None:
            tracker.finish(exit_code=1)
        full = disk_full_error(err, run.path)
        if full is not None:
            raise full from err
        raise
    finally:
        run.release()
    tracker.finish()
    return final["eval/loss"]


def task_body(name: str):
    """The function that runs task `name` inside the job: (config, resolved config, run
    directory, mesh, sequence length, tracker, checkpointer, stop request) → final metrics."""
    if name == "clm":
        return pretrain
    if name == "classify":
        return finetune
    raise FlaxlmError(
        f"task.name={name!r} is not a task flaxlm runs. Pick task=clm (pre-train a causal "
        "LM) or task=classify (fine-tune a classifier)."
    )


def pretrain(config: TrainConfig, resolved: dict, run: RunDir, mesh, seq_len: int, tracker,
             checkpointer: Checkpointer, stop: StopRequest) -> dict:
    """task=clm: the causal-LM pre-training run; returns the final metrics.

    With model.init_from it continues pre-training a GPT-2 checkpoint (HF's or a run's own
    model/): shape and tokenizer come from the checkpoint, the weights too unless resuming.
    """
    checkpoint_dir = (pretrained.resolve_checkpoint(config.model.init_from)
                      if config.model.init_from else None)
    if checkpoint_dir:
        config = dataclasses.replace(
            config, model=pretrained.pretrained_model_config(checkpoint_dir, config.model))
        seq_len = config.task.max_seq_length or config.model.n_positions  # the checkpoint's
        check_block_length(config, seq_len)
    batch_size = global_batch_size(config, mesh.size)
    prepare = _streamed_data if config.language.streaming else _packed_data
    fixed_tokenizer = (pretrained.load_pretrained_tokenizer(checkpoint_dir)
                       if checkpoint_dir and config.tokenizer.path is None else None)
    tokenizer, loader, eval_blocks, train_size = prepare(config, mesh, seq_len, batch_size,
                                                         fixed_tokenizer)
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
    model = build.build_lm(spec, nnx.Rngs(params=init_key))  # init_from may name an encoder
    if checkpoint_dir and not run.resuming:  # a resumed run's weights come from its checkpoint
        report = pretrained.load_pretrained_weights(model, checkpoint_dir,
                                                    source=config.model.init_from)
        print(f"flaxlm: model.init_from={config.model.init_from}: {report}")
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
    with_document_start(tokenizer).save_pretrained(model_dir)  # as the export will have it
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


def _packed_data(config: TrainConfig, mesh, seq_len: int, batch_size: int, tokenizer=None):
    """The whole corpus tokenised (by `tokenizer`, or one prepared from the config) and packed
    (cached), shuffled per epoch."""
    corpus = load_corpus(config.language)
    tokenizer = tokenizer or prepare_tokenizer(
        config.tokenizer, corpus.train, config.model.vocab_size, config.cache_dir
    )
    train_blocks = tokenize_and_pack(corpus.train, tokenizer, seq_len, config.cache_dir, "tokenize train")
    eval_blocks = tokenize_and_pack(
        corpus.validation, tokenizer, seq_len, config.cache_dir, "tokenize validation"
    )
    check_corpus_size(config, len(train_blocks), len(eval_blocks), seq_len, batch_size)
    loader = TrainLoader(train_blocks, batch_size, mesh, seed=config.seed)
    return tokenizer, loader, eval_blocks, len(train_blocks)


def _streamed_data(config: TrainConfig, mesh, seq_len: int, batch_size: int, tokenizer=None):
    """language.streaming: a small validation head packed like above; training packed on the
    fly from this process's shard of the rest of the stream."""
    validation, train_stream = load_corpus_stream(config.language)
    if tokenizer is None:
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


def check_settings(config: TrainConfig, num_devices: int) -> int:
    """Settings that can be checked before any data is read; returns the sequence length
    (clm: the block length; classify: the padded example length)."""
    if config.task.name == "classify":
        seq_len = check_task_settings(config)  # the model's positions are checked once known
    else:
        seq_len = config.task.max_seq_length or config.model.n_positions
    if config.task.name == "clm":
        build.check_lm_family(config.model)
        check_block_length(config, seq_len)
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
    check_optimizer_settings(config.optimizer)
    if config.task.name == "clm" and config.language.streaming:
        check_streaming_settings(config)
    return seq_len


def check_block_length(config: TrainConfig, seq_len: int) -> None:
    if not 2 <= seq_len <= config.model.n_positions:
        raise FlaxlmError(
            f"task.max_seq_length={seq_len} must be between 2 and the model's context length "
            f"model.n_positions={config.model.n_positions} ({config.model.name}). Lower "
            "task.max_seq_length, or pick a model with more positions."
        )


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


def flops_per_token(config: TrainConfig, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight that multiplies (the position table is a lookup,
    the tied token table counts once, as the LM head) plus attention's 12·layers·width·length
    (PaLM, appendix B)."""
    model = config.model
    matmul_params = num_params - model.n_positions * model.n_embd
    return 6 * matmul_params + 12 * model.n_layer * model.n_embd * seq_len


def _print_summary(final: dict, run_dir: str) -> None:
    tokens = f", {final['tokens_seen']:,} tokens" if "tokens_seen" in final else ""
    print(f"flaxlm: done in {final['wall_time_s']:.0f}s | {final['steps']} steps{tokens} | "
          f"final {describe(final)} | run dir {run_dir}")
