"""The test processes themselves: what every test may take for granted, whatever ran before it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

FIRST_A_CPU_RUN_THEN_A_MESH = '''
import jax
from flaxlm.config import DistributedConfig, HardwareConfig
from flaxlm.parallel import configure_platform


def test_a_run_on_the_cpu_group_comes_first():
    configure_platform(HardwareConfig(name="cpu", platform="cpu", cpu_devices=3,
                                      distributed=DistributedConfig("off", timeout_s=300)))


def test_then_a_test_that_needs_eight_devices():
    assert jax.device_count() == 8
'''


def test_a_worker_runs_jax_on_eight_devices_whatever_test_comes_first(tmp_path):
    """A worker whose first test ran flaxlm-train with hardware=cpu in its process started JAX
    with hardware.cpu_devices, one per core by default (configure_platform picks the count
    when JAX has not started):
    on a 2-core machine test_sft.py's runs, which ask for 8, were then refused when pytest
    -n 2 gave it that worker. The tests' conftest now starts JAX itself."""
    (tmp_path / "test_order.py").write_text(FIRST_A_CPU_RUN_THEN_A_MESH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
         "-p", "no:randomly", "-o", "addopts=", str(tmp_path / "test_order.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 passed" in result.stdout


class _Worker:
    """What xdist's scheduler asks of a worker."""

    shutting_down = False

    def send_runtest_some(self, indices):
        pass

    def shutdown(self):
        self.shutting_down = True


def test_xdist_hands_out_the_modules_longest_first_as_the_suite_sorts_them(pytestconfig):
    """conftest sorts the modules longest first (a weight from their `slow` and `multiprocess`
    tests), so that the last module a worker starts under `--dist loadfile` is a short one.
    pytest-xdist 3.7 and later re-sorted them by their number of tests: test_multihost.py (7
    tests of 20-40 s) and test_wheel.py (6) came after test_config.py (225 of milliseconds),
    at the end of the suite, and one worker finished minutes after the other."""
    if pytestconfig.getoption("loadscopereorder", default=None) is None:
        pytest.skip("pytest-xdist is not loaded here (-p no:xdist): it schedules nothing")
    from types import SimpleNamespace

    from xdist.scheduler import LoadFileScheduling

    collection = ["tests/test_long.py::test_end_to_end",  # sorted first by conftest: `slow`
                  *(f"tests/test_many.py::test_{i}" for i in range(5)),
                  *(f"tests/test_some.py::test_{i}" for i in range(3))]
    config = SimpleNamespace(option=pytestconfig.option, getvalue=lambda name: ["1*popen"])
    scheduler = LoadFileScheduling(config)
    worker = _Worker()
    scheduler.add_node(worker)
    scheduler.add_node_collection(worker, collection)
    scheduler.schedule()  # the first modules to the worker, the rest queued in their order
    handed_out = [*scheduler.assigned_work[worker], *scheduler.workqueue]
    assert handed_out == ["tests/test_long.py", "tests/test_many.py", "tests/test_some.py"]
