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
import mmap
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import xxhash

from lcache.errors import ConfigError, CorruptionError
from lcache.io import (
    BufferPool,
    Pending,
    align_down,
    align_up,
    aligned_buffer,
    close_file,
    default_engine,
    fsync_dir,
    logical_block_size,
    pread_full,
    read_and_close,
    settle,
    sync_fd,
)
from lcache.io.publish import atomic_write
from lcache.store import record
from lcache.store.files import open_in_store

_SUM_HDR = struct.Struct("<4sIQQQQ")  # magic, version, segment, count, data_len, checksum
SUMMARY_HEAD = _SUM_HDR.size
SUMMARY_ENTRY = 17  # a record's key (8 bytes), offset (4), length (4) and kind (1)
_SUM_MAGIC = b"LCSM"
SCAN_CHUNK = 4 << 20
BATCH_HINT = 16 << 20
WRITE_DEPTH = 4  # direct writes in flight per batch
SPLIT_ABOVE = 1 << 20  # smaller batches go out as one write
MAX_GAP = 64 << 10  # the largest run of padding zeros a scan steps over
Buffer = bytes | bytearray | memoryview


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


# The names log_path and sum_path give, and their atomic publishes' NAME.tmpPID: [0-9], not
# \d (which takes other scripts' digits), and \Z, not $ (which takes a trailing newline).
_SEGMENT_FILE = re.compile(r"^([0-9]{10})\.(log|sum)(\.tmp[0-9]+)?\Z")


MAX_SEGMENT = (1 << 32) - 2  # the highest segment id: the next one still fits 32 bits


def segment_file(name: str) -> tuple[int, str, bool] | None:
    """(id, "log" or "sum", whether a temp) of a name in ``segments/`` that a store writes;
    None for any other. Ids outside 1..``MAX_SEGMENT`` are not a store's: an index location
    holds the segment id in 32 bits and a delete's floor, the id after it, too, so lcache
    never writes them; 2**32 - 1 made every later put an OverflowError, and 0, whose index
    locations are those of empty slots, made recovery journal every empty slot (attack
    helper 100). Nor is an unpadded ``1.sum``, which was read as ``0000000001.sum`` (and its
    removal as a summary without a log failed)."""
    # Why the first test: a listing of a full cache passes hundreds of names each time a
    # process makes a segment, and the regular expression was most of its cost.
    digits, suffix = name[:10], name[10:]
    if (suffix == ".log" or suffix == ".sum") and digits.isascii() and digits.isdigit():
        seg = int(digits)
        return (seg, suffix[1:], False) if 0 < seg <= MAX_SEGMENT else None
    m = _SEGMENT_FILE.match(name)
    if m is None or not 0 < int(m.group(1)) <= MAX_SEGMENT:
        return None
    return int(m.group(1)), m.group(2), m.group(3) is not None


# The first bytes of a log (its first record's) and of a summary.
_FILE_MAGIC = {"log": struct.pack("<I", record.MAGIC), "sum": _SUM_MAGIC}


def holds_written_segment(root: str) -> bool:
    """Whether ``segments/`` holds a segment a store wrote: a regular file under a name
    ``segment_file`` takes (not a temp) that starts with a record's magic (a log) or a
    summary's. This, not a name, proves a folder whose configuration is lost a store: a
    user's ``build.log`` there, or a ``0000000001.log`` of other bytes, proves nothing.
    A ``segments`` that is a symbolic link proves nothing either (it is never followed)."""
    folder = segments_dir(root)
    try:
        if os.path.islink(folder):
            return False
        names = os.listdir(folder)
    except OSError:
        return False
    for name in sorted(names):
        found = segment_file(name)
        if found is None or found[2]:
            continue
        try:
            fd = open_in_store(os.path.join(folder, name), os.O_RDONLY)
        except (OSError, CorruptionError):
            continue
        head = bytearray(4)
        try:
            if pread_full(fd, 0, memoryview(head)) == len(head) and \
                    head == _FILE_MAGIC[found[1]]:
                return True
        except OSError:
            pass
        finally:
            close_file(fd)
    return False


def list_segments(root: str) -> tuple[list[int], set[int]]:
    """(ids of every ``.log`` sorted, ids that have a ``.sum``). Names a store does not
    write (``segment_file``) are passed over, and so are folders under a segment's name,
    which are not the store's either (``foreign_entries``): one failed every open and
    ``fsck --repair`` with IsADirectoryError or a CorruptionError that said to run it."""
    logs: list[int] = []
    sums: set[int] = set()
    with os.scandir(segments_dir(root)) as entries:
        names = [e.name for e in entries if not e.is_dir(follow_symlinks=False)]
    for name in names:
        found = segment_file(name)
        if found is None or found[2]:
            continue
        if found[1] == "log":
            logs.append(found[0])
        else:
            sums.add(found[0])
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
    #: Each record's packed index location (segment << 32 | offset), made once: cleaning
    #: compares a window of summaries with the index at every segment allocation.
    locs: npt.NDArray[np.uint64] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "locs", (np.uint64(self.segment) << np.uint64(32))
                           | self.offsets.astype(np.uint64))

    def encode(self) -> bytes:
        body = (
            self.keys.astype("<u8").tobytes() + self.offsets.astype("<u4").tobytes()
            + self.lengths.astype("<u4").tobytes() + self.kinds.astype("u1").tobytes()
        )
        fields = (self.segment, len(self.keys), self.data_len)
        return _SUM_HDR.pack(_SUM_MAGIC, 2, *fields, _checksum(fields, body)) + body

    @classmethod
    def decode(cls, raw: bytes, path: str, log_size: int | None = None) -> Summary:
        """The summary in ``raw``; ``log_size``: the length of its segment file, which a
        version 1 summary's unchecked data length may not pass."""
        if len(raw) < _SUM_HDR.size:
            raise CorruptionError(f"{path}: truncated segment summary")
        magic, version, seg, count, data_len, csum = _SUM_HDR.unpack_from(raw)
        body = raw[_SUM_HDR.size :]
        if magic != _SUM_MAGIC or version not in (1, 2) or len(body) != count * SUMMARY_ENTRY:
            raise CorruptionError(f"{path}: not a valid segment summary")
        # Version 1 checked the body only: a flipped bit of data_len made fsck cut intact
        # records off the segment, or a cleaning allocate 2**38 bytes (attack helper 100).
        want = _checksum((seg, count, data_len), body) if version == 2 else \
            xxhash.xxh3_64_intdigest(body)
        if want != csum:
            raise CorruptionError(f"{path}: segment summary checksum mismatch")
        keys = np.frombuffer(body, "<u8", count, 0)
        offsets = np.frombuffer(body, "<u4", count, 8 * count)
        lengths = np.frombuffer(body, "<u4", count, 12 * count)
        kinds = np.frombuffer(body, "u1", count, 16 * count)
        end = int((offsets.astype(np.int64) + lengths).max()) if count else 0
        # what version 1 leaves unchecked, bounded: a data length up to 2**32 made fsck and
        # a cleaning allocate 4 GiB (attack helper 102)
        top = (1 << 32) - 1 if version == 2 or log_size is None else log_size
        if not end <= data_len <= top:
            raise CorruptionError(f"{path}: segment summary says its segment ends at "
                                  f"{data_len}, not after its last record ({end})"
                                  + (f" and within its {top} bytes" if top == log_size else ""))
        return cls(seg, keys, offsets, lengths, kinds, data_len)


def _checksum(fields: tuple[int, int, int], body: bytes) -> int:
    """A version 2 summary's: its segment, record count and data length, and its body."""
    return xxhash.xxh3_64_intdigest(struct.pack("<QQQ", *fields) + body)


def read_summary(root: str, seg: int) -> Summary:
    path = sum_path(root, seg)
    try:
        log_size: int | None = os.stat(log_path(root, seg)).st_size
    except FileNotFoundError:
        log_size = None
    summary = Summary.decode(read_and_close(open_in_store(path, os.O_RDONLY)), path, log_size)
    if summary.segment != seg:
        raise CorruptionError(f"{path}: summary names segment {summary.segment}")
    return summary


def write_summary(root: str, summary: Summary, durable: bool) -> None:
    atomic_write(sum_path(root, summary.segment), summary.encode(), io_class="cache-meta",
                 durable=durable)


def _zero_gap(view: memoryview, used: int, pos: int) -> int:
    """Length of the zeros at ``view[used:]`` if a valid header follows them on a 512-byte
    boundary (the padding before a batch that starts on a fresh block), else 0."""
    window = bytes(view[used : used + MAX_GAP])
    zeros = len(window) - len(window.lstrip(b"\0"))
    if zeros == 0 or zeros == len(window) or (pos + used + zeros) % 512:
        return 0
    return zeros if record.parse_header(view[used + zeros :]) is not None else 0


def scan_log(fd: int, seg: int, size: int,
             damaged: list[tuple[int, int, int]] | None = None) -> Summary:
    """Rebuild a summary by reading a segment front to back; stops at the first bad header.

    A whole record whose header is intact but whose key or payload fails its checksum is
    left out of the summary and the scan goes on; ``(kind, key64, offset)`` of each such
    record is appended to ``damaged`` when given. ``data_len`` of the result is where the
    readable part ends (the torn tail starts there).
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
                gap = _zero_gap(view, used, pos)
                if gap:
                    used += gap
                    continue
                break
            if head.size > n - used:
                if used == 0:  # one record larger than the chunk: read it whole
                    big = bytearray(head.size)
                    got = pread_full(fd, pos, memoryview(big), "cache-recovery")
                    if got == head.size:
                        if record.verify_any(memoryview(big)) is not None:
                            keys.append(head.key64)
                            offsets.append(pos)
                            lengths.append(head.size)
                            kinds.append(head.kind)
                        elif damaged is not None:
                            damaged.append((head.kind, head.key64, pos))
                        used = head.size
                break
            if record.verify_any(view[used : used + head.size]) is None:
                # Why go on: the header passed its own check and the record is whole, so this
                # is damage inside one record, not a torn tail; stopping here would throw away
                # every later record of the segment.
                if damaged is not None:
                    damaged.append((head.kind, head.key64, pos + used))
                used += head.size
                continue
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


@dataclass(slots=True)
class StagedWrite:
    """A batch laid out at [start, end) of the segment, to be written from ``base``."""

    start: int
    end: int
    base: int
    data: list[Buffer]
    batches_before: int
    offset_before: int
    tail_before: bytearray
    independent: bool = False  # starts on a fresh block: may be written beside the previous
    pending: list[Pending] = field(default_factory=list)
    done: bool = False  # waited for, whatever the outcome


class SegmentWriter:
    """The active segment of one process: appends records, then seals.

    Created by the store under its meta lock; holds ``flock`` on the file until sealed.

    With ``direct`` (the default where the filesystem allows it) appends bypass the page cache:
    on this class of machine buffered writes reach ~0.45 GB/s and O_DIRECT ~1.6-1.9 GB/s. Each
    append writes whole blocks from the block holding the current end, re-writing that partial
    block from a copy kept in memory and zero-padding the last one; the zeros past the end are
    never a valid header, and sealing cuts them off.
    """

    def __init__(self, root: str, seg: int, segment_size: int, direct: bool = False,
                 pool: BufferPool | None = None) -> None:
        self.root = root
        self.segment = seg
        self.segment_size = segment_size
        self.path = log_path(root, seg)
        self.fd = open_in_store(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        if not try_lock(self.fd):  # cannot happen: the id is new and we hold the meta lock
            close_file(self.fd)
            raise CorruptionError(f"{self.path} is locked by another process")
        self.offset = 0
        self._direct_fd = -1
        self._block = 1
        if direct:
            try:
                self._direct_fd = open_in_store(self.path, os.O_WRONLY, direct=True)
                self._block = logical_block_size(root)
            except (ConfigError, OSError):
                self._direct_fd = -1  # e.g. tmpfs: fall back to buffered writes
        self._tail = bytearray()  # bytes of the partial last block (direct mode)
        self._buffers = pool or BufferPool(2)
        self._stages: list[mmap.mmap] = []  # two, alternating between batches
        self._which = 0
        self._inflight: list[StagedWrite] = []
        self._entry_synced = False
        self._batches: list[tuple[int, list[tuple[int, int, int]]]] = []  # (start, entries)

    @property
    def room(self) -> int:
        # a large direct batch starts on the next block boundary (see stage)
        return self.segment_size - align_up(self.offset, self._block)

    def room_leaving(self, reserve: int) -> int:
        """Bytes that may be appended while ``room`` stays at least ``reserve``: appends may
        start on a block boundary, so the reserve counts in whole blocks."""
        return self.room - align_up(reserve, self._block)

    def append(self, parts: Sequence[Buffer], entries: list[tuple[int, int, int]],
               io_class: str = "cache-write") -> int:
        """Write ``parts`` (whole records) at the end and wait; returns their offset."""
        staged = self.stage(parts, entries)
        self.submit(staged, io_class)
        self.wait(staged)
        return staged.start

    def stage(self, parts: Sequence[Buffer], entries: list[tuple[int, int, int]]) -> StagedWrite:
        """Lay out ``parts`` (whole records; ``entries`` are (kind, key64, length)) after the
        records staged so far, without writing them yet.

        With direct I/O the bytes are copied into one of two aligned staging buffers, so the
        next batch can be prepared while this one is written. A direct batch of 1 MiB or more
        starts on the next block boundary (the zeros before it are already on disk as the
        padding of the previous write), so it shares no block with the batch before it and
        both may be in flight at once; a scan steps over such gaps.
        """
        size = sum(e[2] for e in entries)
        independent = self._direct_fd >= 0 and size >= SPLIT_ABOVE
        start = align_up(self.offset, self._block) if independent else self.offset
        staged = StagedWrite(start, start + size, start, list(parts), len(self._batches),
                             self.offset, self._tail, independent)
        if self._direct_fd >= 0:
            self._stage_direct(staged)
        self._batches.append((start, entries))
        self.offset = staged.end
        return staged

    def _stage_direct(self, staged: StagedWrite) -> None:
        block = self._block
        base = align_down(staged.start, block)
        need = align_up(staged.end, block) - base
        self._which ^= 1
        while len(self._stages) < 2:
            self._stages.append(self._buffers.take(BATCH_HINT))
        if len(self._stages[self._which]) < need:
            self._stages[self._which] = aligned_buffer(need)
        view = memoryview(self._stages[self._which])
        pos = staged.start - base  # the bytes of the partial block before start, or none
        view[:pos] = self._tail[:pos]
        for part in staged.data:
            view[pos : pos + len(part)] = part
            pos += len(part)
        view[pos:need] = bytes(need - pos)  # zero padding up to the block boundary
        staged.base = base
        staged.data = [view[:need]]
        self._tail = bytearray(view[align_down(staged.end, block) - base : staged.end - base])
        view.release()

    def submit(self, staged: StagedWrite, io_class: str = "cache-write") -> None:
        """Start writing a staged batch (in the background with direct I/O; a buffered
        write into the page cache is done here). The previous batch must be done, unless this
        one is ``independent``.

        A large direct batch goes out as ``WRITE_DEPTH`` block-aligned pieces at once: one
        write in flight leaves this class of SSD at about two thirds of its sequential speed.
        """
        engine = default_engine()
        self._inflight.append(staged)
        if self._direct_fd < 0:
            staged.pending = [engine.writev_now(self.fd, staged.base, staged.data, io_class)]
            return
        whole = staged.data[0]
        piece = max(SPLIT_ABOVE, align_up(-(-len(whole) // WRITE_DEPTH), self._block))
        for lo in range(0, len(whole), piece):
            staged.pending.append(engine.submit_write(self._direct_fd, staged.base + lo,
                                                      whole[lo : lo + piece], io_class))

    def wait(self, staged: StagedWrite) -> None:
        """Wait for a submitted batch. On failure, forget it and everything staged after it
        and cut the file back, so the segment holds only whole records; then re-raise."""
        if not staged.pending:
            raise AssertionError("wait() on a batch that was never submitted")
        staged.done = True
        self._inflight.remove(staged)
        try:
            try:
                for p in staged.pending:
                    p.wait()
            finally:
                settle(staged.pending)  # after a failed piece, the others land first too
            staged.data = []
        except BaseException:
            for later in self._inflight:  # let them land before the file is cut back
                settle(later.pending)
                later.done = True
            self._inflight.clear()
            del self._batches[staged.batches_before :]
            self.offset = staged.offset_before
            self._tail = staged.tail_before
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, staged.offset_before)
            raise

    def sync(self) -> None:
        sync_fd(self.fd, True, "cache-write")
        if not self._entry_synced:  # a new file's directory entry must be durable too
            fsync_dir(segments_dir(self.root))
            self._entry_synced = True

    def summary(self) -> Summary:
        entries = [e for _, batch in self._batches for e in batch]
        lengths = np.array([e[2] for e in entries], np.uint32)
        offsets = np.zeros(len(entries), np.uint32)
        i = 0
        for start, batch in self._batches:  # records of a batch follow each other
            offsets[i : i + len(batch)] = start + np.concatenate(
                ([0], np.cumsum(lengths[i : i + len(batch) - 1], dtype=np.uint64)))
            i += len(batch)
        return Summary(
            self.segment, np.array([e[1] for e in entries], np.uint64), offsets, lengths,
            np.array([e[0] for e in entries], np.uint8), self.offset,
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
        for staged in self._inflight:  # no write may outlive the descriptors it uses
            settle(staged.pending)
        self._inflight.clear()
        if self._direct_fd >= 0:
            close_file(self._direct_fd)
            self._direct_fd = -1
        for buf in self._stages:  # reused by the next writer: no fresh page faults
            self._buffers.give(buf)
        self._stages = []
        if self.fd >= 0:
            close_file(self.fd)
            self.fd = -1
