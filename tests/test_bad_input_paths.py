"""Paths the CLI and the data API are given that are unusual: a directory named in bytes that
are not UTF-8, a directory the command made and then failed in, a symbolic link loop, a device
or a path through a file where a directory is wanted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import xxhash

from lcache.data import CachedDataset, DatasetSource, SourceError
from lcache.data.cachedir import SHM, remove_orphaned_staging
from lcache.data.warm import warm_cache

from .conftest import (
    assert_one_line_error,
    make_files,
    mounted_tmpfs,
    run_lcache,
    subprocess_env,
)

CAPACITY = "16MiB"


def _not_utf8(folder: Path, name: bytes = b"cache\xff") -> str:
    """``folder/name`` as Python names a path that is not UTF-8 (lone surrogates)."""
    return os.fsdecode(os.fsencode(folder) + b"/" + name)


# ------------------------------------------------------------------ names that are not UTF-8
def test_a_cache_directory_whose_name_is_not_utf8_caches(tmp_path: Path) -> None:
    """The finding (probe 2.1): its staging area's name was hashed from ``str.encode()``,
    a UnicodeEncodeError traceback from CachedDataset, `lcache warm` and `lcache demo`."""
    files = make_files(tmp_path / "data", 6)
    cache = _not_utf8(tmp_path)
    ds = CachedDataset(str(tmp_path / "data"), cache, CAPACITY)
    try:
        assert [ds[i] for i in range(6)] == files
        staging = ds.cache.staging_dir
        if staging.startswith(SHM + "/"):  # it names its cache as the file system does
            origin = Path(staging, "origin").read_bytes()
            assert origin == os.fsencode(cache) + b"\n" + ds.cache.cache_id.encode()
    finally:
        ds.cache.close()
    again = CachedDataset(str(tmp_path / "data"), cache, CAPACITY)
    try:
        mark = again.stats()
        assert [again[i] for i in range(6)] == files
        assert again.stats(since=mark)["fetches"] == 0  # read back from the cache
    finally:
        again.cache.close()


def test_a_utf8_cache_directory_keeps_its_staging_name(tmp_path: Path) -> None:
    """A staging area in /dev/shm is named as before for a UTF-8 name (a running job and a
    new process of the same cache share it)."""
    make_files(tmp_path / "data", 2)
    ds = CachedDataset(str(tmp_path / "data"), tmp_path / "caché", CAPACITY)
    try:
        if not ds.cache.staging_dir.startswith(SHM + "/"):
            pytest.skip("staging is inside the cache directory here")
        key = xxhash.xxh3_64_hexdigest(f"{ds.cache.cache_dir}#{ds.cache.cache_id}".encode())
        assert ds.cache.staging_dir == os.path.join(SHM, f"lcache-{key}")
    finally:
        ds.cache.close()


def test_the_staging_area_left_by_a_killed_run_of_a_non_utf8_cache_is_removed(
        tmp_path: Path) -> None:
    """Its ``origin`` file, which names the cache, is read back as it was written: decoded
    as UTF-8 it was never removed (memory in /dev/shm held until a reboot)."""
    make_files(tmp_path / "data", 3)
    cache = _not_utf8(tmp_path)
    left = subprocess.run(
        [sys.executable, "-c", "import os, sys\nfrom lcache.data import CachedDataset\n"
         f"ds = CachedDataset(sys.argv[1], sys.argv[2], {CAPACITY!r})\nds[0]\n"
         "print(ds.cache.staging_dir, flush=True)\nos._exit(0)  # no close: as if killed",
         str(tmp_path / "data"), cache],
        capture_output=True, env=subprocess_env(), timeout=120, check=False)
    assert left.returncode == 0, left.stderr
    staging = os.fsdecode(left.stdout.strip())
    if not staging.startswith(SHM + "/"):
        pytest.skip("staging is inside the cache directory here")
    try:
        assert os.path.isdir(staging)
        remove_orphaned_staging()
        assert os.path.isdir(staging)  # its cache is still there
        shutil.rmtree(cache)
        remove_orphaned_staging()
        assert not os.path.exists(staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def test_warm_stats_and_fsck_of_a_cache_whose_name_is_not_utf8(tmp_path: Path) -> None:
    make_files(tmp_path / "src", 3)
    cache = _not_utf8(tmp_path, b"c\xff")
    out = run_lcache("warm", "src", "--cache", cache, "--capacity", "10MB", "--json",
                     cwd=tmp_path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert json.loads(out.stdout)["cached_samples"] == 3
    out = run_lcache("stats", cache, "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["store"]["live_keys"] == 3
    out = run_lcache("fsck", cache, "--json", cwd=tmp_path)
    assert out.returncode == 0 and json.loads(out.stdout)["clean"] is True, out.stderr


# ------------------------------------------------------- a directory warm made, then failed
@pytest.mark.root
def test_a_failed_warm_leaves_no_directory_it_made(tmp_path: Path) -> None:
    """The finding (probe 2.1): `lcache warm` left the cache directory it had made (and its
    parents) when it then failed; here the device is full at once."""
    make_files(tmp_path / "src", 3)
    with mounted_tmpfs(tmp_path / "fs", "4k") as fs:
        out = run_lcache("warm", "src", "--cache", str(fs / "new" / "c"), "--capacity",
                         "10MB", cwd=tmp_path)
        assert out.returncode == 2 and "no space left" in out.stderr, out.stderr
        assert list(fs.iterdir()) == []


class _Failing:
    """A map-style dataset whose items from ``fail_from`` on cannot be read, once armed
    (the probe of its contents reads some first)."""

    def __init__(self, n: int) -> None:
        self.n, self.fail_from = n, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i >= self.fail_from:
            raise OSError(f"item {i} is gone")
        return bytes([i]) * 100


def test_warm_that_fails_before_caching_a_sample_removes_the_folders_it_made(
        tmp_path: Path) -> None:
    data = _Failing(40)
    source = DatasetSource(data)
    data.fail_from = 0
    with pytest.raises(SourceError, match="item 0 is gone"):
        warm_cache(source, str(tmp_path / "a" / "b" / "cache"), CAPACITY, threads=1,
                   show_progress=False)
    assert list(tmp_path.iterdir()) == []


def test_warm_that_fails_after_caching_samples_keeps_them_for_a_rerun(tmp_path: Path) -> None:
    data = _Failing(40)
    source = DatasetSource(data)
    data.fail_from = 20  # a group of 8 at a time, in order, on one thread
    with pytest.raises(SourceError, match="item 20 is gone"):
        warm_cache(source, str(tmp_path / "cache"), CAPACITY, threads=1, show_progress=False)
    data.fail_from = 40
    figures = warm_cache(source, str(tmp_path / "cache"), CAPACITY, threads=1,
                         show_progress=False)
    assert figures["cached_samples"] == 40 and figures["fetched_samples"] == 24, figures


def test_warm_that_fails_in_a_directory_it_did_not_make_leaves_it(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir(mode=0o700)
    data = _Failing(40)
    source = DatasetSource(data)
    data.fail_from = 0
    with pytest.raises(SourceError):
        warm_cache(source, str(tmp_path / "cache"), CAPACITY, threads=1, show_progress=False)
    assert (tmp_path / "cache" / "cache.json").exists()


# ------------------------------------------------------ what names no directory, in the CLI
DIRECTORY_COMMANDS = [("stats", "{}"), ("fsck", "{}"), ("ckpt", "ls", "{}"),
                      ("warm", "src", "--cache", "{}")]


@pytest.mark.parametrize("command", DIRECTORY_COMMANDS, ids=lambda c: c[0])
def test_a_symbolic_link_loop_is_named_itself(tmp_path: Path, command: tuple[str, ...]) -> None:
    """The finding (probe 3.5): `lcache stats loop1` said "loop1/cache.json is a symbolic
    link, not a regular file; remove it", of a file that is not there."""
    os.symlink("loop1", tmp_path / "loop2")
    os.symlink("loop2", tmp_path / "loop1")
    out = run_lcache(*(a.format("loop1") for a in command), cwd=tmp_path)
    err = assert_one_line_error(out, "loop1: too many levels of symbolic links")
    assert "cache.json" not in err


@pytest.mark.parametrize("command", DIRECTORY_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize(("where", "what"), [
    ("/dev/null", "/dev/null is not a directory (it is a character device)"),
    ("fifo", "fifo is not a directory (it is a FIFO)"),
    ("src/a.bin/x", "src/a.bin/x is not a directory (a part of its path is a file)")],
    ids=["device", "fifo", "through-a-file"])
def test_what_is_no_directory_is_named_itself(tmp_path: Path, command: tuple[str, ...],
                                              where: str, what: str) -> None:
    """The finding (probe 3.5): `lcache stats /dev/null` said "cannot access
    /dev/null/cache.json: not a directory"."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"x" * 100)
    os.mkfifo(tmp_path / "fifo")
    out = run_lcache(*(a.format(where) for a in command), cwd=tmp_path)
    err = assert_one_line_error(out, what)
    assert "cache.json" not in err
