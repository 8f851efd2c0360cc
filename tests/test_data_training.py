"""Training with the sample cache: DataLoader workers, hit ratio against OPT, no double fetch,
torchrun ranks sharing one cache, mid-epoch resume, and the sampler's plan (the order and plan
functions alone: test_data_plan.py; the fixed set and its room: test_data_fixed_set.py).

Every sample file encodes its index (first 8 bytes, little-endian) followed by deterministic
random bytes, and every item read is checked byte for byte, so a wrong or damaged sample fails.
Run with ``-s`` to see the measured hit ratios next to OPT's and LRU's.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from lcache.data import CachedDataset, FileSource, SeedAwareSampler  # noqa: E402
from lcache.data import sampler as sampler_module  # noqa: E402
from lcache.data.order import node_order, rank_order  # noqa: E402
from lcache.data.plan import belady, fixed_set, simulate_lru, simulate_opt  # noqa: E402
from lcache.data.shared import SharedCounters  # noqa: E402
from lcache.errors import ConfigError  # noqa: E402
from lcache.store import Store, fsck  # noqa: E402
from lcache.testing.remote import ThrottledServer  # noqa: E402

from ._cache_data import HEADER, _close_datasets, open_dataset, write_samples  # noqa: E402,F401
from ._torchrun_cache import sample_bytes, sample_index  # noqa: E402
from .conftest import KIB, MIB, fork_while_held, run_torchrun  # noqa: E402

#: DataLoader tests: 2,000 samples of 4 KiB, a cache of about half of them.
N, SIZE = 2000, 4 * KIB
CAPACITY = 4 * MIB
#: Hit-ratio test: the store's fixed costs (a free and an active segment per writer, 64 KiB
#: each, and the index) must be small next to the capacity for the plan to reach 95% of OPT
#: (which gets the whole nominal capacity) at a fraction of 0.25: 3,000 x 16,000 bytes.
BIG_N, BIG_SIZE = 3000, 16000


# --------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_samples(tmp_path_factory.mktemp("small") / "data", N, SIZE)


def read_epoch(loader: DataLoader, size: int, stop_after: int | None = None) -> list[int]:
    """Sample indices of one pass over ``loader`` (every item's bytes checked)."""
    got: list[int] = []
    for b, batch in enumerate(loader):
        if stop_after is not None and b == stop_after:
            break
        got.extend(sample_index(item, size) for item in batch)
    return got


def _totals_of(path: str) -> dict[str, int]:
    return SharedCounters(path).totals()


def node_totals(ds: CachedDataset) -> dict[str, int]:
    """``ds.cache.counters.totals()``, read in a forked child: reading (closing) the counter
    file here would drop this process's counter-slot lock, and the next DataLoader worker
    would then share our slot and lose counts (``test_counter_slot_survives_totals``).
    Even so, DataLoader workers forked after this process has counted (its prefetcher
    does) share one slot and lose increments (``test_forked_workers_get_their_own_counter_
    slots``): counts are exact with num_workers=0 or persistent workers only."""
    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(_totals_of, (ds.cache.counters.path,))


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def assert_once_each(got: list[int], n: int) -> None:
    counts = Counter(got)
    assert len(got) == n and len(counts) == n and set(counts) == set(range(n)), (
        f"{len(got)} items, {len(counts)} distinct; repeated "
        f"{[i for i, c in counts.items() if c > 1][:10]}, missing "
        f"{sorted(set(range(n)) - set(counts))[:10]}")


class LoggedSource(FileSource):
    """A local ``FileSource`` that appends each fetched index to ``log`` (from any process):
    exact fetch counts, unlike the node counters (see the counter tests at the end)."""

    def __init__(self, url: str, log: Path) -> None:
        super().__init__(url)
        self.log = str(log)

    def fetch(self, index: int) -> bytes:
        with open(self.log, "a") as f:
            f.write(f"{index}\n")
        return super().fetch(index)


class PathLog(Counter):  # type: ignore[type-arg]
    """A ``ThrottledServer.paths`` that also logs the requests in the order they came."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def __setitem__(self, key: str, value: int) -> None:
        self.log.append(key)
        super().__setitem__(key, value)


def sample_gets(paths: Counter, n: int) -> Counter:  # type: ignore[type-arg]
    """GETs per sample index among server paths (listing and marker requests left out)."""
    out: Counter[int] = Counter()
    for path, count in paths.items():
        name = path.rsplit("/", 1)[-1]
        if name.endswith(".bin") and name[:-4].isdigit() and int(name[:-4]) < n:
            out[int(name[:-4])] += count
    return out


# --------------------------------------------------------------------------- 1. DataLoader
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True),
                                                     (4, False)])
def test_dataloader_every_sample_once_in_sampler_order(small_data: Path, tmp_path: Path,
                                                       workers: int, persistent: bool) -> None:
    ds = open_dataset(str(small_data), tmp_path / "cache", CAPACITY)
    sampler = SeedAwareSampler(ds, seed=7)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=workers,
                        persistent_workers=persistent, collate_fn=list)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        got = read_epoch(loader, SIZE)
        assert_once_each(got, N)
        assert got == sampler.order(epoch).tolist()
        orders.append(got)
    assert len({tuple(order) for order in orders}) == 3  # reshuffled every epoch
    # (exact access counts: see test_forked_workers_get_their_own_counter_slots)
    totals = node_totals(ds)
    assert totals["corrupt_refetches"] == totals["admit_failures"] == 0


# --------------------------------------------------------------------------- 2. hit ratio
@pytest.fixture(scope="module")
def big_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_samples(tmp_path_factory.mktemp("big") / "data", BIG_N, BIG_SIZE)


def test_dataloader_workers_seal_their_segments_when_they_exit(small_data: Path,
                                                              tmp_path: Path) -> None:
    """Regression: a worker leaves by os._exit (no atexit), so each epoch left its segments
    open, to be recovered as a crashed writer's by the next process (and counted so)."""
    ds = open_dataset(str(small_data), tmp_path / "cache", CAPACITY)
    sampler = SeedAwareSampler(ds, seed=3, loader_workers=2, prefetch=False)
    loader = DataLoader(ds, batch_size=64, sampler=sampler, num_workers=2, collate_fn=list)
    for epoch in range(2):  # workers started and ended with each epoch
        sampler.set_epoch(epoch)
        assert_once_each(read_epoch(loader, SIZE), N)
    ds.cache.close()
    assert fsck(str(tmp_path / "cache" / "store")).clean
    with Store.open(str(tmp_path / "cache" / "store")) as store:
        assert store.counters.recovered_segments == 0  # none was left open
        assert store.stats()["recovered_segments"] == 0  # nor recovered by the loop


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_hit_ratio_close_to_opt(big_data: Path, tmp_path: Path, fraction: float) -> None:
    """Warm epochs reach >= 95% of OPT's hit ratio (OPT given the whole nominal capacity)
    and the fraction the plan can hold, with prefetch on; LRU is far below."""
    n, dataset_bytes = BIG_N, BIG_N * BIG_SIZE
    capacity = int(fraction * dataset_bytes)
    ds = open_dataset(str(big_data), tmp_path / "cache", capacity)
    sampler = SeedAwareSampler(ds, seed=3, loader_workers=2)
    loader = DataLoader(ds, batch_size=64, sampler=sampler, num_workers=2,
                        persistent_workers=True, collate_fn=list)
    measured, remote = [], []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        before = node_totals(ds)
        assert_once_each(read_epoch(loader, BIG_SIZE), n)
        d = delta(node_totals(ds), before)
        assert d["accesses"] == n and d["admit_failures"] == 0, d
        assert d["remote_bytes"] == d["fetches"] * BIG_SIZE, d
        measured.append(1 - d["fetches"] / d["accesses"])
        remote.append(d["remote_bytes"])

    seq = np.concatenate([node_order(n, 3, e, range(1), 1) for e in range(3)])
    record = BIG_SIZE + HEADER
    opt_hits = belady(seq, record, capacity).hits
    opt = [float(opt_hits[e * n:(e + 1) * n].mean()) for e in range(3)]
    assert simulate_opt(seq, record, capacity) == pytest.approx(np.mean(opt))
    lru_warm = simulate_lru(seq, record, capacity) * 3 / 2  # epoch 0 has no hits for anyone
    plan_fraction = sampler.plan_capacity / (dataset_bytes + HEADER * n)
    planned = [sampler.plan(e).hit_ratio for e in range(3)]
    print(f"\nfraction {fraction}: measured {[round(x, 4) for x in measured]}, "
          f"plan {[round(x, 4) for x in planned]}, OPT {[round(x, 4) for x in opt]}, "
          f"LRU (warm epochs) {lru_warm:.4f}, plan can hold {plan_fraction:.4f}, "
          f"remote MB/epoch {[round(r / 1e6, 1) for r in remote]} of "
          f"{dataset_bytes / 1e6:.1f}")
    assert measured[0] == 0.0 and remote[0] == dataset_bytes  # cold: each sample once
    for e in (1, 2):
        assert measured[e] >= 0.95 * opt[e], (e, measured[e], opt[e])
        assert measured[e] >= plan_fraction - 0.01, (e, measured[e], plan_fraction)
        assert remote[e] <= (1 - 0.95 * fraction) * dataset_bytes
    assert lru_warm < 0.5 * min(measured[1:])


# --------------------------------------------------------------------------- 3. no double fetch
@pytest.mark.parametrize(("n", "size", "fraction", "batch"), [
    (N, SIZE, 0.5, 32),
    (N, SIZE, None, 32),  # None: room for everything
    (1500, 16000, 0.25, 64),  # the loader runs 4 batches (~1 MB) ahead of the reads
], ids=["4k-half", "4k-all", "16k-quarter"])
def test_no_sample_fetched_twice_per_epoch(tmp_path: Path, n: int, size: int,
                                           fraction: float | None, batch: int) -> None:
    """With prefetch and two workers each sample is requested at most once per epoch, and
    exactly the plan's misses are; when the cache holds everything, warm epochs request
    nothing. ("Everything" takes a little more than the dataset: a nominal fraction of 1.0
    leaves part of it out, see ``plan_capacity``.)"""
    root = write_samples(tmp_path / "remote", n, size)
    dataset_bytes = n * size
    capacity = int(dataset_bytes * (1.15 if fraction is None else fraction))
    with ThrottledServer(str(root), latency=0.002) as server:
        ds = open_dataset(server.url + "/", tmp_path / "cache", capacity)
        sampler = SeedAwareSampler(ds, seed=11)
        if fraction is None:
            assert sampler.plan(1).hit_ratio == sampler.plan(2).hit_ratio == 1.0
        loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=2,
                            collate_fn=list)
        for epoch in range(3):
            sampler.set_epoch(epoch)
            before = Counter(server.paths)
            got = read_epoch(loader, size)
            assert got == sampler.order(epoch).tolist()
            gets = sample_gets(Counter(server.paths) - before, n)
            twice = {i: c for i, c in gets.items() if c > 1}
            assert not twice, f"epoch {epoch}: {len(twice)} samples requested twice: {twice}"
            # Every planned miss is fetched; a few more only when more processes write than
            # the plan reserved segments for (test_plan_holds_with_many_loader_workers): that
            # happens when readers outrun the prefetcher and admit misses themselves.
            misses = n - int(sampler.plan(epoch).hits.sum())
            requests = sum(gets.values())
            assert misses <= requests <= misses + n // 200, (epoch, requests, misses)
            if fraction is None and epoch > 0:
                assert not gets


def test_a_slow_training_loop_gets_every_hit_the_plan_has(tmp_path: Path) -> None:
    """The finding: with steps slower than the remote, the prefetcher ran its window ahead and
    put kept samples into the main store before the reader had deleted what the plan deletes
    first; past its capacity the store evicted samples the plan keeps (a warm epoch got 0.25
    of the plan's 0.45, no counter said why). 300 samples of 30 KB in 64 KiB segments: one
    record per segment, so the store has no room to copy what it cleans."""
    n, size = 300, 30_000
    root = write_samples(tmp_path / "remote", n, size)
    ds = open_dataset(str(root), tmp_path / "cache", n * size // 2, segment_size="64KiB")
    sampler = SeedAwareSampler(ds, seed=5)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        mark = ds.stats()
        for access in sampler:
            assert sample_index(ds[access], size) == access.sample
            time.sleep(0.002)  # the training step
        got = ds.stats(since=mark)
        assert got["fetches"] == n - int(sampler.plan(epoch).hits.sum()), (epoch, got)
    with Store.open(str(tmp_path / "cache" / "store")) as store:
        assert store.counters.evictions == 0  # the plan deletes; the store never has to


def test_a_loader_reading_far_behind_the_sampler_loses_no_staged_sample(tmp_path: Path) -> None:
    """The finding: a small staging area (1 byte, rounded up to its minimum) and a loader
    holding 2 x 2 x 200 samples between the sampler and its reads: FIFO cleaning dropped
    staged samples before their read, fetched again (2,030 fetches for 2,000 misses, and
    kept ones then missed in later epochs: 1,433 for 1,377)."""
    n, size = 2000, 4096
    root = write_samples(tmp_path / "src", n, size)
    ds = open_dataset(str(root), tmp_path / "cache", "3MB", staging_bytes=1)
    sampler = SeedAwareSampler(ds, seed=0, loader_workers=2)
    loader = DataLoader(ds, batch_size=200, sampler=sampler, num_workers=2, prefetch_factor=2,
                        collate_fn=list)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        mark = ds.stats()
        for _ in loader:
            time.sleep(0.01)
        got = ds.stats(since=mark)
        planned = n - int(sampler.plan(epoch).hits.sum())
        # Up to 0.5% more: under load a worker reads its batch late, the prefetcher's count
        # of unread staged bytes then leaves that late sample out (so that one never read
        # does not hold back the rest), and FIFO cleaning drops it: 2 of 232 staged samples
        # fetched again, in 1 run of 8 on a loaded machine (left as it is; see the stop-30
        # note). The finding above is 15-28 times that.
        assert planned <= got["fetches"] <= planned + n // 200, (epoch, planned, got)


@pytest.mark.parametrize("staging", [None, 1], ids=["default-staging", "least-staging"])
def test_eight_ranks_of_a_node_still_prefetch(tmp_path: Path, staging: int | None) -> None:
    """The finding: the default 256 MiB staging area was 16 segments, and each of a node's
    ranks holds two: at 7 or more ranks no staging window was left, and (with 8979b8d's
    budget) nothing at all was prefetched. Rank 0 of 8, in one process."""
    n, size = 2000, 4096
    root = write_samples(tmp_path / "src", n, size)
    options = {} if staging is None else {"staging_bytes": staging}
    ds = open_dataset(str(root), tmp_path / "cache", "3MB", **options)
    sampler = SeedAwareSampler(ds, seed=0, num_replicas=8, rank=0, local_world_size=8,
                               loader_workers=0)
    if staging is None:
        assert ds.cache.staging_window(8) > 0 and sampler.prefetch_window > 1
    mark = ds.stats()
    for access in sampler:
        assert sample_index(ds[access], size) == access.sample
        time.sleep(0.001)  # the training step: the prefetcher gets ahead
    assert ds.stats(since=mark)["prefetched"] > 0


# --------------------------------------------------------------------------- 4. torchrun
TORCHRUN_TIMEOUT = 120


def split_by_marks(log: list[str], epochs: int) -> list[Counter]:  # type: ignore[type-arg]
    """The server's requests per epoch, between the ranks' ``/_mark/...`` requests."""
    marks = {f"/_mark/{m}": i for i, m in enumerate(["start", *(f"end{e}" for e in
                                                                range(epochs))])}
    seen = [marks[p] for p in log if p in marks]
    assert seen == list(range(epochs + 1)), seen
    out: list[Counter] = []  # type: ignore[type-arg]
    current: Counter | None = None  # type: ignore[type-arg]
    for path in log:
        if path in marks:
            if current is not None:
                out.append(current)
            current = Counter()
        elif current is not None:
            current[path] += 1
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("n", "drop_last"), [(2001, False), (2001, True)])
def test_torchrun_two_ranks_share_one_cache(tmp_path: Path, n: int, drop_last: bool) -> None:
    """Two ranks of one node (gloo), one cache dir, one remote: per epoch each rank reads
    ``rank_order``, together every sample once (DistributedSampler's padding or dropped
    tail aside), and the remote serves each sample at most once per epoch."""
    root = write_samples(tmp_path / "remote", n, SIZE)
    out = tmp_path / "out"
    out.mkdir()
    epochs, seed, world = 3, 5, 2
    with ThrottledServer(str(root), latency=0.002) as server:
        server.paths = PathLog()
        run_torchrun(
            [str(Path(__file__).with_name("_torchrun_cache.py")), server.url,
             str(tmp_path / "cache"), str(out), "--samples", str(n), "--size", str(SIZE),
             "--capacity", str(5 * MIB), "--epochs", str(epochs), "--seed", str(seed),
             "--num-workers", "1", "--watchdog", str(TORCHRUN_TIMEOUT - 20),
             *(["--drop-last"] if drop_last else [])],
            TORCHRUN_TIMEOUT, nproc=world,
            hint=f" (the ranks dump their stacks at {TORCHRUN_TIMEOUT - 20} s)")
        log = list(server.paths.log)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    per_epoch = split_by_marks(log, epochs)
    per_rank = n // world if drop_last else -(-n // world)
    for r, result in enumerate(ranks):
        assert (result["rank"], result["world"], result["local_world"]) == (r, world, world)
        assert result["node_ranks"] == [0, 1]
    for epoch in range(epochs):
        union: Counter[int] = Counter()
        for r, result in enumerate(ranks):
            got = result["epochs"][epoch]
            assert got == rank_order(n, seed, epoch, r, world, drop_last=drop_last).tolist()
            assert len(got) == per_rank
            union.update(got)
        extra = per_rank * world - n  # > 0: padding (read twice); < 0: dropped (unread)
        assert sorted(union.values()).count(2) == max(extra, 0)
        assert len(union) == n - max(-extra, 0)
        assert set(union.values()) <= {1, 2}
        gets = sample_gets(per_epoch[epoch], n)
        assert all(gets[i] <= union[i] for i in gets)  # a padded sample may be read twice
        once = {i: c for i, c in gets.items() if c > 1 and union[i] == 1}
        assert not once, f"epoch {epoch}: fetched more than once: {once}"
        print(f"\ntorchrun n={n} drop_last={drop_last} epoch {epoch}: {sum(gets.values())} "
              f"sample requests for {sum(union.values())} accesses")
        if epoch > 0:
            assert sum(gets.values()) < 0.75 * n  # the shared cache serves the rest


# --------------------------------------------------------------------------- 5. resume
def test_resume_mid_epoch_and_at_epoch_boundary(small_data: Path, tmp_path: Path) -> None:
    batch, k = 16, 40
    cache_dir = tmp_path / "cache"

    def build() -> tuple[CachedDataset, SeedAwareSampler, DataLoader]:
        ds = open_dataset(str(small_data), cache_dir, CAPACITY)
        sampler = SeedAwareSampler(ds, seed=21)
        return ds, sampler, DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=2,
                                       collate_fn=list)

    ds, sampler, loader = build()
    sampler.set_epoch(0)
    assert_once_each(read_epoch(loader, SIZE), N)
    sampler.set_epoch(1)
    before = read_epoch(loader, SIZE, stop_after=k)
    assert len(before) == k * batch
    state = sampler.state_dict(consumed=k * batch)
    assert (state["epoch"], state["consumed"]) == (1, k * batch)
    ds.cache.close()  # what the process's exit does
    del ds, sampler, loader
    gc.collect()

    ds, sampler, loader = build()
    sampler.load_state_dict(json.loads(json.dumps(state)))  # as saved in a checkpoint
    assert (sampler.epoch, len(sampler)) == (1, N - k * batch)
    sampler.set_epoch(1)  # the training loop's call for the resumed epoch keeps the position
    after = read_epoch(loader, SIZE)
    assert after == sampler.order(1).tolist()[k * batch:]
    assert_once_each(before + after, N)
    sampler.set_epoch(2)
    t0 = node_totals(ds)
    got = read_epoch(loader, SIZE)
    assert got == sampler.order(2).tolist()
    assert_once_each(got, N)
    fetched = delta(node_totals(ds), t0)["fetches"]
    planned = N - int(sampler.plan(2).hits.sum())
    assert fetched <= planned + N // 100, (fetched, planned)  # the cache survived the restart

    # At an epoch boundary: the rest of that epoch is empty, then the next one as usual.
    state = sampler.state_dict()
    assert (state["epoch"], state["consumed"]) == (2, N)
    ds.cache.close()
    del ds, sampler, loader
    gc.collect()
    _, sampler, loader = build()
    sampler.load_state_dict(state)
    assert (sampler.epoch, len(sampler)) == (2, 0)
    sampler.set_epoch(2)
    assert read_epoch(loader, SIZE) == []
    sampler.set_epoch(3)
    assert len(sampler) == N
    got = read_epoch(loader, SIZE)
    assert got == sampler.order(3).tolist()
    assert_once_each(got, N)


# --------------------------------------------------------------------------- 6. plan
@pytest.mark.parametrize("nodes", [1, 2])
def test_sampler_plan_is_the_whole_sequence_belady(small_data: Path, tmp_path: Path,
                                                   nodes: int) -> None:
    """Belady over the node's accesses of every epoch. A node that reads every sample each
    epoch admits only a fixed set (as many hits, no writes once it is cached); one of two
    nodes, which reads a different half each epoch, caches what it reads next."""
    ds = open_dataset(str(small_data), tmp_path / "cache", CAPACITY)
    sampler = SeedAwareSampler(ds, seed=4, prefetch=False, num_replicas=nodes, rank=0,
                               local_world_size=1)
    orders = [node_order(N, 4, e, range(1), nodes) for e in range(4)]
    held = fixed_set(np.full(N, SIZE + HEADER), sampler.plan_capacity) if nodes == 1 \
        else None
    if nodes == 1:  # every next use lies in the next epoch: one run over all of them
        whole = belady(np.concatenate(orders), SIZE + HEADER, sampler.plan_capacity,
                       admit=held)
        parts = np.split(whole.hits, 4)
    else:  # a next use two epochs on is past the plan's horizon: epoch by epoch
        parts, carried = [], {}
        for e in range(3):
            got = belady(orders[e], SIZE + HEADER, sampler.plan_capacity,
                         horizon=orders[e + 1], carried=carried)
            parts.append(got.hits)
            carried = got.carried
    for e in range(3):  # the last epoch's plan looks one epoch further: compare 0..2
        assert sampler.plan(e).hits.tolist() == parts[e].tolist()
    warm = [sampler.plan(e) for e in (1, 2)]
    if nodes == 1:  # warm epochs write nothing: every kept access was a hit
        assert not any((p.keep & ~p.hits).any() for p in warm)
    else:  # Belady's caching of the next half beats any fixed set's hits
        assert min(p.hit_ratio for p in warm) > sampler.plan_capacity / (N * (SIZE + HEADER))


@pytest.mark.parametrize("capacity", [3 * MIB, CAPACITY, 7 * MIB])
def test_a_resumed_sampler_plans_from_two_epochs_back_not_from_epoch_0(
        small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capacity: int) -> None:
    """Regression: a sampler resumed at epoch E planned epochs 0..E (a million samples at
    epoch 100: minutes). It plans E-2..E from an empty cache, and the plan is the same."""
    ds = open_dataset(str(small_data), tmp_path / "cache", capacity)
    continuous = SeedAwareSampler(ds, seed=5, prefetch=False)
    for e in range(31):
        continuous.plan(e)  # one epoch after another, as a job that never stopped
    calls = []
    real = sampler_module.belady
    monkeypatch.setattr(sampler_module, "belady",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    resumed = SeedAwareSampler(ds, seed=5, prefetch=False)
    resumed.load_state_dict(continuous.state_dict(consumed=7) | {"epoch": 30})
    plan = resumed.plan(30)
    assert len(calls) == 3
    assert plan.keep.tolist() == continuous.plan(30).keep.tolist()
    assert plan.hits.tolist() == continuous.plan(30).hits.tolist()
    resumed.set_epoch(90_000)  # a jump: planned from 89,998, not from 30
    resumed.plan(90_000)
    assert len(calls) == 6


def test_next_epochs_plan_is_made_while_this_epoch_runs(small_data: Path,
                                                        tmp_path: Path) -> None:
    """Belady over a million samples takes seconds: epoch e + 1's plan is computed in the
    background once epoch e starts, and is the plan a fresh sampler computes."""
    ds = open_dataset(str(small_data), tmp_path / "cache", CAPACITY)
    sampler = SeedAwareSampler(ds, seed=4, prefetch=False)
    iter(sampler).__next__()  # epoch 0 starts
    assert sampler._ahead is not None
    sampler._ahead.join(timeout=60)
    assert 1 in sampler._plans  # made without being asked for
    fresh = SeedAwareSampler(ds, seed=4, prefetch=False)
    assert sampler.plan(1).keep.tolist() == fresh.plan(1).keep.tolist()
    assert sampler.plan(1).hits.tolist() == fresh.plan(1).hits.tolist()


# ------------------------------------------------- regressions (segments, staging)
def _count_in_child(tmp_path: Path, _: CachedDataset) -> None:
    SharedCounters(str(tmp_path / "counters.bin")).add(accesses=1)


def _read_in_child(tmp_path: Path, ds: CachedDataset) -> None:
    assert ds[3] == sample_bytes(3, SIZE, 0)


def _open_in_child(tmp_path: Path, ds: CachedDataset) -> None:
    other = CachedDataset(ds.cache.source, tmp_path / "other", CAPACITY)
    assert other[3] == sample_bytes(3, SIZE, 0)
    other.cache.close()


@pytest.mark.parametrize(("module", "lock", "use"), [
    ("lcache.data.shared", "_SETUP", _count_in_child),  # a counter slot, the claims' fd
    ("lcache.data.cache", "_OPENING", _open_in_child),  # a new cache's stores
    ("lcache.store.store", "_REOPENING", _read_in_child),  # an inherited store
], ids=["counters", "cache", "store"])
def test_a_child_forked_while_a_thread_holds_a_setup_lock_does_not_hang(
        tmp_path: Path, small_data: Path, module: str, lock: str, use: Any) -> None:
    """A process forked while another thread of its parent held one of the locks that set
    up per-process state (a prefetch thread opening the cache as a DataLoader forks its
    workers) must not wait for that thread: it does not exist in the child."""
    import importlib

    held = getattr(importlib.import_module(module), lock)
    ds = open_dataset(str(small_data), tmp_path / "cache", CAPACITY)
    ds[0]  # opened in the parent: the child reopens what it inherits
    code = fork_while_held(held, use, tmp_path, ds)
    assert code is not None, f"the child waited for {lock}, which its parent's thread held at fork"
    assert code == 0


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_plan_holds_with_many_loader_workers(small_data: Path, tmp_path: Path) -> None:
    log = tmp_path / "fetches.log"
    ds = open_dataset(LoggedSource(str(small_data), log), tmp_path / "cache", N * SIZE // 2)
    sampler = SeedAwareSampler(ds, seed=11, prefetch=False)  # the workers admit every miss
    loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=6, collate_fn=list)
    fetched = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        assert_once_each(read_epoch(loader, SIZE), N)
        fetched.append(len(log.read_text().split()) - sum(fetched))
    assert fetched == [N - int(sampler.plan(e).hits.sum()) for e in range(2)]


def _touch_and_drop(source: str, cache_dir: Path) -> str:
    ds = CachedDataset(source, cache_dir, CAPACITY)
    ds[0]
    return ds.cache.staging_dir


def test_dropped_cache_frees_its_staging_memory(small_data: Path, tmp_path: Path) -> None:
    staging = _touch_and_drop(str(small_data), tmp_path / "cache")
    gc.collect()
    try:
        assert not os.path.exists(staging), f"{staging} outlived its cache object"
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def test_fixture_files_encode_their_index(small_data: Path) -> None:
    files = sorted(small_data.iterdir())
    assert len(files) == N
    for i in (0, 1, N - 1):
        assert sample_index(files[i].read_bytes(), SIZE) == i
    damaged = bytearray(files[3].read_bytes())
    damaged[100] ^= 1
    with pytest.raises(AssertionError):
        sample_index(bytes(damaged), SIZE)


@pytest.mark.parametrize(("kwargs", "word"), [
    ({"seed": None}, "seed"), ({"seed": 1.5}, "seed"), ({"seed": -1}, "seed"),
    ({"seed": True}, "seed"), ({"num_replicas": 2.5}, "num_replicas"),
    ({"num_replicas": 2, "rank": 1, "local_world_size": -1}, "local_world_size"),
    ({"loader_workers": -1}, "loader_workers"), ({"prefetch_threads": 0}, "prefetch_threads"),
])
def test_sampler_arguments_that_are_not_whole_numbers_are_named(
        tmp_path: Path, small_data: Path, kwargs: dict[str, Any], word: str) -> None:
    ds = open_dataset(str(small_data), tmp_path / "cache", CAPACITY)
    with pytest.raises(ConfigError, match=word):
        SeedAwareSampler(ds, **kwargs)


@pytest.mark.parametrize(("env", "word"), [
    ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0'"), ({"RANK": "x"}, "RANK='x'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "not below WORLD_SIZE"),
    ({"WORLD_SIZE": "1" * 30}, "WORLD_SIZE='1111"),
])
def test_a_launch_environment_that_is_not_whole_numbers_is_named(
        tmp_path: Path, small_data: Path, monkeypatch: pytest.MonkeyPatch,
        env: dict[str, str], word: str) -> None:
    """Were a ZeroDivisionError and bare ValueErrors from int()."""
    ds = open_dataset(str(small_data), tmp_path / "cache", CAPACITY)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=word):
        SeedAwareSampler(ds)


def test_epochs_and_states_a_sampler_cannot_take_are_refused(tmp_path: Path,
                                                            small_data: Path) -> None:
    """A step number given as the epoch would plan every epoch from 0 up to it (hours);
    other bad epochs and states were TypeErrors, AttributeErrors and KeyErrors."""
    ds = open_dataset(str(small_data), tmp_path / "cache", CAPACITY)
    sampler = SeedAwareSampler(ds, num_replicas=1, rank=0, prefetch=False)
    for epoch in (2**40, -1, "3", None, 1.0, True):
        with pytest.raises(ConfigError, match="epoch"):
            sampler.set_epoch(epoch)  # type: ignore[arg-type]
    sampler.set_epoch(np.int64(2))  # numpy integers are whole numbers
    assert sampler.epoch == 2
    for state in (None, {}, {"epoch": 0}, [1]):
        with pytest.raises(ConfigError, match="not a sampler state"):
            sampler.load_state_dict(state)  # type: ignore[arg-type]
    bad = {**sampler.state_dict(consumed=0), "epoch": 10**9}
    with pytest.raises(ConfigError, match="epoch"):
        sampler.load_state_dict(bad)
    array_seed = {**sampler.state_dict(consumed=0), "seed": np.array([3, 3])}
    with pytest.raises(ConfigError, match="sampler state has seed="):  # "truth value" before
        sampler.load_state_dict(array_seed)


def test_a_state_taken_after_set_epoch_starts_that_epoch(tmp_path: Path,
                                                        small_data: Path) -> None:
    """Regression: set_epoch(e + 1) kept the count of epoch e, so a state taken before
    iterating the new epoch resumed it as consumed, and the whole epoch was skipped."""
    ds = open_dataset(str(small_data), tmp_path / "cache", CAPACITY)
    sampler = SeedAwareSampler(ds, num_replicas=1, rank=0, prefetch=False)
    first = [a.sample for a in sampler]
    sampler.set_epoch(1)
    state = sampler.state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 0)
    again = SeedAwareSampler(ds, num_replicas=1, rank=0, prefetch=False)
    again.load_state_dict(state)
    again.set_epoch(1)
    assert_once_each([a.sample for a in again], len(first))
