"""Figures a report must not make up: merged traces, repeated samples, duplicated input,
damaged counters and rates over no time (the findings of an attacker's report)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lcache.report import summarize

M = 1 << 20


def _op(ts: float, off: int, size: int = M, ret: int = M, dur: float = 500.0,
        name: str = "write", pid: int = 100) -> dict[str, Any]:
    return {"name": name, "cat": "checkpoint", "pid": pid, "tid": pid, "ts": ts, "dur": dur,
            "ph": "X", "args": {"file": "/data/a.bin", "off": off, "size": size, "ret": ret}}


def _disk(ts: float, read_sectors: int, reads: int = 0, dev: str = "vda") -> dict[str, Any]:
    return {"name": dev, "cat": "diskstats", "ph": "C", "pid": 100, "tid": 100, "ts": ts,
            "args": {"reads": reads, "read_sectors": read_sectors, "writes": 0,
                     "write_sectors": 0, "io_ms": 0}}


def _proc(ts: float, read_bytes: int, pid: int = 100) -> dict[str, Any]:
    return {"name": "io", "cat": "proc-io", "ph": "C", "pid": pid, "tid": pid, "ts": ts,
            "args": {"rchar": read_bytes, "wchar": 0, "syscr": 0, "syscw": 0,
                     "read_bytes": read_bytes, "write_bytes": 0}}


def _write(path: Path, events: list[Any]) -> Path:
    path.write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n"
                            for e in events))
    return path


def test_two_disk_samples_at_one_time_keep_the_device_peak(tmp_path: Path) -> None:
    """The finding: a repeated sample (dt = 0) zeroed the whole device peak, which read
    0.0 MB/s under a mean of 4 MB/s; the zero-length interval is what must be skipped."""
    t = _write(tmp_path / "t.trace", [
        _op(0.0, 0), _disk(0.0, 0, 0), _disk(1e6, 8192, 10), _disk(1e6, 8192, 10),
        _disk(2e6, 8192 * 2, 20)])
    vda = summarize(t)["devices"]["vda"]
    assert vda["read_bytes"] == 8192 * 2 * 512
    assert vda["MBps_peak"] >= vda["MBps_mean"] > 0, vda
    assert vda["IOPS_peak"] == 10.0, vda
