"""The in-process recorder: per-thread buffers, a background flush, flush at exit and fork.

Hot path (installed as the ``lcache.io`` tracer): look up this thread's buffer, map the fd to a
path through a cache validated by the file's inode (one ``fstat``), append one tuple. Formatting
and writing happen in a daemon thread every ``FLUSH_INTERVAL_S`` and at exit.

Processes: after ``fork()`` the child drops the parent's unflushed events (the parent writes
them), names itself in the trace and starts its own flush thread. A forked
``multiprocessing`` child (a DataLoader worker) leaves through ``os._exit`` without running
``atexit``; ``multiprocessing`` runs its ``Finalize`` hooks first, so the recorder registers
one there, and DataLoader workers' events arrive complete.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from typing import Any

from lcache.io import tracer as _io_tracer
from lcache.io.tracer import IOEvent
from lcache.trace.mounts import MountTable
from lcache.trace.schema import CLASSES
from lcache.trace.writer import (
    EVENT_REST,
    TraceWriter,
    event_prefix,
    file_metadata,
    process_metadata,
)

FLUSH_INTERVAL_S = 0.5
ENV = "LCACHE_TRACE"
ENV_FLUSH = "LCACHE_TRACE_FLUSH_S"  # seconds between background flushes (tests set it high)

#: The recorder of this process, or ``None``; other modules test it with a single ``is None``.
_active: Recorder | None = None
_lock = threading.Lock()


class _Buffer:
    __slots__ = ("events", "thread", "tid")

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.thread = threading.current_thread()
        self.tid = threading.get_native_id()


class Recorder:
    """Records this process's I/O events to ``path`` (see ``lcache.trace.enable``)."""

    def __init__(self, path: str, compress: bool | None = None) -> None:
        self.writer = TraceWriter(path, compress)
        self.path = self.writer.path
        self._local = threading.local()
        self._buffers: list[_Buffer] = []
        self._buffers_lock = threading.Lock()
        self._paths: dict[int, list[Any]] = {}  # fd -> [st_dev, st_ino, path, checked_ns]
        self._fids: dict[str, int] = {}
        self._mounts = MountTable()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pid = os.getpid()
        self._pending_meta = process_metadata(self.pid, _process_name(), os.getppid())

    # -- hot path ------------------------------------------------------------------------
    def _new_buffer(self) -> list[tuple[Any, ...]]:
        buf = _Buffer()
        self._local.events = buf.events
        with self._buffers_lock:
            self._buffers.append(buf)
        return buf.events

    def __call__(self, event: IOEvent) -> None:
        # Why fstat every event (~1 us): fd numbers are reused after close (a new checkpoint
        # file or segment often gets the number the previous one had), so a remembered path
        # may name another file; re-checking only now and then put dataset reads under a
        # checkpoint's name.
        known = self._check_fd(event.fd, self._paths.get(event.fd), event.start_ns)
        try:
            events = self._local.events
        except AttributeError:
            events = self._new_buffer()
        events.append((known, event))

    def _check_fd(self, fd: int, known: list[Any] | None, now_ns: int) -> list[Any]:
        try:
            st = os.fstat(fd)
        except OSError:  # closed already (or never valid): name it by number
            return [0, 0, f"fd:{fd}", 0]
        if known is None or known[1] != st.st_ino or known[0] != st.st_dev:
            known = [st.st_dev, st.st_ino, _fd_path(fd), now_ns]
            self._paths[fd] = known
        else:
            known[3] = now_ns
        return known

    def record(self, op: str, file: str, offset: int, size: int, io_class: str,
               start_ns: int, duration_ns: int, result: int) -> None:
        try:
            events = self._local.events
        except AttributeError:
            events = self._new_buffer()
        events.append(([0, 0, file, 0], IOEvent(op, -1, offset, size, result, start_ns,
                                                duration_ns, io_class)))

    # -- flushing ------------------------------------------------------------------------
    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="lcache-trace-flush",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = float(os.environ.get(ENV_FLUSH) or FLUSH_INTERVAL_S)
        while not self._stop.wait(interval):
            try:
                self.flush()
            except OSError as exc:  # a full disk must not kill the job being traced
                sys.stderr.write(f"lcache trace: cannot write {self.path}: {exc}\n")

    def flush(self) -> None:
        """Write every buffered event of every thread (one ``write()``)."""
        with self._flush_lock:
            if self.writer.fd < 0:
                return
            lines = self._pending_meta
            self._pending_meta = []
            pid, fids = self.pid, self._fids
            with self._buffers_lock:
                buffers = list(self._buffers)
            for buf in buffers:
                events = buf.events
                n = len(events)
                if n == 0:
                    if not buf.thread.is_alive():
                        with self._buffers_lock:
                            self._buffers.remove(buf)
                    continue
                chunk = events[:n]
                del events[:n]  # appends made meanwhile sit after n and stay
                tid = buf.tid
                prefixes: dict[tuple[str, str], str] = {}
                append = lines.append
                for known, ev in chunk:
                    path = known[2]
                    fid = fids.get(path)
                    if fid is None:
                        fid = fids[path] = len(fids) + 1
                        append(file_metadata(pid, fid, path,
                                             self._mounts.lookup(known[0], path)))
                    key = (ev.op, ev.io_class)
                    prefix = prefixes.get(key)
                    if prefix is None:
                        prefix = prefixes[key] = event_prefix(pid, tid, ev.op, ev.io_class)
                    # Formatted inline: this loop is most of the recorder's CPU time.
                    start, dur = ev.start_ns, ev.duration_ns
                    append(EVENT_REST % (prefix, start // 1000, start % 1000, dur // 1000,
                                         dur % 1000, fid, ev.offset, ev.size, ev.result))
            self.writer.write_lines(lines)

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() \
                and thread.is_alive():
            thread.join(timeout=5)
        self.flush()
        self.writer.close()

    def after_fork_in_child(self) -> None:
        # The parent flushes what was buffered before the fork; the child starts afresh.
        self.pid = os.getpid()
        self._local = threading.local()
        self._buffers = []
        self._buffers_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._fids = {}
        self._pending_meta = process_metadata(self.pid, _process_name(), os.getppid())
        self._stop = threading.Event()
        self.start()


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd:{fd}"


def _process_name() -> str:
    name = " ".join(sys.argv) if sys.argv and sys.argv[0] else sys.executable
    return name[:300]


_checked: set[str] = set(CLASSES) | {"read", "write", "fsync", "fdatasync", "open", "unlink"}


def _check_name(kind: str, value: str) -> None:
    if value in _checked:
        return
    # The hot path formats events by hand, so names must need no JSON escaping.
    if not value or len(value) > 64 or not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError(f"trace {kind} {value!r} must be 1-64 letters, digits, '-', '_' or "
                         "'.'; use one of the documented classes (docs/trace.md)")
    _checked.add(value)


def enable(path: str, *, compress: bool | None = None) -> None:
    """Start recording this process's lcache I/O events to ``path``.

    Every ``lcache.io`` operation is recorded with its ``io_class``. Forked children
    (DataLoader workers) append their own events to the same file; ``LCACHE_TRACE`` is set so
    that spawned Python children that import lcache do too. Enabling the same path twice is a
    no-op; enabling another path switches to it.

    Args:
        path: the trace file (created, or appended to). Ending in ``.gz`` compresses it.
        compress: force gzip on or off, whatever the suffix.
    """
    global _active
    with _lock:
        if _active is not None:
            if _active.path == os.path.abspath(path) and os.getpid() == _active.pid:
                return
            _disable_locked()
        rec = Recorder(path, compress)
        rec.start()
        _active = rec
        _io_tracer.set_tracer(rec)
        os.environ[ENV] = rec.path
        _register_once()


def disable() -> None:
    """Flush the buffered events, close the trace and uninstall the recorder."""
    with _lock:
        _disable_locked()


def _disable_locked() -> None:
    global _active
    rec = _active
    if rec is None:
        return
    _active = None
    if _io_tracer.get_tracer() is rec:
        _io_tracer.set_tracer(None)
    if os.environ.get(ENV) == rec.path:
        del os.environ[ENV]
    rec.close()


def enabled() -> bool:
    """Whether this process is recording a trace."""
    return _active is not None


def flush() -> None:
    """Write the buffered events now (they are also written every 0.5 s and at exit)."""
    rec = _active
    if rec is not None:
        rec.flush()


def record(op: str, file: str, offset: int, size: int, io_class: str, start_ns: int,
           duration_ns: int, result: int) -> None:
    """Record one I/O operation that did not go through ``lcache.io``; no-op when off.

    Args:
        op: ``"read"`` or ``"write"`` (bytes moved) or another verb (``"fsync"``, ``"open"``).
        file: path or URL of what was read or written.
        offset: byte offset in the file.
        size: bytes requested.
        io_class: one of ``lcache.trace.CLASSES``.
        start_ns: ``time.perf_counter_ns()`` when the operation started.
        duration_ns: how long it took, in nanoseconds.
        result: bytes transferred, or ``-errno`` on failure.
    """
    rec = _active
    if rec is None:
        return
    _check_name("op", op)
    _check_name("class", io_class)
    if start_ns < 0 or duration_ns < 0:
        raise ValueError(f"start_ns ({start_ns}) and duration_ns ({duration_ns}) must be >= 0; "
                         "take them from lcache.trace.now_ns()")
    rec.record(op, str(file), int(offset), int(size), io_class, int(start_ns),
               int(duration_ns), int(result))


def now_ns() -> int:
    """The clock trace timestamps use (``time.perf_counter_ns``)."""
    return time.perf_counter_ns()


_registered = False


def _register_once() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    atexit.register(_at_exit)
    os.register_at_fork(after_in_child=_after_fork_in_child)
    # multiprocessing children (DataLoader workers) end with os._exit, after running their
    # Finalize hooks but not atexit; the child's bootstrap clears the finalizers inherited
    # from the parent and then runs its after-fork hooks, so register the flush from there.
    import multiprocessing.util as mp_util

    mp_util.register_after_fork(_FORK_HOOK, _register_multiprocessing_finalizer)


def _at_exit() -> None:
    rec = _active
    if rec is not None and rec.pid == os.getpid():
        with contextlib.suppress(OSError):
            rec.flush()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # the parent may have held it while forking
    rec = _active
    if rec is not None:
        rec.after_fork_in_child()


class _ForkHook:
    """A weak-referenceable key for ``multiprocessing.util.register_after_fork``."""


_FORK_HOOK = _ForkHook()


def _register_multiprocessing_finalizer(_: object) -> None:
    import multiprocessing.util as mp_util

    mp_util.Finalize(None, _at_exit, exitpriority=-100)


def enable_from_environment() -> None:
    """Honour ``LCACHE_TRACE=path`` (called when lcache is imported)."""
    path = os.environ.get(ENV)
    if path and _active is None:
        try:
            enable(path)
        except OSError as exc:
            sys.stderr.write(f"lcache: cannot trace to LCACHE_TRACE={path}: {exc}\n")
