"""Devices, the device mesh and shardings.

The mesh has five named axes: `data` (the batch only), `fsdp` (the batch, and parameters plus
optimizer state split ZeRO-3 style: each device keeps 1/n and the step gathers them as it needs
them), `expert` (the batch, and a Mixture-of-Experts layer's experts: each device holds
E/expert of them, and the tokens travel to their experts' devices and back by all-to-all,
`flaxlm.models.moe`; for every other parameter it is data parallelism), `context` (each row's
positions: every device of the axis holds a slice of each row's activations, contiguous or
in the balanced order of `flaxlm.models.context_parallel`, and attention gathers the keys and
values of the whole row, `flaxlm.models.attention`) and
`tensor` (attention heads and MLP width split Megatron style; the batch is replicated along
it and along `context`). Everything is written with `jax.jit` over the mesh: the batch is one
global `jax.Array` sharded on `data` × `fsdp` × `expert` (`BATCH_AXES`), and each parameter's
layout follows from the logical axis names it carries (`logical_axes` metadata, e.g.
("embed", "mlp")) through one table of rules, `LOGICAL_AXIS_RULES`, so a new model family or
mesh shape needs no per-parameter code.
With the default mesh (all devices on `data`) every parameter is replicated: plain data
parallelism, `jax.jit` inserting the cross-device mean of the gradients. Multi-host: every
process loads only its own rows and `jax.make_array_from_process_local_data` stitches them into
the global batch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax._src import xla_bridge
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxlm import distributed
from flaxlm.config import HardwareConfig, MeshConfig, ModelConfig, Remat
from flaxlm.errors import FlaxlmError

# In this order the devices are laid out: the innermost axes get the nearest devices, for the
# collectives of every layer (tensor's) and of every sparse layer (expert's all-to-all).
DATA_AXIS, FSDP_AXIS, EXPERT_AXIS, CONTEXT_AXIS, TENSOR_AXIS = MESH_AXES = (
    "data", "fsdp", "expert", "context", "tensor")
# The batch's rows are split over all three (expert parallelism borrows the data dimension, as
# in MaxText and torchtitan: the expert axis's devices hold different experts and different
# tokens); in mesh order, so that a host's devices hold a contiguous run of rows.
BATCH_AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS)

# Logical axis name (what a parameter dimension means) → the mesh axes that may split it, in
# order of preference; () never. A dimension takes the first of them that has more than one
# device, divides it evenly and splits no earlier dimension of the same array; else it stays
# whole. So a matrix is split over fsdp on its model width and over tensor on its heads or MLP
# width, and a bias of heads or MLP width falls back to fsdp when there is no tensor axis.
LOGICAL_AXIS_RULES: dict[str, tuple[str, ...]] = {
    "embed": (FSDP_AXIS,),  # the model width: ZeRO-3 keeps 1/fsdp of every matrix per device
    "vocab": (TENSOR_AXIS,),  # token embeddings (and the tied LM head) by vocabulary rows
    "heads": (TENSOR_AXIS, FSDP_AXIS),  # attention projections' per-head columns / rows
    "kv_heads": (TENSOR_AXIS, FSDP_AXIS),  # grouped-query attention's key/value projections
    "mlp": (TENSOR_AXIS, FSDP_AXIS),  # the MLP's hidden width
    "experts": (EXPERT_AXIS,),  # an MoE layer's experts: E/expert per device
    "positions": (),  # position and segment tables: small, looked up by every row
    "classes": (),  # a classifier's outputs: a handful
    "layers": (),  # a scanned model's stacked blocks: each step of the scan reads one whole
}
_JAX_PLATFORM_NAMES = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


# XLA's CPU scheduler orders a step for concurrency and runs rematerialised activations as
# early as it can, so `model.remat` would recompute them and keep them alive all the same; the
# memory-minded scheduler makes remat save memory, at some speed, so it is chosen only then.
_CPU_REMAT_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def configure_platform(hardware: HardwareConfig, remat: Remat = Remat.none,
                       compile_only: bool = False) -> None:
    """Point JAX at the hardware group's platform (and, on CPU, its device count, and the
    scheduler that lets `remat` save memory when the model rematerialises).

    `compile_only` (flaxlm-plan): no other hosts are joined, and a TPU group with a
    `hardware.topology` runs JAX on the CPU, compiling for the slice's chips
    (`target_devices`), so that no TPU need be attached.

    Must run before JAX starts its backend; once it has (an earlier run in this process, or a
    test's conftest), the settings are fixed and only checked.
    """
    if hardware.platform not in _JAX_PLATFORM_NAMES:
        raise FlaxlmError(
            f"hardware.platform={hardware.platform!r} is not one of "
            f"{sorted(_JAX_PLATFORM_NAMES)}; fix it in conf/hardware/{hardware.name}.yaml."
        )
    platform = "cpu" if compile_only and compiles_for_topology(hardware) else hardware.platform
    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", _JAX_PLATFORM_NAMES[platform])
        if hardware.platform == "cpu":  # not a TPU group planned from the CPU: one device does
            count = hardware.cpu_devices or os.cpu_count() or 1
            flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
            flags.append(f"--xla_force_host_platform_device_count={count}")
            if Remat(remat) is not Remat.none and not any(
                    f.startswith(_CPU_REMAT_SCHEDULER.split("=")[0]) for f in flags):
                flags.append(_CPU_REMAT_SCHEDULER)
            os.environ["XLA_FLAGS"] = " ".join(flags)
    # Joining the other hosts reads XLA_FLAGS, and must come before the backend starts.
    if not compile_only:
        distributed.initialize(hardware)
    try:
        backend = jax.default_backend()
    except Exception as err:  # noqa: BLE001 — JAX raises AssertionError when it finds no GPU
        reason = str(err).strip() or f"no {hardware.platform} device found"
        raise FlaxlmError(
            f"JAX could not start on hardware.platform={hardware.platform!r} "
            f"(hardware={hardware.name}): {reason}. Pick the hardware group that matches this "
            "machine (cpu, cpu-8, gpu, tpu) or install the matching jax extra, e.g. "
            "`pip install -U 'jax[cuda12]'`."
        ) from err
    wanted = "gpu" if platform == "gpu" else platform
    if backend != wanted:
        raise FlaxlmError(
            f"hardware={hardware.name} asks for platform {hardware.platform!r}, but JAX in this "
            f"process already runs on {backend!r} (it is fixed by the first run of a process). "
            "Run the job in a fresh process, or choose a hardware group for this machine."
        )


def compiles_for_topology(hardware: HardwareConfig) -> bool:
    """Whether a plan of this hardware compiles for `hardware.topology`'s TPU slice rather
    than for the devices attached."""
    return hardware.platform == "tpu" and hardware.topology.name is not None


def target_devices(hardware: HardwareConfig) -> list:
    """The devices a plan compiles for: the chips of `hardware.topology`'s slice (XLA's TPU
    compiler, from libtpu, need not see them), else the devices JAX runs on."""
    if not compiles_for_topology(hardware):
        return jax.devices()
    topology = hardware.topology
    try:
        import libtpu  # noqa: F401 — the TPU compiler comes with it
    except ImportError as err:
        raise FlaxlmError(
            f"Planning hardware={hardware.name} compiles for a TPU slice "
            f"(hardware.topology.name={topology.name}) with XLA's TPU compiler, which comes "
            "with libtpu: `pip install 'flaxlm[tpu]'` (or 'jax[tpu]' of the installed jax's "
            "version)."
        ) from err
    from jax.experimental import topologies

    # libtpu reads these at start-up; without them it looks for a TPU's metadata and warns.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", hardware.name.removeprefix("tpu-"))
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # Only compiling, it opens no chip: other processes (plans, tests) may load libtpu too,
    # which its lock file (/tmp/libtpu_lockfile) otherwise refuses.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    extra = {"chips_per_host_bounds": tuple(topology.chips_per_host)} if topology.chips_per_host \
        else {}
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=topology.name,
                                            chip_config_name=topology.chip_config,
                                            **extra).devices
    except Exception as err:  # noqa: BLE001 — libtpu raises XlaRuntimeError / ValueError
        raise FlaxlmError(
            f"libtpu does not accept hardware.topology (name={topology.name}, chip_config="
            f"{topology.chip_config}, chips_per_host={topology.chips_per_host}) of "
            f"hardware={hardware.name}: {str(err).strip().splitlines()[0]}. Use a topology "
            "such as v4:2x2x1 (chip_config megacore) or v5e:2x4 (default)."
        ) from err


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """The devices a run computes on, as far as choosing kernels for them goes: the platform
    and, where known, which generation of chip it is."""

    platform: str  # "cpu", "gpu", "tpu"
    kind: str = ""  # JAX's device_kind: "TPU v3", "TPU v5 lite", "Tesla T4"; "": unknown
    compute_capability: str = ""  # an NVIDIA GPU's, as CUDA writes it ("7.5"); "": unknown

    @property
    def name(self) -> str:
        return self.kind or self.platform

    @property
    def tpu_generation(self) -> int | None:
        """A TPU's generation, the number in its kind ("TPU v5 lite": 5, "TPU7x": 7); None:
        not a TPU, or a kind that does not say."""
        found = re.search(r"TPU\s*v?(\d+)", self.kind, re.IGNORECASE)
        return int(found.group(1)) if self.platform == "tpu" and found else None

    @property
    def cuda_capability(self) -> tuple[int, int] | None:
        """A GPU's compute capability as (major, minor); None: not known."""
        found = re.fullmatch(r"(\d+)\.(\d+)", self.compute_capability.strip())
        return (int(found.group(1)), int(found.group(2))) if found else None


def accelerator_of(device) -> Accelerator:
    """What a JAX device (attached, a TPU slice's compile-only chip, or a traced mesh's
    abstract device) says of itself; only CUDA devices have a compute capability."""
    return Accelerator(device.platform, device.device_kind,
                       str(getattr(device, "compute_capability", "") or ""))


def run_accelerator(hardware: HardwareConfig) -> Accelerator:
    """The devices a run on `hardware` computes on: those JAX runs on when they are of the
    hardware's platform (training; a plan for the devices attached); a plan compiled on this
    CPU for a TPU slice: the chips `hardware.topology` names ("v3:2x2": TPU v3s, the kind of
    chip libtpu compiles for); else (JAX not started, or on another platform) only the
    platform."""
    if xla_bridge.backends_are_initialized() and jax.default_backend() == hardware.platform:
        return accelerator_of(jax.devices()[0])
    if compiles_for_topology(hardware):
        return Accelerator("tpu", f"TPU {hardware.topology.name.split(':')[0]}")
    return Accelerator(hardware.platform)


def make_mesh(num_devices: int | None, mesh: MeshConfig | None = None,
              devices: Sequence | None = None) -> Mesh:
    """The (data, fsdp, expert, tensor) mesh over the first `num_devices` of `devices` (default: the
    devices JAX runs on; all when `num_devices` is None), with `mesh`'s axis sizes (default:
    every device on `data`)."""
    devices = list(jax.devices() if devices is None else devices)
    if num_devices is not None:
        if not 1 <= num_devices <= len(devices):
            raise FlaxlmError(
                f"hardware.num_devices={num_devices}, but there are {len(devices)} device(s): "
                f"{devices}. Set hardware.num_devices between 1 and {len(devices)}, or null "
                "for all of them."
            )
        if _process_count(devices) > 1 and num_devices != len(devices):
            raise FlaxlmError(
                "hardware.num_devices must be null (all devices) when training on several hosts."
            )
        devices = devices[:num_devices]
    # No mesh settings (tests, benchmarks): plain data parallelism over every device.
    shape = mesh_shape(mesh or MeshConfig(data=-1, fsdp=1, tensor=1, expert=1, context=1),
                       len(devices))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def _process_count(devices: Sequence) -> int:
    return len({device.process_index for device in devices})


def mesh_shape(mesh: MeshConfig, num_devices: int) -> tuple[int, ...]:
    """hardware.mesh's (data, fsdp, expert, context, tensor) sizes for `num_devices` devices;
    one -1 takes the devices the other axes leave."""
    sizes = {axis: getattr(mesh, axis) for axis in MESH_AXES}
    settings = ", ".join(f"hardware.mesh.{axis}={size}" for axis, size in sizes.items())
    wildcards = [axis for axis, size in sizes.items() if size == -1]
    fixed = math.prod(size for size in sizes.values() if size != -1)
    valid = len(wildcards) <= 1 and all(size >= 1 or size == -1 for size in sizes.values())
    if valid and wildcards and num_devices % fixed == 0:
        sizes[wildcards[0]] = num_devices // fixed
    if not valid or math.prod(sizes.values()) != num_devices:
        raise FlaxlmError(
            f"{settings} does not fit {num_devices} device(s): the axis sizes must be positive "
            f"and multiply to the device count, with at most one -1 (the devices the others "
            f"leave). For {num_devices} devices, e.g. hardware.mesh.data=-1 "
            f"hardware.mesh.fsdp={num_devices} hardware.mesh.expert=1 hardware.mesh.context=1 "
            "hardware.mesh.tensor=1 (all of them on fsdp); or change hardware.num_devices."
        )
    return tuple(sizes[axis] for axis in MESH_AXES)


def row_shards(mesh: MeshConfig, num_devices: int) -> int:
    """How many ways the batch's rows are split: the data, fsdp and expert axes' product, the
    devices / (context × tensor). The devices of a context or tensor axis hold the same rows
    (each its slice of their positions, or of the model's width)."""
    sizes = dict(zip(MESH_AXES, mesh_shape(mesh, num_devices)))
    return math.prod(sizes[axis] for axis in BATCH_AXES)


def context_size(hardware: HardwareConfig, num_devices: int | None = None) -> int:
    """hardware.mesh.context resolved: -1 is the devices the other axes leave of
    `num_devices` (default: the devices the run computes on, `target_devices`)."""
    context = hardware.mesh.context
    if context != -1:
        return context
    if num_devices is None:
        num_devices = hardware.num_devices or len(target_devices(hardware))
    return dict(zip(MESH_AXES, mesh_shape(hardware.mesh, num_devices)))[CONTEXT_AXIS]


def check_context_axis(mesh: MeshConfig, num_devices: int, seq_len: int | None,
                       pads_rows: bool) -> None:
    """A `context` axis splits each row's positions into equal slices (in the balanced order,
    `hardware.mesh.balance_context`, two chunks a device), so it must divide the row's length;
    and it serves causal language models, whose attention masks nothing but the causal order
    and documents (an encoder's or classifier's padding masks do not travel with the
    slices)."""
    context = dict(zip(MESH_AXES, mesh_shape(mesh, num_devices)))[CONTEXT_AXIS]
    if context == 1:
        return
    if pads_rows:
        raise FlaxlmError(
            f"hardware.mesh.context={context} splits each row's positions over {context} "
            "devices, for causal language models (task=clm, sft, dpo); this task's model "
            "masks padding, which the slices do not carry. Set hardware.mesh.context=1.")
    # The balanced order cuts each row into 2C chunks (flaxlm.models.context_parallel).
    pieces = 2 * context if mesh.balance_context else context
    if seq_len is not None and seq_len % pieces:
        fitting = [size for size in range(1, context) if seq_len % (pieces // context * size) == 0
                   and num_devices % size == 0]
        cut = (f"into {pieces} equal chunks (the balanced order: two per device, "
               "hardware.mesh.balance_context=true)" if pieces != context
               else "into equal slices")
        raise FlaxlmError(
            f"hardware.mesh.context={context} does not divide the rows' {seq_len} positions "
            f"{cut}. Set task.max_seq_length to a multiple of {pieces} (e.g. "
            f"{-(-seq_len // pieces) * pieces}), or hardware.mesh.context to a number of "
            f"devices that divides it and the {num_devices} device(s), e.g. "
            f"hardware.mesh.context={max(fitting)}.")


def check_expert_axis(model: ModelConfig, mesh: MeshConfig, num_devices: int) -> None:
    """A Mixture-of-Experts model's experts must split evenly over `hardware.mesh.expert`:
    each device of the axis holds the same number of them. (A dense model takes any expert
    axis: it splits the batch, as `data` does.)"""
    experts = model.moe.num_experts
    expert = dict(zip(MESH_AXES, mesh_shape(mesh, num_devices)))[EXPERT_AXIS]
    if experts is None or experts % expert == 0:
        return
    fitting = [size for size in range(1, expert) if experts % size == 0 and expert % size == 0]
    raise FlaxlmError(
        f"model.moe.num_experts={experts} does not divide by hardware.mesh.expert={expert}: "
        f"expert parallelism gives each of the expert axis's {expert} devices the same number "
        f"of experts. Set hardware.mesh.expert to a divisor of {experts} that divides the "
        f"{num_devices} device(s), e.g. hardware.mesh.expert={max(fitting)} with "
        "hardware.mesh.data=-1 taking the devices it leaves, or model.moe.num_experts to a "
        f"multiple of {expert}."
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over `data` × `fsdp` × `expert` (replicated over `tensor`),
    the rest whole."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def logical_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """The mesh layout of an array whose dimensions mean `names` (LOGICAL_AXIS_RULES)."""
    if len(names) != len(shape):  # e.g. Adafactor's factored moments: smaller than the param
        return PartitionSpec()
    spec, used = [], set()
    for name, size in zip(names, shape):
        if name is not None and name not in LOGICAL_AXIS_RULES:
            raise FlaxlmError(
                f"logical axis {name!r} has no sharding rule; the rules name "
                f"{sorted(LOGICAL_AXIS_RULES)} (flaxlm.parallel.LOGICAL_AXIS_RULES)."
            )
        candidates = LOGICAL_AXIS_RULES[name] if name is not None else ()
        axis = next((axis for axis in candidates if axis not in used
                     and mesh.shape[axis] > 1 and size % mesh.shape[axis] == 0), None)
        spec.append(axis)
        if axis is not None:
            used.add(axis)
    while spec and spec[-1] is None:  # P() and P(None, None) are one layout but not equal
        spec.pop()
    return PartitionSpec(*spec)


def state_shardings(tree, mesh: Mesh):
    """`tree` (parameters, optimizer state, gradients, a whole train state) with each array
    replaced by its sharding: an `nnx.Variable` by its `logical_axes`, anything else
    replicated. Works on abstract arrays too (inside `jax.jit`, or from `jax.eval_shape`)."""

    def sharding_of(leaf):
        if isinstance(leaf, nnx.Variable):
            names = leaf.get_metadata().get("logical_axes", ())
            return leaf.replace(NamedSharding(mesh, logical_spec(names, leaf.shape, mesh)))
        return replicated(mesh)

    return jax.tree.map(sharding_of, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def place_state(tree, mesh: Mesh):
    """`tree` laid out on `mesh` by its logical axes (see `state_shardings`). An abstract tree
    (`jax.ShapeDtypeStruct` leaves, as `nnx.eval_shape` and `jax.eval_shape` make) gets the
    same layout as its leaves' `sharding`: what a plan compiles the steps for."""
    shardings = state_shardings(tree, mesh)
    if is_abstract(tree):
        return jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                        sharding=sharding), tree, shardings)
    return jax.device_put(tree, shardings)


def initializer(build: Callable[[], nnx.Module], mesh: Mesh
                ) -> tuple[nnx.GraphDef, jax.stages.Wrapped]:
    """The graph of the module `build()` makes, and a jitted function of no arguments that
    returns its state already laid out on `mesh` by its logical axes (`state_shardings`).

    The shapes come from `nnx.eval_shape` (nothing is allocated); the jitted init computes each
    device's part of every variable where it lives, so no device and no host ever holds a
    whole parameter that the layout splits. The values are those of `build()` run eagerly, bit
    for bit: JAX's threefry draws the same bits whatever the layout (`jax_threefry_partitionable`,
    on by default), and XLA's algebraic simplifier, which would fold an initializer's scale into
    the normal draw's own constant and round one ulp differently from the eager ops, is off
    for this program (it runs once)."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(build))
    shardings = state_shardings(abstract_state, mesh)

    def init_model():  # the program's name in JAX's compile log
        return nnx.split(build())[1]

    return graphdef, jax.jit(init_model, out_shardings=shardings,
                             compiler_options={"xla_disable_hlo_passes": "algsimp"})


def init_on_mesh(build: Callable[[], nnx.Module], mesh: Mesh) -> nnx.Module:
    """The module `build()` makes, its variables created sharded on `mesh` (`initializer`)."""
    graphdef, init = initializer(build, mesh)
    return nnx.merge(graphdef, init())


def host_copy(array, dtype=None) -> np.ndarray:
    """`array` (a `jax.Array`, possibly sharded, or anything numpy reads) on the host, as
    `dtype`. JAX keeps the host value of an array it has converted with that array, so
    converting a model's parameters would leave the whole model on the host: the value is
    gathered from a fresh copy instead, dropped with it."""
    if isinstance(array, jax.Array):
        array = jax.device_put(array, array.sharding, may_alias=False)
    return np.asarray(array, dtype=dtype)


def is_abstract(tree) -> bool:
    """Whether `tree` holds shapes only (ShapeDtypeStruct leaves), no arrays."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)


def traced_on(mesh: Mesh, fn, name: str | None = None):
    """`fn`, which `jax.jit` traces with `mesh` as the mesh in context: what lets the models'
    `constrain_batch` lay activations out on it without being given the mesh. `name`: the
    program's, as JAX's compile log and profiles show it (else `on_mesh`)."""

    def on_mesh(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    if name:
        on_mesh.__name__ = on_mesh.__qualname__ = name
    return on_mesh


def constrain_batch(x_BxE: jax.Array, *, last_over_tensor: bool = False) -> jax.Array:
    """Inside a step traced on a mesh (`traced_on`): `x_BxE`'s leading (batch) axis split over
    `BATCH_AXES` as the batch is, the rest whole (or, with `last_over_tensor`, the last axis
    split over `tensor`: an MLP's hidden units under tensor parallelism); outside one, `x_BxE`
    unchanged.

    Without it the compiler may lay activations out as the weights that make them are laid
    out: with parameters split over `fsdp` on the model width, it then gathers the whole
    global batch's activations onto every device, and a device's temporaries grow with the
    number of devices instead of shrinking (fsdp is data parallelism for the activations)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(axis not in mesh.axis_names for axis in BATCH_AXES):
        return x_BxE
    # A (B, L, ...) activation's positions over `context` (`sequence_axis`).
    positions = [sequence_axis(x_BxE.shape[1])] if x_BxE.ndim >= 3 else []
    middle = [None] * (x_BxE.ndim - 1 - len(positions) - 1)
    if last_over_tensor and TENSOR_AXIS in mesh.axis_names:
        spec = PartitionSpec(BATCH_AXES, *positions, *middle, TENSOR_AXIS)
    else:
        spec = PartitionSpec(BATCH_AXES, *positions)
    return jax.lax.with_sharding_constraint(x_BxE, spec)


def sequence_axis(length: int) -> str | None:
    """Inside a step traced on a mesh: `context` where the mesh splits rows' positions over it
    (more than one device) and it divides `length` evenly, else None (generation's one new
    token a step, and everything on a mesh without it, keeps its positions whole)."""
    mesh = jax.sharding.get_abstract_mesh()
    size = 1 if mesh.empty else dict(mesh.shape).get(CONTEXT_AXIS, 1)
    return CONTEXT_AXIS if size > 1 and length % size == 0 else None


def constrain_state(tree, mesh: Mesh):
    """Inside `jax.jit`: keep `tree` laid out by its logical axes."""
    return jax.lax.with_sharding_constraint(tree, state_shardings(tree, mesh))


def process_rows(global_rows: int, mesh: Mesh) -> tuple[int, int]:
    """(first, count) of the global batch rows this process feeds, for a batch of `global_rows`.

    Rows are split evenly over the `data` × `fsdp` × `expert` positions in mesh order (each
    part held by every `tensor` device of its position), so a process owns the contiguous rows
    of its own devices' parts.
    """
    parts = batch_sharded(mesh).addressable_devices_indices_map((global_rows,)).values()
    starts = sorted({part[0].indices(global_rows)[0] for part in parts})
    stops = sorted({part[0].indices(global_rows)[1] for part in parts})
    if any(stop != start for stop, start in zip(stops, starts[1:])):
        raise FlaxlmError(
            f"This process's devices hold rows {list(zip(starts, stops))} of the batch, which "
            "are not contiguous; the mesh must give each host a contiguous run of the data, "
            "fsdp and expert axes (hardware.mesh)."
        )
    return starts[0], stops[-1] - starts[0]


def batch_spec(shape: Sequence[int], dtype, mesh: Mesh) -> jax.ShapeDtypeStruct:
    """The shape, dtype and layout of a global batch (rows split over `BATCH_AXES`), as
    `global_batch` makes one: what a plan compiles the steps for, with no data."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=batch_sharded(mesh))


def global_batch(local_rows: np.ndarray, mesh: Mesh) -> jax.Array:
    """This process's rows as its part of one global array sharded on `BATCH_AXES`."""
    return jax.make_array_from_process_local_data(batch_sharded(mesh), local_rows)
