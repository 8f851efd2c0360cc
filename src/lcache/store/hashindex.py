"""The byte-key index: an open-addressing hash table (linear probing) keyed by xxh3-64 of the
key, 24 bytes per slot, in ``index-bytes-G.bin``.

The table is sized from the store's capacity when it is created (``initial_slots``) and grows
with the keys: once more than half of its slots are taken, the store builds a table twice as
large as a new generation of the file (see ``files.py``), within what the capacity allows
beside the segments writers need. Every block of it is allocated when it is built, so no page
of it is ever a hole. A header word counts the slots in use, for the growth decision (a crash
can leave it off by one; growth counts again before it decides).

Readers never lock and stop at the first empty slot of a probe run. Writers hold ``flock`` on
the file; a writer or reader that finds the generation moved reopens the file by its new name.
Deletes shift later entries of a probe run back (no tombstones in the table), so probes stay
short without rebuilding.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt

from lcache.errors import IndexFullError
from lcache.io import close_file
from lcache.store.files import Generations, allocate, current_generation, generation_path
from lcache.store.index import (
    INDEX_HEADER,
    USED_FIELD,
    USED_OFFSET,
    U64Array,
    damaged,
    finish_index_file,
    missing,
    new_index_file,
    open_index_file,
    pack_loc,
)

HASH_ENTRY = np.dtype(
    [("hash", "<u8"), ("loc", "<u8"), ("length", "<u4"), ("ref", "u1"), ("state", "u1"),
     ("pad", "u1", (2,))]
)
EMPTY, USED = 0, 1
MIN_SLOTS = 16
MAX_LOAD = 0.5  # grow past this share of slots in use
FULL_LOAD = 0.9  # when the table may not grow: evict keys to stay under this share
_BLOCK = 4096


def table_bytes(slots: int) -> int:
    """Bytes on disk of a table of ``slots`` (whole blocks: it is fully allocated)."""
    return -(-(INDEX_HEADER + slots * HASH_ENTRY.itemsize) // _BLOCK) * _BLOCK


def slots_for(keys: int) -> int:
    """The smallest table (a power of two) that holds ``keys`` under ``MAX_LOAD``."""
    slots = MIN_SLOTS
    while keys > slots * MAX_LOAD:
        slots *= 2
    return slots


def largest_table(slots: int, room: int, max_keys: int | None) -> int:
    """The most slots a table of ``slots`` may grow to in ``room`` bytes (the old table and
    the new one both exist while it is built), within what ``max_keys`` keys need."""
    largest = slots
    while table_bytes(2 * largest) + table_bytes(largest) <= room:
        largest *= 2
    if max_keys is not None:
        largest = min(largest, max(slots_for(max_keys), slots))
    return largest


def initial_slots(capacity: int) -> int:
    """Slots of a new store's table: one per MiB of capacity, 64..4096 (it grows anyway)."""
    return 1 << min(max((capacity >> 20).bit_length() - 1, 6), 12)


class _Table:
    """One generation of the table, mapped."""

    def __init__(self, gen: int, path: str, fd: int, slots: int) -> None:
        self.gen, self.path, self.fd = gen, path, fd
        self.mm = mmap.mmap(fd, INDEX_HEADER + slots * HASH_ENTRY.itemsize)
        arr = np.frombuffer(self.mm, dtype=HASH_ENTRY, offset=INDEX_HEADER)
        self.hash: U64Array = arr["hash"]
        self.loc: U64Array = arr["loc"]
        self.length = arr["length"]
        self.ref = arr["ref"]
        self.state = arr["state"]
        self.slots = slots
        self.mask = slots - 1

    @property
    def used(self) -> int:
        return min(int(USED_FIELD.unpack_from(self.mm, USED_OFFSET)[0]), self.slots)

    @used.setter
    def used(self, n: int) -> None:
        USED_FIELD.pack_into(self.mm, USED_OFFSET, max(n, 0))

    def find(self, h: int) -> int:
        """Slot holding ``h``, or -1.

        A slot whose loc is 0 is being written (or was, by a killed process) and is stepped
        over: writers clear loc first and set it last, so a slot with a loc is whole.
        """
        i = h & self.mask
        for _ in range(self.slots):
            if self.state[i] == EMPTY:
                return -1
            if self.hash[i] == h and self.loc[i]:
                return i
            i = (i + 1) & self.mask
        return -1

    def free_slot(self, h: int) -> int:
        i = h & self.mask
        for _ in range(self.slots):
            if self.state[i] != USED or not self.loc[i]:  # empty, or a dead copy
                return i
            i = (i + 1) & self.mask
        raise IndexFullError(
            f"the byte-key index {self.path} is full ({self.slots} slots); it grows with the "
            "keys as far as the capacity and max_byte_keys allow: raise them")

    def delete_slot(self, i: int) -> None:
        """Empty slot ``i`` by backward-shift deletion (the caller holds the lock).

        Later entries of the probe run that may live at ``i`` move back, so no tombstones pile
        up and probes stay short. Each move copies before it clears, so a crash part-way leaves
        at worst a duplicate of an entry (``remove`` removes all copies), never loses one; the
        slot being overwritten has its loc cleared first, so it is never a mix of two entries.
        Concurrent readers may miss a moving entry; a miss is always allowed.
        """
        mask = self.mask
        j = i
        for _ in range(self.slots - 1):  # bounded: a full table has no empty slot to stop at
            j = (j + 1) & mask
            if self.state[j] != USED:
                break
            home = int(self.hash[j]) & mask
            stays = (i < home <= j) if i <= j else (home > i or home <= j)
            if stays:
                continue
            self.loc[i] = 0
            self.hash[i] = self.hash[j]
            self.length[i] = self.length[j]
            self.ref[i] = self.ref[j]
            self.loc[i] = self.loc[j]
            i = j
        self.loc[i] = 0
        self.state[i] = EMPTY
        self.used = self.used - 1

    def place(self, hashes: U64Array, locs: U64Array, lens: npt.NDArray[np.uint32],
              refs: npt.NDArray[np.uint8]) -> None:
        """Insert entries into this (new, empty, unpublished) table, all at once.

        Linear probing by rounds: each round, every entry not placed yet takes its current
        slot if that is empty and no earlier entry of the round wants it, else moves one on.
        Every slot an entry stepped over was taken before it, which is what lookups rely on.
        """
        hashes, first = np.unique(hashes, return_index=True)  # a crash mid-shift: two copies
        locs, lens, refs = locs[first], lens[first], refs[first]
        if len(hashes) > self.slots:
            raise IndexFullError(f"{len(hashes)} byte keys do not fit in {self.slots} slots")
        pos = (hashes & np.uint64(self.mask)).astype(np.int64)
        todo = np.arange(len(hashes))
        while len(todo):
            slot = pos[todo]
            free = self.state[slot] == EMPTY
            _, win = np.unique(slot[free], return_index=True)
            winners = todo[free][win]
            at = pos[winners]
            self.hash[at] = hashes[winners]
            self.loc[at] = locs[winners]
            self.length[at] = lens[winners]
            self.ref[at] = refs[winners]
            self.state[at] = USED
            placed = np.zeros(len(hashes), dtype=bool)
            placed[winners] = True
            todo = todo[~placed[todo]]
            pos[todo] = (pos[todo] + 1) & self.mask
        self.used = len(hashes)


class HashIndex:
    """The byte-key hash table, followed across generations."""

    MAGIC = b"LCIH"
    STEM = "index-bytes"

    def __init__(self, root: str, meta: Generations, slots: int = 64,
                 create: bool = True) -> None:
        """Open the current generation, creating one of ``slots`` if there is none and
        ``create``; the caller holds the store's meta lock.

        Raises:
            CorruptionError: the file is damaged, or missing and ``create`` is false.
        """
        self.root = root
        self._meta = meta
        self._tlock = threading.Lock()
        self._dirty = False  # this process changed entries since its last flush
        gen = current_generation(root, meta, self.STEM)
        if not os.path.lexists(generation_path(root, self.STEM, gen)):
            if not create:
                raise missing(root, generation_path(root, self.STEM, gen))
            self._build(root, meta, gen, max(MIN_SLOTS, slots), *_no_entries())
        self._t = self._open(gen)

    def _open(self, gen: int) -> _Table:
        path = generation_path(self.root, self.STEM, gen)
        if not os.path.lexists(path):
            raise missing(self.root, path)
        fd, slots, size = open_index_file(self.root, path, self.MAGIC)
        why = None
        if slots < MIN_SLOTS or slots & (slots - 1):
            why = f"bad slot count {slots}"
        elif size != INDEX_HEADER + slots * HASH_ENTRY.itemsize:
            why = f"{size} bytes, but {slots} slots take {INDEX_HEADER} + {slots} x " \
                  f"{HASH_ENTRY.itemsize}"
        try:
            if why is not None:
                raise damaged(self.root, path, why)
            # Read whole through the map: no hole may be left (a file cut and extended again
            # would have some); asked for now, a full disk is DiskFullError, not SIGBUS later.
            allocate(fd, path, 0, size)
        except BaseException:
            close_file(fd)
            raise
        return _Table(gen, path, fd, slots)

    @classmethod
    def _build(cls, root: str, meta: Generations, gen: int, slots: int, hashes: U64Array,
               locs: U64Array, lens: npt.NDArray[np.uint32],
               refs: npt.NDArray[np.uint8]) -> None:
        """Write a table holding these entries and publish it as generation ``gen``."""
        path = generation_path(root, cls.STEM, gen)
        tmp, fd = new_index_file(path, cls.MAGIC, slots, slots * HASH_ENTRY.itemsize,
                                 dense=True)
        try:
            table = _Table(gen, tmp, fd, slots)
            table.place(hashes, locs, lens, refs)
            table.mm.flush()
        except BaseException:
            close_file(fd)
            os.unlink(tmp)
            raise
        finish_index_file(root, meta, cls.STEM, tmp, fd, gen)

    @classmethod
    def rebuild(cls, root: str, meta: Generations, hashes: U64Array, locs: U64Array,
                lens: npt.NDArray[np.uint32], min_slots: int = MIN_SLOTS) -> None:
        """Publish a new generation holding exactly these entries (meta lock held)."""
        gen = current_generation(root, meta, cls.STEM) + 1
        cls._build(root, meta, gen, max(min_slots, slots_for(len(hashes))), hashes, locs,
                   lens, np.zeros(len(hashes), np.uint8))

    # ------------------------------------------------------------------ the current table
    def _follow(self) -> _Table:
        """The current generation's table, reopened if it moved (caller holds _tlock)."""
        t = self._t
        gen = self._meta.generation(self.STEM)
        if gen != t.gen:
            new = self._open(gen)
            close_file(t.fd)
            self._t = t = new
        return t

    def _table(self) -> _Table:
        t = self._t
        if self._meta.generation(self.STEM) != t.gen:
            with self._tlock:  # not while a writer of this process holds the old file
                t = self._follow()
        return t

    @contextmanager
    def _locked(self) -> Iterator[_Table]:
        """The current table, exclusive against other threads and processes."""
        with self._tlock:
            while True:
                t = self._follow()
                fcntl.flock(t.fd, fcntl.LOCK_EX)
                if self._meta.generation(self.STEM) == t.gen:
                    break
                fcntl.flock(t.fd, fcntl.LOCK_UN)  # grown while we waited: use the new one
            self._dirty = True
            try:
                yield t
            finally:
                fcntl.flock(t.fd, fcntl.LOCK_UN)

    @property
    def slots(self) -> int:
        return self._table().slots

    @property
    def fd(self) -> int:
        """The descriptor of the file in use (a forked child closes the parent's)."""
        return self._t.fd

    # ------------------------------------------------------------------ growth
    def crowded(self, more: int, load: float = MAX_LOAD) -> bool:
        """Whether ``more`` new keys would fill more than ``load`` of the slots (by the
        header's count: cheap, and may be off by a crash)."""
        t = self._table()
        return t.used + more > t.slots * load

    def recount(self) -> int:
        """Count the slots in use exactly, and fix the header's count."""
        with self._locked() as t:
            t.used = int(np.count_nonzero(t.state == USED))
            return t.used

    def grow(self, slots: int) -> None:
        """Move to a table of ``slots`` (a power of two); the caller holds the meta lock."""
        with self._locked() as t:
            if slots <= t.slots:
                return
            live = (t.state == USED) & (t.loc != 0)
            self._build(self.root, self._meta, t.gen + 1, slots, t.hash[live], t.loc[live],
                        t.length[live], t.ref[live])

    # ------------------------------------------------------------------ reads and writes
    def lookup(self, h: int) -> tuple[int, int] | None:
        t = self._table()
        i = t.find(h)
        if i < 0:
            return None
        loc = int(t.loc[i])
        return (loc, int(t.length[i])) if loc else None

    def set(self, h: int, loc: int, length: int) -> None:
        with self._locked() as t:
            i = t.find(h)
            if i < 0:
                i = t.free_slot(h)
                if t.state[i] == EMPTY:
                    t.used = t.used + 1
            t.loc[i] = 0
            t.hash[i] = h
            t.length[i] = length
            t.ref[i] = 0
            t.loc[i] = loc
            t.state[i] = USED

    def move(self, h: int, old: int, new: int) -> bool:
        """``IntIndex.move`` for a byte key's hash ``h``."""
        with self._locked() as t:
            i = t.find(h)
            if i < 0 or int(t.loc[i]) != old:
                return False
            t.loc[i] = new
            t.ref[i] = 0
            return True

    def remove(self, h: int, expected_loc: int | None = None) -> bool:
        with self._locked() as t:
            return self._remove(t, h, expected_loc)

    @staticmethod
    def _remove(t: _Table, h: int, expected_loc: int | None) -> bool:
        removed = False
        while (i := t.find(h)) >= 0:
            if expected_loc is not None and int(t.loc[i]) != expected_loc:
                break
            t.delete_slot(i)
            removed = True
        return removed

    def touch(self, h: int) -> None:
        t = self._table()
        i = t.find(h)
        if i >= 0:
            t.ref[i] = 1

    def referenced(self, h: int) -> bool:
        t = self._table()
        i = t.find(h)
        return bool(i >= 0 and t.ref[i])

    def items(self) -> Iterator[tuple[int, int, int]]:
        """(hash, loc, length) of every used slot."""
        t = self._table()
        for i in np.flatnonzero((t.state == USED) & (t.loc != 0)):
            yield int(t.hash[i]), int(t.loc[i]), int(t.length[i])

    def clear_segment(self, segment: int, from_offset: int = 0) -> list[int]:
        """Remove entries pointing into ``segment`` at or past ``from_offset``; returns their
        hashes."""
        lo, hi = pack_loc(segment, from_offset), pack_loc(segment + 1, 0)
        with self._locked() as t:
            hit = np.flatnonzero((t.state == USED) & (t.loc >= lo) & (t.loc < hi))
            doomed = [(int(t.hash[i]), int(t.loc[i])) for i in hit]
            return [h for h, loc in doomed if self._remove(t, h, loc)]

    def live_count(self) -> int:
        t = self._table()
        return int(np.count_nonzero((t.state == USED) & (t.loc != 0)))

    def bytes_on_disk(self) -> int:
        return os.fstat(self._table().fd).st_blocks * 512

    def flush(self) -> None:
        """Make this process's changes durable (msync; skipped when it made none)."""
        if self._dirty:
            self._dirty = False
            self._t.mm.flush()

    def close(self) -> None:
        close_file(self._t.fd)


def _no_entries() -> tuple[U64Array, U64Array, npt.NDArray[np.uint32], npt.NDArray[np.uint8]]:
    return (np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.uint32),
            np.zeros(0, np.uint8))

