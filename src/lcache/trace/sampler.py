"""Sampling /proc: the I/O counters of a process tree and of the block devices.

Every ``interval`` seconds the sampler finds the descendants of the root process (through
``/proc/<pid>/task/<tid>/children``, or a scan of ``/proc/*/stat`` where the kernel lacks it),
reads each one's ``/proc/<pid>/io`` and the whole-disk lines of ``/proc/diskstats``, and writes
them as Chrome counter events (cumulative values; the report turns them into rates). A process
that starts and ends between two samples is not seen; the last interval of one that exits is
lost (the kernel drops its counters when it is reaped).
"""

from __future__ import annotations

import os
import threading
import time

from lcache.trace.schema import DISKSTATS, PROC_IO
from lcache.trace.writer import TraceWriter, dumps, process_metadata, read_cmdline

_IO_KEYS = {"rchar": "rchar", "wchar": "wchar", "syscr": "syscr", "syscw": "syscw",
            "read_bytes": "read_bytes", "write_bytes": "write_bytes"}
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


def read_proc_io(pid: int) -> dict[str, int] | None:
    try:
        with open(f"/proc/{pid}/io") as f:
            text = f.read()
    except OSError:  # gone, or another user's
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in _IO_KEYS:
            values[key] = int(value)
    return values if len(values) == len(_IO_KEYS) else None


def read_diskstats() -> dict[str, dict[str, int]]:
    """Whole disks only (partitions would count the same bytes twice)."""
    try:
        disks = set(os.listdir("/sys/block"))
    except OSError:
        disks = set()
    out: dict[str, dict[str, int]] = {}
    try:
        with open("/proc/diskstats") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) < 13:
            continue
        name = parts[2]
        if (disks and name not in disks) or name.startswith(_SKIP_DEVICES):
            continue
        out[name] = {"reads": int(parts[3]), "read_sectors": int(parts[5]),
                     "writes": int(parts[7]), "write_sectors": int(parts[9]),
                     "io_ms": int(parts[12])}
    return out


class ProcSampler:
    """Samples the tree under ``root_pid`` into ``writer`` from a background thread."""

    def __init__(self, root_pid: int, writer: TraceWriter, interval: float,
                 exclude: set[int] | None = None) -> None:
        self.root_pid = root_pid
        self.writer = writer
        self.interval = interval
        self.exclude = exclude or set()
        self.samples = 0
        self.cpu_s = 0.0
        self._seen: set[int] = set()
        self._use_children = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lcache-trace-sampler",
                                        daemon=True)

    def sample(self) -> None:
        cpu0 = time.thread_time()
        ts = f"{time.perf_counter_ns() / 1000:.3f}"
        lines: list[str] = []
        for pid in descendants(self.root_pid, self._use_children):
            if pid in self.exclude:
                continue
            io = read_proc_io(pid)
            if io is None:
                continue
            if pid not in self._seen:
                self._seen.add(pid)
                lines.extend(process_metadata(pid, read_cmdline(pid)[:300]))
            lines.append(f'{{"name":"io","cat":"{PROC_IO}","ph":"C","pid":{pid},"tid":{pid},'
                         f'"ts":{ts},"args":{dumps(io)}}}')
        me = os.getpid()
        for dev, counters in read_diskstats().items():
            lines.append(f'{{"name":{dumps(dev)},"cat":"{DISKSTATS}","ph":"C","pid":{me},'
                         f'"tid":{me},"ts":{ts},"args":{dumps(counters)}}}')
        self.writer.write_lines(lines)
        self.samples += 1
        self.cpu_s += time.thread_time() - cpu0  # what sampling costs the machine

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop and take one last sample (of the devices; the root may be gone)."""
        self._stop.set()
        self._thread.join()
        self.sample()
