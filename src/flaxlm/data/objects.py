"""Local copies of data files that live in a bucket (s3://, gs://), kept in flaxlm's cache.

Every reader of data files (corpus, classification examples, chat, preferences) parses local
files, with the checks that name what is wrong in them; a file in a bucket is copied to
`<cache_dir>/objects/<version key>/<scheme>/<bucket>/<key>` first and read from there. The
version key hashes the URL with what the store says identifies the object's version (ETag or
generation, size, time), so a rewritten object is copied again and a run never trains on a
stale copy; the readable tail of the path makes a message about the copy name its object. A
copy is downloaded into a scratch folder and renamed into place: a killed download leaves no
file that looks whole. The cache stays on the host's own disk (on a pod, each host keeps its
copy; each process then takes its own rows of the data, as with local files).
"""

from __future__ import annotations

import os
from pathlib import Path

from flaxlm.data import cache
from flaxlm.data.fingerprint import settings_fingerprint
from flaxlm.errors import FlaxlmError
from flaxlm.storage import download, object_version


def local_copy(url: str, cache_dir: str | None, setting: str) -> Path:
    """The cached local copy of the object at `url`, downloaded if this version is not there."""
    if cache_dir is None:
        raise FlaxlmError(f"{setting}: {url!r} is in a bucket, and copies of bucket files are "
                          "kept in flaxlm's cache: set cache_dir (or FLAXLM_CACHE).")
    root = os.path.join(os.path.expanduser(cache_dir), "objects")
    key = settings_fingerprint(url, object_version(url, setting))[:20]
    scheme, _, rest = url.partition("://")
    path = Path(root, key, scheme, *rest.split("/"))
    if path.is_file():
        return path
    cache.remove_stale_scratch(root)
    with cache.scratch_folder(root) as scratch:
        partial = os.path.join(scratch, path.name)
        download(url, partial, setting)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, path)  # another process may have put the same copy there first
    return path
