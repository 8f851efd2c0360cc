"""Recovery after a crash: seal the segments of dead writers and remove what a killed
process left half-done. Runs under the store's meta lock, so no live process is publishing."""

from __future__ import annotations

import logging
import os
from contextlib import suppress

from lcache.io import close_file, pread_full, sync_fd
from lcache.store import record
from lcache.store.files import open_in_store
from lcache.store.hashindex import HashIndex
from lcache.store.index import IntIndex, pack_loc
from lcache.store.layout import temp_leftovers
from lcache.store.segment import (
    Summary,
    list_segments,
    log_path,
    scan_log,
    sum_path,
    try_lock,
    write_summary,
)

log = logging.getLogger("lcache")


def remove_leftovers(root: str) -> None:
    """Delete temp files of interrupted atomic publishes and summaries without a segment."""
    # Why safe: a process killed inside atomic_write (stats.json, store.json, a summary, an
    # index being created) leaves NAME.tmpPID; every such publish happens under the meta lock,
    # which the caller holds, so none of these belongs to a live process.
    for path in temp_leftovers(root):  # only the store's own: the rest is not ours
        with suppress(FileNotFoundError):
            os.unlink(path)
    logs, sums = list_segments(root)
    for seg in sums - set(logs):  # a cleaned segment whose summary removal was interrupted
        os.unlink(sum_path(root, seg))


def seal_if_orphan(root: str, seg: int, ints: IntIndex, hashes: HashIndex,
                   durable: bool, dropped: list[tuple[int, int]]) -> Summary | bool:
    """Recover ``seg`` if its writer is dead: its summary, or True if the segment is gone;
    False if a live writer holds it. The (kind, key64) whose index entries recovery removed
    are appended to ``dropped``."""
    try:
        fd = open_in_store(log_path(root, seg), os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        if not try_lock(fd):
            return False
        return recover_segment(root, seg, fd, ints, hashes, durable, dropped)
    finally:
        close_file(fd)


def recover_segment(root: str, seg: int, fd: int, ints: IntIndex, hashes: HashIndex,
                    durable: bool, dropped: list[tuple[int, int]]) -> Summary:
    """Scan an orphaned segment, cut its torn tail, drop index entries past it, seal it."""
    size = os.fstat(fd).st_size
    damaged: list[tuple[int, int, int]] = []
    summary = scan_log(fd, seg, size, damaged)
    for kind, key64, offset in damaged:  # skipped by the scan: no index entry may stay
        index: IntIndex | HashIndex = ints if kind == record.KIND_INT else hashes
        if index.remove(key64, pack_loc(seg, offset)):
            dropped.append((kind, key64))
    if summary.data_len < size:
        tail = bytearray(min(size - summary.data_len, 1 << 20))
        pread_full(fd, summary.data_len, memoryview(tail), "cache-recovery")
        if tail.count(0) != len(tail):  # all zeros is just the padding of a direct write
            log.warning("segment %d: cut a torn tail of %d bytes after a crash", seg,
                        size - summary.data_len)
        os.ftruncate(fd, summary.data_len)
    # Why outside the if: the file may already be shorter than what the index points at
    # (a torn write or lost tail, not cut by us); those entries must go too.
    dropped += [(record.KIND_INT, k) for k in ints.clear_segment(seg, summary.data_len)]
    dropped += [(record.KIND_BYTES, h) for h in hashes.clear_segment(seg, summary.data_len)]
    if durable:
        sync_fd(fd, True, "cache-recovery")
    write_summary(root, summary, durable)
    return summary
