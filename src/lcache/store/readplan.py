"""Planning a batch of reads: sort the wanted records by location and coalesce neighbours."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

MAX_RUN = 4 << 20  # largest coalesced read


@dataclass(slots=True)
class Run:
    """One read: bytes [start, end) of a segment, holding the records ``members`` (indices
    into the batch)."""

    segment: int
    start: int
    end: int
    members: list[int]


def plan_reads(locs: npt.NDArray[np.uint64], lens: npt.NDArray[np.uint32], block: int,
               max_run: int = MAX_RUN) -> list[Run]:
    """Runs covering every record with a location (``loc != 0``), in disk order.

    Records that touch or overlap after alignment to ``block`` (1 for buffered reads, the
    device block for O_DIRECT) share one read, up to ``max_run`` bytes.
    """
    found = np.flatnonzero(locs)
    order = found[np.argsort(locs[found], kind="stable")]
    if len(order) == 0:
        return []
    seg = (locs[order] >> np.uint64(32)).astype(np.int64)
    off = (locs[order] & np.uint64(0xFFFFFFFF)).astype(np.int64)
    start = off // block * block
    end = -(-(off + lens[order].astype(np.int64)) // block) * block
    # a new run where the segment changes or a gap opens; long runs are split below
    new = np.ones(len(order), dtype=bool)
    reach = np.maximum.accumulate((seg << 32) + end)  # in location space: offsets restart
    new[1:] = (seg[1:] != seg[:-1]) | ((seg[1:] << 32) + start[1:] > reach[:-1])
    runs: list[Run] = []
    bounds = [*np.flatnonzero(new).tolist(), len(order)]
    members_all = order.tolist()
    starts, ends, segs = start.tolist(), end.tolist(), seg.tolist()
    for lo, hi in itertools.pairwise(bounds):
        run = Run(segs[lo], starts[lo], ends[lo], [members_all[lo]])
        runs.append(run)
        for j in range(lo + 1, hi):
            if starts[j] > run.end or max(run.end, ends[j]) - run.start > max_run:
                run = Run(segs[j], starts[j], ends[j], [members_all[j]])
                runs.append(run)
                continue
            run.end = max(run.end, ends[j])
            run.members.append(members_all[j])
    return runs
