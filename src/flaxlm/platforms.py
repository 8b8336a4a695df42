"""Which JAX platform a tool runs on when no hardware group says (flaxlm-generate, -export,
-eval: the devices attached to this machine). flaxlm-train and flaxlm-plan pin theirs from the
hardware group (`flaxlm.parallel.configure_platform`).

JAX left to itself tries every platform it knows, the TPU among them whenever libtpu is
installed (the `tpu` extra, which `make test` installs), and on a machine without a TPU libtpu
then prints its probe on stderr ("Failed to find host bounds for accelerator type", "unexpected
worker hostname", "=== Source Location Trace: ===") before JAX falls back to the next platform.
So where no TPU is attached and the user has not chosen, JAX is given the platforms it would
try, less the TPU: the same choice (a GPU where there is one, else the CPU), without the probe.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable

import jax
from jax._src import xla_bridge

# Device files libtpu opens: /dev/accel* (TPU v2 to v4), VFIO groups (v5e and later).
_TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")


def skip_absent_tpu() -> str | None:
    """Before JAX's backends start: pin `jax_platforms` to the platforms JAX would try, less
    the TPU, where no TPU is attached and the user has not chosen (JAX_PLATFORMS, or
    `jax_platforms` set in this process). Returns what it pinned; None where JAX chooses as
    ever (the user chose, a TPU is or may be attached, or the backends have started)."""
    if xla_bridge.backends_are_initialized():
        return None
    pinned = platforms_to_pin(jax.config.jax_platforms, tpu_attached, non_tpu_platforms)
    if pinned is not None:
        jax.config.update("jax_platforms", pinned)
    return pinned


def platforms_to_pin(chosen: str | None, tpu_attached: Callable[[], bool],
                     non_tpu_platforms: Callable[[], list[str] | None]) -> str | None:
    """The `jax_platforms` value that skips the TPU on a machine without one, or None to leave
    JAX's choice alone: the user's choice (`chosen`) is kept, a TPU that is or may be attached
    is used, and platforms that cannot be listed are not guessed."""
    if chosen or tpu_attached():
        return None
    platforms = non_tpu_platforms()
    return ",".join(platforms) if platforms else None


def tpu_attached() -> bool:
    """Whether a TPU is, or may be, attached to this machine, told without starting libtpu: a
    Google TPU among the PCI devices (JAX's own test, by which it decides whether to set libtpu
    up), a device file libtpu opens, or JAX_FORCE_TPU_INIT (JAX's way to insist). True where
    it cannot tell."""
    if "JAX_FORCE_TPU_INIT" in os.environ or any(glob.glob(p) for p in _TPU_DEVICE_FILES):
        return True
    try:
        from jax._src import hardware_utils

        chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
        return chips > 0
    except Exception:  # noqa: BLE001 — a JAX without this helper: let JAX look for a TPU
        return True


def non_tpu_platforms() -> list[str] | None:
    """The platforms JAX would try on its own (its built-in backends and the PJRT plugins
    installed, e.g. cuda), in its order of preference, less the TPU; None where JAX's registry
    of them cannot be read. A platform JAX skips (cuda with no NVIDIA device) is skipped alike,
    and one that fails fails alike: only the TPU's attempt is left out."""
    try:
        xla_bridge._discover_and_register_pjrt_plugins()  # as starting the backends does first
        factories = xla_bridge._backend_factories
        names = [name for name in factories if name != "tpu"]
        # Highest priority first, as JAX prefers them; the sort keeps ties in JAX's order.
        return sorted(names, key=lambda name: -factories[name].priority)
    except Exception:  # noqa: BLE001 — a JAX whose registry changed: JAX chooses
        return None
