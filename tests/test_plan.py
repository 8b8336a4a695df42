"""`flaxlm-plan`: a run compiled for its hardware without running it, through the functions
training uses: the abstract train state carries training's shardings, the real train and eval
steps compile for a TPU slice on this CPU (XLA's TPU compiler from libtpu), and the figures
the plan prints follow from them."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import optax
import pytest
from conftest import REPO, TINY, compose, user_env
from omegaconf import OmegaConf

from flaxlm import aot
from flaxlm.cli import plan as plan_cli
from flaxlm.config import MeshConfig
from flaxlm.errors import FlaxlmError
from flaxlm.hardware_peak import known_peak_tflops
from flaxlm.models import attention
from flaxlm.parallel import (
    accelerator_of,
    configure_platform,
    make_mesh,
    place_state,
    run_accelerator,
    target_devices,
)
from flaxlm.training.optimizer import make_optimizer, make_schedule
from flaxlm.training.step import create_state

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def needs_libtpu(test):
    """Compiles for a TPU slice: skipped, with the reason, only where libtpu is missing."""
    skip = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (the `tpu` "
                              "extra, which `make test` installs): no TPU compiler")
    return pytest.mark.libtpu(skip(test))


# TINY's model on a 4-chip TPU v4 slice (one host), 2 rows of 64 tokens per chip.
SMALL = [o for o in TINY if not o.startswith("hardware=")] + [
    "hardware=tpu-v4-8", "task.max_seq_length=64"]
LLAMA = ["model=llama-tiny", "model.num_kv_heads=2", "model.mlp_size=192"]
# Without dropout, whose random bits XLA counts as FLOPs (threefry's integer arithmetic) and
# the analytic count does not.
GPT2 = ["model.hidden_dropout=0", "model.embedding_dropout=0", "model.attention_dropout=0"]
MESHES = {"data": ["hardware.mesh.data=4"],
          "fsdp": ["hardware.mesh.data=1", "hardware.mesh.fsdp=4"],
          "tensor": ["hardware.mesh.data=2", "hardware.mesh.tensor=2"]}
# Compiled FLOPs per chip against 6·N + 12·L·D·S per token: XLA also counts the softmax,
# the norms, the activations and the optimizer's elementwise work, which the analytic count
# leaves out; at this width they are a few per cent of the matmuls.
FLOPS_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def plans():
    """The plan of each family on each mesh, compiled once for the module."""
    return {(family, mesh): aot.plan(compose([*SMALL, *(LLAMA if family == "llama" else GPT2),
                                              *MESHES[mesh]]))
            for family in ("gpt2", "llama") for mesh in MESHES}


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_the_real_steps_compile_for_a_tpu_slice_with_the_state_donated(plans, family, mesh):
    run = plans[family, mesh]
    assert (run.device_kind, run.num_devices, run.topology) == ("TPU v4", 4, "v4:2x2x1")
    assert run.mesh == {"data": {"data": 4, "fsdp": 1, "tensor": 2}[mesh],
                        "fsdp": 4 if mesh == "fsdp" else 1, "expert": 1, "context": 1,
                        "tensor": 2 if mesh == "tensor" else 1}
    # The compiler's arguments are the plan's state and batch (and the dropout key), laid out
    # in the TPU's tiles (padded: more than their logical bytes at these small shapes); the new
    # state is written over the donated one, so all but the batch and key are aliased.
    assert run.train.argument_bytes >= run.state_bytes + run.batch_bytes
    assert run.train.alias_bytes >= run.state_bytes
    assert run.train.argument_bytes - run.train.alias_bytes < 16 * run.batch_bytes + 2**16
    assert run.train.flops > 0 and run.eval.flops > 0
    assert run.fits and run.peak_bytes < run.hbm_bytes


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_fsdp_holds_exactly_a_quarter_of_the_parameters_per_chip(plans, family):
    """Every parameter here has a dimension of the model's width (64, which 4 divides): each
    chip holds a quarter of each (LOGICAL_AXIS_RULES)."""
    data, fsdp = plans[family, "data"], plans[family, "fsdp"]
    assert fsdp.param_bytes * 4 == data.param_bytes
    assert data.fsdp_state_bytes == fsdp.state_bytes  # the figure the advice quotes
    assert data.param_bytes == data.num_params * 4  # float32, all of them on every chip
    assert fsdp.opt_state_bytes < data.opt_state_bytes / 3


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_the_compiled_flops_agree_with_the_analytic_count(plans, family, mesh):
    run = plans[family, mesh]
    assert run.step_flops == pytest.approx(run.model_flops, rel=FLOPS_TOLERANCE)
    assert 0 < run.mfu <= 1 and run.tokens_per_s > 0


@needs_libtpu
@pytest.mark.slow
def test_the_train_step_with_splash_attention_compiles_for_a_tpu_slice():
    """The real train and eval steps with the splash kernel, run per device under shard_map on
    a data × tensor mesh, lowered to Mosaic (not interpreted) and compiled by XLA's TPU
    compiler; the plan says which attention it compiled."""
    overrides = [*SMALL, *LLAMA, "model.max_positions=128", "task.max_seq_length=128",
                 "task.document_masking=true", "model.attention=splash",
                 "hardware.per_device_batch_size=1", *MESHES["tensor"]]
    planned = aot.plan(compose(overrides))
    assert planned.attention == "attention splash" and planned.train.temp_bytes > 0
    assert "attention splash" in aot.report(planned).splitlines()[0]
    run = aot.abstract_run(compose(overrides))
    assert "tpu_custom_call" in run.steps.train.lower(*run.train_args).as_text()


def test_the_roofline_takes_the_model_s_flops_where_kernels_hide_them_from_the_compiler():
    """A Pallas kernel's FLOPs are missing from the compiled count (megablox's expert matmuls,
    most of an MoE step's): the step still does the model's, so no MFU exceeds 100%."""
    hidden = aot.CompiledStep(compile_s=1.0, argument_bytes=0, output_bytes=0, alias_bytes=0,
                              temp_bytes=0, code_bytes=0, flops=1e9, bytes_accessed=0.0)
    run = aot.RunPlan(model="m", hardware="h", device_kind="TPU v5 lite", num_devices=1,
                      mesh={"data": 1}, topology="v5e:1x1", remat="none", per_device_batch=1,
                      grad_accum_steps=1, global_batch=1, seq_len=1000, num_params=10**6,
                      param_bytes=0, opt_state_bytes=0, batch_bytes=0, train=hidden,
                      eval=hidden, flops_per_token=1e7, hbm_bytes=None, peak_flops=1e14,
                      hbm_bandwidth=None)
    assert run.model_flops == 1e10 > run.step_flops
    assert run.compute_s == pytest.approx(1e-4) and run.mfu == pytest.approx(1.0)
    counted = dataclasses.replace(run, train=dataclasses.replace(hidden, flops=2e10))
    assert counted.compute_s == pytest.approx(2e-4) and counted.mfu == pytest.approx(0.5)


@pytest.mark.slow
def test_gradient_accumulation_counts_its_loop_in_full(plans):
    """cost_analysis counts a loop's body once; the plan multiplies by the micro-batches."""
    one = plans["gpt2", "data"]
    four = aot.plan(compose([*SMALL, *GPT2, "trainer.grad_accum_steps=4"]))
    assert four.tokens_per_step == 4 * one.tokens_per_step
    assert four.step_flops == pytest.approx(4 * one.step_flops, rel=0.05)
    assert four.batch_bytes == 4 * one.batch_bytes


@needs_libtpu
@pytest.mark.slow
def test_a_run_that_does_not_fit_exits_2_naming_what_to_change(plans, monkeypatch, capsys):
    """The plan compiled by the fixture, on a chip of 1 MiB."""
    small_chip = dataclasses.replace(plans["gpt2", "data"], hbm_bytes=2**20)
    monkeypatch.setattr(aot, "plan", lambda cfg, save_to=None: small_chip)
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main(SMALL)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "per chip:" in captured.out  # the plan is printed before the verdict
    [message] = captured.err.strip().splitlines()
    assert message.startswith("flaxlm: error: model=gpt2-tiny does not fit hardware=tpu-v4-8")
    for change in ("hardware.mesh.fsdp=-1", "model.remat=full",
                   "hardware.per_device_batch_size=1 with trainer.grad_accum_steps=2"):
        assert change in message, message


@needs_libtpu
@pytest.mark.slow
def test_a_step_the_tpu_compiler_cannot_fit_exits_2_with_its_figures(capsys):
    """XLA's TPU compiler refuses a program larger than the chip: that refusal is the plan."""
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main([*SMALL, "hardware.per_device_batch_size=131072"])
    assert exit_info.value.code == 2
    [message] = capsys.readouterr().err.strip().splitlines()
    assert message.startswith("flaxlm: error: model=gpt2-tiny does not fit hardware=tpu-v4-8: "
                              "XLA's compiler cannot fit the train step in a TPU v4's memory "
                              "(Ran out of memory on HBM"), message
    assert "hardware.per_device_batch_size=65536 with trainer.grad_accum_steps=2" in message


@pytest.fixture(scope="module")
def cpu_plan(tmp_path_factory):
    """`flaxlm-plan` of TINY on hardware=cpu-8 (its mesh: data=8): what it printed, and its
    JSON figures. Two tests read it: one compile of those steps for the module."""
    path = tmp_path_factory.mktemp("cpu-plan") / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        plan_cli.main([*TINY, "task.max_seq_length=32", "--json", str(path)])
    return out.getvalue(), json.loads(path.read_text())


@pytest.mark.slow
def test_a_cpu_group_is_planned_for_its_own_devices(cpu_plan):
    """No libtpu needed: hardware=cpu-8 compiles for the 8 CPU devices; a CPU's memory is not
    known, so there is no verdict, and no peak, so no roofline."""
    out, run = cpu_plan
    assert "hardware=cpu-8: 8 × cpu (the devices attached)" in out
    assert "roofline estimate     none" in out and "flaxlm: fits" not in out
    assert (run["num_devices"], run["topology"], run["fits"], run["mfu"]) == (8, None, None, None)
    # Unpadded on a CPU: the compiler's arguments are the state, the batch, the key and the
    # optimizer's numbers (4-byte scalars).
    config = OmegaConf.to_object(compose([*TINY, "task.max_seq_length=32"]))
    numbers = make_optimizer(config.optimizer, make_schedule(config.optimizer, 10)).numbers
    assert run["train"]["argument_bytes"] == (run["state_bytes"] + run["batch_bytes"] + 8
                                              + 4 * len(numbers))
    assert run["train"]["alias_bytes"] == run["state_bytes"]


@pytest.mark.slow
def test_under_fsdp_each_device_holds_the_activations_of_its_own_rows(cpu_plan):
    """fsdp is data parallelism for the activations: the hidden states keep their rows split
    over data × fsdp (`parallel.constrain_batch`), so a device's temporaries under fsdp=8 are
    those of data=8 plus at most one gathered copy of the weights, not the whole global
    batch's activations (which made them grow with the number of devices)."""
    _, data = cpu_plan
    assert data["mesh"] == {"data": 8, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    fsdp = aot.plan(compose([*TINY, "task.max_seq_length=32", "hardware.mesh.data=1",
                             "hardware.mesh.fsdp=8"]))
    assert fsdp.param_bytes * 8 == data["param_bytes"]
    for step in ("train", "eval"):
        data_temps, fsdp_temps = data[step]["temp_bytes"], getattr(fsdp, step).temp_bytes
        assert fsdp_temps <= data_temps + data["param_bytes"], (step, data_temps, fsdp_temps)


def test_the_abstract_state_has_the_shardings_training_gives_the_real_one():
    """create_state on an abstract model: ShapeDtypeStructs laid out as place_state lays out
    the arrays."""
    model = aot.abstract_model(OmegaConf.to_object(compose(TINY)))
    mesh = make_mesh(None, MeshConfig(data=2, fsdp=4, tensor=1, expert=1, context=1))
    _, abstract = create_state(model, optax.adamw(1e-3), mesh)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(abstract))
    real = place_state(jax.tree.map(lambda leaf: jax.numpy.zeros(leaf.shape, leaf.dtype),
                                    abstract), mesh)
    for leaf, array in zip(jax.tree.leaves(abstract), jax.tree.leaves(real)):
        assert leaf.sharding == array.sharding


def test_make_mesh_lays_out_the_devices_it_is_given():
    devices = jax.devices()[4:]
    mesh = make_mesh(None, MeshConfig(data=-1, fsdp=2, tensor=1, expert=1, context=1), devices)
    assert list(mesh.devices.flat) == devices and dict(mesh.shape)["data"] == 2
    with pytest.raises(FlaxlmError, match="there are 4 device"):
        make_mesh(8, None, devices)


def test_planning_a_tpu_group_on_a_cpu_does_not_ask_for_a_tpu():
    """Training with hardware=tpu on this CPU is refused; planning it runs JAX on the CPU."""
    hardware = OmegaConf.to_object(compose(SMALL)).hardware
    configure_platform(hardware, compile_only=True)
    with pytest.raises(FlaxlmError, match="asks for platform 'tpu'"):
        configure_platform(hardware)


TPU_PRESETS = sorted(name[:-5] for name in os.listdir(os.path.join(REPO, "conf", "hardware"))
                     if name.startswith("tpu-"))


@needs_libtpu
@pytest.mark.parametrize("preset", TPU_PRESETS)
def test_each_tpu_preset_names_a_slice_libtpu_knows_and_its_chips_peak(preset):
    """A preset's name counts TensorCores (v2-v5p) or chips (v5e, v6e); a megacore chip's two
    cores are one device. Its peak is the one MFU takes for that device (hardware_peak)."""
    hardware = OmegaConf.to_object(compose([f"hardware={preset}"])).hardware
    devices = target_devices(hardware)
    count = int(preset.rsplit("-", 1)[1])
    assert len(devices) == (count // 2 if hardware.topology.chip_config == "megacore" else count)
    assert hardware.num_devices in (None, len(devices))
    assert hardware.peak_tflops_per_device == known_peak_tflops(devices[0].device_kind)
    assert hardware.hbm_gib_per_device > 0 and hardware.hbm_gbps_per_device > 0
    # The chip generation a plan reads from the topology's name, for the attention backend,
    # is that of the chips libtpu compiles for.
    assert run_accelerator(hardware).tpu_generation == accelerator_of(devices[0]).tpu_generation


# One layer of llama-tiny over 128-token sequences (the splash kernel's block: auto takes it
# where it compiles), one row per device: each preset's attention, compiled cheaply.
TINY_LLAMA = [o for o in TINY if not o.startswith("hardware=")] + [
    *LLAMA, "model.num_layers=1", "model.max_positions=128", "task.max_seq_length=128",
    "hardware.per_device_batch_size=1"]
# Mosaic compiles no bfloat16 matmul for these chips (issue 43).
BEFORE_V4 = {"tpu-v2-8": "TPU v2", "tpu-v3-8": "TPU v3"}


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("preset", TPU_PRESETS)
def test_auto_attention_compiles_for_every_tpu_preset(preset):
    """Issue 43: model.attention=auto took the splash kernel on TPU v2 and v3 too, and planning
    for them ended in Mosaic's traceback (E2001, unsupported matmul RHS type bf16). auto takes
    xla there, saying why, and splash on TPU v4 and newer; every preset's steps compile."""
    planned = aot.plan(compose([*TINY_LLAMA, f"hardware={preset}"]))
    if preset in BEFORE_V4:
        assert planned.attention == (
            f"attention xla (auto on {BEFORE_V4[preset]}; the splash kernel does not compile "
            "in bfloat16 before TPU v4)")
    else:
        chip = OmegaConf.to_object(compose([f"hardware={preset}"])).hardware.topology.name
        assert planned.attention == f"attention splash (auto on TPU {chip.split(':')[0]})"
    assert planned.attention in aot.report(planned).splitlines()[0]
    assert planned.train.temp_bytes > 0 and planned.eval.temp_bytes > 0


@needs_libtpu
@pytest.mark.slow
def test_remat_block_runs_the_splash_kernels_forward_once_per_layer():
    """model.remat=block keeps what the splash kernel hands its backward pass (its output and
    softmax statistics): the step compiled for a TPU runs the kernel's forward once per layer,
    as without remat. Issue 44: block recomputed them, running the forward twice, which on a
    v5e is about a tenth of smollm-135m's step."""
    def forward_kernels(remat: str, scan: bool) -> int:
        run = aot.abstract_run(compose([*TINY_LLAMA, "hardware=tpu-v5e-8",
                                        "model.attention=splash", f"model.remat={remat}",
                                        f"model.scan_layers={scan}"]))
        hlo = run.steps.train.lower(*run.train_args).compile().as_text().splitlines()
        return sum("splash_mha_fwd" in line for line in hlo if " custom-call(" in line)

    for scan in (False, True):
        assert forward_kernels("block", scan) == forward_kernels("none", scan) == 1
    assert forward_kernels("dots_with_no_batch_dims_saveable", False) == 2  # the kernel again


@needs_libtpu
@pytest.mark.slow
def test_a_kernel_that_does_not_compile_exits_2_naming_the_backend_and_xla(monkeypatch,
                                                                           capsys):
    """Were a rule missing (here: the splash kernel let onto TPU v3 in bfloat16), Mosaic's
    refusal is one paragraph naming the kernel and model.attention=xla, exit 2, no traceback;
    a splash kernel asked for there is refused before anything compiles."""
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main([*TINY_LLAMA, "hardware=tpu-v3-8", "model.attention=splash"])
    assert exit_info.value.code == 2
    [message] = capsys.readouterr().err.strip().splitlines()
    assert message.startswith("flaxlm: error: model.attention=splash cannot run here: the "
                              "splash kernel does not compile in bfloat16 before TPU v4")
    monkeypatch.setattr(attention, "SPLASH_OLDEST_TPU_IN_HALF_PRECISION", 3)
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main([*TINY_LLAMA, "hardware=tpu-v3-8"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    [message] = captured.err.strip().splitlines()
    assert message.startswith(
        "flaxlm: error: A step did not compile: Mosaic refused the splash attention kernel "
        "(attention splash (auto on TPU v3)): INTERNAL: Mosaic failed to compile TPU kernel"), \
        message
    assert message.endswith("Set model.attention=xla, which compiles on every device (this run "
                            "has model.attention=auto).")
    assert "Traceback" not in captured.err + captured.out


def test_planning_a_tpu_group_without_a_topology_names_the_presets():
    with pytest.raises(FlaxlmError, match="hardware=tpu names none: pick a preset"):
        aot.plan(compose([*SMALL, "hardware=tpu"]))


@needs_libtpu
@pytest.mark.slow
def test_with_libtpu_installed_a_cpu_training_run_never_looks_for_a_tpu(tmp_path):
    """libtpu on a machine without a TPU, and nothing in the environment pinning JAX: a tiny
    `flaxlm-train` run with a CPU hardware group pins JAX's platform before JAX starts, so
    only the CPU backend starts (libtpu would otherwise look for a TPU and say so)."""
    script = textwrap.dedent("""
        import json, sys
        from jax._src import xla_bridge
        from flaxlm.cli.train import main
        sys.argv = ["flaxlm-train", *sys.argv[1:]]
        try:
            main()
        except SystemExit as exit_:
            assert not exit_.code, exit_.code
        print(json.dumps({"backends": sorted(xla_bridge._backends)}))
    """)
    env = user_env("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "ALLOW_MULTIPLE_LIBTPU_LOAD")
    overrides = [*(o for o in TINY if not o.startswith("hardware=")), "hardware=cpu",
                 "hardware.cpu_devices=2", "language.max_train_docs=12",
                 "language.max_eval_docs=2", "samples.prompts=[]", "trainer.max_steps=1",
                 "trainer.eval_before_training=false", f"run_dir={tmp_path / 'run'}"]
    result = subprocess.run([sys.executable, "-c", script, *overrides], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"backends": ["cpu"]}
    assert not re.search(r"libtpu|TPU|backend 'tpu'", result.stderr), result.stderr[-3000:]


@needs_libtpu
@pytest.mark.slow
def test_planning_llama_1b_allocates_no_parameters():
    """llama-1b: 1.24B float32 parameters (4.6 GiB; 13.8 GiB with AdamW's moments), laid out on
    a v5p-8 and its whole train step lowered for them, in a process of its own that peaks far
    below that. (XLA's compile of the lowered step then takes its own memory: about 4 GB and
    several minutes on 2 cores for this unrolled 16-layer step; docs/planning.md.)"""
    script = textwrap.dedent("""
        import json, resource
        from flaxlm import aot
        from flaxlm.cli.plan import compose
        run = aot.abstract_run(compose(["model=llama-1b", "hardware=tpu-v5p-8"]))
        run.steps.train.lower(*run.train_args)
        print(json.dumps({
            "state_bytes": aot.per_device_bytes(run.state),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["state_bytes"] > 13 * 2**30  # what an allocated state would take
    # The process's own imports and libtpu take 2 to 2.6 GB; the parameters alone would be 4.6.
    assert measured["peak_rss_bytes"] < measured["state_bytes"] / 4, measured


# One row of 128 tokens per chip: the verdicts turn on the state (89.75 GiB unsplit, no room
# for its gradients), as at docs/planning.md's 8192, and a short row keeps the fitting step's
# compile short.
LLAMA3_8B_ON_V5P_8 = ["model=llama3-8b", "hardware=tpu-v5p-8", "task.max_seq_length=128",
                      "hardware.per_device_batch_size=1", "model.remat=full",
                      "model.scan_layers=true"]


@pytest.mark.slow  # several seconds: make test runs it
@needs_libtpu
def test_llama3_8b_without_fsdp_does_not_fit_a_v5p_8_and_the_plan_names_fsdp(capsys):
    """Llama 3 8B's float32 parameters and AdamW moments (89.75 GiB) do not leave a v5p chip
    (95 GiB) room for a step, even at 128 tokens: XLA's TPU compiler refuses it, and the plan names
    fsdp over the 4 chips as the fix. (Scanned layers: one compiled block, a compile of
    seconds, where the 32 blocks unrolled take minutes; docs/planning.md has both.)"""
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main([*LLAMA3_8B_ON_V5P_8, "hardware.mesh.data=-1", "hardware.mesh.fsdp=1"])
    assert exit_info.value.code == 2
    [message] = capsys.readouterr().err.strip().splitlines()
    assert message.startswith("flaxlm: error: model=llama3-8b does not fit hardware=tpu-v5p-8: "
                              "XLA's compiler cannot fit the train step"), message
    assert ("Try hardware.mesh.data=1 hardware.mesh.fsdp=-1 (parameters and optimizer state "
            "split over all 4 chips: 89.75 GiB → 22.44 GiB per chip)") in message, message


@needs_libtpu
@pytest.mark.slow
def test_llama3_8b_with_fsdp_and_full_remat_fits_a_v5p_8(capsys):
    plan_cli.main([*LLAMA3_8B_ON_V5P_8, "hardware.mesh.data=1", "hardware.mesh.fsdp=-1"])
    out = capsys.readouterr().out
    assert re.search(r"parameters\s+7\.48 GiB", out), out
    assert re.search(r"optimizer state\s+14\.96 GiB", out), out
    verdict = re.search(r"flaxlm: fits: ([\d.]+) of 95\.74 GiB per chip", out)
    assert verdict and 22.44 < float(verdict.group(1)) < 60, out
