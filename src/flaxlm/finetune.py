"""task=classify: fine-tune a classifier, as the body of `flaxlm.train.train`'s job.

examples (Hub or local files) → the checkpoint's tokenizer (or a BPE trained on the examples)
→ fixed-shape token arrays → an encoder or GPT-2 with a classification head, from pretrained
weights when model.init_from names them → the same jitted, data-parallel steps and loop as
pre-training → evaluation that scores every example exactly once → predictions.jsonl, W&B +
metrics.jsonl and an HF-loadable model directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tokenizers
from flax import nnx

from flaxlm.config import ModelConfig, ModelFamily, Padding, TrainConfig
from flaxlm.data import classify as data
from flaxlm.data.tokenizer import has_document_start, prepare_tokenizer, set_post_processor
from flaxlm.errors import FlaxlmError
from flaxlm.export import MODEL_SUBDIR, export_hf
from flaxlm.models import build, hf, pretrained
from flaxlm.models.gpt2 import GPT2Spec, count_params
from flaxlm.parallel import replicated
from flaxlm.runs import CheckpointSaver, RunDir, restore_run
from flaxlm.training import evaluation
from flaxlm.training.checkpoint import Checkpointer, StopRequest, key_to_json
from flaxlm.training.loop import Throughput, fit
from flaxlm.training.optimizer import make_optimizer, make_schedule
from flaxlm.training.plan import global_batch_size, make_plan
from flaxlm.training.step import CompiledSteps, compile_train_step, create_state


def finetune(config: TrainConfig, resolved: dict, run: RunDir, mesh, max_length: int, tracker,
             checkpointer: Checkpointer, stop: StopRequest) -> dict:
    """task=classify inside `flaxlm.train.train`'s job; returns the final metrics."""
    checkpoint_dir = (pretrained.resolve_checkpoint(config.model.init_from)
                      if config.model.init_from else None)
    model_config = (pretrained.pretrained_model_config(checkpoint_dir, config.model)
                    if checkpoint_dir else config.model)
    check_max_length(max_length, model_config)
    examples = data.load_examples(config.task)
    metrics = config.task.metrics or evaluation.default_metrics(examples.num_labels,
                                                                examples.is_regression)
    evaluation.check_metrics(metrics, examples.is_regression)
    tokenizer = _tokenizer(config, model_config, checkpoint_dir, examples.train)
    tokenizer_hash = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
    train_arrays = data.encode(examples.train, tokenizer, max_length)
    eval_arrays = data.encode(examples.eval, tokenizer, max_length)

    batch_size = global_batch_size(config, mesh.size)
    loader = data.ClassificationLoader(train_arrays, batch_size, mesh, seed=config.seed,
                                       padding=config.task.padding)
    if loader.steps_per_epoch == 0:
        raise FlaxlmError(
            f"The training split has {len(examples.train)} example(s), fewer than one global "
            f"batch of {batch_size} (per-device batch × devices × trainer.grad_accum_steps). "
            "Use more examples, or lower hardware.per_device_batch_size or "
            "trainer.grad_accum_steps."
        )
    plan = make_plan(config, loader.steps_per_epoch)
    schedule = make_schedule(config.optimizer, plan.total_steps)
    tx = make_optimizer(config.optimizer, schedule)

    spec = GPT2Spec(
        model_config,
        compute_dtype=jnp.dtype(config.hardware.compute_dtype),
        param_dtype=jnp.dtype(model_config.param_dtype or config.hardware.param_dtype),
    )
    init_key, dropout_key = jax.random.split(jax.random.key(config.seed))
    model = build.build_classifier(spec, examples.num_labels, tokenizer.pad_token_id,
                                   nnx.Rngs(params=init_key))
    if checkpoint_dir and not run.resuming:  # a resumed run's weights come from its checkpoint
        report = pretrained.load_pretrained_weights(model, checkpoint_dir,
                                                    source=config.model.init_from)
        print(f"flaxlm: model.init_from={config.model.init_from}: {report}")
    graphdef, state = create_state(model, tx)
    state = jax.device_put(state, replicated(mesh))
    steps = compile_classifier_steps(mesh, graphdef, tx, schedule, examples.is_regression,
                                     config.trainer.grad_accum_steps,
                                     config.trainer.skip_nonfinite)
    metadata = {"config": resolved, "tokenizer_sha256": tokenizer_hash,
                "dropout_key": key_to_json(dropout_key), "wandb_run_id": run.wandb_run_id}
    resume = None
    if run.resuming:
        state, dropout_key, resume = restore_run(checkpointer, state, dropout_key, loader,
                                                 tokenizer_hash, tracker, run.path)

    # model/ gets the tokenizer and HF config now, so flaxlm-export can turn any checkpoint
    # of this run into an HF directory while it trains; the end of the run completes it.
    model_dir = os.path.join(run.path, MODEL_SUBDIR)
    hf_config = hf.to_classifier_config(
        model_config, num_labels=examples.num_labels, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        label_names=examples.label_names,
    )
    if jax.process_index() == 0:
        tokenizer.save_pretrained(model_dir)
        hf_config.save_pretrained(model_dir)

    eval_batch = config.hardware.per_device_eval_batch_size or config.hardware.per_device_batch_size
    evaluator = ClassifierEvaluator(
        steps, eval_arrays, eval_batch * mesh.size, mesh, metrics, examples.is_regression,
        examples.num_labels, config.task.padding,
    )
    num_params = count_params(model)
    throughput = Throughput(
        tokens_per_step=batch_size * max_length,
        flops_per_token=flops_per_token(model_config, num_params, max_length),
        peak_flops=config.hardware.peak_tflops_per_device * 1e12 * mesh.size,
    )
    labels = "regression" if examples.is_regression else f"{examples.num_labels} labels"
    print(
        f"flaxlm: {model_config.name} ({num_params / 1e6:.2f}M params, {labels}) on "
        f"{mesh.size} {jax.default_backend()} device(s) | {len(examples.train)} train / "
        f"{len(examples.eval)} eval examples of ≤ {max_length} tokens | global batch "
        f"{batch_size} | {plan.total_steps} steps ({plan.steps_per_epoch}/epoch) | "
        f"run dir {run.path}"
    )
    saver = CheckpointSaver(checkpointer, loader, metadata)
    state, last_eval = fit(state, steps, loader, evaluator, plan, throughput, tracker, dropout_key,
                           save=saver, resume=resume, stop=stop)
    print(f"flaxlm: {saver.describe()}")
    if evaluator.last_predictions is None:  # resumed after the last eval: score once more
        last_eval = evaluator(state.params)
    final = {**last_eval, "steps": int(state.step)}
    if jax.process_index() == 0:  # every process holds all predictions and parameters
        evaluation.write_predictions(
            os.path.join(run.path, "predictions.jsonl"), evaluator.last_predictions,
            eval_arrays["labels"], examples.label_names,
        )
        export_hf(model_dir, jax.device_get(nnx.to_pure_dict(state.params)), model_config,
                  tokenizer, run_config=resolved, eval_metrics=final, hf_config=hf_config,
                  generation=None, source=f"{run.path}, step {final['steps']}", overwrite=True)
    return final


def flops_per_token(model: ModelConfig, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight that multiplies (embedding tables are lookups,
    and a classifier leaves GPT-2's tied LM head unused) plus attention's
    12·layers·width·length."""
    tables = model.vocab_size + model.n_positions
    if model.family == ModelFamily.bert:
        tables += model.type_vocab_size
    return 6 * (num_params - tables * model.n_embd) + 12 * model.n_layer * model.n_embd * seq_len


def _tokenizer(config: TrainConfig, model_config: ModelConfig, checkpoint_dir: str | None,
               train: datasets.Dataset):
    """The checkpoint's own tokenizer (its ids are what the embeddings learnt), else
    tokenizer.path, else a byte-level BPE trained on the training examples."""
    if checkpoint_dir and config.tokenizer.path is None:
        tokenizer = pretrained.load_pretrained_tokenizer(checkpoint_dir)
    else:
        columns = [c for c in ("text", "text_pair") if c in train.column_names]
        texts = datasets.Dataset.from_dict(
            {"text": [t for column in columns for t in train[column]]}
        )
        tokenizer = prepare_tokenizer(config.tokenizer, texts, model_config.vocab_size,
                                      config.cache_dir)
    return with_pair_template(tokenizer)


def with_pair_template(tokenizer):
    """A tokenizer without a post-processor (our byte-level BPEs: packing adds the EOS itself)
    would glue a sentence pair together with nothing between the halves. Give it BERT's
    layout with EOS as the separator: `A </s>` and `A </s> B </s>`, B's tokens of type 1, so
    the halves stay apart and GPT-2's classifier reads a fixed end-of-input token. A language
    model's document start (`</s> A`, from a flaxlm export) gives way to it likewise."""
    processor = tokenizer.backend_tokenizer.post_processor
    if tokenizer.eos_token is None or not (
            processor is None or isinstance(processor, tokenizers.processors.ByteLevel)
            or has_document_start(tokenizer)):
        return tokenizer  # it has its own layout (e.g. BERT's [CLS] A [SEP] B [SEP])
    eos = tokenizer.eos_token
    set_post_processor(tokenizer, tokenizers.processors.TemplateProcessing(
        single=f"$A:0 {eos}:0",
        pair=f"$A:0 {eos}:0 $B:1 {eos}:1",
        special_tokens=[(eos, tokenizer.eos_token_id)],
    ))
    return tokenizer


def check_task_settings(config: TrainConfig) -> int:
    """What can be checked before any data is read; returns the padded example length."""
    task = config.task
    if task.dataset is None and not task.train_files:
        raise FlaxlmError(
            "task=classify needs examples: set task.dataset (a Hub dataset, e.g. "
            "task.dataset=nyu-mll/glue task.dataset_config=mrpc, or experiment=glue-mrpc) or "
            "local files with task.train_files=[...] and task.eval_files=[...]."
        )
    if task.dataset is None and not task.eval_files:
        raise FlaxlmError(
            "task.train_files is set but task.eval_files is empty: fine-tuning evaluates on "
            "held-out examples. Give task.eval_files=[...] (e.g. a validation.tsv)."
        )
    return data.max_length_for(task)


def check_max_length(length: int, model: ModelConfig) -> None:
    if not 2 <= length <= model.n_positions:
        raise FlaxlmError(
            f"task.max_seq_length={length} must be between 2 and the model's "
            f"{model.n_positions} positions ({model.name}). Lower task.max_seq_length."
        )


def classification_losses(logits_BxC: jax.Array, labels_B: jax.Array,
                          is_regression: bool) -> jax.Array:
    """Per-example loss in float32: cross-entropy on integer labels, or squared error for
    regression (one output), as HF's *ForSequenceClassification computes it."""
    logits_BxC = logits_BxC.astype(jnp.float32)
    if is_regression:
        return jnp.square(logits_BxC[:, 0] - labels_B.astype(jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxC, labels_B)


def compile_classifier_steps(mesh, graphdef, tx, schedule, is_regression: bool,
                             grad_accum_steps: int = 1,
                             skip_nonfinite: bool = False) -> CompiledSteps:
    """The shared jitted train step with a classification loss; `eval` returns the logits of
    every row (replicated, so every process holds the whole batch in device order)."""
    def loss_fn(model, batch, rngs):
        logits_BxC = model(batch["input_ids"], batch["attention_mask"],
                           batch["token_type_ids"], rngs=rngs)
        return classification_losses(logits_BxC, batch["labels"], is_regression).mean()

    def logits(params, batch):
        model = nnx.merge(graphdef, params)
        return model(batch["input_ids"], batch["attention_mask"],
                     batch["token_type_ids"]).astype(jnp.float32)

    train = compile_train_step(mesh, graphdef, tx, schedule, loss_fn, grad_accum_steps,
                               skip_nonfinite)
    rep = replicated(mesh)
    return CompiledSteps(train=train, eval=jax.jit(logits, out_shardings=rep))


@dataclasses.dataclass
class ClassifierEvaluator:
    """Loss and the task's metrics over every eval example exactly once; keeps the last
    predictions for predictions.jsonl."""

    steps: CompiledSteps
    arrays: dict[str, np.ndarray]
    global_batch_size: int
    mesh: object
    metrics: list[str]
    is_regression: bool
    num_labels: int
    padding: Padding
    last_predictions: np.ndarray | None = None

    def __call__(self, params) -> dict[str, float]:
        results, self.last_predictions = evaluation.evaluate(
            lambda batch: self.steps.eval(params, batch), self.arrays, self.global_batch_size,
            self.mesh, self.metrics, self.is_regression, self.num_labels, self.padding,
        )
        return results
