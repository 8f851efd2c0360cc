"""Where samples come from: objects under an fsspec URL, byte ranges of large files, or any
map-style dataset. A source numbers its samples ``0..len-1`` and fetches one by number.

Filesystems are created lazily in each process (fsspec caches them per process), so a source
pickles cheaply into DataLoader workers and never shares a connection across ``fork``.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import xxhash

from lcache.data import codec
from lcache.data.identity import probe_contents
from lcache.errors import ConfigError, LCacheError
from lcache.trace import recorder as _trace


class SourceError(LCacheError, OSError):
    """A sample could not be read from the source; the message names the URL and the key."""


class Source(Protocol):
    """What the cache needs of a source. A source may also offer ``fingerprints()``: one
    uint64 per sample that changes when the sample's object is rewritten (from its listing:
    path, size, ETag or modification time), so a cache notices changed samples; a source
    without it is identified by the contents of a probe of its items (``lcache.data.identity``).
    """

    url: str

    def __len__(self) -> int: ...

    def sizes(self) -> npt.NDArray[np.int64]:
        """Bytes of each sample as fetched (known or estimated)."""
        ...

    def fetch(self, index: int) -> bytes: ...

    def decode(self, data: bytes | memoryview) -> Any:
        """The item a dataset returns, from fetched (or cached) bytes."""
        ...


# Fields of an fsspec info dict that change when an object is rewritten: S3/Azure ETag, GCS
# generation and md5Hash, HTTP ETag/Last-Modified/Content-MD5/Digest, and for local files the
# modification time, the inode change time (which no user can set back) and the inode.
VERSION_FIELDS = ("ETag", "etag", "md5Hash", "generation", "VersionId", "version_id",
                  "Content-MD5", "Digest", "Last-Modified", "LastModified", "last_modified",
                  "mtime", "created", "ino")


def object_version(info: dict[str, Any]) -> str:
    """The version fields of an fsspec info dict, as one string ("" if it has none)."""
    return "|".join(f"{k}={info[k]}" for k in VERSION_FIELDS if info.get(k) not in (None, ""))


def _fingerprint(*parts: object) -> int:
    return int(xxhash.xxh3_64_intdigest("\0".join(map(str, parts)).encode()))


async def _gather_infos(fs: Any, paths: list[str]) -> list[Any]:
    from fsspec.asyn import _run_coros_in_chunks

    return list(await _run_coros_in_chunks([fs._info(p) for p in paths],
                                           batch_size=getattr(fs, "batch_size", None)))


class _Fsspec:
    """Lazily created fsspec filesystem for ``url``."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None) -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        self._fs: Any = None
        self._root = ""
        self._pid = -1

    def fs(self) -> tuple[Any, str]:
        # Why the pid: a DataLoader worker forked from us inherits our filesystem object,
        # whose event loop and connections belong to the parent.
        if self._fs is None or self._pid != os.getpid():
            self._pid = os.getpid()
            import fsspec.core

            try:
                self._fs, self._root = fsspec.core.url_to_fs(self.url, **self.storage_options)
            except (ImportError, ValueError) as exc:
                raise ConfigError(f"cannot open {self.url}: {exc}") from exc
        return self._fs, self._root

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["storage_options"])  # type: ignore[misc]

    def infos(self, paths: list[str]) -> list[dict[str, Any]]:
        """fsspec ``info`` of each path (concurrent on async filesystems such as HTTP)."""
        fs, _ = self.fs()
        try:
            if getattr(fs, "async_impl", False):
                from fsspec.asyn import sync

                return sync(fs.loop, _gather_infos, fs, paths)  # type: ignore[no-any-return]
            return [fs.info(p) for p in paths]
        except Exception as exc:
            raise SourceError(f"cannot stat the files under {self.url}: "
                              f"{type(exc).__name__}: {exc}") from exc

    def full_url(self, path: str) -> str:
        fs, _ = self.fs()
        return str(fs.unstrip_protocol(path))

    def cat(self, index: int, path: str, start: int | None = None,
            end: int | None = None) -> bytes:
        """Bytes of ``path`` (or its range); errors name the sample and the URL."""
        fs, _ = self.fs()
        t0 = time.perf_counter_ns() if _trace._active is not None else 0
        try:
            data = bytes(fs.cat_file(path, start=start, end=end))
        except Exception as exc:
            if t0:  # traced as a data-source read (fsspec does not go through lcache.io)
                _trace.record("read", self.full_url(path), start or 0,
                              0 if end is None else end - (start or 0), "data-source", t0,
                              time.perf_counter_ns() - t0, -errno.EIO)
            where = "" if start is None else f"bytes {start}-{end} of "
            raise SourceError(f"cannot read sample {index} ({where}{self.full_url(path)}): "
                              f"{type(exc).__name__}: {exc}") from exc
        if t0:
            _trace.record("read", self.full_url(path), start or 0, len(data), "data-source", t0,
                          time.perf_counter_ns() - t0, len(data))
        return data


class FileSource:
    """One object per sample under a directory or prefix (``/data``, ``s3://b/train/``,
    ``http://host/data/``), ordered by path. ``files`` (relative paths) skips the listing;
    ``suffixes`` keeps only names ending so (e.g. ``(".jpg", ".png")``)."""

    def __init__(self, url: str, *, files: Sequence[str] | None = None,
                 suffixes: Sequence[str] | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self._remote = _Fsspec(url, storage_options)
        fs, root = self._remote.fs()
        root = root.rstrip("/")
        if files is not None:
            self.paths = [f"{root}/{f.lstrip('/')}" for f in files]
            infos = dict(zip(self.paths, self._remote.infos(self.paths), strict=True))
        else:
            try:
                listing = fs.find(root, detail=True)
            except Exception as exc:
                raise SourceError(f"cannot list {url}: {exc}") from exc
            self.paths = sorted(p for p, info in listing.items()
                                if info.get("type") != "directory"
                                and (not suffixes or p.endswith(tuple(suffixes))))
            infos = {p: listing[p] for p in self.paths}
            # e.g. HTTP listings carry neither sizes nor versions: ask each object (HEAD)
            bare = [p for p in self.paths if not infos[p].get("size") or
                    not object_version(infos[p])]
            if bare:
                infos.update(zip(bare, self._remote.infos(bare), strict=True))
        if not self.paths:
            try:  # find() hides connection errors behind an empty listing; ls() raises them
                fs.ls(root)
            except Exception as exc:
                raise SourceError(f"cannot list {url}: {type(exc).__name__}: {exc}") from exc
            raise SourceError(f"no samples found under {url}")
        self._sizes = np.array([int(infos[p].get("size") or 0) for p in self.paths], np.int64)
        self._versions = [object_version(infos[p]) for p in self.paths]

    def fingerprints(self) -> npt.NDArray[np.uint64]:
        """Per sample: its path, size and version (ETag or modification time)."""
        return np.array([_fingerprint(p, int(n), v) for p, n, v in
                         zip(self.paths, self._sizes, self._versions, strict=True)], np.uint64)

    def versioned(self) -> bool:
        """Whether the listing tells rewritten objects apart (ETag or modification time)."""
        return all(self._versions)

    def __len__(self) -> int:
        return len(self.paths)

    def sizes(self) -> npt.NDArray[np.int64]:
        return self._sizes

    def fetch(self, index: int) -> bytes:
        return self._remote.cat(index, self.paths[index])

    def decode(self, data: bytes | memoryview) -> Any:
        return bytes(data)


class RangeSource:
    """Samples as byte ranges of large files (token files, tar shards): sample ``i`` is
    ``length[i]`` bytes at ``offset[i]`` of ``path[i]`` (paths relative to ``url``)."""

    def __init__(self, url: str, paths: Sequence[str] | str,
                 offsets: Sequence[int] | npt.NDArray[np.int64],
                 lengths: Sequence[int] | npt.NDArray[np.int64], *,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self._remote = _Fsspec(url, storage_options)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        n = len(self.offsets)
        names = [paths] * n if isinstance(paths, str) else list(paths)
        if len(names) != n or len(self.lengths) != n:
            raise ConfigError("paths, offsets and lengths must have one entry per sample")
        if n == 0:
            raise ConfigError(f"no samples given for {url}")
        if (self.offsets < 0).any() or (self.lengths <= 0).any():
            raise ConfigError("offsets must be >= 0 and lengths > 0")
        self._files = sorted(set(names))
        lookup = {name: i for i, name in enumerate(self._files)}
        self._file_of = np.array([lookup[p] for p in names], dtype=np.int32)
        infos = self._remote.infos([self._path(i) for i in range(len(self._files))])
        file_sizes = np.array([int(info.get("size") or 0) for info in infos], np.int64)
        ends = self.offsets + self.lengths
        beyond = np.flatnonzero(ends > file_sizes[self._file_of])
        if len(beyond):
            i = int(beyond[0])
            raise ConfigError(f"sample {i}: bytes {self.offsets[i]}-{ends[i]} lie beyond the end "
                              f"of {self._files[self._file_of[i]]} ({file_sizes[self._file_of[i]]}"
                              f" bytes); {len(beyond)} samples do")
        self._versions = [object_version(info) for info in infos]
        self._file_fps = np.array([_fingerprint(f, int(n), v) for f, n, v in
                                   zip(self._files, file_sizes, self._versions, strict=True)],
                                  np.uint64)

    def _path(self, file: int) -> str:
        _, root = self._remote.fs()
        return f"{root.rstrip('/')}/{self._files[file]}"

    def fingerprints(self) -> npt.NDArray[np.uint64]:
        """Per sample: its file's path, size and version, mixed with its offset and length."""
        mix = (self.offsets.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
               ^ self.lengths.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F))
        fps: npt.NDArray[np.uint64] = self._file_fps[self._file_of] ^ mix
        return fps

    def versioned(self) -> bool:
        return all(self._versions)

    def __len__(self) -> int:
        return len(self.offsets)

    def sizes(self) -> npt.NDArray[np.int64]:
        return self.lengths

    def fetch(self, index: int) -> bytes:
        path = self._path(int(self._file_of[index]))
        start = int(self.offsets[index])
        end = start + int(self.lengths[index])
        data = self._remote.cat(index, path, start, end)
        if len(data) != end - start:
            raise SourceError(f"sample {index}: {self._remote.full_url(path)} ended after "
                              f"{len(data)} of bytes {start}-{end}")
        return data

    def decode(self, data: bytes | memoryview) -> Any:
        return bytes(data)


class DatasetSource:
    """Any map-style dataset whose items are bytes, arrays, tensors or containers of them;
    items are cached with ``lcache.data.codec`` (never pickle).

    It has no listing, so it is identified by the full bytes of a fixed pseudo-random probe
    of its items (``lcache.data.identity``), which also estimates the sizes and refuses a
    dataset whose items differ between two reads (random augmentations).
    """

    def __init__(self, dataset: Any, *, url: str | None = None) -> None:
        self.dataset = dataset
        self.url = url or f"dataset:{type(dataset).__name__}"
        try:
            self._n = len(dataset)
        except TypeError:
            raise ConfigError("the dataset must be map-style (have __len__ and "
                              "__getitem__)") from None
        if self._n == 0:
            raise ConfigError(f"{self.url} is empty")
        self.content, probed = probe_contents(self)
        self._mean = int(np.mean(probed))

    def __len__(self) -> int:
        return self._n

    def sizes(self) -> npt.NDArray[np.int64]:
        return np.full(self._n, self._mean, dtype=np.int64)  # an estimate from the probe

    def fetch(self, index: int) -> bytes:
        t0 = time.perf_counter_ns() if _trace._active is not None else 0
        try:
            item = self.dataset[index]
        except Exception as exc:
            raise SourceError(f"cannot read sample {index} from {self.url}: {exc}") from exc
        data = codec.encode(item)
        if t0:  # offset -1: a dataset item has no byte offset (left out of seq_fraction)
            _trace.record("read", self.url, -1, len(data), "data-source", t0,
                          time.perf_counter_ns() - t0, len(data))
        return data

    def decode(self, data: bytes | memoryview) -> Any:
        return codec.decode(data)


def fetch_many(source: Source, indices: Sequence[int]) -> list[bytes]:
    """The bytes of several samples, in order: the source's own ``fetch_many`` (concurrent or
    coalesced requests) where it has one, else one ``fetch`` each."""
    batch = getattr(source, "fetch_many", None)
    if batch is not None:
        return list(batch(indices))
    return [source.fetch(int(i)) for i in indices]


def as_source(source: Any, **options: Any) -> Source:
    """A Source from a Source, a URL or local path (one object per sample) or a dataset."""
    if isinstance(source, (FileSource, RangeSource, DatasetSource)):
        return source
    if isinstance(source, (str, os.PathLike)):
        return FileSource(os.fspath(source), **options)
    if hasattr(source, "fetch") and hasattr(source, "sizes"):
        return source  # type: ignore[no-any-return]
    return DatasetSource(source, **options)
