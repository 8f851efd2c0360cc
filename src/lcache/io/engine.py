"""Positional file I/O on a bounded pool of threads: one engine per process.

``os.preadv``/``os.pwritev`` release the GIL, so a small pool of threads keeps ``queue_depth``
requests in flight at the device. Two ways in:

- ``submit_read``/``submit_write`` hand one operation to the pool and return a ``Pending``
  handle at once; ``submit_*`` blocks while ``queue_depth`` operations are in flight, so memory
  held by queued buffers stays bounded.
- ``read_batch`` hands a whole batch over once (one wake-up per thread, not one per request)
  and the calling thread works on it too; workers pull requests from a shared counter, so a
  slow request does not hold up the rest.

On an ``O_DIRECT`` descriptor, an operation whose offset, length or memory is not aligned is
split: the aligned body goes direct from an aligned bounce buffer and the
unaligned head and tail go through the page cache, so every byte is written (DeepSpeed #1070
wrote a 0-byte file for a 4,000-byte tensor).

The pool is created lazily and re-created after ``fork()``: DataLoader workers never inherit a
running thread pool (../shared/DESIGN.md, "Speed in Python"). ``default_engine()`` is the
process's engine, shared by every layer.
"""

from __future__ import annotations

import _thread
import contextlib
import enum
import errno
import fcntl
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from lcache.checks import env_number, whole_number
from lcache.errors import ConfigError, DiskFullError, LCacheError
from lcache.forksafe import fork_safe_lock
from lcache.io import tracer as _tracing
from lcache.io.buffers import PAGE, align_down, align_up, aligned_empty
from lcache.io.files import O_DIRECT, open_file
from lcache.io.tracer import emit as _emit

Buffer = bytes | bytearray | memoryview
_log = logging.getLogger("lcache")
_ALIGN_MASK = PAGE - 1  # O_DIRECT alignment: a page satisfies every common logical block size
_BOUNCE = 4 << 20  # most bytes an unaligned O_DIRECT operation copies at a time
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
IOV_MAX = 1024  # most buffers one pwritev or writev takes (Linux UIO_MAXIOV, macOS IOV_MAX)
#: The most operations an engine keeps in flight (one worker thread each): far past what a
#: device queue gains from, and what $LCACHE_IO_QUEUE_DEPTH and every queue_depth setting take.
MAX_QUEUE_DEPTH = 1024


class SyncPolicy(enum.Enum):
    """When written data is forced to stable storage.

    NEVER: leave it to the kernel's write-back (fastest; a power loss may lose recent writes).
    FLUSH: on ``flush()``, when a segment is sealed, and at close (the default).
    ALWAYS: ``fdatasync`` after every write call.
    """

    NEVER = "never"
    FLUSH = "flush"
    ALWAYS = "always"

    @classmethod
    def named(cls, value: object, name: str = "sync") -> SyncPolicy:
        """The policy ``value`` names (a member, or its value: ``"flush"``...), or a
        ConfigError naming the setting ``name`` and the choices (not enum's bare
        ValueError)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for policy in cls:
                if value == policy.value:
                    return policy
        names = [policy.value for policy in cls]
        raise ConfigError(f"{name}={value!r:.100}: use {', '.join(names[:-1])} or {names[-1]}")


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
    return _pwrite_all(fd, fd, offset, bufs, io_class)


def _pwrite_all(fd: int, traced_fd: int, offset: int,
                bufs: Sequence[bytes | bytearray | memoryview], io_class: str) -> int:
    """``pwrite_full`` through ``fd``, traced as ``traced_fd`` (the descriptor the caller knows)."""
    t0 = time.perf_counter_ns() if _tracing._tracer is not None else 0
    size = sum(len(b) for b in bufs)
    total = 0
    if len(bufs) > IOV_MAX:
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
        _emit("write", traced_fd, offset, size, -(exc.errno or 1), t0, io_class)
        if exc.errno in _NO_SPACE:
            raise DiskFullError(
                f"no space left on the device writing {size} bytes at offset {offset}"
            ) from exc
        raise
    _emit("write", traced_fd, offset, size, total, t0, io_class)
    return total


def sync_fd(fd: int, data_only: bool = True, io_class: str = "other") -> None:
    """``fdatasync`` (or ``fsync`` with ``data_only=False``) and trace it."""
    t0 = time.perf_counter_ns() if _tracing._tracer is not None else 0
    if data_only:
        os.fdatasync(fd)
    else:
        os.fsync(fd)
    _emit("fdatasync" if data_only else "fsync", fd, 0, 0, 0, t0, io_class)


def _is_direct(fd: int) -> bool:
    return bool(O_DIRECT) and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)


def _aligned(offset: int, buf: Buffer) -> bool:
    """Whether O_DIRECT takes this operation as it is: offset, length and memory aligned."""
    if (offset | len(buf)) & _ALIGN_MASK:
        return False
    address: int = np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]
    return not address & _ALIGN_MASK


def _buffered_twin(fd: int) -> int:
    """A second, buffered descriptor of ``fd``'s file (same access mode), for the bytes
    O_DIRECT cannot take.

    Opened through ``/proc/self/fd``: a link the kernel made to a file this process already
    holds, so it cannot be a planted symbolic link (which ``open_file`` refuses with
    O_NOFOLLOW). The page cache stays coherent with O_DIRECT: the kernel writes dirty pages
    back before a direct read of them, and ``fdatasync`` of either descriptor flushes both.
    """
    access = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    try:
        return os.open(f"/proc/self/fd/{fd}", access | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise ConfigError("unaligned O_DIRECT I/O needs /proc to reach the file buffered; "
                          "align offsets and lengths to 4096 bytes or open without O_DIRECT"
                          ) from exc


def _write_direct_unaligned(fd: int, offset: int, data: memoryview, io_class: str) -> int:
    """Write ``data`` to an O_DIRECT ``fd``: whole blocks direct (through an aligned bounce
    buffer where the memory is not aligned), the partial head and tail blocks buffered."""
    end = offset + len(data)
    a0, a1 = align_up(offset, PAGE), align_down(end, PAGE)
    if a1 <= a0:  # no whole block
        a0 = a1 = end
    pieces = [(off, piece) for off, piece in ((offset, data[: a0 - offset]),
                                              (a1, data[a1 - offset :])) if len(piece)]
    twin = _buffered_twin(fd) if pieces else -1
    written = 0
    try:
        if a1 > a0:
            bounce = aligned_empty(min(a1 - a0, _BOUNCE))
            for pos in range(a0, a1, _BOUNCE):
                chunk = data[pos - offset : min(a1, pos + _BOUNCE) - offset]
                if not _aligned(0, chunk):
                    bounce[: len(chunk)] = chunk
                    chunk = bounce[: len(chunk)]
                written += pwrite_full(fd, pos, [chunk], io_class)
        for off, piece in pieces:
            written += _pwrite_all(twin, fd, off, [piece], io_class)
    finally:
        if twin >= 0:
            os.close(twin)
    return written


def _read_direct_unaligned(fd: int, offset: int, buf: memoryview, io_class: str) -> int:
    """Read into ``buf`` from an O_DIRECT ``fd`` through an aligned bounce buffer."""
    size = len(buf)
    bounce = aligned_empty(min(align_up(size, PAGE) + PAGE, _BOUNCE))
    done = 0
    while done < size:
        pos = offset + done
        skew = pos & _ALIGN_MASK
        want = min(len(bounce), align_up(skew + size - done, PAGE))
        got = pread_full(fd, pos - skew, bounce[:want], io_class)
        n = max(0, min(got - skew, size - done))
        buf[done : done + n] = bounce[skew : skew + n]
        done += n
        if got < want:  # the end of the file
            break
    return done


def open_direct(path: str, flags: int, mode: int = 0o600) -> tuple[int, bool]:
    """Open ``path`` with O_DIRECT where the platform and filesystem allow, else buffered.

    Returns the descriptor and whether it is direct. The engine moves every byte either way
    (unaligned parts of a direct file go through the page cache).
    """
    try:
        return open_file(path, flags, direct=True, mode=mode), True
    except ConfigError:
        _log.debug("O_DIRECT refused for %s; using buffered I/O", path)
        return open_file(path, flags, mode=mode), False


class EngineError(LCacheError, RuntimeError):
    """The engine was used in a way it cannot serve (e.g. a handle waited on across fork)."""


class Pending:
    """The completion handle of one submitted operation.

    ``wait()`` returns the bytes transferred (the full length; short only where a read meets
    the end of the file) or re-raises the error the operation met (``DiskFullError`` for a
    full device). ``done()`` tells without blocking.
    """

    __slots__ = ("_error", "_lock", "_pid", "_result")

    def __init__(self, pid: int) -> None:
        # A held lock the worker releases: cheaper than an Event, and waiting releases the GIL.
        self._lock = _thread.allocate_lock()
        self._lock.acquire()
        self._result = 0
        self._error: BaseException | None = None
        self._pid = pid

    def done(self) -> bool:
        return not self._lock.locked()

    def wait(self, timeout: float | None = None) -> int:
        """Block until the operation finished; its byte count, or its error raised here.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the operation goes on).
            EngineError: the operation was submitted before a ``fork()``; the child never
                sees it complete.
        """
        lock = self._lock
        if lock.locked():
            if self._pid != os.getpid():
                raise EngineError("this I/O was submitted by the parent before fork(); "
                                  "wait for it there, or submit it again in the child")
            if not lock.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(f"I/O not finished after {timeout} s")
            lock.release()
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result: int, error: BaseException | None) -> None:
        self._result = result
        self._error = error
        self._lock.release()


def settle(handles: Iterable[Pending]) -> None:
    """Wait for every handle, ignoring their errors: the cleanup after a first error, so that
    no operation outlives the buffer or the descriptor it uses."""
    for p in handles:
        with contextlib.suppress(Exception):
            p.wait()


Completions = queue.SimpleQueue[Pending]
"""Where finished handles are put, in the order they finish (``notify=`` of ``submit_*``)."""


class _Op:
    """One submitted read or write; a worker runs it and finishes its ``Pending``."""

    __slots__ = ("buf", "fd", "io_class", "notify", "offset", "pending", "tokens", "write")

    def __init__(self, fd: int, offset: int, buf: Buffer | list[Buffer], write: bool,
                 io_class: str, pending: Pending, tokens: queue.SimpleQueue[None],
                 notify: Completions | None) -> None:
        self.fd = fd
        self.offset = offset
        self.buf = buf
        self.write = write
        self.io_class = io_class
        self.pending = pending
        self.tokens = tokens
        self.notify = notify

    def work(self) -> None:
        try:
            fd, offset, io_class = self.fd, self.offset, self.io_class
            if isinstance(self.buf, list):  # submit_writev
                n = (pwrite_full(fd, offset, self.buf, io_class) if not _is_direct(fd)
                     else _transfer(fd, offset, memoryview(b"".join(self.buf)), True, io_class))
            else:
                n = _transfer(fd, offset, memoryview(self.buf), self.write, io_class)
        except BaseException as exc:
            self._finish(0, exc)
            return
        self._finish(n, None)

    def _finish(self, n: int, error: BaseException | None) -> None:
        # The slot is freed before the waiter wakes, so a caller that waits then submits
        # never blocks on its own finished operation.
        self.tokens.put(None)
        self.pending._finish(n, error)
        if self.notify is not None:
            self.notify.put(self.pending)


def _transfer(fd: int, offset: int, buf: memoryview, write: bool, io_class: str) -> int:
    """One whole read or write, split where O_DIRECT cannot take it as it is."""
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B")  # lengths and offsets are in bytes (e.g. a tensor's view)
    slow = not _aligned(offset, buf) and _is_direct(fd)
    if write:
        return (_write_direct_unaligned(fd, offset, buf, io_class) if slow
                else pwrite_full(fd, offset, [buf], io_class))
    return (_read_direct_unaligned(fd, offset, buf, io_class) if slow
            else pread_full(fd, offset, buf, io_class))


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


_engines: weakref.WeakSet[IOEngine] = weakref.WeakSet()


class IOEngine:
    """Runs positional reads and writes with up to ``queue_depth`` of them in flight.

    Prefer ``default_engine()``, shared by every layer of the process, to a private one.
    Do not wait for an operation from inside an ``on_done`` callback: it runs on a worker.

    Args:
        queue_depth: operations kept in flight (worker threads), 1 to ``MAX_QUEUE_DEPTH``.

    Raises:
        ConfigError: ``queue_depth`` is not a whole number in that range.
    """

    def __init__(self, queue_depth: int = 16) -> None:
        self.queue_depth = whole_number(queue_depth, "queue_depth", 1, MAX_QUEUE_DEPTH)
        self._pid = -1
        self._queue: queue.SimpleQueue[_Batch | _Op | None] = queue.SimpleQueue()
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        _engines.add(self)

    def _ensure_pool(self) -> None:
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid == os.getpid():
                return
            # After fork the parent's threads and in-flight operations do not exist here.
            self._queue = queue.SimpleQueue()
            self._tokens = queue.SimpleQueue()
            for _ in range(self.queue_depth):
                self._tokens.put(None)
            self._threads = []
            for i in range(self.queue_depth):
                t = threading.Thread(target=self._worker, name=f"lcache-io-{i}", daemon=True)
                t.start()
                self._threads.append(t)
            self._pid = os.getpid()

    def _worker(self) -> None:
        # SIGTERM is not blocked here (lcache.forksafe.background_thread): on_done callbacks
        # of the program's run in these threads, and processes they start inherit the mask
        q = self._queue
        while True:
            item = q.get()
            if item is None:
                return
            item.work()

    def _submit(self, fd: int, offset: int, buf: Buffer | list[Buffer], write: bool,
                io_class: str, notify: Completions | None) -> Pending:
        self._ensure_pool()
        tokens = self._tokens
        tokens.get()  # blocks while queue_depth operations are in flight
        pending = Pending(self._pid)
        self._queue.put(_Op(fd, offset, buf, write, io_class, pending, tokens, notify))
        return pending

    def submit_read(self, fd: int, offset: int, buf: memoryview, io_class: str = "other",
                    notify: Completions | None = None) -> Pending:
        """Start reading ``len(buf)`` bytes of ``fd`` at ``offset`` into ``buf``.

        ``buf`` must stay untouched until the handle is done. Blocks while ``queue_depth``
        operations are in flight. With ``notify``, the handle is also put there once done,
        so a caller with many operations in flight reaps them in the order they finish
        rather than waiting behind the oldest.
        """
        return self._submit(fd, offset, buf, False, io_class, notify)

    def submit_write(self, fd: int, offset: int, data: Buffer, io_class: str = "other",
                     notify: Completions | None = None) -> Pending:
        """Start writing all of ``data`` to ``fd`` at ``offset``.

        ``data`` must stay unchanged until the handle is done. Blocks while ``queue_depth``
        operations are in flight. ``notify`` as for ``submit_read``.
        """
        return self._submit(fd, offset, data, True, io_class, notify)

    def submit_writev(self, fd: int, offset: int, bufs: Sequence[Buffer],
                      io_class: str = "other", notify: Completions | None = None) -> Pending:
        """Start writing ``bufs`` one after another at ``offset`` (one ``pwritev``; joined
        first on an O_DIRECT descriptor). As ``submit_write`` otherwise."""
        return self._submit(fd, offset, list(bufs), True, io_class, notify)

    def writev_now(self, fd: int, offset: int, bufs: Sequence[Buffer],
                   io_class: str = "other") -> Pending:
        """``submit_writev`` done in the calling thread, for a buffered descriptor: a write
        into the page cache takes microseconds, less than handing it to a worker and waking
        up again (behind whatever thread holds the GIL). Returns a finished handle whose
        ``wait()`` returns or raises as a submitted one would."""
        pending = Pending(os.getpid())
        try:
            n = pwrite_full(fd, offset, list(bufs), io_class)
        except BaseException as exc:
            pending._finish(0, exc)
        else:
            pending._finish(n, None)
        return pending

    def read_batch(self, requests: Sequence[ReadRequest], io_class: str = "other",
                   on_done: Callable[[int, int], None] | None = None,
                   depth: int | None = None) -> list[int]:
        """Perform every request; returns the bytes read for each (short only at end of file).

        ``on_done(i, nbytes)`` runs in the I/O thread as soon as request ``i`` is read, so
        processing overlaps the reads still in flight. At most ``depth`` (default and at most
        ``queue_depth``) requests are in flight, counting the caller's. Raises the first
        exception a request or ``on_done`` met, after every worker has stopped.

        Raises:
            ConfigError: ``depth`` is not None or a whole number >= 1 (one below 1 left
                the batch waiting for workers that were never asked: a hang).
        """
        if depth is not None:
            depth = whole_number(depth, "depth", 1)
        if not requests:
            return []
        helpers = min(self.queue_depth, len(requests), depth or self.queue_depth) - 1
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
        """Finish what was submitted, then stop the worker threads (they are daemons; closing
        is optional but tidy). The engine starts afresh if used again."""
        with self._lock:
            if self._pid == os.getpid():
                for _ in self._threads:
                    self._queue.put(None)
                for t in self._threads:
                    t.join(timeout=5)
            self._threads = []
            self._pid = -1

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # a thread of the parent may have held it at fork()
        self._threads = []
        self._pid = -1


_default: IOEngine | None = None
_default_lock = fork_safe_lock()
DEFAULT_QUEUE_DEPTH = 16
_DEPTH_ENV = "LCACHE_IO_QUEUE_DEPTH"


def default_engine() -> IOEngine:
    """The process's engine, shared by every layer (created on first use).

    Its queue depth is ``$LCACHE_IO_QUEUE_DEPTH`` (default 16) when it is created. A forked
    child gets the same object with a fresh pool of its own.

    Raises:
        ConfigError: ``$LCACHE_IO_QUEUE_DEPTH`` is not a whole number from 1 to
            ``MAX_QUEUE_DEPTH`` (1024).
    """
    global _default
    engine = _default
    if engine is None:
        with _default_lock:
            if _default is None:
                _default = IOEngine(_queue_depth_from_env())
            engine = _default
    return engine


def _queue_depth_from_env() -> int:
    return env_number(_DEPTH_ENV, DEFAULT_QUEUE_DEPTH, 1, MAX_QUEUE_DEPTH)


def _after_fork_in_child() -> None:
    for engine in list(_engines):
        engine._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
