"""Several hosts, simulated: two real `flaxlm-train` processes of 4 CPU devices each, joined by
jax.distributed on localhost (explicit mode, gloo collectives), train like one process with
8 devices: they share one run directory in which only process 0 writes; SIGTERM stops both at
one step with a checkpoint and exit 75, and resumed they end where one process ends; a process
killed with SIGKILL makes the other stop with flaxlm's error and exit code instead of hanging or
aborting, and so does a process that finds no other at the start. Below them, the settings'
checks and the per-process loader positions, in this process."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import TINY, cache_with_builtin, trained_run
from flax import nnx
from numerics import assert_close, magnitude, transformer_depth
from wandb_records import of_type, read_wandb_records

from flaxlm import distributed
from flaxlm.config import DistributedConfig, HardwareConfig
from flaxlm.errors import PEER_EXIT_CODE, FlaxlmError
from flaxlm.parallel import is_abstract
from flaxlm.training.checkpoint.manager import restore_params
from flaxlm.training.checkpoint.resume import PER_PROCESS_KEY, own_loader_state
from flaxlm.training.stop import PREEMPTED_EXIT_CODE

# 2 epochs of 6 steps; a checkpoint every 4 steps and at each epoch end. SGD with momentum (its
# state resumed too), whose update is linear in the gradient: Adam's is about sign(g), which
# flips for a gradient near eps (the key projection's bias has a gradient of exactly 0 in exact
# arithmetic, rounding noise in float32) when the devices' shares are summed in another order.
RUN = [*TINY, "language.max_train_docs=8", "language.max_eval_docs=2", "trainer.num_epochs=2",
       "trainer.log_every_steps=2", "checkpoint.every_steps=4", "optimizer=sgd",
       "optimizer.lr=1e-2", "optimizer.warmup_steps=2"]
# 8 devices × 2 rows × 64 positions: a step's targets, the longest sum in its loss and gradients.
TOKENS = 8 * 2 * 64
NUM_LAYERS = 2  # TINY's
TIMEOUT_S = 60  # hardware.distributed.timeout_s of the runs that should succeed
VOLATILE = {"time", "train/tokens_per_second", "train/mfu"}  # wall-clock dependent
# What a process may take beyond its hardware.distributed.timeout_s waits to start (Python,
# Hydra, JAX) and to stop, on a loaded machine.
SLACK_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def two_hosts(port: int, timeout_s: int = TIMEOUT_S) -> list[list[str]]:
    """The two processes' `flaxlm-train` commands: the same, but for the process id."""
    shared = [sys.executable, "-m", "flaxlm.cli.train", *RUN, "hardware.cpu_devices=4",
              "hardware.num_devices=null", "hardware.distributed.mode=explicit",
              f"hardware.distributed.coordinator_address=localhost:{port}",
              "hardware.distributed.num_processes=2",
              f"hardware.distributed.timeout_s={timeout_s}"]
    return [[*shared, f"hardware.distributed.process_id={i}"] for i in range(2)]


def start(commands, extra, env) -> list[subprocess.Popen]:
    return [subprocess.Popen([*command, *extra], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for command in commands]


def finish(processes, timeout=600) -> list[str]:
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return outputs


def metric_lines(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in VOLATILE}
                for line in f if line.endswith("\n")]


def assert_close_metrics(got: list[dict], expected: list[dict]) -> None:
    """Metrics of the same run on 2 processes and on 1: the same sums, the devices' shares added
    in another order; a step's after that many steps forward and back and its own (an
    evaluation's: forward only, counted as one more)."""
    assert [sorted(r) for r in got] == [sorted(r) for r in expected]
    for record, reference in zip(got, expected):
        for key, value in reference.items():
            if isinstance(value, float) and key != "epoch":  # epoch: a ratio of counts, in Python
                depth = (reference["step"] + 1) * transformer_depth(NUM_LAYERS, backward=True)
                # exp makes the loss's absolute error perplexity's relative one: × the loss
                slope = max(1.0, np.log(value)) if key == "eval/perplexity" else 1.0
                assert np.isfinite(value), key  # assert_close takes NaN for NaN
                assert_close(record[key], value, terms=TOKENS, depth=depth, amplification=slope,
                             err_msg=f"step {reference['step']}: {key}")
            else:
                assert record[key] == value, key


def assert_close_params(run_dir, reference_dir, start) -> None:
    """Each parameter is its start plus lr × its gradients (with momentum): the steps taken, not
    the parameter's size, carry the gradients' error."""
    params, _, step = restore_params(str(run_dir))
    expected, _, expected_step = restore_params(str(reference_dir))
    assert step == expected_step
    leaves, expected_leaves, start_leaves = flat(params), flat(expected), flat(start)
    assert [path for path, _ in leaves] == [path for path, _ in expected_leaves] == [
        path for path, _ in start_leaves]
    depth = step * transformer_depth(NUM_LAYERS, backward=True)
    for (path, leaf), (_, other), (_, first) in zip(leaves, expected_leaves, start_leaves):
        assert_close(leaf, other, terms=TOKENS, depth=depth, scale=magnitude(other - first),
                     err_msg=str(path))


def flat(tree, path=()) -> list:
    if isinstance(tree, dict):
        return [item for key in sorted(tree, key=str) for item in flat(tree[key], (*path, key))]
    return [(path, tree)]


def wait_for_step(run_dir, processes, step: int, timeout=300) -> None:
    deadline = time.monotonic() + timeout
    while not any(r.get("step", 0) >= step and "train/loss" in r for r in metric_lines(run_dir)):
        if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            outputs = finish(processes, timeout=30)
            pytest.fail(f"a process ended before step {step}:\n" + "\n".join(
                o[-2000:] for o in outputs))
        time.sleep(0.2)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same run on one process with 8 devices: its directory, and the parameters it
    started from (as the job made its train state)."""
    from flaxlm.tasks import base

    started = []

    def create_state(*args, **kwargs):
        graphdef, state = make_state(*args, **kwargs)
        if not is_abstract(state.params):  # not the shapes the steps are compiled ahead from
            started.append(jax.device_get(nnx.to_pure_dict(state.params)))
        return graphdef, state

    make_state = base.create_state
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(base, "create_state", create_state)
        run_dir = trained_run(tmp_path_factory, "one-process", RUN)
    [start] = started
    return run_dir, start


def the_run_dir(outputs_dir, processes, timeout=300):
    """The one run directory under `outputs_dir` that metrics are written to."""
    deadline = time.monotonic() + timeout
    while not (found := sorted(outputs_dir.glob("*/metrics.jsonl"))):
        if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            outputs = finish(processes, timeout=30)
            pytest.fail("no run wrote metrics:\n" + "\n".join(o[-2000:] for o in outputs))
        time.sleep(0.2)
    return found[0].parent


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_stopped_by_sigterm_and_resumed_train_like_one_with_eight_devices(
        tmp_path, one_process):
    """The two processes share process 0's run directory, process 0 prepares the data while
    process 1 waits, SIGTERM stops both after one step with a checkpoint and exit 75, and
    resumed in that directory they end where one process with 8 devices does, with one W&B
    run continued."""
    outputs_dir = tmp_path / "outputs"
    # Each host's Hydra picks its own timestamp, as on a real cluster; a fresh cache makes
    # process 0 train the tokenizer and pack the blocks while process 1 waits.
    cache = cache_with_builtin(tmp_path / "cache")
    env = {**os.environ, "FLAXLM_CACHE": str(cache), "WANDB_MODE": "offline"}
    port = free_port()
    processes = start(two_hosts(port),
                      [f"hydra.run.dir={outputs_dir}/" + "${now:%H-%M-%S_%f}", "logger=wandb"],
                      env)
    run_dir = the_run_dir(outputs_dir, processes)
    wait_for_step(run_dir, processes, 2)
    for process in processes:
        process.send_signal(signal.SIGTERM)
    outputs = finish(processes)
    for process, output in zip(processes, outputs):
        assert process.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    steps = [int(line.split("stopped by SIGTERM after step ")[1].split(";")[0])
             for output in outputs for line in output.splitlines() if "stopped by SIGTERM" in line]
    assert len(steps) == 2 and steps[0] == steps[1] < 12  # one step, saved by both
    assert (run_dir / "checkpoints" / str(steps[0])).is_dir()
    assert os.listdir(outputs_dir) == [run_dir.name]  # process 1's own was removed
    assert "process 1 of 2 joined" in outputs[1]
    # process 0 packed the blocks; process 1 waited, then read its file
    assert "tokenize train" in outputs[0] and "tokenize train" not in outputs[1]
    assert "train (epoch" in outputs[0] and "train (epoch" not in outputs[1]  # progress bars

    again = start(two_hosts(port), [f"hydra.run.dir={run_dir}", "logger=wandb"], env)
    outputs = finish(again)
    for process, output in zip(again, outputs):
        assert process.returncode == 0, output[-3000:]
        assert f"from its checkpoint at step {steps[0]}" in output
    lines = metric_lines(run_dir)
    assert len({json.dumps(line, sort_keys=True) for line in lines}) == len(lines)
    reference_dir, initial = one_process
    assert_close_metrics(lines, metric_lines(reference_dir))
    assert_close_params(run_dir, reference_dir, initial)
    assert (run_dir / "model" / "model.safetensors").exists()
    with open(run_dir / "checkpoints" / "12" / "loader" / "metadata") as f:
        loader = json.load(f)
    assert sorted(loader["per_process"]) == ["0", "1"]
    # One W&B run, written by process 0 and continued: both starts logged under the id kept in
    # the run dir, the first ending preempted.
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    offline_runs = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*")))
    assert len(offline_runs) == 2 and all(d.endswith(run_id) for d in offline_runs)
    exit_codes = []
    for offline_run in offline_runs:
        [log] = glob.glob(os.path.join(offline_run, "*.wandb"))
        exit_codes += [e.exit_code for e in of_type(read_wandb_records(Path(log)), "exit")]
    assert exit_codes == [PREEMPTED_EXIT_CODE, 0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_process_makes_the_other_stop_with_an_error_not_hang(tmp_path):
    run_dir = tmp_path / "run"
    timeout_s = 15
    processes = start(two_hosts(free_port(), timeout_s), [f"hydra.run.dir={run_dir}"],
                      dict(os.environ))
    wait_for_step(run_dir, processes, 2)
    processes[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    # The survivor learns of it from a failed collective, a wait of timeout_s in vain, or the
    # coordination service's heartbeats (missed for timeout_s, checked every timeout_s).
    bound_s = 3 * timeout_s + SLACK_S
    [output] = finish(processes[:1], timeout=bound_s)
    finish(processes[1:])
    assert time.monotonic() - killed_at < bound_s
    # flaxlm's paragraph and exit code, not JAX's native abort (134)
    assert processes[0].returncode == PEER_EXIT_CODE, output[-3000:]
    error = output[output.index("flaxlm: error: "):]
    assert ("lost contact with another process" in error
            or "a process stopped or is stuck" in error), output[-3000:]
    assert "Rerun the same command on every host" in error or "timeout_s" in error


# Why each process of the run, started alone, fails to join.
ALONE = {
    # Nobody listens at the coordinator: checked before JAX's client starts.
    1: "nothing answers at localhost:",
    # The other process never starts: JAX's client aborts, the supervising process says so.
    0: "a process did not come in time, and JAX's coordination client ended",
}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_process_alone_stops_with_flaxlms_error_within_the_timeout(tmp_path):
    """Each process id alone, both started at once (they mostly wait), each at a coordinator
    port of its own."""
    timeout_s = 3
    ports = {}
    while len(set(ports.values())) < len(ALONE):  # process 1 must not find process 0's
        ports = {process_id: free_port() for process_id in ALONE}
    started = time.monotonic()
    processes = {
        process_id: subprocess.Popen(
            [*two_hosts(ports[process_id], timeout_s)[process_id],
             f"hydra.run.dir={tmp_path}/run-{process_id}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for process_id in ALONE}
    try:
        for process_id, reason in ALONE.items():
            process = processes[process_id]
            stderr = process.communicate(timeout=2 * timeout_s + SLACK_S)[1]
            assert time.monotonic() - started < 2 * timeout_s + SLACK_S
            assert process.returncode == PEER_EXIT_CODE, stderr[-3000:]
            error = stderr[stderr.index("flaxlm: error: "):]
            assert ("hardware.distributed.mode=explicit could not join the run's processes "
                    "(coordinator localhost:") in error
            assert f"within hardware.distributed.timeout_s={timeout_s}s: {reason}" in error
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()


MESSAGES_SCRIPT = """
import sys, time
from flaxlm import distributed
from flaxlm.config import DistributedConfig, HardwareConfig
from flaxlm.errors import PEER_EXIT_CODE, FlaxlmError
from flaxlm.parallel import configure_platform
pid, port = int(sys.argv[1]), sys.argv[2]
configure_platform(HardwareConfig(
    name="cpu", platform="cpu", cpu_devices=1,
    distributed=DistributedConfig("explicit", f"localhost:{port}", 2, pid, timeout_s=3)))
assert distributed.from_primary("deciding", lambda: ["run", pid]) == ["run", 0]
assert distributed.all_gather("gathering", pid * 10) == [0, 10]
distributed.primary_first("building a cache", lambda: pid == 0 and time.sleep(4))
def fail():
    raise FlaxlmError("the corpus is empty")
try:
    distributed.from_primary("loading the corpus", fail)
except FlaxlmError as err:
    print(f"process {pid}: {err}", flush=True)
if pid == 1:  # process 0 has left
    distributed.all_gather("the next checkpoint", 1)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_messages_between_processes_carry_errors_and_time_out(tmp_path):
    """Process 0's decision and its failure reach the others; a cache build longer than the
    timeout is waited for; a process that never comes is an error after the timeout."""
    script = tmp_path / "messages.py"
    script.write_text(MESSAGES_SCRIPT)
    port = free_port()
    processes = [subprocess.Popen([sys.executable, str(script), str(i), str(port)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
    first, second = finish(processes, timeout=120)
    assert processes[0].returncode == 0, first[-3000:]
    assert "process 0: the corpus is empty" in first
    assert "has waited 3s for process 0 to finish building a cache" in second
    assert "process 1: Process 0 failed while loading the corpus" in second
    assert processes[1].returncode != 0
    assert ("waited hardware.distributed.timeout_s=3s for process 0 to reach the next "
            "checkpoint, in vain") in second, second[-3000:]


# --- in this process ------------------------------------------------------------------------


def test_explicit_mode_names_the_settings_it_misses():
    hardware = HardwareConfig(name="cpu-8", platform="cpu", distributed=DistributedConfig(
        mode="explicit", coordinator_address="localhost:1234", timeout_s=300))
    with pytest.raises(FlaxlmError, match=r"num_processes, hardware\.distributed\.process_id"):
        distributed.initialize(hardware)
    hardware.distributed.num_processes, hardware.distributed.process_id = 2, 2
    with pytest.raises(FlaxlmError, match=r"process_id=2 must be between 0 and"):
        distributed.initialize(hardware)
    hardware.distributed.timeout_s = 0
    with pytest.raises(FlaxlmError, match=r"timeout_s=0 must be at least 1"):
        distributed.initialize(hardware)


def test_auto_mode_without_a_cluster_trains_as_one_process(capsys, monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(name, raising=False)
    distributed.initialize(HardwareConfig(name="cpu-8", platform="cpu",
                                          distributed=DistributedConfig("auto", timeout_s=300)))
    assert "found no cluster" in capsys.readouterr().out
    assert distributed.from_primary("deciding", lambda: [1, "a"]) == [1, "a"]
    assert distributed.all_gather("gathering", {"x": 1}) == [{"x": 1}]


def test_each_process_resumes_its_own_stream_position(monkeypatch):
    positions = [{"kind": "stream", "seed": 0, "stream": {"documents": d}} for d in (5, 9)]
    saved = {**positions[0], PER_PROCESS_KEY: {"0": positions[0], "1": positions[1]}}
    monkeypatch.setattr("jax.process_count", lambda: 2)
    monkeypatch.setattr("jax.process_index", lambda: 1)
    assert own_loader_state(saved, "run") == positions[1]
    monkeypatch.setattr("jax.process_count", lambda: 4)  # the run moved to more hosts
    with pytest.raises(FlaxlmError, match=r"stream positions of 2 process\(es\), and this run "
                                          r"has 4"):
        own_loader_state(saved, "run")
    blocks = {"kind": "blocks", "seed": 0, "num_blocks": 8}  # one position for every process
    assert own_loader_state({**blocks, PER_PROCESS_KEY: {"0": blocks}}, "run") == blocks
    monkeypatch.setattr("jax.process_count", lambda: 1)
    monkeypatch.setattr("jax.process_index", lambda: 0)
    assert own_loader_state(positions[0], "run") == positions[0]  # a one-process checkpoint
