"""Data files named by a setting (language.files, task.files, ...): matching the patterns
(local paths and globs, or bucket URLs such as s3://bucket/dir/*.jsonl, whose objects are read
from local copies in the cache), checking each file before `datasets` reads it, and turning
`datasets`' failures into one readable line."""

from __future__ import annotations

import collections
import contextlib
import glob
import os
from pathlib import Path

from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module
from flaxlm.storage import cached_copy, glob_objects, is_url

datasets = lazy_module("datasets")


def expand_patterns(patterns: list[str], setting: str, cache_dir: str | None = None
                    ) -> list[Path]:
    """Files matched by each path or glob of `setting`, sorted per pattern, in pattern order,
    without repeats; a pattern that matches nothing is an error naming it. A bucket URL's
    objects are copied into `cache_dir` (once per version) and named by their copies."""
    paths: dict[Path, None] = {}  # an ordered set
    for pattern in patterns:
        if is_url(pattern):
            urls = glob_objects(pattern, setting)
            paths.update((Path(cached_copy(url, cache_dir, setting)), None) for url in urls)
            continue
        matches = sorted(
            p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)
        )
        if not matches and os.path.isdir(os.path.expanduser(pattern)):
            raise _directory_given(pattern, setting)
        if not matches:
            raise FlaxlmError(
                f"{setting}: the pattern {pattern!r} matches no file (relative paths are "
                f"resolved from the working directory {os.getcwd()!r}). Fix the path or glob, "
                "or use an absolute path."
            )
        paths.update((Path(m).resolve(), None) for m in matches)
    return list(paths)


def _directory_given(directory: str, setting: str) -> FlaxlmError:
    """A directory where files are named: which of its files to read is the user's choice (a
    folder often also holds a README, a licence, other splits), so the error suggests the glob
    for the kind of file it holds most."""
    base = directory.rstrip("/" + os.sep) or directory
    inside = [Path(p) for p in glob.glob(os.path.join(os.path.expanduser(base), "**", "*"),
                                         recursive=True) if os.path.isfile(p)]
    if not inside:
        return FlaxlmError(f"{setting}: {directory!r} is a directory without files in it. "
                           f"{setting} names files: paths, or globs such as '{base}/*.txt'.")
    suffixes = collections.Counter(p.suffix for p in inside)
    suffix = suffixes.most_common(1)[0][0]
    top_level = any(p.suffix == suffix and p.parent == Path(os.path.expanduser(base))
                    for p in inside)
    deep = f"{base}/**/*{suffix}"
    example = f"{base}/*{suffix}" if top_level else deep
    return FlaxlmError(
        f"{setting}: {directory!r} is a directory, and {setting} names files. Name the files "
        f"in it with a glob, e.g. {setting}=[{example}] ({suffixes[suffix]} of the "
        f"{len(inside)} file(s) in it and its subfolders end in {suffix or 'no extension'}"
        + (f"; ** reaches into subfolders, as in {deep})." if example != deep else ").")
    )


def check_file_type(path: Path, setting: str, supported) -> None:
    """A file of `setting` must have one of the `supported` extensions and not be empty."""
    if path.suffix.lower() not in supported:
        raise FlaxlmError(
            f"{setting}: {str(path)!r} has the unsupported extension {path.suffix!r}. "
            f"Supported: {', '.join(supported)}; convert the file, or rename it if it already is "
            "one of these."
        )
    if path.stat().st_size == 0:
        raise FlaxlmError(f"{setting}: {str(path)!r} is empty. Remove it from {setting}.")


@contextlib.contextmanager
def quiet_datasets_logs():
    """`datasets` logs why a data file does not parse on stderr, then raises; the FlaxlmError
    made of that exception says it again, so the log line would only push it off the first
    line of stderr."""
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)


def root_cause(err: BaseException) -> str:
    """The innermost explicitly chained error: `datasets` wraps the useful message."""
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {err}".rstrip(": .")  # the caller adds its own punctuation
