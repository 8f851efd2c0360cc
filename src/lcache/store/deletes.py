"""The delete journal: what ``Store.delete`` leaves on disk, so that an index rebuilt from the
segments does not bring a deleted key back.

A delete only clears the key's index entry; its record stays in its segment until that segment
is cleaned. An index rebuilt from the segments (``fsck --repair``) would find the record and
serve it again, so each delete also appends ``(kind, key, floor)`` to ``deletes-G.bin``, where
``floor`` is the id the next new segment will get, read after the key left the index. Every
record of the key written before the delete lies in a segment below ``floor``: a compaction
copies a record into a segment whose id it took before it saw the record live. A rebuild leaves
out a key whose only record lies below the floor of one of its entries (that record may
predate it); a record in a segment at or above it was written after.

The same holds for every other way a key leaves the index while an older record of it may
still be in the log: eviction (another writer's segment may hold an older record), recovery
dropping an entry whose record was torn, ``fsck --repair`` dropping one to a damaged record.
Those are journaled too, so a rebuilt index never serves what the live one had stopped serving.

An entry matters while a segment below its floor exists. Compaction of the journal (a new
generation of the file, see ``files.py``) drops the others: no record they could hide is left.
Appends are ``O_APPEND`` writes of whole 16-byte entries under a shared ``flock``; compaction
holds it exclusively, so no append is lost to a compaction that did not see it.

Entries carry a version byte and a 16-bit check, so zeros or a torn tail are not entries. A
damaged entry read as valid can only make a key a miss in a rebuild, never bring one back.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from lcache.errors import CorruptionError
from lcache.io import atomic_write, close_file, pread_full, sync_fd
from lcache.store.files import (
    Generations,
    bump_generation,
    current_generation,
    generation_path,
    open_in_store,
)

MAGIC = b"LCDJ"
_HEAD = struct.Struct("<4sIQ")  # magic, version, entry bytes the last compaction kept
ENTRY = np.dtype([("key", "<u8"), ("floor", "<u4"), ("kind", "u1"), ("version", "u1"),
                  ("check", "<u2")])
COMPACT_ABOVE = 4096  # bytes of entries, and twice what the last compaction kept

U64Array = npt.NDArray[np.uint64]
# (kinds, keys, floors) of entries -> whether each may still hide a record (see compact)
Needed = Callable[[npt.NDArray[np.uint8], U64Array, npt.NDArray[np.uint32]],
                  npt.NDArray[np.bool_]]


def _check(keys: U64Array, floors: npt.NDArray[np.uint32],
           kinds: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint16]:
    mix = (keys * np.uint64(0x9E3779B97F4A7C15)
           + floors.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
           + kinds.astype(np.uint64) + np.uint64(1))
    return (mix >> np.uint64(48)).astype(np.uint16)


def encode(kinds: npt.NDArray[np.uint8], keys: U64Array,
           floors: npt.NDArray[np.uint32]) -> bytes:
    out = np.zeros(len(keys), ENTRY)
    out["key"], out["floor"], out["kind"], out["version"] = keys, floors, kinds, 1
    out["check"] = _check(keys, floors, kinds)
    return out.tobytes()


_ENTRY = struct.Struct("<QIBBH")  # ENTRY, for one entry at a time


def encode_few(keys: list[tuple[int, int]], floor: int) -> bytes:
    """``encode`` of ``(kind, key64)`` pairs sharing a floor, without numpy: a delete journals
    one key, and numpy's set-up would cost it several times the rest of the delete."""
    out = bytearray()
    for kind, key in keys:
        mix = (key * 0x9E3779B97F4A7C15 + floor * 0xC2B2AE3D27D4EB4F + kind + 1) & (2**64 - 1)
        out += _ENTRY.pack(key, floor, kind, 1, mix >> 48)
    return bytes(out)


def decode(body: bytes) -> tuple[npt.NDArray[np.uint8], U64Array, npt.NDArray[np.uint32], int]:
    """(kinds, keys, floors) of the valid entries, and how many bytes were not entries."""
    whole = len(body) // ENTRY.itemsize * ENTRY.itemsize
    raw = np.frombuffer(body, ENTRY, whole // ENTRY.itemsize)
    ok = (raw["version"] == 1) & (raw["kind"] <= 1) & (
        raw["check"] == _check(raw["key"], raw["floor"], raw["kind"]))
    good = raw[ok]
    bad = len(body) - int(np.count_nonzero(ok)) * ENTRY.itemsize
    return good["kind"].copy(), good["key"].copy(), good["floor"].copy(), bad


def write_journal(root: str, meta: Generations, gen: int, body: bytes) -> None:
    """Publish generation ``gen`` of the journal holding ``body`` (entries); meta lock held."""
    path = generation_path(root, DeleteJournal.STEM, gen)
    atomic_write(path, _HEAD.pack(MAGIC, 1, len(body)) + body, io_class="cache-meta")
    bump_generation(root, meta, DeleteJournal.STEM, gen)


def _body(fd: int) -> bytes:
    """The bytes after the header of a journal file, whatever its header says."""
    data = bytearray(max(0, os.fstat(fd).st_size - _HEAD.size))
    n = pread_full(fd, _HEAD.size, memoryview(data), "cache-meta")
    return bytes(data[:n])


def journal_body(path: str) -> bytes:
    """``_body`` of the file at ``path`` (fsck, which may find its header damaged)."""
    fd = open_in_store(path, os.O_RDONLY)
    try:
        return _body(fd)
    finally:
        close_file(fd)


def _highest_floor_per_key(kinds: npt.NDArray[np.uint8], keys: U64Array,
                           floors: npt.NDArray[np.uint32]) -> npt.NDArray[np.int64]:
    """Positions of the entries with the highest floor of their (kind, key)."""
    order = np.lexsort((floors, keys, kinds))
    k, key = kinds[order], keys[order]
    last = np.r_[(k[1:] != k[:-1]) | (key[1:] != key[:-1]), True] if len(order) else \
        np.zeros(0, bool)
    return np.sort(order[last])


class DeleteJournal:
    """``deletes-G.bin``, followed across generations (the store opens one per process)."""

    STEM = "deletes"

    def __init__(self, root: str, meta: Generations) -> None:
        """Open the current generation, creating an empty one if there is none; the caller
        holds the store's meta lock.

        Raises:
            CorruptionError: the file is not a delete journal.
        """
        self.root = root
        self._meta = meta
        self._tlock = threading.Lock()
        self.dirty = False
        self._gen = current_generation(root, meta, self.STEM)
        if not os.path.lexists(self.path):
            self._write(self._gen, b"")
        self._fd = self._open()

    @property
    def path(self) -> str:
        return generation_path(self.root, self.STEM, self._gen)

    @property
    def fd(self) -> int:
        return self._fd

    def _open(self) -> int:
        fd = open_in_store(self.path, os.O_RDWR | os.O_APPEND)
        head = os.pread(fd, _HEAD.size, 0)
        if len(head) < _HEAD.size or _HEAD.unpack(head)[:2] != (MAGIC, 1):
            close_file(fd)
            raise CorruptionError(
                f"{self.path} is damaged (bad header: not an lcache delete journal); run "
                f"`lcache fsck --repair {self.root}` to rewrite it")
        return fd

    def _write(self, gen: int, body: bytes) -> None:
        write_journal(self.root, self._meta, gen, body)

    def _follow(self) -> int:
        """The current generation's descriptor (caller holds _tlock)."""
        gen = self._meta.generation(self.STEM)
        if gen != self._gen:
            old, self._gen = self._fd, gen
            self._fd = self._open()
            close_file(old)
        return self._fd

    def append(self, keys: list[tuple[int, int]], floor: int) -> None:
        """Journal that these ``(kind, key64)`` left the index; ``floor`` was read after."""
        if not keys:
            return
        entry = encode_few(keys, floor)
        with self._tlock:
            while True:
                fd = self._follow()
                fcntl.flock(fd, fcntl.LOCK_SH)
                try:
                    if self._meta.generation(self.STEM) == self._gen:
                        os.write(fd, entry)
                        self.dirty = True
                        return
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)

    def sync(self) -> None:
        """Make the deletes appended so far durable."""
        with self._tlock:
            if self.dirty:
                sync_fd(self._follow(), False, "cache-meta")
                self.dirty = False

    def size(self) -> int:
        with self._tlock:
            return os.fstat(self._follow()).st_size

    def wants_compaction(self, at_least: int = 0) -> bool:
        """Whether the entries grew past ``COMPACT_ABOVE``, twice what the last compaction
        kept, and ``at_least`` bytes."""
        with self._tlock:
            fd = self._follow()
            kept = int(_HEAD.unpack(os.pread(fd, _HEAD.size, 0))[2])
            return os.fstat(fd).st_size - _HEAD.size > max(COMPACT_ABOVE, 2 * kept, at_least)

    def compact(self, floor: int, needed: Needed | None = None) -> None:
        """Keep only the entries some segment below their floor may still need: those above
        ``floor``, the lowest segment id that exists, one per key (the highest floor hides
        whatever a lower one does: a key put and deleted over and over kept an entry per
        delete, 20,000 for one key, and a planned store evicted live records for the room),
        and of those, where given, the ones ``needed(kinds, keys, floors)`` says a segment
        below their floor may hold a record of. The caller holds the meta lock."""
        with self._tlock:
            fd = self._follow()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                kinds, keys, floors, _ = decode(_body(fd))
                keep = np.flatnonzero(floors > floor)
                keep = keep[_highest_floor_per_key(kinds[keep], keys[keep], floors[keep])]
                if needed is not None and len(keep):
                    keep = keep[needed(kinds[keep], keys[keep], floors[keep])]
                self._write(self._gen + 1, encode(kinds[keep], keys[keep], floors[keep]))
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            self._follow()

    def close(self) -> None:
        close_file(self._fd)
