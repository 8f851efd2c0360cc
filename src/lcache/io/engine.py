"""Batched positional I/O with a configurable queue depth.

``os.preadv``/``os.pwritev`` release the GIL, so a small pool of threads keeps ``queue_depth``
requests in flight at the device. A batch is handed to the pool once (one wake-up per thread,
not one per request) and the calling thread works on it too; workers pull requests from a shared
counter, so a slow request does not hold up the rest.

The pool is created lazily and re-created after ``fork()``: DataLoader workers never inherit a
running thread pool (../shared/DESIGN.md, "Speed in Python").
"""

from __future__ import annotations

import enum
import errno
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lcache.errors import DiskFullError
from lcache.io import tracer as _tracing
from lcache.io.tracer import emit as _emit

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_IOV_MAX = 1024  # most buffers one pwritev takes (Linux UIO_MAXIOV, macOS IOV_MAX)


class SyncPolicy(enum.Enum):
    """When written data is forced to stable storage.

    NEVER: leave it to the kernel's write-back (fastest; a power loss may lose recent writes).
    FLUSH: on ``flush()``, when a segment is sealed, and at close (the default).
    ALWAYS: ``fdatasync`` after every write call.
    """

    NEVER = "never"
    FLUSH = "flush"
    ALWAYS = "always"


@dataclass(slots=True)
class ReadRequest:
    """Read ``len(buf)`` bytes of ``fd`` at ``offset`` into the writable buffer ``buf``."""

    fd: int
    offset: int
    buf: memoryview


def pread_full(fd: int, offset: int, buf: memoryview, io_class: str = "other") -> int:
    """Read into ``buf`` until it is full or the file ends; returns the bytes read."""
    t0 = time.perf_counter_ns() if _tracing._tracer is not None else 0
    total = 0
    size = len(buf)
    try:
        while total < size:
            n = os.preadv(fd, [buf[total:]], offset + total)
            if n == 0:
                break
            total += n
    except OSError as exc:
        _emit("read", fd, offset, size, -(exc.errno or 1), t0, io_class)
        raise
    _emit("read", fd, offset, size, total, t0, io_class)
    return total


def pwrite_full(
    fd: int, offset: int, bufs: Sequence[bytes | bytearray | memoryview], io_class: str = "other"
) -> int:
    """Write all of ``bufs`` at ``offset`` (one ``pwritev`` unless the kernel writes short).

    Raises:
        DiskFullError: the device is full (ENOSPC/EDQUOT). Part of the data may be on disk.
    """
    t0 = time.perf_counter_ns() if _tracing._tracer is not None else 0
    size = sum(len(b) for b in bufs)
    total = 0
    if len(bufs) > _IOV_MAX:
        # Why: pwritev fails with EINVAL beyond IOV_MAX buffers, and put_many of small records
        # hands over one buffer per record part; one flat copy is cheap next to that.
        bufs = [b"".join(bufs)]
    try:
        n = os.pwritev(fd, list(bufs), offset)
        total = n
        if n < size:  # rare short write: finish from a flat copy of the remainder
            rest = memoryview(b"".join(bytes(b) for b in bufs))[n:]
            while total < size:
                total += os.pwrite(fd, rest[total - n :], offset + total)
    except OSError as exc:
        _emit("write", fd, offset, size, -(exc.errno or 1), t0, io_class)
        if exc.errno in _NO_SPACE:
            raise DiskFullError(
                f"no space left on the device writing {size} bytes at offset {offset}"
            ) from exc
        raise
    _emit("write", fd, offset, size, total, t0, io_class)
    return total


def sync_fd(fd: int, data_only: bool = True, io_class: str = "other") -> None:
    """``fdatasync`` (or ``fsync`` with ``data_only=False``) and trace it."""
    t0 = time.perf_counter_ns() if _tracing._tracer is not None else 0
    if data_only:
        os.fdatasync(fd)
    else:
        os.fsync(fd)
    _emit("fdatasync" if data_only else "fsync", fd, 0, 0, 0, t0, io_class)


class _Batch:
    """One batch of reads shared by the workers; each pulls the next index from a counter."""

    def __init__(self, requests: Sequence[ReadRequest], io_class: str, parties: int,
                 on_done: Callable[[int, int], None] | None) -> None:
        self.requests = requests
        self.io_class = io_class
        self.on_done = on_done
        self.results = [0] * len(requests)
        self.error: BaseException | None = None
        self._next = itertools.count()
        self._pending = parties
        self._lock = threading.Lock()
        self.done = threading.Event()

    def work(self) -> None:
        requests, results, n = self.requests, self.results, len(self.requests)
        on_done = self.on_done
        try:
            for i in self._next:  # next() on itertools.count is atomic under the GIL
                if i >= n or self.error is not None:
                    break
                req = requests[i]
                results[i] = got = pread_full(req.fd, req.offset, req.buf, self.io_class)
                if on_done is not None:
                    on_done(i, got)
        except BaseException as exc:
            self.error = exc
        with self._lock:
            self._pending -= 1
            if self._pending == 0:
                self.done.set()


class IOEngine:
    """Runs batches of positional reads with up to ``queue_depth`` of them in flight.

    Args:
        queue_depth: requests kept in flight (threads, counting the caller's).
    """

    def __init__(self, queue_depth: int = 16) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        self.queue_depth = queue_depth
        self._pid = -1
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _ensure_pool(self) -> None:
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid == os.getpid():
                return
            # After fork the parent's threads do not exist here: start afresh.
            self._queue = queue.SimpleQueue()
            self._threads = []
            for i in range(self.queue_depth - 1):
                t = threading.Thread(target=self._worker, name=f"lcache-io-{i}", daemon=True)
                t.start()
                self._threads.append(t)
            self._pid = os.getpid()

    def _worker(self) -> None:
        q = self._queue
        while True:
            batch = q.get()
            if batch is None:
                return
            batch.work()

    def read_batch(self, requests: Sequence[ReadRequest], io_class: str = "other",
                   on_done: Callable[[int, int], None] | None = None) -> list[int]:
        """Perform every request; returns the bytes read for each (short only at end of file).

        ``on_done(i, nbytes)`` runs in the I/O thread as soon as request ``i`` is read, so
        processing overlaps the reads still in flight. Raises the first exception a request
        or ``on_done`` met, after every worker has stopped.
        """
        if not requests:
            return []
        helpers = min(self.queue_depth, len(requests)) - 1
        if helpers > 0:
            self._ensure_pool()
        batch = _Batch(requests, io_class, helpers + 1, on_done)
        for _ in range(helpers):
            self._queue.put(batch)
        batch.work()
        batch.done.wait()
        if batch.error is not None:
            raise batch.error
        return batch.results

    def close(self) -> None:
        """Stop the worker threads (they are daemons; closing is optional but tidy)."""
        with self._lock:
            if self._pid == os.getpid():
                for _ in self._threads:
                    self._queue.put(None)
                for t in self._threads:
                    t.join(timeout=5)
            self._threads = []
            self._pid = -1
