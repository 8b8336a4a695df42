"""The accelerator benchmark's search for the largest batch that fits, how it tells running out
of memory from other failures, and one whole run of the script on the CPU."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import accelerator  # noqa: E402
import harness  # noqa: E402

SCRIPT = os.path.join(REPO, "benchmarks", "accelerator.py")


def _fake(outcomes: dict[int, str]):
    """An `attempt` that runs every batch not in `outcomes`; "oom" or "error" for the rest.
    It records the batches tried."""
    tried = []

    def attempt(batch):
        tried.append(batch)
        outcome = outcomes.get(batch)
        if outcome is None:
            return accelerator.Attempt(batch, result={"seconds_per_step": 1.0})
        return accelerator.Attempt(batch, failure=f"exit 1: {outcome} at {batch}",
                                   out_of_memory=outcome == "oom")

    return attempt, tried


def test_doubling_stops_at_the_first_batch_out_of_memory_and_keeps_the_one_before():
    attempt, tried = _fake({8: "oom", 16: "oom"})
    search = accelerator.largest_batch(attempt, start=2, unit=2, cap=1024)
    assert tried == [2, 4, 8]
    assert search.batch == 4
    assert search.stopped == "batch 8 ran out of memory: exit 1: oom at 8"


def test_the_cap_is_never_exceeded_and_is_tried_itself():
    attempt, tried = _fake({})
    search = accelerator.largest_batch(attempt, start=2, unit=2, cap=11)  # 11 → 10 rows
    assert tried == [2, 4, 8, 10]
    assert search.batch == 10 and "reached the cap" in search.stopped
    attempt, tried = _fake({})
    assert accelerator.largest_batch(attempt, start=64, unit=2, cap=4).batch == 4
    assert tried == [4]


def test_a_start_that_does_not_fit_halves_down_to_one_row_per_device():
    attempt, tried = _fake({16: "oom", 8: "oom"})
    search = accelerator.largest_batch(attempt, start=16, unit=2, cap=1024)
    assert tried == [16, 8, 4]  # and never 8 again: a larger batch already failed
    assert search.batch == 4 and search.stopped == "a larger batch ran out of memory"
    attempt, tried = _fake({4: "oom", 2: "oom"})
    search = accelerator.largest_batch(attempt, start=4, unit=2, cap=1024)
    assert tried == [4, 2] and search.batch is None
    assert search.stopped.startswith("batch 2 ran out of memory")


def test_a_failure_not_about_memory_is_reported_as_one_and_never_halved_past():
    attempt, tried = _fake({8: "error"})
    search = accelerator.largest_batch(attempt, start=2, unit=2, cap=1024)
    assert tried == [2, 4, 8] and search.batch == 4
    assert search.stopped == "batch 8 failed, not for memory: exit 1: error at 8"
    attempt, tried = _fake({16: "error"})
    search = accelerator.largest_batch(attempt, start=16, unit=2, cap=1024)
    assert tried == [16] and search.batch is None
    assert "failed, not for memory" in search.stopped


def test_a_cap_below_one_row_per_device_is_one_clear_error():
    attempt, tried = _fake({})
    with pytest.raises(SystemExit, match="--max-batch 4 is less than one row per device"):
        accelerator.largest_batch(attempt, start=8, unit=8, cap=4)
    assert tried == []


def _python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", f"import sys; sys.path.insert(0, {os.path.dirname(SCRIPT)!r});"
                                  f" import harness; {code}")


TPU_OUT_OF_MEMORY = (
    "Traceback (most recent call last):\n  ...\njaxlib.XlaRuntimeError: RESOURCE_EXHAUSTED: "
    "XLA:TPU compile permanent error. Ran out of memory in memory space hbm.\n\n"
    "Total hbm usage >= 17.2G:\n    reserved 530.0M\n    program 16.7G"
)


@pytest.mark.parametrize("code, out_of_memory, named", [
    (f"sys.stderr.write({TPU_OUT_OF_MEMORY!r}); sys.exit(1)", True, "RESOURCE_EXHAUSTED"),
    ("raise RuntimeError('CUDA_ERROR_OUT_OF_MEMORY: out of memory')", True, "OUT_OF_MEMORY"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", True, "SIGKILL"),
    ("raise ValueError('a shape does not divide')", False, "ValueError: a shape does not"),
    ("harness.emit(skip='no result')", False, "exit 0"),
])
def test_out_of_memory_is_told_from_the_whole_stderr(code, out_of_memory, named):
    tried = accelerator.run_attempt(8, _python(code), timeout=60)
    assert tried.result is None and tried.batch == 8
    assert tried.out_of_memory == out_of_memory
    assert named in tried.failure


def test_a_worker_that_reports_a_step_time_fits():
    tried = accelerator.run_attempt(8, _python("harness.emit(0.25, devices='2 × cpu')"), 60)
    assert tried.failure is None and tried.result["seconds_per_step"] == 0.25


def test_the_row_gives_step_time_mfu_against_the_known_peak_and_the_memory_peak():
    info = {"flops_per_token": 6e8, "peak_flops": 1e15, "num_params": 124_439_808,
            "devices": "1 × NVIDIA H200", "peak_bytes_in_use": 3 * 2**30,
            "bytes_limit": 96 * 2**30, "step_bytes": 5 * 2**29}
    variant = accelerator.Variant("gpt2", 1024, "cudnn")
    search = accelerator.Search(64, "batch 128 ran out of memory: exit 1: RESOURCE_EXHAUSTED")
    cells, note = accelerator.table_row(variant, search, [8e5, 1e6, 9e5], info, None)
    assert cells == ["gpt2", "124.4M", "1024", "cudnn", "64", "1 × NVIDIA H200", "72.8",
                     "900,000", "800,000–1,000,000", "54.0%", "3.0 of 96.0 GiB", "2.5 GiB"]
    assert note == f"gpt2/1024/cudnn: batch 64; the search stopped: {search.stopped}"
    record = accelerator.json_row(variant, search, [8e5, 1e6, 9e5], info, None)
    assert record["median_tokens_per_s"] == 9e5 and record["mfu"] == 0.54
    assert record["peak_bytes_in_use"] == 3 * 2**30
    info.update(peak_flops=None, peak_bytes_in_use=None, step_bytes=None)
    cells, _ = accelerator.table_row(accelerator.Variant("gpt2", 1024), search, [1e6], info, None)
    assert cells[3] == "(model's)" and cells[9] == cells[10] == cells[11] == "—"
    cells, note = accelerator.table_row(variant, accelerator.Search(None, "why"), [], None, None)
    assert cells[7] == "no result (below)" and note == "gpt2/1024/cudnn: why"


def test_longer_sequences_start_from_the_same_tokens_per_step():
    assert accelerator.same_tokens(8, 2048, 4096, unit=1) == 4
    assert accelerator.same_tokens(8, 2048, 2048, unit=2) == 8
    assert accelerator.same_tokens(2, 1024, 8192, unit=2) == 2  # never below a row per device


@pytest.mark.slow
def test_the_script_on_a_cpu_prints_tokens_per_second_and_no_mfu():
    """The whole script with a tiny GPT-2 on 2 CPU devices: the cpu group's start (4 rows per
    device) capped at batch 4, which runs and is timed."""
    command = [sys.executable, SCRIPT, "--models", "gpt2-tiny", "--seq", "32",
               "--max-batch", "4", "--rounds", "1", "--warmup", "1",
               "--steps", "2", "hardware.cpu_devices=2", "model.num_layers=2",
               "model.hidden_size=64", "model.num_heads=2", "model.vocab_size=512"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "CPU'S FIGURES" in out and "no MFU is printed" in out
    assert harness.machine_description().splitlines()[0] in out
    assert "gpt2-tiny/32: batch 4 runs" in out and "batch 2 " not in out
    row = next(line for line in out.splitlines() if line.startswith("| gpt2-tiny"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    model, params, seq, attention, batch, devices, step_ms, tokens, spread, mfu, _, step = cells
    assert (seq, attention, batch, devices, mfu) == ("32", "(model's)", "4", "2 × cpu", "—")
    assert params.endswith("M") and float(tokens.replace(",", "")) > 0
    assert step.endswith(" GiB")
    assert "the search stopped: reached the cap, --max-batch 4" in out
