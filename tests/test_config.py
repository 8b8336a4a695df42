"""Tests of the config: every shipped group option composes into the typed schema, mistakes fail
at composition naming the key, and the defaults are the seed notebook's."""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
from pathlib import Path

import jax
import pytest
from conftest import CONF_DIR, compose
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import ConfigCompositionException
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import MISSING, OmegaConf, open_dict

from flaxlm.config import (
    RENAMED,
    Schedule,
    TrainConfig,
    dotted,
    register_configs,
    renamed_keys,
    rows_per_device,
    upgrade_saved_config,
)
from flaxlm.errors import FlaxlmError
from flaxlm.job import check_settings

CONF = Path(CONF_DIR)
# conf/base/ holds what options extend, not a group to choose from.
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "base")
OPTIONS = [(group, f.stem) for group in GROUPS for f in sorted((CONF / group).glob("*.yaml"))]


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


@functools.cache
def default_config():
    """conf/train.yaml composed with no override, once for the tests that only read it."""
    return compose()


def test_every_group_ships_options():
    expected = {"experiment", "hardware", "hparams_search", "hydra", "language", "logger",
                "model", "optimizer", "task"}
    assert expected <= set(GROUPS)
    assert all(any(g == group for g, _ in OPTIONS) for group in GROUPS)


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_into_the_typed_schema(group, option):
    # One composition (each takes a good part of a second) serves both checks: the values
    # with the `hydra` node, then the typed config of everything but that node, which is
    # what composing without it gives.
    cfg = compose([f"{group}={option}"], return_hydra_config=True)

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

    with open_dict(cfg):
        del cfg["hydra"]
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, TrainConfig)
    if group in {f.name for f in dataclasses.fields(TrainConfig)}:
        assert getattr(config, group).name == option


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("model.n_layr=3", ["model.n_layr"]),
        ("model.num_layers=abc", ["model.num_layers", "abc"]),
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
    import optax
    from numerics import assert_close

    from flaxlm.training.optimizer import make_optimizer, make_schedule

    optimizer = OmegaConf.to_object(default_config()).optimizer
    ours = make_optimizer(optimizer, make_schedule(optimizer, 4))
    expected = optax.adamw(optax.linear_schedule(3e-4, 0.0, 4), b1=0.9, b2=0.98, eps=1e-8,
                           weight_decay=0.01)
    params = {"h": {"kernel": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)}}
    states = [ours.init(params), expected.init(params)]
    for step in range(4):
        grads = jax.tree.map(lambda p, s=step: jnp.cos(p * (s + 1)) * 10.0, params)
        (mine, states[0]), (theirs, states[1]) = (
            tx.update(grads, state, params) for tx, state in zip((ours, expected), states))
        # optax's AdamW both, compiled apart: a few roundings a step, up to 4 steps.
        assert_close(mine["h"]["kernel"], theirs["h"]["kernel"], depth=4 * (step + 1))
        params = optax.apply_updates(params, mine)


@pytest.mark.parametrize(("option", "num_params"), [
    ("distilgpt2", 81_912_576), ("gpt2", 124_439_808), ("gpt2-medium", 354_823_168),
    ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)])
@pytest.mark.slow
def test_the_gpt2_options_build_the_published_networks(option, num_params):
    """The parameter counts of HF's GPT-2 checkpoints of these names (tied LM head)."""
    from flaxlm.models.build import abstract_network, build_lm
    from flaxlm.models.layers import TransformerSpec, count_params

    model_config = OmegaConf.to_object(compose([f"model={option}"])).model
    model = abstract_network(lambda rngs: build_lm(TransformerSpec(model_config), rngs))
    assert count_params(model) == num_params


def test_hydra_keeps_the_working_directory_and_timestamps_run_dirs_to_the_microsecond():
    hydra = compose(return_hydra_config=True).hydra
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


def schema_nodes(schema=TrainConfig, path=""):
    """(dotted key, field) for every field of the schema, nested nodes included."""
    for field in dataclasses.fields(schema):
        yield f"{path}{field.name}", field
        default = schema_default(field)
        if dataclasses.is_dataclass(default):
            yield from schema_nodes(type(default), f"{path}{field.name}.")


def test_the_schema_gives_types_and_defaults_only_to_nothing():
    """A value someone chose lives in conf/ alone: the schema's only defaults are nothing (null,
    off, an empty list, a nested node); every other field is MISSING, filled by the YAML."""
    chosen = [f"{key}={schema_default(field)!r}" for key, field in schema_nodes()
              if not (schema_default(field) in (MISSING, None, False, [])
                      or dataclasses.is_dataclass(schema_default(field)))]
    assert chosen == []


# The schema node each group's options (and their bases in conf/base/<group>/) fill.
NODE_SCHEMAS = {"language": "LanguageConfig", "model": "ModelConfig",
                "optimizer": "OptimizerConfig", "hardware": "HardwareConfig",
                "task": "TaskConfig", "logger": "LoggerConfig"}


def extended_files(path: Path) -> list[Path]:
    """The files `path`'s defaults list extends (`- gpt2`, `- /base/model/common@_here_`), not
    the group choices it overrides."""
    defaults = OmegaConf.to_container(OmegaConf.load(path)).get("defaults", [])
    extended = []
    for entry in defaults:
        if not isinstance(entry, str) or entry in ("_self_", "train_schema"):  # the schema itself
            continue
        name = entry.split("@")[0]
        base = CONF / f"{name[1:]}.yaml" if name.startswith("/") else path.parent / f"{name}.yaml"
        extended.append(base)
    return extended


def inherited(path: Path) -> dict:
    """What the files `path` extends give, merged in their order."""
    merged = OmegaConf.create()
    for base in extended_files(path):
        merged = OmegaConf.merge(merged, inherited(base), own_values(base))
    return OmegaConf.to_container(merged, resolve=False)


def own_values(path: Path) -> dict:
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    values.pop("defaults", None)
    return values


def schema_for(path: Path):
    group = path.parent.name
    import flaxlm.config

    return getattr(flaxlm.config, NODE_SCHEMAS[group]) if group in NODE_SCHEMAS else None


def value_at(tree, keys):
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return MISSING
        tree = tree[key]
    return tree


def schema_value(schema, keys):
    for key in keys:
        if schema is None or not dataclasses.is_dataclass(schema):
            return MISSING
        field = next((f for f in dataclasses.fields(schema) if f.name == key), None)
        if field is None:
            return MISSING
        schema = schema_default(field)
    return schema.value if isinstance(schema, enum.Enum) else schema


OPTION_FILES = sorted(
    [p for group in NODE_SCHEMAS for p in (CONF / group).glob("*.yaml")]
    + list((CONF / "base").glob("*/*.yaml")) + [CONF / "train.yaml"])


@pytest.mark.parametrize("path", OPTION_FILES, ids=lambda p: str(p.relative_to(CONF)))
def test_no_file_restates_a_value_its_base_or_the_schema_gives(path):
    """Each value has one home: an option (or a base, or conf/train.yaml) sets a key only to
    change what the files it extends, or the schema, already give."""
    base = inherited(path)
    schema = TrainConfig if path.name == "train.yaml" else schema_for(path)
    repeated = []
    for keys, value in leaves(own_values(path)):
        given = value_at(base, keys)
        if given is MISSING:
            given = schema_value(schema, keys)
        if given is not MISSING and given == value:
            repeated.append(".".join(keys))
    assert repeated == [], f"{path.relative_to(CONF)} restates {repeated}"


def test_bases_extend_options_without_being_options():
    """conf/base/<group>/ holds what several options of a group share; every base is extended
    by some option (or base), and no option of a group extends another group's base."""
    used = {base for path in OPTION_FILES for base in extended_files(path)}
    for base in (CONF / "base").glob("*/*.yaml"):
        assert base in used, f"{base.relative_to(CONF)} is extended by no option"
    for path in OPTION_FILES:
        for base in extended_files(path):
            assert base.exists(), f"{path.relative_to(CONF)} extends missing {base}"
            if base.parent.parent.name == "base":
                assert base.parent.name == path.parent.name or path.name == "train.yaml"


@pytest.mark.parametrize(("old", "new"), RENAMED.items())
def test_a_renamed_key_is_an_error_naming_its_new_spelling(old, new):
    composed = OmegaConf.select(default_config(), new, default="unset")
    assert composed != "unset", f"{new} is no key"
    with pytest.raises(ConfigCompositionException) as info:
        compose([f"{old}=1"])
    assert renamed_keys(f"{info.value}\n{info.value.__cause__}") == [f"{old} was renamed {new}"]


def run_cli(monkeypatch, capsys, argv):
    """flaxlm-train's main() in this process: (exit code, stderr)."""
    from flaxlm.cli import train as cli

    monkeypatch.setattr(sys, "argv", ["flaxlm-train", *argv])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as info:
        cli.main()
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize(("old", "new"), [("trainer.eval_every", "trainer.eval_every_steps"),
                                          ("model.n_embd", "model.hidden_size")])
def test_an_old_key_on_the_command_line_is_one_line_naming_the_new_key(monkeypatch, capsys,
                                                                       old, new):
    code, err = run_cli(monkeypatch, capsys, [f"{old}=64", "logger=none"])
    assert code == 2
    assert err.strip().splitlines() == [
        f"flaxlm: error: {old} was renamed {new} (the command line): use the new name; "
        "docs/configuration.md lists the renamed keys."]


# A user's option of a group, extending a shipped one, that sets a key under its old name.
USERS_OLD_YAML = {
    "optimizer.kind": ("optimizer", "adamw", "kind: adamw\nlr: 1e-3\n", "optimizer.name"),
    "model.n_layer": ("model", "gpt2", "name: mine\nn_layer: 2\n", "model.num_layers"),
}


@pytest.mark.parametrize("old", USERS_OLD_YAML)
def test_an_old_key_in_a_users_yaml_is_one_line_naming_the_new_key(monkeypatch, capsys,
                                                                  tmp_path, old):
    group, base, body, new = USERS_OLD_YAML[old]
    (tmp_path / group).mkdir()
    (tmp_path / group / "mine.yaml").write_text(
        f"defaults:\n  - {base}\n  - _self_\n\n{body}")
    code, err = run_cli(monkeypatch, capsys,
                        ["--config-dir", str(tmp_path), f"{group}=mine", "logger=none"])
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert f"{old} was renamed {new} (config {group}/mine)" in err


def test_a_config_saved_by_an_earlier_release_reads_under_todays_keys():
    """What resume, export and the report read from a run directory of an earlier release: its
    config.yaml, with every renamed key under its new name, merges onto today's schema."""
    saved = OmegaConf.to_container(
        OmegaConf.load(Path(__file__).parent / "data" / "run-v0" / "run" / "config.yaml"))
    upgraded = upgrade_saved_config(saved)
    OmegaConf.merge(OmegaConf.structured(TrainConfig), upgraded)  # no unknown key
    flat = dotted(upgraded)
    assert (flat["trainer.log_every_steps"], flat["optimizer.name"]) == (1, "adamw")
    assert flat["hardware.param_dtype"] == "float32" and "model.param_dtype" not in flat
    # The model's shape and dropout, under their names for every family.
    assert (flat["model.hidden_size"], flat["model.num_layers"], flat["model.num_heads"],
            flat["model.max_positions"], flat["model.mlp_size"]) == (32, 1, 2, 32, None)
    assert (flat["model.activation"], flat["model.layer_norm_eps"]) == ("gelu_new", 1e-5)
    assert (flat["model.hidden_dropout"], flat["model.embedding_dropout"],
            flat["model.attention_dropout"], flat["model.num_kv_heads"]) == (0.1, 0.1, 0.1, None)
    assert not {old for old in RENAMED if old in flat}
    # A model's own parameter dtype of an earlier release moves to the hardware's.
    saved["model"]["param_dtype"] = "bfloat16"
    assert upgrade_saved_config(saved)["hardware"]["param_dtype"] == "bfloat16"


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


def test_hardware_tpu_caps_a_causal_lms_rows_by_tokens_and_keeps_other_tasks_rows():
    """Issue 44: hardware=tpu's 16 rows per chip of 2048 tokens fit no model measured on a v5e
    chip. A causal LM's micro-batch now holds at most hardware.tokens_per_device tokens (8,192:
    smollm-135m's and qwen2.5-0.5b's fastest), fewer rows where its blocks are long; short
    blocks keep the 16 rows (the quickstart on a TPU is unchanged). A row count given wins."""
    def rows(*overrides):
        return OmegaConf.to_object(compose(["hardware=tpu", *overrides])).hardware
    assert rows("model=smollm-135m", "task.max_seq_length=2048").per_device_batch_size == 4
    assert rows("model=smollm-135m", "task.max_seq_length=512").per_device_batch_size == 16
    assert rows().per_device_batch_size == 16  # the quickstart's blocks of 256
    assert rows("model=smollm-135m", "task.max_seq_length=16384").per_device_batch_size == 1
    assert rows("model=gpt2").per_device_batch_size == 8  # null: the model's 1024 positions
    assert rows("hardware.tokens_per_device=4096", "model=smollm-135m",
                "task.max_seq_length=2048").per_device_batch_size == 2
    assert rows("model=smollm-135m", "hardware.per_device_batch_size=3").per_device_batch_size == 3
    assert rows("task=classify", "model=bert-tiny").per_device_batch_size == 16
    assert rows("hardware=tpu-v5e-8", "model=smollm-135m").per_device_batch_size == 4
    cpu = OmegaConf.to_object(compose(["hardware=cpu"])).hardware
    assert cpu.tokens_per_device is None and cpu.per_device_batch_size == 4


@given(tokens=st.integers(1, 1 << 20), length=st.integers(1, 1 << 16), most=st.integers(1, 64))
def test_rows_per_device_are_the_most_within_the_tokens_at_least_one(tokens, length, most):
    rows = rows_per_device(tokens, most, "clm", length, 1 << 20)
    assert 1 <= rows <= most and (rows * length <= tokens or rows == 1)
    assert rows == most or (rows + 1) * length > tokens
    assert rows_per_device(tokens, most, "classify", length, 1 << 20) == most
    assert rows_per_device(None, most, "clm", length, 1 << 20) == most


def test_on_a_tpu_the_loss_is_chunked_by_default_only_where_the_whole_logits_are_large():
    """trainer.loss_chunk_size defaults to 512 where a micro-batch's float32 logits would
    exceed hardware.max_whole_logits_gib (1.75 GiB on TPUs): qwen2.5-0.5b's 4 rows of 2048
    (4.6 GiB over 151,936 tokens) fit a v5e chip only so, llama-1b's 2 rows (1.96 GiB) ran
    faster so, while smollm-135m's 4 rows (1.5 GiB) run fastest whole. Elsewhere, and when
    set, it is what it was."""
    def chunk(*overrides):
        return OmegaConf.to_object(compose([*overrides])).trainer.loss_chunk_size
    assert chunk("hardware=tpu", "model=qwen2.5-0.5b", "task.max_seq_length=2048") == 512
    assert chunk("hardware=tpu", "model=llama-1b", "task.max_seq_length=2048",
                 "hardware.per_device_batch_size=2") == 512
    assert chunk("hardware=tpu", "model=smollm-135m", "task.max_seq_length=2048") is None
    assert chunk("hardware=tpu", "model=qwen2.5-0.5b", "task.max_seq_length=2048",
                 "trainer.loss_chunk_size=null") is None
    assert chunk("hardware=tpu", "model=smollm-135m", "trainer.loss_chunk_size=1024") == 1024
    assert chunk("hardware=cpu", "model=qwen2.5-0.5b", "task.max_seq_length=2048") is None
    assert chunk() is None  # the quickstart
