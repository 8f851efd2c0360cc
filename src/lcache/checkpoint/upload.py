"""Copy a finished checkpoint to any fsspec URL (s3://, gs://, file://, ...), manifest last.

The remote copy follows the local rule as far as an object store allows: the manifest is
uploaded after every data file, so a reader that finds it finds complete data.
"""

from __future__ import annotations

import os
from typing import Any

from lcache.checkpoint.format import MANIFEST
from lcache.checkpoint.persist import CHUNK, open_member
from lcache.checkpoint.restore import read_manifest
from lcache.errors import ConfigError
from lcache.io import close_file, pread_full
from lcache.io.urls import filesystem_of

IO_CLASS = "checkpoint-upload"


def upload_checkpoint(path: str, url: str, storage_options: dict[str, Any] | None = None
                      ) -> str:
    """Upload the checkpoint directory ``path`` to ``url/<name>``; returns that URL."""
    fs, base = filesystem_of(url, storage_options)
    name = os.path.basename(path.rstrip(os.sep))
    dest = f"{base.rstrip('/')}/{name}"
    # the files the manifest names (checked plain names), nothing else found in the directory
    files = sorted({shard["file"] for shard in read_manifest(path)["shards"]})
    try:
        fs.makedirs(dest, exist_ok=True)
        _copy(fs, path, dest, [*files, MANIFEST])
    except NotImplementedError as exc:  # fsspec's HTTP filesystem: reading only
        raise ConfigError(f"cannot upload to {url}: {type(fs).__name__} cannot write files; "
                          "give upload_to a writable URL (s3://, gs://, a path...)") from exc
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return f"{protocol}://{dest}" if protocol != "file" else dest


def _copy(fs: Any, path: str, dest: str, names: list[str]) -> None:
    """Copy the files ``names`` of ``path`` to ``dest`` on ``fs``, in that order."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    for fname in names:
        fd, _, _ = open_member(os.path.join(path, fname), "checkpoint file")
        try:
            with fs.open(f"{dest}/{fname}", "wb") as out:
                offset = 0
                while True:
                    n = pread_full(fd, offset, view, IO_CLASS)
                    if n == 0:
                        break
                    out.write(view[:n])
                    offset += n
        finally:
            close_file(fd)
