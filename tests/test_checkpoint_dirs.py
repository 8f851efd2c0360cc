"""Checkpoint directories: a mistyped one is an error, not an empty run; every directory a
save creates is owner-only; a directory another user owns, can write or planted is refused."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from lcache import checkpoint as ck
from lcache.checkpoint import dirs
from lcache.cli.main import cli
from lcache.errors import ConfigError, StorePermissionError

from .conftest import assert_one_line_error, run_as_nobody, run_lcache


def test_a_missing_directory_is_an_error_an_empty_one_is_not(tmp_path: Path) -> None:
    ck.save({"a": 1}, tmp_path / "ckpts" / "step-1")
    typo = tmp_path / "ckpst"
    for call in (ck.latest, ck.list_checkpoints):
        with pytest.raises(ck.CheckpointNotFoundError, match=f"no checkpoint directory at {typo}"):
            call(typo)
    with pytest.raises(FileNotFoundError):
        ck.latest(str(typo))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ck.CheckpointNotFoundError, match="not a directory"):
        ck.latest(tmp_path / "a-file")
    (tmp_path / "empty").mkdir()
    assert ck.latest(tmp_path / "empty") is None
    assert ck.list_checkpoints(tmp_path / "empty") == ([], [])
    assert ck.latest(tmp_path / "ckpts") == str(tmp_path / "ckpts" / "step-1")


@pytest.mark.parametrize("command", [["ls"], ["ls", "--json"], ["verify"], ["verify", "--json"]])
def test_cli_on_a_missing_directory_exits_2_with_one_line(
        tmp_path: Path, command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a short path: the CLI's error console wraps at 80 columns
    (tmp_path / "ckpts").mkdir()
    out = CliRunner().invoke(cli, ["ckpt", command[0], "ckpst", *command[1:]])
    assert out.exit_code == 2, out.output
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and "no checkpoint directory at ckpst" in lines[0], out.output


@pytest.mark.parametrize("as_json", [False, True])
def test_verify_of_a_folder_that_is_no_checkpoint_exits_2_with_one_line(
        tmp_path: Path, as_json: bool) -> None:
    """The finding (attack helper 69, finding 10): `ckpt verify` of a plain folder (no
    manifest, no checkpoint in it) printed "DAMAGED home: 0 arrays", as if a checkpoint were
    there and broken; it says the folder is no checkpoint."""
    (tmp_path / "home" / "notes").mkdir(parents=True)
    (tmp_path / "home" / "notes.txt").write_text("mine\n")
    run = run_lcache("ckpt", "verify", "home", *(["--json"] if as_json else []), cwd=tmp_path)
    assert_one_line_error(run, "home is not a checkpoint", "no manifest.json")
    assert run.stdout == "" and "DAMAGED" not in run.stderr


# --------------------------------------------------------------------------- permissions
def mode(path: Path) -> int:
    return path.lstat().st_mode & 0o7777


def test_every_directory_a_save_creates_is_0700_whatever_the_umask(tmp_path: Path) -> None:
    from lcache.checkpoint import dirs

    old = os.umask(0)
    try:
        ck.save({"w": np.ones(10)}, tmp_path / "a" / "b" / "ckpts" / "step-1")
        stage, fd = dirs.open_staging(str(tmp_path / "a" / "b" / "ckpts"), "step-2")
        os.close(fd)
    finally:
        os.umask(old)
    for made in ("a", "a/b", "a/b/ckpts", "a/b/ckpts/step-1", "a/b/ckpts/.lcache-partial-step-2"):
        assert mode(tmp_path / made) == 0o700, (made, oct(mode(tmp_path / made)))
    for name in ("manifest.json", "rank00000.data"):
        assert mode(tmp_path / "a/b/ckpts/step-1" / name) == 0o600, name
    assert stage == str(tmp_path / "a/b/ckpts/.lcache-partial-step-2")


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(StorePermissionError, match=r"can be written by other users.*chmod go-w"):
        ck.save({"a": 1}, root / "s")
    above = tmp_path / "open"
    above.mkdir()
    above.chmod(0o777)  # not sticky: anyone could swap ckpts/ for their own
    with pytest.raises(PermissionError, match=r"lies in .*open, which other users can write"):
        ck.save({"a": 1}, above / "ckpts" / "s")
    assert os.listdir(root) == []
    assert os.listdir(above) == []  # refused before anything was created under it


def test_a_symlinked_root_planted_by_another_user_is_refused(tmp_path: Path,
                                                            nobody_dir: Path) -> None:
    """nobody plants /tmp-like/ckpts -> a directory of ours: saving through it would write
    where nobody chose (and nobody could swap the link between saves)."""
    shared = nobody_dir / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # world-writable and sticky, as /tmp
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    run_as_nobody("", f"os.symlink(sys.argv[1], {str(shared / 'ckpts')!r})", str(mine))
    assert (shared / "ckpts").is_symlink() and (shared / "ckpts").lstat().st_uid == 65534
    with pytest.raises(StorePermissionError, match=r"symbolic link owned by uid 65534"):
        ck.save({"a": 1}, shared / "ckpts" / "s")
    assert os.listdir(mine) == []
    # our own link to our own directory is fine
    (tmp_path / "link").symlink_to(mine)
    ck.save({"a": 1}, tmp_path / "link" / "s")
    assert ck.load(mine / "s") == {"a": 1}


# --------------------------------------------------------------------------- removal
def test_remove_checkpoint_removes_only_a_checkpoint(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory that was no checkpoint was deleted without a word; a bare name was renamed
    to a trash directory and then failed (fsync of ""), a trailing slash and a missing path
    were bare OSErrors (attack helper 47)."""
    monkeypatch.chdir(tmp_path)
    ck.save({"w": np.ones(4)}, "relcp")
    ck.save({"w": np.ones(4)}, tmp_path / "root" / "ck")
    ck.remove_checkpoint("relcp")  # a bare name, relative to the current directory
    ck.remove_checkpoint(f"{tmp_path / 'root' / 'ck'}/")
    assert os.listdir(tmp_path) == ["root"] and os.listdir(tmp_path / "root") == []
    (tmp_path / "victim" / "sub").mkdir(parents=True)
    (tmp_path / "victim" / "sub" / "data.txt").write_text("important")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text('{"someone": "else"}')
    for path, why in (("victim", "no manifest.json"), ("other", "not a readable lcache")):
        with pytest.raises(ConfigError, match=f"{path} is not an lcache checkpoint.*{why}"):
            ck.remove_checkpoint(path)
    assert (tmp_path / "victim" / "sub" / "data.txt").read_text() == "important"
    assert (tmp_path / "other" / "manifest.json").exists()
    with pytest.raises(ck.CheckpointNotFoundError, match="no checkpoint at nope"):
        ck.remove_checkpoint("nope")
    assert sorted(os.listdir(tmp_path)) == ["other", "root", "victim"]  # no trash left


# --------------------------------------------------------------------------- links, retention
def test_a_link_in_the_root_is_never_a_checkpoint_of_it(tmp_path: Path) -> None:
    """Links were listed (is_complete follows them) and then refused by remove_checkpoint: a
    `latest -> step-N` link made every save with keep_last raise "nothing was deleted" after
    deleting, and a link to an older checkpoint elsewhere failed keep_last=1 before it
    published, losing the checkpoint (attack helper 54)."""
    ck.save({"kept": True}, tmp_path / "archive" / "kept-forever")  # older than all below
    root = tmp_path / "ckpts"
    for step in range(4):  # the common convention: a `latest` link refreshed after each save
        ck.save({"step": step}, root / f"step-{step}", keep_last=2)
        (root / "latest").unlink(missing_ok=True)
        (root / "latest").symlink_to(f"step-{step}")
    assert sorted(os.listdir(root)) == ["latest", "step-2", "step-3"]
    assert [c.name for c in ck.list_checkpoints(root)[0]] == ["step-2", "step-3"]
    assert ck.latest(root) == str(root / "step-3")

    (root / "a-link").symlink_to(tmp_path / "archive" / "kept-forever")
    (root / "a-dangling-link").symlink_to(tmp_path / "nowhere")
    good, bad = ck.list_checkpoints(root)
    assert [c.name for c in good] == ["step-2", "step-3"] and bad == []
    assert ck.apply_retention(root, 1) == [str(root / "step-2")]
    ck.save({"step": 9}, root / "step-9", keep_last=1)  # published, the link neither counted
    assert sorted(os.listdir(root)) == ["a-dangling-link", "a-link", "latest", "step-9"]
    assert ck.load(tmp_path / "archive" / "kept-forever") == {"kept": True}
    assert ck.load(ck.latest(root)) == {"step": 9}
    out = CliRunner().invoke(cli, ["ckpt", "ls", "--json", str(root)])
    assert out.exit_code == 0, out.output
    assert [c["name"] for c in json.loads(out.output)["checkpoints"]] == ["step-9"]
    # a save under a link's name: refused as a link, not as "a checkpoint named 'a-link'
    # already exists" (helper 56), and nothing is written through it
    with pytest.raises(ConfigError, match="a-link is a link"):
        ck.save({"step": 10}, root / "a-link")
    assert ck.load(tmp_path / "archive" / "kept-forever") == {"kept": True}


def test_retention_skips_what_it_cannot_remove_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Retention that could not remove one checkpoint raised, after removing others, and
    failed the save (before publishing it, when it ran first) (attack helper 54)."""
    root = tmp_path / "ckpts"
    for step in range(3):
        ck.save({"step": step}, root / f"step-{step}")
    # an immutable folder cannot be moved away, even by root: a real EPERM
    if subprocess.run(["chattr", "+i", str(root / "step-0")]).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        with caplog.at_level(logging.WARNING, "lcache.checkpoint"):
            assert ck.apply_retention(root, 1) == [str(root / "step-1")]
            assert ck.save({"step": 3}, root / "step-3", keep_last=1) == str(root / "step-3")
        assert sorted(os.listdir(root)) == ["step-0", "step-3"]
        assert "retention kept " + str(root / "step-0") in caplog.text
    finally:
        subprocess.run(["chattr", "-i", str(root / "step-0")], check=True)

    def broken(root: str, keep_last: int, **_: object) -> list[str]:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(dirs, "retain", broken)
    with caplog.at_level(logging.WARNING, "lcache.checkpoint"):
        assert ck.save({"step": 4}, root / "step-4", keep_last=1) == str(root / "step-4")
    assert "retention after checkpoint " + str(root / "step-4") + " did not run" in caplog.text
    assert ck.load(ck.latest(root)) == {"step": 4}


def test_a_clock_set_back_never_makes_retention_remove_the_new_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints were ordered by their wall-clock creation time: after the clock stepped
    back (or on a node whose clock is behind), save(keep_last=1) returned the path of a
    checkpoint it had already removed, and latest() gave the older one (attack helper 68)."""
    import time

    root = tmp_path / "ckpts"
    for step in range(3):
        ck.save({"step": step}, root / f"step-{step}", keep_last=1)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 600)
    assert ck.save({"step": 3}, root / "step-3", keep_last=1) == str(root / "step-3")
    assert os.listdir(root) == ["step-3"]
    assert ck.latest(root) == str(root / "step-3")
    ck.save({"step": 4}, root / "step-4")
    assert [c.name for c in ck.list_checkpoints(root)[0]] == ["step-3", "step-4"]


def test_checkpoints_with_the_longest_names_are_removed(tmp_path: Path) -> None:
    """A name over 214 bytes could be saved but never removed: its trash name was too long
    (ENAMETOOLONG), so retention kept every one and the disk filled (attack helper 68)."""
    root = tmp_path / "ckpts"
    longest = 255 - len(dirs.PARTIAL)
    names = [f"{i}".ljust(longest, "x") for i in range(3)] + ["é" * (longest // 2)]
    for name in names:
        ck.save({"n": name}, root / name, keep_last=2)
    assert sorted(os.listdir(root)) == sorted(names[2:])
    ck.remove_checkpoint(root / names[3])
    assert os.listdir(root) == [names[2]]



def test_the_order_stops_at_its_largest(tmp_path: Path) -> None:
    """A manifest at the largest order must not make the next save's unreadable."""
    from lcache.checkpoint import manifest

    ck.save({"step": 0}, tmp_path / "step-0")
    where = tmp_path / "step-0" / "manifest.json"
    body = manifest.parse_manifest(where.read_bytes(), str(where))
    where.write_bytes(manifest.dump_manifest({**body, "order": manifest.MAX_ORDER}))
    ck.save({"step": 1}, tmp_path / "step-1")
    assert ck.load(ck.latest(tmp_path)) == {"step": 1}
    assert [c.order for c in ck.list_checkpoints(tmp_path)[0]] == [manifest.MAX_ORDER] * 2


_SAVER = """
import sys
import numpy as np
from lcache import checkpoint as ck
root, tag = sys.argv[1], sys.argv[2]
for i in range(40):
    ck.save({"x": np.arange(4)}, f"{root}/{tag}-{i:02d}", direct=False)
"""


def test_two_processes_publishing_into_one_folder_take_places_in_turn(tmp_path: Path) -> None:
    """Two processes saving into one folder took the same place (read before either
    published), and the later one's keep_last removed what it had just published (attack
    helper 72)."""
    savers = [subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path), tag])
              for tag in "ab"]
    assert [p.wait(timeout=120) for p in savers] == [0, 0]
    orders = [c.order for c in ck.list_checkpoints(tmp_path)[0]]
    assert len(orders) == 80 and len(set(orders)) == 80

    # a save publishes only while it holds the folder's publishing lock
    with dirs.publishing(str(tmp_path)):
        late = subprocess.Popen([sys.executable, "-c", _SAVER.replace("40", "1"),
                                 str(tmp_path), "c"])
        with pytest.raises(subprocess.TimeoutExpired):
            late.wait(timeout=3)
        assert not (tmp_path / "c-00").exists()
    assert late.wait(timeout=60) == 0
    assert ck.latest(tmp_path) == str(tmp_path / "c-00")


def test_a_checkpoint_without_an_order_is_placed_by_its_time(tmp_path: Path) -> None:
    """Checkpoints an older lcache wrote have no order: they sorted before every new one,
    so the next keep_last removed the newest of them (attack helper 72)."""
    from lcache.checkpoint import manifest

    ck.save({"step": 1}, tmp_path / "step-1")
    ck.save({"step": 2}, tmp_path / "step-2")
    where = tmp_path / "step-2" / "manifest.json"
    body = manifest.parse_manifest(where.read_bytes(), str(where))
    del body["order"]  # as an older version wrote it
    where.write_bytes(manifest.dump_manifest(body))
    assert ck.latest(tmp_path) == str(tmp_path / "step-2")
    ck.save({"step": 3}, tmp_path / "step-3", keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-3"]


def test_a_file_named_like_a_staging_folder_is_left_alone(tmp_path: Path) -> None:
    """A file or FIFO named .lcache-partial-* made every save fail with a raw
    NotADirectoryError from the clean-up (attack helper 72)."""
    (tmp_path / ".lcache-partial-old").write_text("mine")
    os.mkfifo(tmp_path / ".lcache-partial-fifo")
    assert ck.save({"step": 1}, tmp_path / "step-1") == str(tmp_path / "step-1")
    assert (tmp_path / ".lcache-partial-old").read_text() == "mine"
    (tmp_path / ".lcache-partial-step-2").write_text("in the way")
    with pytest.raises(ConfigError, match="not a folder"):
        ck.save({"step": 2}, tmp_path / "step-2")
    assert (tmp_path / ".lcache-partial-step-2").read_text() == "in the way"


def test_the_publishing_lock_is_shared_by_a_processs_threads_and_not_by_its_children(
        tmp_path: Path) -> None:
    """A save waited for ever for the folder's lock that its own process held (a SIGTERM
    handler's save while the main thread ran retention), or that a child forked meanwhile
    kept (a DataLoader worker): the lock was let go only by closing it (attack helper 77)."""
    import multiprocessing
    import time

    with dirs.publishing(str(tmp_path)):  # as a retention the handler interrupted
        ck.async_save({"x": 1}, tmp_path / "inside").wait(timeout=30)
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
        child.start()  # forked while the lock is held: it shares the open directory
    try:
        ck.async_save({"x": 2}, tmp_path / "after").wait(timeout=30)
        probe = subprocess.run([sys.executable, "-c", _SAVER.replace("40", "1"),
                                str(tmp_path), "other"], timeout=60)
        assert probe.returncode == 0  # another process is not kept out either
    finally:
        child.kill()
        child.join()
    assert ck.latest(tmp_path) == str(tmp_path / "other-00")


@pytest.mark.parametrize("mode", ["save", "raise"])
def test_a_signal_taken_while_waiting_for_the_lock_leaves_no_hold_behind(
        tmp_path: Path, mode: str) -> None:
    """A handler that ran right after the folder's flock was taken, before the hold was
    registered, left the lock held: a handler that saved waited for itself, and after one
    that raised every later save waited for ever (attack helper 79)."""
    import contextlib
    import signal
    import threading

    def handler(signum: int, frame: object) -> None:
        if mode == "raise":
            raise KeyboardInterrupt
        ck.save({"x": 1}, tmp_path / "from-handler")

    previous = signal.signal(signal.SIGUSR1, handler)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1)\n"),
        str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        # another thread takes the signal: the main thread's flock is not interrupted,
        # and the handler runs right after it returns
        timer = threading.Timer(0.3, lambda: signal.pthread_kill(threading.get_ident(),
                                                                 signal.SIGUSR1))
        timer.start()
        with contextlib.suppress(KeyboardInterrupt):
            ck.apply_retention(tmp_path, 10)  # waits behind the other process
        timer.join()
        ck.async_save({"x": 2}, tmp_path / "after").wait(timeout=30)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        holder.wait(timeout=30)
    assert ck.latest(tmp_path) == str(tmp_path / "after")
    assert dirs._HOLDS == {}
