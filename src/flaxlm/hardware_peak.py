"""The peak FLOP/s that MFU divides by: the configured figure, or the device's known peak.

The table holds the dense bfloat16 peak of one JAX device, as vendors publish it. A TPU v2 or
v3 chip shows JAX two devices (one per core), so its figure is half the chip's; later TPUs
show one device per chip. A CPU has no entry: its peak depends on the model, the clock and the
cores the process may use, and a guessed figure would make MFU a made-up number, so a run on
an unknown device logs no MFU at all.
"""

from __future__ import annotations

from collections.abc import Sequence

# TPUs: JAX's device_kind, matched whole (case aside). "lite" is the efficiency line (v5e, v6e).
_TPU_TFLOPS = {
    "tpu v2": 22.5,
    "tpu v3": 61.5,
    "tpu v4": 275.0,
    "tpu v5 lite": 197.0,
    "tpu v5e": 197.0,
    "tpu v5": 459.0,
    "tpu v5p": 459.0,
    "tpu v6 lite": 918.0,
    "tpu v6e": 918.0,
}

# NVIDIA GPUs: a part of the device_kind (e.g. "NVIDIA H100 80GB HBM3"), the first that matches.
_GPU_TFLOPS = (
    ("h100 pcie", 756.0),
    ("h100 nvl", 835.0),
    ("h100", 989.0),
    ("h200", 989.0),
    ("a100", 312.0),
)


def known_peak_tflops(device_kind: str) -> float | None:
    """The dense bfloat16 TFLOP/s of one device of this JAX `device_kind`; None if unknown."""
    kind = " ".join(device_kind.lower().split())
    if kind in _TPU_TFLOPS:
        return _TPU_TFLOPS[kind]
    return next((tflops for part, tflops in _GPU_TFLOPS if part in kind), None)


def peak_flops(configured_tflops: float | None, device_kinds: Sequence[str]) -> float | None:
    """The peak FLOP/s of all these devices together: `configured_tflops` per device when set,
    else each device's known peak; None when any device's peak is unknown."""
    if configured_tflops is not None:
        return configured_tflops * 1e12 * len(device_kinds)
    per_device = [known_peak_tflops(kind) for kind in device_kinds]
    if not per_device or None in per_device:
        return None
    return sum(per_device) * 1e12
