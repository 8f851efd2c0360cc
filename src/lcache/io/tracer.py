"""The tracer hook: every operation of the I/O engine can be observed.

The hook is a single module-level slot, ``None`` by default, so an untraced operation costs one
global load and one ``is None`` test. Any callable taking an :class:`IOEvent` can be installed;
``lcache.trace`` installs its recorder, which ``emit`` serves without an event object or a
system call: it packs seven integers into 56 bytes appended to this thread's list (no lock: one
C call under the GIL), and the recorder writes them out, joined, as binary blocks. A loop
too hot for even that appends to the list :func:`thread_records` gives it.

Files are named by id, not looked up per event: :func:`note_open` (called by
``lcache.io.files.open_file``) gives every opened fd a fresh file id and remembers its path, so
a reused fd number gets a new id. An fd lcache.io did not open falls back to a cache keyed by the
fd and checked against its inode (one ``fstat`` per event, as fd numbers are reused).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import struct
import sys
import threading
import time
from typing import NamedTuple, Protocol

from lcache.forksafe import fork_safe_lock


class IOEvent(NamedTuple):
    """One completed I/O operation, as handed to a tracer installed with :func:`set_tracer`.

    Attributes:
        op: ``"read"``, ``"write"``, ``"fsync"``, ``"fdatasync"``, ``"open"`` or ``"unlink"``.
        fd: file descriptor the operation used (-1 where none).
        offset: byte offset in the file (0 for operations without one).
        size: bytes requested.
        result: bytes transferred, or ``-errno`` on failure.
        start_ns: ``time.perf_counter_ns()`` when the call started.
        duration_ns: how long the call took.
        io_class: what the bytes were for (``cache-read``, ``cache-write``, ``cache-gc``...).
    """

    op: str
    fd: int
    offset: int
    size: int
    result: int
    start_ns: int
    duration_ns: int
    io_class: str


class Tracer(Protocol):
    def __call__(self, event: IOEvent) -> None: ...


#: A binary record, little-endian int64s: code (op id | class id << 16), file id, offset,
#: size, result, start and end (``perf_counter_ns``). Packed in the hot path and appended to a
#: list: fewer instructions than ``bytearray.extend`` (~430 a record, callgrind),
#: ``array.extend`` or a tuple converted later.
RECORD = struct.Struct("<7q")
RECORD_FIELDS = 7
#: The same 56 bytes, packed as native ssize_t where that is a little-endian int64 (64-bit
#: little-endian machines): "q" converts each int past 2**30 (times, large offsets) through
#: _PyLong_AsByteArray, "n" does not, ~40 ns less a record on CPython 3.11.
_struct = (struct.Struct("@7n") if sys.byteorder == "little" and struct.calcsize("@n") == 8
           else RECORD)
#: ``pack_record(code, fid, offset, size, result, start_ns, end_ns)``: one record
pack_record, _unpack = _struct.pack, _struct.unpack
_INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_NAMES = 0xFFFF  # op or class names per process: ids are 16 bits of the code

_tracer: Tracer | None = None
_binary: Tracer | None = None  # the recorder whose events go to the per-thread lists

#: ``events``, this thread's list of records; set only while the recorder is installed (with
#: another tracer ``emit`` finds none and calls it)
_local = threading.local()
#: (native thread id, records, thread) of every thread that recorded since the last reset
buffers: list[tuple[int, list[bytes], threading.Thread]] = []
_buffers_lock = fork_safe_lock()

_ops: dict[str, int] = {"other": 1}  # op name -> id (1..65535)
_classes: dict[str, int] = {"other": 1}  # class name -> id (1..65535)
_codes: dict[str, dict[str, int]] = {}  # class name -> op name -> code (one lookup each)
_file_ids = itertools.count(1)
_fids: dict[int, int] = {}  # fd -> file id, for fds opened through lcache.io
_names: dict[int, tuple[str, int]] = {}  # file id -> (path, st_dev or 0) of the open fds
_unknown: dict[int, tuple[int, int, int]] = {}  # fd not opened by lcache.io -> (dev, ino, fid)
#: Names of file ids whose fd was closed or reused while tracing, kept for the recorder's next
#: two flushes (its events may still be buffered), then dropped: memory stays bounded.
_retired: dict[int, tuple[str, int]] = {}
_retired_before: dict[int, tuple[str, int]] = {}
#: Op and class names the recorder has yet to write: ("op"|"cat", id, name)
pending: list[tuple[str, int, str]] = []


def set_tracer(tracer: Tracer | None, binary: bool = False) -> Tracer | None:
    """Install ``tracer`` (or remove it with ``None``); returns the previous one.

    With ``binary`` (the ``lcache.trace`` recorder), ``emit`` appends binary records to the
    per-thread lists in :data:`buffers` instead of calling ``tracer``, and every op and class
    name in use is queued in :data:`pending` for the recorder to write.
    """
    global _tracer, _binary, _local
    previous = _tracer
    _binary = tracer if binary else None
    _tracer = tracer
    if not binary:  # threads' lists stay with the recorder; emit finds none and calls tracer
        _local = threading.local()
    if binary:
        queue_all_names()
    return previous


def get_tracer() -> Tracer | None:
    """The installed tracer, or ``None`` when tracing is off."""
    return _tracer


def emit(op: str, fd: int, offset: int, size: int, result: int, t0: int, io_class: str) -> None:
    """Hand one finished operation, started at ``t0`` (``perf_counter_ns``), to the tracer."""
    if _tracer is not None:
        end = time.perf_counter_ns()
        try:  # the hot path: one 56-byte record, no event object, no system call
            _local.events.append(pack_record(_codes[io_class][op], _fids[fd], offset, size,
                                             result, t0, end))
            return
        except (AttributeError, KeyError, struct.error):  # another tracer; a new thread, name
            pass  # or fd. Outside the handler: a tracer's own error is not chained to these
        _slow(op, fd, offset, size, result, t0, end, io_class)


def thread_records() -> list[bytes] | _Forward | None:
    """Where a hot loop appends its records itself, as
    ``pack_record(code(op, io_class), fid_for(fd), offset, size, result, start_ns, end_ns)``
    with the code and file id looked up once, not per event: this thread's list while
    ``lcache.trace``'s recorder is installed, an object whose ``append`` hands each record to
    another installed tracer as an :class:`IOEvent`, or ``None`` when tracing is off.

    ``emit`` costs ~3,000 instructions an event (callgrind), of which the Python call and the
    name and fd lookups are ~1,200 and the thread's list ~500 (here once per call): a store
    read of 4 KiB from the page cache is ~80,000 instructions, and tracing it must cost under
    3%."""
    if _tracer is None:
        return None
    try:
        return _local.events  # type: ignore[no-any-return]
    except AttributeError:
        pass
    if _tracer is _binary:
        return _new_thread_list()
    return _Forward(_tracer)


class _Forward:
    """``thread_records()`` under a tracer other than the recorder: records become events."""

    __slots__ = ("tracer",)

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def append(self, packed: bytes) -> None:
        code_, fid, offset, size, result, start, end = _unpack(packed)
        op = next((n for n, i in _ops.items() if i == code_ & 0xFFFF), "other")
        io_class = next((n for n, i in _classes.items() if i == code_ >> 16), "other")
        fd = next((fd for fd, f in _fids.items() if f == fid), -1)
        self.tracer(IOEvent(op, fd, offset, size, result, start, end - start, io_class))


def _slow(op: str, fd: int, offset: int, size: int, result: int, t0: int, end: int,
          io_class: str) -> None:
    tracer = _tracer
    if tracer is None:
        return
    if tracer is _binary:
        append(op, fid_for(fd), offset, size, result, t0, end, io_class)
    else:
        tracer(IOEvent(op, fd, offset, size, result, t0, end - t0, io_class))


def append(op: str, fid: int, offset: int, size: int, result: int, start_ns: int,
           end_ns: int, io_class: str) -> None:
    """Append one record to this thread's buffer (the slow path: a new thread, name or fd)."""
    try:
        events = _local.events
    except AttributeError:
        events = _new_thread_list()
    lo, hi = _INT64  # a value no system call returns must not fail the I/O it records
    events.append(pack_record(code(op, io_class), fid, *(min(max(v, lo), hi) for v in (
        offset, size, result, start_ns, end_ns))))


def _new_thread_list() -> list[bytes]:
    events = _local.events = []
    with _buffers_lock:
        buffers.append((threading.get_native_id(), events, threading.current_thread()))
    return events


def code(op: str, io_class: str) -> int:
    """The record code of an (op, class) pair; a new name is given an id and queued."""
    op_id = _ops.get(op) or _new_id(_ops, "op", op)
    class_id = (_classes.get(io_class) or _new_id(_classes, "cat", io_class)) << 16
    if op in _ops and io_class in _classes:  # not an overflow mapped to "other"
        _codes.setdefault(io_class, {})[op] = op_id | class_id
    return op_id | class_id


def _new_id(table: dict[str, int], kind: str, name: str) -> int:
    n = len(table) + 1
    if n > MAX_NAMES:  # a caller makes up names per call: the rest count as "other" (id 1)
        return 1
    table[name] = n
    if _binary is not None:
        pending.append((kind, n, name))
    return n


def note_open(fd: int, path: str) -> None:
    """Give ``fd``, just opened on ``path``, a new file id (``open_file`` calls this)."""
    fid = next(_file_ids)
    old = _fids.get(fd)
    if old is not None:
        _retire(old)
    if not path.startswith("/"):
        path = os.path.abspath(path)  # now: the working directory may change later
    dev = 0
    if _binary is not None:  # now: the file may be renamed before its name is written
        with contextlib.suppress(OSError):
            dev = os.fstat(fd).st_dev
    _names[fid] = (path, dev)
    _fids[fd] = fid


def note_close(fd: int) -> None:
    """Forget ``fd``'s file id (``lcache.io.files.close_file`` calls this before closing)."""
    fid = _fids.pop(fd, None)
    if fid is not None:
        _retire(fid)


def note_same_file(new_fd: int, fd: int) -> None:
    """``new_fd`` was just opened on the file behind ``fd`` (a second descriptor of it, such
    as a buffered twin of an O_DIRECT fd): it is named like ``fd``, without a system call."""
    name = _names.get(_fids.get(fd, 0))
    if name is None:  # fd is not lcache.io's: both are named through the fstat fallback
        note_close(new_fd)
    else:
        note_open(new_fd, name[0])


def _retire(fid: int) -> None:
    name = _names.pop(fid, None)
    if name is not None and _binary is not None:
        _retired[fid] = name


def file_name(fid: int) -> tuple[str, int] | None:
    """(path, st_dev or 0) of a file id of an open fd, or of one retired since the flush
    before last."""
    return _names.get(fid) or _retired.get(fid) or _retired_before.get(fid)


def next_flush() -> None:
    """Called by the recorder as a flush starts: names retired before the previous flush
    started can no longer be in a buffer."""
    global _retired, _retired_before
    _retired_before, _retired = _retired, {}


def fid_for(fd: int) -> int:
    """The file id of ``fd`` for the tracer."""
    return _fids.get(fd) or _fid_of(fd)


def _fid_of(fd: int) -> int:
    """The file id of an fd lcache.io did not open, checked against its inode (``fstat``):
    fd numbers are reused after close, and a remembered path may name another file."""
    try:
        st = os.fstat(fd)
    except OSError:  # closed already, or never valid: name it by number
        dev, ino = -1, fd
    else:
        dev, ino = st.st_dev, st.st_ino
    known = _unknown.get(fd)
    if known is not None and known[0] == dev and known[1] == ino:
        return known[2]
    fid = next(_file_ids)
    if known is not None:
        _retire(known[2])
    _unknown[fd] = (dev, ino, fid)
    path = f"fd:{fd}"
    if dev != -1:
        with contextlib.suppress(OSError):
            path = os.readlink(f"/proc/self/fd/{fd}")
    _names[fid] = (path, max(dev, 0))
    return fid


def new_file_id() -> int:
    """A file id for a file named by path (``lcache.trace.record``, which keeps the name)."""
    return next(_file_ids)


def queue_all_names() -> None:
    """Queue every op and class name (at ``enable`` and in a forked child, whose trace lines
    carry its own pid)."""
    pending.extend(("op", n, name) for name, n in _ops.items())
    pending.extend(("cat", n, name) for name, n in _classes.items())


def take_pending() -> list[tuple[str, int, str]]:
    """The queued names, removed from the queue (appends made meanwhile stay)."""
    n = len(pending)
    out = pending[:n]
    del pending[:n]
    return out


def reset_buffers() -> None:
    """Drop every thread's records (after ``fork()``: the parent writes what they held)."""
    global _local
    _local = threading.local()
    with _buffers_lock:
        buffers.clear()
    del pending[:]


def forget_dead_buffer(entry: tuple[int, list[bytes], threading.Thread]) -> None:
    """Stop tracking the empty list of a thread that has ended."""
    with _buffers_lock:
        if entry in buffers:
            buffers.remove(entry)
