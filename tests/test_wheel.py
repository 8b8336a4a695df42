"""`pip install .` without `-e`: the wheel carries `conf/`, so the installed `flaxlm-train`
starts from any directory, and a user's own config directory composes on top of it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO, TINY, cache_with_builtin, user_env

# What a wheel is not built from; copying the rest keeps the build's `build/` and
# `*.egg-info` out of the checkout.
NOT_SOURCES = shutil.ignore_patterns(".venv", ".git", "build", "dist", "outputs", "wandb",
                                     "*.egg-info", "__pycache__", ".pytest_cache", ".cache")

PURELIB = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
MY_MODEL = ("name: my-model\nvocab_size: 512\nmax_positions: 64\nhidden_size: 32\nnum_layers: 1\n"
            "num_heads: 2\n")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtual environment holding only the wheel built from this checkout; the
    third-party dependencies come from the test's environment through a .pth file, which
    adds that site-packages to the path without running its own .pth files (the editable
    install's pointer to `src/` among them)."""
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(REPO, tmp / "src", ignore=NOT_SOURCES)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp / "dist"), str(tmp / "src")], check=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("flaxlm-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", PURELIB], check=True, capture_output=True,
                          text=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "--quiet", str(wheel)], check=True, timeout=300)
    return venv


def flaxlm_train(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The installed console script as a user runs it (conftest's `user_env`)."""
    env = user_env("HYDRA_FULL_ERROR", FLAXLM_CACHE=str(cache_with_builtin(cwd / "cache")),
                   HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    return subprocess.run([str(venv / "bin" / "flaxlm-train"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_installed_package_is_the_wheels_and_reads_its_own_conf(installed):
    where = subprocess.run(
        [str(installed / "bin" / "python"), "-c",
         "import flaxlm, flaxlm.cli.train as cli; print(flaxlm.__file__); print(cli.CONFIG_DIR)"],
        cwd=installed, check=True, capture_output=True, text=True).stdout.split()
    assert all(Path(path).is_relative_to(installed) for path in where), where
    assert Path(where[1], "train.yaml").is_file()


@pytest.mark.slow
def test_the_installed_flaxlm_train_prints_its_config_from_another_directory(installed, tmp_path):
    result = flaxlm_train(installed, "--cfg", "job", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "name: gpt2-tiny" in result.stdout and "trainer:" in result.stdout


@pytest.mark.slow
def test_the_wheel_carries_the_tpu_vm_launcher_hydra_finds_among_its_plugins(installed, tmp_path):
    """Hydra looks for launchers only in the `hydra_plugins` namespace package, which the wheel
    ships beside `flaxlm`."""
    result = flaxlm_train(installed, "launcher=tpu-vm", "--cfg", "hydra", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("_target_: hydra_plugins.flaxlm_tpu_vm_launcher.tpu_vm_launcher.TpuVmLauncher"
            in result.stdout)
    where = subprocess.run(
        [str(installed / "bin" / "python"), "-c",
         "import hydra_plugins.flaxlm_tpu_vm_launcher as p; print(p.__file__)"],
        cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()
    assert Path(where).is_relative_to(installed), where


@pytest.mark.slow
def test_a_users_config_dir_composes_on_top_of_the_installed_one(installed, tmp_path):
    Path(tmp_path, "mine", "model").mkdir(parents=True)
    Path(tmp_path, "mine", "model", "my-model.yaml").write_text(MY_MODEL)
    result = flaxlm_train(installed, "--config-dir", str(tmp_path / "mine"), "model=my-model",
                          "--cfg", "job", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "name: my-model" in result.stdout and "hidden_size: 32" in result.stdout
    # The packaged groups are still there beside the user's.
    assert "name: en-builtin" in result.stdout


@pytest.mark.slow
def test_the_installed_flaxlm_train_trains_from_another_directory(installed, tmp_path):
    run = tmp_path / "run"
    result = flaxlm_train(installed, *TINY, "trainer.max_steps=3",
                          "trainer.eval_before_training=false", "samples.prompts=[]",
                          "language.max_train_docs=40", "language.max_eval_docs=10",
                          f"hydra.run.dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(row.get("step") == 3 for row in steps), steps


@pytest.mark.slow
def test_every_command_the_wheel_registers_is_installed_and_answers_help(installed, tmp_path):
    """(tests/test_cli.py checks that every tool is registered.)"""
    import configparser

    (entry_points,) = installed.glob("lib/python*/site-packages/flaxlm-*.dist-info/"
                                     "entry_points.txt")
    registered = configparser.ConfigParser()
    registered.read(entry_points)
    names = list(registered["console_scripts"])
    assert "flaxlm-train" in names and "flaxlm-pairs" in names, names
    for name in names:
        result = subprocess.run([str(installed / "bin" / name), "--help"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0 and result.stdout.strip(), (name, result.stderr[-2000:])
