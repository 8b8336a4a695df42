"""What the language-model tasks (clm, sft, dpo) share: `LanguageModelTask`, the parts of the
pipeline they state alike (a GPT-2 or Llama network and its next-token steps, model/ as a
causal LM, eval.harness as a loop hook, an export that merges LoRA adapters, and samples from
the trained model); how long their sequences are; and the chat tasks' tokenizer. The tasks
themselves stay independent of each other; each imports this."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence

import jax

from flaxlm import layout
from flaxlm.config import ModelConfig, TrainConfig
from flaxlm.data.chat_template import CHATML_MARKERS, with_chat_template
from flaxlm.data.tables import text_dataset
from flaxlm.data.tokenizer import (
    keeps_own_conventions,
    prepare_tokenizer,
    prompt_tokenizer,
    token_byte_lengths,
)
from flaxlm.errors import FlaxlmError
from flaxlm.export import export_adapter
from flaxlm.generate import log_samples, settings_from_samples
from flaxlm.models import build, hf, lora, moe, pretrained
from flaxlm.models.layers import check_head_width, check_sliding_window
from flaxlm.parallel import replicated
from flaxlm.tasks import base
from flaxlm.tasks.base import JobContext
from flaxlm.tasks.pipeline import Network, Run, Task
from flaxlm.training.loop import Hook
from flaxlm.training.step import CompiledSteps, LossSettings, compile_steps


class LanguageModelTask(Task):
    """A task that trains a causal LM (GPT-2 or Llama, from model.init_from or fresh, LoRA
    allowed): its network, model/, downstream hook and export, stated once for clm, sft and
    dpo. Each states its data and evaluation; DPO its own steps (`steps_compiler`)."""

    chat = True  # samples are a user's turns answered (task=clm's: prompts continued)

    def check_settings(self, config: TrainConfig) -> int:
        """What every LM task checks (a causal-LM family, LoRA's settings, the head width and
        sliding window, the block length, eval.harness's) around what the task checks of its
        data (`check_data_settings`)."""
        build.check_lm_family(config.model,
                              f"task={config.task.name} trains a causal language model")
        lora.check_lora(config.model)
        moe.check_moe(config.model)
        check_head_width(config.model)
        check_sliding_window(config.model)
        self.check_data_settings(config)
        seq_len = config.task.max_seq_length or config.model.max_positions
        check_block_length(config, seq_len)
        check_downstream(config)
        return seq_len

    @abc.abstractmethod
    def check_data_settings(self, config: TrainConfig) -> None:
        """Check the settings of the task's data (raising FlaxlmError), before any is read."""

    def sequence_length(self, config: TrainConfig, seq_len: int) -> int:
        settings_from_samples(config.samples)  # a bad setting fails now, not after training
        return lm_sequence_length(config, seq_len)

    def steps_compiler(self, run: Run) -> Callable[..., CompiledSteps]:
        return lm_steps_compiler(run.config)

    def network(self, run: Run) -> Network:
        config, tokenizer, seq_len = run.config, run.data.tokenizer, run.seq_len

        def flops_per_token(training: base.Training) -> float:
            return build.lm_flops_per_token(
                config.model, training.num_params, seq_len,
                training.num_trainable if training.trainable is not None else None)

        hf_config = hf.lm_config_json(config.model, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)
        return Network(build=build.build_lm, compile_steps=self.steps_compiler(run),
                       flops_per_token=flops_per_token, hf_config=hf_config,
                       tokenizer=prompt_tokenizer(tokenizer, own_conventions(config)),
                       trainable=lora.trainable(config.model))

    def hooks(self, run: Run) -> list[Hook]:
        return downstream_hooks(run.job, run.config.model, run.data.tokenizer,
                                own_conventions(run.config))

    def export(self, run: Run, params: dict, final: dict) -> None:
        config, tokenizer = run.config, run.data.tokenizer
        settings, own = settings_from_samples(config.samples), own_conventions(config)
        if config.model.moe.bias_update_rate:
            # Known from the start, and no reason to fail a finished run: the checkpoints
            # hold the model, routing bias and all.
            print(f"flaxlm: no transformers export in {layout.MODEL_SUBDIR}/: "
                  f"model.moe.bias_update_rate={config.model.moe.bias_update_rate} "
                  "trained a routing bias that transformers' MoE classes do not have, "
                  "so an export would route tokens otherwise than the model trained; "
                  "the run's checkpoints hold it whole.")
            model = config.model
        else:
            model, params = export_lm(run.job, config.model, params, tokenizer, final,
                                      generation=settings, own_conventions=own)
        log_samples(build.lm_from_params(model, params), tokenizer, config.samples.prompts,
                    settings, run.job.tracker, step=final["steps"], own_conventions=own,
                    chat=self.chat)


def check_chat_source(config: TrainConfig, what: str, no_data: str) -> None:
    """Where a chat task's data come from: task.files (with task.eval_files, if any),
    task.hub_path or task.drills, never a corpus; `no_data` is the error without any."""
    task = config.task
    if config.language is not None:
        raise FlaxlmError(
            f"task={task.name} reads {what} from task.files, task.hub_path or task.drills, so "
            f"language={config.language.name} (a corpus for task=clm) would be ignored. Drop "
            "the language override.")
    if task.drills <= 0 and task.hub_path is None and not task.files:
        raise FlaxlmError(no_data)
    if task.eval_files and not task.files:
        raise FlaxlmError(f"task.eval_files is set but task.files is empty: give the training "
                          f"{what} too, task.files=[train.jsonl].")


def pad_id(tokenizer) -> int:
    """What fills a chat row after its last token: the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def token_bytes(run: Run) -> jax.Array:
    """The UTF-8 bytes of each token of the run's tokenizer, on every device: what an LM
    evaluation turns its loss into bits per byte with."""
    # Put from the host straight onto the mesh: through `jnp.asarray` it compiles a copy.
    return jax.device_put(token_byte_lengths(run.data.tokenizer),
                          replicated(run.job.mesh))


def own_conventions(config: TrainConfig) -> bool:
    """Whether the run frames documents and prompts with its tokenizer's own special tokens
    (`keeps_own_conventions`)."""
    return keeps_own_conventions(config.tokenizer.convention, config.model.init_from)


def lm_sequence_length(config: TrainConfig, seq_len: int) -> int:
    """The block length once the model the run starts from is known (`config.model`): with
    model.init_from, the checkpoint's shape decides its default."""
    if config.model.init_from:
        seq_len = config.task.max_seq_length or config.model.max_positions
        check_block_length(config, seq_len)
    return seq_len


def lm_start(config: TrainConfig, seq_len: int) -> tuple[TrainConfig, base.Start, int]:
    """The run's start (`base.model_start`), the config with the model it starts from, and the
    block length (`lm_sequence_length`)."""
    start = base.model_start(config)
    config = dataclasses.replace(config, model=start.model)
    return config, start, lm_sequence_length(config, seq_len)


def lm_steps_compiler(config: TrainConfig) -> Callable[..., CompiledSteps]:
    """`compile(mesh, graphdef, optimizer)`: the LM's train and eval steps as this run
    jits them (its gradient accumulation, its handling of non-finite steps)."""

    def compile_lm_steps(mesh, graphdef, optimizer) -> CompiledSteps:
        return compile_steps(mesh, graphdef, optimizer, config.trainer.grad_accum_steps,
                             skip_nonfinite=config.trainer.skip_nonfinite,
                             loss=LossSettings(z_loss=config.trainer.z_loss,
                                               chunk_size=config.trainer.loss_chunk_size),
                             trainable=lora.trainable(config.model),
                             position_buckets=tuple(config.eval.position_buckets))

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
