"""The shard-local order (``SeedAwareSampler(shard_window=W)``): shards in a random order, the
samples of each run of W shards shuffled together. Every sample once per epoch, the same order
in every process, and nearby misses fetched in few ranged requests from a real HTTP server."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lcache.data import CachedDataset, RangeSource, SeedAwareSampler
from lcache.data.order import ShardWindow, epoch_order, rank_order
from lcache.errors import ConfigError
from lcache.testing.remote import ThrottledServer

SHARDS, PER_SHARD, SIZE = 12, 24, 1024


def _runs(order: np.ndarray, shards: np.ndarray, window: int) -> list[set[int]]:
    """The shards of each run of the order, checking each run holds whole shards."""
    runs, i = [], 0
    while i < len(order):
        seen: set[int] = set()
        count = 0
        while i < len(order) and (len(seen) < window or int(shards[order[i]]) in seen):
            seen.add(int(shards[order[i]]))
            i += 1
            count += 1
        assert count == sum(int((shards == s).sum()) for s in seen)  # whole shards only
        runs.append(seen)
    return runs


@pytest.mark.parametrize("window", [1, 2, 5, 100])
def test_a_permutation_of_whole_shards_in_runs(window: int) -> None:
    rng = np.random.default_rng(0)
    shards = rng.integers(0, 9, 200) * 7  # labels need not be 0..k-1 nor contiguous
    local = ShardWindow(shards, window)
    order = epoch_order(200, 3, 1, local=local)
    assert sorted(order.tolist()) == list(range(200))
    runs = _runs(order, shards, window)
    assert all(len(r) == min(window, 9) for r in runs[:-1])
    assert np.array_equal(order, epoch_order(200, 3, 1, local=local))  # a pure function
    assert not np.array_equal(order, epoch_order(200, 3, 2, local=local))
    if window == 1:  # within a shard the samples are shuffled too
        assert any(np.any(np.diff(order[shards[order] == s]) < 0) for s in set(shards))


def test_ranks_split_the_order_as_distributed_sampler_does() -> None:
    shards = np.repeat(np.arange(5), 7)
    local = ShardWindow(shards, 2)
    parts = [rank_order(35, 0, 0, r, 3, local=local) for r in range(3)]
    whole = np.concatenate([epoch_order(35, 0, 0, local=local)] * 2)[:36]
    for r in range(3):
        assert np.array_equal(parts[r], whole[r:36:3])


@pytest.fixture
def remote(tmp_path: Path) -> Path:
    """SHARDS files of PER_SHARD samples each; a sample's bytes name it."""
    root = tmp_path / "remote"
    root.mkdir()
    for s in range(SHARDS):
        body = b"".join(_sample(s * PER_SHARD + j) for j in range(PER_SHARD))
        (root / f"shard-{s:02d}.bin").write_bytes(body)
    return root


def _sample(i: int) -> bytes:
    return i.to_bytes(8, "little") * (SIZE // 8)


def _source(url: str) -> RangeSource:
    n = SHARDS * PER_SHARD
    return RangeSource(url, [f"shard-{i // PER_SHARD:02d}.bin" for i in range(n)],
                       [(i % PER_SHARD) * SIZE for i in range(n)], [SIZE] * n, coalesce_gap=0)


def _epoch_requests(remote: Path, cache: Path, window: int) -> int:
    """GETs one epoch of a cold cache takes, checking every sample arrives once, intact."""
    with ThrottledServer(str(remote)) as server:
        ds = CachedDataset(_source(server.url), cache, "4MiB")
        sampler = SeedAwareSampler(ds, seed=1, shard_window=window, loader_workers=0)
        got = [ds[access] for access in sampler]
        n = SHARDS * PER_SHARD
        assert sorted(int.from_bytes(g[:8], "little") for g in got) == list(range(n))
        assert all(g == _sample(int.from_bytes(g[:8], "little")) for g in got)
        return sum(v for k, v in server.paths.items() if k.startswith("/shard-"))


def test_nearby_misses_come_in_few_ranged_requests(remote: Path, tmp_path: Path) -> None:
    scattered = _epoch_requests(remote, tmp_path / "a", 0)
    local = _epoch_requests(remote, tmp_path / "b", 2)
    # 288 samples: a global shuffle rarely puts two neighbours of one shard in a prefetch
    # group; in runs of 2 shards the prefetcher asks for each shard's misses at once.
    assert scattered > 150
    assert local <= 3 * SHARDS


def test_bad_windows_and_sources_refused(remote: Path, tmp_path: Path) -> None:
    ds = CachedDataset(_source(str(remote)), tmp_path / "c", "4MiB")
    for bad in (-1, 2.5, "4"):
        with pytest.raises(ConfigError, match="shard_window"):
            SeedAwareSampler(ds, shard_window=bad)  # type: ignore[arg-type]
    files = tmp_path / "files"
    files.mkdir()
    (files / "a.bin").write_bytes(b"x" * 10)
    with pytest.raises(ConfigError, match="one object per sample"):
        SeedAwareSampler(CachedDataset(str(files), tmp_path / "d", "4MiB"), shard_window=2)


def test_resume_needs_the_same_window(remote: Path, tmp_path: Path) -> None:
    ds = CachedDataset(_source(str(remote)), tmp_path / "e", "4MiB")
    state = SeedAwareSampler(ds, shard_window=2, prefetch=False).state_dict(consumed=5)
    with pytest.raises(ConfigError, match="shard_window=2"):
        SeedAwareSampler(ds, prefetch=False).load_state_dict(state)
    resumed = SeedAwareSampler(ds, shard_window=2, prefetch=False)
    resumed.load_state_dict(state)
    assert [a.sample for a in resumed] == resumed.order()[5:].tolist()
