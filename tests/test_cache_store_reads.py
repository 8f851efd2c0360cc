"""The store's warm read path: sealed segments read through memory maps, never into a hole
(SIGBUS on a full tmpfs), always checked, mappings of deleted segments dropped, and records
removed as they are read (``get_many(remove=...)``). (Python's mmap refuses a length past
the end of the file, so a mapping never covers pages beyond it.)"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lcache.store import Store

from .conftest import KIB, mounted_tmpfs, subprocess_env

SETTINGS = {"capacity": "8MiB", "segment_size": "256KiB", "max_writers": 2, "sync": "never"}


def value(key: int, size: int = 3000) -> bytes:
    return key.to_bytes(8, "little") * (size // 8)


def sealed_store(root: Path, n: int = 300, size: int = 3000) -> None:
    """``n`` records in sealed segments (closing seals the active one)."""
    with Store.open(root, **SETTINGS) as store:
        store.put_many(list(range(n)), [value(k, size) for k in range(n)])


def read_calls() -> int:
    """Read system calls of this process so far (every thread): ``syscr`` of /proc/self/io."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("syscr:")).split()[1])


def test_warm_batches_of_sealed_segments_make_no_read_calls(tmp_path: Path) -> None:
    sealed_store(tmp_path / "s")
    with Store.open(tmp_path / "s", **SETTINGS) as store:
        keys = list(range(0, 300, 7))
        assert [bytes(v) for v in store.get_many(keys)] == [value(k) for k in keys]  # maps
        own = -read_calls() + read_calls()  # what reading the counter costs
        before = read_calls()
        for lo in range(0, 300, 32):
            got = store.get_many(list(range(lo, min(300, lo + 32))))
            assert [bytes(v) for v in got] == [value(k) for k in range(lo, min(300, lo + 32))]
        assert store.get(5) == value(5)
        assert read_calls() - before == own  # served from the mappings: no preadv


def test_mapped_records_are_still_checked(tmp_path: Path) -> None:
    sealed_store(tmp_path / "s")
    with Store.open(tmp_path / "s", **SETTINGS) as store:
        assert store.get(42) == value(42)  # its segment is mapped now
        damaged = next(p for p in (tmp_path / "s" / "segments").glob("*.log")
                       if value(42) in p.read_bytes())
        at = damaged.read_bytes().index(value(42)) + 100
        fd = os.open(damaged, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xff", at)  # seen through the shared mapping
        finally:
            os.close(fd)
        assert store.get_many([41, 42, 43]) == [value(41), None, value(43)]
        assert store.counters.verify_failures == 1


READ_ALL = """
import sys
from lcache.store import Store
store = Store.open(sys.argv[1], capacity="8MiB", segment_size="256KiB", max_writers=2,
                   sync="never")
got = store.get_many(list(range(int(sys.argv[2]))))
print(sum(v is None for v in got), sum(v is not None and bytes(v[:8]) ==
      i.to_bytes(8, "little") for i, v in enumerate(got)))
"""


def read_in_child(root: Path, n: int) -> tuple[int, int]:
    """(misses, right values) of reading keys 0..n-1 in a child process, which a fault that
    cannot get a page kills with SIGBUS."""
    done = subprocess.run([sys.executable, "-c", READ_ALL, str(root), str(n)],
                          capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    misses, right = done.stdout.split()
    return int(misses), int(right)


def _punch_hole(path: Path, offset: int, length: int) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(path, os.O_RDWR)
    try:
        # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        if libc.fallocate(fd, 3, ctypes.c_long(offset), ctypes.c_long(length)) != 0:
            pytest.skip(f"cannot punch a hole here: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def test_a_hole_in_a_sealed_segment_on_a_full_tmpfs_is_a_miss_not_sigbus(
        tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "mnt", "12m") as mnt:
        root = mnt / "s"
        sealed_store(root, n=300, size=8 * KIB)
        log = max((root / "segments").glob("*.log"), key=lambda p: p.stat().st_size)
        _punch_hole(log, 64 * KIB, 16 * KIB)
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:  # fill the tmpfs: a fault in the hole now cannot get a page
            while os.write(fd, bytes(4 * KIB)):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        misses, right = read_in_child(root, 300)
        assert 2 <= misses <= 4 and misses + right == 300


def _mapped_deleted(root: Path) -> list[str]:
    with open("/proc/self/maps", errors="surrogateescape") as f:  # names in any bytes
        return [line for line in f if str(root) in line and "(deleted)" in line]


GC = """
import sys
from lcache.store import Store
store = Store.open(sys.argv[1], capacity="8MiB", segment_size="256KiB", max_writers=2,
                   sync="never")
for k in range(300):
    store.delete(k)
store.gc(min_dead_fraction=0.5)
store.close()
"""


def test_mappings_of_deleted_segments_are_dropped(tmp_path: Path) -> None:
    root = tmp_path / "s"
    sealed_store(root)
    with Store.open(root, **SETTINGS) as store:
        store.put(1000, value(1000))
        held = store.get_many(list(range(300)))  # every sealed segment mapped
        kept = held[7]
        del held
        done = subprocess.run([sys.executable, "-c", GC, str(root)], capture_output=True,
                              text=True, timeout=60, env=subprocess_env())
        assert done.returncode == 0, done.stderr[-2000:]
        assert _mapped_deleted(root)  # not yet noticed
        assert store.get(1000) == value(1000)  # a read notices the gc generation moved
        assert len(_mapped_deleted(root)) == 1  # the one a caller still holds a view into
        assert bytes(kept) == value(7)
        del kept
        assert not _mapped_deleted(root)


def test_get_many_removes_what_it_read(tmp_path: Path) -> None:
    root = tmp_path / "s"
    sealed_store(root, n=20)
    with Store.open(root, **SETTINGS) as store:
        got = store.get_many([1, 2, 3, 99], remove=[True, False, True, True])
        assert [None if v is None else bytes(v) for v in got] == \
            [value(1), value(2), value(3), None]
        assert (1 in store, 2 in store, 3 in store) == (False, True, False)
        assert store.counters.deletes == 2
        got = store.get_many([b"k", 4], remove=[True, True])  # the byte-key path too
        assert got[0] is None and bytes(got[1]) == value(4) and 4 not in store
        with pytest.raises(ValueError, match="remove flags"):
            store.get_many([5, 6], remove=[True])
    # journaled: an index rebuilt from the segments does not bring them back
    for index in root.glob("index-int*.bin"):
        index.unlink()
    from lcache.store.fsck import fsck

    fsck(str(root), repair=True)
    with Store.open(root, **SETTINGS) as store:
        assert [k for k in range(20) if k in store] == [0, *range(2, 3), *range(5, 20)]
