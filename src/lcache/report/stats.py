"""Summary statistics of a trace (the content of summary.json; definitions in docs/trace.md).

Definitions, per class, over its data operations (``read`` and ``write``):
- ``ops``: data operations; ``other_ops``: the rest (fsync, open...); ``errors``: failed ops.
- ``bytes``/``read_bytes``/``write_bytes``: bytes transferred (the result of successful ops).
- ``size_p50``/``size_p99``: nearest-rank percentiles of the requested sizes.
- ``seq_fraction``: of the ops with a known offset, those the device sees as sequential.
  Per file and direction (read or write), whatever process made the ops, the ops are taken
  in start order and the ends (offset + bytes transferred) of the ``STREAMS`` most recently
  continued streams are kept: an op that starts at one of them continues that stream and
  is sequential, as is an op that starts where another op ends that started while it was in
  flight. Several writes in flight in one file (a checkpoint) or several streams through
  one file are sequential however their starts interleave; the first op of a file and
  direction is not.
- ``MBps_mean``: bytes / 10^6 over the class's active span (first start to last end);
  ``None`` where the span has no length (ops of no duration at one instant).
- ``MBps_peak``: the highest rate over equal time bins that tile the span (100 bins, or one per
  millisecond for spans under 0.1 s), each op counted in the bin where it starts; it is never
  below ``MBps_mean``.
- ``lat_p50_us``/``lat_p99_us``: nearest-rank percentiles of op durations in microseconds.
- A p99 (``size_p99``, ``lat_p99_us``) is ``None`` for a class of fewer than 100 ops: no op
  would lie above it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import numpy as np
import numpy.typing as npt

from lcache.report.load import DISK_FIELDS, PROC_FIELDS, Trace, in_memory

SECTOR = 512


def nearest_rank(values: npt.NDArray[Any], p: float) -> float:
    """The nearest-rank percentile: the smallest value with at least p% of values <= it."""
    if len(values) == 0:
        return 0.0
    ordered = np.sort(values)
    k = max(1, math.ceil(p / 100.0 * len(ordered)))
    return float(ordered[k - 1])


def enough_ops(p: float) -> int:
    """Fewest ops for which percentile ``p`` is given: at least one op must lie above it
    (p90: 10, p99: 100, p99.9: 1,000); with 3 ops a "p99.9" is only the slowest op."""
    return math.ceil(100 / (100 - p) - 1e-9) if p >= 90 else 1


def data_mask(trace: Trace) -> npt.NDArray[np.bool_]:
    codes = [i for i, name in enumerate(trace.ops) if name in ("read", "write")]
    return np.isin(trace.op, codes)


#: Streams followed per file and direction: a device queue's worth. Random 4 KiB reads in a
#: 100 MiB file meet one of 32 stream ends by chance 32 / 25,600 of the time; up to 32
#: streams interleaved through one file still read as sequential.
STREAMS = 32


def sequential(trace: Trace, mask: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    """Per row of ``mask``: whether the device sees the op as sequential (module doc).

    "Starts where the previous op in start order ended" called a checkpoint written as
    8 writes in flight 100% random: the threads start their writes in any order."""
    idx = np.flatnonzero(mask & (trace.offset >= 0))
    seq = np.zeros(len(trace), dtype=bool)
    if len(idx) == 0:
        return seq
    order = idx[np.lexsort((trace.ts_us[idx], trace.op[idx], trace.file[idx]))]
    off, got = trace.offset[order], trace.result[order]
    end = np.where(got > 0, off + got, -1)  # an op that moved nothing continues nothing
    start, stop = trace.ts_us[order], trace.ts_us[order] + trace.dur_us[order]
    group = trace.file[order].astype(np.int64) * (len(trace.ops) + 1) + trace.op[order]
    hit = np.zeros(len(order), dtype=bool)
    # An op that started after this one, while it was in flight, and ends where it starts.
    for lag in range(1, min(STREAMS, len(order) - 1) + 1):
        hit[:-lag] |= ((group[lag:] == group[:-lag]) & (end[lag:] == off[:-lag])
                       & (start[lag:] < stop[:-lag]))
    # A stream that started before: the ends of the STREAMS most recently continued ones.
    streams: OrderedDict[int, None] = OrderedDict()
    previous = -1
    for k, (g, o, e) in enumerate(zip(group.tolist(), off.tolist(), end.tolist(),
                                      strict=True)):
        if g != previous:
            streams.clear()
            previous = g
        if o in streams:
            hit[k] = True
            del streams[o]
        if e >= 0:
            streams[e] = None
            streams.move_to_end(e)
            if len(streams) > STREAMS:
                streams.popitem(last=False)
    seq[order] = hit
    return seq


def trace_start_us(trace: Trace) -> float:
    """The one time origin of every plot: the first event or /proc sample of the trace."""
    starts = [float(trace.ts_us.min())] if len(trace) else []
    starts += [float(ts.min()) for ts, _ in (*trace.proc.values(), *trace.disks.values())
               if len(ts)]
    return min(starts, default=0.0)


def event_source(trace: Trace) -> npt.NDArray[np.int32]:
    """Per event, the trace file it came from (all from one where the loader did not say)."""
    return trace.source if len(trace.source) == len(trace) else np.zeros(len(trace), np.int32)


class Timeline:
    """The time of some events with the gaps between trace files taken out: two runs traced
    minutes apart and given to one report are not minutes of I/O (a 198 s span for two runs
    of under a second each). Each file's events span first start to last end; files that
    overlap in time (ranks of one job) share it."""

    def __init__(self, start_us: npt.NDArray[np.float64], end_us: npt.NDArray[np.float64],
                 source: npt.NDArray[np.int32]) -> None:
        spans = sorted((float(start_us[source == k].min()), float(end_us[source == k].max()))
                       for k in np.unique(source))
        merged: list[list[float]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts = np.array([lo for lo, _ in merged], np.float64)
        ends = np.array([hi for _, hi in merged], np.float64)
        # the time taken out before each interval, and where the squeezed time begins
        self.cut = np.concatenate([[0.0], np.cumsum(self.starts[1:] - ends[:-1])]) \
            + (self.starts[0] if len(merged) else 0.0)
        self.length_us = float((ends - self.starts).sum())

    def squeeze(self, t_us: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """Times as microseconds from the first start, the gaps before them taken out."""
        i = np.clip(np.searchsorted(self.starts, t_us, side="right") - 1, 0, None)
        return t_us - self.cut[i]


def counter_steps(ts_us: npt.NDArray[np.float64], vals: npt.NDArray[np.int64],
                  source: npt.NDArray[np.int32] | None
                  ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Per interval between consecutive /proc samples of one series: (seconds, increase of
    each counter).

    An interval between two trace files is NaN seconds and no increase: what a disk did
    between two recordings is no part of either (two runs minutes apart read as 839 MiB
    for 10 MB traced). A counter that goes down was restarted (a device removed and added
    again, a pid reused): the interval's increase is the new value, as Prometheus's rate()
    takes it, never a negative byte count (-562,949,953,370,112 bytes were printed)."""
    dt = np.diff(ts_us) / 1e6
    step = np.diff(vals, axis=0)
    step = np.where(step < 0, vals[1:], step)
    if source is not None and len(source) == len(ts_us):
        apart = np.diff(source) != 0
        dt[apart] = np.nan
        step[apart] = 0
    return dt, step


def time_bins(span_s: float) -> tuple[float, int]:
    """(bin width in seconds, number of bins): equal bins that tile the span exactly."""
    nbins = min(100, max(1, int(span_s / 0.001)))
    return (span_s / nbins if span_s > 0 else 0.001), nbins


def rates(ts_us: npt.NDArray[np.float64], nbytes: npt.NDArray[np.int64], t0_us: float,
          bin_s: float, nbins: int) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(MB/s, IOPS) per bin, each op counted in the bin where it starts."""
    b = np.clip(((ts_us - t0_us) / 1e6 / bin_s).astype(np.int64), 0, max(nbins - 1, 0))
    mb = np.bincount(b, weights=nbytes.astype(np.float64), minlength=nbins) / 1e6 / bin_s
    iops = np.bincount(b, minlength=nbins) / bin_s
    return mb, iops


def _class_stats(trace: Trace, rows: npt.NDArray[np.bool_], data: npt.NDArray[np.bool_],
                 seq: npt.NDArray[np.bool_], read_code: int, write_code: int) -> dict[str, Any]:
    d = rows & data
    ok = d & (trace.result >= 0)
    moved = np.where(ok, trace.result, 0)
    known = d & (trace.offset >= 0)
    reads, writes = d & (trace.op == read_code), d & (trace.op == write_code)
    n = int(d.sum())
    out: dict[str, Any] = {
        "ops": n, "read_ops": int(reads.sum()), "write_ops": int(writes.sum()),
        "other_ops": int((rows & ~data).sum()), "errors": int((d & (trace.result < 0)).sum()),
        "bytes": int(moved[d].sum()), "read_bytes": int(moved[reads].sum()),
        "write_bytes": int(moved[writes].sum()),
        "size_p50": int(nearest_rank(trace.size[d], 50)),
        "size_p99": int(nearest_rank(trace.size[d], 99)) if n >= enough_ops(99) else None,
        "seq_fraction": float(seq[known].sum() / known.sum()) if known.any() else 0.0,
        "MBps_mean": 0.0, "MBps_peak": 0.0,
        "lat_p50_us": round(nearest_rank(trace.dur_us[d], 50), 3),
        "lat_p99_us": (round(nearest_rank(trace.dur_us[d], 99), 3) if n >= enough_ops(99)
                       else None),
    }
    if n:
        time = Timeline(trace.ts_us[d], trace.ts_us[d] + trace.dur_us[d], event_source(trace)[d])
        span_s = time.length_us / 1e6
        if span_s > 0:
            out["MBps_mean"] = round(out["bytes"] / 1e6 / span_s, 3)
            bin_s, nbins = time_bins(span_s)
            mb, _ = rates(time.squeeze(trace.ts_us[d]), moved[d], 0.0, bin_s, nbins)
            out["MBps_peak"] = round(float(mb.max()), 3)
        else:  # ops of no duration at one instant: a rate over no time is undefined, not 0
            out["MBps_mean"] = out["MBps_peak"] = None
        out["span_s"] = round(span_s, 6)
    return out


def summarize_trace(trace: Trace, top_files: int = 10) -> dict[str, Any]:
    """The summary.json content of a loaded trace."""
    data = data_mask(trace)
    seq = sequential(trace, data)
    read_code = trace.ops.index("read") if "read" in trace.ops else -1
    write_code = trace.ops.index("write") if "write" in trace.ops else -1
    classes: dict[str, Any] = {}
    for code, name in sorted(enumerate(trace.classes), key=lambda c: c[1]):
        classes[name] = _class_stats(trace, trace.cls == code, data, seq, read_code,
                                     write_code)
    # The total leaves out strace's events: they are the same bytes seen from the kernel side.
    lib = np.ones(len(trace), dtype=bool)
    if "syscall" in trace.classes:
        lib = trace.cls != trace.classes.index("syscall")
    moved = np.where(data & (trace.result >= 0), trace.result, 0)
    per_file = np.bincount(trace.file, weights=moved.astype(np.float64),
                           minlength=len(trace.files)) if len(trace) else np.zeros(0)
    ranked = [int(i) for i in np.argsort(-per_file, kind="stable")[:top_files]
              if per_file[i] > 0]
    where = [file_system(trace, i) for i in range(len(trace.files))]
    files = []
    for i in ranked:
        rows = trace.file == i
        files.append({"file": trace.files[i], "bytes": int(per_file[i]),
                      "ops": int((rows & data).sum()),
                      "classes": sorted({trace.classes[c] for c in np.unique(trace.cls[rows])}),
                      "mount": where[i]["mount"], "fs": where[i]["fs"]})
    span = 0.0
    if len(trace):
        span = Timeline(trace.ts_us, trace.ts_us + trace.dur_us,
                        event_source(trace)).length_us / 1e6
    return {
        "trace": {"files": trace.paths, "events": trace.events, "io_events": len(trace),
                  "ignored_events": trace.ignored, "repeated_events": trace.repeats,
                  "span_s": round(span, 6),
                  "processes": len(set(trace.pid.tolist()) | set(trace.proc)),
                  "unfinished_processes": [pid for _, pid in trace.unfinished]},
        "classes": classes,
        "total": _class_stats(trace, lib, data, seq, read_code, write_code),
        "top_files": files,
        "filesystems": _fs_summary(trace, where, data, lib, moved),
        "processes": _proc_summary(trace),
        "devices": _disk_summary(trace),
        "traced_vs_devices": _traced_vs_devices(trace),
    }


def unfinished_note(summary: dict[str, Any]) -> str | None:
    """The warning for processes that started recording and never wrote their end marker
    (``kill -9``, ``os._exit`` without a flush); ``None`` for a trace without (older traces
    have no markers, so nothing is known)."""
    pids = summary["trace"].get("unfinished_processes") or []
    if not pids:
        return None
    return (f"events may be missing for {len(pids)} process(es) (pids "
            f"{', '.join(str(p) for p in pids)}): killed before they flushed")


def file_system(trace: Trace, i: int) -> dict[str, Any]:
    """Where file ``i`` lives: ``mount``, ``fs``, ``dev`` and ``memory`` (tmpfs, ramfs)."""
    path, w = trace.files[i], trace.file_where[i] if trace.file_where else {}
    memory = in_memory(path, w)
    if "mnt" in w:
        return {"mount": w["mnt"], "fs": w.get("fs", ""), "dev": w["dev"], "memory": memory}
    if memory:  # an older trace: known from the path alone
        return {"mount": "/dev/shm", "fs": "tmpfs", "dev": "", "memory": True}
    unknown = ("(remote)" if "://" in path else "(unknown)" if path.startswith("/")
               else "(not a file)")
    return {"mount": unknown, "fs": "", "dev": w.get("dev", ""), "memory": False}


def _fs_summary(trace: Trace, where: list[dict[str, Any]], data: npt.NDArray[np.bool_],
                lib: npt.NDArray[np.bool_], moved: npt.NDArray[np.int64]) -> dict[str, Any]:
    """Bytes per filesystem the files of the events live on. ``ops`` and the byte counts
    leave out strace's events, as ``total`` does; ``classes`` has every class's bytes."""
    out: dict[str, Any] = {}
    read = trace.ops.index("read") if "read" in trace.ops else -1
    keys = [f"{w['mount']} ({w['dev']})" if w["dev"] else w["mount"] for w in where]
    for key in sorted(set(keys)):
        rows = data & np.isin(trace.file, [i for i, k in enumerate(keys) if k == key])
        if not rows.any():
            continue
        w = where[keys.index(key)]
        reads = rows & lib & (trace.op == read)
        writes = rows & lib & (trace.op != read)
        per_class = np.bincount(trace.cls[rows], weights=moved[rows].astype(np.float64),
                                minlength=len(trace.classes))
        out[key] = {"mount": w["mount"], "fs": w["fs"], "dev": w["dev"], "memory": w["memory"],
                    "ops": int((rows & lib).sum()), "read_bytes": int(moved[reads].sum()),
                    "write_bytes": int(moved[writes].sum()),
                    "classes": {trace.classes[c]: int(per_class[c])
                                for c in np.argsort(-per_class, kind="stable")
                                if per_class[c] > 0}}
    return out


def _proc_summary(trace: Trace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rb, wb = PROC_FIELDS.index("read_bytes"), PROC_FIELDS.index("write_bytes")
    rc, wc = PROC_FIELDS.index("rchar"), PROC_FIELDS.index("wchar")
    for pid, (ts, vals) in sorted(trace.proc.items()):
        dt, step = counter_steps(ts, vals, trace.proc_source.get(pid))
        d = step.sum(axis=0) if len(step) else np.zeros(len(PROC_FIELDS), np.int64)
        out[str(pid)] = {"name": trace.process_names.get(pid, ""), "samples": len(ts),
                         "read_bytes": int(d[rb]), "write_bytes": int(d[wb]),
                         "rchar": int(d[rc]), "wchar": int(d[wc]),
                         "seconds": round(float(np.nansum(dt)), 3)}
    return out


def _disk_summary(trace: Trace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dev, (ts, vals) in sorted(trace.disks.items()):
        # per trace file: the counters' increase and the seconds sampled, summed over files
        dt, steps = counter_steps(ts, vals, trace.disk_source.get(dev))
        d = steps.sum(axis=0) if len(steps) else np.zeros(len(DISK_FIELDS), np.int64)
        secs = float(np.nansum(dt))
        f = {k: int(d[i]) for i, k in enumerate(DISK_FIELDS)}
        ops = f["reads"] + f["writes"]
        peak_mb: float | None = None  # no interval with a length: no rate (not 0)
        peak_iops: float | None = None
        # Two samples at one time (a repeated sample) make an interval of no length: it is
        # skipped, not taken for a reason to give no peak at all.
        timed = dt > 0  # False for NaN: an interval between two files
        if timed.any():
            step = steps[timed]
            mbps = (step[:, 1] + step[:, 3]) * SECTOR / 1e6 / dt[timed]
            iops = (step[:, 0] + step[:, 2]) / dt[timed]
            peak_mb, peak_iops = float(mbps.max()), float(iops.max())
        out[dev] = {"read_bytes": f["read_sectors"] * SECTOR,
                    "write_bytes": f["write_sectors"] * SECTOR,
                    "reads": f["reads"], "writes": f["writes"], "seconds": round(secs, 3),
                    "MBps_mean": round((f["read_sectors"] + f["write_sectors"]) * SECTOR / 1e6
                                       / secs, 3) if secs > 0 else None,
                    "MBps_peak": None if peak_mb is None else round(peak_mb, 3),
                    "IOPS_mean": round(ops / secs, 1) if secs > 0 else None,
                    "IOPS_peak": None if peak_iops is None else round(peak_iops, 1),
                    "busy_fraction": round(f["io_ms"] / 1000 / secs, 4) if secs > 0 else None}
    return out


def traced_storage_bytes(trace: Trace, grid: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Cumulative bytes the traced processes made the block layer move (read_bytes +
    write_bytes of /proc/<pid>/io, summed over processes) at the times ``grid``."""
    rb, wb = PROC_FIELDS.index("read_bytes"), PROC_FIELDS.index("write_bytes")
    total = np.zeros(len(grid))
    for pid, (ts, vals) in trace.proc.items():
        _, step = counter_steps(ts, vals, trace.proc_source.get(pid))
        cum = np.concatenate([[0.0], np.cumsum(step[:, rb] + step[:, wb], dtype=np.float64)])
        order = np.argsort(ts, kind="stable")  # files that overlap in time: interp wants order
        total += np.interp(grid, ts[order], cum[order])
    return total


def _traced_vs_devices(trace: Trace) -> dict[str, Any]:
    """How much of the devices' traffic the traced job made: a device may be busy with
    other jobs' I/O. /proc/<pid>/io does not say which device, so this is over all devices."""
    rb, wb = PROC_FIELDS.index("read_bytes"), PROC_FIELDS.index("write_bytes")
    traced = sum(int(step[:, rb].sum() + step[:, wb].sum())
                 for pid, (ts, v) in trace.proc.items()
                 for step in [counter_steps(ts, v, trace.proc_source.get(pid))[1]])
    rs, ws = DISK_FIELDS.index("read_sectors"), DISK_FIELDS.index("write_sectors")
    device = sum(int(step[:, rs].sum() + step[:, ws].sum()) * SECTOR
                 for dev, (ts, v) in trace.disks.items()
                 for step in [counter_steps(ts, v, trace.disk_source.get(dev))[1]])
    share = round(traced / device, 4) if device > 0 and trace.proc else None
    return {"traced_bytes": traced, "device_bytes": device, "share": share}


def traffic_sentence(tv: dict[str, Any]) -> str | None:
    """The traced job's part of the devices' traffic (``traced_vs_devices``) in words; a
    share above 1 is no share: the devices moved less than the job asked of the block layer
    while the trace ran."""
    if tv["share"] is None:
        return None
    head = (f"The traced processes made the block layer move {tv['traced_bytes']:,} bytes; "
            f"the devices moved {tv['device_bytes']:,} in the same time")
    if tv["share"] <= 1:
        return (f"{head}: the traced job made {tv['share']:.1%} of the devices' traffic (the "
                "rest is other jobs' or the kernel's).")
    return (f"{head}, {tv['share']:,.1f} times less: the job's dirty pages were written back "
            "after the trace ended, or went to a device /proc/diskstats does not list; its "
            "part of the devices' traffic cannot be told.")
