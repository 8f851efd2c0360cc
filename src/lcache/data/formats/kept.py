"""Shard indexes kept in the cache directory: ``DIR/shard-index-<kind>.json`` maps a shard's
identity (URL, path, size and version) to what indexing it found. An index is a function of
the shard's bytes, and the version (ETag, generation, modification time) changes with them,
so an entry is reused whenever the identity matches, by any later run; a shard without a
version gets no identity and is indexed every time. The file is read and written under
``DIR/shard-index.lock``, so the ranks of a node index once."""

from __future__ import annotations

import fcntl
import json
import os
from types import TracebackType
from typing import Any

from lcache import jsondoc
from lcache.io import atomic_write, close_file, private_dir, read_and_close
from lcache.io.files import open_owned

FORMAT = 1


class KeptIndex:
    """``with KeptIndex(cache_dir, kind) as kept: kept.load(); ...; kept.save(entries)``;
    with no ``cache_dir`` it keeps nothing."""

    def __init__(self, cache_dir: str | os.PathLike[str] | None, kind: str) -> None:
        self.dir = None if cache_dir is None else os.path.abspath(os.fspath(cache_dir))
        self.kind = kind
        self._fd = -1

    def __enter__(self) -> KeptIndex:
        if self.dir is not None:
            self.dir = private_dir(self.dir, "cache directory")
            self._fd = open_owned(os.path.join(self.dir, "shard-index.lock"),
                                 os.O_RDWR | os.O_CREAT)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fd >= 0:
            close_file(self._fd)
            self._fd = -1

    @property
    def path(self) -> str:
        assert self.dir is not None
        return os.path.join(self.dir, f"shard-index-{self.kind}.json")

    def load(self) -> dict[str, Any]:
        """Identity -> entry, as saved (empty if nothing was, or it cannot be read)."""
        if self.dir is None:
            return {}
        try:
            fd = open_owned(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return {}
        raw = read_and_close(fd)
        try:
            doc = jsondoc.loads(raw)
        except ValueError:
            return {}
        ok = isinstance(doc, dict) and doc.get("format") == FORMAT and isinstance(
            doc.get("shards"), dict)
        return doc["shards"] if ok else {}

    def save(self, entries: dict[str, Any]) -> None:
        """Keep ``entries`` (the shards of this source; others are dropped)."""
        if self.dir is None:
            return
        body = json.dumps({"format": FORMAT, "shards": entries}).encode()
        atomic_write(self.path, body, io_class="cache-meta")
