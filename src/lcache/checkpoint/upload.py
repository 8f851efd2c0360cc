"""Copy a finished checkpoint to any fsspec URL (s3://, gs://, file://, ...), manifest last.

The remote copy follows the local rules as far as an object store allows: the manifest is
uploaded after every data file, so a reader that finds it finds complete data, and a remote
checkpoint (one with a manifest) is never overwritten: its data files would be rewritten in
place under its old manifest, and an upload cut short would leave neither copy whole (an
object store has no rename that could swap a new copy in at once).
"""

from __future__ import annotations

import os
from typing import Any

from lcache.checkpoint.errors import CheckpointExistsError, ConfigError
from lcache.checkpoint.format import MANIFEST
from lcache.checkpoint.persist import CHUNK, open_member
from lcache.checkpoint.restore import read_manifest
from lcache.checks import lies_within
from lcache.io import close_file, pread_full
from lcache.io.urls import filesystem_of

IO_CLASS = "checkpoint-upload"


def upload_checkpoint(path: str, url: str, storage_options: dict[str, Any] | None = None
                      ) -> str:
    """Upload the checkpoint directory ``path`` to ``url/<name>``; returns that URL.

    Raises:
        ConfigError: a local ``url`` on the checkpoint, in its directory or holding it (see
            ``check_upload_target``), or one that cannot be written.
        CheckpointExistsError: ``url/<name>`` holds a checkpoint already (a manifest); a
            destination without one (an upload cut short) is written over.
    """
    # the files the manifest names (checked plain names), nothing else found in the directory
    files = sorted({shard["file"] for shard in read_manifest(path)["shards"]})
    fs, dest = check_upload_target(path, url, storage_options, [*files, MANIFEST])
    fs.invalidate_cache(dest)  # a listing fsspec cached earlier must not hide a new manifest
    if fs.lexists(f"{dest}/{MANIFEST}"):
        raise CheckpointExistsError(
            f"{url} already holds a checkpoint named {os.path.basename(dest)!r} ({dest}/"
            f"{MANIFEST}); checkpoints are never overwritten (its data files would be "
            "rewritten under its manifest, and an upload cut short would leave neither copy "
            "whole): remove it first, or upload to another URL or under another name")
    try:
        fs.makedirs(dest, exist_ok=True)
        _copy(fs, path, dest, [*files, MANIFEST])
    except NotImplementedError as exc:  # fsspec's HTTP filesystem: reading only
        raise ConfigError(f"cannot upload to {url}: {type(fs).__name__} cannot write files; "
                          "give upload_to a writable URL (s3://, gs://, a path...)") from exc
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return f"{protocol}://{dest}" if protocol != "file" else dest


def check_upload_target(path: str, url: str, storage_options: dict[str, Any] | None = None,
                        names: list[str] | tuple[str, ...] = ()) -> tuple[Any, str]:
    """``(filesystem, destination)`` of uploading the checkpoint ``path`` (its files
    ``names``) to ``url``. A local destination that is the checkpoint, lies in its directory
    or holds that directory is refused: on the checkpoint, the upload opened each file for
    writing over itself and left every checkpoint 0 bytes, its save reported a success; in
    the directory, retention would remove the copy with the checkpoints.

    Raises:
        ConfigError: such a destination, or a URL fsspec cannot open.
    """
    from fsspec.implementations.local import LocalFileSystem

    fs, base = filesystem_of(url, storage_options)
    path = os.path.abspath(path)
    dest = f"{base.rstrip('/')}/{os.path.basename(path)}"
    if not isinstance(fs, LocalFileSystem):
        return fs, dest
    root = os.path.dirname(path)
    for target in (dest, *(f"{dest}/{name}" for name in names)):  # a file may link into it
        if lies_within(target, root):
            where = "in the checkpoint itself" if lies_within(target, path) else \
                f"inside its directory {root}"
            raise ConfigError(f"upload_to={url}: the upload of {path} would write {target}, "
                              f"{where}; give upload_to a place outside {root}")
    if lies_within(root, dest):
        raise ConfigError(f"upload_to={url}: the upload of {path} would go to {dest}, which "
                          f"holds its directory {root}; give upload_to a place outside it")
    return fs, dest


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
