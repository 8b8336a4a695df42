"""orbax's own files in a bucket (each step's `_CHECKPOINT_METADATA`, its items' metadata, the
`commit_success.txt` that makes a step complete, its listings and deletions) written and read
through flaxlm's filesystem, so that they are retried as `storage_retries` says, as every other
bucket call of flaxlm is.

orbax reaches those files through etils.epath, whose fsspec backend keeps a filesystem of its
own per scheme (`fsspec.filesystem("s3")`): botocore's default tries and s3fs's around them,
outside storage_retries, and made once per process with the endpoint of its time. Its `fs`
is made to answer with `flaxlm.storage.filesystem` for s3:// and gs:// (client retries off,
each call retried by `flaxlm.storage_retry`); other schemes keep etils' own.

A file opened through the backend is whole: read with one retried GET, written in memory and
put with one retried PUT when closed. An object store has no partial write anyway (the object
appears when its upload ends), and a retried `open` alone would leave the upload, which
happens at `close`, unretried. orbax's files here are a few kilobytes; its arrays go through
tensorstore (`flaxlm.training.checkpoint.s3`).
"""

from __future__ import annotations

import functools
import io
import os

from etils.epath import backend

from flaxlm.storage import filesystem

_SCHEMES = ("s3://", "gs://")
SETTING = "output_url"


class _Uploaded(io.BytesIO):
    """Bytes kept in memory, put whole at `close` (retried)."""

    def __init__(self, fs, path: str):
        super().__init__()
        self._fs, self._path = fs, path

    def close(self) -> None:
        if self.closed:
            return
        data = self.getvalue()
        try:
            self._fs.pipe_file(self._path, data)
        finally:
            super().close()


class _Files:
    """The part of a filesystem that etils' backend calls, with `open` made whole-object."""

    def __init__(self, fs):
        self._fs = fs

    def __getattr__(self, name: str):
        return getattr(self._fs, name)

    def open(self, path: str, mode: str = "rb"):
        if "r" in mode:
            data = self._fs.cat_file(path)
            return io.BytesIO(data) if "b" in mode else io.StringIO(data.decode("utf-8"))
        if "w" in mode:
            uploaded = _Uploaded(self._fs, path)
            return uploaded if "b" in mode else io.TextIOWrapper(uploaded, encoding="utf-8")
        return self._fs.open(path, mode)  # appending: no whole-object form; etils' way


@functools.cache
def install() -> None:
    """Route etils.epath's fsspec backend to flaxlm's retried filesystem for bucket URLs."""
    fs_of = backend.fsspec_backend.fs

    def fs(path):
        text = os.fspath(path)
        if text.startswith(_SCHEMES):
            return _Files(filesystem(text, SETTING))
        return fs_of(path)

    backend.fsspec_backend.fs = fs
