"""Tests of the config: every shipped group option composes into the typed schema, mistakes fail
at composition naming the key, and the defaults are the seed notebook's."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path

import jax
import pytest
from conftest import CONF_DIR, compose
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import MISSING, OmegaConf

from flaxlm.config import (
    Schedule,
    TrainConfig,
    register_configs,
)
from flaxlm.errors import FlaxlmError
from flaxlm.job import check_settings

CONF = Path(CONF_DIR)
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
OPTIONS = [(group, f.stem) for group in GROUPS for f in sorted((CONF / group).glob("*.yaml"))]


def compose_with_hydra(overrides=()):
    """Like conftest.compose, but keeping the `hydra` node (run dirs, sweeper, job settings)."""
    register_configs()
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return hydra_compose(
            "train", overrides=[*overrides, "run_dir=unset"], return_hydra_config=True
        )


def leaves(node, path=()):
    """(key path, value) for every non-dict value of a plain nested dict (keys may hold dots:
    a sweeper's `optimizer.lr`)."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from leaves(value, (*path, key))
        else:
            yield (*path, key), value


def lookup(cfg, path):
    """The composed value at a key path, interpolations left as written."""
    for key in path[:-1]:
        cfg = cfg[key]
    value = OmegaConf.to_container(cfg, resolve=False)[path[-1]]
    return value.name if isinstance(value, enum.Enum) else value  # hydra.mode: RunMode.MULTIRUN


def option_yaml(group: str, option: str) -> tuple[dict, tuple[str, ...]]:
    """An option file's own values (without its defaults list) and the package they land in."""
    path = CONF / group / f"{option}.yaml"
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    values.pop("defaults", None)
    is_global = "# @package _global_" in path.read_text(encoding="utf-8")
    return values, () if is_global else (group,)


def test_every_group_ships_options():
    expected = {"experiment", "hardware", "hparams_search", "hydra", "language", "logger",
                "model", "optimizer", "task"}
    assert expected <= set(GROUPS)
    assert all(any(g == group for g, _ in OPTIONS) for group in GROUPS)


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_into_the_typed_schema(group, option):
    cfg = compose_with_hydra([f"{group}={option}"])

    values, package = option_yaml(group, option)
    for path, value in leaves(values):
        if value == MISSING:
            continue
        composed = lookup(cfg, (*package, *path))
        assert composed == value, f"{group}/{option}.yaml sets {path}={value!r}, not {composed!r}"
    # Group overrides in an option's defaults list (`override /model: distilgpt2`).
    for entry in OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml")).get(
        "defaults", []
    ):
        if isinstance(entry, str):  # another preset of the group (glue-cola uses glue-mrpc)
            continue
        for key, picked in entry.items():  # `override /language@_global_.language: null`
            if key.startswith("override /hydra/"):  # launcher=slurm picks Hydra's launcher
                assert cfg.hydra.runtime.choices[key.removeprefix("override /")] == picked
                continue
            chosen = cfg[key.removeprefix("override /").split("@")[0]]
            assert chosen is None if picked is None else chosen.name == picked

    config = OmegaConf.to_object(compose([f"{group}={option}"]))
    assert isinstance(config, TrainConfig)
    if group in {f.name for f in dataclasses.fields(TrainConfig)}:
        assert getattr(config, group).name == option


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("model.n_layr=3", ["model.n_layr"]),
        ("model.n_layer=abc", ["model.n_layer", "abc"]),
        ("optimizer.schedule=cosin", ["optimizer.schedule", "cosin"]),
        ("trainer.num_epochs=ten", ["trainer.num_epochs"]),
        ("tokenizer.min_frequncy=3", ["tokenizer.min_frequncy"]),
    ],
)
def test_misspelt_key_or_wrong_type_fails_at_composition_naming_the_key(override, fragments):
    with pytest.raises(ConfigCompositionException) as info:
        compose([override])
    for fragment in fragments:
        assert fragment in str(info.value)


def test_wrong_type_error_explains_the_expected_values():
    with pytest.raises(ConfigCompositionException) as info:
        compose(["optimizer.schedule=cosin"])
    cause = str(info.value.__cause__)
    assert all(s.value in cause for s in Schedule)
    assert "full_key: optimizer.schedule" in cause


@pytest.mark.parametrize("group", ["model", "hardware", "language"])
def test_unknown_group_option_lists_the_available_ones(group):
    with pytest.raises(ConfigCompositionException) as info:
        compose([f"{group}=gpt3"])
    message = str(info.value)
    assert f"Could not find '{group}/gpt3'" in message
    assert f"Available options in '{group}'" in message
    for _, option in (o for o in OPTIONS if o[0] == group):
        assert f"\t{option}\n" in message


def test_the_default_run_steps_as_adamw_with_linear_decay_to_zero():
    """What the default optimizer does to a weight matrix: AdamW (β 0.9 / 0.98, ε 1e-8, weight
    decay 0.01) at 3e-4, decaying linearly to 0 over the run, no warmup, no clipping."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    from flaxlm.training.optimizer import make_optimizer, make_schedule

    optimizer = OmegaConf.to_object(compose()).optimizer
    ours = make_optimizer(optimizer, make_schedule(optimizer, 4))
    expected = optax.adamw(optax.linear_schedule(3e-4, 0.0, 4), b1=0.9, b2=0.98, eps=1e-8,
                           weight_decay=0.01)
    params = {"h": {"kernel": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)}}
    states = [ours.init(params), expected.init(params)]
    for step in range(4):
        grads = jax.tree.map(lambda p, s=step: jnp.cos(p * (s + 1)) * 10.0, params)
        (mine, states[0]), (theirs, states[1]) = (
            tx.update(grads, state, params) for tx, state in zip((ours, expected), states))
        np.testing.assert_allclose(mine["h"]["kernel"], theirs["h"]["kernel"], rtol=1e-6)
        params = optax.apply_updates(params, mine)


@pytest.mark.parametrize(("option", "num_params"), [
    ("distilgpt2", 81_912_576), ("gpt2", 124_439_808), ("gpt2-medium", 354_823_168),
    ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)])
def test_the_gpt2_options_build_the_published_networks(option, num_params):
    """The parameter counts of HF's GPT-2 checkpoints of these names (tied LM head)."""
    from flax import nnx

    from flaxlm.models.build import build_lm
    from flaxlm.models.layers import TransformerSpec, count_params

    model_config = OmegaConf.to_object(compose([f"model={option}"])).model
    model = nnx.eval_shape(lambda: build_lm(TransformerSpec(model_config), nnx.Rngs(0)))
    assert count_params(model) == num_params


def test_hydra_keeps_the_working_directory_and_timestamps_run_dirs_to_the_microsecond():
    hydra = compose_with_hydra().hydra
    assert hydra.job.chdir is False
    run_dir = OmegaConf.to_container(hydra.run, resolve=False)["dir"]
    sweep_dir = OmegaConf.to_container(hydra.sweep, resolve=False)["dir"]
    for directory in (run_dir, sweep_dir):
        assert "${now:" in directory and "%f" in directory
    assert OmegaConf.load(CONF / "hydra" / "default.yaml").job.chdir is False


def test_run_dir_defaults_to_hydras_output_dir_and_cache_to_flaxlm_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FLAXLM_CACHE", str(tmp_path))
    register_configs()
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = hydra_compose("train")
    assert OmegaConf.to_container(cfg, resolve=False)["run_dir"] == "${hydra:runtime.output_dir}"
    assert cfg.cache_dir == str(tmp_path)


def schema_default(field: dataclasses.Field):
    """A dataclass field's default (a nested dataclass for a node), or MISSING."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return MISSING if field.default is dataclasses.MISSING else field.default


def disagreements(schema, values: dict, path: str = ""):
    """Keys `values` (a YAML's own settings) sets to other than the schema's default; a field
    without a default (MISSING) takes its value from the YAML alone."""
    for field in dataclasses.fields(schema):
        if field.name not in values:
            continue
        default, value, key = schema_default(field), values[field.name], f"{path}{field.name}"
        if dataclasses.is_dataclass(default):
            yield from disagreements(type(default), value, f"{key}.")
        elif default != MISSING:
            plain = default.value if isinstance(default, enum.Enum) else default
            if plain != value:
                yield f"{key}: schema {plain!r}, conf/train.yaml {value!r}"


def test_each_default_lives_in_one_place():
    """conf/train.yaml fills the top level and the nodes no group chooses (trainer, checkpoint,
    tokenizer, samples): where it sets a key, the schema has no default or the same one, so a
    config built in code and a composed run cannot silently differ. (Group options are choices
    among values; their schema defaults are the fallback for keys an option leaves out.)"""
    values = OmegaConf.to_container(OmegaConf.load(CONF / "train.yaml"), resolve=False)
    assert {"trainer", "checkpoint", "tokenizer", "samples"} <= values.keys()
    assert list(disagreements(TrainConfig, values)) == []


def test_classify_takes_its_example_length_from_the_task_option_only():
    """task=classify pads to conf/task/classify.yaml's max_seq_length; null there is an error
    naming the setting, not a second default hidden in code."""
    config = OmegaConf.to_object(compose(["experiment=glue-mrpc"]))
    classify = OmegaConf.load(CONF / "task" / "classify.yaml")
    assert config.task.max_seq_length == classify.max_seq_length
    assert check_settings(config, num_devices=8) == config.task.max_seq_length
    config.task.max_seq_length = None
    with pytest.raises(FlaxlmError, match=r"task\.max_seq_length"):
        check_settings(config, num_devices=8)


def preset_base(option: str) -> list[str]:
    """The overrides a preset composes on top of: its group choices, or the preset it extends."""
    defaults = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / f"{option}.yaml"))
    overrides = []
    for entry in defaults.get("defaults", []):
        if isinstance(entry, str):
            if entry != "_self_":
                overrides.append(f"experiment={entry}")
            continue
        overrides += [f"{key.removeprefix('override /')}={value}" for key, value in entry.items()]
    return overrides


PRESETS = [option for group, option in OPTIONS if group == "experiment"]


@pytest.mark.parametrize("option", PRESETS)
def test_experiment_presets_state_only_what_they_change(option):
    """A preset's values differ from what its group choices (or the preset it extends) already
    give: no copies of conf/optimizer/adamw.yaml or conf/train.yaml to drift from them."""
    base = compose(preset_base(option))
    values, _ = option_yaml("experiment", option)
    repeated = [".".join(path) for path, value in leaves(values) if lookup(base, path) == value]
    assert repeated == [], f"experiment/{option}.yaml repeats values it does not change"
