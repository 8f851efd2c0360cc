"""Loading trace files (plain or gzip, JSON lines or wrapped in ``[ ]``) into numpy columns.

Every error names the file and the line: a missing file, a line that is not JSON (the last
line cut short means the file was truncated), an object that is not a trace event, or a file
with no lcache events at all.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from lcache.trace.schema import DISKSTATS, PROC_IO, TraceFormatError

PROC_FIELDS = ("rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes")
DISK_FIELDS = ("reads", "read_sectors", "writes", "write_sectors", "io_ms")


@dataclass
class Trace:
    """Columns of all I/O events (one row per operation) plus the /proc samples."""

    pid: npt.NDArray[np.int64]
    tid: npt.NDArray[np.int64]
    op: npt.NDArray[np.int32]  # index into ``ops``
    cls: npt.NDArray[np.int32]  # index into ``classes``
    file: npt.NDArray[np.int32]  # index into ``files``
    ts_us: npt.NDArray[np.float64]
    dur_us: npt.NDArray[np.float64]
    offset: npt.NDArray[np.int64]  # -1: unknown (some strace events)
    size: npt.NDArray[np.int64]
    result: npt.NDArray[np.int64]
    ops: list[str]
    classes: list[str]
    files: list[str]
    process_names: dict[int, str] = field(default_factory=dict)
    #: pid -> (timestamps in us, counters: one row per sample, columns PROC_FIELDS)
    proc: dict[int, tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]] = field(
        default_factory=dict)
    #: device -> (timestamps in us, counters: one row per sample, columns DISK_FIELDS)
    disks: dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]] = field(
        default_factory=dict)
    paths: list[str] = field(default_factory=list)
    events: int = 0
    ignored: int = 0

    def __len__(self) -> int:
        return len(self.ts_us)


def _lines(path: str) -> Iterator[tuple[int, str]]:
    try:
        with open(path, "rb") as probe:
            magic = probe.read(2)
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no such trace file; give the file that "
                               "`lcache trace -o` or LCACHE_TRACE wrote") from None
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read the trace: {exc.strerror}") from exc
    lineno = 0
    try:
        opener = gzip.open if magic == b"\x1f\x8b" else open
        with opener(path, "rt", encoding="utf-8", errors="strict") as f:
            for lineno, line in enumerate(f, 1):
                yield lineno, line
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise TraceFormatError(f"{path}: line {lineno + 1}: compressed data is cut short or "
                               f"damaged ({exc}); the trace is truncated") from exc
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{path}: line {lineno + 1}: not UTF-8 text; is this a trace "
                               "file?") from exc


def _parse(path: str, lineno: int, line: str, last: bool) -> dict[str, Any] | None:
    text = line.strip()
    if text in ("", "[", "]"):
        return None
    if text.endswith(","):  # Perfetto-wrapped form: "[", one event per line with commas, "]"
        text = text[:-1]
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        if last and not line.endswith("\n"):
            raise TraceFormatError(f"{path}: line {lineno}: the last line is cut short "
                                   "(the trace file is truncated)") from exc
        raise TraceFormatError(f"{path}: line {lineno}: not a JSON object ({exc.msg}); "
                               "is this a trace written by lcache?") from exc
    if not isinstance(obj, dict) or "ph" not in obj or "pid" not in obj:
        raise TraceFormatError(f"{path}: line {lineno}: not a Chrome trace event (an object "
                               "with 'ph' and 'pid'); is this a trace written by lcache?")
    return obj


class _Builder:
    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, int, int, float, float, int, int, int]] = []
        self.ops: dict[str, int] = {}
        self.classes: dict[str, int] = {}
        self.files: dict[str, int] = {}
        self.fid_names: dict[tuple[int, int, int], str] = {}  # (source, pid, fid) -> path
        self.process_names: dict[int, str] = {}
        self.proc: dict[int, list[tuple[float, list[int]]]] = {}
        self.disks: dict[str, list[tuple[float, list[int]]]] = {}
        self.ignored = 0
        self.events = 0

    def index(self, table: dict[str, int], name: str) -> int:
        i = table.get(name)
        if i is None:
            i = table[name] = len(table)
        return i

    def add(self, source: int, path: str, lineno: int, ev: dict[str, Any]) -> None:
        ph = ev["ph"]
        pid = int(ev["pid"])
        args = ev.get("args") or {}
        self.events += 1
        try:
            if ph == "X" and ("fid" in args or "file" in args):
                if "file" in args:  # strace-derived events carry the path itself
                    name = str(args["file"])
                else:
                    name = self.fid_names.get((source, pid, int(args["fid"])),
                                              f"fid {args['fid']} of pid {pid}")
                self.rows.append((
                    pid, int(ev.get("tid", pid)), self.index(self.ops, str(ev["name"])),
                    self.index(self.classes, str(ev.get("cat", "other"))),
                    self.index(self.files, name), float(ev["ts"]), float(ev.get("dur", 0)),
                    int(args.get("off", -1)), int(args.get("size", 0)),
                    int(args.get("ret", 0))))
            elif ph == "M" and ev.get("name") == "file_name":
                self.fid_names[(source, pid, int(args["fid"]))] = str(args["name"])
            elif ph == "M" and ev.get("name") == "process_name":
                self.process_names[pid] = str(args.get("name", ""))
            elif ph == "C" and ev.get("cat") == PROC_IO:
                self.proc.setdefault(pid, []).append(
                    (float(ev["ts"]), [int(args[k]) for k in PROC_FIELDS]))
            elif ph == "C" and ev.get("cat") == DISKSTATS:
                self.disks.setdefault(str(ev["name"]), []).append(
                    (float(ev["ts"]), [int(args[k]) for k in DISK_FIELDS]))
            else:
                self.ignored += 1
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{path}: line {lineno}: a '{ph}' event with a missing or "
                                   f"malformed field ({type(exc).__name__}: {exc})") from exc


def load(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> Trace:
    """Read one or more trace files into one :class:`Trace`.

    Raises:
        TraceFormatError: a file is missing, truncated, not a trace, or holds no lcache events
            (the message names the file and the line).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise TraceFormatError("no trace files given")
    b = _Builder()
    for source, p in enumerate(paths):
        path = os.fspath(p)
        before = b.events
        pending: tuple[int, str] | None = None
        for lineno, line in _lines(path):
            if pending is not None:
                ev = _parse(path, pending[0], pending[1], last=False)
                if ev is not None:
                    b.add(source, path, pending[0], ev)
            pending = (lineno, line)
        if pending is not None:
            ev = _parse(path, pending[0], pending[1], last=True)
            if ev is not None:
                b.add(source, path, pending[0], ev)
        if b.events == before:
            raise TraceFormatError(f"{path}: line 1: the file holds no trace events")
    if not b.rows and not b.proc and not b.disks:
        raise TraceFormatError(f"{os.fspath(paths[0])}: line 1: no lcache I/O events or /proc "
                               "samples in the trace; is it a trace written by lcache?")
    cols = list(zip(*b.rows, strict=True)) if b.rows else [()] * 10

    def arr(i: int, dtype: Any) -> Any:
        return np.array(cols[i], dtype=dtype)

    def series(rows: list[tuple[float, list[int]]]) -> tuple[Any, Any]:
        rows.sort(key=lambda r: r[0])
        return (np.array([r[0] for r in rows], np.float64),
                np.array([r[1] for r in rows], np.int64).reshape(len(rows), -1))

    return Trace(
        pid=arr(0, np.int64), tid=arr(1, np.int64), op=arr(2, np.int32), cls=arr(3, np.int32),
        file=arr(4, np.int32), ts_us=arr(5, np.float64), dur_us=arr(6, np.float64),
        offset=arr(7, np.int64), size=arr(8, np.int64), result=arr(9, np.int64),
        ops=list(b.ops), classes=list(b.classes), files=list(b.files),
        process_names=b.process_names,
        proc={pid: series(rows) for pid, rows in b.proc.items()},
        disks={dev: series(rows) for dev, rows in b.disks.items()},
        paths=[os.fspath(p) for p in paths], events=b.events, ignored=b.ignored)
