"""The store's read path: lookups, reads from memory-mapped sealed segments, planned batch
reads of the rest, and removal of records read once.

A mixin of ``Store`` (the methods' ``self`` is the store): reading shares the store's
descriptors, counters and policy but none of its writing, cleaning or recovery.

Where the bytes come from (measured with 1-128 KiB records on this class of VM, page cache
warm: a 32 KiB ``preadv`` costs 22 us, checking the same record in a mapping 3 us):

* **Sealed segments are memory-mapped** (read-only, one mapping per segment and process) and a
  record is checked and returned in place, as a view of the mapping: no system call, no copy.
  Sealed segments never change, and only the part of the file that exists when it is mapped
  (below its end and its first hole) is ever touched, so a read cannot fault past the end of
  the file (SIGBUS). Mappings of deleted segments are dropped when the gc generation moves,
  so their space is freed once the caller drops the views.
* **The rest** (a live writer's active segment, a store opened with ``direct_io``, a record
  beyond what was mapped) is read with ``preadv``: first in the calling thread without waiting
  for the device (``RWF_NOWAIT``: what the page cache holds), then whatever is left by the I/O
  engine's ``queue_depth`` threads, so a batch of cold reads is still in flight at once.

A mapped record that is not in the page cache is read by a page fault, one at a time. When a
batch shows such faults, the next batches ask the kernel for all their records first
(``MADV_WILLNEED``), so cold reads overlap; that costs about 2 us a record and stops once
batches read at memory speed again.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from lcache.io import ReadRequest, SyncPolicy, aligned_empty, pread_full
from lcache.io.tracer import code, emit, fid_for, pack_record, thread_records
from lcache.store import record
from lcache.store.arguments import batch_length, remove_flags
from lcache.store.files import open_in_store
from lcache.store.parts import StoreParts
from lcache.store.readplan import Run, plan_reads
from lcache.store.segment import log_path, sum_path

if TYPE_CHECKING:
    from lcache.io import IOEngine
    from lcache.store.counters import RateLimitedWarning
    from lcache.store.hashindex import HashIndex
    from lcache.store.index import IntIndex
    from lcache.store.store import Key

MAP_BUDGET = 4 << 30  # bytes of segments mapped per process (address space, page tables)
UNSEALED_RECHECK = 0.05  # seconds before asking again whether an active segment is sealed
_PAGE = mmap.PAGESIZE
_MAPPED_READ = code("read", "cache-read")  # the trace record code of reads by page faults
Keys = Sequence["Key"] | npt.NDArray[np.integer[Any]]


class _Mapping:
    """One sealed segment mapped read-only: ``size`` bytes may be touched. It is unmapped
    when the last reference goes: the store's, and those of the views it handed out."""

    __slots__ = ("fd", "fid", "mm", "size", "view")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.fid = fid_for(fd)  # its name in traces
        self.size = size
        self.mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        self.view = memoryview(self.mm)


class _Maps:
    """A process's mappings (a forked child starts with none: ``pid``)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.by_segment: dict[int, _Mapping] = {}
        self.unsealed: dict[int, float] = {}  # segment -> when it was last found active
        self.bytes = 0
        self.cold = 0.0  # running share of mapped records that needed a disk read

    def drop(self, seg: int) -> None:
        m = self.by_segment.pop(seg, None)
        if m is not None:
            self.bytes -= m.size


class Reader(StoreParts):
    """What reading uses of the store, declared here and provided by ``Store``."""

    direct_io: bool
    engine: IOEngine
    queue_depth: int
    _block: int
    _gc_seen: int
    _tlock: threading.RLock
    _warn_verify: RateLimitedWarning
    _maps_state: _Maps | None = None
    _nowait = True  # RWF_NOWAIT works on this file system (else plain preadv inline)

    def _lookup(self, kind: int, key64: int) -> tuple[int, int] | None:
        raise NotImplementedError

    def _forget_segment(self, seg: int) -> None:
        raise NotImplementedError

    def _weigh_journal(self) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------------- descriptors, mappings
    def _reader_fd(self, seg: int) -> int | None:
        fd = self._fds.get(seg)
        if fd is None:
            try:
                fd = open_in_store(log_path(self.root, seg), os.O_RDONLY, self.direct_io)
            except FileNotFoundError:
                return None
            self._fds[seg] = fd
        return fd

    def _maps(self) -> _Maps:
        maps = self._maps_state
        if maps is None or maps.pid != os.getpid():
            maps = self._maps_state = _Maps()
        return maps

    def _drop_deleted_fds(self) -> None:
        """Close descriptors (and drop mappings) of segments deleted by any process, so their
        space is freed."""
        gen = self._meta.gc_generation
        if gen == self._gc_seen:
            return
        self._gc_seen = gen
        for seg, fd in list(self._fds.items()):
            if os.fstat(fd).st_nlink == 0:
                self._forget_segment(seg)
        maps = self._maps()
        for seg, m in list(maps.by_segment.items()):
            if self._fds.get(seg) != m.fd:  # forgotten (deleted) since it was mapped
                maps.drop(seg)

    def _mapping(self, seg: int) -> _Mapping | None:
        """The segment's mapping, made on first use; ``None`` while it is not sealed (a live
        writer appends to it), for ``direct_io`` stores, and when it cannot be mapped."""
        maps = self._maps()
        m = maps.by_segment.get(seg)
        if m is not None or self.direct_io:
            return m
        checked = maps.unsealed.get(seg)
        if checked is not None and time.monotonic() - checked < UNSEALED_RECHECK:
            return None
        fd = self._reader_fd(seg)
        if fd is None:
            return None
        # Why sealed only: an active segment grows, and recovery cuts the torn tail of a dead
        # writer's one; a sealed segment's file never changes until it is deleted.
        if not os.path.exists(sum_path(self.root, seg)):
            maps.unsealed[seg] = time.monotonic()
            return None
        maps.unsealed.pop(seg, None)
        size = os.fstat(fd).st_size
        with contextlib.suppress(OSError):  # nor a hole (on a full tmpfs a fault is SIGBUS)
            size = min(size, os.lseek(fd, 0, os.SEEK_HOLE))
        if size <= 0:
            return None
        try:
            m = _Mapping(fd, size)
        except (OSError, ValueError):
            return None  # e.g. out of address space: read it with preadv
        while maps.by_segment and maps.bytes + size > MAP_BUDGET:
            maps.drop(next(iter(maps.by_segment)))  # the oldest mapping
        maps.by_segment[seg] = m
        maps.bytes += size
        return m

    # ----------------------------------------------------------------- public reads
    def __contains__(self, key: Key) -> bool:
        """Whether the index has ``key`` (a later get may still miss if the record is bad)."""
        self._check_process()
        kind, key64, _ = record.key_parts(key)
        return self._lookup(kind, key64) is not None

    def get(self, key: Key) -> bytes | None:
        """The value stored under ``key``, or ``None`` (a miss)."""
        view = self.get_many([key])[0]
        return None if view is None else bytes(view)

    def get_many(self, keys: Keys, remove: Sequence[bool] | npt.NDArray[np.bool_] | None = None
                 ) -> list[memoryview | None]:
        """Values for ``keys`` (``None`` for misses) as read-only zero-copy views.

        A view points into the memory-mapped segment or into one fresh buffer per call; it
        stays valid (and keeps that memory) as long as it is referenced. Every record is
        checked (header, key, length, checksum): a damaged or stale one is a miss.

        ``remove`` (one flag per key): remove those keys once read, as ``delete`` does (and
        journaled alike); a key that missed is left alone. For records read once.

        Raises:
            ArgumentTypeError: ``keys`` is not a sequence of int or byte keys, or ``remove``
                not one bool per key (a ConfigError and a TypeError).
            ConfigError: a key out of range, ``remove`` of another length, the store closed.
        """
        self._check_process()
        n = batch_length(keys, "keys")
        if remove is not None:
            remove = remove_flags(remove, n)
        with self._tlock:  # another thread's put may clean (close) a segment we read
            out, key64s, parts = self._get_many(keys)
            if remove is not None:
                self._remove_read(key64s, parts, out, remove)
            return out

    # ----------------------------------------------------------------- the batch
    def _get_many(self, keys: Keys) -> tuple[list[memoryview | None], list[int],
                                              list[tuple[int, int, bytes]] | None]:
        """(views, 64-bit keys, key parts); the parts are ``None`` when every key is an int."""
        self._drop_deleted_fds()
        n = len(keys)
        ints = _int_keys(keys) if n > 1 else None
        parts: list[tuple[int, int, bytes]] | None = None
        if ints is not None:
            locs, lens = self._ints().lookup_many(ints)
            key64s: list[int] = ints.tolist()
            loc_list, len_list = locs.tolist(), lens.tolist()
        else:  # byte keys, or one key: no array work
            parts = [record.key_parts(k) for k in keys]
            key64s = [p[1] for p in parts]
            loc_list, len_list = [0] * n, [0] * n
            for i, (kind, key64, _) in enumerate(parts):
                entry = self._lookup(kind, key64)
                if entry is not None:
                    loc_list[i], len_list[i] = entry
        out: list[memoryview | None] = [None] * n
        unmapped = self._read_mapped(loc_list, len_list, key64s, parts, out)
        if unmapped:
            locs = np.array(loc_list, np.uint64)
            lens = np.array(len_list, np.uint32)
            sub = np.array(unmapped, np.int64)
            runs = plan_reads(locs[sub], lens[sub], self._block)
            for run in runs:
                run.members = [unmapped[j] for j in run.members]
            self._read_runs(runs, key64s, parts, loc_list, len_list, out)
        hits = n - out.count(None)
        self.counters.gets += n
        self.counters.hits += hits
        self.counters.misses += n - hits
        if hits and self.policy.tracks_references:
            self._touch([(record.KIND_INT if parts is None else parts[i][0], key64s[i])
                         for i in range(n) if out[i] is not None])
        return out, key64s, parts

    def _read_mapped(self, locs: list[int], lens: list[int], key64s: list[int],
                     parts: list[tuple[int, int, bytes]] | None,
                     out: list[memoryview | None]) -> list[int]:
        """Check and return in place the records that lie in mapped sealed segments; the
        indices of the others (found, but to be read with preadv) are returned."""
        maps = self._maps()
        by_segment = maps.by_segment
        verify = record.verify
        unmapped: list[int] = []
        placed: list[tuple[int, _Mapping, int, int]] = []  # (i, mapping, offset, length)
        for i, loc in enumerate(locs):
            if not loc:
                continue
            seg = loc >> 32
            m = by_segment.get(seg) or self._mapping(seg)
            off, length = loc & 0xFFFFFFFF, lens[i]
            if m is None or off + length > m.size:
                unmapped.append(i)
            else:
                placed.append((i, m, off, length))
        if not placed:
            return unmapped
        if maps.cold > 0.1 and len(placed) > 1:  # ask for all at once: disk reads overlap
            for _, m, off, length in placed:
                start = off - off % _PAGE
                m.mm.madvise(mmap.MADV_WILLNEED, start, off + length - start)
        records = thread_records()
        slow = 0
        for i, m, off, length in placed:
            t0 = time.perf_counter_ns()
            kind, key64, kb = (record.KIND_INT, key64s[i], b"") if parts is None else parts[i]
            view = out[i] = verify(m.view[off : off + length], kind, key64, kb)
            end = time.perf_counter_ns()
            if end - t0 > 30_000 + length:  # far slower than memory: the fault read the disk
                slow += 1
            if records is not None:  # the bytes page faults moved, traced as reads
                records.append(pack_record(_MAPPED_READ, m.fid, off, length, length, t0, end))
            if view is None:
                self._verify_failed(key64)
            else:
                self.counters.bytes_read += length
        if len(placed) > 1 or slow:
            maps.cold = 0.7 * maps.cold + 0.3 * slow / len(placed)
        return unmapped

    def _read_runs(self, runs: list[Run], key64s: list[int],
                   parts: list[tuple[int, int, bytes]] | None, locs: list[int],
                   lens: list[int], out: list[memoryview | None]) -> None:
        buf = aligned_empty(sum(run.end - run.start for run in runs))
        requests: list[ReadRequest] = []
        placed: list[tuple[int, int, list[int]]] = []
        pos = 0
        for run in runs:
            fd = self._reader_fd(run.segment)
            if fd is None:
                continue  # segment deleted since the lookup: these are misses
            requests.append(ReadRequest(fd, run.start, buf[pos : pos + run.end - run.start]))
            placed.append((pos, run.start, run.members))
            pos += run.end - run.start

        def check(run: int, n_read: int) -> None:
            """Verify one run's records as soon as it is read (in the I/O thread), so checking
            overlaps the other reads in flight."""
            base, start, members = placed[run]
            for i in members:
                lo = base + (locs[i] & 0xFFFFFFFF) - start
                length = lens[i]
                if lo + length <= base + n_read:
                    kind, key64, kb = (record.KIND_INT, key64s[i], b"") if parts is None \
                        else parts[i]
                    view = record.verify(buf[lo : lo + length], kind, key64, kb)
                    out[i] = None if view is None else view.toreadonly()

        if self.direct_io:
            self.engine.read_batch(requests, "cache-read", check, depth=self.queue_depth)
        else:
            left = self._read_cached(requests, check)
            if left:
                self.engine.read_batch([requests[j] for j in left], "cache-read",
                                       lambda j, got: check(left[j], got),
                                       depth=self.queue_depth)
        for _, _, members in placed:
            for i in members:
                if out[i] is None:
                    self._verify_failed(key64s[i])
                else:
                    self.counters.bytes_read += lens[i]

    def _read_cached(self, requests: list[ReadRequest],
                     check: Any) -> list[int]:
        """Read what the page cache holds in this thread (no hand-off to the I/O threads,
        which costs more than a cached read); returns the requests that must wait for the
        device."""
        left: list[int] = []
        for j, req in enumerate(requests):
            if not self._nowait:
                check(j, pread_full(req.fd, req.offset, req.buf, "cache-read"))
                continue
            t0 = time.perf_counter_ns()
            try:
                got = os.preadv(req.fd, [req.buf], req.offset, os.RWF_NOWAIT)
            except BlockingIOError:
                got = -1
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self._nowait = False  # not on this file system: plain reads, inline
                check(j, pread_full(req.fd, req.offset, req.buf, "cache-read"))
                continue
            if got > 0:
                emit("read", req.fd, req.offset, len(req.buf), got, t0, "cache-read")
            if got == len(req.buf):
                check(j, got)
            else:  # not (all) cached; a short read at the end of the file is read again
                left.append(j)
        return left

    def _verify_failed(self, key64: int) -> None:
        self.counters.verify_failures += 1
        self._warn_verify("record for key %r failed verification (stale, torn or corrupt); "
                          "served as a miss", key64)

    def _touch(self, hits: list[tuple[int, int]]) -> None:
        """Set the CLOCK reference bits of records just read."""
        ints = [k for kind, k in hits if kind == record.KIND_INT]
        if ints:
            self._ints().touch_many(np.array(ints, np.uint64))
        for kind, k in hits:
            if kind == record.KIND_BYTES:
                self._hashes().touch(k)

    # ----------------------------------------------------------------- read once
    def _remove_read(self, key64s: list[int], parts: list[tuple[int, int, bytes]] | None,
                     out: list[memoryview | None],
                     remove: Sequence[bool] | npt.NDArray[np.bool_]) -> None:
        """Remove the keys flagged in ``remove`` (checked: ``remove_flags``) that were read,
        as ``delete`` does."""
        chosen = [i for i, r in enumerate(remove) if r and out[i] is not None]
        if not chosen:
            return
        removed: list[tuple[int, int]] = []
        if parts is None:
            ints = self._ints()
            keys = np.array([key64s[i] for i in chosen], np.uint64)
            locs, _ = ints.lookup_many(keys)  # where they are now (compaction may move them)
            gone = ints.remove_many(keys[locs != 0], locs[locs != 0])
            removed = [(record.KIND_INT, k) for k in gone.tolist()]
        else:
            for i in chosen:
                kind, key64, _ = parts[i]
                index: IntIndex | HashIndex = self._ints() if kind == record.KIND_INT \
                    else self._hashes()
                if index.remove(key64):
                    removed.append((kind, key64))
        if not removed:
            return
        journal = self._journal()
        # Why read the floor after the removal: see ``Store.delete``.
        journal.append(removed, self._meta.next_segment)
        if self.sync is SyncPolicy.ALWAYS:
            journal.sync()
        before = self.counters.deletes
        self.counters.deletes += len(removed)
        if before // 256 != self.counters.deletes // 256:
            self._weigh_journal()


def _int_keys(keys: Keys) -> npt.NDArray[np.uint64] | None:
    """``keys`` as a uint64 array when every one is an int key (the common case), else
    ``None`` (``record.key_parts`` then checks each key)."""
    if isinstance(keys, np.ndarray):
        arr = keys
    elif all(type(k) is int for k in keys):
        arr = np.array(keys, dtype=np.int64 if not keys else None)
    else:
        return None
    if arr.dtype.kind not in "iu":
        return None
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) > record.MAX_INT_KEY):
        return None  # out of range: key_parts says so
    return arr.astype(np.uint64, copy=False)
