"""The cache's batched path (``CachedDataset.__getitems__``, which a DataLoader with a batch
size calls): exact counters, the plan's keep flags obeyed, no sample fetched twice by the
processes of a node, a reader killed mid-batch, skipping samples that fail, the capacity as a
fraction, per-epoch figures and resuming from the loader's state alone.

Samples encode their index and are checked byte for byte (``_torchrun_cache.sample_index``).
Fetches are counted at a loopback HTTP server, so they are exact whatever fetches them.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from lcache.data import Access, CachedDataset, SeedAwareSampler  # noqa: E402
from lcache.data.sizing import cache_capacity  # noqa: E402
from lcache.errors import ConfigError  # noqa: E402
from lcache.store.fsck import fsck  # noqa: E402
from lcache.testing.remote import ThrottledServer  # noqa: E402

from ._torchrun_cache import sample_bytes, sample_index  # noqa: E402
from .conftest import KIB, MIB, subprocess_env  # noqa: E402

N, SIZE = 400, 4 * KIB
CAPACITY = 8 * MIB  # room for every sample


def write_samples(root: Path, n: int, size: int) -> Path:
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"{i:06d}.bin").write_bytes(sample_bytes(i, size))
    return root


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_samples(tmp_path / "remote" / "data", N, SIZE)


def gets(server: ThrottledServer) -> Counter[int]:
    """GETs per sample index so far."""
    out: Counter[int] = Counter()
    for path, count in server.paths.items():
        name = path.rsplit("/", 1)[-1]
        if name.endswith(".bin"):
            out[int(name[:-4])] += count
    return out


def check(items: list[Any], indices: list[int]) -> None:
    assert [sample_index(item, SIZE) for item in items] == indices


def test_a_batch_counts_exactly_and_follows_the_keep_flags(data: Path, tmp_path: Path) -> None:
    with ThrottledServer(str(data.parent)) as server:
        ds = CachedDataset(server.url + "/data/", tmp_path / "cache", CAPACITY)
        cache = ds.cache
        try:
            check(ds.__getitems__([0, 1, 2, 3]), [0, 1, 2, 3])  # read-through: admitted
            assert cache.prefetch_many([10, 11], [False, False]) == 2 * SIZE  # staged
            mark = ds.stats()
            batch = [Access(0, True), Access(1, False), Access(10, None), Access(11, True),
                     Access(20, True), Access(21, False), 2, Access(20, False)]
            check(ds.__getitems__(batch), [0, 1, 10, 11, 20, 21, 2, 20])
            d = ds.stats(since=mark)
            assert (d["accesses"], d["fetches"], d["from_ssd"], d["from_ram"]) == (8, 2, 3, 3)
            assert d["deleted"] == 1 and d["served_bytes"] == 8 * SIZE
            assert d["remote_bytes"] == 2 * SIZE and d["skipped"] == 0
            main, staging = cache.store(), cache.staging()
            assert [k in main for k in (0, 1, 2, 20, 21)] == [True, False, True, False, False]
            assert 10 not in staging and 11 not in staging  # staged samples are read once
            assert gets(server) == Counter({**dict.fromkeys(range(4), 1), 10: 1, 11: 1,
                                            20: 1, 21: 1})
            assert ds.__getitems__([]) == []
            with pytest.raises(IndexError, match="outside"):
                ds.__getitems__([1, N])
            with pytest.raises(ValueError, match="since= takes"):
                ds.stats(since=d)
        finally:
            cache.close()


def _read_batches(url: str, cache_dir: str, order: list[int], start: Any, out: str) -> None:
    ds = CachedDataset(url, cache_dir, CAPACITY)
    start.wait()
    got: list[int] = []
    for lo in range(0, len(order), 25):
        got += [sample_index(item, SIZE) for item in ds.__getitems__(order[lo : lo + 25])]
    ds.cache.close()
    Path(out).write_text(" ".join(map(str, got)))


def test_processes_reading_the_same_batches_fetch_each_sample_once(data: Path,
                                                                  tmp_path: Path) -> None:
    """Four processes read the same samples at once, each in its own order and batches:
    the claims let one of them fetch a sample, and the others find it cached."""
    with ThrottledServer(str(data.parent), latency=0.003) as server:
        url = server.url + "/data/"
        CachedDataset(url, tmp_path / "cache", CAPACITY).cache.close()
        orders = [random.Random(p).sample(range(N), N) for p in range(4)]
        ctx = multiprocessing.get_context("fork")
        start = ctx.Barrier(4)
        procs = [ctx.Process(target=_read_batches, args=(url, str(tmp_path / "cache"), order,
                                                         start, str(tmp_path / f"got{p}")))
                 for p, order in enumerate(orders)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(120)
            assert proc.exitcode == 0
        results = [list(map(int, (tmp_path / f"got{p}").read_text().split())) for p in range(4)]
        assert results == orders
        fetched = gets(server)
        assert set(fetched) == set(range(N)) and max(fetched.values()) == 1, \
            {i: c for i, c in fetched.items() if c > 1}


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_dataloader_workers_batch_every_sample_once_and_fetch_it_once(tmp_path: Path) -> None:
    n, size = 1000, 8 * KIB
    data = write_samples(tmp_path / "remote" / "data", n, size)
    with ThrottledServer(str(data.parent), latency=0.001) as server:
        ds = CachedDataset(server.url + "/data/", tmp_path / "cache", 0.5)
        sampler = SeedAwareSampler(ds, seed=3, loader_workers=3)
        loader = DataLoader(ds, batch_size=24, sampler=sampler, num_workers=3,
                            collate_fn=list)
        try:
            for epoch in range(3):
                sampler.set_epoch(epoch)
                before = gets(server)
                mark = ds.stats()
                got = [sample_index(item, size) for batch in loader for item in batch]
                assert got == sampler.order(epoch).tolist()
                fetched = gets(server) - before
                assert max(fetched.values(), default=0) == 1
                misses = n - int(sampler.plan(epoch).hits.sum())
                assert misses <= sum(fetched.values()) <= misses + n // 200
                d = ds.stats(since=mark)
                assert d["accesses"] == n
                # every access is one of: a fetch it waited for, the SSD, staged memory
                assert d["demand_misses"] + d["from_ssd"] + d["from_ram"] == n, d
                print(epoch, {k: d[k] for k in ("fetches", "prefetched", "from_ssd",
                                                "from_ram", "deleted")})
                assert d["fetches"] == sum(fetched.values())
        finally:
            ds.cache.close()


READER = """
import random, sys
from lcache.data import Access, CachedDataset
ds = CachedDataset(sys.argv[1], sys.argv[2], sys.argv[3])
rng = random.Random(int(sys.argv[4]))
print("ready", flush=True)
while True:
    batch = [Access(rng.randrange(len(ds)), rng.choice((None, True, False)))
             for _ in range(rng.randrange(1, 64))]
    if rng.random() < 0.2:
        ds.cache.prefetch_many(rng.sample(range(len(ds)), 16), [rng.random() < 0.5] * 16)
    ds.__getitems__(batch)
"""


@pytest.mark.slow
def test_reader_killed_mid_batch(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    n, size = 600, 8 * KIB
    for i in range(n):
        (root / f"{i:06d}.bin").write_bytes(sample_bytes(i, size))
    cache, capacity = tmp_path / "cache", str(4 * MIB)  # below the dataset: it evicts
    probe = CachedDataset(str(root), cache, capacity)
    stores = [cache / "store", Path(probe.cache.staging_dir)]
    probe.cache.close()
    rng = random.Random(11)
    for rnd in range(2):
        child = subprocess.Popen([sys.executable, "-c", READER, str(root), str(cache),
                                  capacity, str(rnd)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=subprocess_env())
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 60)
        if not ready or child.stdout.readline().strip() != b"ready":
            child.kill()
            pytest.fail(f"the reader did not start: {child.communicate()[1][-2000:]!r}")
        time.sleep(0.5 + rng.random())
        assert child.poll() is None, child.communicate()[1][-2000:]
        os.kill(child.pid, signal.SIGKILL)
        child.communicate(timeout=30)
        ds = CachedDataset(str(root), cache, capacity)  # recovers both stores
        try:
            assert ds.stats()["fetches"] > 0
            order = rng.sample(range(n), n)
            for lo in range(0, n, 50):
                items = ds.__getitems__(order[lo : lo + 50])
                assert [sample_index(item, size) for item in items] == order[lo : lo + 50]
        finally:
            ds.cache.close()
        for path in stores:
            if path.exists():
                report = fsck(str(path))
                assert report.clean, (rnd, path, report.problems)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_skip_leaves_failing_samples_out_and_counts_them(data: Path, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    with ThrottledServer(str(data.parent)) as server:
        url = server.url + "/data/"
        strict = CachedDataset(url, tmp_path / "strict", CAPACITY)
        ds = CachedDataset(url, tmp_path / "cache", CAPACITY, on_error="skip")
        try:
            gone = {7, 100, 101, 333}
            for i in gone:
                (data / f"{i:06d}.bin").unlink()
            with pytest.raises(Exception, match="sample 100"):
                strict.__getitems__([99, 100])
            sampler = SeedAwareSampler(ds, seed=1, prefetch=False)
            loader = DataLoader(ds, batch_size=20, sampler=sampler, num_workers=2,
                                collate_fn=list)
            batches = [[sample_index(item, SIZE) for item in batch] for batch in loader]
            order = sampler.order(0).tolist()
            assert [i for batch in batches for i in batch] == [i for i in order if i not in gone]
            assert len(batches) == N // 20  # shorter batches, none dropped
            assert ds.stats()["skipped"] == len(gone)
            assert ds[7] is None and ds[8] is not None
            assert ds.stats()["skipped"] == len(gone) + 1
            with pytest.raises(Exception, match="every sample of a batch"):
                ds.__getitems__([100, 101])
        finally:
            strict.cache.close()
            ds.cache.close()


def test_capacity_as_a_fraction_of_the_dataset(data: Path, tmp_path: Path) -> None:
    total = N * SIZE
    assert cache_capacity(0.4, total) == cache_capacity("40%", total) == int(0.4 * total)
    assert cache_capacity(" 150 % ", total) == int(1.5 * total)
    assert cache_capacity("8MiB", total) == 8 * MIB and cache_capacity(4096, total) == 4096
    for bad in ("0.4", 0.0, -0.5, float("nan"), float("inf"), "x%", "-3%", "%", "1_0%",
                "\u0664\u0660%"):
        with pytest.raises(ConfigError):
            cache_capacity(bad, total)
    ds = CachedDataset(str(data), tmp_path / "cache", "300%")
    try:
        assert ds.stats()["capacity"] == 3 * total
    finally:
        ds.cache.close()
    with pytest.raises(ConfigError, match="raise the capacity"):
        CachedDataset(str(data), tmp_path / "small", 0.01)
