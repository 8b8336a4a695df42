"""Where `datasets` keeps what it builds while flaxlm loads data: under flaxlm's own cache.

`load_dataset` writes an Arrow copy of every data file it reads (and
`IterableDataset.from_generator` a lock file) into its own cache, by default
`~/.cache/huggingface/datasets`: outside FLAXLM_CACHE, so deleting flaxlm's cache did not clear
what a run left, and a run wrote under the home directory where nothing said it would. Every
data loader of flaxlm calls `keep_datasets_cache_under(cache_dir)` first; a user who named a
cache for `datasets` itself (HF_DATASETS_CACHE, or HF_HOME for all of Hugging Face's) keeps it.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

_VARIABLE = "HF_DATASETS_CACHE"
_routed_to: str | None = None  # what this process set HF_DATASETS_CACHE to, if anything


def keep_datasets_cache_under(cache_dir: str | None) -> None:
    """Point `datasets`' cache at `<cache_dir>/datasets` (no cache_dir: a scratch folder removed
    at exit), unless the user chose one. `datasets` reads HF_DATASETS_CACHE once, at import:
    the variable is set for an import still to come (and for child processes), and the values
    it was read into are changed where `datasets` is loaded already; it looks them up at each
    load."""
    global _routed_to
    chosen = os.environ.get(_VARIABLE)
    if (chosen and chosen != _routed_to) or os.environ.get("HF_HOME"):
        return
    root = (Path(os.path.expanduser(cache_dir), "datasets") if cache_dir is not None
            else _scratch_folder())
    os.environ[_VARIABLE] = _routed_to = str(root)
    config = sys.modules.get("datasets.config")
    if config is not None:
        config.HF_DATASETS_CACHE = root
        config.DOWNLOADED_DATASETS_PATH = root / config.DOWNLOADED_DATASETS_DIR
        config.EXTRACTED_DATASETS_PATH = config.DOWNLOADED_DATASETS_PATH / \
            config.EXTRACTED_DATASETS_DIR


@functools.cache
def _scratch_folder() -> Path:
    folder = tempfile.mkdtemp(prefix="flaxlm-datasets-")
    atexit.register(shutil.rmtree, folder, True)
    return Path(folder)
