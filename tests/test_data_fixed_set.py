"""The fixed set a node of every rank keeps, and the room it keeps it in: a nearly full cache
fetches its plan's misses and writes nothing warm, the set holds the smallest samples,
``drop_last`` and restarts keep it, and a cache reopened smaller fits its capacity.

Every sample file encodes its index, and every item read is checked byte for byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from lcache.data import RangeSource, SeedAwareSampler
from lcache.testing import disk_usage

from ._cache_data import HEADER, _close_datasets, open_dataset, write_samples  # noqa: F401
from ._torchrun_cache import sample_bytes, sample_index


@pytest.mark.parametrize(("n", "size", "segment", "fraction"), [
    (3000, 4096 - HEADER, "32KiB", 0.99),  # 8 records a segment: 375 segments
    (20000, 256 - HEADER, "16KiB", 0.99),  # 64: a segment's summary is 7% of them
], ids=["few-misses", "small-records"])
def test_a_nearly_full_cache_fetches_its_plans_misses_and_writes_nothing_when_warm(
        tmp_path: Path, n: int, size: int, segment: str, fraction: float) -> None:
    """A cache of most of the dataset: each epoch fetches what the plan misses, no more,
    and once full it writes nothing (each sample is read once an epoch, so the samples it
    holds give every hit there is). The findings: Belady's plan admitted nearly every miss
    in a warm epoch (the same hits, a write and the store's cleaning copies for each), and
    the plan left the store no room for its segments' summaries, which a cache of small
    samples then evicted (a tenth more fetches than the plan's misses)."""
    root = write_samples(tmp_path / "remote", n, size)
    ds = open_dataset(str(root), tmp_path / "cache", fraction, segment_size=segment)
    sampler = SeedAwareSampler(ds, seed=1, prefetch=False)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        mark, puts = ds.stats(), ds.cache.store().counters.puts
        batch: list[Any] = []
        for access in [*sampler, None]:
            if access is not None:
                batch.append(access)
            if len(batch) == 32 or (access is None and batch):
                assert [sample_index(item, size) for item in ds.__getitems__(batch)] == \
                    [a.sample for a in batch]
                batch = []
        plan = sampler.plan(epoch)
        assert ds.stats(since=mark)["fetches"] == n - int(plan.hits.sum()) > 0, epoch
        if epoch:  # as many samples as the plan's room holds: C/N
            assert plan.hit_ratio == pytest.approx(
                sampler.plan_capacity // (size + HEADER) / n, abs=1 / n)
            assert ds.cache.store().counters.puts == puts, epoch
    assert ds.cache.store().counters.evictions == 0


@pytest.mark.parametrize("shards", [False, True], ids=["objects", "one-shard"])
def test_a_fixed_set_holds_the_smallest_samples(tmp_path: Path, shards: bool) -> None:
    """The finding (attack helper 101): with sizes falling from the first sample to the
    last, the fixed set, the first samples by index that fit, held 0.20 of the samples at
    0.34 of the bytes (Belady's plan: 0.31). It now holds the smallest that fit: the most
    samples, each a hit every warm epoch. Samples of one shard keep the first by index, so
    that their misses stay one ranged request."""
    n = 1200
    sizes = np.linspace(8_000, 500, n).astype(np.int64)
    blobs = [sample_bytes(i, int(sizes[i])) for i in range(n)]
    root = tmp_path / "remote"
    root.mkdir()
    if shards:
        (root / "shard.bin").write_bytes(b"".join(blobs))
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        source: Any = RangeSource(str(root), ["shard.bin"] * n, offsets, sizes)
    else:
        for i, blob in enumerate(blobs):
            (root / f"{i:06d}.bin").write_bytes(blob)
        source = str(root)
    ds = open_dataset(source, tmp_path / "cache", 0.4, segment_size="32KiB")
    sampler = SeedAwareSampler(ds, seed=2, prefetch=False)
    records = sizes + HEADER
    if shards:  # the first by index
        held = set(range(int(np.searchsorted(np.cumsum(records), sampler.plan_capacity,
                                             "right"))))
    else:  # the smallest, here the last
        most = int(np.searchsorted(np.cumsum(records[::-1]), sampler.plan_capacity, "right"))
        held = set(range(n - most, n))
    assert len(held) > 0.1 * n
    for epoch in range(3):
        sampler.set_epoch(epoch)
        mark, puts = ds.stats(), ds.cache.store().counters.puts
        for access in sampler:
            assert ds[access] == blobs[access.sample]
        plan = sampler.plan(epoch)
        assert ds.stats(since=mark)["fetches"] == n - int(plan.hits.sum())
        if epoch:
            assert set(sampler.node_sequence(epoch)[plan.hits].tolist()) == held
            assert ds.cache.store().counters.puts == puts
    assert ds.cache.store().counters.evictions == 0


def test_a_held_sample_drop_last_leaves_out_of_an_epoch_stays_cached(tmp_path: Path) -> None:
    """The finding (attack helper 101): four ranks of one node with ``drop_last`` and 2,003
    samples read 2,000 an epoch; a sample of the fixed set left out of the next epoch was
    deleted at its read (no next use in the plan's horizon), then fetched and written again
    in the epoch after: 1-2 writes a warm epoch, where a fixed set writes none."""
    n, size, world = 2003, 4096, 4
    root = write_samples(tmp_path / "remote", n, size)
    ds = open_dataset(str(root), tmp_path / "cache", 0.5)
    samplers = [SeedAwareSampler(ds, seed=3, prefetch=False, num_replicas=world, rank=r,
                                 local_world_size=world, drop_last=True) for r in range(world)]
    for epoch in range(6):
        mark, puts = ds.stats(), ds.cache.store().counters.puts
        ranks = []
        for s in samplers:
            s.set_epoch(epoch)
            ranks.append(list(s))
        for step in zip(*ranks, strict=True):  # the ranks in turn, as the plan has them
            batch = list(step)
            assert [sample_index(item, size) for item in ds.__getitems__(batch)] == \
                [a.sample for a in batch]
        plan = samplers[0].plan(epoch)
        assert ds.stats(since=mark)["fetches"] == len(plan.hits) - int(plan.hits.sum())
        if epoch:
            assert ds.cache.store().counters.puts == puts, epoch


def test_a_restarted_fixed_set_plan_is_the_running_ones(tmp_path: Path) -> None:
    """The finding (attack helper 103): a job restarted or resumed plans from a few epochs
    back, from an empty cache; with ``drop_last`` (383 samples on 128 ranks of one node: 127
    left out of each epoch) its plan missed the fixed set's samples those epochs had left
    out, which the cache held since an earlier one (after a restart, 31, 7, 1, 3, 1 and 1
    planned misses that were hits). It now starts from the set's samples read before."""
    n, world = 383, 128
    root = write_samples(tmp_path / "remote", n, 512)
    ds = open_dataset(str(root), tmp_path / "cache", "4MiB", segment_size="4KiB")

    def sampler() -> SeedAwareSampler:
        return SeedAwareSampler(ds, seed=1, prefetch=False, num_replicas=world, rank=0,
                                local_world_size=world, drop_last=True)

    running = sampler()
    plans = [running.plan(epoch) for epoch in range(12)]
    for epoch in range(1, 12):
        restarted = sampler().plan(epoch)
        assert (restarted.hits == plans[epoch].hits).all(), epoch
        assert (restarted.keep == plans[epoch].keep).all(), epoch


def test_a_cache_reopened_smaller_fits_its_new_capacity(tmp_path: Path) -> None:
    """The finding (attack helper 101): a cache filled at 0.8 and reopened at 0.3 kept 2.8
    times its new capacity on disk for good, since a warm fixed set writes nothing and only
    a new segment enforced the bound. It now fits at the open; the plan's misses are what
    it fetches again from the second epoch on."""
    n, size = 4000, 4096
    root = write_samples(tmp_path / "remote", n, size)
    for fraction, epochs in ((0.8, 2), (0.3, 3)):
        ds = open_dataset(str(root), tmp_path / "cache", fraction)
        assert disk_usage(tmp_path / "cache" / "store") <= ds.cache.main_capacity
        sampler = SeedAwareSampler(ds, seed=1, prefetch=False)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            mark = ds.stats()
            for access in sampler:
                assert sample_index(ds[access], size) == access.sample
            plan = sampler.plan(epoch)
            if epoch == epochs - 1:
                assert ds.stats(since=mark)["fetches"] == n - int(plan.hits.sum())
        ds.cache.close()
        assert disk_usage(tmp_path / "cache" / "store") <= ds.cache.main_capacity
