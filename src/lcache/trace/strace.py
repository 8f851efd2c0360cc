"""Per-operation tracing of a process tree's file I/O through strace.

``lcache trace --syscalls`` runs the command under ``strace -f -y`` (``-y`` prints the path
behind each fd) and turns its log into trace events of class ``syscall``. Offsets: ``pread``,
``pwrite``, ``preadv``, ``pwritev`` carry theirs; for ``read``/``write``/``readv``/``writev`` the
parser follows the file position per (thread, fd) from ``openat`` (0), ``lseek`` results and the
bytes moved, and writes ``off: -1`` where it cannot know it (fds opened before tracing, fds
shared across processes after a fork). ``sendfile``, ``copy_file_range`` and ``splice`` move
bytes between two fds: each gives a read of its input and a write of its output, at the offsets
given or at the positions followed. ``mmap`` of a file gives an ``mmap`` event (``size``: the
length mapped, ``ret`` 0): the page faults that then read the file are not system calls, so
strace cannot see those bytes. Only regular files under ``/`` outside ``/dev``, ``/proc`` and
``/sys`` are kept; pipes, sockets and terminals are not storage. Names are the real paths (strace
escapes their bytes); a file written after it was unlinked (``tempfile.TemporaryFile``) is
named as ``/proc/<pid>/fd`` and lsof name it, ``<path> (deleted)``: its bytes still went to its
filesystem.

strace stops the tracee at every traced system call, so the run is slower: docs/trace.md states
by how much (benchmarks/trace_overhead.py measures it).
"""

from __future__ import annotations

import errno
import os
import re
import select
import time
from collections.abc import Iterable, Iterator
from typing import Any

from lcache.io import close_file
from lcache.trace.writer import dumps

SYSCALLS = ("read", "write", "pread64", "pwrite64", "readv", "writev", "preadv", "pwritev",
            "preadv2", "pwritev2", "lseek", "openat", "open", "creat", "fsync", "fdatasync",
            "close", "sendfile", "sendfile64", "copy_file_range", "splice", "mmap")
_READS = {"read", "pread64", "readv", "preadv", "preadv2"}
_WRITES = {"write", "pwrite64", "writev", "pwritev", "pwritev2"}
_POSITIONAL = {"pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2"}
# (input fd, its offset pointer, output fd, its offset pointer) argument indexes; -1: none
#: (count after them: argument 3 of sendfile, 4 of the others)
_COPIES = {"sendfile": (1, 2, 0, -1), "sendfile64": (1, 2, 0, -1),
           "copy_file_range": (0, 1, 2, 3), "splice": (0, 1, 2, 3)}
# memfd_create files live in memory; the kernel names them "/memfd:<name> (deleted)"
_SKIP_PREFIXES = ("/dev/", "/proc/", "/sys/", "/memfd:")

_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+(\w+)\((.*)$")
_RESUMED = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+<\.\.\. (\w+) resumed>(.*)$")
_RESULT = re.compile(r"\)\s+=\s+(-?\d+|\?)(?:<[^>]*>)?(?:\s+(E[A-Z0-9]+))?.*?(?:<(\d+\.\d+)>)?\s*$")
_FD = re.compile(r"^(-?\d+)<(\d+)>(?:,|$)")  # an fd and the index of its lifted path
# What is lifted out of a call's text before it is parsed, so that no character of a file name
# is taken for syntax: quoted strings (an open's path) and the path strace -y prints after an
# fd (or AT_FDCWD). strace escapes < and > inside that path (string_quote with "<>"), and
# prints "(deleted)" after it when the file behind the fd was unlinked.
_OPAQUE = re.compile(r'"(?:[^"\\]|\\.)*"|(?:(?<=\d)|(?<=AT_FDCWD))<([^<>]*)>(\(deleted\))?')
# strace's escapes in a path: octal (1-3 digits), \xHH (with -x), \n \t \r \f \v, \\ and \"
_ESCAPE = re.compile(rb"\\(?:([0-7]{1,3})|x([0-9a-fA-F]{2})|(.))", re.DOTALL)
_LETTERS = {b"n": b"\n", b"t": b"\t", b"r": b"\r", b"f": b"\f", b"v": b"\v"}
_INT = re.compile(r"-?\d+")


def strace_command(log_path: str, command: list[str], strace: str = "strace") -> list[str]:
    # -D: strace runs as a detached grandchild and the command keeps the pid `lcache trace`
    # started, so the /proc sampler's root is the command, not strace (strace's counters held
    # every byte of the command once it reaped it, and its name stood for the command's)
    return [strace, "-D", "-f", "-qq", "-ttt", "-T", "-y", "-s", "0", "-e",
            "trace=" + ",".join(SYSCALLS), "-o", log_path, "--", *command]


def wait_for_exec(pid: int, strace: str, timeout: float = 10.0) -> None:
    """Wait until ``pid`` (started as ``strace -D``) runs the command: strace execs it once
    its grandchild has attached, and the sampler names each process when it first sees it."""
    strace = os.path.realpath(strace)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{pid}/exe") != strace:
                return
        except OSError:  # exited (a zombie has no exe), or not ours
            return
        time.sleep(0.001)


def wait_for_tracer(log_path: str) -> None:
    """Wait until the strace writing ``log_path`` has exited (its log is then complete).

    With ``-D`` strace is not our child; it outlives the command while the command's children
    run, as it did as the parent. It is found by its command line (the log's unique name)."""
    needle = b"\0-o\0" + os.fsencode(log_path) + b"\0"
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if needle not in f.read():
                    continue
            pidfd = os.pidfd_open(int(name))
        except OSError:  # gone, or not ours to read
            continue
        try:
            select.select([pidfd], [], [])  # readable once the process has exited
        finally:
            close_file(pidfd)


def _storage_path(path: str) -> bool:
    # a file's path starts with "/"; pipes, sockets and anonymous inodes are "pipe:[123]",
    # "socket:[123]", "anon_inode:[eventfd]" (a file may well be named "x:[1].bin")
    return path.startswith("/") and not path.startswith(_SKIP_PREFIXES)


def _unescape(match: re.Match[bytes]) -> bytes:
    octal, hexa, char = match.groups()
    if octal or hexa:
        return bytes([int(octal, 8) if octal else int(hexa, 16)])
    return _LETTERS.get(char, char)


def _file_name(text: str, deleted: bool = False) -> str:
    """The path strace -y printed as ``text``, as lcache names files (``os.fsdecode``: bytes
    that are not UTF-8 come as lone surrogates); ``deleted``: it was printed with
    ``(deleted)`` after it, and the name gets the kernel's `` (deleted)``."""
    path = os.fsdecode(_ESCAPE.sub(_unescape, text.encode()))
    return path + " (deleted)" if deleted else path


def _lift(rest: str) -> tuple[str, list[str]]:
    """``rest`` with its quoted strings emptied and each fd's path replaced by its index in
    the list returned (as file names)."""
    paths: list[str] = []

    def lift(m: re.Match[str]) -> str:
        if m[0].startswith('"'):
            return '""'
        paths.append(_file_name(m[1], m[2] is not None))
        return f"<{len(paths) - 1}>"

    return _OPAQUE.sub(lift, rest), paths


def _split_args(args: str) -> list[str]:
    """Top-level arguments of a call, its paths lifted (commas inside ``[...]`` and ``{...}``
    are not separators)."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(args):
        if c in "[{":
            depth += 1
        elif c in "]}" and depth:
            depth -= 1
        elif c == "," and depth == 0:
            out.append(args[start:i].strip())
            start = i + 1
    out.append(args[start:].strip())
    return out


def _fd_arg(arg: str, paths: list[str]) -> tuple[int, str] | None:
    m = _FD.match(arg)
    return (int(m[1]), paths[int(m[2])]) if m else None


def _offset_arg(arg: str) -> int | None:
    """The offset an offset pointer held before the call (``[4096]``, ``[0] => [8192]``);
    ``None`` for ``NULL``: the call used and moved the file position."""
    m = re.match(r"\[(\d+)\]", arg)
    return int(m[1]) if m else None


def _last_ints(args: str, n: int) -> list[int]:
    # The trailing scalar arguments (count, offset) after the buffer or iovec argument.
    tail = args[args.rfind("]") + 1:] if "]" in args else args[args.find(",") + 1:]
    return [int(x) for x in _INT.findall(tail.replace('""...', "").replace('""', ""))][-n:]


def _joined(lines: Iterable[str]) -> Iterator[tuple[int, float, str, str]]:
    """(tid, wall time, syscall, text after the open paren), stitching unfinished calls."""
    pending: dict[int, tuple[float, str, str]] = {}
    for raw in lines:
        line = raw.rstrip("\n")
        if line.endswith("<unfinished ...>"):
            m = _LINE.match(line)
            if m:
                pending[int(m[1])] = (float(m[2]), m[3], m[4][: -len("<unfinished ...>")])
            continue
        m = _RESUMED.match(line)
        if m:
            tid = int(m[1])
            start = pending.pop(tid, None)
            if start is not None and start[1] == m[3]:
                yield tid, start[0], start[1], start[2] + m[4]
            continue
        m = _LINE.match(line)
        if m:
            yield int(m[1]), float(m[2]), m[3], m[4]


def parse(lines: Iterable[str], wall_minus_mono_us: float) -> Iterator[dict[str, Any]]:
    """Trace events (``cat: syscall``) from strace's log lines."""
    position: dict[tuple[int, int], int] = {}
    # (fd, path) -> the thread that last moved that file's position: a description shared
    # with another thread or a forked child moves under us, so our position is then unknown
    mover: dict[tuple[int, str], int] = {}

    def at_position(tid: int, fd: int, path: str, moved: int) -> int:
        """The offset of a call at (tid, fd)'s file position, which it moves by ``moved``."""
        key = (tid, fd)
        last = mover.get((fd, path), tid)
        if last != tid:  # moved by another thread or process since: ours is stale
            position.pop(key, None)
            position.pop((last, fd), None)
        mover[(fd, path)] = tid
        offset = position.get(key, -1)
        if offset >= 0:
            position[key] = offset + moved
        return offset

    for tid, wall, name, text in _joined(lines):
        rest, paths = _lift(text)
        res = _RESULT.search(rest)
        if res is None or res[1] == "?":
            continue
        args = rest[: res.start()]
        ret = int(res[1])
        if ret < 0 and res[2]:
            ret = -getattr(errno, res[2], 1)
        dur_s = float(res[3]) if res[3] else 0.0
        if name in ("openat", "open", "creat"):
            # a new open file description starts at 0; with O_APPEND every write goes to
            # the end, wherever that is: unknown
            if ret >= 0 and "O_APPEND" not in args:
                position[(tid, ret)] = 0
            continue
        # the fields of every event of this call; each event adds name and args
        common = {"cat": "syscall", "pid": tid, "tid": tid,
                  "ts": round(wall * 1e6 - wall_minus_mono_us, 3),
                  "dur": round(dur_s * 1e6, 3), "ph": "X"}

        def event(op: str, path: str, offset: int, size: int, result: int,
                  common: dict[str, Any] = common, name: str = name) -> dict[str, Any]:
            return {"name": op, **common, "args": {"file": path, "off": offset, "size": size,
                                                   "ret": result, "sys": name}}

        if name in _COPIES or name == "mmap":
            parts = _split_args(args)
            if name == "mmap":  # mmap(addr, length, prot, flags, fd, offset)
                fd_arg = _fd_arg(parts[4], paths) if len(parts) == 6 else None
                if fd_arg is not None and _storage_path(fd_arg[1]):
                    try:
                        offset = int(parts[5], 0)  # "0" or "0x1f000"
                    except ValueError:
                        offset = -1
                    yield event("mmap", fd_arg[1], offset, int(parts[1]), min(ret, 0))
                continue
            i_in, i_off_in, i_out, i_off_out = _COPIES[name]
            i_count = 3 if name.startswith("sendfile") else 4
            count_m = _INT.match(parts[i_count]) if i_count < len(parts) else None
            moved = max(ret, 0)
            count = int(count_m[0]) if count_m else moved
            if not 0 <= count < 1 << 62:  # cp asks copy_file_range for "all" (SSIZE_MAX)
                count = moved
            for op, i, i_off in (("read", i_in, i_off_in), ("write", i_out, i_off_out)):
                fd_arg = _fd_arg(parts[i], paths) if i < len(parts) else None
                if fd_arg is None:
                    continue
                off = _offset_arg(parts[i_off]) if i_off >= 0 else None
                if off is None:  # NULL (or no pointer): at the file position, which moves
                    off = at_position(tid, fd_arg[0], fd_arg[1], moved)
                if _storage_path(fd_arg[1]):
                    yield event(op, fd_arg[1], off, count, ret)
            continue
        fd_arg = _fd_arg(args, paths)
        if fd_arg is None:
            continue
        fd, path = fd_arg
        key = (tid, fd)
        if name == "close":
            position.pop(key, None)
            mover.pop((fd, path), None)
            continue
        if name == "lseek":
            if ret >= 0:
                position[key] = ret
                mover[(fd, path)] = tid
            continue
        if not _storage_path(path):
            continue
        moved = max(ret, 0)
        if name in _READS or name in _WRITES:
            op = "read" if name in _READS else "write"
            if name in _POSITIONAL:
                # preadv2/pwritev2 end with a flags argument after the offset
                ints = _last_ints(args, 3 if name.endswith("2") else 2)
                if name.endswith("2"):
                    ints = ints[:-1]
                offset = ints[-1] if ints else -1
                size = ints[0] if name in ("pread64", "pwrite64") and len(ints) == 2 else moved
                if offset == -1 and name.endswith("2"):  # -1: at (and moving) the position
                    offset = position.get(key, -1)
                    if offset >= 0:
                        position[key] = offset + moved
            else:
                offset = at_position(tid, fd, path, moved)
                ints = _last_ints(args, 1)
                size = ints[0] if name in ("read", "write") and ints else moved
        else:  # fsync, fdatasync
            op, offset, size = name, 0, 0
        yield event(op, path, offset, size, ret)


def convert(log_path: str, wall_minus_mono_us: float, chunk: int = 20000) -> Iterator[list[str]]:
    """The strace log as trace lines, in chunks (one ``write()`` each)."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        out: list[str] = []
        for ev in parse(f, wall_minus_mono_us):
            out.append(dumps(ev))
            if len(out) >= chunk:
                yield out
                out = []
        if out:
            yield out
