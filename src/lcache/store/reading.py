"""The store's read path: lookups, planned batch reads and the single-key fast path.

A mixin of ``Store`` (the methods' ``self`` is the store): reading shares the store's
descriptors, counters and policy but none of its writing, cleaning or recovery.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from lcache.io import ReadRequest, aligned_empty, pread_full
from lcache.store import record
from lcache.store.files import open_in_store
from lcache.store.readplan import Run, plan_reads
from lcache.store.segment import log_path

if TYPE_CHECKING:
    from lcache.io import IOEngine
    from lcache.store.counters import Counters, RateLimitedWarning
    from lcache.store.hashindex import HashIndex
    from lcache.store.index import IntIndex
    from lcache.store.layout import MetaPage
    from lcache.store.policy import EvictionPolicy
    from lcache.store.store import Key


class Reader:
    """What reading uses of the store, declared here and provided by ``Store``."""

    root: str
    direct_io: bool
    counters: Counters
    policy: EvictionPolicy
    engine: IOEngine
    _block: int
    _fds: dict[int, int]
    _meta: MetaPage
    _gc_seen: int
    _tlock: threading.RLock
    _warn_verify: RateLimitedWarning

    def _check_process(self) -> None:
        raise NotImplementedError

    def _ints(self) -> IntIndex:
        raise NotImplementedError

    def _hashes(self) -> HashIndex:
        raise NotImplementedError

    def _lookup(self, kind: int, key64: int) -> tuple[int, int] | None:
        raise NotImplementedError

    def _forget_segment(self, seg: int) -> None:
        raise NotImplementedError

    def _reader_fd(self, seg: int) -> int | None:
        fd = self._fds.get(seg)
        if fd is None:
            try:
                fd = open_in_store(log_path(self.root, seg), os.O_RDONLY, self.direct_io)
            except FileNotFoundError:
                return None
            self._fds[seg] = fd
        return fd

    def _drop_deleted_fds(self) -> None:
        """Close descriptors of segments deleted by any process, so their space is freed."""
        gen = self._meta.gc_generation
        if gen == self._gc_seen:
            return
        self._gc_seen = gen
        for seg, fd in list(self._fds.items()):
            if os.fstat(fd).st_nlink == 0:
                self._forget_segment(seg)

    def __contains__(self, key: Key) -> bool:
        """Whether the index has ``key`` (a later get may still miss if the record is bad)."""
        self._check_process()
        kind, key64, _ = record.key_parts(key)
        return self._lookup(kind, key64) is not None

    def get(self, key: Key) -> bytes | None:
        """The value stored under ``key``, or ``None`` (a miss)."""
        view = self.get_many([key])[0]
        return None if view is None else bytes(view)

    def get_many(self, keys: Sequence[Key] | npt.NDArray[np.integer[Any]]) -> list[
            memoryview | None]:
        """Values for ``keys`` (``None`` for misses) as views into one fresh buffer.

        The batch is planned as a whole: records adjacent on disk are read with one call, and
        up to ``queue_depth`` reads are in flight at once.
        """
        self._check_process()
        with self._tlock:  # another thread's put may clean (close) a segment we read
            return self._get_many(keys)

    def _get_many(self, keys: Sequence[Key] | npt.NDArray[np.integer[Any]]) -> list[
            memoryview | None]:
        self._drop_deleted_fds()
        n = len(keys)
        if n == 1 and not self.direct_io:
            return [self._get_one(keys[0])]
        parts = [record.key_parts(k) for k in keys] if not isinstance(keys, np.ndarray) else \
            [(record.KIND_INT, int(k), b"") for k in keys]
        locs = np.zeros(n, np.uint64)
        lens = np.zeros(n, np.uint32)
        is_int = np.fromiter((p[0] == record.KIND_INT for p in parts), bool, n)
        if is_int.all() and n:
            locs, lens = self._ints().lookup_many(
                np.fromiter((p[1] for p in parts), np.uint64, n))
        else:
            for i, (kind, key64, _) in enumerate(parts):
                entry = self._lookup(kind, key64)
                if entry is not None:
                    locs[i], lens[i] = entry
        out: list[memoryview | None] = [None] * n
        runs = plan_reads(locs, lens, self._block)
        if runs:
            self._read_runs(runs, parts, locs, lens, out)
        hits = sum(v is not None for v in out)
        self.counters.gets += n
        self.counters.hits += hits
        self.counters.misses += n - hits
        if hits and self.policy.tracks_references:
            self._touch([parts[i] for i in range(n) if out[i] is not None])
        return out

    def _get_one(self, key: Any) -> memoryview | None:
        """One buffered read, without planning or the thread pool: a DataLoader reads one
        sample at a time, and the batch path's set-up costs more than the read."""
        kind, key64, kb = record.key_parts(int(key) if isinstance(key, np.integer) else key)
        entry = self._lookup(kind, key64)
        out = None
        fd = None if entry is None else self._reader_fd(entry[0] >> 32)
        if entry is not None and fd is not None:
            buf = memoryview(bytearray(entry[1]))
            got = pread_full(fd, entry[0] & 0xFFFFFFFF, buf, "cache-read")
            out = record.verify(buf[:got], kind, key64, kb)
            if out is None:
                self._verify_failed(0, [(kind, key64, kb)])
            else:
                self.counters.bytes_read += entry[1]
        self.counters.gets += 1
        self.counters.hits += out is not None
        self.counters.misses += out is None
        if out is not None and self.policy.tracks_references:
            self._touch([(kind, key64, kb)])
        return out

    def _read_runs(self, runs: list[Run], parts: list[tuple[int, int, bytes]],
                   locs: npt.NDArray[np.uint64], lens: npt.NDArray[np.uint32],
                   out: list[memoryview | None]) -> None:
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
                lo = base + (int(locs[i]) & 0xFFFFFFFF) - start
                length = int(lens[i])
                if lo + length <= base + n_read:
                    kind, key64, kb = parts[i]
                    out[i] = record.verify(buf[lo : lo + length], kind, key64, kb)

        self.engine.read_batch(requests, "cache-read", check)
        for _, _, members in placed:
            for i in members:
                if out[i] is None:
                    self._verify_failed(i, parts)
                else:
                    self.counters.bytes_read += int(lens[i])

    def _verify_failed(self, i: int, parts: list[tuple[int, int, bytes]]) -> None:
        self.counters.verify_failures += 1
        self._warn_verify("record for key %r failed verification (stale, torn or corrupt); "
                          "served as a miss", parts[i][1])

    def _touch(self, hits: list[tuple[int, int, bytes]]) -> None:
        """Set the CLOCK reference bits of records just read."""
        ints = [k for kind, k, _ in hits if kind == record.KIND_INT]
        if ints:
            self._ints().touch_many(np.array(ints, np.uint64))
        for kind, k, _ in hits:
            if kind == record.KIND_BYTES:
                self._hashes().touch(k)
