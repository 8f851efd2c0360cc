"""Read planning against a plain reference: same records, same coalescing."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lcache.store.readplan import plan_reads


def reference(locs: list[int], lens: list[int], block: int, max_run: int) -> list[tuple]:
    order = sorted((loc, i) for i, loc in enumerate(locs) if loc)
    runs: list[list] = []
    for loc, i in order:
        seg, off = loc >> 32, loc & 0xFFFFFFFF
        start, end = off // block * block, -(-(off + lens[i]) // block) * block
        if runs and runs[-1][0] == seg and start <= runs[-1][2] and \
                max(runs[-1][2], end) - runs[-1][1] <= max_run:
            runs[-1][2] = max(runs[-1][2], end)
            runs[-1][3].append(i)
        else:
            runs.append([seg, start, end, [i]])
    return [(r[0], r[1], r[2], sorted(r[3])) for r in runs]


records = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 20), st.integers(1, 9000)),
                   max_size=60)


@settings(max_examples=300, deadline=None)
@given(records, st.sampled_from([1, 512, 4096]), st.sampled_from([8192, 1 << 22]))
def test_plan_matches_reference(recs: list[tuple[int, int, int]], block: int,
                                max_run: int) -> None:
    locs = [(seg << 32) | off if seg else 0 for seg, off, _ in recs]  # seg 0 = a miss
    lens = [n for _, _, n in recs]
    got = plan_reads(np.array(locs, np.uint64), np.array(lens, np.uint32), block, max_run)
    assert [(r.segment, r.start, r.end, sorted(r.members)) for r in got] == \
        reference(locs, lens, block, max_run)


def test_far_apart_records_in_different_segments_are_not_merged() -> None:
    # segment 1 reaches offset 900,000; segment 2's records start low and must not join it
    locs = np.array([(1 << 32) | 890_000, (2 << 32) | 0, (2 << 32) | 500_000], np.uint64)
    lens = np.array([10_000, 100, 100], np.uint32)
    runs = plan_reads(locs, lens, 1)
    assert [(r.segment, r.start, r.end) for r in runs] == [
        (1, 890_000, 900_000), (2, 0, 100), (2, 500_000, 500_100)]
