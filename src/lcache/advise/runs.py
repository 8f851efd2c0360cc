"""Several runs in one trace (files of different jobs given together, a trace appended to).

The processes that read samples are grouped by time: processes whose reads overlap belong to
one run (ranks, DataLoader workers, reader threads). Groups that follow each other are one
run when they read alike (a DataLoader's fresh workers every epoch), or when they are one
job's (its processes descend from one process of the trace file), the later group uses a
folder of the run's cache (a file it read or wrote there, other than the source's) and
reads from the source no sample the run already read there: a cached job's main process
reads ahead before its workers start, and its later epochs read the cache. Else they are
different runs (other classes, other files, another job, or one job starting over): ``lcache demo``
reads the remote without a cache, then, in the same process, the same samples through
lcache. Then one run is fitted, and the others are named.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lcache.report.load import Trace
from lcache.report.stats import event_source

Mask = npt.NDArray[np.bool_]
#: Reads that hand a training step its samples: from the source, or hits in the SSD cache.
SAMPLE_CLASSES = ("data-source", "cache-read")


@dataclass
class Runs:
    spans: list[tuple[float, float, list[str]]]  # start, end (s from the trace start), classes
    chosen: Mask
    index: int = 0
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"count": len(self.spans), "fitted": self.index + 1 if self.spans else None,
                "spans_s": [[round(a, 3), round(b, 3)] for a, b, _ in self.spans],
                "classes": [c for _, _, c in self.spans]}


def split_runs(trace: Trace) -> Runs:
    everything = np.ones(len(trace), dtype=bool)
    codes = [i for i, n in enumerate(trace.classes) if n in SAMPLE_CLASSES]
    reads = np.isin(trace.cls, codes) & (trace.op == (trace.ops.index("read")
                                                       if "read" in trace.ops else -1))
    if not reads.any():
        return Runs([], everything)
    pids = np.unique(trace.pid[reads])
    spans = sorted((float(trace.ts_us[reads & (trace.pid == p)].min()),
                    float((trace.ts_us + trace.dur_us)[reads & (trace.pid == p)].max()), int(p))
                   for p in pids)
    groups: list[list[float]] = []
    members: list[list[int]] = []  # the processes of each group
    for a, b, p in spans:  # merge processes whose reads overlap in time
        if groups and a <= groups[-1][1]:
            groups[-1][1] = max(groups[-1][1], b)
            members[-1].append(p)
        else:
            groups.append([a, b])
            members.append([p])
    starts = [g[0] for g in groups]
    edges = [-np.inf, *starts[1:], np.inf]
    masks = [(trace.ts_us >= edges[k]) & (trace.ts_us < edges[k + 1])
             for k in range(len(groups))]
    kinds = [_kind(trace, m & reads) for m in masks]
    job = _jobs(trace)
    jobs = [set(job[reads & m].tolist()) for m in masks]
    source = reads & (trace.cls == (trace.classes.index("data-source")
                                    if "data-source" in trace.classes else -1))
    key = trace.file.astype(np.int64) * (1 << 40) + np.maximum(trace.offset, 0)
    # Consecutive groups that read alike are one run, and so are one job's groups that go
    # on in the folders of the run's cache (not two trainings a driver ran one after the
    # other, with other caches, over one source folder or two) without starting over
    # (re-reading source samples). Folders, not files: two workers whose first misses did
    # not overlap in time were groups of their own, and split the run (1 run in 3 of a
    # test's); not the source's folder: two trainings over one folder became one run. By
    # the groups' processes, all their I/O: a time window also held the next training's
    # opening of its cache.
    moved = np.isin(trace.op, [trace.ops.index(o) for o in ("read", "write") if o in trace.ops])
    cached = moved & (trace.file >= 0) & ~np.isin(trace.cls, [
        trace.classes.index("data-source")] if "data-source" in trace.classes else [])
    folder = np.unique([os.path.dirname(f) for f in trace.files] or [""],
                       return_inverse=True)[1]
    files = [set(folder[trace.file[cached & np.isin(trace.pid, m)]].tolist()) for m in members]
    runs: list[int] = [0]
    seen = set(key[source & masks[0]].tolist())  # the run's samples read from the source
    used = set(files[0])  # the files the run read or wrote
    for k in range(1, len(groups)):
        fresh = set(key[source & masks[k]].tolist())
        goes_on = bool(jobs[k] & jobs[k - 1]) and not fresh & seen and bool(files[k] & used)
        if kinds[k] != kinds[runs[-1]] and not goes_on:
            runs.append(k)
            seen, used = set(), set()
        seen |= fresh
        used |= files[k]
    bounds = [*runs, len(groups)]
    merged = [np.logical_or.reduce(masks[bounds[i]:bounds[i + 1]]) for i in range(len(runs))]
    t0 = float(trace.ts_us.min())
    out = [((groups[bounds[i]][0] - t0) / 1e6, (groups[bounds[i + 1] - 1][1] - t0) / 1e6,
            sorted({trace.classes[c] for c in np.unique(trace.cls[merged[i]])}))
           for i in range(len(runs))]
    counts = [int((m & reads).sum()) for m in merged]
    best = max(range(len(runs)), key=lambda i: (counts[i], i))  # ties: the later run
    why = ""
    if len(runs) > 1:
        listed = "; ".join(f"run {i + 1}: {a:.1f}-{b:.1f} s, {', '.join(c)}"
                           for i, (a, b, c) in enumerate(out))
        why = (f"the trace holds {len(runs)} runs that read differently ({listed}); fitted "
               f"run {best + 1}, the one with the most sample reads; trace each run apart "
               "to fit the others")
    return Runs(out, merged[best], best, why)


def _jobs(trace: Trace) -> npt.NDArray[np.int64]:
    """Per event, its job: the topmost ancestor of its process present in its trace file (a
    DataLoader worker's parent is the training process), as ``(file << 32) + pid``."""
    process = event_source(trace).astype(np.int64) * (1 << 32) + trace.pid.astype(np.int64)
    parent = {(s << 32) + p: (s << 32) + pp for (s, p), pp in trace.ppid.items()}
    present = set(parent) | set(np.unique(process).tolist())
    top: dict[int, int] = {}
    for p in np.unique(process).tolist():
        q, path = p, {p}
        while parent.get(q) in present and parent[q] not in path:  # a reused pid may loop
            q = parent[q]
            path.add(q)
        top[p] = q
    uniq, inverse = np.unique(process, return_inverse=True)
    return np.array([top[p] for p in uniq.tolist()], np.int64)[inverse]


def _kind(trace: Trace, rows: Mask) -> tuple[frozenset[int], frozenset[int]]:
    """What a group of reads looks like: its classes and the files it reads."""
    return frozenset(np.unique(trace.cls[rows]).tolist()), frozenset(
        np.unique(trace.file[rows]).tolist())
