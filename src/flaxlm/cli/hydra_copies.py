"""Hydra's config repository copied without its ConfigStore: most of `flaxlm-train --help`.

To list the options of each config group, Hydra's help makes a fresh `CachingConfigRepository`
per group and per kind of entry, 133 for flaxlm's conf/, and each deep-copies the repository it
wraps: its three config sources, one of which holds the process's `ConfigStore` with flaxlm's
typed schema (`train_schema`) and Hydra's own. That was ~6 ms a copy, 0.8 of the 1.3 s of CPU
the help text took here. The copy only shields the sources from `initialize_sources()`, which
replaces them and never changes the store: the store is a process-wide singleton that each
source reads through `ConfigStore.load()`, which hands out copies of its nodes. So the copies
share it and copy everything else as before.
"""

from __future__ import annotations

import copy

from hydra._internal.config_repository import CachingConfigRepository, IConfigRepository
from hydra.core.config_store import ConfigStore


def _copying_all_but_the_store(self: CachingConfigRepository, delegate: IConfigRepository
                               ) -> None:
    # Hydra 1.3's own __init__, with the store as its own copy in deepcopy's memo.
    store = ConfigStore.instance()
    self.delegate = copy.deepcopy(delegate, {id(store): store})
    self.cache = {}


def share_the_config_store() -> None:
    """From now on, Hydra's repository copies share the ConfigStore (see the module's text)."""
    CachingConfigRepository.__init__ = _copying_all_but_the_store  # type: ignore[method-assign]
