"""W&B in tests: an offline run kept under the test's folder, and its transaction log
(`run-*.wandb`) read back with wandb's own protobuf classes."""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path


def offline_wandb_env(run_dir: Path, monkeypatch) -> None:
    """W&B offline, with its run files under `run_dir` and its own files beside it."""
    monkeypatch.setenv("WANDB_DIR", str(run_dir))
    # wandb-core writes its own logs under the user cache dir (XDG_CACHE_HOME).
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "XDG_CACHE_HOME"):
        monkeypatch.setenv(name, str(run_dir.parent / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def read_wandb_records(path: Path, wait_s: float = 30.0) -> list:
    """The records of a finished run's transaction log, once its exit record is on disk:
    `run.finish()` can return while wandb's service is still writing the file's tail, so a
    read may end in a chunk written in part (short, or not yet matching its checksum). Such a
    read is taken again; past `wait_s`, every chunk read must be whole."""
    deadline = time.monotonic() + wait_s
    while True:
        records, torn = _read_records(path)
        if (of_type(records, "exit") and not torn) or time.monotonic() > deadline:
            assert not torn, f"{path}: a chunk at byte {torn} fails its length or checksum"
            return records
        time.sleep(0.2)


def _read_records(path: Path) -> tuple[list, int | None]:
    """The records of a W&B transaction log (`run-*.wandb`): LevelDB log framing, i.e. a 7-byte
    file header, then 32 KiB blocks of chunks (crc32 4, length 2, type 1, data), each
    record one FULL chunk or FIRST, MIDDLE..., LAST, the block's tail zero-padded. Also the
    offset of the first chunk that is cut short or fails its checksum, where the read
    stopped (None: every chunk was whole)."""
    # Imported here: wandb is hundreds of files, and every pytest-xdist worker imports the
    # test modules that use this one when it collects the suite.
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # no room for a chunk header: padding
            pos += block - pos % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero-filled rest of the block
            pos += block - pos % block
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != checksum:
            return records, pos
        pending += chunk
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records, None


def of_type(records, kind: str) -> list:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


def items(entries) -> dict:
    """W&B's key/value_json pairs as a dict; nested keys joined with '/'."""
    return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}
