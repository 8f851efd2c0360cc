"""What the store refuses, and that each refusal says what was wrong and what to change."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lcache
from lcache import (
    ConfigError,
    CorruptionError,
    DiskFullError,
    IndexFullError,
    LCacheError,
    StoreFullError,
    StoreNotFoundError,
    StorePermissionError,
)
from lcache.store import Store, fsck, parse_size
from lcache.store.layout import MetaPage, prepare_dir

from .conftest import KIB, SEG, run_as_nobody, subprocess_env

NOBODY = 65534


@pytest.mark.parametrize(("error", "builtin"), [
    (ConfigError, ValueError),
    (CorruptionError, ValueError),
    (StoreNotFoundError, FileNotFoundError),
    (StorePermissionError, PermissionError),
    (DiskFullError, OSError),
    (StoreFullError, RuntimeError),
    (IndexFullError, RuntimeError),
])
def test_errors_inherit_the_builtins(error: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(error, LCacheError)
    assert issubclass(error, builtin)
    assert getattr(lcache, error.__name__) is error


def test_disk_full_error_is_an_enospc_oserror() -> None:
    err = DiskFullError("the disk is full")
    assert err.errno == 28
    assert str(err) == "the disk is full"


def test_capacity_below_segments_times_writers(store_dir: Path) -> None:
    with pytest.raises(ConfigError) as info:
        Store.open(store_dir, capacity=128 * KIB, segment_size=SEG, max_writers=2)
    message = str(info.value)
    for part in ("128.0 KiB", "64.0 KiB", "writers (2)", "192.0 KiB", "raise capacity"):
        assert part in message, message


@pytest.mark.parametrize(("settings", "words"), [
    ({"segment_size": 1000}, "between 4 KiB and 4 GiB"),
    ({"segment_size": 8 << 30}, "between 4 KiB and 4 GiB"),
    ({"max_writers": 0}, "max_writers must be >= 1"),
    ({"max_byte_keys": 3}, "max_byte_keys must be >= 16"),
    ({"capacity": "lots"}, "cannot read 'lots' as a size"),
    ({"policy": "mru"}, "unknown eviction policy 'mru'; choose one of fifo, lru"),
])
def test_bad_settings(store_dir: Path, settings: dict[str, Any], words: str) -> None:
    base = {"capacity": 16 * SEG, "segment_size": SEG, "max_writers": 2}
    with pytest.raises(ConfigError, match=words):
        Store.open(store_dir, **{**base, **settings})
    assert not (store_dir / "store.json").exists(), "a refused store must not be created"


def test_unknown_policy_on_reopen(open_store: Any, store_dir: Path) -> None:
    open_store().close()
    with pytest.raises(ConfigError, match="unknown eviction policy 'belady-typo'"):
        Store.open(store_dir, policy="belady-typo")
    assert Store.open(store_dir).config.policy == "lru"  # the stored config is unchanged


@pytest.mark.parametrize(("setting", "value"), [("segment_size", 2 * SEG)])
def test_fixed_settings_cannot_change_on_reopen(open_store: Any, store_dir: Path,
                                                setting: str, value: int) -> None:
    store = open_store()
    store.put(1, b"one")
    store.close()
    with pytest.raises(ConfigError) as info:
        Store.open(store_dir, **{setting: value})
    message = str(info.value)
    assert f"{setting} is fixed" in message and str(value) in message
    assert "new directory" in message
    again = Store.open(store_dir)
    assert again.get(1) == b"one"
    again.close()


def test_changeable_settings_on_reopen(open_store: Any, store_dir: Path) -> None:
    open_store().close()
    store = Store.open(store_dir, capacity="2MiB", max_writers=3, policy="fifo")
    assert (store.config.capacity, store.config.max_writers, store.config.policy) == (
        2 << 20, 3, "fifo")
    store.close()


@pytest.mark.parametrize(("text", "size"), [
    ("64MiB", 64 << 20), ("50GB", 50 * 10**9), ("4096", 4096), ("4096B", 4096),
    ("1.5GiB", 3 << 29), ("0.5KiB", 512), ("0.4GB", 4 * 10**8), (" 2 MiB ", 2 << 20),
    ("64k", 64_000), (123, 123), (1, 1),
])
def test_sizes_parse(text: int | str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", [
    "0.4", "4096.0", "1.5B", "0", "0KiB", "0.0001KB", "-5", "-5MiB", "nan", "inf", "", " ",
    "MiB", "1.2.3KB", "1e9", "5i", "ten", True, False, None, 0, -1, 1.5, 4096.0, [4096],
    "\u0661\u0660MB",  # other scripts' digits: int() reads them, a size does not
])
def test_what_is_not_a_size_is_refused(bad: object) -> None:
    """Regression: parse_size("0.4") was 0 bytes (found by a new user: capacity="0.4")."""
    with pytest.raises(ConfigError) as info:
        parse_size(bad)  # type: ignore[arg-type]
    message = str(info.value)
    assert repr(bad) in message and "whole number of bytes" in message, message
    assert "1.5GiB" in message  # says what is allowed


@pytest.mark.parametrize("huge", [2**62 + 1, 10**40, "10000000PB", f"{2**62 + 1}"])
def test_sizes_beyond_any_disk_are_refused_by_name(huge: int | str) -> None:
    """The finding: capacity=10**40 and staging_bytes=10**40 were taken (attack helper 47)."""
    assert parse_size(2**62) == 2**62
    with pytest.raises(ConfigError, match=r"^staging_bytes: .* above 2\*\*62 bytes"):
        parse_size(huge, "staging_bytes")


def test_a_fraction_without_a_unit_says_so(store_dir: Path) -> None:
    with pytest.raises(ConfigError, match="a fraction needs a unit"):
        Store.open(store_dir, capacity="0.4")
    assert not store_dir.exists()


def test_missing_store_without_create(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError, match="no lcache store"):
        Store.open(tmp_path / "nothing-here", create=False)
    assert not (tmp_path / "nothing-here").exists()


def listing(root: Path) -> list[tuple[str, int, int]]:
    """Every entry under ``root`` (itself included) with its mode and mtime."""
    return [(str(p.relative_to(root)), p.lstat().st_mode, p.lstat().st_mtime_ns)
            for p in [root, *sorted(root.rglob("*"))]]


def test_an_ordinary_directory_is_not_made_a_store(tmp_path: Path) -> None:
    """Regression: Store.open(create=False) and fsck turned any directory into a store
    (store.json, lock, index files, segments/)."""
    plain = tmp_path / "plain"
    plain.mkdir(mode=0o700)
    (plain / "notes.txt").write_text("mine")
    (plain / "sub").mkdir()
    before = listing(plain)
    with pytest.raises(StoreNotFoundError, match=f"no lcache store in {plain}"):
        Store.open(plain, create=False)
    for repair in (False, True):
        with pytest.raises(StoreNotFoundError, match=f"no lcache store in {plain}"):
            fsck(plain, repair=repair)
    assert listing(plain) == before


def test_a_lock_lcache_did_not_write_is_left_alone(tmp_path: Path) -> None:
    """The finding (attack helper 69, finding 2): Store.open made ``DIR/lock`` before it read
    ``store.json``, so a user's ``lock`` was zero-padded to a page (its first byte changed)
    and ``segments/`` was made beside it; a ``store.json`` that is not lcache's was answered
    with advice to run ``fsck --repair``, which has nothing to rebuild from."""
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (mine / "lock").write_bytes(b"p2\n")
    before = listing(mine)
    with pytest.raises(ConfigError, match=f"{mine / 'lock'} is not the lock file of an lcache"):
        Store.open(mine, capacity="8MiB", segment_size=SEG, max_writers=2)
    assert listing(mine) == before and (mine / "lock").read_bytes() == b"p2\n"

    (mine / "store.json").write_text('{"app": "x"}')
    before = listing(mine)
    for create in (False, True):
        with pytest.raises(CorruptionError, match="holds no segments: it is not an lcache "
                                                  "store") as info:
            Store.open(mine, create=create)
        assert "fsck" not in str(info.value)
    assert listing(mine) == before


@pytest.mark.parametrize(("name", "content"), [
    ("build.log", b"x\n"), ("notes.sum", b"LCSM"), ("0000000001.log", b"x\n"),
    ("0000000001.sum", b""), ("0000000001.log.tmp7", b"LCR1")])
def test_files_named_like_segments_do_not_make_a_folder_a_store(
        tmp_path: Path, name: str, content: bytes) -> None:
    """The finding (attack helper 73, finding 1): any name ending in .log or .sum in
    ``segments/`` made a folder a store, so its ``lock`` was never checked: with a user's
    ``segments/build.log`` and ``lock`` ("p2"), Store.open padded the lock to a page ("r2")
    and wrote a store beside the user's files. Only segments a store wrote (its names,
    starting with a record's or a summary's magic) prove a folder a store."""
    mine = tmp_path / "mine"
    (mine / "segments").mkdir(mode=0o700, parents=True)
    (mine / "segments" / name).write_bytes(content)
    (mine / "lock").write_bytes(b"p2\n")
    before = listing(mine)
    with pytest.raises(ConfigError, match=f"{mine / 'lock'} is not the lock file of an lcache"):
        Store.open(mine, capacity="8MiB", segment_size=SEG, max_writers=2)
    for attempt in (lambda: Store.open(mine, create=False), lambda: fsck(mine),
                    lambda: fsck(mine, repair=True)):
        with pytest.raises((ConfigError, StoreNotFoundError)):
            attempt()
    assert listing(mine) == before and (mine / "lock").read_bytes() == b"p2\n"


def test_segments_a_store_wrote_prove_it_a_store(tmp_path: Path) -> None:
    """A store whose ``store.json`` is lost and whose ``lock`` is damaged is still repaired
    from its segments (they start with a record's magic)."""
    root = tmp_path / "s"
    with Store.open(root, capacity="8MiB", segment_size=SEG, max_writers=2) as store:
        store.put(1, b"one")
    (root / "store.json").unlink()
    (root / "lock").write_bytes(b"damaged")
    with pytest.raises(CorruptionError, match=r"store\.json is missing"):
        Store.open(root, create=False)
    fsck(root, repair=True)
    with Store.open(root, create=False) as store:
        assert bytes(store.get(1) or b"") == b"one"


def test_a_lock_lcache_made_is_its_own(tmp_path: Path) -> None:
    """A ``lock`` left by a store whose creation stopped before ``store.json``, or one made
    before locks were marked (in a store with its configuration), is the store's."""
    fresh = tmp_path / "fresh"
    fresh.mkdir(mode=0o700)
    MetaPage(str(fresh / "lock")).close()  # what a creation killed at that point leaves
    Store.open(fresh, capacity="8MiB", segment_size=SEG, max_writers=2).close()

    old = tmp_path / "old"
    with Store.open(old, capacity="8MiB", segment_size=SEG, max_writers=2) as store:
        store.put(1, b"one")
    (old / "lock").write_bytes(bytes(4096))  # no mark, as locks were made before
    with Store.open(old, create=False) as store:
        assert bytes(store.get(1) or b"") == b"one"


@pytest.mark.parametrize("lock", [b"", bytes(mmap.PAGESIZE),
                                  (7).to_bytes(8, "little") * (MetaPage.WORDS_END // 8) +
                                  bytes(mmap.PAGESIZE - MetaPage.WORDS_END)])
def test_a_creation_an_older_lcache_left_can_be_finished(tmp_path: Path, lock: bytes) -> None:
    """The finding (attack helper 72, finding 7): an older lcache made ``segments/`` and then
    ``lock`` (empty, then one page without the mark, its shared words in use) before
    ``store.json``; killed between, it left a folder Store.open refused ("not the lock file
    of an lcache store ... move it"), though that lock was lcache's own."""
    root = tmp_path / "killed"
    (root / "segments").mkdir(mode=0o700, parents=True)
    (root / "lock").write_bytes(lock)
    with Store.open(root, capacity="8MiB", segment_size=SEG, max_writers=2) as store:
        store.put(1, b"one")
    with Store.open(root, create=False) as store:
        assert bytes(store.get(1) or b"") == b"one"


@pytest.mark.parametrize("at", [MetaPage.WORDS_END, 100, mmap.PAGESIZE - 1])
def test_a_page_with_bytes_past_the_shared_words_is_not_a_lock(tmp_path: Path,
                                                              at: int) -> None:
    """A page-sized file with anything past the shared words (or a page and a byte) is not
    a lock lcache made: it is left alone."""
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    page = bytearray(mmap.PAGESIZE)
    page[at] = 1
    for content in (bytes(page), bytes(mmap.PAGESIZE + 1)):
        (mine / "lock").write_bytes(content)
        before = listing(mine)
        with pytest.raises(ConfigError, match="is not the lock file of an lcache store"):
            Store.open(mine, capacity="8MiB", segment_size=SEG, max_writers=2)
        assert listing(mine) == before and (mine / "lock").read_bytes() == content


def test_processes_creating_one_store_at_once_all_open_it(tmp_path: Path) -> None:
    """Each sees either no ``lock`` or a whole, marked one: none takes another's lock,
    caught half-made, for a user's file."""
    root = tmp_path / "s"
    code = ("import sys; from lcache.store import Store; "
            f"Store.open(sys.argv[1], capacity='8MiB', segment_size={SEG}, max_writers=2)"
            ".close()")
    children = [subprocess.Popen([sys.executable, "-c", code, str(root)], env=subprocess_env(),
                                 stderr=subprocess.PIPE, text=True) for _ in range(8)]
    for child in children:
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".probe")) == []


def _prepare_in_step(barrier: Any, roots: list[str]) -> None:
    try:
        for root in roots:
            barrier.wait(timeout=60)
            prepare_dir(root, create=True)
    except BaseException:
        barrier.abort()  # the others stop at once, not at the timeout
        raise


def test_processes_preparing_one_new_store_at_once_all_succeed(tmp_path: Path) -> None:
    """The finding (attack helper 72, finding 6): prepare_dir checked that ``segments`` was
    missing and then made it, so of processes creating one store at once one occasionally
    failed with a raw FileExistsError. Here they meet at a barrier before each of many new
    stores, so they collide there often."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(8)
    roots = [str(tmp_path / f"s{i}") for i in range(100)]
    children = [context.Process(target=_prepare_in_step, args=(barrier, roots))
                for _ in range(8)]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=120)
    assert [child.exitcode for child in children] == [0] * 8
    for root in roots:
        assert sorted(os.listdir(root)) == ["segments"]


def test_corrupt_config_file(open_store: Any, store_dir: Path) -> None:
    open_store().close()
    (store_dir / "store.json").write_text("{not json")
    with pytest.raises(CorruptionError, match=r"store\.json"):
        Store.open(store_dir)
    (store_dir / "store.json").write_text('{"format": 99}')
    with pytest.raises(CorruptionError, match="not an lcache store configuration"):
        Store.open(store_dir)


def test_directory_owned_by_another_user(store_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory away")
    store_dir.mkdir(mode=0o700)
    os.chown(store_dir, NOBODY, NOBODY)
    with pytest.raises(StorePermissionError) as info:
        Store.open(store_dir)
    message = str(info.value)
    assert f"uid {NOBODY}" in message and "never shared between users" in message
    assert isinstance(info.value, PermissionError)
    assert not (store_dir / "store.json").exists()


def _as_nobody(path: Path) -> str:
    return run_as_nobody("from lcache import StorePermissionError\nfrom lcache.store import Store",
                         """
try:
    Store.open(sys.argv[1])
except StorePermissionError as exc:
    print("refused:", exc)
else:
    print("opened")
""", str(path))


def test_not_writable_directory(nobody_dir: Path) -> None:
    store_dir = nobody_dir / "store"
    store_dir.mkdir(mode=0o500)
    os.chown(store_dir, NOBODY, NOBODY)
    out = _as_nobody(store_dir)
    assert out.startswith("refused:"), out
    assert "not writable" in out and "fix its permissions" in out


def test_cannot_create_directory(nobody_dir: Path) -> None:
    parent = nobody_dir / "locked"
    parent.mkdir(mode=0o555)
    out = _as_nobody(parent / "store")
    assert out.startswith("refused:"), out
    assert "cannot create the cache directory" in out


@pytest.mark.parametrize(("key", "error"), [
    (1.5, TypeError),
    ("text", TypeError),
    (True, TypeError),
    (None, TypeError),
    (-1, ValueError),
    (2**63, ValueError),
    (b"", ValueError),
    (b"k" * 1025, ValueError),
])
def test_bad_keys(open_store: Any, key: Any, error: type[Exception]) -> None:
    store = open_store()
    with pytest.raises(error):
        store.put(key, b"value")
    with pytest.raises(error):
        store.get(key)
    with pytest.raises(error):
        store.delete(key)
    with pytest.raises(error):
        store.get_many([1, key])


def test_int_key_beyond_the_flat_index(open_store: Any) -> None:
    store = open_store()
    with pytest.raises(ConfigError, match="use byte keys"):
        store.put(1 << 40, b"value")
    store.put(b"%d" % (1 << 40), b"value")  # as the message says
    assert store.get(b"%d" % (1 << 40)) == b"value"


def test_value_larger_than_a_segment(open_store: Any) -> None:
    store = open_store()
    with pytest.raises(ValueError) as info:
        store.put(1, b"x" * SEG)
    message = str(info.value)
    assert "does not fit in a segment" in message and "64.0 KiB" in message
    assert "larger segment_size" in message
    store.put(1, b"x" * (SEG - 32))  # exactly one segment with its header fits
    assert store.get(1) == b"x" * (SEG - 32)


def test_values_that_are_not_buffers(open_store: Any) -> None:
    store = open_store()
    with pytest.raises(TypeError, match="not str"):
        store.put(1, "text")
    with pytest.raises(TypeError, match="not int"):
        store.put(1, 12345)
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.put_many([1, 2], [b"a"])
    # strided views: a raw BufferError and numpy's "casts are restricted" (attack helper 98)
    for strided in (memoryview(b"abcdef")[::2], np.arange(10, dtype=np.int64)[::2]):
        with pytest.raises(TypeError, match="C-contiguous buffer, not a strided view"):
            store.put(2, strided)
    assert 2 not in store
    store.put(2, np.ascontiguousarray(np.arange(10, dtype=np.int64)[::2]))
    assert store.get(2) == np.arange(0, 10, 2, dtype=np.int64).tobytes()
    store.put(3, np.zeros((0, 4))[:, ::2])  # empty: a value of 0 bytes (attack helper 99)
    assert store.get(3) == b""


def test_use_after_close(open_store: Any) -> None:
    store = open_store()
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.get(1)
    store.close()  # closing twice is harmless
