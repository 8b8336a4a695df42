"""No flaxlm command probes for a TPU on a machine without one (issue 43): with libtpu
installed (the `tpu` extra, which this venv has), JAX left to itself loads it at start-up, and
libtpu, finding no chip, prints its probe on stderr. The tools given no hardware group pin the
platforms JAX would try, less the TPU (`flaxlm.platforms`); flaxlm-train and flaxlm-plan pin
their hardware group's. Each command runs here as a user's would: a process of its own, with
the environment a user's shell gives it (no JAX_PLATFORMS)."""

import importlib.util
import subprocess
import sys

import pytest
from conftest import user_env, write

from flaxlm.platforms import platforms_to_pin, tpu_attached

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None

# What libtpu prints when it looks for a TPU and finds none.
PROBE_LINES = ("host bounds", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "worker hostname",
               "Source Location Trace", "InitGoogle", "libtpu")

needs_a_cpu_machine_with_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU or tpu_attached(),
    reason="libtpu's probe shows only where libtpu is installed and no TPU is attached")


def no_tpu():
    return False


def a_tpu():
    return True


def jax_platforms():
    return ["cuda", "cpu"]


def unlisted():
    raise AssertionError("the platforms were listed where nothing is to be pinned")


@pytest.mark.parametrize("chosen, attached, platforms, pinned", [
    (None, no_tpu, jax_platforms, "cuda,cpu"),  # no TPU, no choice: JAX's platforms but the TPU
    ("", no_tpu, jax_platforms, "cuda,cpu"),  # JAX_PLATFORMS='': JAX's automatic choice
    ("cpu", no_tpu, unlisted, None),  # the user's choice is kept
    ("tpu", no_tpu, unlisted, None),  # ... even a TPU that is not found: JAX says so
    (None, a_tpu, unlisted, None),  # a TPU is attached: JAX uses it
    (None, no_tpu, lambda: None, None),  # JAX's platforms cannot be listed: JAX chooses
])
def test_only_a_machine_without_a_tpu_and_without_the_users_choice_is_pinned(
        chosen, attached, platforms, pinned):
    assert platforms_to_pin(chosen, attached, platforms) == pinned


PIN_AND_START = """
import sys
import jax
from flaxlm.platforms import skip_absent_tpu
pinned = skip_absent_tpu()
print(pinned, jax.default_backend(), skip_absent_tpu())  # the second call: JAX has started
"""


@needs_a_cpu_machine_with_libtpu
@pytest.mark.parametrize("env, printed", [
    ({}, "cpu cpu None"),  # pinned: the CPU, as JAX would have chosen, without the probe
    ({"JAX_PLATFORMS": "cpu"}, "None cpu None"),  # the user's choice
])
def test_jax_starts_on_a_machine_without_a_tpu_without_the_probe(env, printed):
    done = subprocess.run([sys.executable, "-c", PIN_AND_START], env=user_env(**env),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == printed.split()
    assert_quiet(done.stderr)


def assert_quiet(stderr: str) -> None:
    probe = [line for line in stderr.splitlines() if any(p in line for p in PROBE_LINES)]
    assert probe == [], "libtpu's probe on stderr:\n" + "\n".join(probe)


# --- every command, end to end ------------------------------------------------------------------

TINY_RUN = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
            "model.max_positions=32", "model.vocab_size=512", "task.max_seq_length=32",
            "hardware=cpu", "hardware.cpu_devices=2", "hardware.per_device_batch_size=2",
            "logger=none", "samples.prompts=[]", "trainer.max_steps=1",
            "trainer.eval_before_training=false", "language.max_eval_docs=4"]
TASK = """task: tiny_choice
dataset_path: json
validation_split: validation
dataset_kwargs:
  data_files:
    validation: {data}
output_type: multiple_choice
doc_to_text: '{{{{context}}}}'
doc_to_choice: '{{{{choices}}}}'
doc_to_target: label
metric_list:
  - metric: acc
"""


def command(tool: str, *arguments) -> subprocess.CompletedProcess:
    """`tool` (flaxlm-generate, ...) as a user runs it: its own process, the user's env."""
    done = subprocess.run([sys.executable, "-m", f"flaxlm.cli.{tool}", *map(str, arguments)],
                          env=user_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run trained by flaxlm-train, and what flaxlm-train wrote on stderr."""
    folder = tmp_path_factory.mktemp("quiet")
    with pytest.MonkeyPatch.context() as patch:  # the caches the tests' own (conftest) use
        patch.setenv("FLAXLM_CACHE", str(tmp_path_factory.getbasetemp() / "flaxlm-cache"))
        patch.setenv("HF_DATASETS_CACHE", str(folder / "hf-datasets"))
        done = command("train", *TINY_RUN, f"run_dir={folder / 'run'}")
    return folder / "run", done.stderr


def the_tools(run_dir, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write(tasks / "choice.jsonl", '{"context": "The marsh", "choices": [" a", " b"], '
                                  '"label": 0}\n' * 2)
    write(tasks / "choice.yaml", TASK.format(data=tasks / "choice.jsonl"))
    plan = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
            "model.vocab_size=512", "task.max_seq_length=32", "logger=none"]
    return {
        "generate": [run_dir, "--prompt", "The", "--max-new-tokens", "2"],
        "export": [run_dir, "--out", tmp_path / "hf"],
        "eval": [run_dir, "--tasks", "tiny_choice", "--include-path", tasks, "--limit", "2"],
        "report": [run_dir, "--out", tmp_path / "report"],
        "pairs": [tmp_path / "pairs", "--train", "4", "--validation", "2"],
        "plan": [*plan, "hardware=cpu"],
        "plan-tpu": [*plan, "hardware=tpu-v5e-8"],  # XLA's TPU compiler from libtpu, on the CPU
    }


@pytest.mark.slow
@needs_a_cpu_machine_with_libtpu
def test_flaxlm_train_is_quiet(trained):
    assert_quiet(trained[1])


@pytest.mark.slow
@needs_a_cpu_machine_with_libtpu
@pytest.mark.parametrize("tool", [
    "generate", "export", pytest.param("eval", marks=pytest.mark.harness), "report", "pairs",
    "plan", pytest.param("plan-tpu", marks=pytest.mark.libtpu)])
def test_every_command_is_quiet_on_a_machine_without_a_tpu(trained, tool, tmp_path):
    run_dir, _ = trained
    done = command(tool.removesuffix("-tpu"), *the_tools(run_dir, tmp_path)[tool])
    assert_quiet(done.stderr)
