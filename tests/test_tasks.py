"""The job hands each task its context; the tasks are found by name and check their own
settings before any data is read."""

from __future__ import annotations

import pytest
from conftest import compose
from omegaconf import OmegaConf

from flaxlm.errors import FlaxlmError
from flaxlm.job import check_settings
from flaxlm.tasks.registry import TASKS, task_named


def config_of(*overrides: str):
    return OmegaConf.to_object(compose(list(overrides)))


def test_every_task_option_names_a_registered_task():
    for name in ("clm", "classify"):
        assert task_named(config_of(f"task={name}").task.name) is TASKS[name]


def test_an_unknown_task_name_is_one_clear_error():
    with pytest.raises(FlaxlmError, match=r"task.name='mlm'.*task=clm.*task=classify"):
        task_named("mlm")


def test_a_classify_run_carries_no_corpus():
    config = config_of("experiment=glue-mrpc")
    assert config.language is None
    assert "language" in OmegaConf.to_container(compose(["task=classify"]))
    assert OmegaConf.to_container(compose(["task=classify"]))["language"] is None


def test_a_corpus_given_to_a_classify_run_is_refused():
    config = config_of("task=classify", "language=is", "task.hub_path=nyu-mll/glue")
    with pytest.raises(FlaxlmError, match=r"task.hub_path or task.files, so language=is"):
        check_settings(config, num_devices=8)


def test_clm_without_a_corpus_is_refused():
    config = config_of("~language")
    with pytest.raises(FlaxlmError, match=r"task=clm needs a corpus.*language=en-builtin"):
        check_settings(config, num_devices=8)


def test_clm_refuses_an_encoder_before_reading_data():
    config = config_of("model=bert-tiny")
    with pytest.raises(FlaxlmError, match=r"model=bert-tiny") as raised:
        check_settings(config, num_devices=8)
    assert "model=tiny" not in str(raised.value)


def test_each_task_returns_its_sequence_length():
    assert check_settings(config_of("task.max_seq_length=32"), num_devices=8) == 32
    assert check_settings(config_of("experiment=glue-mrpc", "task.max_seq_length=96"),
                          num_devices=8) == 96
