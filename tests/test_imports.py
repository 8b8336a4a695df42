"""What importing flaxlm costs: the train path's modules and every tool's `--help` load none of
the libraries that take seconds and that a run needs only for some corpora, tasks or loggers
(issue 52: `import flaxlm.job, flaxlm.tasks.clm` took 11 s on a TPU VM, datasets, transformers
and pandas most of it). Each check runs in a fresh interpreter and reads `sys.modules`, which
does not flake as a timing would; the seconds are in docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_cli import SCRIPTS

# Libraries that a module of the train path may only import where a run uses them.
HEAVY = ("datasets", "pandas", "pyarrow", "transformers", "torch", "tensorflow", "lm_eval",
         "optuna", "wandb", "tensorboard", "tensorboardX")

# Runs `module` (its `__main__`, with the arguments after it) or imports the modules named after
# `-i`; at exit, whatever the exit status, prints which of the named libraries are loaded.
LOADED_AT_EXIT = """
import atexit, json, runpy, sys
watched = sys.argv[1].split(",")
atexit.register(lambda: print("\\nloaded:", json.dumps(
    sorted(name for name in watched if name in sys.modules))))
if sys.argv[2] == "-i":
    for name in sys.argv[3:]:
        __import__(name)
else:
    module, sys.argv = sys.argv[2], sys.argv[2:]
    runpy.run_module(module, run_name="__main__")
"""


def loaded(watched, *args: str) -> tuple[int, list[str], str]:
    """(exit status, the `watched` libraries loaded, stderr) of LOADED_AT_EXIT run with args."""
    done = subprocess.run([sys.executable, "-c", LOADED_AT_EXIT, ",".join(watched), *args],
                          capture_output=True, text=True, timeout=120)
    last = done.stdout.splitlines()[-1] if done.stdout else ""
    assert last.startswith("loaded: "), (done.stdout[-2000:], done.stderr[-3000:])
    return done.returncode, json.loads(last.removeprefix("loaded: ")), done.stderr


def test_the_train_path_imports_no_heavy_library():
    """flaxlm-train imports these after Hydra; a quickstart run reaches its corpus and its
    tokenizer before anything of `datasets` or `transformers` is needed, if at all."""
    status, heavy, stderr = loaded(HEAVY, "-i", "flaxlm.job", "flaxlm.tasks.clm")
    assert status == 0, stderr[-3000:]
    assert heavy == []


@pytest.mark.slow  # seven interpreters: make test-fast keeps the train path's check above
@pytest.mark.parametrize("tool", sorted(SCRIPTS))
def test_help_exits_0_without_jax_or_a_heavy_library(tool):
    """`--help` prints what the tool takes: nothing of JAX (seconds to start, more on a TPU VM)
    nor of the libraries its work may need."""
    module = SCRIPTS[tool].partition(":")[0]
    status, heavy, stderr = loaded((*HEAVY, "jax", "flax"), module, "--help")
    assert status == 0, stderr[-3000:]
    assert heavy == []


def test_a_lazy_module_is_imported_at_its_first_use():
    status, names, stderr = loaded(("colorsys",), "-i", "flaxlm.lazy_imports")
    assert (status, names) == (0, []), stderr  # the helper itself imports nothing watched
    use = ("from flaxlm.lazy_imports import lazy_module; import sys; "
           "colorsys = lazy_module('colorsys'); before = 'colorsys' in sys.modules; "
           "hsv = colorsys.rgb_to_hsv(1.0, 0.0, 0.0); "
           "print(before, sys.modules['colorsys'].rgb_to_hsv is colorsys.rgb_to_hsv, hsv)")
    done = subprocess.run([sys.executable, "-c", use], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.split() == ["False", "True", "(0.0,", "1.0,", "1.0)"], done.stderr


def test_hydra_repository_copies_share_the_config_store(monkeypatch):
    """Hydra copies its config repository once per config group to print --help; the copies
    share the process's ConfigStore (flaxlm.cli.hydra_copies) and copy everything else."""
    from hydra._internal.config_repository import CachingConfigRepository, ConfigRepository
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_store import ConfigStore

    from flaxlm.cli.hydra_copies import share_the_config_store
    from flaxlm.cli.train import CONFIG_DIR

    # Put Hydra's own back after the test, whatever share_the_config_store does.
    monkeypatch.setattr(CachingConfigRepository, "__init__", CachingConfigRepository.__init__)
    repository = ConfigRepository(create_config_search_path(CONFIG_DIR))
    share_the_config_store()
    copied = CachingConfigRepository(repository).delegate
    assert copied is not repository
    assert all(a is not b for a, b in zip(copied.sources, repository.sources))
    assert copied.get_schema_source().store is ConfigStore.instance()
    assert copied.load_config("train") is not None  # still a working repository


# Runs flaxlm-train with the arguments given; prints which of the watched libraries are loaded
# when its training loop is about to start (state made, steps compiled or loaded), and at exit.
LOADED_AT_THE_LOOP = """
import atexit, json, sys
from flaxlm.cli import train
from flaxlm.tasks import base
watched = sys.argv[1].split(",")
loaded = lambda: sorted(name for name in watched if name in sys.modules)
run_loop = base.run_loop

def report(*args, **kwargs):
    print("\\nat the loop:", json.dumps(loaded()), flush=True)
    return run_loop(*args, **kwargs)

atexit.register(lambda: print("\\nat exit:", json.dumps(loaded()), flush=True))
base.run_loop, sys.argv = report, ["flaxlm-train", *sys.argv[2:]]
train.main()
"""

# What a run on the builtin corpus, a .txt or a .jsonl file never needs: the corpus is read by
# flaxlm itself, and config.json written without transformers' config classes (which import
# PyTorch), at the start as at the export. The tokenizer is transformers'
# (`PreTrainedTokenizerFast`), its tokenization only.
NEVER_LOADED = ("datasets", "pandas", "pyarrow", "torch", "transformers.configuration_utils",
                "transformers.modeling_utils")


@pytest.mark.slow  # a short run, to its end
@pytest.mark.parametrize("corpus", ["builtin", "jsonl"])
def test_a_run_on_a_corpus_flaxlm_reads_never_imports_datasets_or_pytorch(tmp_path, corpus):
    from conftest import TINY

    source = []
    if corpus == "jsonl":
        rows = [{"text": f"document {i}: " + "some words of text " * (i % 7 + 1)}
                for i in range(400)]
        (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        source = ["language.source=files", f"language.files=[{tmp_path / 'corpus.jsonl'}]"]
    arguments = [*TINY, "hardware=cpu", "trainer.max_steps=1", *source,
                 f"hydra.run.dir={tmp_path / 'run'}"]
    done = subprocess.run([sys.executable, "-c", LOADED_AT_THE_LOOP, ",".join(NEVER_LOADED),
                           *arguments], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = dict(line.split(": ", 1) for line in done.stdout.splitlines()
                   if line.startswith(("at the loop: ", "at exit: ")))
    assert {moment: json.loads(names) for moment, names in reports.items()} == {
        "at the loop": [], "at exit": []}, done.stdout[-2000:]
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()  # it exported
