"""Where progress bars print: on process 0 only, so that several hosts show one set of bars."""

from __future__ import annotations

import io

from flaxlm import distributed


class _Discard(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)


def progress_file() -> io.TextIOBase | None:
    """stderr (None, tqdm's default) on process 0, nowhere on the others. Not tqdm's
    `disable`: a disabled bar stops counting."""
    return None if distributed.is_primary() else _Discard()
