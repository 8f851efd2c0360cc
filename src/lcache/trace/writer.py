"""Appending whole lines to a trace file shared by several processes.

Every process (the one that enabled tracing, its forked DataLoader workers, spawned children
that inherit ``LCACHE_TRACE``, and the ``lcache trace`` sampler) opens the same file with
``O_APPEND`` and writes each flush as one ``writev()`` of whole lines and blocks, so lines of
different processes never interleave inside a line (local filesystems serialize appends per
inode, for a ``writev`` as for a ``write``). A compressed trace is a sequence of gzip members,
one per flush, which ``gzip`` reads as one stream.
"""

from __future__ import annotations

import gzip
import json
import os
import stat
import time
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from lcache.errors import ConfigError
from lcache.io import close_file
from lcache.io.engine import IOV_MAX
from lcache.io.publish import names_directory

_WALL_MINUS_MONO_US: float | None = None


def wall_minus_mono_us() -> float:
    """Microseconds to add to a monotonic timestamp to get Unix time (measured once)."""
    global _WALL_MINUS_MONO_US
    if _WALL_MINUS_MONO_US is None:
        _WALL_MINUS_MONO_US = time.time_ns() / 1000 - time.perf_counter_ns() / 1000
    return _WALL_MINUS_MONO_US


def is_compressed_path(path: str) -> bool:
    return path.endswith(".gz")


def dumps(event: Any) -> str:
    return json.dumps(event, separators=(",", ":"), ensure_ascii=True)


#: How much of an existing file is read to tell whether it is a trace: more than any first
#: line (a ``process_name`` line, its name cut to 4,096 characters and escaped).
_HEAD_BYTES = 64 * 1024


def is_trace(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes) starts an lcache trace: the ``process_name``
    line :func:`process_metadata` writes (``"lcache_trace": 1`` in its args), plain or as the
    start of a gzip member."""
    if head[:2] == b"\x1f\x8b":
        try:
            head = zlib.decompressobj(wbits=31).decompress(head, _HEAD_BYTES)
        except zlib.error:
            return False
    line, newline, _ = head.partition(b"\n")
    try:
        first = json.loads(line) if newline else None
    except ValueError:
        return False
    return (isinstance(first, dict) and first.get("name") == "process_name"
            and isinstance(first.get("args"), dict) and first["args"].get("lcache_trace") == 1)


def check_trace_file(fd: int, path: str, verb: str) -> int:
    """The size of the file open at ``fd``, or a ConfigError when it is not a regular file
    (a FIFO would hang the job once its buffer is full; a device or socket is no trace), or
    is a regular file that is neither empty nor an lcache trace. Every trace starts with the
    ``process_name`` line :func:`process_metadata` writes (``"lcache_trace": 1`` in its
    args), plain or as the start of a gzip member: a trace is only ever appended to or
    replaced, never another file (a script named at ``-o`` or ``LCACHE_TRACE`` by mistake).
    ``verb`` says which, in the message."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket"
                if stat.S_ISSOCK(st.st_mode) else "a device or other special file")
        raise ConfigError(f"{path} is {kind}, not a regular file, and tracing only {verb} "
                          "a trace file; choose a file path")
    if st.st_size == 0:
        return 0
    if not is_trace(os.pread(fd, _HEAD_BYTES, 0)):
        raise ConfigError(f"{path} is not an lcache trace (it does not start with lcache's "
                          f"process_name line), and tracing only {verb} a trace; move it "
                          "away or choose another path")
    return st.st_size


class TraceWriter:
    """An ``O_APPEND`` file descriptor on the trace; ``write_lines`` is one ``writev()``."""

    def __init__(self, path: str, compress: bool | None = None, *, fresh: bool = False) -> None:
        """Open ``path`` to append to, created if missing; ``fresh`` starts a new file there
        instead (``lcache trace``: a trace of one run). Either way an existing regular file
        that is neither empty nor an lcache trace is refused (:func:`check_trace_file`).

        Raises:
            ConfigError: ``path`` holds a file that is not a trace, or is a directory, or its
                directory is missing (none is made).
            OSError: it cannot be opened (a symbolic link is never followed).
        """
        if names_directory(path):
            raise ConfigError(f"{path} names a directory (it ends in '/', '.' or '..'), and "
                              "tracing only writes a trace file; give a file path")
        self.path = os.path.abspath(path)
        self.compress = is_compressed_path(path) if compress is None else compress
        directory = os.path.dirname(self.path)
        # None is made, as `lcache trace -o` makes none: a mistyped LCACHE_TRACE made the
        # folders it named (as root, /nonexist/ at the top of the file system).
        if not os.path.isdir(directory):
            raise ConfigError(f"{path}: its directory {directory} does not exist, and tracing "
                              "makes none; create it or choose another path")
        if os.path.isdir(self.path):
            raise ConfigError(f"{path} is a directory, and tracing only writes a trace file; "
                              "choose a file path")
        # O_NOFOLLOW: a link planted at the trace's name (in /tmp, say) is refused, not appended
        # to. O_RDWR, not O_WRONLY: what is there is read first, on this very file.
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
        self.fd = os.open(self.path, flags, 0o600)
        try:
            size = check_trace_file(self.fd, self.path, "replaces" if fresh else "appends to")
            if fresh and size:  # a new file, not a truncated one: other links keep the old
                close_file(self.fd)
                self.fd = -1
                os.unlink(self.path)
                self.fd = os.open(self.path, flags | os.O_EXCL, 0o600)
            elif size:  # appended in the file's own format, whatever its name or `compress`:
                # a plain line after gzip members (or the reverse) made the whole file unreadable
                self.compress = os.pread(self.fd, 2, 0) == b"\x1f\x8b"
        except BaseException:
            self.close()
            raise

    def write_lines(self, lines: Iterable[str],
                    blocks: Sequence[bytes | memoryview] = ()) -> None:
        """Append ``lines`` and then the binary ``blocks`` (``lcache.trace.blocks``), given
        as their parts, in one ``writev()``: the parts are not copied into one buffer."""
        text = "".join(line + "\n" for line in lines).encode("ascii")
        parts = [text, *blocks] if text else list(blocks)
        if not parts:
            return
        if self.compress:
            parts = [gzip.compress(b"".join(parts), compresslevel=1)]
        elif len(parts) > IOV_MAX:
            parts = [b"".join(parts)]
        total = sum(len(p) for p in parts)
        n = os.writev(self.fd, parts)
        if n < total:  # a short write only happens on a full disk; finish it anyway
            view = memoryview(b"".join(parts))[n:]
            while view:
                view = view[os.write(self.fd, view):]

    def close(self) -> None:
        if self.fd >= 0:
            close_file(self.fd)
            self.fd = -1


def process_metadata(pid: int, name: str, ppid: int | None = None) -> list[str]:
    """The ``process_name`` line (with the clock offset that maps ``ts`` to Unix time).

    ``name`` is cut to 4,096 characters: a command line can be megabytes long, and a loader
    refuses lines longer than any event (``lcache.report.load.MAX_LINE``).
    """
    args: dict[str, Any] = {"name": name[:4096], "lcache_trace": 1,
                            "wall_minus_mono_us": round(wall_minus_mono_us(), 1)}
    if ppid is not None:
        args["ppid"] = ppid
    return [dumps({"name": "process_name", "ph": "M", "pid": pid, "tid": pid, "args": args})]


def file_metadata(pid: int, fid: int, path: str, where: dict[str, str] | None = None) -> str:
    """The ``file_name`` line; ``where`` adds the file's ``dev``, ``fs`` and ``mnt``."""
    return dumps({"name": "file_name", "ph": "M", "pid": pid, "tid": pid,
                  "args": {"fid": fid, "name": path, **(where or {})}})


def event_prefix(pid: int, tid: int, op: str, io_class: str) -> str:
    """The constant start of an I/O event line, up to the value of ``ts``."""
    return f'{{"name":"{op}","cat":"{io_class}","pid":{pid},"tid":{tid},"ts":'


#: The rest of an I/O event line: prefix, ts and dur as microseconds with three decimals
#: (integer part, then nanoseconds), fid, offset, size, result. Hand-formatted: json.dumps of
#: the nested dict costs several times more, and this runs for every event.
EVENT_REST = ('%s%d.%03d,"dur":%d.%03d,"ph":"X","args":{"fid":%d,"off":%d,"size":%d,'
              '"ret":%d}}')


def io_event(pid: int, tid: int, op: str, io_class: str, start_ns: int, duration_ns: int,
             fid: int, offset: int, size: int, result: int) -> str:
    """One I/O event line (``start_ns``/``duration_ns`` >= 0)."""
    return EVENT_REST % (event_prefix(pid, tid, op, io_class), start_ns // 1000,
                         start_ns % 1000, duration_ns // 1000, duration_ns % 1000, fid, offset,
                         size, result)


def read_cmdline(pid: int | str) -> str:
    """A process's command line from /proc (empty when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()
