"""Figures a report must not make up: merged traces, repeated samples, duplicated input,
damaged counters and rates over no time (the findings of an attacker's report)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from lcache.errors import CorruptionError
from lcache.report import summarize

from .conftest import assert_one_line_error, run_lcache

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


def test_traces_recorded_apart_are_counted_per_file(tmp_path: Path) -> None:
    """The finding: two runs traced minutes apart, given to one report, were taken for one
    series: the device's counters and the span ran from the first run's first sample to the
    second's last (839 MiB read and 198 s for two runs of under a second each). Counters
    rise per file and the time between files is no part of any span or rate."""
    gap = 600e6  # the second run, ten minutes later; the disk read 100 GiB in between
    a = _write(tmp_path / "a.trace", [
        _op(0.0, 0, dur=1e6), _proc(0.0, 0), _proc(1e6, M),
        _disk(0.0, 0, 0), _disk(1e6, 2048, 2)])
    b = _write(tmp_path / "b.trace", [
        _op(gap, M, dur=1e6), _proc(gap, 5 * M), _proc(gap + 1e6, 6 * M),
        _disk(gap, 2048 + (100 << 30) // 512, 9), _disk(gap + 1e6, 4096 + (100 << 30) // 512,
                                                         11)])
    s = summarize([a, b])
    vda = s["devices"]["vda"]
    assert (vda["read_bytes"], vda["reads"], vda["seconds"]) == (2 * M, 4, 2.0), vda
    assert vda["MBps_mean"] == round(2 * M / 1e6 / 2, 3)
    assert s["processes"]["100"]["read_bytes"] == 2 * M
    assert s["processes"]["100"]["seconds"] == 2.0
    assert s["traced_vs_devices"] == {"traced_bytes": 2 * M, "device_bytes": 2 * M,
                                      "share": 1.0}
    assert s["trace"]["span_s"] == 2.0 and s["total"]["span_s"] == 2.0
    assert s["total"]["MBps_mean"] == round(2 * M / 1e6 / 2, 3)
    assert s["total"]["MBps_peak"] >= s["total"]["MBps_mean"]


def test_traces_of_one_time_share_their_span(tmp_path: Path) -> None:
    """Files that overlap in time (the ranks of one job) are one span, not two."""
    a = _write(tmp_path / "a.trace", [_op(0.0, 0, dur=1e6)])
    b = _write(tmp_path / "b.trace", [_op(0.5e6, 0, dur=1e6, pid=200)])
    assert summarize([a, b])["trace"]["span_s"] == 1.5


def test_a_trace_given_twice_is_refused(tmp_path: Path) -> None:
    """The finding: the same trace given twice (one name twice, two names of one file, a
    copy) doubled every figure of `lcache report` and `lcache advise`, and said nothing."""
    a = _write(tmp_path / "a.trace", [_op(0.0, 0), _op(1e3, M)])
    (tmp_path / "copy.trace").write_bytes(a.read_bytes())
    (tmp_path / "link.trace").symlink_to(a)
    for other, words in (("a.trace", "given twice"),
                         ("link.trace", "is the same file as"),
                         ("copy.trace", "holds the same trace as")):
        with pytest.raises(CorruptionError, match=f"{other}: {words}"):
            summarize([a, tmp_path / other])
        for command in ("report", "advise"):
            assert_one_line_error(run_lcache(command, "a.trace", other, cwd=tmp_path),
                                  f"{other}: {words}", "give each trace once")


def test_repeated_event_lines_are_dropped_and_counted(tmp_path: Path, caplog: Any) -> None:
    """The finding: every event line written twice in one file doubled the bytes and ops.
    An exact repeat (same pid, tid, start, op, file, offset, size) is dropped and counted."""
    ops = [_op(i * 1e3, i * M) for i in range(10)]
    once = summarize(_write(tmp_path / "once.trace", ops))
    with caplog.at_level(logging.WARNING, logger="lcache"):
        twice = summarize(_write(tmp_path / "twice.trace", ops + ops[3:]))
    assert twice["total"]["bytes"] == once["total"]["bytes"] == 10 * M
    assert twice["total"]["ops"] == 10 and twice["trace"]["repeated_events"] == 7
    assert once["trace"]["repeated_events"] == 0
    assert "dropped 7 I/O events that repeat another" in caplog.text
    # two threads (or one thread later) doing the same op are not repeats
    other = [dict(op, tid=101) for op in ops]
    assert summarize(_write(tmp_path / "two.trace", ops + other))["total"]["ops"] == 20


def test_counters_that_go_down_restarted(tmp_path: Path) -> None:
    """The finding: a disk counter that went down (a device removed and added again) gave
    -562,949,953,370,112 bytes read. A counter that goes down restarted from 0: the
    interval's increase is its new value, and no figure is negative."""
    t = _write(tmp_path / "t.trace", [
        _op(0.0, 0), _disk(0.0, 1000), _disk(1e6, 3000), _disk(2e6, 100), _disk(3e6, 300),
        _proc(0.0, 5 * M), _proc(1e6, 6 * M), _proc(2e6, M), _proc(3e6, 2 * M)])
    s = summarize(t)
    assert s["devices"]["vda"]["read_bytes"] == (2000 + 100 + 200) * 512
    assert s["processes"]["100"]["read_bytes"] == 3 * M
    assert s["traced_vs_devices"]["device_bytes"] == (2000 + 100 + 200) * 512


def test_a_rate_over_no_time_is_undefined_not_zero(tmp_path: Path) -> None:
    """The finding: 10 MiB written by ops of no duration at one instant read 'MBps 0.0'.
    A rate over no time is undefined: null in summary.json, n/a in the HTML."""
    from lcache.report import write_report

    t = _write(tmp_path / "t.trace", [_op(1000.0, i * M, dur=0.0) for i in range(10)]
               + [_disk(1000.0, 0)])
    s = write_report(t, tmp_path / "r.html")
    for c in (s["total"], s["classes"]["checkpoint"]):
        assert c["bytes"] == 10 * M and c["span_s"] == 0.0
        assert c["MBps_mean"] is None and c["MBps_peak"] is None, c
    vda = s["devices"]["vda"]  # one sample: no interval to take a rate over
    assert vda["MBps_mean"] is None and vda["MBps_peak"] is None and vda["IOPS_peak"] is None
    page = (tmp_path / "r.html").read_text()
    row = page[page.index("<b>total</b>"):].split("</tr>")[0].split("<td>")
    assert row[8:10] == ["n/a</td>", "n/a</td>"], row  # MBps_mean, MBps_peak


def test_the_page_runs_only_its_own_script(tmp_path: Path) -> None:
    """The page allowed any inline script ('unsafe-inline') where docs/trace.md promised
    default-src 'none'; only its one script, by hash, may run now."""
    import base64
    import hashlib
    import re

    from lcache.report import write_report

    write_report(_write(tmp_path / "t.trace", [_op(0.0, 0)]), tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    policy = re.search(r'Content-Security-Policy" content="([^"]*)"', page)
    assert policy is not None and "script-src 'unsafe-inline'" not in policy[1], policy
    (script,) = re.findall(r"<script>(.*?)</script>", page, re.S)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in policy[1]


def test_a_share_above_one_is_not_a_percentage(tmp_path: Path) -> None:
    """The finding (newcomer helper 55): the quick start's job wrote 8 MiB the devices had
    not yet written back when the trace ended (0.2 MiB), and the report said "the traced job
    made 102400.0% of the devices' traffic (the rest is other jobs' or the kernel's)". Above
    1 the share is said to be no share, with why; below, a percentage as before. A trace of
    no lcache.io events says what the table counts instead of a bare "0 events"."""
    over = _write(tmp_path / "over.trace", [
        _proc(0.0, 0), _proc(1e6, 8 * M), _disk(0.0, 0, 0), _disk(1e6, 512, 1)])
    run = run_lcache("report", str(over), "-o", "over.html", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    page = (tmp_path / "over.html").read_text()
    for text in (" ".join(run.stdout.split()), page):
        assert "written back after the trace ended" in text and "cannot be told" in text
        assert "% of the devices" not in text and "the rest is other" not in text
    assert "no I/O events: the table counts lcache.io operations" in " ".join(
        run.stdout.split())
    half = _write(tmp_path / "half.trace", [
        _op(0.0, 0), _proc(0.0, 0), _proc(1e6, M), _disk(0.0, 0, 0), _disk(1e6, 4096, 2)])
    run = run_lcache("report", str(half), "-o", "half.html", cwd=tmp_path)
    assert "made 50.0% of the devices' traffic" in " ".join(run.stdout.split())
    assert "made 50.0% of the devices" in (tmp_path / "half.html").read_text()
    assert "no I/O events" not in run.stdout


def test_a_path_that_is_not_utf8_is_shown_escaped(tmp_path: Path) -> None:
    """The finding (attack helper 104): `lcache demo --dir` of a name that is not UTF-8 (its
    byte kept as a surrogate by os.fsdecode) ended in UnicodeEncodeError writing the page."""
    import os

    from lcache.report import write_report

    where = tmp_path / os.fsdecode(b"run\xff")
    where.mkdir()
    trace = _write(where / "t.trace", [_op(0.0, 0)])
    write_report(trace, where / "r.html", where / "summary.json")
    assert "run\\udcff" in (where / "r.html").read_text()
    assert json.loads((where / "summary.json").read_text())
