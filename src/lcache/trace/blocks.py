"""Binary blocks in a trace file: the in-library recorder's events as fixed-size records.

A trace file holds JSON lines (metadata, /proc samples, traces written before this format) and
binary blocks, in any order. A block starts with a NUL byte, which no JSON line does::

    magic b"\\0LCB" | version u16 | kind u16 | pid u32 | tid u32 | payload bytes u32 | payload

all little-endian. Kind 1 (I/O events): ``FIELDS`` int64 per event: code (op id | class
id << 16, ids named by ``io_name`` lines of the same pid), file id (named by ``file_name``
lines), offset, size, result, start and end in ns of ``perf_counter_ns``. Kind 2 (a sample of
``/proc/<pid>/io``): the time (int64 ns), then per process its pid (u32), a length (u32) and
the bytes read. Kind 3 (a sample of ``/proc/diskstats``): the time, then the bytes read; the
whole disks are named by a ``disks`` line of the sampler's pid. Each flush writes its
name lines before its blocks, in one ``write()``.
"""

from __future__ import annotations

import struct

from lcache.io.tracer import RECORD, RECORD_FIELDS

MAGIC = b"\0LCB"
VERSION = 1
KIND_EVENTS = 1
KIND_PROC_IO = 2
KIND_DISKSTATS = 3
KINDS = (KIND_EVENTS, KIND_PROC_IO, KIND_DISKSTATS)
HEADER = struct.Struct("<4sHHIII")
TIME = struct.Struct("<q")  # a /proc sample's time (ns of perf_counter_ns)
PROC_ENTRY = struct.Struct("<II")  # pid, bytes of its /proc/<pid>/io read, which follow
RECORD_BYTES = RECORD.size
FIELDS = RECORD_FIELDS
#: Largest payload a writer makes (a block per 16 MiB, ~300,000 events); a reader refuses more
#: as damage, so a corrupt length cannot make it allocate without bound.
MAX_PAYLOAD = 1 << 24
#: An event's size and offset (from -1: none) and result (from -2**62) are below this, so
#: sums of millions stay within int64; its end time, in us, is at most ``MAX_US``. A reader
#: refuses a trace that breaks either, and the recorder refuses such an event.
MAX_BYTES = 1 << 62
MAX_US = 1 << 53


def block(kind: int, pid: int, tid: int, payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, pid, tid, len(payload)) + payload


def event_blocks(pid: int, tid: int, data: bytes) -> list[bytes | memoryview]:
    """Headers and payloads of the blocks of a run of packed event records (a block per
    ``MAX_PAYLOAD``), to be written as they are: the payloads are views of ``data``."""
    step = MAX_PAYLOAD - MAX_PAYLOAD % RECORD_BYTES
    view = memoryview(data)
    out: list[bytes | memoryview] = []
    for i in range(0, len(data), step):
        chunk = view[i : i + step]
        out += (HEADER.pack(MAGIC, VERSION, KIND_EVENTS, pid, tid, len(chunk)), chunk)
    return out
