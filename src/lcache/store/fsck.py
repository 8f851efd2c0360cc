"""``lcache fsck``: check a store's consistency, and repair what can be repaired.

Checked: every sealed segment's summary and every record it lists (header, key, checksum);
segments left unsealed by a crashed writer; index entries that point at missing segments,
past a segment's end or at damaged records; leftover temp files. Repair seals orphans (cutting
torn tails), rebuilds bad summaries by a scan, drops index entries that cannot be served
(those keys become misses), truncates trailing garbage, deletes temp files, and rebuilds an
index file whose header is damaged. Segments held by a live writer are skipped.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from lcache.errors import CorruptionError, StoreNotFoundError
from lcache.io import pread_full, sync_fd
from lcache.store import record
from lcache.store.index import HashIndex, IntIndex, pack_loc
from lcache.store.layout import MetaPage, load_config, prepare_dir
from lcache.store.segment import (
    Summary,
    list_segments,
    log_path,
    read_summary,
    scan_log,
    segments_dir,
    sum_path,
    try_lock,
    write_summary,
)

_Index = TypeVar("_Index", IntIndex, HashIndex)


@dataclass
class FsckReport:
    path: str
    segments: int = 0
    active_segments: int = 0
    records: int = 0
    indexed_keys: int = 0
    dead_bad_records: int = 0
    problems: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "clean": self.clean}


def fsck(path: str, repair: bool = False) -> FsckReport:
    """Check the store at ``path``; with ``repair``, fix what was found and check again."""
    root = os.path.abspath(path)
    prepare_dir(root, create=False)
    config = load_config(root)
    if config is None:
        raise StoreNotFoundError(f"no lcache store at {root} (no store.json)")
    meta = MetaPage(os.path.join(root, "lock"))
    try:
        fcntl.flock(meta.fd, fcntl.LOCK_EX)
        if not repair:
            return _Checker(root, config.max_byte_keys, fix=False).run()
        first = _Checker(root, config.max_byte_keys, fix=True).run()
        final = _Checker(root, config.max_byte_keys, fix=False).run()
        final.repaired = first.problems
        return final
    finally:
        meta.close()


class _Checker:
    def __init__(self, root: str, byte_slots: int, fix: bool) -> None:
        self.root = root
        self.fix = fix
        self.byte_slots = byte_slots
        self.report = FsckReport(root)
        self.ints: IntIndex | None = None
        self.hashes: HashIndex | None = None
        # (kind, key64) -> length, for every intact record, by location
        self.good: dict[int, tuple[int, int, int]] = {}
        self.bad: set[int] = set()
        self.bad_indexed: set[int] = set()
        self.sizes: dict[int, int] = {}
        self.active: set[int] = set()

    def problem(self, text: str) -> None:
        self.report.problems.append(text)

    def run(self) -> FsckReport:
        self._open_indexes()
        self._check_temp_files()
        logs, sums = list_segments(self.root)
        self.report.segments = len(logs)
        for seg in logs:
            self._check_segment(seg, seg in sums)
        for seg in sums - set(logs):
            self.problem(f"segment {seg}: summary without a log")
            if self.fix:
                os.unlink(sum_path(self.root, seg))
        self._check_index()
        for index in (self.ints, self.hashes):
            if index is not None:
                if self.fix:
                    index.flush()
                index.close()
        return self.report

    def _open_indexes(self) -> None:
        int_path = os.path.join(self.root, "index-int.bin")
        if os.path.exists(int_path):
            self.ints = self._open_index(int_path, lambda: IntIndex(int_path))
        bytes_path = os.path.join(self.root, "index-bytes.bin")
        if os.path.exists(bytes_path):
            self.hashes = self._open_index(
                bytes_path, lambda: HashIndex(bytes_path, self.byte_slots))

    def _open_index(self, path: str, opener: Callable[[], _Index]) -> _Index | None:
        try:
            return opener()
        except CorruptionError as exc:
            self.problem(str(exc))
            if not self.fix:
                return None
            os.unlink(path)  # rebuilt from the segment summaries
            index = opener()
            self._rebuild(index)
            return index

    def _rebuild(self, index: IntIndex | HashIndex) -> None:
        """Index every key that has exactly one record in the sealed segments.

        The log does not say which of two records of one key was written last (writers
        interleave across segments), so such keys are left out: a miss, never a stale value.
        Deletes leave no trace in the log, so a deleted key comes back with its last value.
        """
        kind = record.KIND_INT if isinstance(index, IntIndex) else record.KIND_BYTES
        found: dict[int, tuple[int, int] | None] = {}
        logs, sums = list_segments(self.root)
        for seg in logs:
            if seg not in sums:
                continue
            try:
                summary = read_summary(self.root, seg)
            except CorruptionError:
                continue
            mine = summary.kinds == kind
            for key, off, length in zip(summary.keys[mine].tolist(),
                                        summary.offsets[mine].tolist(),
                                        summary.lengths[mine].tolist(), strict=True):
                found[key] = None if key in found else (pack_loc(seg, off), length)
        for key, entry in found.items():
            if entry is None:
                continue
            if isinstance(index, IntIndex):
                index.grow(key)
            index.set(key, *entry)

    def _check_temp_files(self) -> None:
        for folder in (self.root, segments_dir(self.root)):
            for name in os.listdir(folder):
                if ".tmp" in name:
                    self.problem(f"leftover temp file {os.path.join(folder, name)}")
                    if self.fix:
                        os.unlink(os.path.join(folder, name))

    def _check_segment(self, seg: int, sealed: bool) -> None:
        path = log_path(self.root, seg)
        fd = os.open(path, os.O_RDWR if self.fix else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if not sealed:
                if not try_lock(fd):
                    self.active.add(seg)
                    self.report.active_segments += 1
                    return
                summary = scan_log(fd, seg, size)
                self.problem(f"segment {seg}: left unsealed by a crashed writer"
                             f" ({size - summary.data_len} torn bytes)")
                if self.fix:
                    self._truncate(fd, seg, size, summary.data_len)
                    write_summary(self.root, summary, durable=True)
            else:
                try:
                    summary = read_summary(self.root, seg)
                except CorruptionError as exc:
                    self.problem(str(exc))
                    summary = scan_log(fd, seg, size)
                    if self.fix:
                        self._truncate(fd, seg, size, summary.data_len)
                        write_summary(self.root, summary, durable=True)
                if size > summary.data_len:
                    self.problem(f"segment {seg}: {size - summary.data_len} bytes past its end")
                    if self.fix:
                        self._truncate(fd, seg, size, summary.data_len)
            self.sizes[seg] = summary.data_len
            self._check_records(fd, summary)
        finally:
            os.close(fd)

    def _truncate(self, fd: int, seg: int, size: int, data_len: int) -> None:
        if size > data_len:
            os.ftruncate(fd, data_len)
            sync_fd(fd, False, "cache-fsck")

    def _check_records(self, fd: int, summary: Summary) -> None:
        data = bytearray(summary.data_len)
        n = pread_full(fd, 0, memoryview(data), "cache-fsck")
        view = memoryview(data)[:n]
        for key, off, length, kind in zip(summary.keys.tolist(), summary.offsets.tolist(),
                                          summary.lengths.tolist(), summary.kinds.tolist(),
                                          strict=True):
            loc = pack_loc(summary.segment, off)
            head = record.verify_any(view[off : off + length])
            if head is None or head.key64 != key or head.size != length or head.kind != kind:
                self.bad.add(loc)
            else:
                self.good[loc] = (kind, key, length)
            self.report.records += 1

    def _check_index(self) -> None:
        for index, kind in ((self.ints, record.KIND_INT), (self.hashes, record.KIND_BYTES)):
            if index is None:
                continue
            for key, loc, length in list(index.items()):
                seg, off = loc >> 32, loc & 0xFFFFFFFF
                if seg in self.active:
                    self.report.indexed_keys += 1
                    continue
                reason = self._entry_problem(kind, key, loc, length, seg, off)
                if reason is None:
                    self.report.indexed_keys += 1
                    continue
                self.problem(f"index entry for key {key}: {reason}")
                if self.fix:
                    index.remove(key, loc)
        self.report.dead_bad_records = len(self.bad - self.bad_indexed)

    def _entry_problem(self, kind: int, key: int, loc: int, length: int, seg: int,
                       off: int) -> str | None:
        if seg not in self.sizes:
            return f"points at missing segment {seg}"
        if off + length > self.sizes[seg]:
            return f"points past the end of segment {seg}"
        if loc in self.bad:
            self.bad_indexed.add(loc)
            return f"points at a damaged record (segment {seg}, offset {off})"
        good = self.good.get(loc)
        if good is None or good != (kind, key, length):
            return f"points at segment {seg} offset {off}, where no such record starts"
        return None


__all__ = ["FsckReport", "fsck"]
