"""Belady's rule on the known future order: the live plan and the offline simulators.

The sampler knows every access of the node in advance, so for each access it can decide
whether the sample is worth keeping until its next use. Belady's MIN (evict the sample needed
furthest in the future; do not admit one needed later than everything cached) maximises hits
for equal-sized samples. We run it as *interval selection*: access ``t`` of sample ``x`` opens
the interval up to x's next use; the plan keeps an interval only if Belady never evicts x
inside it. Evictions then happen at the sample's own access (delete after reading), not at
another sample's miss, which is what lets many processes follow the plan without talking.

With every sample read once per epoch, a hit in epoch e+1 must be cached at the epoch
boundary, so no policy beats C/N; Belady reaches it (see docs/cache.md). Variable sizes make
exact OPT NP-hard; Belady by next use is the standard heuristic and what we call "opt".

So does a cache that holds a fixed set of samples (``admit``): when the node reads every
sample once an epoch, each one it holds is a hit, C/N, and a warm epoch writes nothing.
Belady instead admits nearly every miss, evicting what is needed furthest: the same hits,
but (1 - f) of the dataset written again each epoch, and the store's cleaning copies. (Where
a node reads a different part of the dataset each epoch, Belady caches the part it reads
next and beats a fixed set.)
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from lcache.store import parse_size

NEVER = np.iinfo(np.int64).max
FOR_GOOD = NEVER - 1  # the next use of a sample ``admit`` holds that no epoch ahead reads


def next_uses(seq: npt.NDArray[np.int64], horizon: npt.NDArray[np.int64] | None = None
              ) -> npt.NDArray[np.int64]:
    """For each position of ``seq``, the position of the same sample's next access, counting
    on into ``horizon`` (the following epoch) at ``len(seq) + j``; ``NEVER`` when none."""
    n = len(seq)
    out = np.full(n, NEVER, dtype=np.int64)
    if n:
        order = np.argsort(seq, kind="stable")
        same = seq[order[1:]] == seq[order[:-1]]
        out[order[:-1][same]] = order[1:][same]
    if horizon is not None and len(horizon) and n:
        top = int(max(seq.max(), horizon.max())) + 1
        first = np.full(top, NEVER, dtype=np.int64)
        samples, at = np.unique(horizon, return_index=True)
        first[samples] = at + n
        last = out == NEVER  # each sample's last access in seq continues into the horizon
        out[last] = first[seq[last]]
    return out


@dataclass
class PlanResult:
    """``keep[t]``: keep the sample of access ``t`` cached until its next use.
    ``hits[t]``: access ``t`` finds its sample cached. ``carried``: samples cached at the end,
    with their next use counted from the start of the horizon."""

    keep: npt.NDArray[np.bool_]
    hits: npt.NDArray[np.bool_]
    carried: dict[int, int]

    @property
    def hit_ratio(self) -> float:
        return float(self.hits.mean()) if len(self.hits) else 0.0


def belady(seq: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64] | int, capacity: int, *,
           horizon: npt.NDArray[np.int64] | None = None,
           carried: dict[int, int] | None = None,
           admit: npt.NDArray[np.bool_] | None = None) -> PlanResult:
    """Run Belady's rule over ``seq`` with a cache of ``capacity`` bytes.

    ``sizes`` is bytes per sample (an array indexed by sample, or one size for all).
    ``carried`` maps samples cached at the start to their next-use position in ``seq``
    (from the previous epoch's result). ``admit``: the samples a miss may be cached for
    (indexed by sample; None: any), e.g. ``fixed_set``'s, kept whether or not the horizon
    reads them: a sample ``drop_last`` left out of the next epoch was deleted, then fetched
    and written again in the epoch after.
    """
    nu = next_uses(seq, horizon)
    n = len(seq)
    uniform = isinstance(sizes, (int, np.integer))

    def size_of(x: int) -> int:
        return int(sizes) if uniform else int(sizes[x])  # type: ignore[index]

    keep = np.zeros(n, dtype=bool)
    hits = np.zeros(n, dtype=bool)
    # resident sample -> (next use, the access that opened its interval; -1 = carried in)
    resident: dict[int, tuple[int, int]] = {}
    heap: list[tuple[int, int, int]] = []  # (-next use, sample, opening access), lazy deletes
    used = 0
    for x, t_next in (carried or {}).items():
        resident[x] = (t_next, -1)
        heap.append((-t_next, x, -1))
        used += size_of(x)
    heapq.heapify(heap)
    seq_list = seq.tolist()
    nu_list = nu.tolist()
    admits = None if admit is None else admit.tolist()
    for t in range(n):
        x = seq_list[t]
        if x in resident:
            hits[t] = True
            del resident[x]
            used -= size_of(x)
        t_next = nu_list[t]
        held = admits is not None and admits[x]
        if t_next == NEVER and not held:
            continue
        size = size_of(x)
        if size > capacity or (admits is not None and not held):
            continue
        if t_next == NEVER:  # held for good, even where drop_last leaves it out of the horizon
            t_next = FOR_GOOD
        resident[x] = (t_next, t)
        heapq.heappush(heap, (-t_next, x, t))
        keep[t] = True
        used += size
        while used > capacity:
            neg, y, opened = heapq.heappop(heap)
            if resident.get(y) != (-neg, opened):
                continue  # stale entry: y was used or re-admitted since
            del resident[y]
            used -= size_of(y)
            if opened >= 0:
                keep[opened] = False
    out = {x: t_next if t_next == FOR_GOOD else t_next - n
           for x, (t_next, _) in resident.items() if t_next != NEVER}
    return PlanResult(keep, hits, out)


def fixed_set(sizes: npt.NDArray[np.int64], capacity: int, *, whole_shards: bool = False
              ) -> npt.NDArray[np.bool_]:
    """The samples a cache of ``capacity`` bytes holds for good: the smallest that fit,
    equal sizes by index, so that the set holds the most samples, each a hit and a request
    saved every epoch (where sizes fell from the first sample to the last, the first by
    index held 0.19 of them, Belady 0.33, the smallest 0.56). ``whole_shards`` (samples lie
    in shared objects): the first by index, so that a shard's samples stay together and its
    misses come whole, as one ranged request. Either way the set depends on the sizes alone,
    not on an epoch's order: a resumed job, which plans from two epochs back, finds the same
    one."""
    order = np.arange(len(sizes)) if whole_shards else np.argsort(sizes, kind="stable")
    held = np.zeros(len(sizes), dtype=bool)
    held[order[np.cumsum(sizes[order]) <= capacity]] = True
    return held


def simulate_opt(seq: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64] | int,
                 capacity: int | str) -> float:
    """Hit ratio of Belady/OPT over the whole access sequence (the offline reference)."""
    capacity = parse_size(capacity, "capacity")
    return belady(np.asarray(seq, dtype=np.int64), sizes, capacity).hit_ratio


def simulate_lru(seq: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64] | int,
                 capacity: int | str) -> float:
    """Hit ratio of a demand LRU cache (admit every miss) over the same sequence."""
    capacity = parse_size(capacity, "capacity")  # "1GB" was a TypeError at the first miss
    uniform = isinstance(sizes, (int, np.integer))
    cache: OrderedDict[int, int] = OrderedDict()
    used = hits = 0
    for x in np.asarray(seq).tolist():
        if x in cache:
            hits += 1
            cache.move_to_end(x)
            continue
        size = int(sizes) if uniform else int(sizes[x])  # type: ignore[index]
        if size > capacity:
            continue
        cache[x] = size
        used += size
        while used > capacity:
            _, evicted = cache.popitem(last=False)
            used -= evicted
    return hits / len(seq) if len(seq) else 0.0
