"""Compiled steps kept on disk (flaxlm.training.executables): a second run of the same config
loads its train and eval steps without tracing them, and trains to the same losses; a setting
that changes the program misses; `flaxlm-plan --save` writes what a run of the same overrides
loads (compiled_steps=DIR), and a directory made for other devices is refused in one paragraph."""

from __future__ import annotations

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import pytest
from conftest import TINY, compose

from flaxlm.cli import plan as plan_cli
from flaxlm.errors import FlaxlmError
from flaxlm.job import train
from flaxlm.training import executables

RUN = [*TINY, "task.max_seq_length=32", "trainer.max_steps=3", "trainer.log_every_steps=1",
       "checkpoint.every_steps=null", "checkpoint.at_epoch_end=false"]
STEPS = ("train_step", "eval_step")  # the names the steps are traced under (`traced_on`)
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


@contextlib.contextmanager
def traced_steps():
    """The names of the steps JAX traces meanwhile (a list, filled as they are)."""
    traced = []

    def listen(event, duration, **kwargs):
        if event == TRACE_EVENT and kwargs.get("fun_name") in STEPS:
            traced.append(kwargs["fun_name"])

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield traced
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def losses(run_dir) -> list[tuple[int, str, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], key, r[key]) for r in records for key in ("train/loss", "eval/loss")
            if key in r]


def trained(tmp_path, name: str, overrides=()) -> tuple[list, list]:
    """A run of RUN + `overrides`: its losses and the steps it traced."""
    run_dir = tmp_path / name
    with traced_steps() as traced:
        train(compose([*RUN, *overrides], run_dir=run_dir))
    return losses(run_dir), traced


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three runs in one fresh cache: the first, the same again, and one without dropout."""
    tmp_path = tmp_path_factory.mktemp("kept")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLAXLM_CACHE", str(tmp_path / "cache"))
        patch.setenv("FLAXLM_KEEP_COMPILED_STEPS", "true")
        first = trained(tmp_path, "first")
        again = trained(tmp_path, "again")
        other = trained(tmp_path, "no-dropout", ["model.hidden_dropout=0"])
    return {"first": first, "again": again, "no-dropout": other,
            "store": tmp_path / "cache" / executables.STORE_DIR}


@pytest.mark.slow
def test_a_second_identical_run_loads_its_steps_and_trains_to_the_same_losses(runs):
    (first_losses, first_traced), (again_losses, again_traced) = runs["first"], runs["again"]
    assert len(first_traced) >= 2  # the train and the eval step, traced and compiled
    assert again_traced == []  # both loaded: nothing traced, so nothing compiled
    assert len(first_losses) == 3 + 2  # three steps, an eval before and after
    assert again_losses == first_losses  # to the bit
    assert len(list(runs["store"].glob("*/train-*.exe"))) >= 1


@pytest.mark.slow
def test_a_setting_that_changes_the_program_misses(runs):
    losses_without, traced = runs["no-dropout"]
    assert len(traced) >= 2
    assert losses_without != runs["first"][0]
    assert len(list(runs["store"].glob(f"*/{executables.KEY_FILE}"))) == 2


def test_the_key_leaves_out_only_the_allowed_settings():
    base = compose(RUN, run_dir="a")
    from omegaconf import OmegaConf

    config = OmegaConf.to_object(base)
    part = executables.config_part(config)
    assert "run_dir" not in part and "trainer.log_every_steps" not in part
    assert part["model.hidden_dropout"] == "0.1" and "optimizer.lr" in part and "seed" in part
    moved = OmegaConf.to_object(compose([*RUN, "trainer.log_every_steps=7", "logger=wandb"],
                                        run_dir="b"))
    assert executables.config_part(moved) == part


def plan_saved(overrides, directory) -> str:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        plan_cli.main([*overrides, "--save", str(directory)])
    return out.getvalue()


@pytest.mark.slow
def test_a_plan_saved_for_this_run_is_what_it_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAXLM_KEEP_COMPILED_STEPS", "false")
    compiled_here, traced_here = trained(tmp_path, "compiling")
    # Planned after the run: its programs are in JAX's persistent cache, whose XLA:CPU
    # executables serialise without their kernels (`executables.compile_to_keep`).
    saved = tmp_path / "planned"
    plan_saved(RUN, saved)
    assert len(list(saved.glob("*/train-*.exe"))) == len(list(saved.glob("*/eval-*.exe"))) == 1
    loaded, traced = trained(tmp_path, "loading", [f"compiled_steps={saved}"])
    assert len(traced_here) >= 2 and traced == []
    assert loaded == compiled_here


@pytest.mark.slow
def test_a_plan_saved_for_other_devices_is_refused_naming_them(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAXLM_KEEP_COMPILED_STEPS", "false")
    saved = tmp_path / "planned"
    plan_saved([*RUN, "hardware.num_devices=4"], saved)
    with pytest.raises(FlaxlmError) as refused:
        train(compose([*RUN, f"compiled_steps={saved}"], run_dir=tmp_path / "run"))
    message = str(refused.value)
    assert f"compiled_steps={saved} was compiled for another run" in message
    assert ("its devices are 4 × cpu (cpu, mesh data=4 fsdp=1 expert=1 context=1 tensor=1), "
            "this run's 8 × cpu (cpu, mesh data=8 fsdp=1 expert=1 context=1 tensor=1)"
            ) in message
    assert "config keys differ: hardware.num_devices=4 there, 8 here." in message
    assert "flaxlm-plan <overrides>" in message and "Traceback" not in message


def test_plan_save_needs_the_schedules_length(tmp_path):
    with pytest.raises(FlaxlmError, match="--save needs trainer.max_steps"):
        plan_cli.run([*TINY, "task.max_seq_length=32", "--save", str(tmp_path / "x")])


def test_the_key_leaves_out_what_jax_adds_on_a_tpu_but_keeps_the_users_tpu_flags(monkeypatch):
    """JAX adds --xla_tpu_use_enhanced_launch_barrier to LIBTPU_INIT_ARGS when it starts on a
    TPU: a plan made on a CPU, loaded on the chip, was refused over it (issue 52, on a v5e)."""
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    planned = executables.environment()
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_use_enhanced_launch_barrier=true")
    assert executables.environment() == planned
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_use_enhanced_launch_barrier=true "
                       "--xla_tpu_enable_latency_hiding_scheduler=false")
    assert executables.environment() != planned


def test_a_store_that_cannot_be_written_costs_a_compile_not_the_run(tmp_path, capsys):
    store = executables.StepStore(tmp_path / "store")
    (tmp_path / "store").write_text("a file where the store's folder would be")
    compiled = jax.jit(lambda x: x + 1).lower(jnp.ones(2)).compile()
    key = executables.ProgramKey({"what": "a test"})
    assert store.save(key, "train", "sig", compiled) is False
    assert "not kept for later runs" in capsys.readouterr().out
