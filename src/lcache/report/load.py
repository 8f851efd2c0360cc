"""Loading trace files (plain or gzip, JSON lines or wrapped in ``[ ]``) into numpy columns.

Every error names the file and the line: a missing file or one that is not a regular file, a
line that is not JSON (the last line cut short means the file was truncated) or is longer than
any event, an object that is not a trace event or holds numbers out of range, or a file with
no lcache events at all. Memory stays bounded by the events, whatever the file holds.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from lcache.io import close_file
from lcache.io.files import NotRegularFile, open_regular
from lcache.trace import blocks
from lcache.trace.mounts import MEMORY_FS
from lcache.trace.sampler import DISK_FIELDS as DISK_FIELDS  # the loader's public names
from lcache.trace.sampler import PROC_FIELDS as PROC_FIELDS
from lcache.trace.sampler import parse_diskstats, parse_proc_io
from lcache.trace.schema import DISKS, DISKSTATS, PROC_IO, RAM_CLASS, TraceFormatError
from lcache.trace.writer import dumps, io_event


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
    #: (index in ``paths``, pid) -> the pid of its parent, as its ``process_name`` line says
    #: (a DataLoader worker's parent is the training process)
    ppid: dict[tuple[int, int], int] = field(default_factory=dict)
    #: pid -> (timestamps in us, counters: one row per sample, columns PROC_FIELDS)
    proc: dict[int, tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]] = field(
        default_factory=dict)
    #: device -> (timestamps in us, counters: one row per sample, columns DISK_FIELDS)
    disks: dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]] = field(
        default_factory=dict)
    #: per file: ``{"dev", "fs", "mnt"}`` as the recorder found them (``{}``: not known)
    file_where: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    #: per event: the index in ``paths`` of the trace file it came from (empty: all from one)
    source: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, np.int32))
    #: per pid / device: the index in ``paths`` of each sample's file (rows of ``proc`` and
    #: ``disks`` are in file order, then time): counters of two recordings are not one series
    proc_source: dict[int, npt.NDArray[np.int32]] = field(default_factory=dict)
    disk_source: dict[str, npt.NDArray[np.int32]] = field(default_factory=dict)
    events: int = 0
    ignored: int = 0
    #: exact repeats of an I/O event that were dropped (see :func:`_drop_repeats`)
    repeats: int = 0
    #: (index in ``paths``, pid) of each process whose ``recorder`` start marker has no end
    #: after it: killed before its last flush, so its last events may be missing
    unfinished: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ts_us)


#: Longest line accepted. Real events are far shorter (paths are at most 4 KiB, process names
#: are cut to 4 KiB); a longer line is damage or not a trace, and the cap bounds the memory a
#: file without newlines (``/dev/zero``, a gzip bomb) can take.
MAX_LINE = 1 << 20
MAX_BLANK_LINES = 10_000  # in a row: a gzip of 10^8 newlines (100 KB) took minutes to read

#: Timestamps and durations are microseconds; beyond 2^53 (285 years) a float loses the
#: microsecond and the time bins of the report would overflow.
_MAX_US = float(blocks.MAX_US)
_MAX_BYTES = blocks.MAX_BYTES
MAX_CLASSES = 24  # shown apart in a report; the rest are one


def _open(path: str) -> BinaryIO:
    """The trace file, opened without blocking (a FIFO would wait for a writer) and only if it
    is a regular file (a device or a FIFO can be endless)."""
    try:
        fd = open_regular(path, os.O_RDONLY, follow=True)
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no such trace file; give the file that "
                               "`lcache trace -o` or LCACHE_TRACE wrote") from None
    except NotRegularFile as exc:
        kind = "a directory" if exc.kind == "a directory" else "not a regular file"
        raise TraceFormatError(f"{path}: {kind}; give a trace file that `lcache trace -o` "
                               "or LCACHE_TRACE wrote") from None
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read the trace: {exc.strerror}") from None
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        close_file(fd)
        raise


@dataclass
class Block:
    """One binary block of a trace (``lcache.trace.blocks``), header checked."""

    at: int  # byte offset in the (uncompressed) trace
    kind: int  # blocks.KIND_EVENTS, KIND_PROC_IO or KIND_DISKSTATS
    pid: int
    tid: int
    payload: bytes


def records(path: str) -> Iterator[tuple[int, str | Block]]:
    """The trace's JSON lines, as (line number, text), and binary blocks, as (byte offset,
    :class:`Block`), in file order.

    Raises:
        TraceFormatError: the file is missing, not a regular file, truncated or damaged.
    """
    lineno = 0
    at = 0
    blank = 0  # blank lines in a row
    try:
        with _open(path) as raw:
            magic = raw.read(2)
            raw.seek(0)
            stream: Any = gzip.GzipFile(fileobj=raw) if magic == b"\x1f\x8b" else raw
            while first := stream.peek(1)[:1]:
                if first == blocks.MAGIC[:1]:
                    block = _read_block(path, stream, at)
                    at += blocks.HEADER.size + len(block.payload)
                    yield block.at, block
                    continue
                data = stream.readline(MAX_LINE + 1)
                lineno += 1
                at += len(data)
                if len(data) > MAX_LINE:
                    raise TraceFormatError(f"{path}: line {lineno}: longer than {MAX_LINE} "
                                           "characters, which no trace event is; the file is "
                                           "damaged or not a trace")
                if data.isspace():  # no writer makes them: a run of them is a bomb
                    blank += 1
                    if blank > MAX_BLANK_LINES:
                        raise TraceFormatError(f"{path}: line {lineno}: more than "
                                               f"{MAX_BLANK_LINES:,} blank lines in a row, "
                                               "which no trace has; the file is damaged or "
                                               "not a trace")
                    continue
                blank = 0
                yield lineno, data.decode("utf-8")
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise TraceFormatError(f"{path}: line {lineno + 1}: compressed data is cut short or "
                               f"damaged ({exc}); the trace is truncated") from exc
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{path}: line {lineno}: not UTF-8 text; is this a trace "
                               "file?") from exc
    except TraceFormatError:
        raise
    except OSError as exc:
        raise TraceFormatError(f"{path}: line {lineno + 1}: cannot read the trace: "
                               f"{exc.strerror or exc}") from exc


def _read_block(path: str, stream: Any, at: int) -> Block:
    where = f"{path}: byte {at}"
    head = stream.read(blocks.HEADER.size)
    if len(head) < blocks.HEADER.size:
        raise TraceFormatError(f"{where}: a binary block cut short (the trace is truncated)")
    magic, version, kind, pid, tid, length = blocks.HEADER.unpack(head)
    if magic != blocks.MAGIC:
        raise TraceFormatError(f"{where}: neither a JSON line nor an lcache binary block; "
                               "is this a trace written by lcache?")
    if version != blocks.VERSION or kind not in blocks.KINDS:
        raise TraceFormatError(f"{where}: a binary block of version {version}, kind {kind}, "
                               "which this lcache does not read; upgrade lcache")
    if length > blocks.MAX_PAYLOAD or (length % blocks.RECORD_BYTES if kind == blocks.KIND_EVENTS
                                       else length < blocks.TIME.size):
        raise TraceFormatError(f"{where}: a binary block of {length} bytes, which no writer "
                               "makes; the trace is damaged")
    parts: list[bytes] = []
    left = length
    while left:  # in pieces: a damaged length must not allocate before the bytes exist
        part = stream.read(min(left, 1 << 20))
        if not part:
            raise TraceFormatError(f"{where}: a binary block cut short (the trace is "
                                   "truncated)")
        parts.append(part)
        left -= len(part)
    return Block(at, kind, pid, tid, b"".join(parts))


def json_lines(path: str) -> Iterator[str]:
    """The trace as Chrome trace events, one JSON object per line (with its newline): the
    recorder's binary blocks become one line per event, the other lines are kept as they are.

    Raises:
        TraceFormatError: the file is missing, truncated or damaged.
    """
    for _, line in _lines(path):
        yield line


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """The trace as JSON lines, binary blocks turned into one line per event."""
    names: dict[tuple[int, str, int], str] = {}
    whole: dict[int, set[str]] = {}  # sampler pid -> whole disks
    for n, rec in records(path):
        if isinstance(rec, Block):
            lines = _block_lines(path, rec, names) if rec.kind == blocks.KIND_EVENTS \
                else _sample_lines(path, rec, whole.get(rec.pid))
            for line in lines:
                yield n, line + "\n"
            continue
        if rec.startswith('{"name":"disks"'):
            ev = _parse(path, n, rec, last=False)
            if ev is not None:
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    whole[_int(ev["pid"])] = _whole_disks(ev)
        if rec.startswith('{"name":"io_name"'):  # ours, so in this key order
            ev = _parse(path, n, rec, last=False)
            if ev is not None:
                args = ev.get("args") or {}
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    names[(_int(ev["pid"]), str(args["kind"]), _int(args["id"]))] = \
                        str(args["name"])
        yield n, rec


def _block_lines(path: str, block: Block, names: dict[tuple[int, str, int], str]
                 ) -> Iterator[str]:
    cols = _block_columns(path, block)
    pid = block.pid
    for row in zip(*(c.tolist() for c in cols), strict=True):
        code, fid, off, size, ret, t0, t1 = row
        op = _name(path, block, names, "op", code & 0xFFFF)
        cat = _name(path, block, names, "cat", code >> 16)
        yield io_event(pid, block.tid, op, cat, t0, t1 - t0, fid, off, size, ret)


def _whole_disks(ev: dict[str, Any]) -> set[str]:
    return {str(d) for d in ev["args"]["whole"]}


def _sample_lines(path: str, block: Block, whole: set[str] | None) -> Iterator[str]:
    ts, samples = _samples(path, block, whole)
    us = f"{ts // 1000}.{ts % 1000:03d}"
    for key, values in samples:
        if block.kind == blocks.KIND_PROC_IO:
            yield dumps({"name": "io", "cat": PROC_IO, "ph": "C", "pid": key, "tid": key,
                         "ts": float(us), "args": dict(zip(PROC_FIELDS, values, strict=True))})
        else:
            yield dumps({"name": key, "cat": DISKSTATS, "ph": "C", "pid": block.pid,
                         "tid": block.pid, "ts": float(us),
                         "args": dict(zip(DISK_FIELDS, values, strict=True))})


def _samples(path: str, block: Block, whole: set[str] | None
             ) -> tuple[int, list[tuple[Any, list[int]]]]:
    """A /proc sample block: its time (ns) and (pid, counters) or (disk, counters)."""
    data = block.payload
    try:
        (ts,) = blocks.TIME.unpack_from(data)
        if ts < 0 or ts // 1000 > 1 << 53:
            raise ValueError(f"time {ts} ns")
        if block.kind == blocks.KIND_DISKSTATS:
            return ts, list(parse_diskstats(data[blocks.TIME.size :], whole).items())
        out: list[tuple[Any, list[int]]] = []
        pos = blocks.TIME.size
        while pos < len(data):
            pid, n = blocks.PROC_ENTRY.unpack_from(data, pos)
            pos += blocks.PROC_ENTRY.size
            if pos + n > len(data):
                raise ValueError("an entry runs past the block")
            values = parse_proc_io(data[pos : pos + n])
            pos += n
            if values is not None:
                out.append((pid, values))
        return ts, out
    except (struct.error, ValueError) as exc:
        detail = " ".join(str(exc)[:200].split())
        raise TraceFormatError(f"{path}: byte {block.at}: a /proc sample block that does not "
                               f"parse ({detail}); the trace is damaged") from exc


def _name(path: str, block: Block, names: dict[tuple[int, str, int], str], kind: str,
          ident: int) -> str:
    name = names.get((block.pid, kind, ident))
    if name is None:
        raise TraceFormatError(f"{path}: byte {block.at}: an event of pid {block.pid} names "
                               f"{kind} id {ident}, which no io_name line defined before it; "
                               "the trace is damaged")
    return name


def _block_columns(path: str, block: Block) -> list[npt.NDArray[np.int64]]:
    """The block's record fields as columns, checked: codes of two 16-bit ids, start and end
    times that are times (end not before start)."""
    a = np.frombuffer(block.payload, dtype="<i8").reshape(-1, blocks.FIELDS)
    cols = [a[:, i].astype(np.int64) for i in range(blocks.FIELDS)]
    code, t0, t1 = cols[0], cols[5], cols[6]
    if len(code) and ((code < 0).any() or (code >> 32).any() or (t0 < 0).any()
                      or (t1 < t0).any() or int(t1.max()) // 1000 > 1 << 53):
        raise TraceFormatError(f"{path}: byte {block.at}: a binary block with an event code "
                               "or a time out of range; the trace is damaged")
    return cols


def _check_bytes(path: str, block: Block, off: Any, size: Any, ret: Any) -> None:
    """What ``_bytes`` checks of a JSON event, for a block's columns that a report sums."""
    if len(size) and ((size < 0).any() or int(size.max()) >= _MAX_BYTES
                      or (off < -1).any() or int(off.max()) >= _MAX_BYTES
                      or (ret <= -_MAX_BYTES).any() or (ret >= _MAX_BYTES).any()):
        raise TraceFormatError(f"{path}: byte {block.at}: a binary block with a size, offset "
                               "or result that is not a byte count below 2**62")


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
    except (ValueError, RecursionError) as exc:  # a 5,000-digit number; [[[[...]]]]
        raise TraceFormatError(f"{path}: line {lineno}: not a trace event (nested too deeply "
                               "or a number too long)") from exc
    if not isinstance(obj, dict) or "ph" not in obj or "pid" not in obj:
        raise TraceFormatError(f"{path}: line {lineno}: not a Chrome trace event (an object "
                               "with 'ph' and 'pid'); is this a trace written by lcache?")
    if not isinstance(obj.get("args", {}), dict):
        raise TraceFormatError(f"{path}: line {lineno}: the event's 'args' is not an object")
    return obj


def _whole(value: Any) -> int:
    """A JSON number that is a whole number: ``int()`` took ``"1000"``, ``true`` for 1 and
    ``1.5`` for 1, and a damaged field passed for a count."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{str(value)[:40]!r} is not a number")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{value} is not a whole number")
    return int(value)


def _int(value: Any) -> int:
    """An integer field, which must fit the int64 columns."""
    n = _whole(value)
    if not -(1 << 63) <= n < 1 << 63:
        raise ValueError(f"{n:.3g} does not fit in 64 bits")
    return n


def _bytes(value: Any, name: str, low: int = 0) -> int:
    """A size, offset or result: from ``low`` to below 2**62 bytes, so sums of millions
    of them stay within the int64 columns (three sizes of 2**63 - 1 summed wrapped round)."""
    n = _whole(value)
    if not low <= n < _MAX_BYTES:
        raise ValueError(f"{name} {n:.3g} is not a byte count from {low} to 2**62")
    return n


def _us(value: Any) -> float:
    """A time in microseconds: finite and within 2^53."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{str(value)[:40]!r} is not a number of microseconds")
    t = float(value)
    if not abs(t) <= _MAX_US:  # also false for NaN
        raise ValueError(f"{t} us is not a time")
    return t


def _counter(value: Any, name: str) -> int:
    """A /proc counter: a count from 0 (a negative one is damage, not a reset)."""
    n = _whole(value)
    if not 0 <= n < 1 << 63:
        raise ValueError(f"counter {name} {n:.3g} is not a count from 0 to 2**63")
    return n


def _moved(op: str, size: int, ret: int) -> int:
    """The result of an op: a read or a write moves at most the bytes asked for."""
    if op in ("read", "write") and ret > size:
        raise ValueError(f"a {op} of {size} bytes that moved {ret}")
    return ret


def _dur(value: Any) -> float:
    t = _us(value)
    if t < 0:
        raise ValueError(f"negative duration {t}")
    return t


class _Builder:
    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, int, int, float, float, int, int, int, int]] = []
        self.chunks: list[list[npt.NDArray[Any]]] = []  # columns, in file order with rows
        self.io_names: dict[tuple[int, int, str, int], str] = {}  # (source, pid, kind, id)
        self.whole: dict[tuple[int, int], set[str]] = {}  # (source, sampler pid) -> disks
        self.ops: dict[str, int] = {}
        self.classes: dict[str, int] = {}
        self.files: dict[str, int] = {}
        self.fid_names: dict[tuple[int, int, int], str] = {}  # (source, pid, fid) -> path
        self.where: dict[str, dict[str, str]] = {}  # path -> {"dev", "fs", "mnt"}
        self.process_names: dict[int, str] = {}
        self.ppid: dict[tuple[int, int], int] = {}  # (source, pid) -> parent pid
        self.proc: dict[int, list[tuple[int, float, list[int]]]] = {}  # (source, ts, values)
        self.disks: dict[str, list[tuple[int, float, list[int]]]] = {}
        self.ignored = 0
        self.events = 0
        self.recording: dict[tuple[int, int], bool] = {}  # (source, pid) -> started, not ended

    def index(self, table: dict[str, int], name: str) -> int:
        i = table.get(name)
        if i is None:
            i = table[name] = len(table)
        return i

    def add(self, source: int, path: str, lineno: int, ev: dict[str, Any]) -> None:
        ph = ev["ph"]
        args = ev.get("args") or {}
        self.events += 1
        try:
            pid = _int(ev["pid"])
            if ph == "X" and ("fid" in args or "file" in args):
                if "file" in args:  # strace-derived events carry the path itself
                    name = str(args["file"])
                else:
                    name = self.fid_names.get((source, pid, _int(args["fid"])),
                                              f"fid {args['fid']} of pid {pid}")
                op, size = str(ev["name"]), _bytes(args.get("size", 0), "size")
                self.rows.append((
                    pid, _int(ev.get("tid", pid)), self.index(self.ops, op),
                    self.index(self.classes, str(ev.get("cat", "other"))),
                    self.index(self.files, name), _us(ev["ts"]), _dur(ev.get("dur", 0)),
                    _bytes(args.get("off", -1), "offset", -1), size,
                    _moved(op, size, _bytes(args.get("ret", 0), "result", 1 - _MAX_BYTES)),
                    source))
            elif ph == "M" and ev.get("name") == "file_name":
                name = str(args["name"])
                self.fid_names[(source, pid, _int(args["fid"]))] = name
                if "dev" in args and not self.where.get(name):
                    self.where[name] = {k: str(args[k])[:4096] for k in ("dev", "fs", "mnt")
                                        if k in args}
            elif ph == "M" and ev.get("name") == DISKS:
                self.whole[(source, pid)] = _whole_disks(ev)
            elif ph == "M" and ev.get("name") == "io_name":
                self.io_names[(source, pid, str(args["kind"]), _int(args["id"]))] = \
                    str(args["name"])[:4096]
            elif ph == "M" and ev.get("name") == "recorder":
                # the last marker counts: a pid reused after an end starts afresh
                self.recording[(source, pid)] = args["state"] == "start"
            elif ph == "M" and ev.get("name") == "process_name":
                self.process_names[pid] = str(args.get("name", ""))
                if "ppid" in args:
                    self.ppid[(source, pid)] = _int(args["ppid"])
            elif ph == "C" and ev.get("cat") == PROC_IO:
                self.proc.setdefault(pid, []).append(
                    (source, _us(ev["ts"]), [_counter(args[k], k) for k in PROC_FIELDS]))
            elif ph == "C" and ev.get("cat") == DISKSTATS:
                self.disks.setdefault(str(ev["name"]), []).append(
                    (source, _us(ev["ts"]), [_counter(args[k], k) for k in DISK_FIELDS]))
            else:
                self.ignored += 1
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            detail = " ".join(f"{type(exc).__name__}: {exc}"[:200].split())
            kind = " ".join(str(ph)[:40].split())  # one line, whatever the trace holds
            raise TraceFormatError(f"{path}: line {lineno}: a '{kind}' event with a "
                                   f"missing or malformed field ({detail})") from exc


    def add_block(self, source: int, path: str, block: Block) -> None:
        if block.kind != blocks.KIND_EVENTS:
            ts, samples = _samples(path, block, self.whole.get((source, block.pid)))
            self.events += len(samples)
            for key, values in samples:
                table: Any = self.proc if block.kind == blocks.KIND_PROC_IO else self.disks
                table.setdefault(key, []).append((source, ts / 1000.0, values))
            return
        self.add_events(source, path, block)

    def add_events(self, source: int, path: str, block: Block) -> None:
        """A binary block's events, as columns (no Python object per event)."""
        code, fid, off, size, ret, t0, t1 = _block_columns(path, block)
        _check_bytes(path, block, off, size, ret)
        n = len(code)
        self.events += n
        if not n:
            return
        self.flush_rows()
        pid = block.pid

        def mapped(ids: npt.NDArray[np.int64], name_of: Any) -> npt.NDArray[np.int32]:
            uniq, inverse = np.unique(ids, return_inverse=True)
            return np.array([name_of(int(i)) for i in uniq], np.int32)[inverse]

        def named(table: dict[str, int], kind: str) -> Any:
            def name_of(ident: int) -> int:
                name = self.io_names.get((source, pid, kind, ident))
                if name is None:
                    raise TraceFormatError(f"{path}: byte {block.at}: an event of pid {pid} "
                                           f"names {kind} id {ident}, which no io_name line "
                                           "defined before it; the trace is damaged")
                return self.index(table, name)
            return name_of

        def file_of(ident: int) -> int:
            name = self.fid_names.get((source, pid, ident), f"fid {ident} of pid {pid}")
            return self.index(self.files, name)

        op = mapped(code & 0xFFFF, named(self.ops, "op"))
        moving = np.isin(op, [self.ops[k] for k in ("read", "write") if k in self.ops])
        if (moving & (ret > size)).any():
            raise TraceFormatError(f"{path}: byte {block.at}: a binary block with a read or "
                                   "write that moved more bytes than it asked for; the trace "
                                   "is damaged")
        self.chunks.append([
            np.full(n, pid, np.int64), np.full(n, block.tid, np.int64), op,
            mapped(code >> 16, named(self.classes, "cat")), mapped(fid, file_of),
            t0 / 1000.0, (t1 - t0) / 1000.0, off, size, ret, np.full(n, source, np.int32)])

    def flush_rows(self) -> None:
        if self.rows:
            cols = list(zip(*self.rows, strict=True))
            self.chunks.append([np.array(c, dtype=t) for c, t in zip(cols, _DTYPES,
                                                                     strict=True)])
            self.rows = []


_DTYPES = (np.int64, np.int64, np.int32, np.int32, np.int32, np.float64, np.float64, np.int64,
           np.int64, np.int64, np.int32)


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
    seen: dict[Any, tuple[int, str]] = {}  # file identity, content digest -> first given
    for source, p in enumerate(paths):
        path = os.fspath(p)
        before = b.events
        with contextlib.suppress(OSError):  # a missing file is records()'s error to give
            st = os.stat(path)
            _once(seen, ("file", st.st_dev, st.st_ino), source, path, "is the same file as")
        digest = hashlib.blake2b(digest_size=16)
        pending: tuple[int, str] | None = None
        for lineno, line in records(path):
            if isinstance(line, Block):
                digest.update(blocks.HEADER.pack(blocks.MAGIC, blocks.VERSION, line.kind,
                                                 line.pid, line.tid, len(line.payload)))
                digest.update(line.payload)
            else:
                digest.update(line.encode("utf-8", "surrogatepass"))
            if pending is not None:
                ev = _parse(path, pending[0], pending[1], last=False)
                if ev is not None:
                    b.add(source, path, pending[0], ev)
                pending = None
            if isinstance(line, Block):
                b.add_block(source, path, line)
            else:
                pending = (lineno, line)
        if pending is not None:
            ev = _parse(path, pending[0], pending[1], last=True)
            if ev is not None:
                b.add(source, path, pending[0], ev)
        if b.events == before:
            raise TraceFormatError(f"{path}: line 1: the file holds no trace events")
        _once(seen, ("content", digest.digest()), source, path, "holds the same trace as")
    b.flush_rows()
    # a process killed before its first flush left its start marker alone: an empty trace
    # whose note says events may be missing, not a refusal
    if not b.chunks and not b.proc and not b.disks and not any(b.recording.values()):
        raise TraceFormatError(f"{os.fspath(paths[0])}: line 1: no lcache I/O events or /proc "
                               "samples in the trace; is it a trace written by lcache?")
    def arr(i: int, dtype: Any) -> Any:
        return np.concatenate([c[i] for c in b.chunks]).astype(dtype) if b.chunks \
            else np.array([], dtype=dtype)

    def series(rows: list[tuple[int, float, list[int]]]) -> tuple[Any, Any]:
        rows.sort(key=lambda r: (r[0], r[1]))
        return (np.array([r[1] for r in rows], np.float64),
                np.array([r[2] for r in rows], np.int64).reshape(len(rows), -1))

    def sources(rows: list[tuple[int, float, list[int]]]) -> Any:
        return np.array(sorted(r[0] for r in rows), np.int32)  # the order series() gives

    trace = Trace(
        pid=arr(0, np.int64), tid=arr(1, np.int64), op=arr(2, np.int32), cls=arr(3, np.int32),
        file=arr(4, np.int32), ts_us=arr(5, np.float64), dur_us=arr(6, np.float64),
        offset=arr(7, np.int64), size=arr(8, np.int64), result=arr(9, np.int64),
        ops=[_printable(n) for n in b.ops], classes=[_printable(n) for n in b.classes],
        files=[_printable(n) for n in b.files],
        process_names={pid: _printable(n) for pid, n in b.process_names.items()},
        ppid=b.ppid,
        proc={pid: series(rows) for pid, rows in b.proc.items()},
        disks={_printable(dev): series(rows) for dev, rows in b.disks.items()},
        file_where=[b.where.get(name, {}) for name in b.files],
        paths=[os.fspath(p) for p in paths], events=b.events, ignored=b.ignored,
        unfinished=sorted(key for key, open_ in b.recording.items() if open_),
        source=arr(10, np.int32),
        proc_source={pid: sources(rows) for pid, rows in b.proc.items()},
        disk_source={_printable(dev): sources(rows) for dev, rows in b.disks.items()})
    _drop_repeats(trace)
    _cache_in_memory_apart(trace)
    _fold_rare_classes(trace)
    return trace


def _once(seen: dict[Any, tuple[int, str]], key: Any, source: int, path: str,
          what: str) -> None:
    """Refuse a trace given twice (by one name or two, or as a copy): its every figure
    would count twice, and nothing in the report would say so."""
    first, name = seen.setdefault(key, (source, path))
    if first != source:
        again = "given twice" if name == path else f"{what} {name}, given before it"
        raise TraceFormatError(f"{path}: {again}; give each trace once")


def _drop_repeats(trace: Trace) -> None:
    """Drop exact repeats of an I/O event (same pid, tid, start, op, file, offset and size):
    one thread cannot start the same operation twice at one nanosecond, so a repeat is a
    line copied into the trace (a file concatenated with itself, a log merged twice), and
    counted it would double the figures. The count is kept, logged and in the summary."""
    n = len(trace)
    if n < 2:
        return
    keys = (trace.size, trace.offset, trace.file, trace.op, trace.ts_us, trace.tid, trace.pid)
    order = np.lexsort(keys)
    same = np.ones(n - 1, dtype=bool)
    for k in keys:
        same &= k[order[1:]] == k[order[:-1]]
    if not same.any():
        return
    keep = np.ones(n, dtype=bool)
    keep[order[1:][same]] = False  # lexsort is stable: the first in file order stays
    for name in ("pid", "tid", "op", "cls", "file", "ts_us", "dur_us", "offset", "size",
                 "result", "source"):
        column = getattr(trace, name)
        if len(column) == n:
            setattr(trace, name, column[keep])
    trace.repeats = int(n - keep.sum())
    logging.getLogger("lcache").warning(
        "lcache: dropped %d I/O events that repeat another exactly (same pid, tid, start, "
        "op, file, offset, size) in %s; a trace line was copied", trace.repeats,
        ", ".join(trace.paths))


def _fold_rare_classes(trace: Trace) -> None:
    """Past ``MAX_CLASSES`` classes (lcache records about ten; a trace's are free text),
    those that moved the fewest bytes become one, ``other (N classes)``: every plot has a
    line and a legend entry per class, and 1,000 classes took 35 s to draw."""
    n = len(trace.classes)
    if n <= MAX_CLASSES:
        return
    moved = np.bincount(trace.cls, weights=np.maximum(trace.size, 0), minlength=n)
    ops = np.bincount(trace.cls, minlength=n)
    keep = sorted(int(i) for i in np.lexsort((-ops, -moved))[:MAX_CLASSES - 1])
    remap = np.full(n, len(keep), np.int32)
    remap[keep] = np.arange(len(keep), dtype=np.int32)
    trace.classes = [trace.classes[i] for i in keep] + [f"other ({n - len(keep)} classes)"]
    trace.cls = remap[trace.cls]


def _printable(name: str) -> str:
    """``name`` with lone surrogates shown as escapes: a file name that is not UTF-8 comes
    through JSON as ``"caf\\udce9"``, which matplotlib and HTML cannot draw; shown as
    ``caf\\xe9``, its bytes."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name decodes to
        return name.encode("utf-8", "backslashreplace").decode()


def in_memory(path: str, where: dict[str, str]) -> bool:
    """Whether a file lives in memory (tmpfs, ramfs). Traces written before the recorder
    noted filesystems say nothing: there a path under /dev/shm is taken for tmpfs."""
    if "fs" in where:
        return where["fs"] in MEMORY_FS
    return path.startswith("/dev/shm/")


def _cache_in_memory_apart(trace: Trace) -> None:
    """Cache I/O to files in memory (lcache's prefetch staging area in /dev/shm) becomes
    class ``cache-ram``: counted as cache-read/cache-write it was taken for SSD traffic."""
    ram = np.array([in_memory(f, w) for f, w in zip(trace.files, trace.file_where,
                                                    strict=True)], dtype=bool)
    cache = np.array([c.startswith("cache-") for c in trace.classes], dtype=bool)
    if not len(trace) or not ram.any() or not cache.any():
        return
    moved = ram[trace.file] & cache[trace.cls]
    if moved.any():
        if RAM_CLASS not in trace.classes:
            trace.classes.append(RAM_CLASS)
        trace.cls[moved] = trace.classes.index(RAM_CLASS)
