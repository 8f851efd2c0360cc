"""The advised cache capacity, given to a real cache, plans the target hit ratio: the store's
own overhead (a free segment, one per writer, the index) is added to the samples' records."""

from __future__ import annotations

from pathlib import Path

import pytest

import lcache.trace
from lcache.advise import Targets, advise
from lcache.data import CachedDataset, SeedAwareSampler
from lcache.data.cache import SampleCache
from lcache.data.sizing import capacity_for
from lcache.errors import ConfigError
from tests.test_advise_traces import record_trace

N, SIZE = 1000, 4096  # /tmp/attack32's case: 0.9 was advised as 3,715,200 B and planned 0.769


def _reads(t0: int) -> None:
    for i in range(N):  # one epoch of the dataset, 0.1 ms apart
        lcache.trace.record("read", f"/data/{i:05d}.bin", 0, SIZE, "data-source",
                            t0 + i * 100_000, 50_000, SIZE)


@pytest.mark.parametrize("hit", [0.5, 0.9])
def test_advised_capacity_plans_the_target_hit_ratio(tmp_path: Path, hit: float) -> None:
    record_trace(tmp_path / "run.trace", _reads, in_thread=True)
    cap = advise(tmp_path / "run.trace", Targets(hit_ratio=hit))["advice"][0]
    assert cap["topic"] == "cache capacity"
    data = tmp_path / "data"
    data.mkdir()
    for i in range(N):
        (data / f"{i:05d}.bin").write_bytes(bytes(SIZE))
    ds = CachedDataset(str(data), str(tmp_path / "cache"), capacity=cap["value"])
    sampler = SeedAwareSampler(ds, seed=0, prefetch=False)  # default loader_workers
    assert sampler.plan(1).hit_ratio >= hit
    assert sampler.plan_capacity >= cap["plan_bytes"] == round(hit * N) * (SIZE + 32)
    # the arithmetic states the overhead it added
    assert f"{cap['value']:,} B" in cap["arithmetic"] and "writers" in cap["arithmetic"]


@pytest.mark.parametrize(("n", "size", "writers", "need"),
                         [(1000, 4096, 5, 900 * 4128), (50, 100_000, 9, 2_000_000)])
def test_capacity_for_is_the_smallest_that_holds_the_bytes(tmp_path: Path, n: int, size: int,
                                                          writers: int, need: int) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(n):
        (data / f"{i:05d}.bin").write_bytes(bytes(size))

    def room(capacity: int, where: str) -> int:  # a real cache's plan room, -1: refused
        try:
            cache = SampleCache(str(data), str(tmp_path / where), capacity)
        except ConfigError:  # below the minimum capacity
            return -1
        return cache.plan_capacity(writers)

    # where this machine stages prefetched samples decides whether staging costs capacity
    on_ssd = SampleCache(str(data), str(tmp_path / "probe"), 1 << 30)._on_ssd
    cap = capacity_for(need, n, size, writers, staging_on_ssd=on_ssd)
    assert room(cap, "a") >= need > room(cap - 1, "b")
