"""Fuzzing the trace loader (report/load.py) and the statistics behind the report: random
bytes, random JSON lines, huge and special numbers, deep nesting, every truncation and bit flip
of a real trace in its four forms (as recorded: JSON lines and binary blocks; gzip members;
converted to JSON lines; Perfetto's JSON array). Only
LCacheError subclasses escape, in bounded time and memory."""

from __future__ import annotations

import gzip
import json
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lcache.trace
from lcache.errors import CorruptionError
from lcache.io import open_file, pread_full, pwrite_full
from lcache.report import write_perfetto
from lcache.report.load import json_lines, load
from lcache.report.stats import summarize_trace

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A real trace of lcache.io reads and writes, as JSON lines, gzip and Perfetto array."""
    tmp = tmp_path_factory.mktemp("real")
    lines = tmp / "t.trace"
    lcache.trace.enable(str(lines))
    try:
        fd = open_file(str(tmp / "data.bin"), os.O_RDWR | os.O_CREAT)
        try:
            for i in range(6):
                pwrite_full(fd, i * 4096, [b"x" * 4096], "cache-write")
            lcache.trace.flush()  # two flushes: two gzip members in the .gz form
            for i in range(6):
                pread_full(fd, i * 4096, memoryview(bytearray(4096)), "cache-read")
        finally:
            os.close(fd)
    finally:
        lcache.trace.disable()
    wrapped = tmp / "t.json"
    write_perfetto(lines, wrapped)
    text = lines.read_bytes()
    assert b"\0LCB" in text  # the recorder's binary blocks, between JSON lines
    half = len(text) // 2
    return {"t.trace": text, "t.json": wrapped.read_bytes(),
            "t.jsonl": "".join(json_lines(str(lines))).encode(),
            "t.trace.gz": gzip.compress(text[:half]) + gzip.compress(text[half:])}


def check(path: Path, data: bytes) -> None:
    """Load (and summarize) ``data``: a trace or a CorruptionError, fast and in little memory."""
    path.write_bytes(data)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        summarize_trace(load(path))
    except CorruptionError as exc:  # TraceFormatError: names the file and the line
        assert str(path) in str(exc) and "\n" not in str(exc), str(exc)[:300]
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 5.0
    assert peak < 16 << 20, peak


NUMBERS = (st.integers() | st.floats() | st.sampled_from(
    [2**63, -(2**63) - 1, 2**64, 10**30, 1e308, -1e308, 1e-320, 2.0**53, -1, 0]))
SCALARS = st.none() | st.booleans() | NUMBERS | st.text(max_size=10)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=10)
ARGS = st.fixed_dictionaries({}, optional={
    k: JSON | NUMBERS for k in ("fid", "file", "name", "off", "size", "ret", *(
        "rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes", "reads",
        "read_sectors", "writes", "write_sectors", "io_ms"))})
EVENT = st.fixed_dictionaries(
    {"ph": st.sampled_from(["X", "M", "C", "B", "i"]) | JSON, "pid": NUMBERS | JSON},
    optional={"name": st.sampled_from(["read", "write", "file_name", "process_name", "io",
                                       "vda"]) | JSON,
              "cat": st.sampled_from(["cache-read", "proc-io", "diskstats"]) | JSON,
              "tid": NUMBERS | JSON, "ts": NUMBERS | JSON, "dur": NUMBERS | JSON,
              "args": ARGS | JSON})


@SETTINGS
@given(st.binary(max_size=3000))
def test_random_bytes(tmp_path: Path, data: bytes) -> None:
    check(tmp_path / "r.trace", data)
    check(tmp_path / "r.trace.gz", gzip.compress(data))


# Well-formed I/O events with extreme values: they load, and the statistics must cope.
INT64 = st.integers(-(2**63), 2**63 - 1) | st.sampled_from([0, -1, 2**63 - 1, -(2**63)])
IO_EVENT = st.fixed_dictionaries({
    "ph": st.just("X"), "name": st.sampled_from(["read", "write", "fsync"]),
    "cat": st.sampled_from(["cache-read", "checkpoint", "syscall"]), "pid": INT64,
    "tid": INT64, "ts": st.floats(-(2.0**53), 2.0**53), "dur": st.floats(0, 2.0**53),
    "args": st.fixed_dictionaries({"file": st.text(max_size=5), "off": INT64, "size": INT64,
                                   "ret": INT64})})


@settings(SETTINGS, max_examples=80)
@given(st.lists(EVENT | IO_EVENT, min_size=1, max_size=12), st.booleans())
def test_random_json_events(tmp_path: Path, events: list[dict[str, Any]],
                            wrapped: bool) -> None:
    lines = [json.dumps(e) for e in events]  # NaN and Infinity literals included
    text = ("[\n" + ",\n".join(lines) + "\n]\n") if wrapped else "\n".join(lines) + "\n"
    check(tmp_path / "e.trace", text.encode())


@SETTINGS
@given(st.sampled_from(["t.trace", "t.json", "t.jsonl", "t.trace.gz"]), st.data())
def test_truncations_and_bit_flips_of_a_real_trace(tmp_path: Path, real: dict[str, bytes],
                                                   name: str, data: st.DataObject) -> None:
    original = real[name]
    cut = data.draw(st.integers(0, len(original)))
    check(tmp_path / name, original[:cut])
    at = data.draw(st.integers(0, len(original) - 1))
    bit = data.draw(st.integers(0, 7))
    flipped = bytearray(original)
    flipped[at] ^= 1 << bit
    check(tmp_path / name, bytes(flipped))


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 200_000), st.sampled_from(["[", "{\"a\":", "{\"ph\":\"X\",\"pid\":["]))
def test_deep_nesting(tmp_path: Path, depth: int, opener: str) -> None:
    closer = {"[": "]", "{\"a\":": "}", "{\"ph\":\"X\",\"pid\":[": "]"}[opener]
    line = opener * depth + "1" + closer * depth
    check(tmp_path / "d.trace", (line + "\n").encode())


@pytest.mark.parametrize("digits", [18, 19, 20, 400, 4300, 4301, 100_000])
def test_huge_numbers_in_every_field(tmp_path: Path, real: dict[str, bytes],
                                     digits: int) -> None:
    big = "9" * digits
    events = [json.loads(line) for line in real["t.jsonl"].decode().splitlines()]
    for i, ev in enumerate(events):
        for key in ("pid", "tid", "ts", "dur"):
            if key in ev:
                text = json.dumps({**ev, key: 0}).replace(f'"{key}": 0', f'"{key}": {big}')
                check(tmp_path / f"h{i}{key}.trace", (text + "\n").encode())
        for key in ev.get("args", {}):
            text = json.dumps({**ev, "args": {**ev["args"], key: 0}}).replace(
                f'"{key}": 0', f'"{key}": {big}')
            check(tmp_path / f"h{i}a{key}.trace", (text + "\n").encode())


def _block(payload: bytes, *, magic: bytes = b"\0LCB", version: int = 1,
           length: int | None = None) -> bytes:
    import struct

    n = len(payload) if length is None else length
    return struct.pack("<4sHHIII", magic, version, 1, 7, 7, n) + payload


NAMES = (b'{"name":"io_name","ph":"M","pid":7,"args":{"kind":"op","id":1,"name":"read"}}\n'
         b'{"name":"io_name","ph":"M","pid":7,"args":{"kind":"cat","id":1,"name":"other"}}\n')


def _record(code: int = 1 | 1 << 16, t0: int = 1000, t1: int = 2000) -> bytes:
    import struct

    return struct.pack("<7q", code, 1, 0, 4096, 4096, t0, t1)


@pytest.mark.parametrize(("data", "says"), [
    (NAMES + _block(_record()), None),
    (NAMES + _block(_record())[:-9], "cut short"),
    (NAMES + _block(_record())[:10], "cut short"),
    (NAMES + _block(_record(), magic=b"\0XYZ"), "neither a JSON line nor"),
    (NAMES + _block(_record(), version=9), "upgrade lcache"),
    (NAMES + _block(b"", length=1 << 30), "which no writer makes"),
    (NAMES + _block(_record()[:50]), "which no writer makes"),
    (NAMES + _block(_record(t0=5, t1=4)), "out of range"),
    (NAMES + _block(_record(t0=-1)), "out of range"),
    (NAMES + _block(_record(code=2 | 1 << 16)), "op id 2"),
    (_block(_record()) + NAMES, "op id 1"),  # names after their block
])
def test_damaged_binary_blocks_are_one_line_errors(tmp_path: Path, data: bytes,
                                                   says: str | None) -> None:
    path = tmp_path / "b.trace"
    check(path, data)
    if says is None:
        trace = load(path)
        assert (len(trace), trace.ops, trace.classes) == (1, ["read"], ["other"])
        return
    with pytest.raises(CorruptionError, match=says) as err:
        load(path)
    assert "byte " in str(err.value) and "\n" not in str(err.value)
    check(tmp_path / "b.trace.gz", gzip.compress(data))


def _sample(kind: int, payload: bytes) -> bytes:
    import struct

    return struct.pack("<4sHHIII", b"\0LCB", 1, kind, 7, 7, len(payload)) + payload


PROC_IO = (b"rchar: 1\nwchar: 2\nsyscr: 3\nsyscw: 4\nread_bytes: 5\nwrite_bytes: 6\n"
           b"cancelled_write_bytes: 0\n")


@pytest.mark.parametrize(("data", "says"), [
    (_sample(2, (1000).to_bytes(8, "little") + (9).to_bytes(4, "little")
             + len(PROC_IO).to_bytes(4, "little") + PROC_IO), None),
    (_sample(2, (1000).to_bytes(8, "little") + (9).to_bytes(4, "little")
             + (500).to_bytes(4, "little") + PROC_IO), "runs past the block"),
    (_sample(2, (1000).to_bytes(8, "little") + (9).to_bytes(4, "little")
             + len(PROC_IO).to_bytes(4, "little") + PROC_IO.replace(b"1", b"x")), "parse"),
    (_sample(2, (1000).to_bytes(8, "little") + b"\1\2"), "parse"),
    (_sample(3, (-5).to_bytes(8, "little", signed=True) + b"8 0 vda 1 2 3 4 5 6 7 8 9 10"),
     "parse"),
    (_sample(2, b"\1\2\3"), "which no writer makes"),
])
def test_damaged_proc_sample_blocks_are_one_line_errors(tmp_path: Path, data: bytes,
                                                        says: str | None) -> None:
    path = tmp_path / "s.trace"
    check(path, data)
    if says is None:
        assert load(path).proc[9][1].tolist() == [[1, 2, 3, 4, 5, 6]]
        return
    with pytest.raises(CorruptionError, match=says) as err:
        load(path)
    assert "byte 0" in str(err.value) and "\n" not in str(err.value)
