"""`train(cfg)`: the whole pre-training job, from a composed config to a trained model.

corpus → tokenizer → packed blocks → mesh and sharded batches → jitted steps → evaluation →
W&B + metrics.jsonl → an HF-loadable model directory. This is the config edge: the composed
config becomes typed objects here, and everything below receives plain arguments.
"""

from __future__ import annotations

import os
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
from flaxlm.data.tokenizer import prepare_tokenizer, token_byte_lengths
from flaxlm.errors import FlaxlmError
from flaxlm.models import hf
from flaxlm.models.gpt2 import GPT2LMHeadModel, GPT2Spec, count_params
from flaxlm.parallel import configure_platform, make_mesh, replicated
from flaxlm.tracking import start_tracker
from flaxlm.training.loop import Evaluator, Plan, Throughput, fit
from flaxlm.training.optimizer import make_optimizer, make_schedule
from flaxlm.training.step import compile_steps, create_state


def train(cfg: DictConfig, *, choices: dict[str, str] | None = None,
          run_name: str | None = None, run_group: str | None = None) -> float:
    """Run one training job; return the final eval loss (what a sweeper minimises).

    `choices` (the option picked in each config group), `run_name` and `run_group` label the
    W&B run; the Hydra entrypoint fills them in.
    """
    config: TrainConfig = OmegaConf.to_object(cfg)
    started = time.perf_counter()
    configure_platform(config.hardware)
    enable_compilation_cache(config.cache_dir)
    mesh = make_mesh(config.hardware.num_devices)
    seq_len = check_settings(config, mesh.size)  # before claiming run_dir: a retry can reuse it
    run_dir = claim_run_dir(config.run_dir)
    OmegaConf.save(cfg, os.path.join(run_dir, "config.yaml"), resolve=True)

    tracker_config = {**OmegaConf.to_container(cfg, resolve=True), "choices": choices or {}}
    tracker = start_tracker(config.logger, run_dir, tracker_config, name=run_name, group=run_group)
    try:
        final = _train(config, run_dir, mesh, seq_len, tracker)
        final["wall_time_s"] = time.perf_counter() - started
        tracker.summary(final)
        _print_summary(final, run_dir)
    except BaseException:
        tracker.finish(exit_code=1)
        raise
    tracker.finish()
    return final["eval/loss"]


def _train(config: TrainConfig, run_dir: str, mesh, seq_len: int, tracker) -> dict:
    batch_size = global_batch_size(config, mesh.size)
    prepare = _streamed_data if config.language.streaming else _packed_data
    tokenizer, loader, eval_blocks, train_size = prepare(config, mesh, seq_len, batch_size)

    model_dir = os.path.join(run_dir, "model")
    tokenizer.save_pretrained(model_dir)
    gpt2_config = hf.to_gpt2_config(
        config.model,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    gpt2_config.save_pretrained(model_dir)

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
    steps = compile_steps(mesh, graphdef, tx, schedule, config.trainer.grad_accum_steps)

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
        f"({plan.steps_per_epoch}/epoch) | run dir {run_dir}"
    )
    state, last_eval = fit(state, steps, loader, evaluator, plan, throughput, tracker, dropout_key)
    hf.save_pretrained(model_dir, nnx.to_pure_dict(state.params), gpt2_config)
    return {**last_eval, "tokens_seen": int(state.step) * batch_size * seq_len,
            "steps": int(state.step)}


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
            f"run_dir={run_dir} already holds a run (it has a metrics.jsonl), and a new run "
            "never writes into an existing one. Leave run_dir / hydra.run.dir at its default "
            "(a fresh timestamped folder under outputs/) or choose a new directory."
        ) from None
    return run_dir


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
