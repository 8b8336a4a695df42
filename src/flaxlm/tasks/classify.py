"""task=classify: fine-tune a sequence (or sentence-pair) classifier, or a regressor.

examples (Hub or local files) → the checkpoint's tokenizer (or a BPE trained on the examples)
→ fixed-shape token arrays → an encoder or GPT-2 with a classification head, from pretrained
weights when model.init_from names them → the same jitted, data-parallel steps and loop as
pre-training → evaluation that scores every example exactly once → predictions.jsonl and an
HF-loadable model/.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tokenizers
from flax import nnx

from flaxlm import layout
from flaxlm.config import ModelConfig, TrainConfig
from flaxlm.data.encoding import encode, example_loader, max_length_for
from flaxlm.data.examples import Examples, load_examples
from flaxlm.data.fingerprint import arrays_fingerprint
from flaxlm.data.tables import text_dataset
from flaxlm.data.tokenizer import (
    document_prefix,
    glues_pairs,
    has_document_start,
    prepare_tokenizer,
    set_post_processor,
)
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module
from flaxlm.models import build, hf, pretrained
from flaxlm.parallel import replicated
from flaxlm.tasks import base
from flaxlm.tasks.base import Start, Training
from flaxlm.tasks.pipeline import Network, Run, Task, TaskData
from flaxlm.training import evaluation
from flaxlm.training.step import CompiledSteps, TrainState, compile_train_step

datasets = lazy_module("datasets")


class Classification(Task):
    """The classification task: labelled examples (or sentence pairs) in padded rows, a
    classifier (or regressor) head, evaluation that scores every held-out example once, and
    predictions.jsonl beside the exported model."""

    pads_rows = True

    def check_settings(self, config: TrainConfig) -> int:
        task = config.task
        build.check_classifier_family(config.model, "task=classify fine-tunes a classifier")
        if config.model.lora.rank is not None:
            raise FlaxlmError(
                f"model.lora.rank={config.model.lora.rank} with task=classify: flaxlm trains "
                "adapters for task=clm and task=sft only (a classifier's fresh head would have "
                "to train beside them, and the PEFT export has no place for it). Fine-tune the "
                "whole classifier (model.lora.rank=null), or train adapters with task=clm."
            )
        if config.eval.harness.tasks:
            raise FlaxlmError(
                f"eval.harness.tasks={list(config.eval.harness.tasks)} evaluates a language "
                "model, and task=classify trains a classifier. Drop eval.harness, or evaluate "
                "the task=clm run this classifier starts from (flaxlm-eval RUN_DIR --tasks ...)."
            )
        if config.language is not None:
            raise FlaxlmError(
                f"task=classify reads its examples from task.hub_path or task.files, so "
                f"language={config.language.name} (a corpus for task=clm) would be ignored. "
                "Drop the language override."
            )
        if task.hub_path is None and not task.files:
            raise FlaxlmError(
                "task=classify needs examples: set task.hub_path (a Hub dataset, e.g. "
                "task.hub_path=nyu-mll/glue task.hub_config=mrpc, or experiment=glue-mrpc) "
                "or local files with task.files=[...] and task.eval_files=[...]."
            )
        if task.hub_path is None and not task.eval_files:
            raise FlaxlmError(
                "task.files is set but task.eval_files is empty: fine-tuning evaluates "
                "on held-out examples. Give task.eval_files=[...] (e.g. a validation.tsv)."
            )
        return max_length_for(task)  # the model's positions are checked once known

    def eval_metrics(self, config: TrainConfig) -> base.EvalMetrics:
        """The loss and task.metrics (or the defaults task.num_labels gives); the main one is
        f1 where it is logged (GLUE's headline metric where it applies), else the first."""
        num_labels = config.task.num_labels
        names = config.task.metrics
        if not names and num_labels is not None:
            names = evaluation.default_metrics(num_labels, is_regression=num_labels == 1)
        if not names:  # the defaults depend on labels only the data will tell
            return base.EvalMetrics(("eval/loss",), "eval/loss")
        main = "f1" if "f1" in names else names[0]
        return base.EvalMetrics(("eval/loss", *(f"eval/{n}" for n in names)), f"eval/{main}")

    def sequence_length(self, config: TrainConfig, max_length: int) -> int:
        check_max_length(max_length, config.model)
        return max_length

    def data(self, run: Run) -> ExampleData:
        config, max_length = run.config, run.seq_len
        examples = load_examples(config.task, config.cache_dir)
        metrics = config.task.metrics or evaluation.default_metrics(examples.num_labels,
                                                                    examples.is_regression)
        evaluation.check_metrics(metrics, examples.is_regression)
        tokenizer = _tokenizer(config, run.start, examples.train)
        train_arrays = encode(examples.train, tokenizer, max_length)
        eval_arrays = encode(examples.eval, tokenizer, max_length)
        loader = example_loader(train_arrays, run.batch_size, run.job.mesh, seed=config.seed,
                                padding=config.task.padding)
        if loader.steps_per_epoch == 0:
            raise FlaxlmError(
                f"The training split has {len(examples.train)} example(s), fewer than one "
                f"global batch of {run.batch_size} (per-device batch × devices × "
                "trainer.grad_accum_steps). Use more examples, or lower "
                "hardware.per_device_batch_size or trainer.grad_accum_steps."
            )
        # Token ids and labels: the examples as the model sees them (the tokenizer is
        # checked on its own).
        fingerprint = {"training examples": arrays_fingerprint(train_arrays),
                       "evaluation examples": arrays_fingerprint(eval_arrays)}
        return ExampleData(tokenizer=tokenizer, loader=loader, fingerprint=fingerprint,
                           trains_on=f"{len(examples.train)} train / {len(examples.eval)} eval "
                                     f"examples of ≤ {max_length} tokens",
                           examples=examples, metrics=metrics, eval_arrays=eval_arrays)

    def network(self, run: Run) -> Network:
        config, examples, tokenizer = run.config, run.data.examples, run.data.tokenizer

        def build_classifier(spec, rngs):
            return build.build_classifier(spec, examples.num_labels, rngs)

        def flops_per_token(training: Training) -> float:
            return build.classifier_flops_per_token(config.model, training.num_params,
                                                    run.seq_len)

        hf_config = hf.to_classifier_config(
            config.model, num_labels=examples.num_labels, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            label_names=examples.label_names,
        )
        steps = functools.partial(compile_classifier_steps, is_regression=examples.is_regression,
                                  grad_accum_steps=config.trainer.grad_accum_steps,
                                  skip_nonfinite=config.trainer.skip_nonfinite)
        return Network(build=build_classifier, compile_steps=steps,
                       flops_per_token=flops_per_token, hf_config=hf_config, tokenizer=tokenizer,
                       about=("regression" if examples.is_regression
                              else f"{examples.num_labels} labels"))

    def evaluator(self, run: Run) -> evaluation.ClassifierEvaluator:
        examples = run.data.examples
        return evaluation.ClassifierEvaluator(
            run.training.steps, run.data.eval_arrays, run.eval_batch_size, run.job.mesh,
            run.data.metrics, examples.is_regression, examples.num_labels,
            run.config.task.padding,
        )

    def final_metrics(self, run: Run, state: TrainState, last_eval: dict) -> dict[str, float]:
        """The last evaluation and the steps (no tokens: a row's are mostly padding)."""
        if run.evaluator.last_predictions is None:  # resumed after the last eval: score once more
            last_eval = run.evaluator(state.params)
        return {**last_eval, "steps": int(state.step)}

    def export(self, run: Run, params: dict, final: dict) -> None:
        """predictions.jsonl of the held-out examples, and model/ as a sequence classifier."""
        job, data = run.job, run.data
        job.write(evaluation.write_predictions, job.path(layout.PREDICTIONS_FILE),
                  run.evaluator.last_predictions, data.eval_arrays["labels"],
                  data.examples.label_names)
        base.export_model(job, params, run.config.model, data.tokenizer, final,
                          hf_config=run.network.hf_config, generation=None)


@dataclasses.dataclass(kw_only=True)
class ExampleData(TaskData):
    """What the task trains and evaluates on."""

    examples: Examples
    metrics: list[str]  # the eval metrics: task.metrics, or the defaults of the labels
    eval_arrays: dict[str, np.ndarray]


def _tokenizer(config: TrainConfig, start: Start, train: datasets.Dataset):
    """The checkpoint's own tokenizer (its ids are what the embeddings learnt), else
    tokenizer.path, else a byte-level BPE trained on the training examples."""
    if start.checkpoint_dir and config.tokenizer.path is None:
        tokenizer = pretrained.load_pretrained_tokenizer(start.checkpoint_dir)
    else:
        columns = [c for c in ("text", "text_pair") if c in train.column_names]
        texts = text_dataset([t for column in columns for t in train[column]])
        tokenizer = prepare_tokenizer(config.tokenizer, texts, start.model.vocab_size,
                                      config.cache_dir)
    return with_pair_template(tokenizer)


def with_pair_template(tokenizer):
    """A tokenizer whose template puts nothing between the halves of a pair (no
    post-processor, as our byte-level BPEs: packing adds the EOS itself; GPT-2's; a Llama
    tokenizer's `<s> A B` or `A B`) would glue a sentence pair together. Give it BERT's layout
    with EOS as the separator, after the special tokens it puts in front of a text (a BOS):
    `[<s>] A </s>` and `[<s>] A </s> B </s>`, B's tokens of type 1, so the halves stay apart
    and a decoder's classifier reads a fixed end-of-input token. A language model's document
    start (`</s> A`, from a flaxlm export) gives way to it likewise. The template is saved with
    the tokenizer, so the exported classifier's tokenizer encodes pairs the same way."""
    if tokenizer.eos_token is None or not (has_document_start(tokenizer)
                                           or glues_pairs(tokenizer)):
        return tokenizer  # it has its own layout (e.g. BERT's [CLS] A [SEP] B [SEP])
    eos = tokenizer.eos_token
    lead = tokenizer.convert_ids_to_tokens(list(document_prefix(tokenizer)))
    first = " ".join([*(f"{token}:0" for token in lead), f"$A:0 {eos}:0"])
    set_post_processor(tokenizer, tokenizers.processors.TemplateProcessing(
        single=first,
        pair=f"{first} $B:1 {eos}:1",
        special_tokens=sorted({(token, tokenizer.convert_tokens_to_ids(token))
                               for token in (*lead, eos)}),
    ))
    return tokenizer


def check_max_length(length: int, model: ModelConfig) -> None:
    if not 2 <= length <= model.max_positions:
        raise FlaxlmError(
            f"task.max_seq_length={length} must be between 2 and the model's "
            f"{model.max_positions} positions ({model.name}). Lower task.max_seq_length."
        )


def classification_losses(logits_BxC: jax.Array, labels_B: jax.Array,
                          is_regression: bool) -> jax.Array:
    """Per-example loss in float32: cross-entropy on integer labels, or squared error for
    regression (one output), as HF's *ForSequenceClassification computes it."""
    logits_BxC = logits_BxC.astype(jnp.float32)
    if is_regression:
        return jnp.square(logits_BxC[:, 0] - labels_B.astype(jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxC, labels_B)


def compile_classifier_steps(mesh, graphdef, optimizer, is_regression: bool,
                             grad_accum_steps: int = 1,
                             skip_nonfinite: bool = False) -> CompiledSteps:
    """The shared jitted train step with a classification loss; `eval` returns the logits of
    every row (replicated, so every process holds the whole batch in device order)."""
    def loss_fn(model, batch, rngs):
        logits_BxC = model(batch["input_ids"], batch["attention_mask"],
                           batch["token_type_ids"], rngs=rngs)
        return classification_losses(logits_BxC, batch["labels"], is_regression).mean(), {}

    def logits(params, batch):
        model = nnx.merge(graphdef, params)
        return model(batch["input_ids"], batch["attention_mask"],
                     batch["token_type_ids"]).astype(jnp.float32)

    train = compile_train_step(mesh, graphdef, optimizer, loss_fn, grad_accum_steps,
                               skip_nonfinite)
    return CompiledSteps(train=train, eval=jax.jit(logits, out_shardings=replicated(mesh)))
