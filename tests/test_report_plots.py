"""What the report's plots show: one time origin, percentiles only where the ops support them,
the devices set against the traced processes, class colours that stay apart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lcache.report import plots as report_plots
from lcache.report import print_summary, summarize
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


def test_no_high_percentile_from_too_few_ops(tmp_path: Path, figures: list[Any]) -> None:
    lines = _lines()  # 50 checkpoint writes
    lines += [json.dumps({"name": "read", "cat": "cache-read", "pid": 7, "tid": 7,
                          "ts": 2000 * US + i, "dur": 10.0 + i, "ph": "X",
                          "args": {"fid": 1, "off": 0, "size": 4096, "ret": 4096}})
              for i in range(3)]
    t = tmp_path / "t.trace"
    t.write_text("\n".join(lines) + "\n")
    s = summarize(t)
    for name in ("cache-read", "checkpoint"):  # 3 and 50 ops: no p99
        assert s["classes"][name]["lat_p99_us"] is None
        assert s["classes"][name]["size_p99"] is None
    assert s["classes"]["cache-read"]["lat_p50_us"] == 11.0
    _, caption, _ = report_plots.latency(load(t))
    bars = {c.get_label(): [p.get_height() for p in c.patches]
            for c in figures[0].axes[0].containers}
    # rows: cache-read read (3 ops), checkpoint write (50 ops)
    assert bars["p50"][0] == 11.0 and bars["p90"][1] > 0
    for p in ("p90", "p99", "p99.9"):
        assert np.isnan(bars[p][0])
    assert np.isnan(bars["p99"][1]) and np.isnan(bars["p99.9"][1])
    assert "too few ops" in caption and "cache-read read" in caption
    print_summary(s)  # prints "-" for the missing p99s


def test_devices_set_against_the_traced_processes(tmp_path: Path,
                                                  figures: list[Any]) -> None:
    t = tmp_path / "t.trace"
    t.write_text("\n".join(_lines()) + "\n")
    s = summarize(t)
    # the process wrote 1 MiB per 0.5 s; the disk wrote 4 MiB per 0.5 s
    assert s["traced_vs_devices"] == {"traced_bytes": 20 << 20, "device_bytes": 80 << 20,
                                      "share": 0.25}
    report_plots.devices(load(t))
    lines = {line.get_label(): line for line in figures[0].axes[0].get_lines()}
    traced = lines["traced processes (all devices)"].get_ydata()
    device = lines["vda"].get_ydata()
    assert np.allclose(traced, 2 * 1.048576) and np.allclose(device, 4 * traced)


def _cvd_distance(a: str, b: str, matrix: np.ndarray) -> float:
    """CIELAB distance of two colours as seen with a colour-vision deficiency (Machado, Oliveira
    and Fernandes 2009, severity 1, applied to linear RGB)."""
    def lab(hex_colour: str) -> np.ndarray:
        srgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
        rgb = np.where(srgb <= 0.04045, srgb / 12.92, ((srgb + 0.055) / 1.055) ** 2.4)
        rgb = np.clip(matrix @ rgb, 0, 1)
        xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722],
                        [0.0193, 0.1192, 0.9505]]) @ rgb / np.array([0.95047, 1, 1.08883])
        f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
        return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])
    return float(np.linalg.norm(lab(a) - lab(b)))


_VISION = {
    "normal": np.eye(3),
    "protanopia": np.array([[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216],
                            [-0.003882, -0.048116, 1.051998]]),
    "deuteranopia": np.array([[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413],
                              [-0.011820, 0.042940, 0.968881]]),
    "tritanopia": np.array([[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602],
                            [0.004733, 0.691367, 0.303900]]),
}


def test_class_colours_stay_apart_for_colour_blind_readers(tmp_path: Path,
                                                           figures: list[Any]) -> None:
    """Every pair of classes in one plot differs in line style or in colour by a CIELAB
    distance of at least 12 with normal vision and each of the three dichromacies."""
    from matplotlib.colors import to_hex

    from lcache.trace import CLASSES

    lines = [json.dumps({"name": "file_name", "ph": "M", "pid": 7, "tid": 7,
                         "args": {"fid": 1, "name": "/nvme/x"}})]
    lines += [json.dumps({"name": "read", "cat": c, "pid": 7, "tid": 7, "ts": 10.0 * i,
                          "dur": 1.0, "ph": "X",
                          "args": {"fid": 1, "off": 0, "size": 4096, "ret": 4096}})
              for i, c in enumerate(CLASSES)]
    t = tmp_path / "t.trace"
    t.write_text("\n".join(lines) + "\n")
    report_plots.over_time(load(t))
    drawn = [(line.get_label(), to_hex(line.get_color()), line.get_linestyle())
             for line in figures[0].axes[0].get_lines()]
    assert len(drawn) == len(CLASSES)
    for i, (a, ca, sa) in enumerate(drawn):
        for b, cb, sb in drawn[i + 1:]:
            if sa == sb:
                for vision, m in _VISION.items():
                    assert _cvd_distance(ca, cb, m) >= 12, (a, b, vision)
