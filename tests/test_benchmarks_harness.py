"""MFU only against a known peak, and the benchmark harness's own logic: alternating rounds in
separate processes, medians, spreads and ratios."""

import os
import sys
import types

import jax
import pytest
from conftest import REPO, compose, config_node
from omegaconf import OmegaConf

from flaxlm.errors import FlaxlmError
from flaxlm.hardware_peak import known_peak_tflops, peak_flops
from flaxlm.parallel import make_mesh
from flaxlm.tasks.base import throughput
from flaxlm.training.loop import Throughput, _Window

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import harness  # noqa: E402


@pytest.mark.parametrize("kind", ["TPU v4", "TPU v5 lite", "NVIDIA H100 80GB HBM3",
                                  "NVIDIA A100-SXM4-80GB"])
def test_a_known_device_kind_is_matched_whatever_its_case_and_spacing(kind):
    peak = known_peak_tflops(kind)
    assert peak is not None and peak > 0
    assert known_peak_tflops(kind.upper()) == known_peak_tflops(f" {kind.lower()} ") == peak
    assert known_peak_tflops(kind.replace(" ", "  ")) == peak


def test_the_most_specific_gpu_name_wins():
    """An H100 on PCIe runs slower than the SXM part whose name it contains."""
    assert known_peak_tflops("NVIDIA H100 PCIe") < known_peak_tflops("NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("kind", ["cpu", "TPU v4 lite", "Tesla T4", ""])
def test_an_unknown_device_kind_has_no_peak(kind):
    """No guessed figure: MFU against a made-up peak would be a made-up number."""
    assert known_peak_tflops(kind) is None


def test_peak_is_the_configured_figure_or_every_device_known():
    assert peak_flops(0.5, ["cpu", "cpu"]) == 1e12
    assert peak_flops(None, ["NVIDIA H100 80GB HBM3"] * 2) == 2 * 989e12
    assert peak_flops(None, ["cpu"] * 8) is None
    assert peak_flops(None, ["TPU v4", "cpu"]) is None


def _job(**hardware):
    mesh = make_mesh(2)
    config = types.SimpleNamespace(hardware=config_node("hardware", **hardware))
    return types.SimpleNamespace(config=config, mesh=mesh)


def test_no_peak_on_cpu_unless_configured(capsys):
    assert jax.devices()[0].device_kind == "cpu"
    assert throughput(_job(), 100, 10.0).peak_flops is None
    assert "no MFU logged" in capsys.readouterr().out
    assert throughput(_job(peak_tflops_per_device=0.5), 100, 10.0).peak_flops == 1e12
    with pytest.raises(FlaxlmError, match="peak_tflops_per_device=0"):
        throughput(_job(peak_tflops_per_device=0.0), 100, 10.0)


# A TPU slice's preset (tpu-v3-8, ...) names its chips' peak, for flaxlm-plan, which has no chip
# to ask: test_plan.py checks that it is the table's.
@pytest.mark.parametrize("group", ["cpu", "cpu-8", "gpu", "tpu"])
def test_shipped_hardware_groups_take_the_peak_from_the_table(group):
    config = compose([f"hardware={group}"])
    assert OmegaConf.select(config, "hardware.peak_tflops_per_device") is None


def _window_record(peak_flops):
    window = _Window(Throughput(tokens_per_step=1000, flops_per_token=6.0, peak_flops=peak_flops))
    metrics = {"loss": 2.0, "grad_norm": 1.0, "learning_rate": 0.1}
    window.add(1, metrics)
    window.add(2, metrics)
    return window.flush(epoch=0.5)


def test_mfu_is_logged_only_against_a_known_peak():
    record = _window_record(None)
    assert record["train/tokens_per_second"] > 0
    assert "train/mfu" not in record
    record = _window_record(1e6)
    assert record["train/mfu"] == pytest.approx(record["train/tokens_per_second"] * 6.0 / 1e6)


def test_rounds_rotate_the_order():
    names = ["a", "b", "c"]
    assert [harness.round_order(names, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_summary_is_median_spread_and_ratio_of_medians():
    rates = {"ours": [10.0, 30.0, 20.0], "peer": [5.0, 100.0, 40.0, 50.0], "gone": []}
    rows = {row.name: row for row in harness.summarise(rates, {"gone": "skipped: no"}, "ours")}
    assert rows["ours"].median == 20.0 and rows["ours"].ratio == 1.0
    assert rows["peer"].median == 45.0 and rows["peer"].ratio == pytest.approx(2.25)
    assert rows["gone"].median is None and rows["gone"].note == "skipped: no"
    table = harness.format_table(list(rows.values()), "tokens/s", "ours")
    assert "5.0–100.0" in table and "2.25×" in table and "MFU" not in table
    assert "gone: skipped: no" in table
    assert "50.0%" in harness.format_table([rows["ours"]], "tokens/s", "ours",
                                           mfu=lambda rate: rate / 40)


def _python_worker(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", f"import sys; sys.path.insert(0, {harness.__file__!r}"
                                  f".rsplit('/', 1)[0]); import harness; {code}")


def test_each_contender_runs_in_its_own_process_every_round():
    contenders = [
        harness.Contender("fast", _python_worker("harness.emit(0.5, pid=__import__('os')"
                                                 ".getpid())")),
        harness.Contender("skips", _python_worker("harness.emit(skip='no compiler')")),
        harness.Contender("breaks", _python_worker("raise SystemExit('broken here')")),
        harness.Contender("absent", (), skip_reason="not installed"),
    ]
    rates, notes, info = harness.run_rounds(contenders, rounds=2, units_per_step=100)
    assert rates["fast"] == [200.0, 200.0]
    assert rates["skips"] == rates["breaks"] == rates["absent"] == []
    assert notes == {"skips": "skipped: no compiler", "breaks": "failed (exit 1): broken here",
                     "absent": "skipped: not installed"}
    assert info["fast"]["pid"] != os.getpid()


def test_cpu_description_names_the_model_and_matmul_flags():
    cpuinfo = ("processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu sse avx2 fma avx512f "
               "avx512_bf16\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu\n")
    description = harness.cpu_description(cpuinfo)
    assert description.startswith("AMD EPYC 9654, ")
    assert description.endswith("flags: avx2 fma avx512f avx512_bf16")


@pytest.mark.slow
def test_profile_traces_a_jax_workers_steps_and_the_summary_names_its_operations(tmp_path):
    """`--profile DIR`: each JAX worker traces steps after its timed ones into
    DIR/<contender>/round-<n>; profile_summary prints time per step by operation."""
    step = ("import jax, jax.numpy as jnp; f = jax.jit(lambda x: jnp.tanh(x @ x)); "
            "x = jnp.ones((64, 64)); "
            "harness.emit(harness.time_steps(lambda: f(x).block_until_ready(), 1, 2))")
    contenders = [harness.Contender("jaxy", _python_worker(step))]
    rates, notes, _ = harness.run_rounds(contenders, rounds=1, units_per_step=1,
                                         profile=str(tmp_path))
    assert len(rates["jaxy"]) == 1 and not notes
    import profile_summary

    trace_dir = tmp_path / "jaxy" / "round-1"
    events, _ = profile_summary.load_events(str(trace_dir))
    assert events
    text = profile_summary.summarise(str(trace_dir), top=5)
    assert "ms of wall time per step" in text
    assert any(name in text for name in ("fusion", "dot", "tanh")), text


# A TPU trace and the step's HLO, cut down to what profile_summary reads: the device's "XLA
# Ops" line (the host's threads only launch them) and the fusions' bodies.
TPU_HLO = """HloModule jit_step

%fused_computation.1 (param_0: bf16[8,576], param_1: bf16[576,49152]) -> f32[8,49152] {
  %param_0 = bf16[8,576]{1,0} parameter(0)
  %param_1 = bf16[576,49152]{1,0} parameter(1)
  ROOT %convolution.1 = f32[8,49152]{1,0} convolution(%param_0, %param_1), dim_labels=bf_io->bf
}

%fused_computation.3 (param_0: f32[576]) -> f32[576] {
  %param_0 = f32[576]{0} parameter(0)
  ROOT %multiply.3 = f32[576]{0} multiply(%param_0, %param_0)
}

ENTRY %main.5 (Arg_0: bf16[8,576]) -> f32[] {
  %fusion.1 = f32[8,49152]{1,0} fusion(%a), calls=%fused_computation.1, metadata={op_name="jvp()"}
  %custom-call.2 = bf16[4,9,2048,64]{3,2,1,0} custom-call(%q), custom_call_target="tpu_custom_call"
  %fusion.3 = f32[576]{0} fusion(%x), calls=%fused_computation.3, metadata={op_name="transpose(j)"}
  ROOT %fusion.4 = f32[576]{0} fusion(%x), calls=%fused_computation.3, metadata={op_name="mul"}
}
"""


def test_the_summary_reads_a_tpus_operations_and_puts_each_in_its_category(tmp_path):
    import gzip
    import json

    import profile_summary

    def op(name, ts, dur, pid=2, tid=7):
        return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}

    metadata = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
                {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:TPU:0"}},
                {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name",
                 "args": {"name": "XLA Ops"}},
                {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name",
                 "args": {"name": "XLA Modules"}}]
    steps = profile_summary.harness.PROFILED_STEPS
    events = [op("fusion.1", 0, 3000 * steps), op("custom-call.2", 3000 * steps, 5000 * steps),
              op("fusion.3", 8000 * steps, 1000 * steps), op("fusion.4", 9000 * steps, 500 * steps),
              # A while loop around its body's operation, on the same line: 200 µs its own.
              op("while.5", 9500 * steps, 700 * steps), op("fusion.3", 9600 * steps, 500 * steps),
              op("jit_step", 0, 99000 * steps, tid=8),  # the module: not an operation
              op("fusion.1", 0, 77000 * steps, pid=1, tid=3)]  # a host thread
    trace_dir = tmp_path / "round-1"
    (trace_dir / "plugins" / "profile" / "run").mkdir(parents=True)
    with gzip.open(trace_dir / "plugins" / "profile" / "run" / "t.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": metadata + events}, f)
    (trace_dir / "step.hlo.txt").write_text(TPU_HLO)

    text = profile_summary.summarise(str(trace_dir), top=5, vocab=49152)
    shares = {line.split("%", 1)[1].strip(): float(line.split()[0])
              for line in text.splitlines() if "%  " in line}
    assert shares == {"attention kernel": 5.0, "matmul: vocabulary": 3.0,
                      "elementwise, reductions (backward)": 1.5,
                      "elementwise, reductions (outside the gradient: optimizer, metrics)": 0.7}
    # Summed, the operations' own times are the line's wall time: nothing counted twice.
    assert "10 ms of wall time per step" in text and "summed over threads: 10 ms" in text, text
