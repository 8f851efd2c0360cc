"""Per-operation tracing of a process tree's file I/O through strace.

``lcache trace --syscalls`` runs the command under ``strace -f -y`` (``-y`` prints the path
behind each fd) and turns its log into trace events of class ``syscall``. Offsets: ``pread``,
``pwrite``, ``preadv``, ``pwritev`` carry theirs; for ``read``/``write``/``readv``/``writev`` the
parser follows the file position per (thread, fd) from ``openat`` (0), ``lseek`` results and the
bytes moved, and writes ``off: -1`` where it cannot know it (fds opened before tracing, fds
shared across processes after a fork). Only regular files under ``/`` outside ``/dev``,
``/proc`` and ``/sys`` are kept; pipes, sockets and terminals are not storage.

strace stops the tracee at every traced system call, so the run is slower: docs/trace.md states
by how much (benchmarks/trace_overhead.py measures it).
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterable, Iterator
from typing import Any

from lcache.trace.writer import dumps

SYSCALLS = ("read", "write", "pread64", "pwrite64", "readv", "writev", "preadv", "pwritev",
            "preadv2", "pwritev2", "lseek", "openat", "open", "creat", "fsync", "fdatasync",
            "close")
_READS = {"read", "pread64", "readv", "preadv", "preadv2"}
_WRITES = {"write", "pwrite64", "writev", "pwritev", "pwritev2"}
_POSITIONAL = {"pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2"}
_SKIP_PREFIXES = ("/dev/", "/proc/", "/sys/")

_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+(\w+)\((.*)$")
_RESUMED = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+<\.\.\. (\w+) resumed>(.*)$")
_RESULT = re.compile(r"\)\s+=\s+(-?\d+|\?)(?:<[^>]*>)?(?:\s+(E[A-Z0-9]+))?.*?(?:<(\d+\.\d+)>)?\s*$")
_FD = re.compile(r"^(-?\d+)<(.*?)>(?:,|$)")
_INT = re.compile(r"-?\d+")


def strace_command(log_path: str, command: list[str], strace: str = "strace") -> list[str]:
    return [strace, "-f", "-qq", "-ttt", "-T", "-y", "-s", "0", "-e",
            "trace=" + ",".join(SYSCALLS), "-o", log_path, "--", *command]


def _storage_path(path: str) -> bool:
    return path.startswith("/") and not path.startswith(_SKIP_PREFIXES) and ":[" not in path


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
    for tid, wall, name, rest in _joined(lines):
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
        fd_m = _FD.match(args)
        if fd_m is None:
            continue
        fd, path = int(fd_m[1]), fd_m[2]
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
                last = mover.get((fd, path), tid)
                if last != tid:  # moved by another thread or process since: ours is stale
                    position.pop(key, None)
                    position.pop((last, fd), None)
                mover[(fd, path)] = tid
                offset = position.get(key, -1)
                ints = _last_ints(args, 1)
                size = ints[0] if name in ("read", "write") and ints else moved
                if offset >= 0:
                    position[key] = offset + moved
        else:  # fsync, fdatasync
            op, offset, size = name, 0, 0
        ts_us = wall * 1e6 - wall_minus_mono_us
        yield {"name": op, "cat": "syscall", "pid": tid, "tid": tid, "ts": round(ts_us, 3),
               "dur": round(dur_s * 1e6, 3), "ph": "X",
               "args": {"file": path, "off": offset, "size": size, "ret": ret, "sys": name}}


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
