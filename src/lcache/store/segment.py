"""Segments: append-only record files, sealed by publishing a summary beside them.

Lifecycle (``SegmentState``)::

    ACTIVE --seal--> SEALED --clean (GC/eviction)--> deleted
    ACTIVE --writer dies--> ORPHAN --recover (scan, truncate torn tail)--> SEALED

An ACTIVE segment's writer holds ``flock(LOCK_EX)`` on its ``.log``; when the writer dies the
kernel drops the lock, which is how an ORPHAN is told from a live writer's segment. A segment
is SEALED when its ``.sum`` exists (published atomically); sealed segments are immutable.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from lcache.errors import ConfigError, CorruptionError
from lcache.io import (
    align_down,
    align_up,
    aligned_buffer,
    logical_block_size,
    open_file,
    pread_full,
    pwrite_full,
    sync_fd,
)
from lcache.store import record
from lcache.store.layout import atomic_write

_SUM_HDR = struct.Struct("<4sIQQQQ")  # magic, version, segment, count, data_len, checksum
_SUM_MAGIC = b"LCSM"
SCAN_CHUNK = 4 << 20


class SegmentState(enum.Enum):
    ACTIVE = "active"
    ORPHAN = "orphan"
    SEALED = "sealed"


def segments_dir(root: str) -> str:
    return os.path.join(root, "segments")


def log_path(root: str, seg: int) -> str:
    return os.path.join(root, "segments", f"{seg:010d}.log")


def sum_path(root: str, seg: int) -> str:
    return os.path.join(root, "segments", f"{seg:010d}.sum")


def list_segments(root: str) -> tuple[list[int], set[int]]:
    """(ids of every ``.log`` sorted, ids that have a ``.sum``)."""
    logs: list[int] = []
    sums: set[int] = set()
    for name in os.listdir(segments_dir(root)):
        stem, _, ext = name.partition(".")
        if not stem.isdigit():
            continue
        if ext == "log":
            logs.append(int(stem))
        elif ext == "sum":
            sums.add(int(stem))
    return sorted(logs), sums


def try_lock(fd: int) -> bool:
    """Take the writer lock without waiting; False if a live process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


@dataclass(frozen=True, slots=True)
class Summary:
    """Where every record of a segment lies: parallel arrays, one entry per record."""

    segment: int
    keys: npt.NDArray[np.uint64]
    offsets: npt.NDArray[np.uint32]
    lengths: npt.NDArray[np.uint32]
    kinds: npt.NDArray[np.uint8]
    data_len: int

    def encode(self) -> bytes:
        body = (
            self.keys.astype("<u8").tobytes() + self.offsets.astype("<u4").tobytes()
            + self.lengths.astype("<u4").tobytes() + self.kinds.astype("u1").tobytes()
        )
        head = _SUM_HDR.pack(
            _SUM_MAGIC, 1, self.segment, len(self.keys), self.data_len,
            xxhash.xxh3_64_intdigest(body),
        )
        return head + body

    @classmethod
    def decode(cls, raw: bytes, path: str) -> Summary:
        if len(raw) < _SUM_HDR.size:
            raise CorruptionError(f"{path}: truncated segment summary")
        magic, version, seg, count, data_len, csum = _SUM_HDR.unpack_from(raw)
        body = raw[_SUM_HDR.size :]
        if magic != _SUM_MAGIC or version != 1 or len(body) != count * 17:
            raise CorruptionError(f"{path}: not a valid segment summary")
        if xxhash.xxh3_64_intdigest(body) != csum:
            raise CorruptionError(f"{path}: segment summary checksum mismatch")
        keys = np.frombuffer(body, "<u8", count, 0)
        offsets = np.frombuffer(body, "<u4", count, 8 * count)
        lengths = np.frombuffer(body, "<u4", count, 12 * count)
        kinds = np.frombuffer(body, "u1", count, 16 * count)
        return cls(seg, keys, offsets, lengths, kinds, data_len)


def read_summary(root: str, seg: int) -> Summary:
    path = sum_path(root, seg)
    with open(path, "rb") as f:
        summary = Summary.decode(f.read(), path)
    if summary.segment != seg:
        raise CorruptionError(f"{path}: summary names segment {summary.segment}")
    return summary


def write_summary(root: str, summary: Summary, durable: bool) -> None:
    atomic_write(sum_path(root, summary.segment), summary.encode(), durable)


def scan_log(fd: int, seg: int, size: int) -> Summary:
    """Rebuild a summary by reading a segment front to back; stops at the first bad record.

    ``data_len`` of the result is where the intact prefix ends (the torn tail starts there).
    """
    keys: list[int] = []
    offsets: list[int] = []
    lengths: list[int] = []
    kinds: list[int] = []
    pos = 0
    buf = bytearray(SCAN_CHUNK)
    while pos < size:
        want = min(SCAN_CHUNK, size - pos)
        n = pread_full(fd, pos, memoryview(buf)[:want], "cache-recovery")
        view = memoryview(buf)[:n]
        used = 0
        while used < n:
            head = record.parse_header(view[used:])
            if head is None:
                break
            if head.size > n - used:
                if used == 0:  # one record larger than the chunk: read it whole
                    big = bytearray(head.size)
                    got = pread_full(fd, pos, memoryview(big), "cache-recovery")
                    if got == head.size and record.verify_any(memoryview(big)) is not None:
                        keys.append(head.key64)
                        offsets.append(pos)
                        lengths.append(head.size)
                        kinds.append(head.kind)
                        used = head.size
                break
            if record.verify_any(view[used : used + head.size]) is None:
                break
            keys.append(head.key64)
            offsets.append(pos + used)
            lengths.append(head.size)
            kinds.append(head.kind)
            used += head.size
        if used == 0:
            break
        pos += used
    return Summary(
        seg, np.array(keys, np.uint64), np.array(offsets, np.uint32),
        np.array(lengths, np.uint32), np.array(kinds, np.uint8), pos,
    )


class SegmentWriter:
    """The active segment of one process: appends records, then seals.

    Created by the store under its meta lock; holds ``flock`` on the file until sealed.

    With ``direct`` (the default where the filesystem allows it) appends bypass the page cache:
    on this class of machine buffered writes reach ~0.45 GB/s and O_DIRECT ~1.6-1.9 GB/s. Each
    append writes whole blocks from the block holding the current end, re-writing that partial
    block from a copy kept in memory and zero-padding the last one; the zeros past the end are
    never a valid header, and sealing cuts them off.
    """

    def __init__(self, root: str, seg: int, segment_size: int, direct: bool = False) -> None:
        self.root = root
        self.segment = seg
        self.segment_size = segment_size
        self.path = log_path(root, seg)
        self.fd = os.open(
            self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
        )
        if not try_lock(self.fd):  # cannot happen: the id is new and we hold the meta lock
            os.close(self.fd)
            raise CorruptionError(f"{self.path} is locked by another process")
        self.offset = 0
        self._direct_fd = -1
        self._block = 1
        if direct:
            try:
                self._direct_fd = open_file(self.path, os.O_WRONLY, direct=True)
                self._block = logical_block_size(root)
            except (ConfigError, OSError):
                self._direct_fd = -1  # e.g. tmpfs: fall back to buffered writes
        self._tail = bytearray()  # bytes of the partial last block (direct mode)
        self._stage = aligned_buffer(0)  # aligned staging buffer for direct writes
        self._keys: list[int] = []
        self._offsets: list[int] = []
        self._lengths: list[int] = []
        self._kinds: list[int] = []

    @property
    def room(self) -> int:
        return self.segment_size - self.offset

    def append(self, parts: Sequence[bytes | bytearray | memoryview],
               entries: list[tuple[int, int, int]], io_class: str = "cache-write") -> int:
        """Write ``parts`` (whole records) at the end; ``entries`` are (kind, key64, length).

        Returns the offset the data starts at. On failure the file is cut back, so the segment
        holds only whole records.
        """
        start = self.offset
        try:
            if self._direct_fd >= 0:
                end = self._write_direct(parts, io_class)
            else:
                end = start + pwrite_full(self.fd, start, parts, io_class)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, start)
            raise
        pos = start
        for kind, key64, length in entries:
            self._keys.append(key64)
            self._offsets.append(pos)
            self._lengths.append(length)
            self._kinds.append(kind)
            pos += length
        if pos != end:
            raise AssertionError(f"entries describe {pos - start} bytes, wrote {end - start}")
        self.offset = end
        return start

    def _write_direct(self, parts: Sequence[bytes | bytearray | memoryview], io_class: str) -> int:
        block = self._block
        base = align_down(self.offset, block)
        size = sum(len(p) for p in parts)
        end = self.offset + size
        need = align_up(end, block) - base
        if len(self._stage) < need:  # reused across appends: no page faults per batch
            self._stage = aligned_buffer(max(need, 2 * len(self._stage)))
        view = memoryview(self._stage)
        pos = len(self._tail)
        view[:pos] = self._tail
        for part in parts:
            view[pos : pos + len(part)] = part
            pos += len(part)
        view[pos:need] = bytes(need - pos)  # zero padding up to the block boundary
        pwrite_full(self._direct_fd, base, [view[:need]], io_class)
        self._tail = bytearray(view[align_down(end, block) - base : end - base])
        view.release()
        return end

    def sync(self) -> None:
        sync_fd(self.fd, True, "cache-write")

    def summary(self) -> Summary:
        return Summary(
            self.segment, np.array(self._keys, np.uint64), np.array(self._offsets, np.uint32),
            np.array(self._lengths, np.uint32), np.array(self._kinds, np.uint8), self.offset,
        )

    def seal(self, durable: bool) -> Summary:
        """Make the segment immutable: sync, publish its summary, drop the lock."""
        if os.fstat(self.fd).st_size > self.offset:
            os.ftruncate(self.fd, self.offset)  # the zero padding of direct writes
        if durable:
            self.sync()
        summary = self.summary()
        write_summary(self.root, summary, durable)
        self.close()
        return summary

    def close(self) -> None:
        """Close without sealing (a crash looks like this); the kernel drops the lock."""
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
            self._direct_fd = -1
        self._stage.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
