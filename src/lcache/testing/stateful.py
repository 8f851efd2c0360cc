"""A Hypothesis state machine that checks a store against a plain dict (imports hypothesis).

The model is a ``dict`` of what each key should hold. The store may differ from it in two ways
only, and each is checked:

* a key may be missing once the store has evicted something since the key was last put
  (``counters.evictions`` grew); the key then leaves the model;
* after a crash (``Store._abandon()``: every descriptor dropped without sealing or flushing, as
  ``kill -9`` leaves it, optionally with the unsealed segment's unsynced tail cut off at a random
  point, as a torn write leaves it) a key changed since the last durability point may hold any
  value it held since then, or be missing.

* after ``fsck --repair`` rebuilt the indexes from the segments (a damaged index), any key may
  be missing (a key with two records in the log is left out), but none may come back after its
  delete or hold a value it no longer held.

Never allowed: bytes that were not the model's value, a key back after a delete, a bound on disk
bytes exceeded, a segment longer than ``segment_size``, an unclean ``fsck`` at a reopen.

Use it from a test with ``run_state_machine_as_test(lambda: StoreMachine(tmp_dir), settings=...)``.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Sequence

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lcache.store import Store, fsck
from lcache.store import record as _record
from lcache.testing import faults
from lcache.testing.strategies import byte_keys, int_keys, keys, values
from lcache.testing.values import pattern_bytes

Key = int | bytes
KIB = 1024


class StoreMachine(RuleBasedStateMachine):
    """put / get / get_many / delete / gc / flush / reopen / crash, checked against a dict."""

    segment_size = 64 * KIB
    #: Small enough that a handful of large values force eviction: sealed segments may hold
    #: capacity - segment_size x (max_writers + 1) - index bytes, about 110 KiB here.
    capacity = 4 * 64 * KIB
    max_writers = 1
    max_byte_keys = 256

    def __init__(self, base_dir: str | os.PathLike[str]) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="machine-", dir=os.fspath(base_dir))
        self.policy = "lru"
        self._store: Store | None = None
        self.model: dict[Key, bytes] = {}
        #: cumulative eviction count when the key was last put
        self.put_at: dict[Key, int] = {}
        #: key -> every value it held since the last durability point (None = absent)
        self.dirty: dict[Key, list[bytes | None]] = {}
        self.evictions_before = 0
        #: (segment, offset) up to which the active segment is known to be synced
        self.durable: tuple[int, int] = (0, 0)
        #: every key ever put or deleted (a rebuilt index must not bring a deleted one back)
        self.touched: set[Key] = set()

    # ------------------------------------------------------------------ helpers
    @property
    def store(self) -> Store:
        if self._store is None:
            raise AssertionError("the store is not open")
        return self._store

    def _open(self) -> None:
        self._store = Store.open(
            self.dir, capacity=self.capacity, segment_size=self.segment_size,
            max_writers=self.max_writers, policy=self.policy, max_byte_keys=self.max_byte_keys,
        )

    def _evictions(self) -> int:
        return self.evictions_before + self.store.counters.evictions

    def _writer_pos(self) -> tuple[int, int]:
        writer = self.store._writer
        return (writer.segment, writer.offset) if writer is not None else (0, 0)

    def _note_change(self, key: Key, new: bytes | None) -> None:
        self.touched.add(key)
        if key not in self.dirty:
            self.dirty[key] = [self.model.get(key)]
        self.dirty[key].append(new)

    def _forget(self, key: Key) -> None:
        self.model.pop(key, None)
        self.put_at.pop(key, None)

    def _check(self, key: Key, got: bytes | memoryview | None) -> None:
        expected = self.model.get(key)
        if got is None:
            if expected is not None:
                assert self._evictions() > self.put_at[key], (
                    f"key {key!r} is missing although nothing was evicted since its put"
                )
                self._forget(key)
            return
        assert expected is not None, f"key {key!r} returned {len(got)} bytes but is not stored"
        assert bytes(got) == expected, (
            f"key {key!r}: wrong bytes ({len(got)} bytes, expected {len(expected)})"
        )

    def _check_all(self) -> None:
        model_keys = list(self.model)
        for key, got in zip(model_keys, self.store.get_many(model_keys), strict=True):
            self._check(key, got)

    # ------------------------------------------------------------------ rules
    @initialize(policy=st.sampled_from(["fifo", "lru"]))
    def open_store(self, policy: str) -> None:
        self.policy = policy
        self._open()

    def _put(self, key: Key, value: bytes) -> None:
        before = self._writer_pos()
        self.store.put(key, value)
        self._note_change(key, value)
        self.model[key] = value
        self.put_at[key] = self._evictions()
        seg, off = self._writer_pos()
        if seg != before[0]:
            # A new segment: what eviction copied into it was synced before this record.
            _, _, kb = _record.key_parts(key)
            self.durable = (seg, off - _record.record_size(kb, len(value)))

    @rule(key=int_keys(), value=values())
    def put_int(self, key: int, value: bytes) -> None:
        self._put(key, value)

    @rule(key=byte_keys(), value=values())
    def put_bytes(self, key: bytes, value: bytes) -> None:
        self._put(key, value)

    @rule(items=st.lists(st.tuples(keys(), values()), min_size=1, max_size=8))
    def put_many(self, items: list[tuple[Key, bytes]]) -> None:
        before = self._writer_pos()
        copied = self.store.counters.gc_bytes_copied
        # A batch that spans segments may evict its own first records to make room for the
        # later ones: count from before the call.
        evictions = self._evictions()
        self.store.put_many([k for k, _ in items], [v for _, v in items])
        for key, value in items:
            self._note_change(key, value)
            self.model[key] = value
            self.put_at[key] = evictions
        seg, off = self._writer_pos()
        if seg != before[0] or self.store.counters.gc_bytes_copied > copied:
            # Copies made while allocating were synced, and precede the batch's records in
            # the new segment: the first of those records is where the unsynced part starts.
            starts = [loc.offset for k, _ in items
                      if (loc := faults.locate(self.store, k)) is not None and loc.segment == seg]
            self.durable = (seg, min(starts, default=off))

    @rule(key=keys(), size=st.integers(8 * KIB, 20 * KIB), seed=st.integers(0, 255))
    def put_large(self, key: Key, size: int, seed: int) -> None:
        self._put(key, pattern_bytes(size, seed))

    @rule(key=keys())
    def get(self, key: Key) -> None:
        self._check(key, self.store.get(key))

    @rule(batch=st.lists(keys(), max_size=12), as_array=st.booleans())
    def get_many(self, batch: list[Key], as_array: bool) -> None:
        query: Sequence[Key] | np.ndarray = batch
        if as_array and batch and all(isinstance(k, int) for k in batch):
            query = np.array(batch, dtype=np.uint64)
        got = self.store.get_many(query)
        assert len(got) == len(batch)
        for key, view in zip(batch, got, strict=True):
            self._check(key, view)

    @rule()
    def scan(self) -> None:
        """Read every key the model holds (an epoch; with ``lru`` it marks them all)."""
        self._check_all()

    @rule(key=keys())
    def delete(self, key: Key) -> None:
        existed = self.store.delete(key)
        if key in self.model:
            if not existed:
                assert self._evictions() > self.put_at[key], (
                    f"delete({key!r}) found nothing although nothing was evicted"
                )
        else:
            assert not existed, f"delete({key!r}) removed a key that was not stored"
        self._note_change(key, None)
        self._forget(key)

    @rule(min_dead=st.sampled_from([0.0, 0.3, 0.5, 0.9]))
    def gc(self, min_dead: float) -> None:
        copied = self.store.counters.gc_bytes_copied
        self.store.gc(min_dead)
        if self.store.counters.gc_bytes_copied > copied:  # copies are synced before unlinking
            self.durable = self._writer_pos()

    @rule()
    def flush(self) -> None:
        self.store.flush()
        self.dirty.clear()
        self.durable = self._writer_pos()

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.evictions_before += self.store.counters.evictions
        self._store = None
        report = fsck(self.dir)
        assert report.clean, f"fsck after close: {report.problems}"
        self._open()
        self.dirty.clear()
        self.durable = (0, 0)
        self._check_all()

    @rule()
    def rebuild_indexes(self) -> None:
        """Close, damage both index headers, ``fsck --repair`` (rebuilds them), reopen."""
        self.store.close()
        # +1: every key put so far may now be a miss, as after an eviction
        self.evictions_before += self.store.counters.evictions + 1
        self._store = None
        for kind in ("int", "bytes"):
            faults.flip_bit(faults.index_path(self.dir, kind), 1, 2)
        report = fsck(self.dir, repair=True)
        assert report.clean, f"fsck --repair left {report.problems}"
        self._open()
        self.dirty.clear()
        self.durable = (0, 0)
        touched = sorted(self.touched, key=repr)
        for key, got in zip(touched, self.store.get_many(touched), strict=True):
            self._check(key, got)  # a deleted key that came back fails here

    @rule(cut=st.booleans(), where=st.floats(0.0, 1.0))
    def crash(self, cut: bool, where: float) -> None:
        """kill -9 (``_abandon``), optionally tearing the unsynced tail, then reopen."""
        store = self.store
        writer = store._writer
        store._abandon()
        self.evictions_before += store.counters.evictions
        self._store = None
        orphan = writer.segment if writer is not None else None
        if cut and writer is not None:
            size = os.stat(writer.path).st_size
            low = self.durable[1] if self.durable[0] == writer.segment else 0
            faults.truncate(writer.path, low + int((size - low) * where))
        before = fsck(self.dir)
        for problem in before.problems:  # only the crashed writer's segment may look wrong
            assert orphan is not None and re.search(rf"segment {orphan}\b", problem), (
                f"fsck after a crash reports damage outside the crashed segment: {problem}"
            )
        self._open()
        after = fsck(self.dir)
        assert after.clean, f"fsck after recovery: {after.problems}"
        for key, allowed in self.dirty.items():
            got = self.store.get(key)
            if got is None:
                self._forget(key)
                continue
            assert any(got == v for v in allowed if v is not None), (
                f"after a crash key {key!r} holds bytes it never held since the last flush"
            )
            self.model[key] = got
            self.put_at[key] = self._evictions()
        self.dirty.clear()
        self.durable = (0, 0)
        self._check_all()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def within_capacity(self) -> None:
        used = faults.disk_usage(self.dir)
        assert used <= self.capacity, f"{used} bytes on disk exceed the capacity {self.capacity}"

    @invariant()
    def segments_within_size(self) -> None:
        longest = faults.largest_segment(self.dir)
        assert longest <= self.segment_size, (
            f"a segment holds {longest} bytes, more than segment_size {self.segment_size}"
        )

    def teardown(self) -> None:
        try:
            if self._store is not None:
                self._store.close()
        finally:
            self._store = None
            shutil.rmtree(self.dir, ignore_errors=True)
