"""WebDataset tar shards as a source, without conversion.

A sample is what WebDataset groups: consecutive regular members with the same key (the name
up to the first dot of its last path part), extensions lower-cased, metadata members
(``__name__``) and names without an extension skipped. Its bytes are the tar bytes from its
first header to the end of its last member, so the cache stores exactly what the shard holds
and a fetch is one ranged read (neighbouring samples coalesce into one). ``decode`` returns
the sample as WebDataset's raw samples look: ``{"__key__": key, "jpg": bytes, "cls": bytes,
...}``; ``path_of(i)`` is ``SHARD_URL#key`` (WebDataset's ``__url__`` and ``__key__``).

The index comes from the tar headers: each shard is read once, in blocks, skipping the data
of members larger than a block, shards side by side. With ``cache_dir=`` the index of each
shard is kept in ``DIR/shard-index.json`` under its path, size and version (ETag or
modification time) and reused while they match; a shard without a version is read again.
Every header's checksum is checked when the shard is indexed and again when a sample is
fetched, with its key.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from lcache.checks import path_argument, whole_number
from lcache.data.formats import tar
from lcache.data.formats.kept import KeptIndex
from lcache.data.formats.shards import checked_infos, make_remote, shard_names
from lcache.data.listing import Progress
from lcache.data.remote import Listed, Remote, SourceCorruptionError, object_version
from lcache.data.sources import RangeSource

_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext

Entry = tuple[str, int, int]  # a sample of a shard: key, first byte, end


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member as WebDataset groups it, or None for one it skips."""
    if _META.match(name):
        return None
    match = _KEY.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


def index_shard(read: Any, size: int, where: Any) -> list[Entry]:
    """The samples of one shard, in order, from its headers."""
    samples: list[Entry] = []
    key: str | None = None
    exts: set[str] = set()
    start = end = 0
    for m in tar.scan(read, 0, size, where, archive=True):
        split = split_name(m.name) if m.kind in tar.REGULAR else None
        if split is None:
            continue
        k, ext = split
        if k != key:
            if key is not None:
                samples.append((key, start, end))
            key, exts, start = k, set(), m.start
        elif ext in exts:
            raise SourceCorruptionError(f"{where(m.start)}: sample {k!r} has two {ext!r} "
                                        "members (WebDataset refuses it too)")
        exts.add(ext)
        end = min(m.end, size)
    if key is not None:
        samples.append((key, start, end))
    return samples


class _Blocks:
    """``read(offset, n)`` over one shard, fetched ``block`` bytes at a time from the
    offset asked, so the data of members larger than a block is skipped."""

    def __init__(self, remote: Remote, path: str, size: int, block: int, version: str
                 ) -> None:
        self.remote, self.path, self.size, self.block = remote, path, size, block
        # an index is kept under the shard's listed version: one scanned from a rewrite
        # after the listing was taken for the listed bytes' once they were put back (an S3
        # ETag is the content's), and served a sample without a member (attack round 22)
        self.listed = Listed(size, version)
        self.start = 0
        self.buf = memoryview(b"")

    def __call__(self, offset: int, n: int) -> memoryview:
        if not (self.start <= offset and offset + n <= self.start + len(self.buf)):
            end = min(self.size, offset + max(n, self.block))
            data = self.remote.get_many([(self.path, offset, end)],
                                        lambda url: f"cannot index the shard {url}",
                                        self.listed)[0]
            if len(data) != end - offset:
                raise SourceCorruptionError(
                    f"{self.remote.full_url(self.path)}: ended at byte {offset + len(data)}, "
                    f"its listing said {self.size} bytes: a shard rewritten while indexed?")
            self.start, self.buf = offset, memoryview(data)
        return self.buf[offset - self.start:offset - self.start + n]


class WebDatasetSource(RangeSource):
    """The samples of the WebDataset tar shards under ``url`` (``shards=`` names them, brace
    patterns such as ``"train-{000000..000146}.tar"`` allowed; else every ``.tar``).

    Args:
        url: the folder or prefix of the shards.
        shards: shard names relative to ``url``, or patterns.
        cache_dir: keep the shards' indexes there (see the module doc).
        index_block: bytes read per request while indexing a shard.
        storage_options, progress, fetch options: as for ``FileSource``.
    """

    def __init__(self, url: str, *, shards: str | Sequence[str] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None,
                 storage_options: dict[str, Any] | None = None,
                 progress: bool | None = None, index_block: int = 4 << 20,
                 **fetch_options: Any) -> None:
        index_block = whole_number(index_block, "index_block", tar.BLOCK, 1 << 30)
        if cache_dir is not None:  # 5 was a TypeError, "\0" a ValueError, from deep inside
            cache_dir = path_argument(cache_dir, "cache_dir")
        remote = make_remote(url, storage_options, fetch_options)
        names = shard_names(remote, shards, ".tar", progress, cache_dir)
        infos = checked_infos(remote, names, None, "shard")
        sizes = [int(info.get("size") or 0) for info in infos]
        entries = self._index(remote, names, sizes, infos, cache_dir, progress, index_block)
        empty = [n for n, e in zip(names, entries, strict=True) if not e]
        if len(empty) == len(names):
            raise SourceCorruptionError(f"no WebDataset samples in the {len(names)} shards "
                                        f"under {remote.url} (e.g. {names[0]})")
        self.keys = [key for e in entries for key, _, _ in e]
        file_of = np.concatenate([np.full(len(e), i, np.int32) for i, e in enumerate(entries)])
        offsets = [s for e in entries for _, s, _ in e]
        lengths = [end - s for e in entries for _, s, end in e]
        self._setup(remote, names, infos, file_of, offsets, lengths)

    @staticmethod
    def _index(remote: Remote, names: list[str], sizes: list[int],
               infos: list[dict[str, Any]], cache_dir: str | os.PathLike[str] | None,
               progress: bool | None, block: int) -> list[list[Entry]]:
        where = f"{remote.url}|{remote.location()}"
        ids = [f"{where}|{n}|{s}|{object_version(i)}" if object_version(i) else None
               for n, s, i in zip(names, sizes, infos, strict=True)]
        with KeptIndex(cache_dir, "webdataset") as kept:
            known = kept.load()
            entries: list[list[Entry] | None] = [_entries(known.get(i)) if i else None
                                                 for i in ids]
            todo = [j for j, e in enumerate(entries) if e is None]
            bar = Progress(f"indexing {remote.url}", progress)

            def one(j: int) -> list[Entry]:
                path = remote.path(names[j])
                url = remote.full_url(path)
                found = index_shard(_Blocks(remote, path, sizes[j], block,
                                            object_version(infos[j])), sizes[j],
                                    lambda pos: f"{url} at byte {pos}")
                bar.update(shards=1, samples=len(found))
                return found

            try:
                if todo:
                    workers = min(len(todo), remote.options.concurrency, 16)
                    with ThreadPoolExecutor(workers) as pool:
                        for j, found in zip(todo, pool.map(one, todo), strict=True):
                            entries[j] = found
            finally:
                bar.close()
            if todo:
                kept.save({i: e for i, e in zip(ids, entries, strict=True) if i is not None})
        return [e or [] for e in entries]

    def path_of(self, index: int) -> str:
        """``SHARD_URL#key``."""
        path = self._paths[self._file_of[index]]
        return f"{self._remote.full_url(path)}#{self.keys[index]}"

    def check(self, index: int, data: bytes) -> None:
        """Every header's checksum, and that the members are the sample's key."""
        url = self._remote.full_url(self._paths[self._file_of[index]])
        start = int(self.offsets[index])
        got = _members(data, lambda pos: f"sample {index} ({url} at byte {start + pos})",
                       verify=True)
        if got.get("__key__") != self.keys[index]:
            raise SourceCorruptionError(
                f"sample {index} ({url} at byte {start}): holds key {got.get('__key__')!r}, "
                f"not {self.keys[index]!r}: the shard changed since it was indexed?")

    def decode(self, data: bytes | memoryview) -> dict[str, Any]:
        return _members(data, lambda pos: f"a cached WebDataset sample at byte {pos}",
                        verify=False)


def _entries(raw: Any) -> list[Entry] | None:
    """A kept shard index, if it is one."""
    try:
        return [(str(k), int(a), int(b)) for k, a, b in raw] if isinstance(raw, list) else None
    except (TypeError, ValueError):
        return None


def _members(data: bytes | memoryview, where: Any, verify: bool) -> dict[str, Any]:
    view = memoryview(data)
    out: dict[str, Any] = {}
    for m in tar.scan(lambda o, n: view[o:o + n], 0, len(view), where, verify=verify):
        split = split_name(m.name) if m.kind in tar.REGULAR else None
        if split is None:
            continue
        key, ext = split
        if out.setdefault("__key__", key) != key or ext in out:
            raise SourceCorruptionError(f"{where(m.start)}: member {m.name!r} is not of "
                                        f"sample {out['__key__']!r}")
        out[ext] = bytes(view[m.data:m.data + m.size])
    return out
