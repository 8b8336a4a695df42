"""Tests of `flaxlm.data.cache`: scratch folders that outlive their owner are removed and those of
a live owner kept, and the records that tell a damaged cache entry from a whole one."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import config_node
from hypothesis import given
from hypothesis import strategies as st

from flaxlm.data import cache
from flaxlm.data.packing import tokenize_and_pack
from flaxlm.data.tables import text_dataset
from flaxlm.data.tokenizer import prepare_tokenizer

TEXTS = [f"Document {i}: the tide came in over the flats, and the birds moved up the shore."
         for i in range(300)]

# Holds a scratch folder in argv[1] until killed: a build in progress.
HOLD_SCRATCH = """
import sys, time
from flaxlm.data import cache
with cache.scratch_folder(sys.argv[1]) as scratch:
    open(scratch + "/partial", "wb").write(b"x" * 1000)
    print(scratch, flush=True)
    time.sleep(600)
"""

# Packs TEXTS into the cache at argv[1], stalling (until killed) after the last token batch
# reached the scratch file.
STALLED_PACKING = """
import json, sys, time
from flaxlm.config import TokenizerConfig
from flaxlm.data import packing
from flaxlm.data.tables import text_dataset
from flaxlm.data.tokenizer import prepare_tokenizer

texts = text_dataset(TEXTS)
tokenizer = prepare_tokenizer(TokenizerConfig(**json.loads(sys.argv[2])), texts, 512, sys.argv[1])
real_batches = packing._token_batches


def stalled(*args):
    yield from real_batches(*args)
    print("packing", flush=True)
    time.sleep(600)


packing._token_batches = stalled
packing.tokenize_and_pack(texts, tokenizer, 16, sys.argv[1])
"""


def start(script: str, *args: str) -> tuple[subprocess.Popen, str]:
    """A Python subprocess running `script`, once it has printed its first line that is not
    blank (returned; the BPE trainer prints blank lines)."""
    process = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                               text=True)
    for line in process.stdout:
        if line.strip():
            return process, line.strip()
    raise AssertionError(f"the subprocess ended early with {process.wait()}")


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    process.stdout.close()


def scratch_folders(folder: Path) -> list[Path]:
    return sorted(folder.glob(cache.SCRATCH_PREFIX + "*"))


@pytest.mark.slow
def test_packing_killed_with_sigkill_leaves_scratch_that_the_next_use_removes(tmp_path, capsys):
    settings = json.dumps(dataclasses.asdict(config_node("tokenizer", vocab_size=300)))
    packer, _ = start(f"TEXTS = {TEXTS!r}\n" + STALLED_PACKING, str(tmp_path), settings)
    blocks_folder = tmp_path / "blocks"
    try:
        [scratch] = scratch_folders(blocks_folder)
        assert (scratch / "stream.int32").exists()
        cache.remove_stale_scratch(str(blocks_folder))  # another run, while this one packs
        assert scratch.exists(), "a live build's scratch folder was removed"
    finally:
        kill(packer)
    assert scratch.exists()  # what kill -9 leaves

    texts = text_dataset(TEXTS)
    tokenizer = prepare_tokenizer(config_node("tokenizer", vocab_size=300), texts, 512,
                                  str(tmp_path))
    blocks = tokenize_and_pack(texts, tokenizer, 16, str(tmp_path))
    assert scratch_folders(blocks_folder) == []
    assert "removed 1 scratch folder(s)" in capsys.readouterr().out
    assert len(blocks) > 100
    assert sorted(p.suffix for p in blocks_folder.iterdir()) == [".json", ".npy"]


def test_scratch_of_a_live_owner_is_kept_and_of_a_killed_one_removed(tmp_path):
    owner, scratch = start(HOLD_SCRATCH, str(tmp_path))
    try:
        cache.remove_stale_scratch(str(tmp_path))
        assert Path(scratch, "partial").exists()
        assert json.loads(Path(scratch, cache.OWNER_FILE).read_text()) == {
            "host": socket.gethostname(), "pid": owner.pid}
    finally:
        kill(owner)
    cache.remove_stale_scratch(str(tmp_path))
    assert not Path(scratch).exists()


def test_a_finished_build_leaves_no_scratch(tmp_path):
    with cache.scratch_folder(str(tmp_path)) as scratch:
        cache.remove_stale_scratch(str(tmp_path))  # this process's own build: kept
        assert Path(scratch).is_dir()
    assert list(tmp_path.iterdir()) == []


def make_scratch(parent: Path, owner: dict | None, age_s: float) -> Path:
    """A scratch folder nobody holds, with the `owner` file given, last changed `age_s` ago."""
    scratch = parent / f"{cache.SCRATCH_PREFIX}made"
    scratch.mkdir()
    (scratch / "stream.int32").write_bytes(b"\0" * 64)
    if owner is not None:
        (scratch / cache.OWNER_FILE).write_text(json.dumps(owner))
    then = time.time() - age_s
    for path in (*scratch.iterdir(), scratch):
        os.utime(path, (then, then))
    return scratch


@pytest.mark.parametrize(
    ("owner", "age_s", "removed"),
    [
        # another host: its lock may not be visible here, so only age tells
        ({"host": "elsewhere", "pid": 1}, 60, False),
        ({"host": "elsewhere", "pid": 1}, cache.FOREIGN_SCRATCH_AGE_S + 60, True),
        # no owner file (an older flaxlm's, or a build killed before claiming it)
        (None, 60, False),
        (None, cache.FOREIGN_SCRATCH_AGE_S + 60, True),
        # this host, lock free: its owner is dead, however fresh
        ({"host": socket.gethostname(), "pid": 1}, 0, True),
    ],
)
def test_which_scratch_folders_count_as_stale(tmp_path, owner, age_s, removed):
    scratch = make_scratch(tmp_path, owner, age_s)
    cache.remove_stale_scratch(str(tmp_path))
    assert scratch.exists() != removed


# --- records ---------------------------------------------------------------------------------


@pytest.fixture
def recorded(tmp_path) -> Path:
    data = np.random.default_rng(0).integers(0, 2**31, 3 << 20, dtype=np.int32).tobytes()
    (tmp_path / "entry.bin").write_bytes(data)  # 12 MiB: checked by samples
    (tmp_path / "small.txt").write_text("hello")
    cache.write_record(str(tmp_path / "record.json"), ["entry.bin", "small.txt"])
    return tmp_path


def test_a_recorded_entry_as_written_has_no_damage(recorded):
    assert cache.damage(str(recorded / "record.json")) is None


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    ("harm", "phrase"),
    [
        (lambda d: os.truncate(d / "entry.bin", 1000), "has 1,000 bytes instead of"),
        (lambda d: open(d / "entry.bin", "ab").write(b"more"), "bytes instead of"),
        (lambda d: overwrite(d / "entry.bin", 0, b"\xff"), "differs from its recorded checksum"),
        (lambda d: overwrite(d / "entry.bin", (12 << 20) - 1, b"\xff"), "checksum"),
        (lambda d: overwrite(d / "small.txt", 2, b"L"), "small.txt differs"),
        (lambda d: (d / "small.txt").unlink(), "small.txt cannot be read"),
        (lambda d: (d / "record.json").write_text('{"entry.bin": {"by'), "record.json is unread"),
        (lambda d: (d / "record.json").unlink(), "record.json is missing"),
    ],
)
def test_damage_names_what_differs_from_the_record(recorded, harm, phrase):
    harm(recorded)
    assert phrase in cache.damage(str(recorded / "record.json"))


@given(st.integers(0, 1 << 40))
def test_samples_stay_in_the_file_cover_both_ends_and_are_bounded(size):
    starts = cache._window_starts(size)
    assert len(starts) <= cache.SAMPLE_WINDOWS
    assert all(0 <= s < size for s in starts)
    if size:
        assert starts[0] == 0 and starts[-1] + cache.WINDOW_BYTES >= size
    if size <= cache.SAMPLE_WINDOWS * cache.WINDOW_BYTES:  # small: read whole
        assert starts == list(range(0, size, cache.WINDOW_BYTES))


def test_compiled_programs_are_kept_where_jax_compilation_cache_dir_says(tmp_path,
                                                                         monkeypatch):
    """JAX's own variable names a folder several jobs share; without it, the run's cache_dir."""
    import jax

    from flaxlm.job import enable_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    try:
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "shared"))
        enable_compilation_cache(str(tmp_path / "cache"))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "shared")
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
        enable_compilation_cache(str(tmp_path / "cache"))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache" / "xla")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
