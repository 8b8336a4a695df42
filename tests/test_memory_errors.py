"""A step that does not fit the devices' memory stops the run with one paragraph: what XLA
said, and the memory recipes the run does not use yet (flaxlm.training.memory). On a TPU
XLA's compiler refuses such a program at the first step; here its error is planted."""

from __future__ import annotations

import json

import jax
import pytest
from conftest import SHORT, compose
from omegaconf import OmegaConf

from flaxlm.errors import FlaxlmError
from flaxlm.job import train
from flaxlm.training import step as step_module
from flaxlm.training.memory import out_of_memory_error

# What XLA's TPU compiler said for smollm-135m at 16 rows × 2048 tokens on one v5e chip.
XLA_SAYS = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
            "space hbm. Used 16.67G of 15.75G hbm. Exceeded hbm capacity by 943.89M.\n\n"
            "Total hbm usage >= 16.67G:")


def typed(overrides):
    return OmegaConf.to_object(compose(overrides))


def test_the_paragraph_names_what_xla_said_and_the_recipes_not_in_use():
    wrapped = RuntimeError("while compiling the step")
    wrapped.__cause__ = jax.errors.JaxRuntimeError(XLA_SAYS)
    config = typed(["hardware.per_device_batch_size=16", "model.remat=block"])
    error = out_of_memory_error(wrapped, config)
    assert isinstance(error, FlaxlmError)
    message = str(error)
    assert "\n" not in message
    assert f"a {jax.devices()[0].device_kind} with" in message
    assert "hardware.per_device_batch_size=16" in message
    assert "Used 16.67G of 15.75G hbm" in message
    assert "--fit" in message
    assert "trainer.loss_chunk_size=512" in message and "optimizer.moment_dtype=bfloat16" in message
    assert "model.remat=block" not in message  # in use already
    assert "hardware.per_device_batch_size=8 trainer.grad_accum_steps=2" in message


def test_other_errors_are_left_alone():
    assert out_of_memory_error(ValueError("shapes do not match"), typed([])) is None
    disk_full = ValueError('RESOURCE_EXHAUSTED: Error writing "params/0": No space left on device')
    assert out_of_memory_error(disk_full, typed([])) is None


def test_a_step_that_does_not_fit_stops_the_run_with_the_paragraph(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):  # where XLA's compiler refuses the program, at the first step
        raise jax.errors.JaxRuntimeError(XLA_SAYS)

    monkeypatch.setattr(step_module, "accumulate_gradients", refuse)
    with pytest.raises(FlaxlmError, match=r"does not fit the memory.*Used 16\.67G of 15\.75G"):
        train(compose(SHORT, run_dir=tmp_path / "run"))
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed" and "does not fit the memory" in status["reason"]
