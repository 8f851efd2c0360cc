"""Eviction policies: FIFO evicts oldest first, copying nothing; LRU (CLOCK) keeps what was read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lcache.store import EvictionPolicy, Store, make_policy, register_policy
from lcache.store import policy as policy_module
from lcache.store.layout import save_config
from lcache.testing import disk_usage, largest_segment, pattern_bytes

from .conftest import KIB, SEG

VALUE = 4 * KIB  # 15 records of 4 KiB + header fill a 64 KiB segment
PER_SEG = SEG // (VALUE + 32)


def fill(store: Any, keys: range) -> None:
    for k in keys:
        store.put(k, pattern_bytes(VALUE, k))


def present(store: Any, keys: Sequence[int]) -> list[int]:
    got = store.get_many(list(keys))
    for k, v in zip(keys, got, strict=True):
        assert v is None or bytes(v) == pattern_bytes(VALUE, k), f"wrong bytes for {k}"
    return [k for k, v in zip(keys, got, strict=True) if v is not None]


def test_fifo_evicts_oldest_first_and_copies_nothing(open_store: Any) -> None:
    store = open_store(policy="fifo", capacity=6 * SEG, max_writers=1)
    n = 20 * PER_SEG  # far more than fits
    fill(store, range(n))
    store.get_many(list(range(0, n, 3)))  # reads must not change FIFO order
    fill(store, range(n, n + 2 * PER_SEG))
    total = n + 2 * PER_SEG
    alive = present(store, range(total))
    assert store.counters.evictions > 0
    assert store.counters.gc_bytes_copied == 0, "FIFO must not copy (write amplification 1)"
    assert alive, "the newest records must still be there"
    first = alive[0]
    assert alive == list(range(first, total)), "FIFO kept an older record over a newer one"
    # capacity - segment x (writers + 1) of sealed data stays: at least 2 segments' worth
    assert total - first >= 2 * PER_SEG
    assert disk_usage(store.root) <= 6 * SEG


def test_lru_keeps_records_that_were_read(open_store: Any) -> None:
    store = open_store(policy="lru", capacity=8 * SEG, max_writers=1)
    old = range(0, 2 * PER_SEG)  # the two oldest segments
    fill(store, old)
    # A third of each segment: copies may fill at most half of the segment they go to.
    hot = range(0, 2 * PER_SEG, 3)
    cold = [k for k in old if k % 3]
    assert len(present(store, hot)) == len(hot)  # sets their reference bits
    # Push the old segments out: enough new data to evict them once, not the copies too
    # (sealed data may reach 6 segments here).
    fill(store, range(1000, 1000 + 7 * PER_SEG))
    assert store.counters.evictions > 0
    assert store.counters.gc_bytes_copied > 0, "CLOCK copies referenced records forward"
    assert present(store, cold) == [], "unread records of the same age should be gone"
    assert present(store, hot) == list(hot), "records that were read should have been kept"


def test_lru_second_chance_is_given_once(open_store: Any) -> None:
    """A copied record's bit is cleared: unless read again, the next pass evicts it."""
    store = open_store(policy="lru", capacity=8 * SEG, max_writers=1)
    fill(store, range(PER_SEG))
    present(store, range(PER_SEG))
    fill(store, range(1000, 1000 + 24 * PER_SEG))  # several full passes over the capacity
    assert present(store, range(PER_SEG)) == []


def test_lru_copy_forward_leaves_room_for_the_put(open_store: Any) -> None:
    """Copying referenced records into a new segment must not push a put past segment_size.

    Regression: the new writer was filled by CLOCK copies, then the record that asked for it
    was appended anyway, so a 64 KiB segment grew past 64 KiB.
    """
    store = open_store(policy="lru", capacity=5 * SEG, max_writers=1)
    small = range(60)  # ~62 KiB of 1 KiB records in one segment, all read (referenced)
    for k in small:
        store.put(k, pattern_bytes(KIB, k))
    store.get_many(list(small))
    for k in range(1000, 1012):  # one 40 KiB record per segment pushes the small ones out
        store.put(k, pattern_bytes(40 * KIB, k))
        assert largest_segment(store.root) <= SEG, f"after put({k})"
        assert disk_usage(store.root) <= 5 * SEG
    assert store.counters.gc_bytes_copied > 0
    assert store.get(1011) == pattern_bytes(40 * KIB, 1011)
    for k, v in zip(small, store.get_many(list(small)), strict=True):
        assert v is None or bytes(v) == pattern_bytes(KIB, k)


def test_gc_compacts_mostly_dead_segments_without_evicting(open_store: Any) -> None:
    store = open_store(policy="fifo", capacity=16 * SEG, max_writers=1)
    fill(store, range(4 * PER_SEG))
    for k in range(4 * PER_SEG):
        if k % 4:
            store.delete(k)
    store.flush()
    before = disk_usage(store.root)
    freed = store.gc(0.5)
    assert freed > 0
    assert store.counters.evictions == 0
    assert store.counters.gc_bytes_copied > 0
    assert disk_usage(store.root) < before
    assert present(store, range(4 * PER_SEG)) == list(range(0, 4 * PER_SEG, 4))


def test_policy_registry(open_store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered policy is the one a store opened with its name evicts by.

    Regression (of the test): it only called the registered policy itself, never through a
    store. This one evicts the newest sealed segment first, the opposite of FIFO, so what
    survives shows whose order the store followed.
    """
    monkeypatch.setattr(policy_module, "_REGISTRY", dict(policy_module._REGISTRY))
    assert make_policy("fifo").name == "fifo"
    assert make_policy("lru").tracks_references
    asked: list[list[int]] = []

    class NewestFirst:
        name = "newest-first-test"
        tracks_references = False
        greedy = False

        def victim_order(self, sealed: Sequence[int]) -> list[int]:
            asked.append(list(sealed))
            return sorted(sealed, reverse=True)

        def keep(self, keys: Any, kinds: Any, referenced: Any) -> Any:
            return np.zeros(len(keys), dtype=bool)

    register_policy("newest-first-test", NewestFirst)
    policy: EvictionPolicy = make_policy("newest-first-test")
    assert policy.victim_order([1, 3, 2]) == [3, 2, 1]
    asked.clear()

    store = open_store(policy="newest-first-test", capacity=6 * SEG, max_writers=1)
    n = 8 * PER_SEG  # far more than fits
    fill(store, range(n))
    assert asked, "the store never asked the registered policy for victims"
    assert store.counters.evictions > 0
    alive = present(store, range(n))
    # FIFO would have evicted the oldest first; this policy keeps them and evicts the newest
    assert alive[: 2 * PER_SEG] == list(range(2 * PER_SEG)), alive
    assert n - 1 in alive  # the record just put sits in the active segment
    assert len(alive) < n - PER_SEG


@pytest.mark.parametrize("policy", ["fifo", "lru"])
def test_policy_may_change_on_reopen(open_store: Any, store_dir: Any, policy: str) -> None:
    store = open_store(policy="fifo" if policy == "lru" else "lru")
    store.put(1, b"x")
    store.close()
    again = open_store(policy=policy)
    assert again.config.policy == policy
    assert again.get(1) == b"x"


def test_evicting_an_old_segment_keeps_a_key_rewritten_since(open_store: Any) -> None:
    store = open_store(policy="fifo", capacity=6 * SEG, max_writers=1)
    fill(store, range(PER_SEG))  # keys 0.. fill the oldest segment
    store.put(0, b"rewritten")  # now lives in a newer segment
    fill(store, range(PER_SEG, 5 * PER_SEG))  # push the oldest segment out
    assert store.get(1) is None  # the oldest segment was evicted...
    assert store.get(0) == b"rewritten"  # ...but not the newer record of key 0


def test_a_new_segment_has_the_room_asked_for_after_clock_copies(tmp_path: Path) -> None:
    """A writer asked for ``need`` bytes gets them even when making its segment copied
    referenced records forward into it (what gc and large puts rely on). The finding (the
    kill -9 torture test): copies ending mid-block took up to a block of the reserve, and a
    gc, left 40,960 bytes for a segment's 43,247 live ones, evicted a live record."""
    store = Store.open(tmp_path / "s", capacity=1 << 20, segment_size=64 << 10, policy="lru",
                       max_writers=2)
    short = []
    for i in range(3000):
        store.put(i % 900, bytes(1000 + (i * 37) % 900))  # sizes off block boundaries
        if i % 50 == 0:
            store.get_many(list(range(900)))  # every CLOCK bit set: cleaning copies
        if i % 97 == 0:
            need = 20000 + (i * 7919) % 30000
            writer = store._writer_with_room(need)
            if writer.room < need:
                short.append((need, writer.room))
    assert store.counters.gc_bytes_copied > 0
    assert short == []
    store.close()


def test_planned_cleaning_finds_dead_records_past_the_oldest_segments(tmp_path: Path) -> None:
    """A full "planned" store (every live record wanted) whose owner deletes one record for
    each it adds, anywhere in the store, evicts nothing: cleaning finds the segment with the
    dead record. The finding: it compared only the 64 oldest segments, and in a cache of
    the whole dataset (a few deletes an epoch, spread over hundreds of segments) cleaned a
    wholly live one instead, evicting a sample the plan kept: 45 an epoch, fetched again."""
    value = 8 * KIB - 32  # record header included, 8 whole records fill a 64 KiB segment
    store = Store.open(tmp_path / "s", capacity=200 * SEG, segment_size=SEG,
                       policy="planned", max_writers=1)
    key = 0
    while store.counters.evictions == 0:  # filled to the capacity bound
        store.put(key, pattern_bytes(value, key))
        key += 1
    assert len(store._list().sealed) > 2 * 64  # more segments than one window compares
    full = store.counters.evictions
    live = [k for k in range(key) if k in store]
    rng = np.random.default_rng(0)
    for _ in range(400):
        gone = live.pop(int(rng.integers(len(live))))  # mostly past the oldest segments
        store.delete(gone)
        store.put(key, pattern_bytes(value, key))
        live.append(key)
        key += 1
    assert store.counters.gc_segments > 100
    assert store.counters.evictions == full
    store.close()


@pytest.mark.parametrize("policy", ["fifo", "lru", "planned"])
def test_a_capacity_lowered_on_reopen_is_kept_at_once(open_store: Any, store_dir: Path,
                                                      policy: str) -> None:
    """The finding (attack helper 101): reopened with a lower capacity, the store held 2.8
    times it for good when nothing more was written (a warm cache reads only), since only a
    new segment enforced the bound. It now evicts at the open, in the policy's order; what
    stays reads back as written."""
    store = open_store(policy=policy, capacity=16 * SEG, max_writers=1)
    n = 12 * PER_SEG
    fill(store, range(n))
    if policy == "planned":  # dead records among the live
        for k in range(0, n, 2):
            store.delete(k)
    store.close()
    assert disk_usage(store_dir) > 6 * SEG
    store = open_store(policy=policy, capacity=6 * SEG, max_writers=1)
    assert disk_usage(store_dir) <= 6 * SEG
    alive = present(store, range(n))
    assert alive and store.counters.evictions > 0
    if policy == "fifo":
        assert alive == list(range(alive[0], n))  # the oldest went first
    store.close()
    assert Store.open(store_dir).config.capacity == 6 * SEG  # and stays the capacity


def test_an_open_fits_a_store_left_over_its_capacity(open_store: Any, store_dir: Path) -> None:
    """The finding (attack helper 102): an open killed while it evicted for a lowered
    capacity had already saved it, and the next open, asking nothing new, fitted nothing:
    only a lowered capacity was fitted at the open."""
    store = open_store(policy="fifo", capacity=16 * SEG, max_writers=1)
    fill(store, range(12 * PER_SEG))
    store.close()
    save_config(str(store_dir), replace(store.config, capacity=6 * SEG))  # what it left
    with Store.open(store_dir) as again:
        assert disk_usage(store_dir) <= 6 * SEG
        alive = present(again, range(12 * PER_SEG))
        assert alive == list(range(alive[0], 12 * PER_SEG))


def test_a_handle_follows_a_capacity_another_open_lowered(open_store: Any,
                                                          store_dir: Path) -> None:
    """The finding (attack helper 102): a handle opened before another open lowered the
    capacity wrote on under the old one, and the store stayed over the new one."""
    old = open_store(policy="fifo", capacity=16 * SEG, max_writers=2)
    fill(old, range(4 * PER_SEG))
    open_store(policy="fifo", capacity=6 * SEG, max_writers=2).close()
    fill(old, range(4 * PER_SEG, 12 * PER_SEG))
    assert old.config.capacity == 6 * SEG and disk_usage(store_dir) <= 6 * SEG
    alive = present(old, range(12 * PER_SEG))
    assert alive == list(range(alive[0], 12 * PER_SEG))
