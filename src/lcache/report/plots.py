"""The report's plots: matplotlib (Agg) figures rendered to base64 PNG.

Each function returns (title, caption, png_base64). A plot without data is still drawn (it
says why it is empty), so the page always has the same set of images.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any

import numpy as np

from lcache.report.load import PROC_FIELDS, Trace
from lcache.report.stats import (
    SECTOR,
    counter_steps,
    data_mask,
    enough_ops,
    nearest_rank,
    rates,
    time_bins,
    trace_start_us,
    traced_storage_bytes,
)
from lcache.trace.mounts import MEMORY_FS

Plot = tuple[str, str, str]


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _plt().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _empty(ax: Any, why: str) -> None:
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="#666")
    ax.set_xticks([])
    ax.set_yticks([])


def _size_label(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:g}{unit}"
        n /= 1024
    return f"{n:g}TiB"


def _classes(trace: Trace) -> list[tuple[int, str]]:
    return sorted(enumerate(trace.classes), key=lambda c: c[1])


#: Okabe and Ito's colour-blind-safe palette: any two stay apart (CIELAB distance >= 16) under
#: simulated protanopia, deuteranopia and tritanopia, where matplotlib's default falls to 5.
OKABE_ITO = ("#0072B2", "#E69F00", "#D55E00", "#56B4E9", "#009E73", "#CC79A7", "#000000",
             "#F0E442")
_SOLID = ("data-source", "cache-read", "cache-write", "cache-ram", "checkpoint", "offload",
          "other", "cache-gc")
_DASHED = ("cache-recovery", "cache-fsck", "cache-meta", "syscall")
#: Offload's streams: mostly the colour of ``offload``, told apart by line and hatch.
_OFFLOAD = {"offload-read": ("offload", "--", "//"), "offload-write": ("offload", "-.", "\\\\"),
            "offload-act-read": ("offload", ":", "oo"), "offload-act-write": ("other", "-.", "xx")}


def class_style(name: str) -> tuple[str, str, str]:
    """(colour, line style, bar hatch) of a class, the same in every plot. Eight colours,
    so the rarer classes reuse one with a dashed line (hatched bar); other names are dotted."""
    if name in _SOLID:
        return OKABE_ITO[_SOLID.index(name)], "-", ""
    if name in _DASHED:
        return OKABE_ITO[1 + _DASHED.index(name)], "--", "//"
    if name in _OFFLOAD:
        like, line, hatch = _OFFLOAD[name]
        return OKABE_ITO[_SOLID.index(like)], line, hatch
    return OKABE_ITO[sum(map(ord, name)) % len(OKABE_ITO)], ":", ".."


def size_histogram(trace: Trace) -> Plot:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    data = data_mask(trace) & (trace.size > 0)
    if not data.any():
        _empty(ax, "no read/write events")
    else:
        exp = np.floor(np.log2(trace.size[data])).astype(int)
        lo, hi = int(exp.min()), int(exp.max())
        bins = np.arange(lo, hi + 1)
        series = []
        for code, name in _classes(trace):
            for op in ("read", "write"):
                if op not in trace.ops:
                    continue
                m = data & (trace.cls == code) & (trace.op == trace.ops.index(op))
                if m.any():
                    e = np.floor(np.log2(trace.size[m])).astype(int)
                    series.append((name, op, np.bincount(e - lo, minlength=len(bins))))
        width = 0.8 / max(len(series), 1)
        for i, (name, op, counts) in enumerate(series):
            colour, _, hatch = class_style(name)
            # reads filled, writes outlined: the class colour stays the class's
            ax.bar(np.arange(len(bins)) + i * width, counts, width, label=f"{name} {op}",
                   color=colour if op == "read" else "white", edgecolor=colour,
                   hatch=hatch or (None if op == "read" else "xx"))
        ax.set_xticks(np.arange(len(bins)) + 0.4 - width / 2)
        ax.set_xticklabels([_size_label(2.0 ** b) for b in bins], rotation=45, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("operations")
        ax.set_xlabel("request size (power-of-two bin: [2^k, 2^(k+1)))")
        ax.legend(fontsize=7, ncol=2)
    return ("Request sizes", "Operations per request-size bin, per class and op (reads "
            "filled, writes cross-hatched in the class's colour).", _png(fig))


def rw_mix(summary: dict[str, Any]) -> Plot:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3))
    classes = [(k, v) for k, v in summary["classes"].items() if v["bytes"] > 0]
    if not classes:
        _empty(ax, "no bytes moved")
    else:
        names = [k for k, _ in classes]
        r = np.array([v["read_bytes"] for _, v in classes]) / 2**20
        w = np.array([v["write_bytes"] for _, v in classes]) / 2**20
        ax.barh(names, r, label="read", color="#4c78a8")
        ax.barh(names, w, left=r, label="write", color="#f58518")
        ax.set_xlabel("MiB")
        ax.legend(fontsize=8)
    return ("Read/write mix", "Bytes read and written per class.", _png(fig))


def seq_random(summary: dict[str, Any]) -> Plot:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3))
    classes = [(k, v) for k, v in summary["classes"].items() if v["ops"] > 0]
    if not classes:
        _empty(ax, "no read/write events")
    else:
        names = [k for k, _ in classes]
        seq = np.array([v["seq_fraction"] for _, v in classes])
        ax.barh(names, seq, label="sequential", color="#54a24b")
        ax.barh(names, 1 - seq, left=seq, label="random", color="#e45756")
        ax.set_xlim(0, 1)
        ax.set_xlabel("fraction of operations")
        ax.legend(fontsize=8)
    return ("Sequential vs random",
            "As the device sees it: per file and direction, whatever process made them, an "
            "op is sequential when it starts where one of the 32 most recently continued "
            "streams ends, or where an op that started while it was in flight ends (writes "
            "in flight that start in any order are sequential).", _png(fig))


def over_time(trace: Trace) -> tuple[Plot, Plot]:
    plt = _plt()
    figs = [plt.subplots(figsize=(9, 3.2)) for _ in range(2)]
    data = data_mask(trace)
    if not data.any():
        for _, ax in figs:
            _empty(ax, "no read/write events")
    else:
        t0 = float(trace.ts_us[data].min())
        span = (float((trace.ts_us[data] + trace.dur_us[data]).max()) - t0) / 1e6
        bin_s, nbins = time_bins(span)
        x = (t0 - trace_start_us(trace)) / 1e6 + np.arange(nbins) * bin_s
        moved = np.where(trace.result > 0, trace.result, 0)
        for code, name in _classes(trace):
            m = data & (trace.cls == code)
            if m.any():
                mb, iops = rates(trace.ts_us[m], moved[m], t0, bin_s, nbins)
                colour, style, _ = class_style(name)
                figs[0][1].plot(x, mb, label=name, color=colour, linestyle=style)
                figs[1][1].plot(x, iops, label=name, color=colour, linestyle=style)
        for (_, ax), ylabel in zip(figs, ("MB/s", "IOPS"), strict=True):
            ax.set_xlabel(f"seconds since the trace's start (bins of {bin_s * 1000:.3g} ms)")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=7)
    return (("Bandwidth over time", "MB/s per class (10^6 bytes).", _png(figs[0][0])),
            ("IOPS over time", "Operations per second per class.", _png(figs[1][0])))


_PERCENTILES = (50, 90, 99, 99.9)


def latency(trace: Trace) -> Plot:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.2))
    data = data_mask(trace)
    rows: list[tuple[str, list[float], int]] = []
    for code, name in _classes(trace):
        for op in ("read", "write"):
            if op in trace.ops:
                m = data & (trace.cls == code) & (trace.op == trace.ops.index(op))
                if m.any():
                    d = trace.dur_us[m]
                    # a percentile that the ops cannot support is left out (nan: no bar)
                    rows.append((f"{name} {op}", [nearest_rank(d, p) if len(d) >= enough_ops(p)
                                                  else math.nan for p in _PERCENTILES], len(d)))
    caption = "Per class and op (nearest-rank percentiles)."
    if not rows:
        _empty(ax, "no read/write events")
    else:
        width = 0.2
        for j, p in enumerate(_PERCENTILES):
            heights = [r[1][j] if math.isnan(r[1][j]) else max(r[1][j], 0.01) for r in rows]
            ax.bar(np.arange(len(rows)) + j * width, heights, width, label=f"p{p:g}",
                   color=OKABE_ITO[j])
        ax.set_xticks(np.arange(len(rows)) + 0.3)
        ax.set_xticklabels([f"{r[0]}\n({r[2]:,} ops)" for r in rows], rotation=20, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("microseconds")
        ax.legend(fontsize=8)
        short = [r[0] for r in rows if any(math.isnan(v) for v in r[1])]
        if short:
            caption += (" A percentile is drawn only where at least one op lies above it (p90: "
                        "10 ops, p99: 100, p99.9: 1,000); too few ops for the missing bars of: "
                        + ", ".join(short) + ".")
    return ("Latency percentiles", caption, _png(fig))


def top_files(summary: dict[str, Any]) -> Plot:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.4))
    files = summary["top_files"]
    if not files:
        _empty(ax, "no bytes moved")
    else:
        labels = [_file_label(f) for f in files][::-1]
        ax.barh(labels, [f["bytes"] / 2**20 for f in files][::-1],
                color=[_MEMORY if f["fs"] in MEMORY_FS else _STORAGE for f in files][::-1])
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("MiB")
    return ("Top files by bytes", "Files that moved the most bytes (all classes), with the "
            "filesystem each lives on; orange: files in memory (tmpfs, ramfs), blue: the "
            "rest.", _png(fig))


_STORAGE, _MEMORY = "#0072B2", "#E69F00"


def _file_label(f: dict[str, Any], width: int = 60) -> str:
    """``[fs] path`` with the middle of a long path elided: the start (/dev/shm, the cache
    directory) tells files apart as much as the end does."""
    path = f["file"]
    if len(path) > width:
        keep = (width - 3) // 2
        path = path[:keep] + "..." + path[-(width - 3 - keep):]
    return f"[{f['fs']}] {path}" if f.get("fs") else path


def processes(trace: Trace) -> Plot:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.2))
    rb, wb = PROC_FIELDS.index("read_bytes"), PROC_FIELDS.index("write_bytes")
    rc, wc = PROC_FIELDS.index("rchar"), PROC_FIELDS.index("wchar")
    drawn = 0
    t0 = trace_start_us(trace)
    for pid, (ts, vals) in sorted(trace.proc.items()):
        if len(ts) < 2:
            continue
        dt, step = counter_steps(ts, vals, trace.proc_source.get(pid))  # NaN between files
        dt[dt <= 0] = np.nan
        storage = (step[:, rb] + step[:, wb]) / 1e6 / dt
        syscalls = (step[:, rc] + step[:, wc]) / 1e6 / dt
        if np.nansum(syscalls) <= 0 and np.nansum(storage) <= 0:
            continue
        x = (ts[1:] - t0) / 1e6
        line = ax.plot(x, syscalls, label=f"pid {pid} read+write calls")[0]
        ax.plot(x, storage, linestyle="--", color=line.get_color(),
                label=f"pid {pid} storage")
        drawn += 1
        if drawn >= 8:
            break
    if not drawn:
        _empty(ax, "no /proc samples with I/O (only `lcache trace` samples /proc)")
    else:
        ax.set_xlabel("seconds since the trace's start")
        ax.set_ylabel("MB/s")
        ax.legend(fontsize=6, ncol=2)
    return ("Bandwidth per process (/proc/<pid>/io)",
            "Solid: bytes through read/write calls (rchar+wchar, page cache included); "
            "dashed: bytes the process caused the block layer to move (read_bytes+write_bytes).",
            _png(fig))


def devices(trace: Trace) -> Plot:
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
    drawn = 0
    t0 = trace_start_us(trace)
    for dev, (ts, vals) in sorted(trace.disks.items()):
        if len(ts) < 2:
            continue
        dt, step = counter_steps(ts, vals, trace.disk_source.get(dev))  # NaN between files
        dt[dt <= 0] = np.nan
        x = (ts[1:] - t0) / 1e6
        ax.plot(x, (step[:, 1] + step[:, 3]) * SECTOR / 1e6 / dt, label=dev)
        ax2.plot(x, (step[:, 0] + step[:, 2]) / dt, label=dev)
        drawn += 1
    grid = next((ts for ts, _ in sorted(trace.disks.values(), key=lambda d: -len(d[0]))), None)
    if drawn and trace.proc and grid is not None:
        # set against the devices: what share of their traffic the traced job made
        dt = np.diff(grid) / 1e6
        dt[dt <= 0] = np.nan
        ax.plot((grid[1:] - t0) / 1e6, np.diff(traced_storage_bytes(trace, grid)) / 1e6 / dt,
                color="#000000", linestyle="--", label="traced processes (all devices)")
    if not drawn:
        _empty(ax, "no /proc/diskstats samples")
        _empty(ax2, "no /proc/diskstats samples")
    else:
        ax.set_ylabel("MB/s")
        ax2.set_ylabel("IOPS")
        for a in (ax, ax2):
            a.set_xlabel("seconds since the trace's start")
            a.legend(fontsize=7)
    return ("Devices (/proc/diskstats)", "Bandwidth and IOPS per block device (whole disks). "
            "Dashed black: the bytes the traced processes made the block layer move "
            "(/proc/<pid>/io read_bytes + write_bytes, all devices together); the rest of a "
            "device's traffic is other jobs' (or the kernel's).", _png(fig))


def all_plots(trace: Trace, summary: dict[str, Any]) -> list[Plot]:
    bw, iops = over_time(trace)
    return [size_histogram(trace), rw_mix(summary), seq_random(summary), bw, iops,
            latency(trace), top_files(summary), processes(trace), devices(trace)]
