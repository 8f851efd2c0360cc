"""Sampling /proc: the I/O counters of a process tree and of the block devices.

Every ``interval`` seconds the sampler finds the descendants of the root process (through
``/proc/<pid>/task/<tid>/children``, or a scan of ``/proc/*/stat`` where the kernel lacks it),
reads each one's ``/proc/<pid>/io`` and ``/proc/diskstats``, and writes what it read, as it
is, in binary blocks; the loader parses them into counters (cumulative values; the report
turns them into rates), and ``lcache report --jsonl`` into Chrome counter events. A process
that starts and ends between two samples is not seen; the last interval of one that exits is
lost (the kernel drops its counters when it is reaped).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from lcache.forksafe import background_thread
from lcache.io import close_file
from lcache.trace import blocks
from lcache.trace.schema import DISKS
from lcache.trace.writer import TraceWriter, dumps, process_metadata, read_cmdline

PROC_FIELDS = ("rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes")
DISK_FIELDS = ("reads", "read_sectors", "writes", "write_sectors", "io_ms")
_SKIP_DEVICES = ("loop", "ram", "zram", "sr", "fd")


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads' children)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def _scan_children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])  # the name may hold spaces
        tree.setdefault(ppid, []).append(int(name))
    return tree


def descendants(root: int, use_children_files: bool = True) -> list[int]:
    """``root`` and every process below it that is alive now."""
    tree = None if use_children_files else _scan_children()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children(pid) if tree is None else tree.get(pid, []))
    return out


def parse_proc_io(raw: bytes) -> list[int] | None:
    """The counters of one ``/proc/<pid>/io`` read, in ``PROC_FIELDS`` order (``None``: not
    all of them are there)."""
    values: dict[str, int] = {}
    for line in raw.split(b"\n"):
        key, _, value = line.partition(b":")
        name = key.decode("ascii", "replace")
        if name in PROC_FIELDS:
            values[name] = int(value)
    return [values[k] for k in PROC_FIELDS] if len(values) == len(PROC_FIELDS) else None


def parse_diskstats(raw: bytes, whole: set[str] | None) -> dict[str, list[int]]:
    """Counters (``DISK_FIELDS`` order) of the whole disks in a ``/proc/diskstats`` read:
    partitions would count the same bytes twice. ``whole``: the disks of ``/sys/block`` (all
    but loop, ram... devices where the trace does not name them)."""
    out: dict[str, list[int]] = {}
    for line in raw.split(b"\n"):
        parts = line.split()
        if len(parts) < 13:
            continue
        name = parts[2].decode("utf-8", "replace")
        if (whole and name not in whole) or name.startswith(_SKIP_DEVICES):
            continue
        out[name] = [int(parts[i]) for i in (3, 5, 7, 9, 12)]
    return out


class ProcSampler:
    """Samples the tree under ``root_pid`` into ``writer`` from a background thread.

    Each sample is one ``pread`` per process, of a ``/proc/<pid>/io`` kept open, and one of
    ``/proc/diskstats``, written as they are in two binary blocks (``lcache.trace.blocks``);
    the loader parses them. The whole disks are named once, in a ``disks`` line.
    """

    def __init__(self, root_pid: int, writer: TraceWriter, interval: float,
                 exclude: set[int] | None = None) -> None:
        self.root_pid = root_pid
        self.writer = writer
        self.interval = interval
        self.exclude = exclude or set()
        self.samples = 0
        self.cpu_s = 0.0
        self._io_fds: dict[int, int] = {}  # pid -> fd of its /proc/<pid>/io
        self._disk_fd = -1
        self._use_children = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lcache-trace-sampler",
                                        daemon=True)

    def _first_lines(self) -> list[str]:
        me = os.getpid()
        with contextlib.suppress(OSError):
            self._disk_fd = os.open("/proc/diskstats", os.O_RDONLY | os.O_CLOEXEC)
        try:
            disks = sorted(d for d in os.listdir("/sys/block") if not d.startswith(_SKIP_DEVICES))
        except OSError:
            disks = []
        return [dumps({"name": DISKS, "ph": "M", "pid": me, "tid": me,
                       "args": {"whole": disks}})]

    def _proc_io(self, pid: int, lines: list[str]) -> bytes:
        fd = self._io_fds.get(pid)
        if fd is None:
            try:
                fd = os.open(f"/proc/{pid}/io", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:  # gone, or another user's
                return b""
            self._io_fds[pid] = fd
            lines.extend(process_metadata(pid, read_cmdline(pid)[:300]))
        try:
            return os.pread(fd, 4096, 0)
        except OSError:  # reaped: its file is dead, even if the pid comes back
            close_file(self._io_fds.pop(pid))
            return b""

    def sample(self) -> None:
        cpu0 = time.thread_time()
        ts = time.perf_counter_ns()
        lines = self._first_lines() if self.samples == 0 else []
        parts = [blocks.TIME.pack(ts)]
        for pid in descendants(self.root_pid, self._use_children):
            if pid in self.exclude:
                continue
            raw = self._proc_io(pid, lines)
            if raw:
                parts += (blocks.PROC_ENTRY.pack(pid, len(raw)), raw)
        disk = bytearray(blocks.TIME.pack(ts))
        if self._disk_fd >= 0:
            while chunk := os.pread(self._disk_fd, 1 << 16, len(disk) - blocks.TIME.size):
                disk += chunk
        me = os.getpid()
        self.writer.write_lines(lines, [blocks.block(blocks.KIND_PROC_IO, me, me, b"".join(parts)),
                                        blocks.block(blocks.KIND_DISKSTATS, me, me, bytes(disk))])
        self.samples += 1
        self.cpu_s += time.thread_time() - cpu0  # what sampling costs the machine

    def _run(self) -> None:
        background_thread()
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop, take one last sample (of the devices; the root may be gone), close."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join()
        self.sample()
        for fd in (*self._io_fds.values(), self._disk_fd):
            if fd >= 0:
                close_file(fd)
        self._io_fds.clear()
        self._disk_fd = -1
