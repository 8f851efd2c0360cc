"""Fit a trace: per class group (data, cache, checkpoint, offload) the bytes per step, request
sizes, read/write mix, sequential fraction and concurrency; the dataset; the checkpoints.

Every figure comes from the report's loader and statistics (``lcache.report``), never from
parsing trace files here. What cannot be fitted is listed in ``unfitted`` with the reason,
and the rest is still fitted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from lcache.advise.runs import SAMPLE_CLASSES, split_runs
from lcache.advise.steps import Steps, from_markers, from_rhythm, split_idle
from lcache.report.load import Trace
from lcache.report.stats import Timeline, data_mask, event_source, nearest_rank, sequential
from lcache.store.record import HEADER_SIZE

#: The trace classes behind each group the advice speaks of.
GROUPS: dict[str, tuple[str, ...]] = {
    "data": ("data-source",),
    "cache": ("cache-read", "cache-write", "cache-ram", "cache-gc", "cache-meta",
              "cache-recovery", "cache-fsck"),
    "checkpoint": ("checkpoint",),
    "offload": ("offload",),
}
MARKER = "step"

Mask = npt.NDArray[np.bool_]


def _codes(names: list[str], wanted: tuple[str, ...]) -> list[int]:
    return [i for i, n in enumerate(names) if n in wanted]


def _rows(trace: Trace, classes: tuple[str, ...], op: str | None = None) -> Mask:
    rows = np.isin(trace.cls, _codes(trace.classes, classes))
    if op is not None:
        rows &= trace.op == (trace.ops.index(op) if op in trace.ops else -1)
    return rows


def _in_flight(start: npt.NDArray[np.float64], end: npt.NDArray[np.float64]) -> tuple[float,
                                                                                       int]:
    """(mean ops in flight while any is, most at once)."""
    if not len(start):
        return 0.0, 0
    t = np.concatenate([start, end])
    d = np.concatenate([np.ones(len(start)), -np.ones(len(end))])
    order = np.lexsort((d, t))  # an end before a start at the same instant
    level = np.cumsum(d[order])
    dt = np.diff(t[order])
    busy = float(dt[level[:-1] > 0].sum())
    mean = float((level[:-1] * dt).sum() / busy) if busy > 0 else 1.0
    return round(mean, 3), int(level.max())


def _threads(trace: Trace, rows: Mask) -> int:
    """Most threads doing this I/O at once (each thread from its first op to its last):
    a loader's reader threads of one epoch, not all the epochs' threads together."""
    key = trace.pid[rows] * (1 << 32) + trace.tid[rows]
    start = trace.ts_us[rows]
    end = start + trace.dur_us[rows]
    spans = [(float(start[key == k].min()), float(end[key == k].max())) for k in np.unique(key)]
    return _in_flight(np.array([a for a, _ in spans]), np.array([b for _, b in spans]))[1]


def _span_s(trace: Trace, rows: Mask) -> float:
    """Seconds from first start to last end of ``rows`` within each trace file, files that
    overlap in time sharing one span: as the report counts spans (its ``Timeline``), so
    traces recorded minutes apart do not spread their bytes over the gap."""
    if not rows.any():
        return 0.0
    return Timeline(trace.ts_us[rows], (trace.ts_us + trace.dur_us)[rows],
                    event_source(trace)[rows]).length_us / 1e6


def _pow2_histogram(sizes: npt.NDArray[np.int64]) -> dict[str, int]:
    """Requests per power-of-two size bin, keyed by the bin's lower bound in bytes (the
    report's request-size plot uses the same bins)."""
    if not len(sizes):
        return {}
    bins = np.floor(np.log2(np.maximum(sizes, 1))).astype(np.int64)
    values, counts = np.unique(bins, return_counts=True)
    return {str(1 << int(v)): int(c) for v, c in zip(values, counts, strict=True)}


def _group(trace: Trace, rows: Mask, seq: Mask, steps: int) -> dict[str, Any]:
    data = rows & data_mask(trace)
    ok = data & (trace.result >= 0)
    moved = np.where(ok, trace.result, 0)
    read = data & (trace.op == (trace.ops.index("read") if "read" in trace.ops else -1))
    known = data & (trace.offset >= 0)
    rb, wb = int(moved[read].sum()), int(moved[data & ~read].sum())
    mean, peak = _in_flight(trace.ts_us[data], trace.ts_us[data] + trace.dur_us[data])
    span = _span_s(trace, data)
    return {
        "ops": int(data.sum()), "read_bytes": rb, "write_bytes": wb,
        "read_bytes_per_step": round(rb / steps, 1) if steps else None,
        "write_bytes_per_step": round(wb / steps, 1) if steps else None,
        "read_fraction": round(rb / (rb + wb), 4) if rb + wb else None,
        "size_p50": int(nearest_rank(trace.size[data], 50)),
        "size_p90": int(nearest_rank(trace.size[data], 90)),
        "size_histogram": _pow2_histogram(trace.size[data]),
        "seq_fraction": round(float(seq[known].mean()), 4) if known.any() else None,
        "concurrency_mean": mean, "concurrency_max": peak,
        "busy_s": round(float(trace.dur_us[data].sum()) / 1e6, 6),
        "threads": _threads(trace, data),
        "MBps_mean": round((rb + wb) / 1e6 / span, 3) if span > 0 else None,
    }


def _dataset(trace: Trace, reads: Mask) -> dict[str, Any] | None:
    """Distinct samples read from the source (by file and offset): one epoch of them. Cache
    hits are left out: the store reads several records in one request."""
    if not reads.any():
        return None
    key = trace.file[reads].astype(np.int64) * (1 << 40) + np.maximum(trace.offset[reads], 0)
    uniq, first, counts = np.unique(key, return_index=True, return_counts=True)
    sizes = trace.size[reads][first].astype(np.float64)
    files = len(set(trace.file[reads].tolist()))
    whole = bool((trace.offset[reads] <= 0).all())
    out = {
        "samples": len(uniq), "bytes": int(sizes.sum()), "files": files,
        "samples_per_file": max(1, round(len(uniq) / files)),
        "whole_files": whole,
        "record_bytes_p50": int(nearest_rank(sizes, 50)),
        "record_bytes_mean": round(float(sizes.mean()), 1),
        "record_bytes_stdev": round(float(sizes.std()), 1),
        "record_bytes_max": int(sizes.max()),
        "epochs_seen": round(float(counts.mean()), 3),
        "source_reads": int(reads.sum()),
    }
    return out


def _checkpoints(trace: Trace, run: Mask, steps: Steps, sample_ts: npt.NDArray[np.float64],
                 ) -> dict[str, Any] | None:
    """Checkpoint saves (and loads) of the run: writes of class checkpoint grouped by the
    training that happens between them (or, without training, by pauses)."""
    rows = _rows(trace, ("checkpoint",)) & run
    writes = rows & _rows(trace, ("checkpoint",), "write")
    if not writes.any():
        return None
    syncs = rows & np.isin(trace.op, _codes(trace.ops, ("fsync", "fdatasync")))
    reads = rows & _rows(trace, ("checkpoint",), "read")
    order = np.argsort(trace.ts_us[rows])
    ts, end = trace.ts_us[rows][order], (trace.ts_us + trace.dur_us)[rows][order]
    is_write = writes[rows][order]
    nbytes = np.where(trace.result[rows][order] > 0, trace.result[rows][order], 0)
    last_end = np.maximum.accumulate(end)
    idle = np.maximum(ts[1:] - last_end[:-1], 0.0)
    pause = split_idle(idle) or 1e6  # without training between saves: a pause apart, or 1 s
    reads_between = np.searchsorted(sample_ts, ts[1:]) - np.searchsorted(sample_ts,
                                                                        last_end[:-1])
    cut = np.flatnonzero((reads_between > 0) | (idle > pause)) + 1
    saves = []
    loads = 0
    for g in np.split(np.arange(len(ts)), cut):
        if not is_write[g].any():
            loads += bool(reads[rows][order][g].any())
            continue
        dur = (float(last_end[g].max()) - float(ts[g].min())) / 1e6
        saves.append((float(ts[g].min()), int(nbytes[g][is_write[g]].sum()), dur))
    sizes = np.array([s[1] for s in saves], dtype=np.float64)
    durs = np.array([s[2] for s in saves])
    out: dict[str, Any] = {
        "saves": len(saves), "loads": loads, "fsync": bool(syncs.any()),
        "bytes_p50": int(nearest_rank(sizes, 50)),
        "duration_s_p50": round(float(np.median(durs)), 6),
        "persist_MBps": round(float(sizes.sum() / durs.sum() / 1e6), 3) if durs.sum() else None,
        "interval_steps": None, "interval_s": None,
    }
    if len(saves) >= 2:
        out["interval_s"] = round(float(np.median(np.diff([s[0] for s in saves]))) / 1e6, 6)
    if steps.batch_samples and len(saves) >= 1:
        at = [np.searchsorted(sample_ts, s[0]) / steps.batch_samples for s in saves]
        gaps = np.diff([0.0, *at])
        out["interval_steps"] = max(1, round(float(np.median(gaps))))
    return out


def fit(trace: Trace) -> dict[str, Any]:
    """The fitted figures of a loaded trace (docs/advise.md, "What is fitted")."""
    unfitted: list[dict[str, str]] = []
    runs = split_runs(trace)
    run = runs.chosen
    if len(runs.spans) > 1:
        unfitted.append({"what": "one run", "why": runs.why})
    seq = sequential(trace, data_mask(trace))
    samples = _rows(trace, SAMPLE_CLASSES, "read") & run
    source_reads = _rows(trace, ("data-source",), "read") & run
    steps = _steps(trace, samples, run)
    if not steps.source:
        unfitted.append({"what": "steps", "why": steps.why})
    elif steps.batch_samples is None:
        unfitted.append({"what": "batch", "why": steps.why})
    groups: dict[str, Any] = {}
    for name, classes in GROUPS.items():
        rows = _rows(trace, classes) & run
        if name == "data":  # generating a dataset is not reading it
            rows &= _rows(trace, classes, "read")
        if (rows & data_mask(trace)).any():
            groups[name] = {"trace_classes": [c for c in classes if c in trace.classes],
                            **_group(trace, rows, seq, steps.count)}
    if "data" not in groups and "cache" not in groups:
        unfitted.append({"what": "data", "why": "no data reads (class data-source or "
                         "cache-read) in the trace: dataset, batch and reader threads cannot "
                         "be fitted; trace the training loop, with lcache reading its data"})
    dataset = _dataset(trace, source_reads)
    if dataset is not None:  # the epochs the loop was handed, cache hits too
        dataset["epochs_read"] = round(_samples_read(trace, samples) / dataset["samples"], 3)
    generated = _rows(trace, ("data-source",), "write") & run & data_mask(trace)
    if dataset is not None and generated.any():
        dataset["generated_bytes"] = int(np.where(trace.result[generated] > 0,
                                                  trace.result[generated], 0).sum())
    sample_ts = np.sort(trace.ts_us[samples])
    ckpt = _checkpoints(trace, run, steps, sample_ts)
    return {
        "trace": {"files": trace.paths, "io_events": len(trace),
                  "span_s": round(_span_s(trace, np.ones(len(trace), dtype=bool)), 6)},
        "runs": runs.to_dict(),
        "steps": steps.to_dict(),
        "dataset": dataset,
        "groups": groups,
        "checkpoint": ckpt,
        "unfitted": unfitted,
    }


def _steps(trace: Trace, samples: Mask, run: Mask) -> Steps:
    threads = set(zip(trace.pid[samples].tolist(), trace.tid[samples].tolist(), strict=True))
    # Reads in the process's main thread alone: a loop without reader threads or workers.
    inline = len(threads) == 1 and next(iter(threads))[0] == next(iter(threads))[1]
    markers = _rows(trace, (MARKER,), MARKER) & run  # the fitted run's steps, as its reads
    if markers.any():
        stepping = set(np.unique(trace.pid[markers]).tolist())
        if len(stepping) > 1:  # ranks: each reads in its own training thread, or not
            inline = all(p == t and p in stepping for p, t in threads)
        return from_markers(trace.ts_us[markers], trace.dur_us[markers],
                            _samples_read(trace, samples), inline,
                            _process(trace)[markers])
    if not samples.any():
        return Steps("", why="no data reads to take the training loop's rhythm from")
    return from_rhythm(trace.ts_us[samples], trace.ts_us[samples] + trace.dur_us[samples],
                       inline)


def _process(trace: Trace) -> npt.NDArray[np.int64]:
    """Per event, its process: the pid within its trace file (two files may hold one pid)."""
    return event_source(trace).astype(np.int64) * (1 << 32) + trace.pid.astype(np.int64)


def _samples_read(trace: Trace, samples: Mask) -> int:
    """The samples that ``samples`` (source reads and cache hits) handed the training loop:
    one a source read; a cache read of neighbouring records (the store reads them in one
    request) counts the records its bytes hold, at the source's mean sample size plus the
    record header. Reads of the /dev/shm staging area (class cache-ram) are left out: they
    read again what a source read or cache hit already counted."""
    source = samples & _rows(trace, ("data-source",))
    hits = samples & ~source
    if not source.any():
        return int(samples.sum())
    record = float(trace.size[source].mean()) + HEADER_SIZE
    return int(source.sum()) + int(np.maximum(1, np.round(trace.size[hits] / record)).sum())
