"""Deletes survive an index rebuilt from the segments (issue 10, finding 5).

A delete clears the key's index entry; its record stays in the log until its segment is
cleaned. The delete journal (``lcache.store.deletes``) keeps what the rebuild needs to leave
such records out, and compaction of the journal keeps an entry while a segment that may hold
an older record of the key exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lcache.errors import StoreFullError
from lcache.store import Store, fsck
from lcache.store.compaction import live_bytes, live_records
from lcache.store.deletes import COMPACT_ABOVE, ENTRY, decode, encode, encode_few
from lcache.store.files import existing_generations
from lcache.store.segment import list_segments
from lcache.testing import faults, flip_bit, locate, pattern_bytes

from .conftest import KIB, SEG

VALUE = 4 * KIB
PER_SEG = SEG // (VALUE + 32)


def rebuild_indexes(root: Path) -> None:
    """Damage both index headers and let fsck --repair rebuild them from the segments."""
    for kind in ("int", "bytes"):
        flip_bit(faults.index_path(root, kind), 1, 2)
    repaired = fsck(root, repair=True)
    assert repaired.clean, repaired.problems


def test_a_delete_flushed_before_a_crash_stays_deleted(open_store: Any, store_dir: Path) -> None:
    store = open_store()
    store.put_many(list(range(20)), [pattern_bytes(100, k) for k in range(20)])
    store.put(b"name", b"value")
    store.flush()
    assert store.delete(7) and store.delete(b"name")
    store.flush()
    store._abandon()  # kill -9: no close, no seal
    rebuild_indexes(store_dir)
    with Store.open(store_dir) as again:
        assert again.get(7) is None and again.get(b"name") is None
        assert again.get(8) == pattern_bytes(100, 8)


def test_a_key_put_again_after_its_delete_is_not_hidden(open_store: Any,
                                                        store_dir: Path) -> None:
    """The old record (below the delete's floor) is cleaned; the new one, written in a later
    segment, is the key's only record and above the floor: the rebuild serves it."""
    store = open_store(policy="fifo", capacity=8 * SEG, max_writers=1)
    store.put(0, b"old")
    store.put_many(list(range(1, PER_SEG + 1)), [pattern_bytes(VALUE, k)
                                                 for k in range(1, PER_SEG + 1)])
    assert store.delete(0)
    store.put_many(list(range(1000, 1000 + 2 * PER_SEG)), [pattern_bytes(VALUE, k)
                                                          for k in range(2 * PER_SEG)])
    store.put(0, b"new")
    store.gc(0.0)  # the old record's segment is cleaned
    store.close()
    rebuild_indexes(store_dir)
    with Store.open(store_dir) as again:
        assert again.get(0) == b"new"


def test_journal_compaction_keeps_entries_an_old_segment_still_needs(open_store: Any,
                                                                    store_dir: Path) -> None:
    """Regression guard: compacting the journal while the segment holding a deleted key's
    record still exists must keep the key's entry; once that segment is gone, it may go."""
    store = open_store(policy="fifo", capacity=64 * SEG, max_writers=1)
    keys = list(range(600))
    store.put_many(keys, [pattern_bytes(200, k) for k in keys])  # segments 1, 2, 3...
    victim = locate(store, 3)
    assert victim is not None
    for k in keys[1::2]:  # 300 deletes: the journal outgrows its compaction threshold
        assert store.delete(k)
    assert existing_generations(str(store_dir), "deletes") == [0]
    store.gc(1.0)  # compacts the journal; no segment is fully dead, so none is cleaned
    assert existing_generations(str(store_dir), "deletes") == [1], "no compaction happened"
    assert faults.segment_ids(store_dir)[0][0] == victim.segment
    store.close()
    rebuild_indexes(store_dir)
    with Store.open(store_dir) as again:
        assert again.get(3) is None, "a deleted key came back after the rebuild"
        assert all(again.get(k) == pattern_bytes(200, k) for k in keys[0::2])


def test_many_deletes_stay_within_the_capacity(open_store: Any, store_dir: Path) -> None:
    capacity = 16 * SEG
    store = open_store(policy="fifo", capacity=capacity, max_writers=1)
    for rnd in range(6):
        keys = list(range(rnd * 3000, (rnd + 1) * 3000))
        store.put_many(keys, [b"x"] * len(keys))
        for k in keys:
            store.delete(k)
        assert faults.disk_usage(store_dir) <= capacity, f"round {rnd}"
    store.close()
    assert fsck(store_dir).clean


@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 2**64 - 1)), max_size=20),
       st.integers(0, 2**32 - 1))
@settings(max_examples=200, deadline=None)
def test_one_at_a_time_encoder_matches_the_batch_encoder(keys: list[tuple[int, int]],
                                                        floor: int) -> None:
    few = encode_few(keys, floor)
    batch = encode(np.array([k for k, _ in keys], np.uint8),
                   np.array([key for _, key in keys], np.uint64),
                   np.full(len(keys), floor, np.uint32))
    assert few == batch
    kinds, keys64, floors, bad = decode(few)
    assert bad == 0 and list(zip(kinds.tolist(), keys64.tolist(), strict=True)) == keys
    assert (floors == floor).all()


def test_a_full_planned_store_cleans_the_deadest_segment_first(open_store: Any,
                                                              store_dir: Path) -> None:
    """The planned policy (the sample cache's) compares the live bytes of the oldest segments
    at every allocation, with one index lookup for all of them (``live_bytes``): the segment
    whose records were deleted goes first, the older full ones stay."""
    store = open_store(capacity=12 * SEG, policy="planned")
    key = 0
    while len(list_segments(str(store_dir))[1]) < 6:  # six sealed segments
        store.put_many([key], [pattern_bytes(VALUE, key)])
        key += 1
    sealed = sorted(list_segments(str(store_dir))[1])
    dead = sealed[3]
    summary = store._summary(dead)
    for k in summary.keys.tolist():
        store.delete(int(k))
    summaries = [store._summary(s) for s in sealed]
    expected = [int(s.lengths[live_records(s, store._ints(), store._hashes())].sum())
                for s in summaries]
    assert live_bytes(summaries, store._ints(), store._hashes()) == expected
    assert expected[3] == 0 and all(b > 0 for i, b in enumerate(expected) if i != 3)
    while dead in list_segments(str(store_dir))[0]:  # fill until something is cleaned
        store.put_many([key], [pattern_bytes(VALUE, key)])
        key += 1
    assert set(sealed) - {dead} <= set(list_segments(str(store_dir))[0])


def test_journal_compaction_drops_entries_whose_records_are_gone(open_store: Any,
                                                                 store_dir: Path) -> None:
    """An entry goes once no segment below its floor holds a record of its key, though an
    older segment, wholly live, stays. The finding: entries stayed while any segment below
    their floor did, and in a nearly full cache (its oldest segments never cleaned) the
    journal grew by every delete, counted against the capacity."""
    store = open_store(policy="planned", capacity=256 * SEG, max_writers=1)
    kept = list(range(PER_SEG))  # the first segment: never deleted from, never cleaned
    store.put_many(kept, [pattern_bytes(VALUE, k) for k in kept])
    for rnd in range(1, 17):
        keys = list(range(rnd * 1000, rnd * 1000 + 4 * PER_SEG))
        store.put_many(keys, [pattern_bytes(VALUE, k) for k in keys])
        for k in keys[: -PER_SEG // 2]:
            assert store.delete(k)
        store.gc(0.5)  # the dead segments are cleaned; their keys' entries need nothing
    assert faults.segment_ids(store_dir)[0][0] == 1  # the oldest is still there
    entries = store._journal().size() // ENTRY.itemsize
    # what grows between compactions and the last round's deletes, of 16 rounds' 848
    assert entries <= COMPACT_ABOVE // ENTRY.itemsize + 4 * PER_SEG, entries
    store.close()
    rebuild_indexes(store_dir)
    with Store.open(store_dir) as again:
        assert all(again.get(k) == pattern_bytes(VALUE, k) for k in kept)
        assert again.get(16000) is None and again.get(1000) is None


def test_a_key_deleted_over_and_over_keeps_one_journal_entry(open_store: Any,
                                                             store_dir: Path) -> None:
    """The finding (attack helper 100): a key put and deleted again and again, its first
    record in a wholly live old segment, kept a journal entry per delete (20,000 for one
    key, still growing), and a planned store of 9 segments evicted live records for the
    journal's room. The highest floor hides whatever a lower one does: one entry stays."""
    store = open_store(policy="planned", capacity=9 * SEG, max_writers=1)
    store.put(b"hot", b"v0")
    live = list(range(200))
    store.put_many(live, [pattern_bytes(1000, k) for k in live])
    for _ in range(6000):
        store.put(b"hot", b"x" * 3000)
        assert store.delete(b"hot")
    entries = store._journal().size() // ENTRY.itemsize
    assert entries <= 2 * COMPACT_ABOVE // ENTRY.itemsize, entries  # 6,000 before
    assert all(store.get(k) == pattern_bytes(1000, k) for k in live)
    assert store.counters.evictions == 0
    store.close()
    rebuild_indexes(store_dir)  # and the one entry still hides every old record
    with Store.open(store_dir) as again:
        assert again.get(b"hot") is None
        assert all(again.get(k) == pattern_bytes(1000, k) for k in live)


def test_deletes_alone_evict_no_live_record_of_a_planned_store(open_store: Any,
                                                               store_dir: Path) -> None:
    """Deletes grow the journal, which counts against the capacity. In a full "planned"
    store (every live record wanted) a handle that only deletes leaves the cleaning to the
    next segment a writer makes, whose copies have a home. The finding: it cleaned with
    nowhere to copy, evicting every live record of what it cleaned; a nearly full cache's
    reads (its plan's deletes) lost samples the plan kept."""
    store = open_store(policy="planned", capacity=64 * SEG, max_writers=2)
    key = 0
    while store.counters.evictions == 0:  # filled to the capacity bound
        store.put_many(list(range(key, key + 100)), [pattern_bytes(200, k)
                                                     for k in range(key, key + 100)])
        key += 100
    present = [k for k in range(key) if k in store]
    rng = np.random.default_rng(0)
    gone = set(rng.choice(present, len(present) // 3, replace=False).tolist())
    with Store.open(store_dir) as reader:  # another handle, with no segment of its own
        for k in sorted(gone):
            assert reader.delete(k)
        assert reader._journal().size() > SEG  # grown past what the capacity left free
        lost = [k for k in present if k not in gone and reader.get(k) is None]
    assert lost == []
    store.close()


def test_a_damaged_segment_counter_never_brings_a_deleted_key_back(open_store: Any,
                                                                   store_dir: Path) -> None:
    """The finding (attack helper 102): with the ``lock`` page's segment counter damaged
    past 32 bits, a delete raised struct.error after its key had left the index and before
    it was journaled, and an index rebuilt from the segments served the key again. The
    floor is now at most the highest one, which hides every record of the key; a new
    segment is a StoreFullError (ids used up)."""
    store = open_store()
    keys = list(range(50))
    store.put_many(keys, [pattern_bytes(1000, k) for k in keys])
    store._meta._set("next_segment", 1 << 33)
    assert store.delete(3)
    with pytest.raises(StoreFullError, match="every segment id"):
        store.put_many(list(range(100, 200)), [pattern_bytes(1000, k) for k in range(100)])
    store.close()
    rebuild_indexes(store_dir)
    with Store.open(store_dir) as again:
        assert again.get(3) is None
        assert all(again.get(k) == pattern_bytes(1000, k) for k in keys if k != 3)
