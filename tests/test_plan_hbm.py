"""The chip memory `flaxlm-plan` measures a run against: each TPU preset's
`hardware.hbm_gib_per_device` is what a program can use (JAX's `bytes_limit` on the chip, the
figure XLA's TPU compiler fits programs in), not the chip's nominal memory, and the plan's
verdict and report use it."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re

import jax
import jax.numpy as jnp
import pytest
from conftest import REPO, TINY, compose
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from omegaconf import OmegaConf

from flaxlm import aot
from flaxlm.cli import plan as plan_cli
from flaxlm.parallel import target_devices

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def needs_libtpu(test):
    """Compiles for a TPU slice: skipped, with the reason, only where libtpu is missing."""
    skip = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (the `tpu` "
                              "extra, which `make test` installs): no TPU compiler")
    return pytest.mark.libtpu(skip(test))


TPU_PRESETS = sorted(name[:-5] for name in os.listdir(os.path.join(REPO, "conf", "hardware"))
                     if name.startswith("tpu-"))
# JAX's bytes_limit on one TPU v5e chip (docs/benchmarks.md), not its nominal 16 GiB.
V5E_USABLE_GIB = 15.75


def test_the_v5e_presets_hold_the_memory_a_program_can_use_on_the_chip():
    for preset in ("tpu-v5e-8", "tpu-v5e-256"):
        hardware = OmegaConf.to_object(compose([f"hardware={preset}"])).hardware
        assert hardware.hbm_gib_per_device == V5E_USABLE_GIB, preset


@needs_libtpu
@pytest.mark.parametrize("preset", TPU_PRESETS)
def test_each_tpu_preset_holds_the_memory_the_tpu_compiler_lets_a_program_use(preset):
    """A program too large for the preset's device is refused by XLA's TPU compiler with the
    HBM it has for one: the preset's figure, to the compiler's two decimals (on a v5e chip
    that is JAX's bytes_limit, 15.75 GiB)."""
    hardware = OmegaConf.to_object(compose([f"hardware={preset}"])).hardware
    device = target_devices(hardware)[0]
    replicated = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    too_large = jax.ShapeDtypeStruct((200 * 2**30 // 4 // 1024, 1024), jnp.float32,
                                     sharding=replicated)
    step = jax.jit(lambda a: (jnp.sin(a) @ jnp.cos(a).T)[:8].sum() + jnp.exp(a).sum(),
                   out_shardings=replicated)
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as refused:
        step.lower(too_large).compile()
    [available] = re.findall(r"exceeds available HBM \(([\d.]+)G\)", str(refused.value))
    assert hardware.hbm_gib_per_device == pytest.approx(float(available), abs=0.005)


def _compiled(total_gib: float) -> aot.CompiledStep:
    return aot.CompiledStep(compile_s=0.0, argument_bytes=0, output_bytes=0, alias_bytes=0,
                            temp_bytes=int(total_gib * aot.GIB), code_bytes=0, flops=1e12,
                            bytes_accessed=1e9)


# TINY's model on a TPU v5e-8, its steps not compiled: the compiler's figures are set below.
V5E = [o for o in TINY if not o.startswith("hardware=")] + [
    "hardware=tpu-v5e-8", "task.max_seq_length=64"]


@needs_libtpu
@pytest.mark.parametrize(("train_gib", "fits"), [(15.9, False), (15.7, True)])
def test_the_plans_verdict_measures_against_the_usable_memory(monkeypatch, capsys, train_gib,
                                                              fits):
    """A train step of 15.9 GiB per chip would have fit the nominal 16 GiB; it does not fit
    the 15.75 a program can use, and the report says where that figure comes from."""
    monkeypatch.setattr(aot, "compile_step",
                        lambda step, *args, keep=None: _compiled(
                            train_gib if isinstance(args[0], aot.TrainState) else 0.0))
    with contextlib.redirect_stdout(io.StringIO()) as out:
        if fits:
            plan_cli.main(V5E)
        else:
            with pytest.raises(SystemExit) as exit_info:
                plan_cli.main(V5E)
            assert exit_info.value.code == 2
    printed = out.getvalue()
    assert f"of {V5E_USABLE_GIB:.2f} GiB HBM usable (" in printed, printed
    assert "; hardware.hbm_gib_per_device)" in printed, printed
    if fits:
        assert f"fits: {train_gib:.2f} of {V5E_USABLE_GIB:.2f} GiB per chip" in printed
    else:
        [message] = capsys.readouterr().err.strip().splitlines()
        assert f"more than the {V5E_USABLE_GIB:.2f} GiB of a TPU v5 lite" in message, message
