"""The byte-key index is sized from the capacity and grows with the keys (issue 10, finding 2).

Regression: a 6 MiB store of 256 KiB segments put 1 KB values under byte keys until put #1743
raised StoreFullError with no segment and no key left: the fixed 2**20-slot hash index (24 MiB
sparse, never shrinking) had taken the whole capacity, one 4 KiB page per key.
"""

from __future__ import annotations

import multiprocessing
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lcache import ConfigError
from lcache.store import Store, fsck
from lcache.store.files import existing_generations
from lcache.testing import disk_usage, pattern_bytes

from .conftest import KIB, MIB, SEG, subprocess_env


def byte_key(i: int) -> bytes:
    return b"sample/%08d.jpg" % i


def test_small_byte_key_store_stays_writable(tmp_path: Path) -> None:
    capacity = 6 * MIB
    store = Store.open(tmp_path / "s", capacity=capacity, segment_size="256KiB")
    n = 6000
    for i in range(n):
        store.put(byte_key(i), pattern_bytes(1000, i))
        if i % 500 == 0:
            assert disk_usage(store.root) <= capacity, f"after put #{i}"
    assert disk_usage(store.root) <= capacity
    stats = store.stats()
    assert stats["segments"] > 5 and stats["live_keys"] > 2500, stats
    # the newest records are all there (eviction takes the oldest first)
    recent = [byte_key(i) for i in range(n - 1000, n)]
    got = store.get_many(recent)
    assert all(v is not None and bytes(v) == pattern_bytes(1000, n - 1000 + j)
               for j, v in enumerate(got))
    # the index is a small part of the capacity, sized by the keys actually held
    assert stats["index_bytes"] < capacity // 8, stats
    store.close()
    assert fsck(tmp_path / "s").clean


def _reader(root: str, ready: Any, go: Any, out: Any) -> None:
    """Opens the store (mapping the small first table), then, once the parent grew the index
    several times, reads the parent's keys and writes its own."""
    store = Store.open(root)
    assert store.get(byte_key(0)) == b"first"
    ready.set()
    go.wait(60)
    got = store.get_many([byte_key(i) for i in range(2000)])
    hits = sum(v is not None and bytes(v) == pattern_bytes(100, i) for i, v in enumerate(got))
    store.put_many([b"child-%d" % i for i in range(300)], [b"c%d" % i for i in range(300)])
    store.close()
    out.put(hits)


def test_other_processes_follow_a_grown_index(tmp_path: Path) -> None:
    root = str(tmp_path / "s")
    store = Store.open(root, capacity=64 * MIB, segment_size=SEG, max_writers=3)
    store.put(byte_key(0), b"first")
    store.flush()
    first = existing_generations(root, "index-bytes")
    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_reader, args=(root, ready, go, out))
    child.start()
    try:
        assert ready.wait(60)
        store.put_many([byte_key(i) for i in range(2000)],
                       [pattern_bytes(100, i) for i in range(2000)])
        store.flush()
        grown = existing_generations(root, "index-bytes")
        assert grown != first and len(grown) == 1, (first, grown)  # the old files are gone
        go.set()
        hits = out.get(timeout=60)
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert hits == 2000, "the other process did not see the keys put after the growth"
    # the child's puts went into the current table, not into the one it first mapped
    got = store.get_many([b"child-%d" % i for i in range(300)])
    assert all(v is not None and bytes(v) == b"c%d" % i for i, v in enumerate(got))
    store.close()
    assert fsck(root).clean


_GROWER = """
import sys
from lcache.store import Store
store = Store.open(sys.argv[1])
i = int(sys.argv[2])
print("ready", flush=True)
while True:
    keys = [b"k-%d" % j for j in range(i, i + 200)]
    store.put_many(keys, [b"v-%d" % j for j in range(i, i + 200)])
    store.flush()
    i += 200
    print(i, flush=True)
"""


def test_kill_9_during_growth_loses_nothing_flushed(tmp_path: Path) -> None:
    """Writers killed at random moments, many of them inside a growth of the table."""
    root = tmp_path / "s"
    Store.open(root, capacity=256 * MIB, segment_size=4 * MIB, max_writers=2).close()
    rng = random.Random(7)
    flushed = 0
    for _ in range(4):
        child = subprocess.Popen([sys.executable, "-c", _GROWER, str(root), str(flushed)],
                                 stdout=subprocess.PIPE, text=True, env=subprocess_env())
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.3))
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate(timeout=60)
        marks = [int(x) for x in out.split()]
        flushed = max([flushed, *marks])
        report = fsck(root)
        assert all("left unsealed" in p or "leftover" in p for p in report.problems), report
        with Store.open(root) as store:
            got = store.get_many([b"k-%d" % j for j in range(flushed)])
            missing = [j for j, v in enumerate(got) if v is None]
            assert missing == [], f"{len(missing)} flushed keys lost, e.g. {missing[:5]}"
            assert all(bytes(v) == b"v-%d" % j for j, v in enumerate(got) if v is not None)
        assert fsck(root).clean
        assert len(existing_generations(str(root), "index-bytes")) == 1
    assert flushed >= 1000  # the table grew several times over the rounds


def test_minimum_capacity_counts_the_indexes(tmp_path: Path) -> None:
    """Regression: capacity = segment x (writers + 1) was accepted, and the empty store then
    refused its first record (the index files were already on disk)."""
    with pytest.raises(ConfigError, match="for the indexes"):
        Store.open(tmp_path / "a", capacity=3 * SEG, segment_size=SEG, max_writers=2)
    for key in (1, b"a byte key"):
        root = tmp_path / f"min-{type(key).__name__}"
        probe = Store.open(root, capacity=64 * MIB, segment_size=SEG, max_writers=2)
        minimum = probe.config.minimum_capacity()
        probe.close()
        assert 3 * SEG < minimum < 3 * SEG + 64 * KIB
        with Store.open(root, capacity=minimum) as store:
            kb = len(key) if isinstance(key, bytes) else 0
            value = b"x" * (SEG - 32 - kb)  # a record of exactly one segment
            store.put(key, value)
            assert store.get(key) == value
            assert disk_usage(root) <= minimum


def test_an_empty_store_never_refuses_a_record_that_fits(tmp_path: Path) -> None:
    """After its index grew as large as the capacity allows and every key was deleted."""
    capacity = 1 * MIB
    store = Store.open(tmp_path / "s", capacity=capacity, segment_size=SEG, max_writers=2)
    keys = [byte_key(i) for i in range(20_000)]  # more than the largest table holds
    for lo in range(0, len(keys), 1000):  # tiny records: the index weighs more than they do
        store.put_many(keys[lo : lo + 1000], [b"v"] * 1000)
        assert disk_usage(store.root) <= capacity
    assert store.stats()["index_bytes"] > 256 * KIB
    for key in keys:
        store.delete(key)
    store.gc(0.0)
    assert store.stats()["live_keys"] == 0
    big = b"y" * (SEG - 32 - len(b"last"))
    store.put(b"last", big)
    assert store.get(b"last") == big
    assert disk_usage(store.root) <= capacity
    store.close()
    assert fsck(tmp_path / "s").clean


def test_max_byte_keys_bounds_growth_and_may_change(tmp_path: Path) -> None:
    root = tmp_path / "s"
    value = b"v" * 2000  # 30 records a segment: segments seal, so old keys can be evicted
    with Store.open(root, capacity=64 * MIB, segment_size=SEG, max_byte_keys=100,
                    policy="fifo") as store:
        for lo in range(0, 1000, 100):
            store.put_many([byte_key(i) for i in range(lo, lo + 100)], [value] * 100)
        assert store.stats()["live_keys"] < 300  # older keys were evicted to stay under it
        assert store.counters.evictions > 0
        assert store.get(byte_key(999)) == value
    with Store.open(root, max_byte_keys=5000) as store:
        store.put_many([byte_key(i) for i in range(1000, 3000)], [value] * 2000)
        assert store.stats()["live_keys"] >= 2000
