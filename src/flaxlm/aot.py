"""A run planned ahead of time (`flaxlm-plan`): will it fit, and how fast might it go.

The plan takes the path training takes, with shapes instead of arrays: the typed config, the
model built under `nnx.eval_shape` (no parameter is allocated), the train state made by
`create_state` with the shardings training gives it, the batch as `ShapeDtypeStruct`s laid out
as the loader lays it out, and the train and eval steps the task jits, compiled for the
hardware's devices: a TPU slice's chips (`hardware.topology`, XLA's TPU compiler from libtpu,
no TPU attached) or, for the other groups, the devices JAX runs on. What compiles here is what
training runs. It reads no data and trains no tokenizer: the vocabulary is the model's.

What the compiler reports, and how far to trust it:
- per-chip memory (`memory_analysis`): arguments + outputs − donated (aliased) + temporaries,
  the figure the chip must hold; dependable;
- FLOPs and bytes (`cost_analysis`) of the compiled per-chip program: a loop's body counts
  once, so the step's figures are multiplied by its micro-batches (the optimizer update,
  outside the loop, is then over-counted, by a little); a kernel the compiler cannot see
  into counts nothing: with `model.attention=splash` (a Pallas kernel, what `auto` takes on
  a TPU v4 or newer) attention's FLOPs and bytes are missing from both, and with megablox's
  grouped matmul a Mixture-of-Experts model's expert matmuls; the roofline's compute then
  takes the model's analytic FLOPs where they are more than the compiled count, and is low
  by the kernels' share beyond them;
- collectives (`flaxlm.training.collectives`): the bytes of the results of the compiled
  step's all-gathers, all-reduces, reduce-scatters, all-to-alls and collective-permutes, read
  from its HLO, loops counted as many times as they run: what the chips send each other, to
  compare layouts (model.context_attention, fsdp); no time is made of it;
- the time is a roofline, not a measurement: the larger of FLOPs over the chip's peak and
  bytes over its HBM bandwidth; communication between chips and imperfect overlap are not in
  it, and cost analysis's bytes can exceed the chip's real traffic (a real chip can run the
  step faster than this roofline; docs/benchmarks.md), so the tokens/s and MFU it projects
  are estimates, not bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from omegaconf import DictConfig, OmegaConf

from flaxlm import hardware_peak
from flaxlm.config import MeshConfig, ModelConfig, Remat, TrainConfig
from flaxlm.errors import FlaxlmError
from flaxlm.job import check_settings
from flaxlm.models import build, lora, moe
from flaxlm.models.attention import kernel_compile_error
from flaxlm.models.layers import count_params
from flaxlm.parallel import (
    BATCH_AXES,
    CONTEXT_AXIS,
    DATA_AXIS,
    EXPERT_AXIS,
    FSDP_AXIS,
    MESH_AXES,
    TENSOR_AXIS,
    batch_spec,
    compiles_for_topology,
    configure_platform,
    make_mesh,
    mesh_shape,
    replicated,
    row_shards,
    run_accelerator,
    target_devices,
)
from flaxlm.tasks import base
from flaxlm.tasks.clm import CausalLM
from flaxlm.tasks.language_model import lm_start, lm_steps_compiler
from flaxlm.training import collectives, executables
from flaxlm.training.ahead import abstract
from flaxlm.training.memory import MEMORY_RECIPES, MemoryRecipe
from flaxlm.training.optimizer import make_optimizer, make_schedule
from flaxlm.training.plan import global_batch_size
from flaxlm.training.step import CompiledSteps, TrainState, create_state, trained_part

GIB = 2**30


class DoesNotFit(FlaxlmError):
    """XLA's compiler refused the step: it cannot fit the chip's memory (the plan's answer)."""


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """One compiled step's per-chip figures, as XLA reports them."""

    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs written into donated arguments
    temp_bytes: int  # the compiler's temporaries: activations, gathered weights, buffers
    code_bytes: int
    flops: float  # the program's, a loop's body once
    bytes_accessed: float
    # Bytes of each kind of collective in one run of the program, loops counted in full
    # (`flaxlm.training.collectives`): what the cost analysis leaves out.
    collective_bytes: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def communication_bytes(self) -> int:
        return sum(self.collective_bytes.values())

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a run of a config needs per chip and per step; see the module's docstring."""

    model: str
    hardware: str
    device_kind: str
    num_devices: int
    mesh: dict[str, int]
    topology: str | None
    remat: str
    per_device_batch: int  # rows of one micro-batch on one device
    grad_accum_steps: int
    global_batch: int  # rows per optimizer step
    seq_len: int
    num_params: int
    param_bytes: int  # per chip, as the state's shardings split them
    opt_state_bytes: int
    batch_bytes: int
    train: CompiledStep
    eval: CompiledStep
    flops_per_token: float  # analytic (models.build.lm_flops_per_token)
    hbm_bytes: float | None  # one chip's; None: unknown
    peak_flops: float | None  # one chip's
    hbm_bandwidth: float | None  # bytes/s, one chip's
    # Per-chip parameter and optimizer bytes with fsdp over all devices, when that differs.
    fsdp_state_bytes: int | None = None
    # A Mixture-of-Experts model's: the overrides that split its experts over more devices
    # (`expert_axis_overrides`), and the per-chip parameter and optimizer bytes they leave.
    expert_overrides: tuple[str, ...] = ()
    expert_state_bytes: int | None = None
    attention: str = ""  # the backend and why, as the run's banner says it
    dispatch: str = ""  # a Mixture-of-Experts model's: how tokens reach their experts there
    # Where hbm_bytes comes from: the preset's hardware.hbm_gib_per_device (what a program can
    # use, not the chip's nominal memory) or the attached chip's bytes_limit.
    hbm_source: str = ""
    # model.scan_layers: the cost analysis counts the scanned block once, not once per layer,
    # so the compiled FLOPs and bytes are far too low and no roofline is made of them.
    scan_layers: bool = False

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.opt_state_bytes

    @property
    def eval_total_bytes(self) -> int:
        """Evaluation runs while the train state stays on the chip."""
        return self.eval.total_bytes + self.opt_state_bytes

    @property
    def peak_bytes(self) -> int:
        return max(self.train.total_bytes, self.eval_total_bytes)

    @property
    def fits(self) -> bool | None:
        return None if self.hbm_bytes is None else self.peak_bytes <= self.hbm_bytes

    @property
    def step_flops(self) -> float:
        """The compiled step's FLOPs per chip, its micro-batch loop counted in full."""
        return self.train.flops * self.grad_accum_steps

    @property
    def step_bytes_accessed(self) -> float:
        return self.train.bytes_accessed * self.grad_accum_steps

    @property
    def model_flops(self) -> float:
        """The analytic FLOPs of one step per chip (no recomputation counted)."""
        return self.flops_per_token * self.tokens_per_step / self.num_devices

    @property
    def compute_s(self) -> float | None:
        """The step's FLOPs at the chip's peak: the compiled count, or the model's analytic
        FLOPs where kernels hide more than recomputation adds (megablox's expert matmuls, a
        Mixture-of-Experts step's most, count nothing), so that no MFU exceeds 100%."""
        if self.peak_flops is None:
            return None
        return max(self.step_flops, self.model_flops) / self.peak_flops

    @property
    def memory_s(self) -> float | None:
        return None if self.hbm_bandwidth is None else self.step_bytes_accessed / self.hbm_bandwidth

    @property
    def roofline_s(self) -> float | None:
        """The step's time estimate: the slower of compute and HBM traffic."""
        if self.compute_s is None or self.scan_layers:
            return None
        return max(self.compute_s, self.memory_s or 0.0)

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.roofline_s is None else self.tokens_per_step / self.roofline_s

    @property
    def mfu(self) -> float | None:
        if self.roofline_s is None:
            return None
        return self.model_flops / (self.roofline_s * self.peak_flops)

    def as_dict(self) -> dict:
        derived = ("tokens_per_step", "state_bytes", "eval_total_bytes", "peak_bytes", "fits",
                   "step_flops", "step_bytes_accessed", "model_flops", "compute_s",
                   "memory_s", "roofline_s", "tokens_per_s", "mfu")
        return {**dataclasses.asdict(self), **{name: getattr(self, name) for name in derived}}


@dataclasses.dataclass(frozen=True)
class AbstractRun:
    """A run laid out on its hardware as shapes: the jitted steps and the abstract arguments
    they take, ready to lower and compile; nothing allocated."""

    config: TrainConfig
    devices: list
    mesh: Mesh
    seq_len: int
    model: nnx.Module  # abstract
    tx: Any
    state: TrainState  # abstract, with training's shardings
    steps: CompiledSteps  # jitted, not yet compiled
    train_args: tuple  # (state, batch, dropout key)
    eval_args: tuple  # (params, inputs, row mask, token bytes)


def abstract_run(cfg: DictConfig | TrainConfig) -> AbstractRun:
    """The run `cfg` describes, as training would set it up, with shapes for arrays."""
    config: TrainConfig = cfg if isinstance(cfg, TrainConfig) else OmegaConf.to_object(cfg)
    if config.task.name != "clm":
        raise FlaxlmError(
            f"flaxlm-plan plans task=clm runs; task={config.task.name} is not one yet."
        )
    hardware = config.hardware
    try:
        configure_platform(hardware, config.model.remat, compile_only=True)
    except FlaxlmError as err:
        if hardware.platform != "tpu":
            raise
        raise FlaxlmError(
            f"{err} Without a TPU attached, flaxlm-plan compiles for the slice that "
            f"hardware.topology names, and hardware={hardware.name} names none: pick a preset "
            "(hardware=tpu-v4-8, tpu-v5e-8, tpu-v5p-8, tpu-v6e-8, ...) or set "
            "hardware.topology.name (e.g. v4:2x2x1 with hardware.topology.chip_config="
            "megacore)."
        ) from err
    devices = target_devices(hardware)
    mesh = make_mesh(hardware.num_devices, hardware.mesh, devices)
    # model.init_from: its config.json's shape, no weights
    config, _, seq_len = lm_start(config, check_settings(config, mesh.size))
    schedule = make_schedule(config.optimizer, _schedule_length(config))
    tx = make_optimizer(config.optimizer, schedule)
    model = abstract_model(config)
    graphdef, state = create_state(model, tx, mesh, lora.trainable(config.model))
    steps = lm_steps_compiler(config)(mesh, graphdef, tx)
    batch = batch_spec((global_batch_size(config, mesh.size), seq_len), jnp.int32, mesh)
    eval_rows = base.eval_batch_size(hardware, mesh.size)
    eval_args = (state.params, batch_spec((eval_rows, seq_len), jnp.int32, mesh),
                 batch_spec((eval_rows,), jnp.int32, mesh),
                 jax.ShapeDtypeStruct((config.model.vocab_size,), jnp.int32,
                                      sharding=replicated(mesh)))
    return AbstractRun(config, list(devices), mesh, seq_len, model, tx, state, steps,
                       (state, batch, abstract_key(mesh, base.run_dropout_impl(hardware))),
                       eval_args)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What a plan knows before it compiles: the run's shape on the mesh and per-chip state."""

    num_devices: int
    remat: str
    per_device_batch: int
    grad_accum_steps: int
    param_bytes: int
    opt_state_bytes: int
    fsdp_state_bytes: int | None
    expert_overrides: tuple[str, ...] = ()
    expert_state_bytes: int | None = None

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.opt_state_bytes


def plan(cfg: DictConfig | TrainConfig, save_to: str | None = None) -> RunPlan:
    """Compile the run `cfg` describes for its hardware, without running it. A run whose
    step the compiler cannot fit in a chip's memory is a FlaxlmError saying what to change.
    `save_to`: a directory that a run of `cfg` on these devices loads its compiled steps from
    (flaxlm-train compiled_steps=DIR; `flaxlm.training.executables`)."""
    run = abstract_run(cfg)
    keep = _saver(run, save_to) if save_to else (lambda role, args: None)
    config, hardware, mesh, state = run.config, run.config.hardware, run.mesh, run.state
    batch = run.train_args[1]
    rows, accum = batch.shape[0], config.trainer.grad_accum_steps
    trainable = lora.trainable(config.model)
    expert_overrides, expert_mesh = expert_axis_overrides(config, mesh.size)
    layout = _Layout(
        num_devices=mesh.size, remat=Remat(config.model.remat).value,
        per_device_batch=rows // accum // row_shards(config.hardware.mesh, mesh.size),
        grad_accum_steps=accum,
        param_bytes=per_device_bytes(state.params),
        opt_state_bytes=per_device_bytes((state.step, state.opt_state)),
        fsdp_state_bytes=_fsdp_state_bytes(mesh, run.model, run.tx, trainable),
        expert_overrides=expert_overrides,
        expert_state_bytes=None if expert_mesh is None else _state_bytes(
            make_mesh(None, expert_mesh, list(mesh.devices.flat)), run.model, run.tx,
            trainable))
    # A run calls the jitted train step with the optimizer's numbers after the train step's
    # own arguments (`TrainStep`): the program a run looks up is keyed by all four.
    train = _compile_or_refuse(run, layout, "train", run.steps.train, run.train_args,
                               keep("train", (*run.train_args,
                                              abstract(run.steps.train.hyperparams))))
    evaluate = _compile_or_refuse(run, layout, "eval", run.steps.eval, run.eval_args,
                                  keep("eval", run.eval_args))
    num_params = count_params(run.model)
    kind = run.devices[0].device_kind
    hbm = _hbm_bytes(hardware.hbm_gib_per_device, run.devices[0])
    return RunPlan(
        model=config.model.name, hardware=hardware.name, device_kind=kind,
        num_devices=mesh.size, mesh=dict(mesh.shape),
        topology=hardware.topology.name if compiles_for_topology(hardware) else None,
        remat=layout.remat,
        per_device_batch=layout.per_device_batch, grad_accum_steps=accum, global_batch=rows,
        seq_len=run.seq_len, num_params=num_params, param_bytes=layout.param_bytes,
        opt_state_bytes=layout.opt_state_bytes, batch_bytes=per_device_bytes(batch),
        train=train, eval=evaluate,
        flops_per_token=build.lm_flops_per_token(config.model, num_params, run.seq_len,
                                                 _trained_params(state, config.model)),
        hbm_bytes=hbm,
        hbm_source=_hbm_source(hardware.hbm_gib_per_device, hbm),
        peak_flops=hardware_peak.peak_flops(hardware.peak_tflops_per_device, [kind]),
        hbm_bandwidth=None if hardware.hbm_gbps_per_device is None
        else hardware.hbm_gbps_per_device * 1e9,
        fsdp_state_bytes=layout.fsdp_state_bytes,
        expert_overrides=layout.expert_overrides, expert_state_bytes=layout.expert_state_bytes,
        attention=base.attention_choice(config, config.model, CausalLM.pads_rows).describe(),
        dispatch=moe.describe_dispatch(config.model.moe, run_accelerator(hardware).platform)
        if moe.enabled(config.model) else "",
        scan_layers=config.model.scan_layers,
    )


def _saver(run: AbstractRun, directory: str) -> Callable:
    """`keep(role, args)`: what hands the compiled `role` step, made for `args`, to the
    directory a run loads it from. The schedule's length is compiled into the train step:
    without data it is known only from trainer.max_steps."""
    if run.config.trainer.max_steps is None:
        raise FlaxlmError(
            "flaxlm-plan --save needs trainer.max_steps: the train step has the learning-rate "
            "schedule's length compiled in, and without reading the data the plan cannot know "
            "an epoch's. Add trainer.max_steps=N to the plan's overrides and to the run's.")
    store = executables.StepStore(directory)
    key = executables.program_key(run.config, _schedule_length(run.config), run.mesh)
    return lambda role, args: (
        lambda compiled: store.save(key, role, executables.signature(args), compiled))


def _compile_or_refuse(run: AbstractRun, layout: _Layout, phase: str, step, args,
                       keep: Callable | None = None) -> CompiledStep:
    """`compile_step`; XLA's TPU compiler refuses a program that cannot fit the chip's
    memory, which is the plan's answer, said as one paragraph with what to change; an
    attention kernel that does not compile for the chips is one paragraph too."""
    try:
        return compile_step(step, *args, keep=keep)
    except Exception as err:  # noqa: BLE001 — JaxRuntimeError, whatever XLA raises
        kernel = kernel_compile_error(
            err, base.attention_choice(run.config, run.config.model, CausalLM.pads_rows))
        if kernel is not None:
            raise kernel from err
        text = str(err)
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        reason = text.split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0].rstrip(".")
        raise DoesNotFit(
            f"model={run.config.model.name} does not fit hardware={run.config.hardware.name}: "
            f"XLA's compiler cannot fit the {phase} step in a {run.devices[0].device_kind}'s "
            f"memory ({reason}); parameters {gib(layout.param_bytes)} and optimizer state "
            f"{gib(layout.opt_state_bytes)} per chip. "
            + _changes(layout, "temporaries are mostly activations")
        ) from err


def abstract_model(config: TrainConfig) -> nnx.Module:
    """The run's language model as shapes, dtypes and logical axes: nothing allocated."""
    spec = base.model_spec(config, config.model, CausalLM.pads_rows)
    return build.abstract_network(lambda rngs: build.build_lm(spec, rngs))


def abstract_key(mesh: Mesh, impl: str) -> jax.ShapeDtypeStruct:
    """The step's dropout key of implementation `impl` (`base.run_dropout_impl`), replicated
    as training passes it."""
    key = jax.eval_shape(functools.partial(jax.random.key, impl=impl), 0)
    return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated(mesh))


def compile_step(step, *args, keep: Callable | None = None) -> CompiledStep:
    """`step` (a jitted function) lowered for `args` (shapes with shardings) and compiled;
    `keep(compiled)`, if given, is handed the executable."""
    started = time.perf_counter()
    if keep is None:
        compiled = step.lower(*args).compile()
    else:
        # The devices' platform from a leaf laid out on them (a leaf on the abstract mesh
        # names none).
        platform = next(device.platform for leaf in jax.tree.leaves(args)
                        for device in getattr(getattr(leaf, "sharding", None), "device_set", ()))
        compiled = executables.compile_to_keep(step, args, platform)
    seconds = time.perf_counter() - started
    if keep is not None:
        keep(compiled)
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, Sequence):  # one dict per program in some jax versions
        cost = cost[0] if cost else {}
    return CompiledStep(
        compile_s=seconds, argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes, alias_bytes=memory.alias_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes, code_bytes=memory.generated_code_size_in_bytes,
        flops=float(cost.get("flops", 0.0)), bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        collective_bytes=collectives.collective_bytes(compiled.as_text()),
    )


def per_device_bytes(tree) -> int:
    """Bytes one device holds of the abstract `tree`, by each leaf's sharding (the largest
    device's share; they are equal unless a dimension does not divide evenly)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(tree) if not _is_key(leaf))


def _is_key(leaf) -> bool:
    return jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _schedule_length(config: TrainConfig) -> int:
    """Steps the learning-rate schedule spans; without data the epoch's length is unknown, and
    the schedule's length does not change the compiled step."""
    return config.trainer.max_steps or max(10 * config.optimizer.warmup_steps, 1000)


def _hbm_bytes(configured_gib: float | None, device) -> float | None:
    if configured_gib is not None:
        return configured_gib * GIB
    try:  # an attached accelerator says what it holds; a CPU or a topology's chip does not
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 — compile-only devices raise
        return None
    return stats.get("bytes_limit")


def _hbm_source(configured_gib: float | None, hbm_bytes: float | None) -> str:
    """Where the plan's figure for a chip's memory comes from; "" when there is none."""
    if configured_gib is not None:
        return "hardware.hbm_gib_per_device"
    return "the chip's bytes_limit" if hbm_bytes is not None else ""


def _trained_params(state: TrainState, model: ModelConfig) -> int | None:
    """The parameters a model.lora run trains (its adapters); None: every one."""
    trainable = lora.trainable(model)
    if trainable is None:
        return None
    return sum(leaf.size for leaf in jax.tree.leaves(trained_part(state, trainable).params))


def _fsdp_state_bytes(mesh: Mesh, model, tx, trainable=None) -> int | None:
    """Per-chip parameter and optimizer bytes with every device on `fsdp` (the tensor and
    expert axes kept), computed from the shardings alone; None when that is the mesh already.
    `trainable`: what has optimizer state (model.lora: the adapters; None: every parameter)."""
    tensor, expert = mesh.shape[TENSOR_AXIS], mesh.shape[EXPERT_AXIS]
    context = mesh.shape.get(CONTEXT_AXIS, 1)
    if mesh.shape[FSDP_AXIS] * tensor * expert * context == mesh.size:
        return None
    fsdp_mesh = make_mesh(None, MeshConfig(data=1, fsdp=-1, tensor=tensor, expert=expert,
                                           context=context), list(mesh.devices.flat))
    return _state_bytes(fsdp_mesh, model, tx, trainable)


def _state_bytes(mesh: Mesh, model, tx, trainable=None) -> int:
    """Per-chip parameter and optimizer bytes of `model`'s train state laid out on `mesh`."""
    _, state = create_state(model, tx, mesh, trainable)
    return per_device_bytes(state.params) + per_device_bytes((state.step, state.opt_state))


def expert_axis_overrides(config: TrainConfig, num_devices: int
                          ) -> tuple[tuple[str, ...], MeshConfig | None]:
    """For a Mixture-of-Experts model whose experts could be split over more devices: the
    overrides that split them over the most (the largest expert axis dividing both the
    experts and the devices the tensor axis leaves), and the mesh they make; the rest of the
    mesh is kept where it still fits the devices, else the batch axes take what is left
    (`data`). ((), None) for a dense model or an expert axis already that large.

    It costs no quality: each chip keeps 1/expert of every sparse layer's experts and their
    optimizer state, and the tokens travel to them by all-to-all (communication time)."""
    experts = config.model.moe.num_experts
    if experts is None:
        return (), None
    mesh = config.hardware.mesh
    sizes = dict(zip(MESH_AXES, mesh_shape(mesh, num_devices)))
    room = num_devices // sizes[TENSOR_AXIS]
    largest = max(size for size in range(1, room + 1)
                  if room % size == 0 and experts % size == 0)
    if largest <= sizes[EXPERT_AXIS]:
        return (), None
    overrides = (f"hardware.mesh.expert={largest}",)
    wider = dataclasses.replace(mesh, expert=largest)
    try:
        mesh_shape(wider, num_devices)
    except FlaxlmError:  # the other axes were fixed sizes that no longer multiply out
        overrides += ("hardware.mesh.data=-1", "hardware.mesh.fsdp=1")
        wider = dataclasses.replace(wider, data=-1, fsdp=1)
    return overrides, wider


def context_axis_candidates(config: TrainConfig, num_devices: int, seq_len: int
                            ) -> list[tuple[str, ...]]:
    """For a run without a context axis: the overrides that split each row's positions over
    2, 4, 8, … devices (each size dividing the devices and the row's `seq_len`), smallest
    first. The devices come out of the data axis first, then fsdp (which holds the parameters
    and optimizer state: fewer fsdp devices, more of them per chip); the rows then split
    fewer ways, so the global batch is kept by micro-batches of one row per device
    (trainer.grad_accum_steps), the fewest activations. [] when the run has a context axis
    already.

    It costs no quality: each device keeps 1/context of every row's activations, and
    attention moves the keys and values between the devices (model.context_attention)."""
    sizes = dict(zip(MESH_AXES, mesh_shape(config.hardware.mesh, num_devices)))
    if sizes[CONTEXT_AXIS] != 1:
        return []
    rows = global_batch_size(config, num_devices)
    candidates, context = [], 2
    while context <= num_devices:
        left, split = context, dict(sizes)
        for axis in (DATA_AXIS, FSDP_AXIS):
            taken = math.gcd(split[axis], left)
            split[axis], left = split[axis] // taken, left // taken
        shards = math.prod(split[axis] for axis in BATCH_AXES)
        if left == 1 and seq_len % context == 0 and rows % shards == 0:
            split[CONTEXT_AXIS] = context
            batch = () if config.trainer.global_batch_size is not None else (
                "hardware.per_device_batch_size=1",)
            candidates.append((*(f"hardware.mesh.{axis}={split[axis]}" for axis in MESH_AXES),
                               *batch, f"trainer.grad_accum_steps={rows // shards}"))
        context *= 2
    return candidates


def rows_do_not_fit(run: AbstractRun, ladder: Sequence[RecipeStep],
                    temporaries: int | None) -> bool | None:
    """Whether the rows' temporaries (None: the compiler refused the step, which needed more
    than the chip) leave no room even beside the smallest state a memory recipe makes: then
    only splitting each row over devices (a context axis) can fit the step. None when the
    chip's memory is unknown or that smallest state alone exceeds it (nothing on the rows'
    side helps)."""
    hbm = hbm_bytes(run)
    smallest = min([per_device_bytes(run.state.params)
                    + per_device_bytes((run.state.step, run.state.opt_state))]
                   + [step.state_bytes for step in ladder])
    if hbm is None or smallest >= hbm:
        return None
    return temporaries is None or smallest + temporaries > hbm


# ------------------------------------------------------------------------ memory recipes


@dataclasses.dataclass(frozen=True)
class RecipeStep:
    """A rung of the ladder: every recipe so far added to the command's overrides."""

    overrides: tuple[str, ...]  # added to the command's, a later key replacing an earlier one
    added: tuple[str, ...]  # this rung's own recipe
    cost: str  # of this rung's recipe
    state_bytes: int  # per chip: parameters and optimizer state, from the abstract state


def recipe_ladder(config: TrainConfig, num_devices: int,
                  compose: Callable[[Sequence[str]], TrainConfig]) -> list[RecipeStep]:
    """The memory recipes not in effect in `config`, each added to those before it, cheapest
    in quality first, then the micro-batch halved (the global batch kept) down to one row per
    device; each rung with the per-chip state it leaves (its abstract state laid out: nothing
    compiled). `compose(extra)`: the run's config with the `extra` overrides."""
    recipes = [r for r in MEMORY_RECIPES if not r.in_effect(config)]
    # The expert axis first: it costs no quality, only the all-to-all's time.
    experts, _ = expert_axis_overrides(config, num_devices)
    if experts:
        recipes.insert(0, MemoryRecipe(experts, "the experts split over more chips, the "
                                       "tokens sent to them by all-to-all: the same loss",
                                       lambda c: False))
    rows = global_batch_size(config, num_devices) // row_shards(config.hardware.mesh,
                                                                num_devices)
    accum = config.trainer.grad_accum_steps
    while rows // accum > 1 and (rows // accum) % 2 == 0:
        accum *= 2
        batch = () if config.trainer.global_batch_size is not None else (
            f"hardware.per_device_batch_size={rows // accum}",)
        recipes.append(MemoryRecipe((*batch, f"trainer.grad_accum_steps={accum}"),
                                    "the same global batch in more, smaller micro-batches: "
                                    "slower", lambda c: False))
    ladder, added = [], ()
    for recipe in recipes:
        added = override(added, recipe.overrides)
        state = abstract_run(compose(added)).state
        ladder.append(RecipeStep(added, recipe.overrides, recipe.cost,
                                 per_device_bytes(state.params)
                                 + per_device_bytes((state.step, state.opt_state))))
    return ladder


def override(overrides: Sequence[str], extra: Sequence[str]) -> tuple[str, ...]:
    """`overrides` then `extra`, dropping an earlier override of a key that `extra` sets."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in extra}
    return (*(o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in keys), *extra)


def hbm_bytes(run: AbstractRun) -> float | None:
    """One chip's usable memory, as the plan of `run` measures against it; None: unknown."""
    return _hbm_bytes(run.config.hardware.hbm_gib_per_device, run.devices[0])


def ladder_advice(ladder: Sequence[RecipeStep], hbm_bytes: float | None,
                  temp_bytes: int | None) -> str:
    """The ladder as a sentence: each rung's overrides, its state per chip (exact) and, with
    today's compiled temporaries added (activations, gradients, scratch of the step that did
    not fit; the recipes keep them or shrink them), an estimate of its total."""
    if not ladder:
        return ""
    rungs = []
    for step in ladder:
        figure = f"state {gib(step.state_bytes)}"
        if hbm_bytes is not None and step.state_bytes > hbm_bytes:
            figure += ", more than the chip holds"
        elif temp_bytes is not None:
            figure += f", about {gib(step.state_bytes + temp_bytes)} with today's temporaries"
        rungs.append(f"{' '.join(step.added)} ({figure}; {step.cost})")
    return ("Memory recipes, cheapest in quality first, each added to those before it (per "
            "chip): " + "; + ".join(rungs) + ". flaxlm-plan --fit compiles them in this order "
            "and plans the first that fits.")


# ------------------------------------------------------------------------------ the report


def report(run: RunPlan) -> str:
    """The plan as lines a person reads: per chip, per step, the compile."""
    mesh = " ".join(f"{axis}={size}" for axis, size in run.mesh.items())
    where = f"topology {run.topology}" if run.topology else "the devices attached"
    lines = [
        f"flaxlm: plan of model={run.model} ({run.num_params / 1e6:,.1f}M params) on "
        f"hardware={run.hardware}: {run.num_devices} × {run.device_kind} ({where}), mesh "
        f"{mesh}, remat {run.remat}" + "".join(f", {part}" for part in (run.attention,
                                                                       run.dispatch) if part),
        f"  batch: {run.global_batch} rows × {run.seq_len} tokens = {run.tokens_per_step:,} "
        f"tokens per step ({run.per_device_batch} rows per device × {_row_shards(run)} "
        f"× {run.grad_accum_steps} micro-batch(es))",
        "  per chip:",
        f"    parameters            {gib(run.param_bytes)}",
        f"    optimizer state       {gib(run.opt_state_bytes)}",
        f"    batch                 {gib(run.batch_bytes)}",
        f"    compiler temporaries  {gib(run.train.temp_bytes)} (train step); "
        f"{gib(run.eval.temp_bytes)} (eval step)",
        f"    total                 {gib(run.train.total_bytes)} (train step); "
        f"{gib(run.eval_total_bytes)} (eval step, the train state kept)"
        + (f" of {gib(run.hbm_bytes)} HBM usable ({run.peak_bytes / run.hbm_bytes:.0%}"
           + (f"; {run.hbm_source}" if run.hbm_source else "") + ")"
           if run.hbm_bytes else " (the chip's memory is unknown: hardware.hbm_gib_per_device)"),
        "  per step, per chip:",
        f"    FLOPs (compiled)      {_si(run.step_flops, 'FLOP')}: XLA's cost analysis of "
        "the compiled train step (recomputation and optimizer included"
        + (f"; its micro-batch loop × {run.grad_accum_steps}" if run.grad_accum_steps > 1
           else "") + ")",
        f"    FLOPs (analytic)      {_si(run.model_flops, 'FLOP')}: "
        f"{_si(run.flops_per_token, 'FLOP')} per token (6 per weight that multiplies + attention's "
        "12·layers·width·length), the model FLOPs of MFU",
        f"    HBM traffic           {_si(run.step_bytes_accessed, 'B')} (cost analysis)",
        _collectives_line(run.train),
    ]
    lines += _roofline_lines(run)
    lines.append(f"  compile: train step {run.train.compile_s:.1f} s, eval step "
                 f"{run.eval.compile_s:.1f} s")
    return "\n".join(lines)


def _row_shards(run: RunPlan) -> str:
    """The devices that split the rows; those of a context or tensor axis share them."""
    shared = run.mesh.get(CONTEXT_AXIS, 1) * run.mesh.get(TENSOR_AXIS, 1)
    if shared == 1:
        return f"{run.num_devices} devices"
    return (f"{run.num_devices // shared} row shards ({run.num_devices} devices, {shared} to "
            "a row: context × tensor)")


def _collectives_line(step: CompiledStep) -> str:
    kinds = ", ".join(f"{kind} {_si(size, 'B')}" for kind, size in step.collective_bytes.items()
                      if size)
    return (f"    collectives           {_si(step.communication_bytes, 'B')}"
            + (f" ({kinds})" if kinds else "") + ": the results of the compiled train step's "
            "collectives, loops counted in full (between chips; not in the roofline)")


def _roofline_lines(run: RunPlan) -> list[str]:
    if run.scan_layers:
        return ["    roofline estimate     none: with model.scan_layers=true XLA's cost analysis "
                "counts the scanned block once, not once per layer, so the FLOPs and HBM "
                "traffic above are too low; plan with model.scan_layers=false for them"]
    if run.roofline_s is None:
        return ["    roofline estimate     none: the chip's peak FLOP/s is unknown (set "
                "hardware.peak_tflops_per_device)"]
    parts = [f"compute {_si(run.compute_s, 's')} at {_si(run.peak_flops, 'FLOP/s')}"]
    if run.memory_s is not None:
        parts.append(f"HBM {_si(run.memory_s, 's')} at {_si(run.hbm_bandwidth, 'B/s')}")
    return [
        f"    roofline estimate     {_si(run.roofline_s, 's')} per step ({'; '.join(parts)}; "
        "communication not counted)",
        f"    projected (estimate)  {run.tokens_per_s:,.0f} tokens/s, MFU {run.mfu:.1%} "
        "(estimates)",
    ]


def verdict(run: RunPlan) -> str | None:
    """None when the run fits (or the chip's memory is unknown); else one paragraph: what
    does not fit, and what to change."""
    if run.fits is not False:
        return None
    phase = "train" if run.train.total_bytes >= run.eval_total_bytes else "eval"
    need = run.train.total_bytes if phase == "train" else run.eval_total_bytes
    temps = run.train.temp_bytes if phase == "train" else run.eval.temp_bytes
    return (f"model={run.model} does not fit hardware={run.hardware}: the {phase} step needs "
            f"{gib(need)} per chip, more than the {gib(run.hbm_bytes)} of a "
            f"{run.device_kind} (parameters {gib(run.param_bytes)}, optimizer state "
            f"{gib(run.opt_state_bytes)}, temporaries {gib(temps)}). "
            + _changes(run, f"most of the {gib(temps)} of temporaries are activations"))


def _changes(run: RunPlan | _Layout, temporaries: str) -> str:
    """What to change so that the run needs less memory per chip, with the figure that can
    be had without compiling again."""
    advice = []
    if run.expert_state_bytes is not None:
        advice.append(
            f"{' '.join(run.expert_overrides)} (the experts and their optimizer state split "
            f"over more chips, the tokens sent to them: {gib(run.state_bytes)} → "
            f"{gib(run.expert_state_bytes)} per chip, the same loss)")
    if run.fsdp_state_bytes is not None:
        advice.append(
            f"hardware.mesh.data=1 hardware.mesh.fsdp=-1 (parameters and optimizer state "
            f"split over all {run.num_devices} chips: {gib(run.state_bytes)} → "
            f"{gib(run.fsdp_state_bytes)} per chip)")
    if run.remat not in (Remat.full.value, Remat.nothing_saveable.value):
        advice.append("model.remat=full (each block keeps only its input for the backward "
                      f"pass: {temporaries})")
    if run.per_device_batch > 1:
        half = run.per_device_batch // 2
        advice.append(
            f"hardware.per_device_batch_size={half} with trainer.grad_accum_steps="
            f"{run.grad_accum_steps * run.per_device_batch // half} (the same global batch; "
            "activations shrink with the micro-batch)")
    if not advice:
        advice.append("a slice with more chips (hardware=...), or a smaller model or sequence "
                      "(task.max_seq_length)")
    return "Try " + "; or ".join(advice) + "; then plan again."


def _si(value: float, unit: str) -> str:
    """`value` with the SI prefix that leaves 1 to 999 of it: 2.47e8 FLOP → 247 MFLOP."""
    prefixes = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""),
                (1e-3, "m"), (1e-6, "µ")]
    scale, prefix = next(((s, p) for s, p in prefixes if abs(value) >= s), prefixes[-1])
    return f"{value / scale:.3g} {prefix}{unit}"


def gib(num_bytes: float) -> str:
    """`num_bytes` as KiB, MiB or GiB, whichever reads best."""
    if num_bytes < 2**20:
        return f"{num_bytes / 2**10:,.1f} KiB"
    if num_bytes < GIB:
        return f"{num_bytes / 2**20:,.1f} MiB"
    return f"{num_bytes / GIB:,.2f} GiB"
