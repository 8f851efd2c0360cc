"""O_DIRECT appends: large batches start on a fresh block (leaving a zero gap) and may be in
flight together; small ones re-write the partial block. Scans and recovery must see through."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lcache.store import Store, fsck


def value(key: int, size: int) -> bytes:
    return (key.to_bytes(8, "little") * (size // 8 + 1))[:size]


def open_store(root: Path) -> Store:
    return Store.open(root, capacity="512MiB", segment_size="32MiB", max_writers=2,
                      policy="fifo")


def put_batches(store: Store) -> dict[int, int]:
    """Large batches (independent) mixed with small ones, record sizes not block multiples."""
    sizes: dict[int, int] = {}
    key = 0
    for batch_records, size in ((700, 3001), (3, 555), (400, 5003), (1, 17), (300, 7777)):
        keys = list(range(key, key + batch_records))
        store.put_many(keys, [value(k, size) for k in keys])
        sizes.update(dict.fromkeys(keys, size))
        key += batch_records
    return sizes


def check(store: Store, sizes: dict[int, int]) -> None:
    keys = list(sizes)
    for k, got in zip(keys, store.get_many(keys), strict=True):
        assert got is not None, f"key {k} missing"
        assert got == value(k, sizes[k]), f"key {k}: wrong bytes"


def test_large_batches_leave_zero_gaps_that_reads_and_seals_handle(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = open_store(root)
    sizes = put_batches(store)
    writer = store._writer
    assert writer is not None
    if writer._direct_fd < 0:
        pytest.skip("the filesystem of tmp_path refuses O_DIRECT")
    starts = [start for start, _ in writer._batches]
    assert any(s % 4096 == 0 and s > 0 for s in starts), "no batch started on a fresh block"
    check(store, sizes)
    store.close()
    assert fsck(root).clean
    with open_store(root) as store:
        check(store, sizes)


def test_recovery_scans_across_the_gaps_after_a_crash(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = open_store(root)
    sizes = put_batches(store)
    store.flush()
    seg_path = store._writer.path if store._writer is not None else ""
    store._abandon()  # like kill -9: the segment is left unsealed
    assert os.path.exists(seg_path)
    report = fsck(root)
    assert not report.clean and "unsealed" in report.problems[0]
    with open_store(root) as store:
        assert store.counters.recovered_segments == 1
        check(store, sizes)  # every flushed record, including those after each gap
    assert fsck(root).clean
