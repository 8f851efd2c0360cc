"""What the report's plots show: one time origin, percentiles only where the ops support them,
the devices set against the traced processes, class colours that stay apart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lcache.report import plots as report_plots
from lcache.report.load import load

US = 1e6


def _lines(lib_start_s: float = 7.5) -> list[str]:
    """/proc and diskstats samples every 0.5 s for 10 s; lcache events from ``lib_start_s``."""
    out = [json.dumps({"name": "file_name", "ph": "M", "pid": 7, "tid": 7,
                       "args": {"fid": 1, "name": "/nvme/ckpt.bin"}})]
    for k in range(21):
        ts = 1000 * US + k * 0.5 * US
        out.append(json.dumps({"name": "io", "cat": "proc-io", "ph": "C", "pid": 7, "ts": ts,
                               "args": {"rchar": 0, "wchar": k << 20, "syscr": 0,
                                        "syscw": k, "read_bytes": 0,
                                        "write_bytes": k << 20}}))
        out.append(json.dumps({"name": "vda", "cat": "diskstats", "ph": "C", "pid": 1,
                               "ts": ts, "args": {"reads": 0, "read_sectors": 0,
                                                  "writes": 4 * k,
                                                  "write_sectors": k * 4 * 2048,
                                                  "io_ms": 0}}))
    for i in range(50):
        out.append(json.dumps({"name": "write", "cat": "checkpoint", "pid": 7, "tid": 7,
                               "ts": 1000 * US + lib_start_s * US + i * 1000, "dur": 500,
                               "ph": "X", "args": {"fid": 1, "off": i << 20,
                                                   "size": 1 << 20, "ret": 1 << 20}}))
    return out


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The matplotlib figures the plots draw, kept instead of turned into PNGs."""
    figs: list[Any] = []
    monkeypatch.setattr(report_plots, "_png", lambda fig: figs.append(fig) or "")
    return figs


def test_every_plot_counts_seconds_from_the_trace_start(tmp_path: Path,
                                                        figures: list[Any]) -> None:
    t = tmp_path / "t.trace"
    t.write_text("\n".join(_lines(7.5)) + "\n")
    trace = load(t)
    report_plots.over_time(trace)
    report_plots.processes(trace)
    report_plots.devices(trace)
    bw, iops, proc, dev = figures
    for fig in (bw, iops):
        (line,) = fig.axes[0].get_lines()
        assert line.get_xdata()[0] == pytest.approx(7.5, abs=0.01)  # not 0: the same origin
    for fig in (proc, dev):
        xs = [x for line in fig.axes[0].get_lines() for x in line.get_xdata()]
        assert min(xs) == pytest.approx(0.5) and max(xs) == pytest.approx(10.0)
