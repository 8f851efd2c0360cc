"""The node-wide index: key -> (segment, offset, record length), shared through ``mmap``.

Two memory-mapped files sit in the store directory:

* ``index-int.bin``: a flat array for dense integer keys, 16 bytes per key, no hashing, no
  Python object per entry. It grows (sparse file) when a larger key is put.
* ``index-bytes.bin``: an open-addressing hash table (linear probing) for byte-string keys,
  keyed by xxh3-64 of the key; 24 bytes per slot, fixed number of slots.

Readers never lock. An entry is two 8-byte words written separately, so a reader can see a torn
entry; the record header check at the read turns that into a miss (see ``record.py``). Writers
of either index serialize with ``flock`` on its file, which the kernel drops if the process
dies, so two writers of one key never leave a torn entry behind.

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
from contextlib import AbstractContextManager, contextmanager

import numpy as np
import numpy.typing as npt

from lcache.errors import ConfigError, CorruptionError, DiskFullError, IndexFullError

INDEX_HEADER = 4096
_HDR = struct.Struct("<4sIQ")  # magic, version, slots (hash table) or 0

INT_ENTRY = np.dtype([("loc", "<u8"), ("length", "<u4"), ("ref", "u1"), ("pad", "u1", (3,))])
HASH_ENTRY = np.dtype(
    [("hash", "<u8"), ("loc", "<u8"), ("length", "<u4"), ("ref", "u1"), ("state", "u1"),
     ("pad", "u1", (2,))]
)
MAX_INT_KEYS = 1 << 36  # a 1 TiB sparse index; larger keys should be byte keys
EMPTY, USED = 0, 1

U64Array = npt.NDArray[np.uint64]


def pack_loc(segment: int, offset: int) -> int:
    return (segment << 32) | offset


def unpack_loc(loc: int) -> tuple[int, int]:
    return loc >> 32, loc & 0xFFFFFFFF


_PAGE = mmap.PAGESIZE


def _back(fd: int, path: str, start: int, end: int) -> None:
    """Give the file blocks under bytes [start, end) before they are stored to through the map.

    Why: the index files are sparse, and a store into a hole of a shared mapping needs a new
    block; on a full filesystem the kernel answers with SIGBUS, which kills the process instead
    of raising DiskFullError. ``posix_fallocate`` asks for the block first, where it can fail.
    """
    start = start // _PAGE * _PAGE
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"no space left on the device for the index {path}") from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def _create(path: str, magic: bytes, slots: int, data_bytes: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.pwrite(fd, _HDR.pack(magic, 1, slots), 0)
        os.ftruncate(fd, INDEX_HEADER + data_bytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _open_checked(path: str, magic: bytes) -> tuple[int, int]:
    """Open an index file, check its header; returns (fd, slots field)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    head = os.pread(fd, _HDR.size, 0)
    if len(head) < _HDR.size or _HDR.unpack(head)[0] != magic or _HDR.unpack(head)[1] != 1:
        os.close(fd)
        raise CorruptionError(
            f"{path} is not an lcache index (bad header); run 'lcache fsck --repair' to rebuild it"
        )
    return fd, _HDR.unpack(head)[2]


@contextmanager
def _file_locked(fd: int, tlock: threading.Lock) -> Iterator[None]:
    """Exclusive against other threads (``tlock``) and processes (``flock``; the kernel drops
    it if the holder dies)."""
    with tlock:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


class IntIndex:
    """Flat array index for integer keys."""

    MAGIC = b"LCII"

    def __init__(self, path: str, initial_keys: int = 1 << 16) -> None:
        self.path = path
        if not os.path.exists(path):
            _create(path, self.MAGIC, 0, initial_keys * INT_ENTRY.itemsize)
        self._fd, _ = _open_checked(path, self.MAGIC)
        self._tlock = threading.Lock()
        self._map()

    def _map(self) -> None:
        size = os.fstat(self._fd).st_size
        self._mm = mmap.mmap(self._fd, size)
        arr = np.frombuffer(self._mm, dtype=INT_ENTRY, offset=INDEX_HEADER)
        self._arr = arr
        self._loc: U64Array = arr["loc"]
        self._len = arr["length"]
        self._ref = arr["ref"]
        self.capacity = len(arr)
        pages = (size + _PAGE - 1) // _PAGE
        old = getattr(self, "_backed", bytearray())
        # 1 = the page is known to have blocks (allocation never shrinks); a bytearray so
        # the hot path checks a range with one C-level find().
        self._backed = old[:pages] + bytearray(max(0, pages - len(old)))

    def _back_keys(self, keys: U64Array) -> None:
        """Allocate the pages holding these keys' entries (see ``_back``)."""
        item = INT_ENTRY.itemsize  # divides the page size: an entry never straddles pages
        first, last = (int(keys[0]),) * 2 if len(keys) == 1 else (int(keys.min()),
                                                                  int(keys.max()))
        lo = (INDEX_HEADER + first * item) // _PAGE
        hi = (INDEX_HEADER + last * item) // _PAGE
        if self._backed.find(0, lo, hi + 1) < 0:
            return
        pages = np.unique((INDEX_HEADER + keys.astype(np.uint64) * np.uint64(item)) // _PAGE)
        for page in pages.tolist():
            if not self._backed[page]:
                _back(self._fd, self.path, page * _PAGE, min((page + 1) * _PAGE, len(self._mm)))
                self._backed[page] = 1

    def _refresh(self) -> None:
        """Another process may have grown the file: map it again if so."""
        if os.fstat(self._fd).st_size > INDEX_HEADER + self.capacity * INT_ENTRY.itemsize:
            self._map()

    def grow(self, key: int) -> None:
        """Make room for ``key``; the caller holds the store's meta lock."""
        if key >= MAX_INT_KEYS:
            raise ConfigError(f"int key {key} is too large for the flat index; use byte keys")
        self._refresh()
        if key < self.capacity:
            return
        new = max(key + 1, self.capacity * 2)
        os.ftruncate(self._fd, INDEX_HEADER + new * INT_ENTRY.itemsize)
        self._map()

    def lookup(self, key: int) -> tuple[int, int] | None:
        if key >= self.capacity:
            self._refresh()
            if key >= self.capacity:
                return None
        loc = int(self._loc[key])
        return (loc, int(self._len[key])) if loc else None

    def lookup_many(self, keys: U64Array) -> tuple[U64Array, npt.NDArray[np.uint32]]:
        if len(keys) and int(keys.max()) >= self.capacity:
            self._refresh()
        inside = keys < self.capacity
        safe = np.where(inside, keys, 0)
        locs = np.where(inside, self._loc[safe], 0).astype(np.uint64)
        lens = np.where(inside, self._len[safe], 0).astype(np.uint32)
        return locs, lens

    def set(self, key: int, loc: int, length: int) -> None:
        self.set_many(np.array([key], np.uint64), np.array([loc], np.uint64),
                      np.array([length], np.uint32))

    def set_many(self, keys: U64Array, locs: U64Array, lens: npt.NDArray[np.uint32]) -> None:
        if len(keys):
            self._back_keys(keys)
        # Why the lock: two processes putting one key would otherwise interleave their two
        # words and leave an entry that no record matches (a permanent miss).
        # Why loc = 0 first: a process killed between the two words would otherwise leave the
        # old location with the new length, an entry no record matches; now it is a miss.
        with _file_locked(self._fd, self._tlock):
            self._loc[keys] = 0
            self._len[keys] = lens
            self._ref[keys] = 0
            self._loc[keys] = locs

    def remove(self, key: int, expected_loc: int | None = None) -> bool:
        if key >= self.capacity:
            self._refresh()
            if key >= self.capacity:
                return False
        with _file_locked(self._fd, self._tlock):
            loc = int(self._loc[key])
            if loc == 0 or (expected_loc is not None and loc != expected_loc):
                return False
            self._loc[key] = 0
            return True

    def remove_many(self, keys: U64Array, expected_locs: U64Array) -> int:
        """Remove the entries of ``keys`` that still hold ``expected_locs``; returns how many."""
        inside = keys < self.capacity
        keys, expected_locs = keys[inside], expected_locs[inside]
        with _file_locked(self._fd, self._tlock):
            hit = self._loc[keys] == expected_locs
            self._loc[keys[hit]] = 0
        return int(np.count_nonzero(hit))

    def touch_many(self, keys: U64Array) -> None:
        self._ref[keys[keys < self.capacity]] = 1

    def referenced(self, keys: U64Array) -> npt.NDArray[np.bool_]:
        inside = keys < self.capacity
        safe = np.where(inside, keys, 0)
        return np.where(inside, self._ref[safe] != 0, False)

    def items(self) -> Iterator[tuple[int, int, int]]:
        """(key, loc, length) of every used entry."""
        keys = np.flatnonzero(self._loc)
        for k in keys:
            yield int(k), int(self._loc[k]), int(self._len[k])

    def clear_segment(self, segment: int, from_offset: int = 0) -> int:
        """Remove entries pointing into ``segment`` at or past ``from_offset``; returns count."""
        lo, hi = pack_loc(segment, from_offset), pack_loc(segment + 1, 0)
        hit = (self._loc >= lo) & (self._loc < hi)
        n = int(np.count_nonzero(hit))
        if n:
            self._loc[hit] = 0
        return n

    def live_count(self) -> int:
        return int(np.count_nonzero(self._loc))

    def bytes_on_disk(self) -> int:
        return os.fstat(self._fd).st_blocks * 512

    def flush(self) -> None:
        self._mm.flush()

    def close(self) -> None:
        os.close(self._fd)


class HashIndex:
    """Open-addressing hash table for byte keys (by their xxh3-64), fixed slot count."""

    MAGIC = b"LCIH"

    def __init__(self, path: str, slots: int) -> None:
        self.path = path
        if not os.path.exists(path):
            slots = 1 << max(4, (slots - 1).bit_length())  # a power of two
            _create(path, self.MAGIC, slots, slots * HASH_ENTRY.itemsize)
        self._fd, slots = _open_checked(path, self.MAGIC)
        if slots <= 0 or slots & (slots - 1):
            raise CorruptionError(f"{path}: bad slot count {slots}; run 'lcache fsck --repair'")
        self._mm = mmap.mmap(self._fd, INDEX_HEADER + slots * HASH_ENTRY.itemsize)
        arr = np.frombuffer(self._mm, dtype=HASH_ENTRY, offset=INDEX_HEADER)
        self._hash: U64Array = arr["hash"]
        self._loc: U64Array = arr["loc"]
        self._len = arr["length"]
        self._ref = arr["ref"]
        self._state = arr["state"]
        self.slots = slots
        self._backed = bytearray((len(self._mm) + _PAGE - 1) // _PAGE)  # as in IntIndex
        self._mask = slots - 1
        self._tlock = threading.Lock()

    def _locked(self) -> AbstractContextManager[None]:
        return _file_locked(self._fd, self._tlock)

    def _find(self, h: int) -> int:
        """Slot holding ``h``, or -1.

        A slot whose loc is 0 is being written (or was, by a killed process) and is stepped
        over: writers clear loc first and set it last, so a slot with a loc is whole.
        """
        i = h & self._mask
        for _ in range(self.slots):
            if self._state[i] == EMPTY:
                return -1
            if self._hash[i] == h and self._loc[i]:
                return i
            i = (i + 1) & self._mask
        return -1

    def lookup(self, h: int) -> tuple[int, int] | None:
        i = self._find(h)
        if i < 0:
            return None
        loc = int(self._loc[i])
        return (loc, int(self._len[i])) if loc else None

    def set(self, h: int, loc: int, length: int) -> None:
        with self._locked():
            i = self._find(h)
            if i < 0:
                i = self._free_slot(h)
            self._back_slot(i)
            self._loc[i] = 0
            self._hash[i] = h
            self._len[i] = length
            self._ref[i] = 0
            self._loc[i] = loc
            self._state[i] = USED

    def _back_slot(self, i: int) -> None:
        """Allocate the page(s) holding slot ``i`` (see ``_back``)."""
        start = INDEX_HEADER + i * HASH_ENTRY.itemsize
        end = start + HASH_ENTRY.itemsize
        lo, hi = start // _PAGE, (end - 1) // _PAGE
        if self._backed.find(0, lo, hi + 1) >= 0:
            _back(self._fd, self.path, start, end)
            self._backed[lo : hi + 1] = b"\x01" * (hi + 1 - lo)

    def _free_slot(self, h: int) -> int:
        i = h & self._mask
        for _ in range(self.slots):
            if self._state[i] != USED or not self._loc[i]:  # empty, or a dead copy
                return i
            i = (i + 1) & self._mask
        raise IndexFullError(
            f"the byte-key index {self.path} is full ({self.slots} slots); "
            "create the store with a larger max_byte_keys"
        )

    def _delete_slot(self, i: int) -> None:
        """Empty slot ``i`` by backward-shift deletion (the caller holds the lock).

        Later entries of the probe run that may live at ``i`` move back, so no tombstones pile
        up and probes stay short. Each move copies before it clears, so a crash part-way leaves
        at worst a duplicate of an entry (``remove`` removes all copies), never loses one; the
        slot being overwritten has its loc cleared first, so it is never a mix of two entries.
        Concurrent readers may miss a moving entry; a miss is always allowed.
        """
        mask = self._mask
        j = i
        for _ in range(self.slots - 1):  # bounded: a full table has no empty slot to stop at
            j = (j + 1) & mask
            if self._state[j] != USED:
                break
            home = int(self._hash[j]) & mask
            stays = (i < home <= j) if i <= j else (home > i or home <= j)
            if stays:
                continue
            self._loc[i] = 0
            self._hash[i] = self._hash[j]
            self._len[i] = self._len[j]
            self._ref[i] = self._ref[j]
            self._loc[i] = self._loc[j]
            i = j
        self._loc[i] = 0
        self._state[i] = EMPTY

    def remove(self, h: int, expected_loc: int | None = None) -> bool:
        with self._locked():
            return self._remove(h, expected_loc)

    def _remove(self, h: int, expected_loc: int | None) -> bool:
        removed = False
        while (i := self._find(h)) >= 0:
            if expected_loc is not None and int(self._loc[i]) != expected_loc:
                break
            self._delete_slot(i)
            removed = True
        return removed

    def touch(self, h: int) -> None:
        i = self._find(h)
        if i >= 0:
            self._ref[i] = 1

    def referenced(self, h: int) -> bool:
        i = self._find(h)
        return bool(i >= 0 and self._ref[i])

    def items(self) -> Iterator[tuple[int, int, int]]:
        """(hash, loc, length) of every used slot."""
        for i in np.flatnonzero((self._state == USED) & (self._loc != 0)):
            yield int(self._hash[i]), int(self._loc[i]), int(self._len[i])

    def clear_segment(self, segment: int, from_offset: int = 0) -> int:
        lo, hi = pack_loc(segment, from_offset), pack_loc(segment + 1, 0)
        with self._locked():
            hit = np.flatnonzero((self._state == USED) & (self._loc >= lo) & (self._loc < hi))
            doomed = [(int(self._hash[i]), int(self._loc[i])) for i in hit]
            return sum(self._remove(h, loc) for h, loc in doomed)

    def live_count(self) -> int:
        return int(np.count_nonzero((self._state == USED) & (self._loc != 0)))

    def bytes_on_disk(self) -> int:
        return os.fstat(self._fd).st_blocks * 512

    def flush(self) -> None:
        self._mm.flush()

    def close(self) -> None:
        os.close(self._fd)
