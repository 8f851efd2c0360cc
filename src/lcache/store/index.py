"""The node-wide index: key -> (segment, offset, record length), shared through ``mmap``.

Two memory-mapped files sit in the store directory, each replaced whole by a new generation
when ``fsck --repair`` rebuilds it (see ``files.py``):

* ``index-int-G.bin`` (this module): a flat array for dense integer keys, 16 bytes per key, no
  hashing, no Python object per entry. It grows in place (a sparse file) when a larger key is
  put; readers notice the longer file.
* ``index-bytes-G.bin`` (``hashindex.py``): a hash table for byte-string keys, fully allocated,
  grown into a new generation when it gets crowded.

Readers never lock. An entry is two 8-byte words written separately, so a reader can see a torn
entry; the record header check at the read turns that into a miss (see ``record.py``). Writers
of either index serialize with ``flock`` on its file, which the kernel drops if the process
dies, so two writers of one key never leave a torn entry behind.

The int index is sparse, and no page of it is touched through the map before it has blocks:
writers allocate a page (``posix_fallocate``) before storing into it, readers ask the file
(``SEEK_DATA``) before reading a page not known to have blocks, and scans read only the data
extents. On tmpfs even a read of a hole needs a new page, which a full filesystem answers
with SIGBUS.

A location is packed into one u64: ``segment_id << 32 | offset``; 0 means empty (segment ids
start at 1).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt

from lcache.errors import ConfigError, CorruptionError
from lcache.io import close_file, sync_fd
from lcache.store.files import (
    Generations,
    allocate,
    current_generation,
    generation_path,
    open_in_store,
    publish_generation,
)

INDEX_HEADER = 4096
VERSION = 2
HDR = struct.Struct("<4sIQQ")  # magic, version, entries (int) or slots (hash), used (hash)
USED_FIELD = struct.Struct("<Q")
USED_OFFSET = 16

INT_ENTRY = np.dtype([("loc", "<u8"), ("length", "<u4"), ("ref", "u1"), ("pad", "u1", (3,))])
MAX_INT_KEYS = 1 << 36  # a 1 TiB sparse index; larger keys should be byte keys
INITIAL_INT_KEYS = 1 << 16

U64Array = npt.NDArray[np.uint64]
_PAGE = mmap.PAGESIZE


def pack_loc(segment: int, offset: int) -> int:
    return (segment << 32) | offset


def unpack_loc(loc: int) -> tuple[int, int]:
    return loc >> 32, loc & 0xFFFFFFFF


def damaged(root: str, path: str, why: str) -> CorruptionError:
    return CorruptionError(f"{path} is damaged ({why}); run `lcache fsck --repair {root}` to "
                           "rebuild it from the segments")


def missing(root: str, path: str) -> CorruptionError:
    return CorruptionError(f"{path} is missing while segments hold records; run "
                           f"`lcache fsck --repair {root}` to rebuild it from the segments")


def new_index_file(path: str, magic: bytes, count: int, data_bytes: int,
                   dense: bool) -> tuple[str, int]:
    """A complete empty index under a temp name beside ``path``: (temp path, open fd).

    ``dense``: every block allocated now (the hash table); otherwise only the header page is,
    and pages get blocks as entries are stored (the int array).
    """
    tmp = f"{path}.tmp{os.getpid()}"
    if os.path.lexists(tmp):  # a killed process of the same pid left it
        os.unlink(tmp)
    fd = open_in_store(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        allocate(fd, tmp, 0, INDEX_HEADER + data_bytes if dense else INDEX_HEADER)
        os.pwrite(fd, HDR.pack(magic, VERSION, count, 0), 0)
        os.ftruncate(fd, INDEX_HEADER + data_bytes)
    except BaseException:
        close_file(fd)
        os.unlink(tmp)
        raise
    return tmp, fd


def finish_index_file(root: str, meta: Generations, stem: str, tmp: str, fd: int,
                      gen: int) -> str:
    """Sync a built index and publish it as generation ``gen`` (meta lock held)."""
    try:
        sync_fd(fd, False, "cache-meta")
    finally:
        close_file(fd)
    return publish_generation(root, meta, stem, tmp, gen)


def open_index_file(root: str, path: str, magic: bytes) -> tuple[int, int, int]:
    """Open an index file and check its header: (fd, entries or slots, size)."""
    fd = open_in_store(path, os.O_RDWR)
    try:
        # The header before the size: the int index is extended before its header says so.
        head = os.pread(fd, HDR.size, 0)
        size = os.fstat(fd).st_size
        if size < INDEX_HEADER or len(head) < HDR.size:
            raise damaged(root, path, f"bad header: {size} bytes, shorter than its header")
        got_magic, version, count, _ = HDR.unpack(head)
        if got_magic != magic or version != VERSION:
            raise damaged(root, path, "bad header: not an lcache index of this version")
    except BaseException:
        close_file(fd)
        raise
    return fd, count, size


def _has_blocks(fd: int, page: int) -> bool:
    """Whether a page of the file has blocks (so reading it through the map is safe)."""
    try:
        return os.lseek(fd, page * _PAGE, os.SEEK_DATA) == page * _PAGE
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no data at or after it
            return False
        raise


@contextmanager
def file_locked(fd: int, tlock: threading.Lock) -> Iterator[None]:
    """Exclusive against other threads (``tlock``) and processes (``flock``; the kernel drops
    it if the holder dies)."""
    with tlock:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


class _IntMap:
    """One mapping of one generation of the int index file."""

    def __init__(self, gen: int, path: str, fd: int, backed: npt.NDArray[np.uint8]) -> None:
        self.gen, self.path, self.fd = gen, path, fd
        size = os.fstat(fd).st_size
        self.mm = mmap.mmap(fd, size)
        arr = np.frombuffer(self.mm, dtype=INT_ENTRY, offset=INDEX_HEADER)
        self.loc: U64Array = arr["loc"]
        self.length = arr["length"]
        self.ref = arr["ref"]
        self.capacity = len(arr)
        pages = (size + _PAGE - 1) // _PAGE
        # 1 = the page is known to have blocks (allocation never shrinks in a generation)
        self.backed = np.zeros(pages, np.uint8)
        self.backed[: min(pages, len(backed))] = backed[:pages]
        self.backed[0] = 1  # the header page: its magic was read, so it has blocks

    def pages(self, keys: U64Array) -> npt.NDArray[np.int64]:
        item = INT_ENTRY.itemsize  # divides the page size: an entry never straddles pages
        return ((INDEX_HEADER + keys.astype(np.int64) * item) // _PAGE).astype(np.int64)

    def present(self, keys: U64Array) -> npt.NDArray[np.bool_]:
        """Which of ``keys`` (all < capacity) lie in pages with blocks."""
        pages = self.pages(keys)
        known: npt.NDArray[np.bool_] = self.backed[pages] != 0
        if not known.all():
            for page in np.unique(pages[~known]).tolist():
                if _has_blocks(self.fd, page):
                    self.backed[page] = 1
            known = self.backed[pages] != 0
        return known

    def page_ok(self, key: int) -> bool:
        page = (INDEX_HEADER + key * INT_ENTRY.itemsize) // _PAGE
        if self.backed[page]:
            return True
        if _has_blocks(self.fd, page):
            self.backed[page] = 1
            return True
        return False

    def back(self, keys: U64Array) -> None:
        """Allocate the pages holding these keys' entries before storing into them."""
        pages = self.pages(keys)
        for page in np.unique(pages[self.backed[pages] == 0]).tolist():
            allocate(self.fd, self.path, page * _PAGE, min(_PAGE, len(self.mm) - page * _PAGE))
            self.backed[page] = 1

    def extents(self) -> Iterator[tuple[int, int]]:
        """[first, end) key ranges of the file's data extents (the holes are all empty)."""
        item = INT_ENTRY.itemsize
        pos, size = INDEX_HEADER, INDEX_HEADER + self.capacity * item
        while pos < size:
            try:
                start = os.lseek(self.fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    return
                raise
            if start >= size:
                return
            end = min(os.lseek(self.fd, start, os.SEEK_HOLE), size)
            self.backed[start // _PAGE : (end + _PAGE - 1) // _PAGE] = 1
            yield (start - INDEX_HEADER) // item, (end - INDEX_HEADER) // item
            pos = end


class IntIndex:
    """Flat array index for integer keys (a sparse file)."""

    MAGIC = b"LCII"
    STEM = "index-int"

    def __init__(self, root: str, meta: Generations, initial_keys: int = INITIAL_INT_KEYS,
                 create: bool = True) -> None:
        """Open the current generation; the caller holds the store's meta lock.

        Raises:
            CorruptionError: the file is damaged, or missing and ``create`` is false.
        """
        self.root = root
        self._meta = meta
        self._tlock = threading.Lock()
        self._switch = threading.Lock()
        self._dirty = False  # this process changed entries since its last flush
        gen = current_generation(root, meta, self.STEM)
        path = generation_path(root, self.STEM, gen)
        if not os.path.lexists(path):
            if not create:
                raise missing(root, path)
            tmp, fd = new_index_file(path, self.MAGIC, initial_keys,
                                     initial_keys * INT_ENTRY.itemsize, dense=False)
            finish_index_file(root, meta, self.STEM, tmp, fd, gen)
        self._t = self._open(gen)

    def _open(self, gen: int) -> _IntMap:
        path = generation_path(self.root, self.STEM, gen)
        if not os.path.lexists(path):
            raise missing(self.root, path)
        fd, count, size = open_index_file(self.root, path, self.MAGIC)
        data = size - INDEX_HEADER
        item = INT_ENTRY.itemsize
        # Longer than the header says is a growth cut short by a crash (the file is extended
        # first): usable. Shorter, or not whole entries, is damage.
        if data % item or data < count * item:
            close_file(fd)
            raise damaged(self.root, path, f"{size} bytes, but the header says "
                          f"{INDEX_HEADER} + {count} x {item}")
        return _IntMap(gen, path, fd, np.zeros(0, np.uint8))

    # ------------------------------------------------------------------ the current mapping
    def _map(self) -> _IntMap:
        t = self._t
        if self._meta.generation(self.STEM) != t.gen:  # fsck --repair published a rebuild
            with self._switch:
                t = self._t
                if self._meta.generation(self.STEM) != t.gen:
                    new = self._open(self._meta.generation(self.STEM))
                    close_file(t.fd)
                    self._t = t = new
        return t

    def _refresh(self, t: _IntMap) -> _IntMap:
        """Another process may have grown the file: map it again if so."""
        if os.fstat(t.fd).st_size > INDEX_HEADER + t.capacity * INT_ENTRY.itemsize:
            with self._switch:
                if self._t is t:
                    self._t = _IntMap(t.gen, t.path, t.fd, t.backed)
                t = self._t
        return t

    @property
    def capacity(self) -> int:
        return self._map().capacity

    # ------------------------------------------------------------------ growth
    def grow(self, key: int) -> None:
        """Make room for ``key``; the caller holds the store's meta lock."""
        if key >= MAX_INT_KEYS:
            raise ConfigError(f"int key {key} is too large for the flat index; use byte keys")
        t = self._refresh(self._map())
        if key < t.capacity:
            return
        new = max(key + 1, t.capacity * 2)
        os.ftruncate(t.fd, INDEX_HEADER + new * INT_ENTRY.itemsize)
        os.pwrite(t.fd, HDR.pack(self.MAGIC, VERSION, new, 0), 0)
        self._refresh(t)

    # ------------------------------------------------------------------ reads
    def lookup(self, key: int) -> tuple[int, int] | None:
        t = self._map()
        if key >= t.capacity:
            t = self._refresh(t)
            if key >= t.capacity:
                return None
        if not t.page_ok(key):
            return None
        loc = int(t.loc[key])
        return (loc, int(t.length[key])) if loc else None

    def lookup_many(self, keys: U64Array) -> tuple[U64Array, npt.NDArray[np.uint32]]:
        t = self._map()
        if len(keys) and int(keys.max()) >= t.capacity:
            t = self._refresh(t)
        inside = keys < t.capacity
        safe = np.where(inside, keys, 0)
        ok = inside & t.present(safe)
        safe = np.where(ok, safe, 0)
        locs = np.where(ok, t.loc[safe], 0).astype(np.uint64)
        lens = np.where(ok, t.length[safe], 0).astype(np.uint32)
        return locs, lens

    def referenced(self, keys: U64Array) -> npt.NDArray[np.bool_]:
        t = self._map()
        inside = keys < t.capacity
        safe = np.where(inside, keys, 0)
        ok = inside & t.present(safe)
        return np.where(ok, t.ref[np.where(ok, safe, 0)] != 0, False)

    def items(self) -> Iterator[tuple[int, int, int]]:
        """(key, loc, length) of every used entry."""
        t = self._map()
        for first, end in t.extents():
            for k in (first + np.flatnonzero(t.loc[first:end])).tolist():
                yield k, int(t.loc[k]), int(t.length[k])

    def live_count(self) -> int:
        t = self._map()
        return sum(int(np.count_nonzero(t.loc[a:b])) for a, b in t.extents())

    # ------------------------------------------------------------------ writes
    def set(self, key: int, loc: int, length: int) -> None:
        self.set_many(np.array([key], np.uint64), np.array([loc], np.uint64),
                      np.array([length], np.uint32))

    def set_many(self, keys: U64Array, locs: U64Array, lens: npt.NDArray[np.uint32]) -> None:
        t = self._map()
        if len(keys):
            t.back(keys)
        # Why the lock: two processes putting one key would otherwise interleave their two
        # words and leave an entry that no record matches (a permanent miss).
        # Why loc = 0 first: a process killed between the two words would otherwise leave the
        # old location with the new length, an entry no record matches; now it is a miss.
        self._dirty = True
        with file_locked(t.fd, self._tlock):
            t.loc[keys] = 0
            t.length[keys] = lens
            t.ref[keys] = 0
            t.loc[keys] = locs

    def remove(self, key: int, expected_loc: int | None = None) -> bool:
        t = self._map()
        if key >= t.capacity:
            t = self._refresh(t)
            if key >= t.capacity:
                return False
        if not t.page_ok(key):
            return False
        with file_locked(t.fd, self._tlock):
            loc = int(t.loc[key])
            if loc == 0 or (expected_loc is not None and loc != expected_loc):
                return False
            t.loc[key] = 0
            self._dirty = True
            return True

    def move(self, key: int, old: int, new: int) -> bool:
        """Point ``key`` from its record at ``old`` to a copy of it at ``new`` (same length),
        clearing its reference bit; False, and nothing done, if it no longer points at
        ``old`` (put or removed meanwhile). One 8-byte store: a reader, or a kill, sees the
        old location or the new one, never an empty entry (``set`` empties it first)."""
        t = self._map()
        if key >= t.capacity or not t.page_ok(key):
            return False
        with file_locked(t.fd, self._tlock):
            if int(t.loc[key]) != old:
                return False
            t.loc[key] = new
            t.ref[key] = 0
            self._dirty = True
            return True

    def remove_many(self, keys: U64Array, expected_locs: U64Array) -> U64Array:
        """Remove the entries of ``keys`` that still hold ``expected_locs``; returns their
        keys."""
        t = self._map()
        inside = keys < t.capacity
        keys, expected_locs = keys[inside], expected_locs[inside]
        ok = t.present(keys)
        keys, expected_locs = keys[ok], expected_locs[ok]
        with file_locked(t.fd, self._tlock):
            hit = t.loc[keys] == expected_locs
            removed: U64Array = keys[hit]
            t.loc[removed] = 0
        self._dirty |= len(removed) > 0
        return removed

    def touch_many(self, keys: U64Array) -> None:
        t = self._map()
        if len(keys) == 1:  # the DataLoader's one sample at a time: no array work
            key = int(keys[0])
            if key < t.capacity and t.page_ok(key):
                t.ref[key] = 1
            return
        keys = keys[keys < t.capacity]
        t.ref[keys[t.present(keys)]] = 1

    def clear_segment(self, segment: int, from_offset: int = 0) -> list[int]:
        """Remove entries pointing into ``segment`` at or past ``from_offset``; returns their
        keys."""
        lo, hi = pack_loc(segment, from_offset), pack_loc(segment + 1, 0)
        t = self._map()
        removed: list[int] = []
        for first, end in list(t.extents()):
            part = t.loc[first:end]
            hit = (part >= lo) & (part < hi)
            if hit.any():
                part[hit] = 0
                removed += (first + np.flatnonzero(hit)).tolist()
        self._dirty |= bool(removed)
        return removed

    # ------------------------------------------------------------------ rebuilding
    @classmethod
    def rebuild(cls, root: str, meta: Generations, keys: U64Array, locs: U64Array,
                lens: npt.NDArray[np.uint32]) -> None:
        """Publish a new generation holding exactly these entries (meta lock held)."""
        stem = cls.STEM
        gen = current_generation(root, meta, stem) + 1
        count = max(INITIAL_INT_KEYS, int(keys.max()) + 1 if len(keys) else 0)
        tmp, fd = new_index_file(generation_path(root, stem, gen), cls.MAGIC, count,
                                 count * INT_ENTRY.itemsize, dense=False)
        try:
            t = _IntMap(gen, tmp, fd, np.zeros(0, np.uint8))
            if len(keys):
                t.back(keys)
                t.loc[keys] = locs
                t.length[keys] = lens
            t.mm.flush()
        except BaseException:
            close_file(fd)
            os.unlink(tmp)
            raise
        finish_index_file(root, meta, stem, tmp, fd, gen)

    # ------------------------------------------------------------------ housekeeping
    def bytes_on_disk(self) -> int:
        return os.fstat(self._map().fd).st_blocks * 512

    def flush(self) -> None:
        """Make this process's changes durable (msync; skipped when it made none)."""
        if self._dirty:
            self._dirty = False
            self._t.mm.flush()

    def close(self) -> None:
        close_file(self._t.fd)

    @property
    def fd(self) -> int:
        """The descriptor of the file in use (a forked child closes the parent's)."""
        return self._t.fd
