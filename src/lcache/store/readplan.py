"""Planning a batch of reads: sort the wanted records by location and coalesce neighbours."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from lcache.io import align_down, align_up

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
    runs: list[Run] = []
    for i in order.tolist():
        loc = int(locs[i])
        seg, off = loc >> 32, loc & 0xFFFFFFFF
        start, end = align_down(off, block), align_up(off + int(lens[i]), block)
        if runs:
            last = runs[-1]
            if last.segment == seg and start <= last.end and end - last.start <= max_run:
                last.end = max(last.end, end)
                last.members.append(i)
                continue
        runs.append(Run(seg, start, end, [i]))
    return runs
