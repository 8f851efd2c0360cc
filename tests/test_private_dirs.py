"""lcache.io.dirs: the one check of cache, store, checkpoint and bench directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lcache.errors import ConfigError, StorePermissionError
from lcache.io import atomic_write
from lcache.io.dirs import private_dir

from .conftest import mounted_tmpfs

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def test_created_dirs_and_parents_are_0700_under_umask_000(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = private_dir(tmp_path / "a" / "b" / "c")
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", Path(path)):
        assert d.stat().st_mode & 0o777 == 0o700, d


def test_dir_others_can_write_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(StorePermissionError, match="chmod go-w"):
        private_dir(d)
    d.chmod(0o755)
    assert private_dir(d) == str(d)


def test_a_file_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a directory"):
        private_dir(tmp_path / "f")
    with pytest.raises(ConfigError, match="not a directory"):
        private_dir(tmp_path / "f" / "below")


def test_missing_dir_without_create(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        private_dir(tmp_path / "none", create=False)
    assert not (tmp_path / "none").exists()


def test_own_symlink_is_followed(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert os.path.samefile(private_dir(tmp_path / "link"), tmp_path / "real")


@needs_root
def test_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(StorePermissionError, match="belongs to uid 65534"):
        private_dir(d)


@needs_root
def test_symlink_planted_by_another_user_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    link = tmp_path / "planted"
    link.symlink_to(tmp_path / "real")
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(StorePermissionError, match="symbolic link owned by uid 65534"):
        private_dir(link)


@needs_root
def test_parent_another_user_can_replace_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    mine = parent / "mine"
    mine.mkdir(mode=0o700)
    os.chown(parent, NOBODY, NOBODY)
    with pytest.raises(StorePermissionError, match="which uid 65534 owns"):
        private_dir(mine)


def test_parent_others_can_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    (parent / "mine").mkdir(mode=0o700)
    parent.chmod(0o777)
    with pytest.raises(StorePermissionError, match="not sticky"):
        private_dir(parent / "mine")
    parent.chmod(0o1777)  # as /tmp: others cannot rename what is ours
    private_dir(parent / "mine")
    private_dir(parent / "new")


def test_nothing_is_created_under_a_parent_others_can_replace(tmp_path: Path) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o777)
    with pytest.raises(StorePermissionError, match="not sticky"):
        private_dir(parent / "a" / "b")
    assert os.listdir(parent) == []


def test_atomic_write_never_follows_a_symlink_at_its_temp_name(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    (tmp_path / f"out.json.tmp{os.getpid()}").symlink_to(target)
    with pytest.raises(ConfigError, match="is in the way of writing"):
        atomic_write(str(tmp_path / "out.json"), b"{}")
    assert target.read_bytes() == b"keep"
    # neither is the link removed, nor a file at that name truncated (attack helper 78)
    assert (tmp_path / f"out.json.tmp{os.getpid()}").is_symlink()
    os.mkfifo(tmp_path / f"notes.txt.tmp{os.getpid()}")
    with pytest.raises(ConfigError, match="move it away"):
        atomic_write(str(tmp_path / "notes.txt"), b"{}")
    assert not (tmp_path / "notes.txt").exists()
    # a regular file there is the leftover of a killed process that had this pid (a
    # restarted container's pids repeat): it no longer blocks the write (attack helper 79)
    (tmp_path / f"cache.json.tmp{os.getpid()}").write_bytes(b"{half")
    atomic_write(str(tmp_path / "cache.json"), b"{}")
    assert (tmp_path / "cache.json").read_bytes() == b"{}"
    assert not (tmp_path / f"cache.json.tmp{os.getpid()}").exists()


def test_a_directory_that_cannot_be_written_is_a_permission_error(tmp_path: Path) -> None:
    """The finding: on a read-only mount (or an immutable directory: root passes permission
    bits, not those) the cache, a checkpoint save, the offload swap file and the store each
    failed with a bare OSError from their first file, where docs promise
    StorePermissionError."""
    torch = pytest.importorskip("torch")
    from lcache import checkpoint
    from lcache.data import CachedDataset
    from lcache.offload import OffloadedOptimizer
    from lcache.store import Store

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 100)
    with mounted_tmpfs(tmp_path / "ro", "1m", ",ro") as ro:
        for where in (ro, ro / "sub"):
            with pytest.raises(StorePermissionError, match=r"(?i)read-only file system"):
                CachedDataset(str(src), where, "8MiB")
            with pytest.raises(StorePermissionError, match=r"(?i)read-only file system"):
                checkpoint.save({"a": 1}, where / "ckpt")
            with pytest.raises(StorePermissionError, match=r"(?i)read-only file system"):
                OffloadedOptimizer([torch.nn.Parameter(torch.ones(4))], dir=where, lr=0.1)
            with pytest.raises(StorePermissionError, match=r"(?i)read-only file system"):
                Store.open(str(where / "store"), capacity="1GiB")


def test_a_read_only_mount_others_can_write_is_not_told_to_chmod(tmp_path: Path) -> None:
    # (attack helper 47) the advice was `chmod go-w`, which a read-only file system refuses
    with mounted_tmpfs(tmp_path / "ro", "1m", ",mode=0777,ro") as ro:
        with pytest.raises(StorePermissionError, match="read-only") as exc:
            private_dir(ro)
        assert "chmod go-w" not in str(exc.value)
