"""Shared test set-up: 8 simulated CPU devices, and caches that never touch the user's."""

import dataclasses
import functools
import os
from pathlib import Path

# Before JAX starts: every multi-device path runs on 8 simulated CPU devices, as on one 8-core
# TPU host. Tests that want fewer devices build a smaller mesh.
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


@pytest.fixture
def unwritable(tmp_path):
    """A directory this process cannot write to: read-only by its mode, or, for root (whom
    modes do not stop), one under /sys, which is read-only on Linux."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o555)
    yield directory if not os.access(directory, os.W_OK) else Path("/sys/flaxlm-test")
    directory.chmod(0o755)


@pytest.fixture(scope="session")
def train_state():
    """A small GPT-2's train state (AdamW), replicated on 2 devices: what checkpoints hold."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from flaxlm.models.gpt2 import GPT2LMHeadModel
    from flaxlm.models.layers import TransformerSpec
    from flaxlm.parallel import make_mesh, replicated
    from flaxlm.training.step import create_state

    config = config_node("model", ["model=gpt2"], n_layer=2, n_embd=32, n_head=2, n_positions=16,
                         vocab_size=64)
    model = GPT2LMHeadModel(TransformerSpec(config, jnp.float32, jnp.float32), nnx.Rngs(params=0))
    _, state = create_state(model, optax.adamw(1e-3))
    return jax.device_put(state, replicated(make_mesh(2)))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF_DIR = os.path.join(REPO, "conf")

# A model and corpus small enough for a training run of a few seconds on 2 cores.
TINY = [
    "model.n_layer=2",
    "model.n_embd=64",
    "model.n_head=4",
    "model.n_positions=64",
    "model.vocab_size=512",
    "hardware.per_device_batch_size=2",
    "logger=none",
    "hardware=cpu-8",
]


def trained_run(tmp_path_factory, name: str, overrides) -> str:
    """A run of `overrides` trained to its end in a fresh folder, for a module-scoped fixture
    that tests compare their runs with (the session's flaxlm cache, as every test has)."""
    from flaxlm.job import train

    run_dir = tmp_path_factory.mktemp(name) / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLAXLM_CACHE", str(tmp_path_factory.getbasetemp() / "flaxlm-cache"))
        train(compose(overrides, run_dir=run_dir))
    return run_dir


@functools.cache
def _composed(overrides: tuple[str, ...]):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(compose(overrides))


def config_node(node: str, overrides=(), **changes):
    """One typed node of the config `overrides` compose to (e.g. config_node("model",
    ["model=llama-tiny"], n_layer=2)), with `changes`: how a test builds a config in code while
    every value it does not change still comes from conf/, the one home of each value."""
    return dataclasses.replace(getattr(_composed(tuple(overrides)), node), **changes)


# An option of each model family: what model_config takes the family's settings from.
FAMILY_OPTIONS = {"gpt2": "gpt2", "bert": "bert-tiny", "llama": "llama-tiny"}


def model_config(family: str = "gpt2", **fields):
    """A network of `family` with the shape `fields` give, built in code: the family's
    settings (activation, dropout, epsilon, ...) come from conf/ through one of its options,
    whose optional shape settings (n_inner, n_kv_head) and pretrained weights are left out."""
    unset = {"n_inner": None, "n_kv_head": None, "init_from": None}
    return config_node("model", [f"model={FAMILY_OPTIONS[family]}"], **{**unset, **fields})


def mesh_config(**sizes):
    """The default hardware's mesh (conf/) with `sizes` changed, e.g. mesh_config(fsdp=8)."""
    return dataclasses.replace(config_node("hardware").mesh, **sizes)


def compose(overrides=(), run_dir=None, return_hydra_config=False):
    """conf/train.yaml composed as `flaxlm-train` would, outside a Hydra app (with its `hydra`
    node if `return_hydra_config`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from flaxlm.config import register_configs

    register_configs()
    extra = [f"run_dir={run_dir}"] if run_dir is not None else ["run_dir=unset"]
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return hydra_compose("train", overrides=[*overrides, *extra],
                             return_hydra_config=return_hydra_config)
