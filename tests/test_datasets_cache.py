"""What `datasets` writes while flaxlm loads data stays under flaxlm's cache (issue 55, point 5):
nothing under the home directory's ~/.cache/huggingface/datasets unless the user named it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import pytest
from conftest import CONF_DIR, user_env, write

from flaxlm.data import datasets_cache
from flaxlm.data.datasets_cache import keep_datasets_cache_under

# A corpus in a CSV file (what `load_dataset` reads, as against .txt and .jsonl, which flaxlm
# reads itself), loaded whole and streamed, as flaxlm-train's data build does.
BUILD = textwrap.dedent("""
    import os, sys
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from flaxlm.config import register_configs
    from flaxlm.data.corpus import load_corpus, load_corpus_stream

    register_configs()
    with initialize_config_dir(sys.argv[1], version_base="1.3"):
        config = OmegaConf.to_object(compose("train", overrides=[
            "language=files", f"language.files=[{sys.argv[2]}]", "language.max_eval_docs=1",
            "run_dir=unset"]))
    cache_dir = os.path.expanduser(config.cache_dir)
    assert len(load_corpus(config.language, cache_dir).train) > 0
    assert len(list(load_corpus_stream(config.language, cache_dir)[1])) > 0
""")


def test_a_data_build_writes_nothing_under_the_home_directory(tmp_path):
    """Failed before: `datasets` kept the CSV's Arrow copy and its lock files in
    $HOME/.cache/huggingface/datasets."""
    home, cache = tmp_path / "home", tmp_path / "flaxlm-cache"
    home.mkdir()
    csv = write(tmp_path / "corpus.csv",
                "text\n" + "".join(f'"document number {i} of the corpus"\n' for i in range(8)))
    env = user_env("HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE_HOME", HOME=str(home),
                   FLAXLM_CACHE=str(cache), HF_HUB_OFFLINE="1",
                   HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    result = subprocess.run([sys.executable, "-c", BUILD, CONF_DIR, str(csv)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (home / ".cache" / "huggingface").exists(), sorted(map(str, home.rglob("*")))
    assert list((cache / "datasets").rglob("*.arrow")), "the Arrow copy is in flaxlm's cache"


@pytest.fixture
def no_datasets_cache_chosen(monkeypatch):
    """No HF_DATASETS_CACHE or HF_HOME, as on a user's machine; what the test changes in
    `datasets.config` and the environment is put back after it."""
    for name in ("HF_DATASETS_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HF_DATASETS_CACHE", "DOWNLOADED_DATASETS_PATH", "EXTRACTED_DATASETS_PATH"):
        monkeypatch.setattr(datasets.config, name, getattr(datasets.config, name))
    monkeypatch.setattr(datasets_cache, "_routed_to", None)


def test_the_cache_goes_under_cache_dir_or_a_scratch_folder(no_datasets_cache_chosen, tmp_path):
    keep_datasets_cache_under(str(tmp_path / "cache"))
    assert datasets.config.HF_DATASETS_CACHE == tmp_path / "cache" / "datasets"
    assert datasets.config.EXTRACTED_DATASETS_PATH.is_relative_to(tmp_path / "cache")
    keep_datasets_cache_under(None)  # no cache configured: nothing kept past the process
    scratch = datasets.config.HF_DATASETS_CACHE
    assert scratch.is_dir() and not scratch.is_relative_to(Path.home())


def test_a_cache_the_user_named_for_datasets_is_kept(no_datasets_cache_chosen, tmp_path,
                                                      monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "theirs"))
    before = datasets.config.HF_DATASETS_CACHE
    keep_datasets_cache_under(str(tmp_path / "cache"))
    assert datasets.config.HF_DATASETS_CACHE == before
