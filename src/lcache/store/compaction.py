"""What cleaning a segment needs to know and do: which records are live, which were read
lately, and copying the ones worth keeping into a new segment."""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt

from lcache.io import close_file, pread_full
from lcache.store import record
from lcache.store.files import open_in_store
from lcache.store.hashindex import HashIndex
from lcache.store.index import IntIndex, pack_loc
from lcache.store.segment import SegmentWriter, Summary, log_path


def live_records(summary: Summary, ints: IntIndex, hashes: HashIndex) -> npt.NDArray[np.bool_]:
    """Which records of a segment the index still points at."""
    return _live(summary.keys, summary.kinds, summary.locs, ints, hashes)


def live_bytes(summaries: list[Summary], ints: IntIndex, hashes: HashIndex) -> list[int]:
    """The live bytes of each segment, with one index lookup for all of them (a full store
    compares many segments at every allocation)."""
    if not summaries:
        return []
    live = _live(np.concatenate([s.keys for s in summaries]),
                 np.concatenate([s.kinds for s in summaries]),
                 np.concatenate([s.locs for s in summaries]), ints, hashes)
    owner = np.repeat(np.arange(len(summaries)), [len(s.keys) for s in summaries])
    lengths = np.concatenate([s.lengths for s in summaries])
    sums = np.bincount(owner[live], weights=lengths[live], minlength=len(summaries))
    return [int(x) for x in sums]


def _live(keys: npt.NDArray[np.uint64], kinds: npt.NDArray[np.uint8],
          old: npt.NDArray[np.uint64], ints: IntIndex, hashes: HashIndex
          ) -> npt.NDArray[np.bool_]:
    live = np.zeros(len(old), dtype=bool)
    is_int = kinds == record.KIND_INT
    if is_int.any():
        locs, _ = ints.lookup_many(keys[is_int])
        live[is_int] = locs == old[is_int]
    for i in np.flatnonzero(~is_int):
        entry = hashes.lookup(int(keys[i]))
        live[i] = entry is not None and entry[0] == int(old[i])
    return live


def referenced_records(summary: Summary, ints: IntIndex,
                       hashes: HashIndex) -> npt.NDArray[np.bool_]:
    """Which records of a segment have their CLOCK reference bit set."""
    refs = np.zeros(len(summary.keys), dtype=bool)
    is_int = summary.kinds == record.KIND_INT
    if is_int.any():
        refs[is_int] = ints.referenced(summary.keys[is_int])
    for i in np.flatnonzero(~is_int):
        refs[i] = hashes.referenced(int(summary.keys[i]))
    return refs


def evict_records(summary: Summary, evict: npt.NDArray[np.bool_], ints: IntIndex,
                  hashes: HashIndex) -> list[tuple[int, int]]:
    """Remove the index entries of the records ``evict`` marks, unless a key was written
    again meanwhile (its entry then points elsewhere). Returns the (kind, key64) removed."""
    old = summary.locs
    is_int = summary.kinds == record.KIND_INT
    gone = ints.remove_many(summary.keys[evict & is_int], old[evict & is_int])
    removed = [(record.KIND_INT, k) for k in gone.tolist()]
    for i in np.flatnonzero(evict & ~is_int):
        if hashes.remove(int(summary.keys[i]), int(old[i])):
            removed.append((record.KIND_BYTES, int(summary.keys[i])))
    return removed


def copy_forward(root: str, summary: Summary, keep: npt.NDArray[np.bool_], dest: SegmentWriter,
                 reserve: int, ints: IntIndex, hashes: HashIndex) -> int:
    """Append the kept records to ``dest`` and re-point the index at the copies.

    Each record is checked again first, so a damaged one is never copied. Records that do not
    fit in ``dest.room - reserve`` or fail the check get ``keep[i] = False`` (the caller evicts
    them). A key overwritten meanwhile keeps its new value. Returns the bytes copied.
    """
    fd = open_in_store(log_path(root, summary.segment), os.O_RDONLY)
    try:
        data = bytearray(summary.data_len)
        got = pread_full(fd, 0, memoryview(data), "cache-gc")
    finally:
        close_file(fd)
    view = memoryview(data)[:got]
    parts: list[memoryview] = []
    entries: list[tuple[int, int, int]] = []
    olds: list[int] = []
    # Why not dest.room - reserve: the next append starts on a block boundary, so copies
    # ending mid-block took up to a block of the reserve. A gc that had a new segment made
    # with room for a segment's 43,247 live bytes then found 40,960, and evicted a live
    # record (the kill -9 torture test)
    room = dest.room_leaving(reserve)
    for i in np.flatnonzero(keep):
        off, length = int(summary.offsets[i]), int(summary.lengths[i])
        rec = view[off : off + length]
        if length > room or record.verify_any(rec) is None:
            keep[i] = False
            continue
        parts.append(rec)
        entries.append((int(summary.kinds[i]), int(summary.keys[i]), length))
        olds.append(pack_loc(summary.segment, off))
        room -= length
    if not parts:
        return 0
    start = dest.append(parts, entries, "cache-gc")
    pos = start
    for (kind, key64, length), old in zip(entries, olds, strict=True):
        index: IntIndex | HashIndex = ints if kind == record.KIND_INT else hashes
        # Why move, not lookup then set: set empties the entry before it writes the new
        # location (a kill between left a flushed record lost), and a put between our look
        # and our write was undone by the older copy.
        index.move(key64, old, pack_loc(dest.segment, pos))
        pos += length
    return pos - start
