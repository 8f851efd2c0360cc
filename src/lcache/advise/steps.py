"""Training steps found in a trace: from step markers, else from the rhythm of data reads.

A step marker is an event that ``lcache.trace.record("step", name, step, 0, "step", t0,
compute_ns, 0)`` writes when a training loop (a sampler, a DataLoader) advances: op ``step``,
class ``step``, its duration the step's compute. Without markers the steps come from the
data reads: a loop that reads a batch then computes leaves bursts of reads separated by idle
gaps, one burst per step.

* Reads made by the process's main thread alone (``tid == pid``: a loader without reader
  threads) are not overlapped with compute: the idle gap between bursts *is* the compute.
* Reads made by reader threads or worker processes run ahead of compute: in a compute-bound
  loop the readers wait for room, so bursts still come one per step and the period is the
  step; compute fills it (``compute_s = step_s``).
* Reads that never pause (read-bound readers, always busy) show no step: the loop's compute
  cannot be seen, and only a marker gives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

#: Steps needed before a rhythm counts: the first bursts are the readers' warm-up.
MIN_STEPS = 8
#: An idle gap between bursts must be this many times the longest gap inside a burst...
SEPARATION = 5.0
#: ... and at least this long: no training step is shorter than half a millisecond.
MIN_GAP_US = 500.0
#: The bursts must be alike: their sizes vary by at most this (stdev / mean, steady bursts).
MAX_SPREAD = 0.5


@dataclass(frozen=True, slots=True)
class Steps:
    """What the trace says about the training loop's steps (``None``: not visible)."""

    source: str  # "markers", "rhythm" or "" (not found)
    count: int = 0
    step_s: float | None = None
    compute_s: float | None = None
    batch_samples: int | None = None
    inline: bool = False
    prefetch_batches: int | None = None
    why: str = ""
    ranks: int = 1  # processes that recorded step markers: count and batch are per rank

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "source": self.source or None, "count": self.count, "step_s": self.step_s,
            "compute_s": self.compute_s, "batch_samples": self.batch_samples,
            "reads_in_training_thread": self.inline, "prefetch_batches": self.prefetch_batches}
        if self.step_s and self.compute_s is not None:
            out["au_estimate"] = round(min(1.0, self.compute_s / self.step_s), 4)
        if self.why:
            out["why"] = self.why
        if self.ranks > 1:
            out["ranks"] = self.ranks
        return out


def from_markers(ts_us: npt.NDArray[np.float64], dur_us: npt.NDArray[np.float64],
                 samples: int, inline: bool,
                 pid: npt.NDArray[np.int64] | None = None) -> Steps:
    """Steps from marker events (start and compute of each step); ``samples``: the samples
    the run's reads handed its steps; ``inline``: the reads are the training thread's own;
    ``pid``: the process of each marker. Markers are fitted per process: one process's
    steps follow each other, several processes stepping at once (ranks) do not, so the
    step is the time between a process's own markers, and the count and the batch are a
    rank's (the markers over the most processes that stepped at once; a job resumed in a
    new process counts its steps in both)."""
    if pid is None:
        pid = np.zeros(len(ts_us), dtype=np.int64)
    per_process = [np.sort(ts_us[pid == p]) for p in np.unique(pid)]
    ranks = _most_at_once([(float(t[0]), float(t[-1])) for t in per_process])
    count = round(len(ts_us) / ranks)
    if count < MIN_STEPS + 1:
        return Steps("", count, why=_too_short(count, None), ranks=ranks)
    diffs = np.concatenate([np.diff(t) for t in per_process])
    if not len(diffs):
        return Steps("", count, why="each process recorded one step marker: no time between "
                     "two steps of one process to fit", ranks=ranks)
    step_s = float(np.median(diffs)) / 1e6
    # The batch: the run's sample reads over its steps (all ranks' over all ranks' markers:
    # a rank's). Not the reads between two markers: reader threads and DataLoader workers
    # read ahead, in bursts that need not fall between the markers of the step that uses
    # them (a prefetcher leaves most steps with none).
    batch, why = None, ""
    if samples >= len(ts_us):
        batch = round(samples / len(ts_us))
    else:
        why = (f"{samples} samples read (data-source, cache-read) for {len(ts_us)} step "
               "markers, fewer than one a step: no batch to fit; trace the loop with lcache "
               "reading its data")
    return Steps("markers", count, round(step_s, 6), round(float(np.median(dur_us)) / 1e6, 6),
                 batch, inline, why=why, ranks=ranks)


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    """Most of the (first, last) spans that overlap at one instant."""
    edges = sorted([(a, 0) for a, _ in spans] + [(b, 1) for _, b in spans])
    level = peak = 0
    for _, end in edges:  # a start before an end at the same instant: they overlap
        level += -1 if end else 1
        peak = max(peak, level)
    return max(1, peak)


def _too_short(steps: int, step_s: float | None) -> str:
    need = f" (at {step_s:.3g} s a step: {(MIN_STEPS + 2) * step_s:.3g} s of training)" \
        if step_s else ""
    return (f"the trace holds {steps} step(s); fitting steps needs at least {MIN_STEPS + 1} "
            f"after the readers' warm-up{need}: trace a longer stretch of the run")


def from_rhythm(start_us: npt.NDArray[np.float64], end_us: npt.NDArray[np.float64],
                inline: bool) -> Steps:
    """Steps from bursts of data reads (module doc). ``start_us``/``end_us``: the reads."""
    if len(start_us) < 2:
        return Steps("", why=_too_short(0, None))
    order = np.argsort(start_us, kind="stable")
    start, end = start_us[order], np.maximum.accumulate(end_us[order])
    idle = np.maximum(start[1:] - end[:-1], 0.0)  # nothing in flight between read k and k+1
    split = split_idle(idle)
    if split is None:
        return Steps("", why="the data reads never pause, so no step shows in them (the "
                     "readers were always busy: a read-bound loop); record a step marker "
                     "(docs/advise.md) to fit the compute per step")
    cut = np.flatnonzero(idle > split) + 1
    bursts = np.split(np.arange(len(start)), cut)
    sizes = np.array([len(b) for b in bursts])
    firsts = start[[b[0] for b in bursts]]
    steady = sizes[1:]
    if len(steady) < MIN_STEPS:
        period = float(np.median(np.diff(firsts))) / 1e6 if len(firsts) > 1 else None
        return Steps("", len(bursts), why=_too_short(len(bursts), period))
    if steady.std() > MAX_SPREAD * steady.mean():
        return Steps("", len(bursts), why="the data reads pause irregularly (bursts of "
                     f"{int(steady.min())}-{int(steady.max())} reads), not once per step; "
                     "record a step marker (docs/advise.md) to fit the steps")
    batch = int(np.median(steady))
    step_s = float(np.median(np.diff(firsts[1:]))) / 1e6
    gaps = idle[cut - 1][1:]
    compute_s = float(np.median(gaps)) / 1e6 if inline else step_s
    ahead = None if inline else max(1, round(sizes[0] / batch) - 1)
    return Steps("rhythm", len(start) // batch, round(step_s, 6),
                 round(compute_s, 6), batch, inline, ahead)


def split_idle(idle: npt.NDArray[np.float64]) -> float | None:
    """The idle time that separates steps, or None when the idle times are not in two
    well-apart groups. Candidates: Otsu's threshold on the log of the positive idle times,
    every break of ``SEPARATION`` times between consecutive ones, and the break between
    back-to-back reads (0 apart) and the rest. Of those that leave the pauses
    ``SEPARATION`` times longer than the gaps inside bursts (and ``MIN_GAP_US``), the one with
    the most pauses wins: steps are many, checkpoint and epoch pauses few. Too few steps is
    the caller's to say."""
    positive = np.unique(idle[idle > 0])
    if not len(positive):
        return None
    breaks = np.flatnonzero(positive[1:] >= SEPARATION * positive[:-1])
    candidates = [float(positive[0]) / 2,
                  *(float(np.sqrt(positive[i] * positive[i + 1])) for i in breaks)]
    if len(positive) > 1:
        candidates.append(_otsu(np.log10(idle[idle > 0])))
    best: tuple[int, float] | None = None
    for threshold in candidates:
        inside, outside = idle[idle <= threshold], idle[idle > threshold]
        if (len(inside) and np.median(outside) >= max(
                MIN_GAP_US, SEPARATION * float(np.percentile(inside, 90)))
                and (best is None or len(outside) > best[0])):
            best = (len(outside), threshold)
    return None if best is None else best[1]


def _otsu(logs: npt.NDArray[np.float64]) -> float:
    """Otsu's threshold (the split of most between-group variance), back in linear units."""
    values = np.sort(logs)
    n = len(values)
    k = np.arange(1, n)
    csum = np.cumsum(values)
    between = k * (n - k) * (csum[:-1] / k - (csum[-1] - csum[:-1]) / (n - k)) ** 2
    between[values[1:] == values[:-1]] = -1.0  # split only between distinct values
    best = int(np.argmax(between))
    return float(10 ** ((values[best] + values[best + 1]) / 2))
