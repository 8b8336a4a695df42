"""`language=[is,no,da]` on the command line: a mixture of those languages.

Hydra merges a list of a group's options into one node (what `logger=[wandb,tensorboard]`
wants), which for languages would keep the last corpus and drop the rest. So before Hydra sees
the command line, a list of languages is spelt as what it means: the `mixture` option, and each
language added as a source of its own,

    language=[is,no]  →  language=mixture +language@mixture.sources.is=is
                                          +language@mixture.sources.no=no

(the long form a user may also write, and what a preset such as conf/language/nordic.yaml
says in its defaults list). `folded` turns the long form back into the list, for the names
people read (the W&B run's). A sweep over lists (`-m 'language=[is,no],[da,sv]'`) is not
rewritten: sweep over mixture presets instead (`-m language=nordic,is`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from flaxlm.errors import FlaxlmError

MIXTURE_OPTION = "mixture"  # conf/language/mixture.yaml
_LIST = re.compile(r"language=\[([^\[\]]*)\]")
_SOURCE = re.compile(r"\+language@mixture\.sources\.([^=]+)=(.+)")


def expand_language_list(args: Sequence[str]) -> list[str]:
    """`args` (a command line's overrides and flags) with a `language=[...]` list of two or
    more options spelt as the mixture of them; a list of one is that language alone."""
    expanded = []
    for arg in args:
        match = _LIST.fullmatch(arg)
        if match is None:
            expanded.append(arg)
            continue
        names = [name.strip().strip("'\"") for name in match[1].split(",") if name.strip()]
        if len(set(names)) != len(names):
            raise FlaxlmError(f"{arg} names a language twice; name each language once (a "
                              "language's share is mixture.weights', not its repeats).")
        if len(names) < 2:
            expanded += [f"language={name}" for name in names]
            continue
        expanded += [f"language={MIXTURE_OPTION}",
                     *(f"+language@mixture.sources.{name}={name}" for name in names)]
    return expanded


def folded(overrides: Sequence[str]) -> list[str]:
    """`overrides` with the mixture's long form (`expand_language_list`'s) as the list it
    came from: `language=[is,no]`."""
    sources = [match[1] for match in map(_SOURCE.fullmatch, overrides)
               if match and match[1] == match[2]]
    if f"language={MIXTURE_OPTION}" not in overrides or not sources:
        return list(overrides)
    rest = [o for o in overrides if o != f"language={MIXTURE_OPTION}"
            and not ((match := _SOURCE.fullmatch(o)) and match[1] == match[2])]
    return [f"language=[{','.join(sources)}]", *rest]
