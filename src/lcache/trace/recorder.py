"""The in-process recorder: per-thread binary buffers, a background flush, flush at exit and fork.

Hot path (``lcache.io.tracer.emit``, installed by ``enable``): a 56-byte record appended to
this thread's list; files are named by the id ``lcache.io.files.open_file`` gave the
fd. A daemon thread writes the buffers as binary blocks (``lcache.trace.blocks``), with JSON
lines naming the files, ops and classes they use, every ``FLUSH_INTERVAL_S`` and at exit.
``lcache report`` and ``lcache.report.load`` turn the blocks into events; nothing is formatted
while the job runs.

Processes: after ``fork()`` the child drops the parent's unflushed events (the parent writes
them), names itself and every file it inherited in the trace, and starts its own flush thread.
A forked ``multiprocessing`` child (a DataLoader worker) leaves through ``os._exit`` without
running ``atexit``; ``multiprocessing`` runs its ``Finalize`` hooks first, so the recorder
registers one there, and DataLoader workers' events arrive complete. A process ended by
SIGTERM (``Pool.terminate()``, which leaving ``with Pool(...)`` calls) flushes in a handler
and then dies by the signal, as it would have (see ``_on_sigterm``).

Markers: each recording process writes ``recorder`` lines, ``"state": "start"`` when it
starts (at once, not at the first flush) and ``"state": "end"`` after its last flush; a pid
with a start and no end lost the events of its last interval (``kill -9``, ``os._exit``).
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import signal
import sys
import threading
import time

from lcache.checks import env_seconds, flag, path_argument
from lcache.errors import ConfigError
from lcache.forksafe import background_thread, fork_safe_lock
from lcache.io import tracer as _io_tracer
from lcache.io.tracer import IOEvent
from lcache.trace import blocks as blocks_mod
from lcache.trace.blocks import event_blocks
from lcache.trace.mounts import MountTable
from lcache.trace.schema import CLASSES
from lcache.trace.writer import TraceWriter, dumps, file_metadata, process_metadata

FLUSH_INTERVAL_S = 0.5
ENV = "LCACHE_TRACE"
ENV_FLUSH = "LCACHE_TRACE_FLUSH_S"  # seconds between background flushes (tests set it high)
#: why LCACHE_TRACE could not be honoured when lcache was imported (a bad setting)
env_error: ConfigError | None = None

#: The recorder of this process, or ``None``; other modules test it with a single ``is None``.
_active: Recorder | None = None
_lock = fork_safe_lock()


class Recorder:
    """Records this process's I/O events to ``path`` (see ``lcache.trace.enable``)."""

    def __init__(self, path: str, compress: bool | None = None) -> None:
        self.writer = TraceWriter(path, compress)
        self.path = self.writer.path
        self._named: dict[str, int] = {}  # path or URL given to record() -> file id
        self._record_names: dict[int, str] = {}  # and back
        self._written: set[int] = set()  # file ids whose file_name line is in the trace
        self._mounts = _mount_table()
        self._flush_lock = threading.Lock()
        self._flushing = 0  # ident of the thread in flush(), 0: none
        self._deferred_sigterm = False  # a SIGTERM that came while this thread flushed
        self.pid = os.getpid()
        self._start()

    def _start(self) -> None:
        self._ended = False
        # Written now, not at the first flush: a process killed before its first flush still
        # shows that it recorded, and so that its events may be missing.
        self.writer.write_lines([*process_metadata(self.pid, _process_name(), os.getppid()),
                                 _marker(self.pid, "start")])

    def __call__(self, event: IOEvent) -> None:
        """Record an event handed over as an object (``emit`` appends without one)."""
        _io_tracer.append(event.op, _io_tracer.fid_for(event.fd), event.offset, event.size,
                          event.result, event.start_ns, event.start_ns + event.duration_ns,
                          event.io_class)

    def record(self, op: str, file: str, offset: int, size: int, io_class: str,
               start_ns: int, duration_ns: int, result: int) -> None:
        fid = self._named.get(file)
        if fid is None:
            fid = self._named[file] = _io_tracer.new_file_id()
            self._record_names[fid] = file
        _io_tracer.append(op, fid, offset, size, result, start_ns, start_ns + duration_ns,
                          io_class)

    # -- flushing ------------------------------------------------------------------------
    def flush(self, tidy: bool = True) -> None:
        """Write every buffered event of every thread (one ``writev()``: each thread's records
        are joined once and not copied again). ``tidy=False`` (from a signal handler) leaves
        ended threads' lists tracked: dropping one takes a lock the interrupted code may hold."""
        with self._flush_lock:
            self._flushing = threading.get_ident()
            try:
                self._flush_locked(tidy)
            finally:
                self._flushing = 0
        if self._deferred_sigterm:  # it came during this flush (_on_sigterm): now end
            self._deferred_sigterm = False
            os.kill(os.getpid(), signal.SIGTERM)

    def _flush_locked(self, tidy: bool) -> None:
        if self.writer.fd < 0:
            return
        _io_tracer.next_flush()
        blocks: list[bytes | memoryview] = []
        lines: list[str] = []
        for entry in list(_io_tracer.buffers):
            tid, events, thread = entry
            n = len(events)
            if n == 0:
                if tidy and not thread.is_alive():
                    _io_tracer.forget_dead_buffer(entry)
                continue
            chunk = b"".join(events[:n])
            del events[:n]  # appends made meanwhile sit after n and stay
            blocks.extend(event_blocks(self.pid, tid, chunk))
            lines.extend(self._file_lines(chunk))
        # Taken after the events: every op and class name they use was queued before.
        pid = self.pid
        lines.extend(dumps({"name": "io_name", "ph": "M", "pid": pid, "tid": pid,
                            "args": {"kind": kind, "id": ident, "name": name}})
                     for kind, ident, name in _io_tracer.take_pending())
        self.writer.write_lines(lines, blocks)

    def _file_lines(self, chunk: bytes) -> list[str]:
        """``file_name`` lines of the files first used in ``chunk`` (found without a Python
        object per event)."""
        import numpy as np  # here: `lcache trace` and traced children import this module

        fids = np.sort(np.frombuffer(chunk, "<i8")[1 :: blocks_mod.FIELDS])
        # not np.unique: its first call imports numpy.ma, 50 ms in every traced process
        first = np.ones(len(fids), bool)
        first[1:] = fids[1:] != fids[:-1]
        out = []
        for fid in fids[first].tolist():
            if fid in self._written:
                continue
            self._written.add(fid)
            name = self._record_names.get(fid)
            if name is not None:
                where = self._mounts.lookup(0, name)
            else:
                known = _io_tracer.file_name(fid)
                name, dev = known if known is not None else (f"fid:{fid}", 0)
                where = self._mounts.lookup(dev, name)
            out.append(file_metadata(self.pid, fid, name, where))
        return out

    def end(self, how: str, tidy: bool = True) -> None:
        """Flush, then write the end marker: nothing of this process is left unwritten."""
        self.flush(tidy)
        with self._flush_lock:
            # once: a multiprocessing child's Finalize and then its atexit both end it
            if self.writer.fd >= 0 and not self._ended:
                self._ended = True
                self.writer.write_lines([_marker(self.pid, "end", how)])

    def flush_from_signal_handler(self, how: str | None) -> None:
        """``end`` (or, ``how`` None, only ``flush``) from a signal handler, which runs in the
        main thread between two bytecodes: if that thread was inside ``flush`` (holding the
        lock), waiting would deadlock, so nothing more is written (its interrupted flush is
        lost, the end marker says nothing); the flush thread holds the lock only for one
        ``writev``, so it is waited for."""
        if self._flushing == threading.get_ident():
            return  # only by a handler other than _on_sigterm, which defers to the flush
        if not self._flush_lock.acquire(timeout=5.0):
            return
        self._flush_lock.release()
        if how is None:
            self.flush(tidy=False)
        else:
            self.end(how, tidy=False)

    def close(self) -> None:
        self.end("disable")
        with self._flush_lock:  # the background thread may be flushing: it finds fd -1
            self.writer.close()

    def after_fork_in_child(self) -> None:
        # The parent flushes what was buffered before the fork; the child starts afresh and
        # names what it inherited under its own pid.
        self.pid = os.getpid()
        _io_tracer.reset_buffers()
        _io_tracer.queue_all_names()
        self._written = set()
        self._flush_lock = threading.Lock()
        self._flushing = 0
        self._deferred_sigterm = False
        self._start()


def _marker(pid: int, state: str, how: str = "") -> str:
    args = {"state": state, "how": how} if how else {"state": state}
    return dumps({"name": "recorder", "ph": "M", "pid": pid, "tid": pid, "args": args})


_flusher: threading.Thread | None = None
_mounts: MountTable | None = None


def _mount_table() -> MountTable:
    """One mount table per process (it re-reads mountinfo for a device it does not know)."""
    global _mounts
    if _mounts is None:
        _mounts = MountTable()
    return _mounts


def _start_flusher() -> None:
    """One daemon thread per process writes the active recorder's events every interval; it
    outlives enable/disable, which then cost no thread start or join."""
    global _flusher
    if _flusher is None or not _flusher.is_alive():
        _flusher = threading.Thread(target=_flush_loop, name="lcache-trace-flush", daemon=True)
        _flusher.start()


def flush_interval() -> float:
    """Seconds between background flushes: ``$LCACHE_TRACE_FLUSH_S``, else
    ``FLUSH_INTERVAL_S``.

    Raises:
        ConfigError: it is not a number of seconds from 0.001 to 1,000,000.
    """
    return env_seconds(ENV_FLUSH, FLUSH_INTERVAL_S, 0.001, 1_000_000)


_interval = FLUSH_INTERVAL_S  # set by enable(), checked there: the thread never parses it


def _flush_loop() -> None:
    background_thread()
    while True:
        time.sleep(_interval)
        rec = _active
        if rec is None or rec.pid != os.getpid():
            continue
        try:
            rec.flush()
        except OSError as exc:  # a full disk must not kill the job being traced
            sys.stderr.write(f"lcache trace: cannot write {rec.path}: {exc}\n")


def _process_name() -> str:
    name = " ".join(sys.argv) if sys.argv and sys.argv[0] else sys.executable
    return name[:300]


_checked: set[str] = set(CLASSES) | {"read", "write", "fsync", "fdatasync", "open", "unlink"}


_MAX_BYTES = blocks_mod.MAX_BYTES
_MAX_END_NS = (blocks_mod.MAX_US + 1) * 1000  # an end at or past it is past MAX_US


def _check_name(kind: str, value: str) -> None:
    if value in _checked:
        return
    # Names become legend labels and summary keys: short and plain, like the documented ones.
    if not value or len(value) > 64 or not all(c.isalnum() or c in "-_." for c in value):
        raise ConfigError(f"trace {kind} {value!r} must be 1-64 letters, digits, '-', '_' or "
                         "'.'; use one of the documented classes (docs/trace.md)")
    _checked.add(value)


def enable(path: str, *, compress: bool | None = None) -> None:
    """Start recording this process's lcache I/O events to ``path``.

    Every ``lcache.io`` operation is recorded with its ``io_class``. Forked children
    (DataLoader workers) append their own events to the same file; ``LCACHE_TRACE`` is set so
    that spawned Python children that import lcache do too. Enabling the same path twice is a
    no-op; enabling another path switches to it.

    Args:
        path: the trace file (created in an existing directory, or appended to when it is an
            lcache trace or empty).
            Ending in ``.gz`` compresses it.
        compress: force gzip on or off, whatever the suffix.

    Raises:
        ConfigError: ``$LCACHE_TRACE_FLUSH_S`` is not seconds from 0.001 to 1,000,000, or
            ``path`` is not a path, holds a file that is not an lcache trace (it is left as
            it is), is a directory, or its directory does not exist (none is made).
    """
    global _active, _interval
    path = path_argument(path, "path")  # enable(None) was a TypeError from os.path
    if compress is not None:
        flag(compress, "compress")
    with _lock:
        interval = flush_interval()  # before anything changes: a bad value leaves tracing as is
        if _active is not None:
            if _active.path == os.path.abspath(path) and os.getpid() == _active.pid:
                return
            _disable_locked()
        rec = Recorder(path, compress)
        _interval = interval
        _start_flusher()
        _active = rec
        _io_tracer.reset_buffers()  # events left by a recorder closed mid-operation
        _io_tracer.set_tracer(rec, binary=True)
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


MAX_FILE_NAME = 16384  # characters: a URL with a long query string fits


def record(op: str, file: str, offset: int, size: int, io_class: str, start_ns: int,
           duration_ns: int, result: int) -> None:
    """Record one I/O operation that did not go through ``lcache.io``; no-op when off.

    Args:
        op: ``"read"`` or ``"write"`` (bytes moved) or another verb (``"fsync"``, ``"open"``).
        file: path or URL of what was read or written (1 to 16,384 characters).
        offset: byte offset in the file.
        size: bytes requested.
        io_class: one of ``lcache.trace.CLASSES``.
        start_ns: ``time.perf_counter_ns()`` when the operation started.
        duration_ns: how long it took, in nanoseconds.
        result: bytes transferred, or ``-errno`` on failure.

    Raises:
        ConfigError: a name that is not 1-64 letters, digits, '-', '_' or '.', or a value a
            report could not read (a size, offset from -1 or result past 2**62, a time below
            0 or ending past 2**53 us, something not a whole number); nothing is recorded.
    """
    rec = _active
    if rec is None:
        return
    _check_name("op", op)
    _check_name("class", io_class)
    if isinstance(file, os.PathLike):
        file = os.fspath(file)
    if not isinstance(file, str) or not 0 < len(file) <= MAX_FILE_NAME or "\0" in file:
        # a report reads names back one line each, and refused the whole trace for a name
        # of 2 MiB; None was kept as the file "None"
        raise ConfigError(f"trace record: file {file!r:.80} must be a path or URL of 1 to "
                          f"{MAX_FILE_NAME:,} characters, without NUL")
    try:
        offset, size, result = int(offset), int(size), int(result)
        start_ns, duration_ns = int(start_ns), int(duration_ns)
    except (TypeError, ValueError, OverflowError):  # NaN, infinity, None, "x"
        raise ConfigError(f"trace record of {file!r:.80}: offset {offset!r:.40}, size "
                          f"{size!r:.40}, result {result!r:.40}, start_ns {start_ns!r:.40} and "
                          f"duration_ns {duration_ns!r:.40} must be whole numbers") from None
    # The bounds a report reads back (lcache.report.load): one event past them made it refuse
    # the whole trace, so it is refused here, before anything is kept. One test, a local bound:
    # this is the hot path of hand-recorded I/O.
    m = _MAX_BYTES
    if not (0 <= size < m and -1 <= offset < m and -m < result < m and start_ns >= 0
            and duration_ns >= 0 and start_ns + duration_ns < _MAX_END_NS):
        if start_ns < 0 or duration_ns < 0 or start_ns + duration_ns >= _MAX_END_NS:
            raise ConfigError(f"trace record of {file!r:.80}: start_ns ({start_ns}) and "
                              f"duration_ns ({duration_ns}) must be >= 0 and end before 2**53 "
                              "us; take them from lcache.trace.now_ns()")
        raise ConfigError(f"trace record of {file!r:.80}: size {size}, offset {offset} and "
                          f"result {result} must be byte counts below 2**62 (offset -1: none; "
                          "result: -errno on failure)")
    rec.record(op, file, offset, size, io_class, start_ns, duration_ns, result)


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
    # Finalize hooks but not atexit; a forked child's bootstrap clears the finalizers inherited
    # from the parent and then runs its after-fork hooks, so register the flush from there.
    import multiprocessing.process as mp_process
    import multiprocessing.util as mp_util

    mp_util.register_after_fork(_FORK_HOOK, _register_multiprocessing_finalizer)
    _mark_exit()
    # A spawn or forkserver child imports lcache while it unpickles its main module or task,
    # and its bootstrap runs no after-fork hook (SpawnProcess._after_fork does nothing); a
    # child that imports lcache after its bootstrap has run them already. Either way, now.
    if (mp_process.parent_process() is not None
            or getattr(mp_process.current_process(), "_inheriting", False)):
        _register_multiprocessing_finalizer(None)


# The pid of a process of this fork tree whose exit has begun, written before
# multiprocessing's exit SIGTERMs its daemonic children: a DataLoader worker whose parent it
# is ends quietly on that SIGTERM, as torch's own handler does for its parent's.
_EXITING = mmap.mmap(-1, 8)  # anonymous and shared: forked children see the parent's writes
_EXITING_MADE_BY = os.getpid()
_exit_marker: object = None  # this process's Finalize that writes _EXITING


def _mark_exit() -> None:
    """Have this process write its pid to ``_EXITING`` when its exit begins: in
    multiprocessing's exit function (the main process's atexit, a child's bootstrap), a
    finalizer of priority >= 0 runs before the daemonic children are terminated. An atexit
    hook did not do: a child runs none, and the main process's ran after that function when
    lcache was imported before multiprocessing."""
    global _exit_marker
    import multiprocessing.util as mp_util

    if not (isinstance(_exit_marker, mp_util.Finalize) and _exit_marker.still_active()):
        _exit_marker = mp_util.Finalize(None, _write_exiting, exitpriority=100)


def _write_exiting() -> None:
    _EXITING[:8] = os.getpid().to_bytes(8, "little")


def _at_exit() -> None:
    rec = _active
    if rec is not None and rec.pid == os.getpid():
        with contextlib.suppress(OSError):
            rec.end("exit")


#: SIGTERM's handler before ours: SIG_DFL, or the program's handler, which ours calls.
_prior_sigterm: object = signal.SIG_DFL


def _install_sigterm_handler() -> None:
    """Flush on SIGTERM, in ``multiprocessing`` children only. ``Pool.terminate()`` (leaving
    a ``with Pool(...)`` block) ends its workers with it, and its default action runs no exit
    hook: each worker's buffered events were lost. Not in other processes: a Python handler
    runs only between bytecodes of the main thread, so a job a scheduler ends while it waits
    in a C call (a collective, ``os.system``) would not die until that call returned; there a
    start marker without an end says the last events may be missing. A handler the program
    installs later replaces ours, and its exit path (``sys.exit``: ``atexit``) flushes."""
    global _prior_sigterm
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may install handlers; spawned children still do
    prior = signal.getsignal(signal.SIGTERM)
    if prior is _on_sigterm or prior is signal.SIG_IGN or prior is None:
        return  # ignored: the process does not die of it; None: a handler set in C, kept
    _prior_sigterm = prior
    signal.signal(signal.SIGTERM, _on_sigterm)


def flush_on_sigterm_in_dataloader_worker() -> None:
    """In a torch DataLoader worker, flush on SIGTERM. The worker loop installs a handler of
    its own in C (``signal.getsignal`` still names ours) that ends the worker with
    ``_exit(0)`` when its parent sends SIGTERM, as multiprocessing's exit does to the
    persistent workers of a loader still alive when the program ends: their events were
    lost. Ours flushes, writes the end marker, then exits as torch's does (a death by the
    signal would make the parent's loader raise at exit). Called by lcache's dataset in the
    worker's main thread; nothing when not tracing."""
    global _prior_sigterm
    rec = _active
    if rec is None or rec.pid != os.getpid() or "torch" not in sys.modules or \
            threading.current_thread() is not threading.main_thread():
        return
    from torch.utils.data import get_worker_info

    if get_worker_info() is None or _prior_sigterm is _exit_as_torch_worker or \
            signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        return  # not a worker, done, or a handler of the program's (worker_init_fn): kept
    _prior_sigterm = _exit_as_torch_worker
    signal.signal(signal.SIGTERM, _on_sigterm)


def _exit_as_torch_worker(signum: int, frame: object) -> None:
    """What torch's worker handler does: exit 0 when the parent sent SIGTERM (here: the
    parent is exiting; a worker not forked from it cannot tell, and exits 0 as well), else
    die of it, so the loader says the worker was killed."""
    exiting = int.from_bytes(_EXITING[:8], "little")
    if exiting == os.getppid() or os.getpid() == _EXITING_MADE_BY:
        os._exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


_in_sigterm = False  # a second SIGTERM during our flush: the first one goes on and ends it


def _on_sigterm(signum: int, frame: object) -> None:
    # Python runs this in the main thread between two bytecodes, not in the C signal
    # handler, so writing is allowed; the recorder does not wait on a lock this thread holds.
    global _in_sigterm
    if _in_sigterm:
        return
    rec = _active
    if rec is not None and rec.pid == os.getpid() and \
            rec._flushing == threading.get_ident():
        # this thread was inside flush, holding its lock: waiting would deadlock, and dying
        # now lost the events being written (a Pool worker ended while its exit flush ran);
        # the flush sends SIGTERM again when it is done
        rec._deferred_sigterm = True
        return
    _in_sigterm = True
    prior = _prior_sigterm
    try:
        if rec is not None and rec.pid == os.getpid():
            with contextlib.suppress(Exception):  # whatever happens, the process must end
                # the program's handler may carry on: no end marker then
                ends = not callable(prior) or prior is _exit_as_torch_worker
                rec.flush_from_signal_handler("sigterm" if ends else None)
    finally:
        _in_sigterm = False
    if callable(prior):
        prior(signum, frame)
        return
    # The default action, as if we had not been here: the exit status says SIGTERM.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _after_fork_in_child() -> None:
    global _flusher
    _flusher = None  # threads do not survive fork()
    rec = _active
    if rec is not None:
        rec.after_fork_in_child()
        _start_flusher()


class _ForkHook:
    """A weak-referenceable key for ``multiprocessing.util.register_after_fork``."""


_FORK_HOOK = _ForkHook()


_finalizer: object = None  # our multiprocessing.util.Finalize, once registered


def _register_multiprocessing_finalizer(_: object) -> None:
    global _finalizer
    import multiprocessing.util as mp_util

    # Once: registered at import and again by a bootstrap that runs the after-fork hooks
    # (Python 3.10 also does in spawn children), the flush must not run twice.
    if not (isinstance(_finalizer, mp_util.Finalize) and _finalizer.still_active()):
        _finalizer = mp_util.Finalize(None, _at_exit, exitpriority=-100)
    _mark_exit()
    _install_sigterm_handler()


def enable_from_environment() -> None:
    """Honour ``LCACHE_TRACE=path`` (called when lcache is imported)."""
    path = os.environ.get(ENV)
    if path and _active is None:
        global env_error
        try:
            enable(path)
        except ConfigError as exc:  # the CLI exits with status 2 on it (lcache.cli.main)
            env_error = exc
        except OSError as exc:  # a file it may not open: refused alike, in words, not a repr
            reason = exc.strerror or str(exc)
            env_error = ConfigError(reason[:1].lower() + reason[1:])
        if env_error is not None:  # a program importing lcache goes on, untraced
            sys.stderr.write(f"lcache: cannot trace to LCACHE_TRACE={path}: {env_error}\n")
