"""Where samples come from: objects under an fsspec URL (``FileSource``, or
``ImageFolderSource`` with labels), byte ranges of large files (``RangeSource``), or any
map-style dataset. A source numbers its samples
``0..len-1``, fetches one by number, and several at once with ``fetch_many``.

Remote requests (listing, stat, fetch) go through ``lcache.data.remote.Remote``: concurrent
on an async filesystem, with a timeout, retried on transient errors, traced. Byte ranges are
coalesced per object (``lcache.data.fetch``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import unquote

import numpy as np
import numpy.typing as npt

from lcache.checks import path_argument, seconds
from lcache.data import codec
from lcache.data.fetch import Want, fetch
from lcache.data.identity import probe_contents
from lcache.data.listing import (
    UNKNOWN_SIZE,
    Listing,
    forget_listing,
    given_files,
    kept_listing,
    list_objects,
    listed_size,
    suffix_filter,
)
from lcache.data.remote import (
    FetchOptions,
    Remote,
    SourceChangedError,
    SourceError,
    fingerprint,
    object_version,
    tells_rewrites,
)
from lcache.errors import ConfigError
from lcache.store.index import MAX_INT_KEYS
from lcache.store.layout import format_size
from lcache.trace import recorder as _trace

__all__ = ["DatasetSource", "FileSource", "ImageFolderSource", "RangeSource", "Source",
           "SourceError", "as_source", "fetch_many", "object_version"]


class Source(Protocol):
    """What the cache needs of a source. A source may also offer:

    - ``fetch_many(indices)``: the bytes of several samples in one go (``fetch_many`` below
      falls back to one ``fetch`` each);
    - ``fingerprints(versions=True)``: one uint64 per sample that changes when the sample's
      object is rewritten (from its listing: path, size, ETag or modification time), so a
      cache notices changed samples; with ``versions=False``, of what the index names alone
      (path and size), compared even with ``check=False``. A source without it is
      identified by the contents of a probe of its items (``lcache.data.identity``);
    - ``versioned()``: whether its fingerprints see an object rewritten with the same size
      (a warning says so when they do not);
    - ``known_sizes()``: per sample, the exact length ``fetch`` returns (-1 where not
      known before the fetch); a cached copy of another length is not served;
    - ``path_of(index)``: where the sample lives (a URL, or a shard URL and key), for
      transforms and error messages;
    - ``location``: what besides ``url`` says where the data is (an S3 endpoint): part of
      the cache directory's identity.
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


def _fetch_options(options: dict[str, Any]) -> FetchOptions:
    try:
        return FetchOptions(**options)
    except TypeError:
        known = ", ".join(FetchOptions.__dataclass_fields__)
        raise ConfigError(f"unknown source options {sorted(options)}; a source takes "
                          f"storage_options= and {known}") from None


class FileSource:
    """One object per sample under a directory or prefix (``/data``, ``s3://b/train/``,
    ``http://host/data/``), ordered by path.

    Args:
        url: the directory, prefix or URL.
        files: the objects to serve, in order (names relative to ``url``), instead of a
            listing: names alone are asked for their sizes (concurrently); with sizes
            (``{"a.jpg": 1234}`` or ``[("a.jpg", 1234)]``) nothing is asked, and since no
            version is known either, pass ``fingerprint=`` to the dataset for a safe reuse.
        suffixes: keep only names ending so, ignoring case (``(".jpg", ".png")``).
        storage_options: passed to fsspec.
        cache_dir: keep the listing there for the other ranks of this launch and, within
            ``listing_ttl`` seconds, for later runs (``lcache.data.listing``).
        progress: a progress line while listing (default: on a terminal).
        fetch_options: ``concurrency``, ``retries``, ``timeout``, ``backoff``,
            ``coalesce_gap``, ``max_request`` (``lcache.data.remote.FetchOptions``).
    """

    def __init__(self, url: str, *, files: Sequence[Any] | Mapping[str, int] | None = None,
                 suffixes: Sequence[str] | None = None,
                 storage_options: dict[str, Any] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, listing_ttl: float = 0.0,
                 progress: bool | None = None, **fetch_options: Any) -> None:
        if cache_dir is not None:  # 5 was a TypeError, "\0" a ValueError, from deep inside
            cache_dir = path_argument(cache_dir, "cache_dir")
        self._remote = Remote(url, storage_options, _fetch_options(fetch_options))
        self.url = self._remote.url
        self.location = self._remote.location()
        suffix_filter(suffixes)  # checks them before they are used
        listing_ttl = seconds(listing_ttl, "listing_ttl")
        key = {"kind": type(self).__name__, "url": self.url, "location": self.location,
               "files": files,
               "suffixes": sorted(suffixes) if suffixes else None,
               "storage_options": storage_options}
        # where the listing is kept for later opens (see fetch_many)
        self._kept = None if cache_dir is None else (cache_dir, key)
        with kept_listing(cache_dir, key, listing_ttl) as (listing, keep):
            if listing is None:
                listing = self._list(files, suffixes, progress, cache_dir)
                keep(listing)
        self.paths = listing.paths
        self._sizes = np.maximum(listing.sizes, 0)  # what the plan counts
        self._object_sizes = listing.sizes  # as listed (UNKNOWN_SIZE: not known)
        self._versions = listing.versions

    def _list(self, files: Sequence[Any] | Mapping[str, int] | None,
              suffixes: Sequence[str] | None, progress: bool | None,
              cache_dir: str | None) -> Listing:
        if files is not None:
            listing = given_files(self._remote, files)
            if not listing.paths:
                raise SourceError(f"files= names no samples under {self.url}")
            return listing
        keep = suffix_filter(suffixes)
        infos, others = list_objects(self._remote, lambda p: keep(p) and self._accepts(p),
                                     progress, cache_dir)
        paths = self._order(list(infos))
        if not paths:
            raise SourceError(self._nothing_found(suffixes, others))
        return Listing(paths, np.array([listed_size(infos[p]) for p in paths],
                                       np.int64), [object_version(infos[p]) for p in paths])

    def _accepts(self, path: str) -> bool:
        return True

    def _order(self, paths: list[str]) -> list[str]:
        return sorted(paths)

    def _nothing_found(self, suffixes: Sequence[str] | None, others: list[str]) -> str:
        """Why nothing was found: the filter, and what it left out."""
        what = f"no samples found under {self.url}"
        if suffixes:
            what += f" with suffixes {tuple(suffixes)} (case ignored)"
        if not others:
            return what
        seen = ", ".join(self._relative(p) for p in sorted(others)[:3])
        return f"{what}; it holds {len(others)} other files, e.g. {seen}"

    def _relative(self, path: str) -> str:
        root = self._remote.fs()[1].rstrip("/")
        return path[len(root) + 1:] if path.startswith(root + "/") else path

    def fingerprints(self, versions: bool = True) -> npt.NDArray[np.uint64]:
        """Per sample: its path, size and version (ETag or modification time), or without
        the version: what the sample's index names."""
        return np.array([fingerprint(p, int(n), v if versions else "") for p, n, v in
                         zip(self.paths, self._sizes, self._versions, strict=True)], np.uint64)

    def versioned(self) -> bool:
        """Whether the listing tells rewritten objects apart (an ETag, a modification time
        finer than a second)."""
        return all(tells_rewrites(v) for v in self._versions)

    def known_sizes(self) -> npt.NDArray[np.int64]:
        return np.where(self._object_sizes < 0, -1, self._sizes)

    def __len__(self) -> int:
        return len(self.paths)

    def sizes(self) -> npt.NDArray[np.int64]:
        return self._sizes

    def path_of(self, index: int) -> str:
        """The URL of sample ``index``'s object."""
        return self._remote.full_url(self.paths[index])

    def fetch(self, index: int) -> bytes:
        return self.fetch_many([index])[0]

    def fetch_many(self, indices: Sequence[int]) -> list[bytes]:
        """The objects of ``indices``, fetched concurrently, in order; one whose size is not
        the listed one is an error (it changed since the listing)."""
        sizes = self._object_sizes
        try:
            return fetch(self._remote, [Want(int(i), self.paths[int(i)],
                                             size=None if sizes[int(i)] == UNKNOWN_SIZE
                                             else int(sizes[int(i)]),
                                             version=self._versions[int(i)])
                                        for i in indices])
        except SourceError as exc:
            # An object changed since the kept listing was made: it goes, so that opening
            # the source again lists it anew (within its TTL, every open took it again).
            if self._kept is not None and isinstance(exc.__cause__, SourceChangedError):
                forget_listing(*self._kept)
                self._kept = None
            raise

    def decode(self, data: bytes | memoryview) -> Any:
        return bytes(data)


class ImageFolderSource(FileSource):
    """An ImageNet-style folder, ``root/<class>/**/<image>``: items are ``(bytes, label)``,
    with ``classes`` (sorted folder names) and ``class_to_idx`` as torchvision's
    ``ImageFolder`` has them, and samples in its order (by class, then folder, then name).

    Files directly under the root are not samples; ``suffixes`` defaults to torchvision's
    image extensions (case ignored). The classes are the folders that hold a sample:
    torchvision refuses an empty class folder unless ``allow_empty=True``, which would then
    number it. The label travels with the sample's bytes (4 bytes after them, so the cache
    stores it with its checksum) and is part of the sample's fingerprint: a new class folder
    that renumbers the labels drops the cached samples whose label changed.
    """

    EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

    def __init__(self, url: str, *, suffixes: Sequence[str] | None = EXTENSIONS,
                 **options: Any) -> None:
        super().__init__(url, suffixes=suffixes, **options)
        names = [self._class_of(p) for p in self.paths]
        self.classes = sorted(set(names))
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.labels = np.array([self.class_to_idx[c] for c in names], np.int64)
        self._sizes = self._sizes + _LABEL.itemsize

    def _class_of(self, path: str) -> str:
        name = self._relative(path).split("/", 1)[0]
        # An HTTP listing names "a b/x.jpg" as a%20b/x.jpg: the class is the folder's name.
        return unquote(name) if self.url.startswith(("http://", "https://")) else name

    def _accepts(self, path: str) -> bool:
        return "/" in self._relative(path)

    def _order(self, paths: list[str]) -> list[str]:
        decode = unquote if self.url.startswith(("http://", "https://")) else str

        def key(p: str) -> tuple[str, str, str]:
            folder, _, name = decode(p).rpartition("/")
            return self._class_of(p), folder, name

        return sorted(paths, key=key)

    def fingerprints(self, versions: bool = True) -> npt.NDArray[np.uint64]:
        return np.array([fingerprint(p, int(n), v if versions else "", int(c)) for p, n, v, c in
                         zip(self.paths, self._sizes, self._versions, self.labels,
                             strict=True)], np.uint64)

    def fetch_many(self, indices: Sequence[int]) -> list[bytes]:
        datas = super().fetch_many(indices)
        return [d + int(self.labels[int(i)]).to_bytes(_LABEL.itemsize, "little")
                for i, d in zip(indices, datas, strict=True)]

    def known_sizes(self) -> npt.NDArray[np.int64]:
        return super().known_sizes()  # the labels are counted: said here, below fetch_many

    def decode(self, data: bytes | memoryview) -> tuple[bytes, int]:
        view = memoryview(data)
        cut = len(view) - _LABEL.itemsize
        return bytes(view[:cut]), int.from_bytes(view[cut:], "little")


_LABEL = np.dtype("<u4")


def _mix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """MurmurHash3's 64-bit finalizer, on an array: a bijection that spreads every bit of
    the input over the output (no two inputs share an output)."""
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xFF51AFD7ED558CCD)
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xC4CEB9FE1A85EC53)
    return x ^ (x >> np.uint64(33))


def _column(values: Any, name: str) -> npt.NDArray[np.int64]:
    """A RangeSource's ``offsets`` or ``lengths`` as int64: whole numbers below 2**62 (a
    float was cut to an int, a string was a bare ValueError, 2**63 an OverflowError)."""
    column = np.asarray(values)
    if column.ndim != 1 or (column.dtype.kind not in "iu" and len(column)):
        raise ConfigError(f"{name}: give a list or array of whole numbers, one per sample")
    if len(column) and int(column.max()) >= 1 << 62:
        raise ConfigError(f"{name}: {int(column.max())} is beyond any file (2**62 bytes)")
    return column.astype(np.int64)


def _check_table(url: str, offsets: npt.NDArray[np.int64],
                 lengths: npt.NDArray[np.int64]) -> None:
    if len(offsets) == 0:
        raise ConfigError(f"no samples given for {url}")
    if (offsets < 0).any() or (lengths <= 0).any():
        raise ConfigError("offsets must be >= 0 and lengths > 0")


class RangeSource:
    """Samples as byte ranges of large files (token files, tar shards): sample ``i`` is
    ``length[i]`` bytes at ``offset[i]`` of ``path[i]`` (paths relative to ``url``).

    ``fetch_many`` coalesces the ranges of one file that lie within ``coalesce_gap`` of
    each other into one request (``lcache.data.fetch``).
    """

    #: 2: a row's file, offset and length mixed non-linearly (1, unnamed: linearly, which
    #: an edited table could solve for); caches of another scheme fetch their samples again
    fingerprint_scheme = 2

    def __init__(self, url: str, paths: Sequence[str] | str,
                 offsets: Sequence[int] | npt.NDArray[np.int64],
                 lengths: Sequence[int] | npt.NDArray[np.int64], *,
                 storage_options: dict[str, Any] | None = None, **fetch_options: Any) -> None:
        remote = Remote(url, storage_options, _fetch_options(fetch_options))
        offsets, lengths = _column(offsets, "offsets"), _column(lengths, "lengths")
        n = len(offsets)
        try:  # paths=5 was a bare TypeError
            names: list[Any] = [paths] * n if isinstance(paths, str) else list(paths)
        except TypeError:
            names = [paths]
        if not all(isinstance(name, str) for name in names):
            raise ConfigError(f"paths={paths!r:.200}: give a file name, or a list of one "
                              "per sample, relative to the URL")
        if len(names) != n or len(lengths) != n:
            raise ConfigError("paths, offsets and lengths must have one entry per sample")
        _check_table(url, offsets, lengths)
        files = sorted(set(names))
        lookup = {name: i for i, name in enumerate(files)}
        file_of = np.array([lookup[p] for p in names], dtype=np.int32)
        infos = remote.infos([remote.path(f) for f in files])
        self._setup(remote, files, infos, file_of, offsets, lengths)

    def _setup(self, remote: Remote, files: list[str], infos: Sequence[dict[str, Any]],
               file_of: npt.ArrayLike, offsets: npt.ArrayLike, lengths: npt.ArrayLike) -> None:
        """The table: ``files`` (names under the URL) with their fsspec ``infos``, and per
        sample its file (an index into ``files``), offset and length."""
        self.url = remote.url
        self.location = remote.location()
        self._remote = remote
        self._files = list(files)
        self._file_of = np.asarray(file_of, dtype=np.int32)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        _check_table(self.url, self.offsets, self.lengths)
        self._paths = [remote.path(f) for f in self._files]
        folders = [f for f, info in zip(self._files, infos, strict=True)
                   if info.get("type") == "directory"]
        if folders:
            raise ConfigError(f"{folders[0]!r} under {self.url} is a folder, not a file whose "
                              "byte ranges are samples")
        file_sizes = np.array([int(info.get("size") or 0) for info in infos], np.int64)
        ends = self.offsets + self.lengths
        beyond = np.flatnonzero(ends > file_sizes[self._file_of])
        if len(beyond):
            i = int(beyond[0])
            raise ConfigError(f"sample {i}: bytes {self.offsets[i]}-{ends[i]} lie beyond the end "
                              f"of {self._files[self._file_of[i]]} ({file_sizes[self._file_of[i]]}"
                              f" bytes); {len(beyond)} samples do")
        self._versions = [object_version(info) for info in infos]
        self._file_sizes = [int(n) for n in file_sizes]
        self._file_fps = np.array([fingerprint(f, n, v) for f, n, v in
                                   zip(self._files, self._file_sizes, self._versions,
                                       strict=True)], np.uint64)

    def fingerprints(self, versions: bool = True) -> npt.NDArray[np.uint64]:
        """Per sample: its file's path, size and version (unless ``versions`` is False),
        mixed with its offset and length."""
        files = self._file_fps if versions else np.array(
            [fingerprint(f, n, "") for f, n in zip(self._files, self._file_sizes, strict=True)],
            np.uint64)
        # Why nested mixing, not a sum or xor of products: an edited table found (offset,
        # length) pairs with the old sample's fingerprint in a second. For a file and a length
        # this is a bijection of the offset (and the other way round), so a row moved within
        # its file always changes; a hit whose length is not the row's is refused anyway.
        with np.errstate(over="ignore"):
            inner = _mix64(files[self._file_of] ^ _mix64(self.offsets.astype(np.uint64)
                                                         + np.uint64(0x9E3779B97F4A7C15)))
            return _mix64(inner ^ self.lengths.astype(np.uint64))

    def known_sizes(self) -> npt.NDArray[np.int64]:
        return self.lengths

    def versioned(self) -> bool:
        return all(tells_rewrites(v) for v in self._versions)

    def __len__(self) -> int:
        return len(self.offsets)

    def sizes(self) -> npt.NDArray[np.int64]:
        return self.lengths

    def shards(self) -> npt.NDArray[np.int32]:
        """Per sample, the number of the file it lies in (for a shard-local order)."""
        return self._file_of

    def path_of(self, index: int) -> str:
        """``URL#bytes=START-END`` of sample ``index``."""
        start = int(self.offsets[index])
        return (f"{self._remote.full_url(self._paths[self._file_of[index]])}"
                f"#bytes={start}-{start + int(self.lengths[index])}")

    def fetch(self, index: int) -> bytes:
        return self.fetch_many([index])[0]

    def fetch_many(self, indices: Sequence[int]) -> list[bytes]:
        """The ranges of ``indices``, in order: nearby ranges of one file in one request,
        requests concurrent, each response's length checked, and ``check`` run on each."""
        wants = []
        for i in indices:
            i = int(i)
            start, f = int(self.offsets[i]), self._file_of[i]
            wants.append(Want(i, self._paths[f], start, start + int(self.lengths[i]),
                              self._file_sizes[f], self._versions[f]))
        return fetch(self._remote, wants, self.check)

    def check(self, index: int, data: bytes) -> None:
        """Refuse sample ``index``'s fetched bytes if they are not what its format says
        (a format with checksums overrides this); plain ranges carry nothing to check."""

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
        except (OverflowError, ValueError) as exc:  # a __len__ past sys.maxsize, or below 0
            raise ConfigError(f"{self.url}: its __len__ is not a length ({exc})") from None
        if self._n == 0:
            raise ConfigError(f"{self.url} is empty")
        # The cache holds tables of a few bytes per sample (sizes, plan, order), and its
        # store's int keys are sample indices: a __len__ of 10**12 failed in numpy instead
        # ("Unable to allocate 7.28 TiB").
        from lcache.bench.resources import need_memory  # lazily: the bench package is large

        table = self._n * np.dtype(np.int64).itemsize
        what = f"the per-sample size table of {self.url} ({self._n:,} samples, its __len__)"
        fix = "check its __len__, or cache a part of it (torch.utils.data.Subset)"
        need_memory(table, what, f"its length: {fix}")
        if self._n > MAX_INT_KEYS:
            raise ConfigError(f"{what} needs about {format_size(table)} of memory, and a cache "
                              f"holds at most {MAX_INT_KEYS:,} samples; {fix}")
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

    def path_of(self, index: int) -> str:
        return f"{self.url}#{index}"

    def decode(self, data: bytes | memoryview) -> Any:
        return codec.decode(data)


def fetch_many(source: Source, indices: Sequence[int]) -> list[bytes]:
    """The bytes of several samples, in order: the source's own ``fetch_many`` (concurrent,
    coalesced requests) where it has one, else one ``fetch`` each. A subclass that overrides
    ``fetch`` but not ``fetch_many`` (to log or alter fetches) has its ``fetch`` called."""
    batch = getattr(source, "fetch_many", None)
    if batch is not None and _defined_below(type(source), "fetch_many", "fetch"):
        return list(batch(indices))
    return [source.fetch(int(i)) for i in indices]


def known_sizes(source: Source) -> npt.NDArray[np.int64] | None:
    """The source's ``known_sizes()`` (the exact length of each sample's fetched bytes, -1
    where not known), or None: it has none, or a subclass changed what ``fetch`` or
    ``fetch_many`` return below the class that knows the sizes (a source that decompresses
    what it fetched: each hit had another length and was dropped)."""
    sizes = getattr(source, "known_sizes", None)
    if sizes is None or not all(_defined_below(type(source), "known_sizes", name)
                                for name in ("fetch", "fetch_many")):
        return None
    known: npt.NDArray[np.int64] = sizes()
    return known


def _defined_below(cls: type, name: str, other: str) -> bool:
    """Whether ``cls`` gets ``name`` from the class that defines ``other`` or a subclass."""
    def owner(attr: str) -> type | None:
        return next((k for k in cls.__mro__ if attr in k.__dict__), None)

    mine, theirs = owner(name), owner(other)
    return mine is not None and (theirs is None or issubclass(mine, theirs))


def as_source(source: Any, *, cache_dir: str | os.PathLike[str] | None = None,
              **options: Any) -> Source:
    """A Source from a Source, a URL or local path (one object per sample, its listing kept
    in ``cache_dir``) or a dataset."""
    if isinstance(source, (FileSource, RangeSource, DatasetSource)):
        return source
    if isinstance(source, (str, os.PathLike)):
        return FileSource(os.fspath(source), cache_dir=cache_dir, **options)
    if hasattr(source, "fetch") and hasattr(source, "sizes"):
        return source  # type: ignore[no-any-return]
    return DatasetSource(source, **options)
