"""Ownership and symbolic links (issue 10, finding 7, the store's part).

A store never follows a symbolic link inside its directory: every file it opens is opened with
``O_NOFOLLOW`` and ``segments/`` must be a real directory. A directory or a link that another
user made is refused before anything is written there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lcache import LCacheError, StorePermissionError
from lcache.store import Store, fsck
from lcache.store.counters import read_totals
from lcache.store.files import generation_path
from lcache.testing import faults, pattern_bytes

from .conftest import SMALL, run_as_nobody

NOBODY = 65534
KEYS: list[int | bytes] = [*range(40), *(b"k-%d" % i for i in range(10))]


def value(seed: int, key: int | bytes) -> bytes:
    """Sizes differ between stores too, so no record of one lies where the other's does."""
    return pattern_bytes(3000 + 100 * seed, seed * 1000 + sum(repr(key).encode()) % 1000)


def fill(root: Path, seed: int) -> None:
    """Several sealed segments, then closed: the same keys in every store, with values that
    differ from store to store (bytes read through a link would be the wrong ones)."""
    with Store.open(root, **SMALL) as store:
        for k in KEYS:
            store.put(k, value(seed, k))


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def _targets(root: Path) -> dict[str, str]:
    first = faults.segment_ids(root)[0][0]
    return {
        "store.json": "store.json",
        "lock": "lock",
        "stats.json": "stats.json",
        "int index": os.path.basename(faults.index_path(root, "int")),
        "byte index": os.path.basename(faults.index_path(root, "bytes")),
        "delete journal": os.path.basename(faults.index_path(root, "deletes")),
        "segment log": os.path.relpath(faults.segment_log(root, first), root),
        "segment summary": os.path.relpath(faults.segment_sum(root, first), root),
    }


def _use(root: Path) -> tuple[list[str], list[int | bytes]]:
    """Everything a user does with a store: (the errors met, the keys missing at the end)."""
    try:
        with Store.open(root, create=False) as store:
            for k, v in zip(KEYS, store.get_many(KEYS), strict=True):
                assert v is None or bytes(v) == value(1, k), f"{k!r}: bytes of another store"
            store.put(1000, b"new")
            store.delete(5)
            store.gc(0.0)
            kept = [k for k in KEYS if k != 5]
            got = store.get_many(kept)
            assert all(v is None or bytes(v) == value(1, k) for k, v in zip(kept, got,
                                                                              strict=True))
            return [], [k for k, v in zip(kept, got, strict=True) if v is None]
    except LCacheError as exc:
        return [str(exc)], []


@pytest.mark.parametrize("what", ["store.json", "lock", "int index", "byte index",
                                  "delete journal", "segment log", "segment summary",
                                  "stats.json"])
def test_a_link_inside_a_store_is_never_followed(tmp_path: Path, what: str) -> None:
    """Regression: a link in a store to another store's file was followed: read (another
    store's bytes, summary or counters taken for its own) or written into."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    fill(mine, 1)
    fill(other, 2)
    name = _targets(mine)[what]
    (mine / name).unlink()
    (mine / name).symlink_to(other / name)
    before = snapshot(other)

    errors, missing = _use(mine)

    assert snapshot(other) == before, "the other store was written through the link"
    if what == "segment summary":  # rebuilt by a scan of the segment itself, not followed
        assert errors == [] and missing == []
    elif what == "stats.json":  # advisory and replaced whole: never read through the link
        assert errors == [] and missing == []
        assert not (mine / name).is_symlink()
        assert read_totals(str(mine)).puts == 1, "another store's counters were summed in"
    else:  # refused, with the way out
        assert len(errors) == 1, errors
        assert name.split("/")[-1] in errors[0] and "symbolic link" in errors[0], errors
        assert f"lcache fsck --repair {mine}" in errors[0], errors
        repaired = fsck(mine, repair=True)
        assert repaired.clean, repaired.problems
        assert any("symbolic link" in p for p in repaired.repaired), repaired.repaired
        assert not (mine / name).is_symlink()
        assert _use(mine)[0] == []
    assert fsck(mine).clean
    assert snapshot(other) == before


def test_segments_must_be_a_real_directory(tmp_path: Path) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    fill(mine, 1)
    fill(other, 2)
    before = snapshot(other)
    for path in (mine / "segments").iterdir():
        path.unlink()
    (mine / "segments").rmdir()
    (mine / "segments").symlink_to(other / "segments")
    with pytest.raises(StorePermissionError, match="symbolic link"):
        Store.open(mine)
    with pytest.raises(StorePermissionError, match="symbolic link"):
        fsck(mine, repair=True)
    assert snapshot(other) == before


def test_a_planted_temp_file_link_is_not_followed(tmp_path: Path) -> None:
    """The index built when the byte-key table grows goes to NAME.tmpPID: a link planted
    there is removed, not written through."""
    root, target = tmp_path / "s", tmp_path / "target"
    target.write_bytes(b"precious")
    store = Store.open(root, capacity="64MiB", segment_size="256KiB")
    tmp = Path(generation_path(str(root), "index-bytes", 1) + f".tmp{os.getpid()}")
    tmp.symlink_to(target)
    store.put_many([b"key-%d" % i for i in range(500)], [b"v"] * 500)  # grows the table
    assert faults.index_path(root, "bytes").endswith("-1.bin")
    assert target.read_bytes() == b"precious"
    store.close()


def _as_nobody(body: str, arg: str) -> str:
    return run_as_nobody("", body, arg)


def _sticky(nobody_dir: Path) -> Path:
    sticky = nobody_dir / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    return sticky


def test_a_0777_directory_made_by_another_user_is_refused(nobody_dir: Path) -> None:
    """Regression: a 0777 directory created by nobody was accepted as root's store."""
    planted = _sticky(nobody_dir) / "store"
    _as_nobody("os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)", str(planted))
    assert planted.stat().st_uid == NOBODY
    with pytest.raises(StorePermissionError) as info:
        Store.open(planted, **SMALL)
    assert f"uid {NOBODY}" in str(info.value)
    assert list(planted.iterdir()) == [], "something was written into it"
    with pytest.raises(LCacheError):
        Store.open(planted, create=False)
    assert list(planted.iterdir()) == []


def test_a_link_planted_in_a_sticky_directory_is_refused(nobody_dir: Path) -> None:
    real = nobody_dir / "real"
    fill(real, 1)
    before = snapshot(real)
    link = _sticky(nobody_dir) / "store"
    _as_nobody(f"os.symlink({str(real)!r}, sys.argv[1])", str(link))
    assert link.lstat().st_uid == NOBODY
    with pytest.raises(StorePermissionError, match="symbolic link owned by uid 65534"):
        Store.open(link, **SMALL)
    with pytest.raises(StorePermissionError):
        fsck(link, repair=True)
    assert snapshot(real) == before



# ------------------------------------------------------------------------ not regular files
_USE_IN_CHILD = """
import sys
from lcache import LCacheError
from lcache.store import Store
try:
    with Store.open(sys.argv[1], create=False) as store:
        store.get_many(list(range(40)))
        store.put(1000, b"new")
        store.get_many(list(range(40)))
except LCacheError as exc:
    print("ERROR", exc)
"""

_FSCK_IN_CHILD = """
import sys
from lcache import LCacheError
from lcache.store import fsck
try:
    print(fsck(sys.argv[1]).problems)
except LCacheError as exc:
    print("ERROR", exc)
"""


@pytest.mark.parametrize("what", ["store.json", "int index", "byte index", "delete journal",
                                  "segment log", "segment summary", "stats.json"])
def test_a_fifo_inside_a_store_never_blocks(tmp_path: Path, what: str) -> None:
    """Regression: a FIFO under a store file's name blocked opening the store, reading from
    it and ``lcache fsck`` forever. Now the open never waits (``O_NONBLOCK``) and anything but
    a regular file is refused like a link, with the way out. In children: a hang fails."""
    import subprocess
    import sys

    root = tmp_path / "store"
    fill(root, 1)
    name = _targets(root)[what]
    (root / name).unlink()
    os.mkfifo(root / name)

    used = subprocess.run([sys.executable, "-c", _USE_IN_CHILD, str(root)],
                          capture_output=True, text=True, timeout=60)
    assert used.returncode == 0, used.stderr
    if "ERROR" in used.stdout:  # refused, naming the file
        assert f"{root / name} is a FIFO" in used.stdout, used.stdout
    if what not in ("stats.json", "segment summary"):  # advisory, or rebuilt by a scan
        assert f"lcache fsck --repair {root}" in used.stdout, used.stdout

    checked = subprocess.run([sys.executable, "-c", _FSCK_IN_CHILD, str(root)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr
    if what != "stats.json":  # fsck does not look at the counters
        assert name.split("/")[-1] in checked.stdout, checked.stdout
