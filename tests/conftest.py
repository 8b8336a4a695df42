"""Shared test set-up: 8 simulated CPU devices, and caches that never touch the user's."""

import os

# Before JAX starts: every multi-device path runs on 8 simulated CPU devices, like the seed's
# 8 TPU cores. Tests that want fewer devices build a smaller mesh.
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path_factory, monkeypatch):
    """flaxlm's cache (tokenizers, packed blocks) in a per-session temp dir."""
    monkeypatch.setenv("FLAXLM_CACHE", str(tmp_path_factory.getbasetemp() / "flaxlm-cache"))
