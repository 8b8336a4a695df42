"""What the language-model tasks (clm, sft, dpo) share: where a run starts and how long its
sequences are, how its next-token train and eval steps are compiled, the chat tasks'
tokenizer, and its downstream evaluation (eval.harness). The tasks themselves stay
independent of each other; each imports this."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from flaxlm import layout
from flaxlm.config import ModelConfig, TrainConfig
from flaxlm.data.chat_template import CHATML_MARKERS, with_chat_template
from flaxlm.data.tables import text_dataset
from flaxlm.data.tokenizer import prepare_tokenizer
from flaxlm.errors import FlaxlmError
from flaxlm.export import export_adapter
from flaxlm.models import lora, pretrained
from flaxlm.tasks import base
from flaxlm.tasks.base import JobContext
from flaxlm.training.loop import Hook
from flaxlm.training.step import CompiledSteps, LossSettings, compile_steps


def lm_start(config: TrainConfig, seq_len: int) -> tuple[TrainConfig, base.Start, int]:
    """The run's start (`base.model_start`), the config with the model it starts from, and the
    block length: with model.init_from, the checkpoint's shape decides its default."""
    start = base.model_start(config)
    if start.checkpoint_dir:
        config = dataclasses.replace(config, model=start.model)
        seq_len = config.task.max_seq_length or config.model.max_positions
        check_block_length(config, seq_len)
    return config, start, seq_len


def lm_steps_compiler(config: TrainConfig) -> Callable[..., CompiledSteps]:
    """`compile(mesh, graphdef, tx, schedule)`: the LM's train and eval steps as this run
    jits them (its gradient accumulation, its handling of non-finite steps)."""

    def compile_lm_steps(mesh, graphdef, tx, schedule) -> CompiledSteps:
        return compile_steps(mesh, graphdef, tx, schedule, config.trainer.grad_accum_steps,
                             skip_nonfinite=config.trainer.skip_nonfinite,
                             loss=LossSettings(z_loss=config.trainer.z_loss,
                                               chunk_size=config.trainer.loss_chunk_size),
                             trainable=lora.trainable(config.model))

    return compile_lm_steps


def chat_tokenizer(config: TrainConfig, start: base.Start,
                   conversations: Sequence[Sequence[dict]]):
    """The chat tasks' tokenizer with its chat template (`with_chat_template`):
    model.init_from's, else tokenizer.path, else a byte-level BPE trained on the
    `conversations`' text with ChatML's markers among its special tokens."""
    if start.checkpoint_dir and config.tokenizer.path is None:
        tokenizer = pretrained.load_pretrained_tokenizer(start.checkpoint_dir)
    else:
        settings = config.tokenizer
        if config.task.chat_template is None:
            extra = [m for m in CHATML_MARKERS if m not in settings.special_tokens]
            settings = dataclasses.replace(settings,
                                           special_tokens=[*settings.special_tokens, *extra])
        texts = text_dataset(["\n".join(f"{turn['role']}\n{turn['content']}" for turn in turns)
                              for turns in conversations])
        tokenizer = prepare_tokenizer(settings, texts, config.model.vocab_size,
                                      config.cache_dir)
    return with_chat_template(tokenizer, config.task.chat_template, config.model.vocab_size)


def check_block_length(config: TrainConfig, seq_len: int) -> None:
    if not 2 <= seq_len <= config.model.max_positions:
        raise FlaxlmError(
            f"task.max_seq_length={seq_len} must be between 2 and the model's context length "
            f"model.max_positions={config.model.max_positions} ({config.model.name}). Lower "
            "task.max_seq_length, or pick a model with more positions."
        )


def export_lm(job: JobContext, model: ModelConfig, params: dict, tokenizer, final: dict,
              **export_options) -> tuple[ModelConfig, dict]:
    """The run's model/ (`base.export_model`) of `model` (the shape the run trained, after
    model.init_from); with model.lora, the PEFT adapter directory beside it first, and model/
    the merged model. Returns the exported network's config and parameters (merged), what
    end-of-run samples are drawn from."""
    if lora.enabled(model):
        job.write(export_adapter, job.path(layout.ADAPTER_SUBDIR), params, model,
                  base_model=model.init_from, source=f"{job.run.path}, step {final['steps']}")
        params = lora.merged_params(params, lora.adapter_scale(model.lora))
        model = lora.without_adapters(model)
    base.export_model(job, params, model, tokenizer, final, **export_options)
    return model, params


def check_downstream(config: TrainConfig) -> None:
    """eval.harness's settings, checked before any data is read."""
    if config.eval.harness.tasks:
        _downstream().check_harness(config.eval.harness)


def downstream_hooks(job: JobContext, model: ModelConfig, tokenizer,
                     own_conventions: bool) -> list[Hook]:
    """The loop hook of eval.harness (none without tasks), on the network of `model` (the
    shape the run trains, after model.init_from)."""
    harness = job.config.eval.harness
    if not harness.tasks:
        return []
    return [_downstream().HarnessEvaluation(harness, model, tokenizer, own_conventions,
                                            job.mesh, job.run.path)]


def _downstream():
    """flaxlm.downstream, which loads lm-evaluation-harness: only for a run with
    eval.harness.tasks, and with a clear error where the harness is not installed."""
    try:
        from flaxlm import downstream
    except ImportError as error:
        raise FlaxlmError(
            f"eval.harness needs lm-evaluation-harness, which is not installed ({error}). "
            "Install flaxlm's `eval` extra (pip install -e '.[eval]'), or set "
            "eval.harness.tasks=[]."
        ) from None
    return downstream
