"""The steps of the one pipeline (tasks/pipeline.py) that every task runs, and what they share:
the context the job hands a task, where the model starts, the train state on the mesh (the
optimizer and its schedule, the model initialised or loaded from `model.init_from`, a stopped
run restored), the run's model/ directory, the throughput, the loop with its checkpoints, and
the export. The pipeline calls the steps in their order; a task's own parts use only what
they state with (`EvalMetrics`, `Start`, `Training`) and the export of model/ (`export_model`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from omegaconf import OmegaConf

from flaxlm import hardware_peak, layout
from flaxlm.config import ContextAttention, HardwareConfig, ModelConfig, TrainConfig
from flaxlm.data.loader import RowLoader
from flaxlm.errors import FlaxlmError
from flaxlm.export import export_hf
from flaxlm.models import hf, moe, pretrained
from flaxlm.models.attention import Choice, choose_backend
from flaxlm.models.build import model_rngs
from flaxlm.models.layers import TransformerSpec, count_params
from flaxlm.parallel import context_size, init_on_mesh, row_shards, run_accelerator
from flaxlm.runs import RunDir, save_config
from flaxlm.tracking import Tracker
from flaxlm.training.ahead import CompiledAhead, abstract
from flaxlm.training.checkpoint.manager import Checkpointer, key_to_json
from flaxlm.training.checkpoint.resume import (
    DATA_FINGERPRINT_KEY,
    DROPOUT_RNG_KEY,
    CheckpointSaver,
    restore_run,
)
from flaxlm.training.evaluation import Evaluate
from flaxlm.training.executables import kept_steps
from flaxlm.training.hooks import standard_hooks
from flaxlm.training.keys import dropout_impl, key_impl_name, run_keys
from flaxlm.training.loop import Hook, LoopState, Throughput, fit
from flaxlm.training.optimizer import make_optimizer, make_schedule
from flaxlm.training.plan import Plan, make_plan
from flaxlm.training.step import (
    CompiledSteps,
    TrainState,
    TrainStep,
    create_state,
    trained_part,
    with_trained_part,
)
from flaxlm.training.stop import StopRequest


@dataclasses.dataclass
class JobContext:
    """What the job hands a task: the typed config and the run's resources."""

    config: TrainConfig
    resolved: dict  # the resolved config as plain containers: saved with the run and its model
    run: RunDir
    mesh: Mesh
    tracker: Tracker
    checkpointer: Checkpointer
    stop: StopRequest

    @property
    def writes_files(self) -> bool:
        """Every process computes the same parameters and predictions; one writes them."""
        return jax.process_index() == 0

    def write(self, write_fn: Callable[..., Any], *args, **kwargs) -> None:
        """Run `write_fn`, a write of a file of this run, on process 0 only: every file a task
        writes goes through here."""
        if self.writes_files:
            write_fn(*args, **kwargs)

    def path(self, name: str) -> str:
        """`name` (a `flaxlm.layout` constant) inside the run directory."""
        return layout.run_path(self.run.path, name)

    def record_in_config(self, node: str, values: dict) -> None:
        """Settings the run worked out from its data (a mixture's weights, from its corpora's
        sizes) into its resolved config, so that config.yaml, the checkpoints and the model
        card say what the run did. Recorded before training; a resumed run records the same."""
        self.resolved[node].update(values)
        self.write(save_config, self.run.path, self.resolved)


@dataclasses.dataclass(frozen=True)
class EvalMetrics:
    """The eval metrics a task logs (as metrics.jsonl names them), the one a run returns to a
    sweeper unless trainer.objective names another, and those that are better lower (every
    other one is better higher)."""

    logged: tuple[str, ...]
    default: str
    lower_is_better: tuple[str, ...] = ("eval/loss",)


# ------------------------------------------------------------------ the model a run starts from


@dataclasses.dataclass(frozen=True)
class Start:
    """Where the weights come from: `model.init_from`'s checkpoint directory (None: a random
    init) and the model config of the run, with the checkpoint's shape when there is one."""

    checkpoint_dir: str | None
    model: ModelConfig


def model_start(config: TrainConfig) -> Start:
    """The run's start; with model.init_from, one line says which settings the checkpoint's
    config.json replaced, since the preset's name and shape no longer describe the model."""
    if not config.model.init_from:
        return Start(None, config.model)
    checkpoint_dir = pretrained.resolve_checkpoint(config.model.init_from, config.cache_dir)
    model = pretrained.pretrained_model_config(checkpoint_dir, config.model)
    replaced = pretrained.replaced_settings(config.model, model)
    print(f"flaxlm: model.init_from={config.model.init_from}: family and shape from its "
          "config.json" + (f", in place of model={config.model.name}'s: " + ", ".join(replaced)
                           if replaced else f" (the same as model={config.model.name}'s)"))
    if config.model.extend_context:
        # What the extension changes, as the checkpoint's settings before → the run's after.
        as_trained = pretrained.pretrained_model_config(
            checkpoint_dir, dataclasses.replace(config.model, extend_context=False))
        extended = pretrained.replaced_settings(
            dataclasses.replace(as_trained, extend_context=True), model)
        print("flaxlm: model.extend_context: the run's positions in place of the checkpoint's: "
              + (", ".join(extended) if extended else "the same"))
    return Start(checkpoint_dir, model)


def tokenizer_sha256(tokenizer) -> str:
    """What a checkpoint records of the tokenizer: a resumed run must read the same ids."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


# ------------------------------------------------------------------------- the train state


@dataclasses.dataclass
class Training:
    """A run ready to loop: the train state on the mesh, the compiled steps, the plan, and
    what a checkpoint records beside the state."""

    state: TrainState
    steps: CompiledSteps
    plan: Plan
    dropout_key: jax.Array
    metadata: dict
    num_params: int
    resume: LoopState | None
    attention: Choice
    num_trainable: int = 0  # parameters the optimizer updates (model.lora: the adapters)
    opt_state_bytes: int = 0
    trainable: Any = None  # the nnx filter of what trains; None: every parameter
    graphdef: Any = None  # the model's graph, to merge with `state.params`

    def checkpointed(self, state: TrainState) -> TrainState:
        """What a checkpoint holds of `state`: all of it, or with model.lora what trains."""
        return trained_part(state, self.trainable)


def prepare_training(
    job: JobContext,
    start: Start,
    build_model: Callable[[TransformerSpec, nnx.Rngs], nnx.Module],
    compile_steps: Callable[..., CompiledSteps],
    loader,
    tokenizer,
    data_fingerprint: dict[str, str],
    *,
    pads_rows: bool,
    trainable: Any = None,
    compile_ahead: bool = True,
) -> Training:
    """Optimizer, model, train state and compiled steps; a resumed run's state, dropout key
    and data position restored from its latest checkpoint.

    `build_model(spec, rngs)` makes the task's model; `compile_steps(mesh, graphdef, optimizer)`
    its jitted steps. `data_fingerprint` ({what: content hash}, e.g. "training
    data" and "validation data") is saved with every checkpoint; a resume on data with
    another fingerprint is refused unless trainer.resume_on_changed_data. `pads_rows`: the
    task's (`Task.pads_rows`), for the attention backend. `trainable`: the nnx filter of what
    trains (None: every parameter; with model.lora the adapters, `lora.trainable`): its
    checkpoints hold only that, the frozen rest is made again from model.init_from (or the
    seed) when it resumes.
    """
    config = job.config
    plan = make_plan(config, loader.steps_per_epoch)
    schedule = make_schedule(config.optimizer, plan.total_steps)
    tx = make_optimizer(config.optimizer, schedule)
    spec = model_spec(config, start.model, pads_rows)
    attention = attention_choice(config, start.model, pads_rows)
    init_key, dropout_key = run_keys(config.seed, run_dropout_impl(config.hardware))
    build = lambda: build_model(spec, model_rngs(params=init_key))  # noqa: E731
    steps = _steps(job, dataclasses.replace(config, model=start.model), build, tx,
                   compile_steps, loader if compile_ahead else None, plan, dropout_key,
                   data_fingerprint, trainable)
    # Made where it lives: each device computes (and keeps) only its part of each parameter.
    model = init_on_mesh(build, job.mesh)
    # A resumed run's weights come from its checkpoint, except a frozen base, which its
    # checkpoints do not hold.
    if start.checkpoint_dir and (not job.run.resuming or trainable is not None):
        report = pretrained.load_pretrained_weights(model, start.checkpoint_dir,
                                                    source=config.model.init_from,
                                                    shape_from_checkpoint=True)
        print(f"flaxlm: model.init_from={config.model.init_from}: {report}")
    graphdef, state = create_state(model, tx, job.mesh, trainable)  # by its logical axes
    tokenizer_hash = tokenizer_sha256(tokenizer)
    metadata = {"config": job.resolved, "tokenizer_sha256": tokenizer_hash,
                "dropout_key": key_to_json(dropout_key),
                DROPOUT_RNG_KEY: key_impl_name(dropout_key), "wandb_run_id": job.run.wandb_run_id,
                DATA_FINGERPRINT_KEY: data_fingerprint}
    if trainable is not None:
        metadata[LORA_BASE_KEY] = lora_base(config, start)
        if start.checkpoint_dir is None:
            print(f"flaxlm: note: model.lora trains adapters on a base of random weights (no "
                  f"model.init_from; made from seed={config.seed}, which a resume needs "
                  "again); set model.init_from to adapt a pretrained model")
    training = Training(state, steps, plan, dropout_key, metadata, count_params(model), None,
                        attention, num_trainable=_count(trained_part(state, trainable).params),
                        opt_state_bytes=_bytes(state.opt_state), trainable=trainable,
                        graphdef=graphdef)
    if job.run.resuming:  # before model/ is written: a resume that is refused changes nothing
        resumed = restore_run(job.checkpointer, training.checkpointed(state), dropout_key,
                              loader, tokenizer_hash, job.tracker, job.run.path,
                              data_fingerprint=data_fingerprint,
                              accept_changed_data=config.trainer.resume_on_changed_data)
        if trainable is not None:
            check_lora_base(resumed.metadata.get(LORA_BASE_KEY), metadata[LORA_BASE_KEY],
                            job.run.path, resumed.loop.step)
        training.state = with_trained_part(state, resumed.state, trainable)
        training.dropout_key, training.resume = resumed.dropout_key, resumed.loop
        announce_new_length(config, resumed.saved_config, plan, schedule, resumed.loop.step)
    return training


def _steps(job: JobContext, config: TrainConfig, build: Callable[[], nnx.Module], optimizer,
           compile_steps: Callable[..., CompiledSteps], loader, plan: Plan, dropout_key,
           data_fingerprint: dict[str, str], trainable) -> CompiledSteps:
    """The task's steps, made from the model's shapes before the model is initialised: loaded
    from or kept in a store of compiled steps (`kept_steps`: compiled_steps, or
    keep_compiled_steps), and the train step obtained in the background, from the shapes of
    the state (`create_state` of the model's shapes, as the real state will be laid out) and
    of the loader's first batch, while the model is initialised (`flaxlm.training.ahead`).
    A loader whose batches are not known before the loop reads them (a stream, or None: the
    task's batches change once the state exists) leaves the train step to its first call, as
    does a train step the task (or a test) wrapped. `config`: with the model the run starts
    from."""
    graphdef, state = create_state(nnx.eval_shape(build), optimizer, job.mesh, trainable)
    steps = kept_steps(compile_steps(job.mesh, graphdef, optimizer), config, plan.total_steps,
                       job.mesh, data_fingerprint)
    train = steps.train
    if (not isinstance(loader, RowLoader) or loader.steps_per_epoch == 0
            or not isinstance(train, TrainStep)):
        return steps
    args = (state, abstract(next(iter(loader.epoch(0)))), abstract(dropout_key),
            abstract(train.hyperparams))
    return dataclasses.replace(
        steps, train=dataclasses.replace(train, jitted=CompiledAhead(train.jitted, args)))


# The checkpoint metadata of a run that trains adapters (model.lora): the frozen base they
# were trained on, which its checkpoints do not hold.
LORA_BASE_KEY = "lora_base"


def lora_base(config: TrainConfig, start: Start) -> dict:
    """What a LoRA run's checkpoints record of its frozen base: model.init_from and the
    SHA-256 of its weight files, or, for a base initialised at random, the seed that made it."""
    if start.checkpoint_dir is None:
        return {"init_from": None, "seed": config.seed}
    return {"init_from": config.model.init_from,
            "weights_sha256": pretrained.weights_sha256(start.checkpoint_dir)}


def check_lora_base(saved: dict | None, current: dict, run_dir: str, step: int) -> None:
    """Adapters mean something only on the base they were trained on: a resume onto another
    is refused."""
    if saved == current:
        return

    def describe(base: dict | None) -> str:
        if not base:
            return "an unrecorded base"
        if base.get("init_from") is None:
            return f"a random base of seed={base.get('seed')}"
        return (f"model.init_from={base['init_from']} (weights SHA-256 "
                f"{str(base.get('weights_sha256'))[:12]})")

    raise FlaxlmError(
        f"Cannot resume the LoRA run in {run_dir}: its checkpoint at step {step} holds adapters "
        f"trained on {describe(saved)}, and this start's base is {describe(current)}. Its "
        "checkpoints hold only the adapters, which fit only the weights they were trained on. "
        "Resume with the original base (the same model.init_from, its files unchanged, and "
        "seed), or start a new run (trainer.resume=never with a new run_dir)."
    )


def _count(params) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(params))


def _bytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def run_dropout_impl(hardware: HardwareConfig) -> str:
    """The dropout key's implementation hardware.dropout_rng comes to on the run's devices."""
    return dropout_impl(hardware.dropout_rng, run_accelerator(hardware).platform)


def model_spec(config: TrainConfig, model: ModelConfig, pads_rows: bool) -> TransformerSpec:
    """`model`'s shape with the hardware's compute and parameter dtypes, and the attention
    backend `model.attention` and the expert dispatch `model.moe.dispatch` come to on the run's
    hardware (`attention_choice`, `moe.resolved`), which a plan compiles for from another."""
    model = dataclasses.replace(
        model, attention=attention_choice(config, model, pads_rows).backend,
        moe=moe.resolved(model.moe, run_accelerator(config.hardware).platform))
    return TransformerSpec(model, compute_dtype=jnp.dtype(config.hardware.compute_dtype),
                           param_dtype=jnp.dtype(config.hardware.param_dtype),
                           balance_context=config.hardware.mesh.balance_context)


def attention_choice(config: TrainConfig, model: ModelConfig, pads_rows: bool) -> Choice:
    """Which attention backend the run uses on the devices it computes on
    (`flaxlm.parallel.run_accelerator`: their platform and chip generation;
    `flaxlm.models.attention.choose_backend`); a FlaxlmError when `model.attention` names one
    they cannot run. `pads_rows`: the task's (`Task.pads_rows`)."""
    context = context_size(config.hardware)
    if (context != 1 and model.sliding_window is not None
            and ContextAttention(model.context_attention) is ContextAttention.ring):
        raise FlaxlmError(
            f"model.sliding_window={model.sliding_window} with model.context_attention=ring "
            f"(hardware.mesh.context={context}): the ring does not mask a window. Set "
            "model.context_attention=all_gather, which does.")
    return choose_backend(model.attention, run_accelerator(config.hardware),
                          config.hardware.compute_dtype,
                          config.task.max_seq_length or model.max_positions,
                          model.hidden_size // model.num_heads,
                          causal_lm=not pads_rows,
                          attention_dropout=model.attention_dropout,
                          context=context,
                          window=model.sliding_window)


def announce_new_length(config: TrainConfig, saved_config: dict, plan: Plan, schedule,
                        step: int) -> None:
    """A resumed run whose trainer.max_steps / num_epochs changed trains for another number
    of steps than its checkpoint planned, and its learning-rate schedule spans the new length
    (the schedule always spans the run: on the old one the added steps would all run at
    optimizer.end_lr). From `step` on the learning rate follows the new curve, which jumps when
    a decaying run is extended: said in one line, with both rates."""
    saved = saved_config.get("trainer") or {}
    saved_trainer = dataclasses.replace(
        config.trainer, max_steps=saved.get("max_steps", config.trainer.max_steps),
        num_epochs=saved.get("num_epochs", config.trainer.num_epochs))
    planned = make_plan(dataclasses.replace(config, trainer=saved_trainer),
                        plan.steps_per_epoch).total_steps
    if planned == plan.total_steps:
        return
    old_lr = float(make_schedule(config.optimizer, planned)(step))
    new_lr = float(schedule(step))
    print(f"flaxlm: trainer.max_steps / num_epochs now make the run {plan.total_steps} steps "
          f"long where its checkpoint planned {planned}: the learning-rate schedule is "
          f"{'stretched' if plan.total_steps > planned else 'shortened'} to "
          f"{plan.total_steps} steps, so at step {step} the learning rate is {new_lr:.3g} "
          f"instead of the old schedule's {old_lr:.3g} (resume with the old length to keep the "
          "old schedule)", flush=True)


def start_model_dir(job: JobContext, model: ModelConfig, tokenizer, hf_config) -> None:
    """model/ gets the tokenizer and HF config now, so that flaxlm-export can turn any
    checkpoint of the run into an HF directory while it trains (the end of the run completes
    it); model_config.yaml records the shape the run trains, whatever model.init_from gave."""
    job.write(tokenizer.save_pretrained, job.path(layout.MODEL_SUBDIR))
    job.write(hf.write_config, job.path(layout.MODEL_SUBDIR), hf_config)
    job.write(OmegaConf.save, OmegaConf.structured(model), job.path(layout.MODEL_CONFIG_FILE))


def throughput(job: JobContext, tokens_per_step: int, flops_per_token: float) -> Throughput:
    """Tokens and FLOPs per step, and the mesh's peak FLOP/s (None: no MFU is logged)."""
    configured = job.config.hardware.peak_tflops_per_device
    if configured is not None and not configured > 0:
        raise FlaxlmError(
            f"hardware.peak_tflops_per_device={configured}: the peak is the denominator of MFU "
            "and must be a positive number of TFLOP/s per device, or null to take the "
            "device's known peak (no MFU is logged on a device without one, such as a CPU)."
        )
    kinds = [device.device_kind for device in job.mesh.devices.flat]
    peak = hardware_peak.peak_flops(configured, kinds)
    if peak is None:
        print(f"flaxlm: no MFU logged: the peak FLOP/s of {', '.join(sorted(set(kinds)))} "
              "devices is not known (set hardware.peak_tflops_per_device to log one)")
    return Throughput(tokens_per_step, flops_per_token, peak)


def eval_batch_size(hardware: HardwareConfig, num_devices: int) -> int:
    """Rows per evaluation batch over the whole mesh: per device, times the row shards (the
    devices of a context or tensor axis share their rows; `row_shards`)."""
    per_device = hardware.per_device_eval_batch_size or hardware.per_device_batch_size
    return per_device * row_shards(hardware.mesh, num_devices)


def run_loop(job: JobContext, training: Training, loader, evaluate: Evaluate,
             throughput: Throughput, hooks: Sequence[Hook] = ()
             ) -> tuple[TrainState, dict[str, float]]:
    """The loop with the standard hooks and the task's own `hooks` (see training/hooks.py),
    checkpointing with the run's metadata; the final state and last evaluation."""
    saver = CheckpointSaver(job.checkpointer, loader, training.metadata,
                            select=training.checkpointed)
    state, last_eval = fit(training.state, training.steps, loader, training.plan, throughput,
                           job.tracker, training.dropout_key,
                           standard_hooks(training.plan, evaluate, extra=hooks), save=saver,
                           resume=training.resume, stop=job.stop)
    print(f"flaxlm: {saver.describe()}")
    return state, last_eval


def export_model(job: JobContext, params: dict, model: ModelConfig, tokenizer,
                 final: dict, **export_options) -> None:
    """The run's model/ completed: weights, model card and (for an LM) generation settings.
    model/ is the run's own, so what `start_model_dir` wrote there is replaced."""
    job.write(export_hf, job.path(layout.MODEL_SUBDIR), params, model, tokenizer,
              run_config=job.resolved, eval_metrics=final,
              source=f"{job.run.path}, step {final['steps']}", overwrite=True,
              **export_options)


def model_params(state: TrainState) -> dict:
    """The parameters as a nested dict (as `nnx.to_pure_dict` gives) of the arrays where they
    lie on the mesh: the export gathers them to the host one tensor at a time, and samples
    are drawn on the mesh, so the whole model is never on one device or twice on the host."""
    return nnx.to_pure_dict(state.params)
