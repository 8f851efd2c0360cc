"""Binary blocks in a trace file: the in-library recorder's events as fixed-size records.

A trace file holds JSON lines (metadata, /proc samples, traces written before this format) and
binary blocks, in any order. A block starts with a NUL byte, which no JSON line does::

    magic b"\\0LCB" | version u16 | kind u16 | pid u32 | tid u32 | payload bytes u32 | payload

all little-endian. Kind 1 (I/O events): ``FIELDS`` int64 per event: code (op id | class
id << 16, ids named by ``io_name`` lines of the same pid), file id (named by ``file_name``
lines), offset, size, result, start and end in ns of ``perf_counter_ns``. Each flush writes its
name lines before its blocks, in one ``write()``.
"""

from __future__ import annotations

import struct

from lcache.io.tracer import RECORD, RECORD_FIELDS

MAGIC = b"\0LCB"
VERSION = 1
KIND_EVENTS = 1
HEADER = struct.Struct("<4sHHIII")
RECORD_BYTES = RECORD.size
FIELDS = RECORD_FIELDS
#: Largest payload a writer makes (a block per 16 MiB, ~300,000 events); a reader refuses more
#: as damage, so a corrupt length cannot make it allocate without bound.
MAX_PAYLOAD = 1 << 24


def event_blocks(pid: int, tid: int, data: bytes) -> list[bytes]:
    """The blocks of a run of packed event records (split at ``MAX_PAYLOAD``)."""
    step = MAX_PAYLOAD - MAX_PAYLOAD % RECORD_BYTES
    return [HEADER.pack(MAGIC, VERSION, KIND_EVENTS, pid, tid, len(chunk)) + chunk
            for chunk in (data[i : i + step] for i in range(0, len(data), step))]
