"""flaxlm-plan's memory recipes: a run that does not fit is told the recipes (remat, bfloat16
moments, adafactor, bfloat16 parameters, smaller micro-batches) with the per-chip state each
leaves, and `--fit` plans the first that fits. On the CPU's 8 devices with a made-up chip
memory (hardware.hbm_gib_per_device), so that the tiny model's compiles take seconds."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from conftest import TINY, compose
from omegaconf import OmegaConf

from flaxlm import aot
from flaxlm.cli import plan as plan_cli

SHORT = [*TINY, "task.max_seq_length=32"]


def gib(num_bytes: float) -> str:
    return f"hardware.hbm_gib_per_device={num_bytes / aot.GIB:.9f}"


def typed(overrides):
    return OmegaConf.to_object(compose(overrides))


@pytest.mark.slow
def test_the_ladder_is_cheapest_in_quality_first_with_each_rungs_exact_state():
    ladder = aot.recipe_ladder(typed(SHORT), 8, lambda extra: typed(aot.override(SHORT, extra)))
    assert [step.added for step in ladder] == [
        ("trainer.loss_chunk_size=512",), ("model.remat=block",),
        ("optimizer.moment_dtype=bfloat16",), ("optimizer=adafactor",),
        ("model.remat=full",), ("hardware.param_dtype=bfloat16",),
        ("hardware.per_device_batch_size=1", "trainer.grad_accum_steps=2")]
    # Each rung keeps the ones before it; a later value of a key replaces the earlier one.
    assert ladder[4].overrides == ("trainer.loss_chunk_size=512", "optimizer.moment_dtype=bfloat16",
                                   "optimizer=adafactor", "model.remat=full")
    run = aot.abstract_run(typed(SHORT))
    params = aot.per_device_bytes(run.state.params)
    # AdamW's two float32 moments, and a few int32 counters (the step, Adam's count, ...).
    ints = aot.per_device_bytes((run.state.step, run.state.opt_state)) - 2 * params
    assert 0 < ints <= 16
    assert ladder[0].state_bytes == ladder[1].state_bytes == 3 * params + ints  # as it was
    assert ladder[2].state_bytes == 2 * params + ints  # AdamW's two moments in half the bytes
    assert ladder[5].state_bytes < ladder[4].state_bytes  # bfloat16 parameters
    assert ladder[6].state_bytes == ladder[5].state_bytes  # the micro-batch is no state


@pytest.mark.slow
def test_recipes_already_in_effect_are_not_offered():
    overrides = [*SHORT, "model.remat=full", "optimizer.moment_dtype=bfloat16",
                 "hardware.per_device_batch_size=1", "trainer.loss_chunk_size=16"]
    ladder = aot.recipe_ladder(typed(overrides), 8,
                               lambda extra: typed(aot.override(overrides, extra)))
    assert [step.added for step in ladder] == [("optimizer=adafactor",),
                                               ("hardware.param_dtype=bfloat16",)]


@pytest.mark.slow
def test_a_run_that_does_not_fit_names_the_recipes_and_fit_plans_the_first_that_does(
        tmp_path, capsys):
    """Full remat, a chunked loss and one row per device already: the ladder is bfloat16
    moments, adafactor, bfloat16 parameters. A chip between the run's peak and its peak with
    bfloat16 moments: the plan says what each recipe's state is; --fit compiles the first
    and takes it."""
    base = [*SHORT, "model.remat=full", "hardware.per_device_batch_size=1",
            "trainer.loss_chunk_size=16"]
    as_is, halved = aot.plan(compose(base)), aot.plan(compose(
        [*base, "optimizer.moment_dtype=bfloat16"]))
    assert halved.opt_state_bytes < as_is.opt_state_bytes
    assert halved.peak_bytes < as_is.peak_bytes
    chip = [gib((as_is.peak_bytes + halved.peak_bytes) / 2)]

    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main([*base, *chip])
    assert exit_info.value.code == 2
    [message] = capsys.readouterr().err.strip().splitlines()
    assert "Memory recipes, cheapest in quality first" in message, message
    assert (f"optimizer.moment_dtype=bfloat16 (state {aot.gib(halved.state_bytes)}, about "
            f"{aot.gib(halved.state_bytes + as_is.train.temp_bytes)} with today's "
            "temporaries") in message, message
    assert message.index("optimizer=adafactor") < message.index("hardware.param_dtype=bfloat16")
    assert "--fit" in message

    path = tmp_path / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert plan_cli.run([*base, *chip, "--fit", "--json", str(path)]) == 0
    assert "flaxlm: fits with optimizer.moment_dtype=bfloat16: " in out.getvalue()
    chosen = json.loads(path.read_text())
    assert chosen["recipe"] == ["optimizer.moment_dtype=bfloat16"]
    assert chosen["opt_state_bytes"] == halved.opt_state_bytes and chosen["fits"]


@pytest.mark.slow
def test_fit_leaves_out_the_recipes_costing_time_that_a_later_one_made_unneeded(tmp_path):
    """As llama-1b on one v5e chip: with float32 AdamW remat does not fit the step, bfloat16
    moments fit it without remat. --fit climbs the ladder to the loss in chunks, remat and
    bfloat16 moments, then plans bfloat16 moments alone: the same loss, none of the time."""
    with_remat = aot.plan(compose([*SHORT, "trainer.loss_chunk_size=512", "model.remat=block"]))
    both = aot.plan(compose([*SHORT, "trainer.loss_chunk_size=512", "model.remat=block",
                             "optimizer.moment_dtype=bfloat16"]))
    alone = aot.plan(compose([*SHORT, "optimizer.moment_dtype=bfloat16"]))
    assert alone.peak_bytes <= both.peak_bytes < with_remat.peak_bytes
    chip = [gib((both.peak_bytes + with_remat.peak_bytes) / 2)]

    path = tmp_path / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert plan_cli.run([*SHORT, *chip, "--fit", "--json", str(path)]) == 0
    assert ("flaxlm: fits with optimizer.moment_dtype=bfloat16: "
            in out.getvalue()), out.getvalue()
    assert "not needed with it: trainer.loss_chunk_size=512 model.remat=block" in out.getvalue()
    chosen = json.loads(path.read_text())
    assert chosen["recipe"] == ["optimizer.moment_dtype=bfloat16"]
    assert chosen["peak_bytes"] == alone.peak_bytes


@pytest.mark.slow
def test_fit_says_so_when_no_recipe_fits(capsys):
    """A chip smaller than any rung's state: nothing is compiled beyond the run itself."""
    base = [*SHORT, "model.remat=full", "hardware.per_device_batch_size=1",
            "trainer.loss_chunk_size=16", gib(2**10)]
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main([*base, "--fit"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    [message] = captured.err.strip().splitlines()
    assert "No memory recipe fits either: optimizer.moment_dtype=bfloat16 (state alone" in message
    assert "flaxlm: planning with" not in captured.out


@pytest.mark.slow
def test_fit_splits_rows_that_do_not_fit_over_a_context_axis(tmp_path, capsys):
    """Rows of 512 tokens, one per device, on a chip that holds the step's state many times
    over but not one row's temporaries (attention's 512 × 512 scores): no memory recipe can
    make room, so the plan names the context sizes and --fit plans the smallest that fits,
    context=2, first, keeping the global batch of 8 rows in micro-batches."""
    base = [*TINY, "model=llama-tiny", "model.num_layers=2", "model.max_positions=512",
            "task.max_seq_length=512", "hardware.per_device_batch_size=1"]
    context_2 = ["hardware.mesh.data=4", "hardware.mesh.fsdp=1", "hardware.mesh.expert=1",
                 "hardware.mesh.context=2", "hardware.mesh.tensor=1",
                 "hardware.per_device_batch_size=1", "trainer.grad_accum_steps=2"]
    whole, split = aot.plan(compose(base)), aot.plan(compose([*base, *context_2]))
    assert split.global_batch == whole.global_batch == 8
    assert split.peak_bytes < whole.peak_bytes
    assert whole.state_bytes + split.train.temp_bytes < split.peak_bytes  # the rows dominate
    chip = [gib((split.peak_bytes + whole.peak_bytes) / 2)]

    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main([*base, *chip])
    assert exit_info.value.code == 2
    [message] = capsys.readouterr().err.strip().splitlines()
    assert ("split each row's positions over devices (hardware.mesh.context=2, 4, 8): "
            "flaxlm-plan --fit tries them first") in message, message

    path = tmp_path / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert plan_cli.run([*base, *chip, "--fit", "--json", str(path)]) == 0
    assert "flaxlm: planning with hardware.mesh.context=2 " in out.getvalue()
    assert f"flaxlm: fits with {' '.join(context_2)}: " in out.getvalue(), out.getvalue()
    assert "planning with model.remat" not in out.getvalue()  # no recipe compiled before it
    chosen = json.loads(path.read_text())
    assert chosen["recipe"] == context_2 and chosen["mesh"]["context"] == 2
    assert chosen["peak_bytes"] == split.peak_bytes
