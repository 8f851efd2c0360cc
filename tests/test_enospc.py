"""A full device: puts raise DiskFullError (an OSError with ENOSPC), the store stays readable.

The real variant mounts a 3 MiB tmpfs (root only) under a store whose capacity is far larger,
and runs the scenario in a child process: when an index page cannot be allocated, the kernel
answers a store into the shared mapping with SIGBUS, which must not take the test runner down.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lcache import DiskFullError, LCacheError
from lcache.store import Store, fsck
from lcache.testing import pattern_bytes

from .conftest import KIB, MIB, mounted_tmpfs

VALUE = 16 * KIB


def _key(i: int) -> int | bytes:
    # Int keys 64 apart touch a new index page every few puts (staying inside the index's
    # initial 1 MiB); a few byte keys too.
    return b"bytes-%d" % i if i % 7 == 3 else i * 64


def _disk_full_scenario(root: str, filler: str, out: str) -> None:
    """Runs in a child process; writes what it saw to ``out`` as JSON."""
    seen: dict[str, Any] = {}
    store = Store.open(root, capacity=64 * MIB, segment_size=256 * KIB, max_writers=2,
                       max_byte_keys=64)
    flushed: list[int] = []
    i = 0
    try:
        while i < 1000:
            store.put(_key(i), pattern_bytes(VALUE, i))
            i += 1
            if i % 4 == 0:
                store.flush()
                flushed = list(range(i))
        seen["error"] = None
    except DiskFullError as exc:
        seen.update(error=type(exc).__name__, errno=exc.errno, message=str(exc),
                    is_oserror=isinstance(exc, OSError), is_lcache=isinstance(exc, LCacheError))
    seen["puts_before_full"] = i
    failed = i
    # Still readable: everything flushed, with the right bytes; the failed put is not there.
    got = store.get_many([_key(j) for j in flushed])
    seen["flushed"] = len(flushed)
    seen["flushed_ok"] = sum(v is not None and bytes(v) == pattern_bytes(VALUE, j)
                             for j, v in zip(flushed, got, strict=True))
    failed_value = store.get(_key(failed))
    seen["failed_put_readable_as"] = None if failed_value is None else (
        "its value" if failed_value == pattern_bytes(VALUE, failed) else "WRONG BYTES")
    # Still full. Tiny values still fit in the segment's last page, but each key's index entry
    # lies in a page of the index never used before: that page cannot be had either.
    again = []
    for j in range(8):
        key = (200 + j) * 256
        try:
            store.put(key, b"tiny")
            again.append("ok" if store.get(key) == b"tiny" else "WRONG BYTES")
        except DiskFullError:
            again.append("full")
    seen["again"] = again
    # Free space: puts work again.
    os.unlink(filler)
    after = []
    for j in range(failed + 10, failed + 15):
        store.put(_key(j), pattern_bytes(VALUE, j))
        after.append(store.get(_key(j)) == pattern_bytes(VALUE, j))
    seen["after_freeing"] = after
    store.flush()
    seen["fsck_open"] = fsck(root).problems
    store.close()
    seen["fsck_closed"] = fsck(root).problems
    store = Store.open(root)
    got = store.get_many([_key(j) for j in flushed])
    seen["flushed_ok_after_reopen"] = sum(
        v is not None and bytes(v) == pattern_bytes(VALUE, j)
        for j, v in zip(flushed, got, strict=True))
    store.close()
    Path(out).write_text(json.dumps(seen))


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "mnt", "3m") as mnt:
        yield mnt


def _run_child(target: Any, args: tuple[Any, ...], what: str, sigbus: str) -> None:
    """Run ``target`` in a spawned process: a SIGBUS or a hang fails the test, not pytest."""
    child = multiprocessing.get_context("spawn").Process(target=target, args=args)
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
        pytest.fail(f"{what} hung")
    assert child.exitcode == 0, (f"{what}: the process died with exit code {child.exitcode}"
                                 + (f" (SIGBUS: {sigbus})" if child.exitcode == -7 else ""))


@pytest.mark.root
def test_disk_full_on_a_small_tmpfs(small_tmpfs: Path, tmp_path: Path) -> None:
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\0" * (1536 * KIB))  # freed later to make room again
    out = tmp_path / "seen.json"
    _run_child(_disk_full_scenario, (str(small_tmpfs / "store"), str(filler), str(out)),
               "the disk-full scenario",
               "a store into an index page the full filesystem could not back")
    seen = json.loads(out.read_text())
    assert seen["error"] == "DiskFullError", seen
    assert seen["errno"] == errno.ENOSPC and seen["is_oserror"] and seen["is_lcache"]
    assert "full" in seen["message"]
    assert 10 < seen["puts_before_full"] < 1000
    assert seen["flushed"] > 0
    assert seen["flushed_ok"] == seen["flushed"]
    assert seen["failed_put_readable_as"] != "WRONG BYTES"
    assert "WRONG BYTES" not in seen["again"] and "full" in seen["again"], seen["again"]
    assert all(seen["after_freeing"]), seen["after_freeing"]
    assert seen["fsck_open"] == [] and seen["fsck_closed"] == []
    assert seen["flushed_ok_after_reopen"] == seen["flushed"]


def _fill(path: Path) -> None:
    """Write ``path`` until the filesystem is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 * KIB))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def _read_a_full_store(root: str, out: str) -> None:
    """Runs in a child process on a store whose filesystem is full: every read path."""
    seen: dict[str, Any] = {"fsck": fsck(root).problems}
    try:
        seen["fsck_repair"] = fsck(root, repair=True).problems
    except DiskFullError:
        seen["fsck_repair"] = "disk full"  # allowed: it is a clear error, not a signal
    store = Store.open(root)
    holes = [25_000, 75_000, 125_000, 1 << 20]  # pages of the int index never written
    seen["holes"] = [store.get(k) for k in holes] + [k in store for k in holes]
    got = store.get_many(list(range(0, 200_000, 5_000)))
    seen["hits"] = [i * 5_000 for i, v in enumerate(got) if v is not None]
    seen["bytes"] = store.get(b"name") == b"value"
    seen["delete_hole"] = store.delete(75_000)
    seen["live_keys"] = store.stats()["live_keys"]
    store.close()
    Path(out).write_text(json.dumps(seen))


@pytest.mark.root
def test_no_read_touches_an_unallocated_index_page_on_a_full_tmpfs(tmp_path: Path) -> None:
    """Regression: fsck died with SIGBUS reading holes of the mapped index on a full tmpfs
    (there, even a read of a hole through a shared mapping needs a new page)."""
    with mounted_tmpfs(tmp_path / "mnt", "2m") as mnt:
        root = str(mnt / "store")
        with Store.open(root, capacity=64 * MIB, segment_size=256 * KIB, max_writers=2) as s:
            s.put_many(list(range(0, 200_000, 50_000)), [b"v"] * 4)  # far apart: sparse
            s.put(b"name", b"value")
        _fill(mnt / "filler")
        out = tmp_path / "seen.json"
        _run_child(_read_a_full_store, (root, str(out)), "reading a store on a full filesystem",
                   "a read through an index page that has no blocks")
    seen = json.loads(out.read_text())
    assert seen["fsck"] == [] and seen["fsck_repair"] in ([], "disk full"), seen
    assert seen["holes"] == [None] * 4 + [False] * 4
    assert seen["hits"] == [0, 50_000, 100_000, 150_000]
    assert seen["bytes"] and seen["delete_hole"] is False and seen["live_keys"] == 5


def test_disk_full_from_patched_pwritev(open_store: Any, store_dir: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(direct_writes=False)
    for k in range(20):
        store.put(k, pattern_bytes(3000, k))
    store.flush()

    def full(*args: Any, **kwargs: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(DiskFullError) as info:
        store.put(99, pattern_bytes(3000, 99))
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    with pytest.raises(OSError):  # catchable as the builtin too
        store.put_many([100, 101], [b"a", b"b"])
    assert store.get(99) is None
    for k, v in zip(range(20), store.get_many(list(range(20))), strict=True):
        assert v is not None and bytes(v) == pattern_bytes(3000, k)
    monkeypatch.setattr(os, "pwritev", real)
    store.put(99, b"after")
    assert store.get(99) == b"after"
    store.close()
    assert fsck(store_dir).clean
