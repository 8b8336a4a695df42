"""The life of flaxlm's cache entries (trained tokenizers, packed token blocks): built in a
scratch folder that its live owner holds, recorded with what verifies them, checked on load.

Scratch. An entry is built in a `.tmp-*` folder beside it and only the finished entry is
renamed into place. The folder's owner holds a lock (flock) on its `owner.lock`, which also
names the owner's host and pid, for as long as it builds; a killed owner's lock is released by
the kernel. Each use of a cache folder removes the scratch folders of this host whose lock is
free. Another host's lock may be invisible from here (a filesystem mounted without locking), so
its scratch, and any without an owner file, is removed only once nothing in it changed for
FOREIGN_SCRATCH_AGE_S: a live build writes to its scratch all along.

Records. Next to each entry, a record (JSON) holds every file's size and a CRC-32 of sampled
windows of it: SAMPLE_WINDOWS windows of WINDOW_BYTES spread from the first byte to the last,
so checking reads a few MB whatever the file's size (a file that small is read whole). A size
catches a truncated or grown file; the windows catch a damaged header or tail and a sampled
part of the middle. A full checksum would read a file of packed blocks whole on every start,
GBs for a real corpus, before training reads it again.

A damaged entry is flaxlm's own derived data, rebuilt from the corpus: it is replaced (the
check's one line says what was wrong), not kept aside, since keeping a damaged copy of GBs could
fill the very disk whose quota damaged it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
import zlib
from collections.abc import Iterator

SCRATCH_PREFIX = ".tmp-"
OWNER_FILE = "owner.lock"
FOREIGN_SCRATCH_AGE_S = 24 * 3600
SAMPLE_WINDOWS = 32
WINDOW_BYTES = 1 << 17  # 32 windows of 128 KiB: at most 4 MiB read per file


@contextlib.contextmanager
def scratch_folder(parent: str) -> Iterator[str]:
    """A new folder in `parent`, held by this process until the block ends, then removed with
    whatever is left in it (move the finished entry out first)."""
    os.makedirs(parent, exist_ok=True)
    path = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=parent)
    lock = None
    try:
        lock = _claim(path)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if lock is not None:
            os.close(lock)  # after the removal: a live owner's folder is never judged stale


def _claim(path: str) -> int:
    """Lock the owner file before it gets its name, so that every `owner.lock` a cleaner sees
    is already held (the lock belongs to the file, not the name)."""
    pending = os.path.join(path, OWNER_FILE + ".pending")
    descriptor = os.open(pending, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(descriptor, json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
                 .encode())
        os.rename(pending, os.path.join(path, OWNER_FILE))
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def remove_stale_scratch(parent: str) -> None:
    """Remove the scratch folders in `parent` that no live build owns, saying so in one line."""
    try:
        names = [name for name in os.listdir(parent) if name.startswith(SCRATCH_PREFIX)]
    except FileNotFoundError:
        return
    stale = [os.path.join(parent, name) for name in names
             if _is_stale(os.path.join(parent, name))]
    if not stale:
        return
    freed = sum(_size(path) for path in stale)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    print(f"flaxlm: removed {len(stale)} scratch folder(s) left in {parent} by builds that were "
          f"killed ({freed / 2**20:.1f} MB)", flush=True)


def _is_stale(path: str) -> bool:
    owner = _read_owner(path)
    if owner is not None and owner.get("host") == socket.gethostname():
        free = _lock_is_free(os.path.join(path, OWNER_FILE))
        if free is not None:
            return free
    return time.time() - _last_change(path) > FOREIGN_SCRATCH_AGE_S


def _read_owner(path: str) -> dict | None:
    try:
        with open(os.path.join(path, OWNER_FILE), encoding="utf-8") as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _lock_is_free(owner_file: str) -> bool | None:
    """Whether no process holds `owner_file`'s lock; None if the filesystem cannot tell."""
    try:
        descriptor = os.open(owner_file, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK: no locks on this filesystem
        return None
    finally:
        os.close(descriptor)  # closing drops the lock if this took it


def _last_change(path: str) -> float:
    try:
        times = [os.stat(path).st_mtime]
    except FileNotFoundError:  # its build just finished and removed it
        return time.time()
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                times.append(os.stat(os.path.join(root, name)).st_mtime)
    return max(times)


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


# --- records: what an entry's files were when it was made ---------------------------------------


def write_record(record_path: str, names: list[str]) -> None:
    """Record the size and sampled checksum of each of the files `names`, which lie beside
    `record_path`, in `record_path` (JSON, written to a temporary name and renamed)."""
    folder = os.path.dirname(record_path)
    record = {name: _fingerprint(os.path.join(folder, name)) for name in names}
    temporary = f"{record_path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    os.replace(temporary, record_path)


def damage(record_path: str, names: list[str] | None = None) -> str | None:
    """What differs between the files `names` (all those recorded, if None) and their record
    at `record_path`, as a short phrase; None when they match it. A missing record is damage
    too: callers that accept entries made before records existed check those their own way."""
    try:
        with open(record_path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return f"its record {os.path.basename(record_path)} is missing"
    except (OSError, ValueError) as err:
        return f"its record {os.path.basename(record_path)} is unreadable ({err})"
    if not isinstance(record, dict) or not record:
        return f"its record {os.path.basename(record_path)} lists no file"
    folder = os.path.dirname(record_path)
    for name in record if names is None else names:
        expected = record.get(name)
        if not isinstance(expected, dict):
            return f"{name} is not in its record"
        try:
            actual = _fingerprint(os.path.join(folder, name))
        except OSError as err:
            return f"{name} cannot be read ({err.strerror or err})"
        if not isinstance(expected.get("bytes"), int):
            return f"its record of {name} is unreadable"
        if actual["bytes"] != expected["bytes"]:
            return f"{name} has {actual['bytes']:,} bytes instead of {expected.get('bytes'):,}"
        if actual != expected:
            return f"{name} differs from its recorded checksum"
    return None


def _fingerprint(path: str) -> dict:
    """Size, and CRC-32 of the sampled windows (the whole file when it is small)."""
    size = os.path.getsize(path)
    crc = 0
    with open(path, "rb") as f:
        for start in _window_starts(size):
            f.seek(start)
            crc = zlib.crc32(f.read(WINDOW_BYTES), crc)
    return {"bytes": size, "crc32_sampled": crc}


def _window_starts(size: int) -> list[int]:
    if size <= SAMPLE_WINDOWS * WINDOW_BYTES:
        return list(range(0, size, WINDOW_BYTES))
    last = size - WINDOW_BYTES
    return [last * i // (SAMPLE_WINDOWS - 1) for i in range(SAMPLE_WINDOWS)]
