"""Devices, the data mesh and shardings.

Data parallelism (each device gets `per_device_batch_size` examples, gradients averaged over
all devices), written with `jax.jit` over a mesh rather than `pmap`: the batch is
one global `jax.Array` sharded on the mesh's `data` axis, the parameters are replicated, and
`jax.jit` inserts the cross-device mean of the gradients. Multi-host: every process loads only
its own rows and `jax.make_array_from_process_local_data` stitches them into the global batch.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax._src import xla_bridge
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxlm.config import HardwareConfig
from flaxlm.errors import FlaxlmError

DATA_AXIS = "data"
_JAX_PLATFORM_NAMES = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


def configure_platform(hardware: HardwareConfig) -> None:
    """Point JAX at the hardware group's platform (and, on CPU, its device count).

    Must run before JAX starts its backend; once it has (an earlier run in this process, or a
    test's conftest), the settings are fixed and only checked.
    """
    if hardware.platform not in _JAX_PLATFORM_NAMES:
        raise FlaxlmError(
            f"hardware.platform={hardware.platform!r} is not one of "
            f"{sorted(_JAX_PLATFORM_NAMES)}; fix it in conf/hardware/{hardware.name}.yaml."
        )
    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", _JAX_PLATFORM_NAMES[hardware.platform])
        if hardware.platform == "cpu":
            count = hardware.cpu_devices or os.cpu_count() or 1
            flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
            flags.append(f"--xla_force_host_platform_device_count={count}")
            os.environ["XLA_FLAGS"] = " ".join(flags)
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
    wanted = "gpu" if hardware.platform == "gpu" else hardware.platform
    if backend != wanted:
        raise FlaxlmError(
            f"hardware={hardware.name} asks for platform {hardware.platform!r}, but JAX in this "
            f"process already runs on {backend!r} (it is fixed by the first run of a process). "
            "Run the job in a fresh process, or choose a hardware group for this machine."
        )


def make_mesh(num_devices: int | None) -> Mesh:
    """A 1-D mesh over the first `num_devices` devices (all when None), axis `data`."""
    devices = jax.devices()
    if num_devices is not None:
        if not 1 <= num_devices <= len(devices):
            raise FlaxlmError(
                f"hardware.num_devices={num_devices}, but JAX sees {len(devices)} device(s): "
                f"{devices}. Set hardware.num_devices between 1 and {len(devices)}, or null "
                "for all of them."
            )
        if jax.process_count() > 1 and num_devices != len(devices):
            raise FlaxlmError(
                "hardware.num_devices must be null (all devices) when training on several hosts."
            )
        devices = devices[:num_devices]
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over the `data` axis, the rest whole."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def process_rows(global_rows: int, mesh: Mesh) -> tuple[int, int]:
    """(first, count) of the global batch rows this process feeds, for a batch of `global_rows`.

    Rows are split evenly over the devices in mesh order, so a process owns the contiguous rows
    of its own devices.
    """
    devices = list(mesh.devices.flat)
    rows_per_device = global_rows // len(devices)
    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    return mine[0] * rows_per_device, len(mine) * rows_per_device


def global_batch(local_rows: np.ndarray, mesh: Mesh) -> jax.Array:
    """This process's rows as its part of one global array sharded on `data`."""
    return jax.make_array_from_process_local_data(batch_sharded(mesh), local_rows)
