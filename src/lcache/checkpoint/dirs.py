"""Checkpoint directories: staging, atomic publish, listing, leftovers and retention.

A save writes into ``ROOT/.lcache-partial-NAME/`` and publishes by writing ``manifest.json``
there (temp file, fsync, rename) and then renaming the directory to ``ROOT/NAME`` (and fsyncing
ROOT). So ``ROOT/NAME`` either does not exist or holds a complete checkpoint; ``kill -9`` at any
moment leaves at most a hidden staging directory, which the next save in ROOT removes.

Writers hold a shared ``flock`` on the staging directory itself, released by the kernel
when they die, so clean-up never removes a save in progress (DESIGN: no lock files whose
existence is the lock).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lcache.checkpoint.errors import (
    CheckpointExistsError,
    CheckpointFailedError,
    CheckpointNotFoundError,
    ConfigError,
)
from lcache.checkpoint.format import MANIFEST
from lcache.checkpoint.manifest import MAX_MANIFEST_BYTES, MAX_ORDER, parse_manifest
from lcache.checkpoint.persist import IO_CLASS, read_small_file
from lcache.checks import lies_within, path_argument, unshowable, whole_number
from lcache.errors import LCacheError, StorePermissionError
from lcache.io import atomic_write, close_file, fsync_dir, private_dir

log = logging.getLogger("lcache.checkpoint")

PARTIAL = ".lcache-partial-"
TRASH = ".lcache-trash-"


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A complete checkpoint found in a directory (from its manifest)."""

    name: str
    path: str
    created_unix: float
    world_size: int
    arrays: int
    data_bytes: int
    meta: dict[str, Any]
    order: float = 0.0  # when it was published, never before one published earlier (below)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "created_unix": self.created_unix,
                "world_size": self.world_size, "arrays": self.arrays,
                "data_bytes": self.data_bytes, "meta": self.meta, "order": self.order}


def split_path(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(root, name) of a checkpoint path; the name must be a plain directory name."""
    full = os.path.abspath(path_argument(path, "checkpoint path"))
    root, name = os.path.split(full.rstrip(os.sep))
    if not name or name.startswith(".") or name in ("..",):
        raise ConfigError(f"checkpoint path {os.fspath(path)!r} must end in a directory name "
                          "that does not start with '.', e.g. ckpts/step-100")
    bad = unshowable(name)
    if bad is not None:  # `lcache ckpt ls` would print it raw: an ESC sequence, a split line
        raise ConfigError(f"checkpoint name {name[:60]!r} holds the control or format "
                          f"character {bad!r}, which a listing cannot show as it is; give a "
                          "name of printable characters, e.g. step-100")
    if lies_within(os.getcwd(), full):
        # publishing renames the checkpoint onto the path: it would replace the directory
        # this process works in
        raise ConfigError(f"checkpoint path {os.fspath(path)!r} is the current directory or "
                          "holds it; give a path below it, e.g. ckpts/step-100")
    if len(os.fsencode(PARTIAL + name)) > 255:  # the staging directory's name must fit
        raise ConfigError(f"checkpoint name {name[:40]!r}... is too long: at most "
                          f"{255 - len(PARTIAL)} bytes")
    return root, name


def staging_dir(root: str, name: str) -> str:
    return os.path.join(root, PARTIAL + name)


def ensure_root(root: str) -> None:
    """Create ``root`` owner-only if needed; refuse one that is not private to you."""
    private_dir(root, "checkpoint directory")


def is_complete(path: str) -> bool:
    """Whether ``path`` has a manifest entry (of any kind: a link or a FIFO there is a damaged
    checkpoint, listed as such, not an unfinished save)."""
    return os.path.lexists(os.path.join(path, MANIFEST))


def open_staging(root: str, name: str, alone: bool = False) -> tuple[str, int]:
    """Create (or reuse) the staging directory and hold a ``flock`` on it: shared by the
    ranks of one save; exclusive for a save of one process (``alone``), so that two of them
    (scripts started without a process group are each rank 0 of 1) never write one file and
    publish each other's halves.

    Returns (staging path, locked directory fd); close the fd when the save is over.

    Raises:
        CheckpointExistsError: ``alone``, and another save of that name is running.
    """
    if is_complete(os.path.join(root, name)) and not os.path.islink(os.path.join(root, name)):
        raise CheckpointExistsError(f"a checkpoint named {name!r} already exists in {root}; "
                                    "checkpoints are never overwritten: pick a new name "
                                    "(e.g. with the step number) or delete it first")
    final = os.path.join(root, name)
    if os.path.islink(final) or (os.path.lexists(final) and not os.path.isdir(final)):
        what = "is a link (no checkpoint of the folder)" if os.path.islink(final) else \
            "exists and is not a directory"
        raise ConfigError(f"{final} {what}: a checkpoint would be published there as one; "
                          "pick another name or move it away")
    if os.path.isdir(final) and os.listdir(final):
        raise ConfigError(f"{final} exists and is neither a checkpoint nor empty: pick "
                          "another name or move it away")
    stage = staging_dir(root, name)
    if os.path.islink(stage) or (os.path.lexists(stage) and not os.path.isdir(stage)):
        what = "a link" if os.path.islink(stage) else "not a folder"
        raise ConfigError(f"{stage} is in the way of this save's staging folder and lcache did "
                          f"not make it (it is {what}): move it away")
    busy = 0
    for _ in range(10):
        try:
            os.makedirs(stage, mode=0o700, exist_ok=True)
        except OSError as exc:  # e.g. /proc, where nothing can be created
            raise StorePermissionError(f"cannot create a staging directory in the checkpoint "
                                       f"directory {root}: {exc.strerror}; choose a directory "
                                       "you can write") from exc
        try:
            fd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:  # another save's clean-up removed it after our mkdir
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if alone else fcntl.LOCK_SH)
        except BlockingIOError:
            # another save of this name, or a clean-up moving a leftover away: ask again
            close_file(fd)
            busy += 1
            time.sleep(0.01)
            continue
        try:
            if os.path.samestat(os.fstat(fd), os.stat(stage)):
                return stage, fd
        except FileNotFoundError:
            pass
        close_file(fd)  # a clean-up removed it between mkdir and flock: make it again
    if busy == 10:
        raise CheckpointExistsError(
            f"another save of a checkpoint named {name!r} into {root} is running; "
            "checkpoints are never overwritten: pick a new name (e.g. with the step number)")
    raise ConfigError(f"cannot hold staging directory {stage}: something keeps removing it")


def _trash_path(root: str, name: str) -> str:
    """A trash name for ``name`` in ``root``, cut to fit 255 bytes (a checkpoint named with
    215 or more could not be renamed to it: ENAMETOOLONG, and retention kept every one)."""
    tail = f"-{os.getpid()}-{time.time_ns()}".encode()
    short = os.fsencode(name)[:255 - len(TRASH) - len(tail)]
    return os.path.join(root, os.fsdecode(os.fsencode(TRASH) + short + tail))


def _take_if_unlocked(path: str) -> str | None:
    """Move staging dir ``path`` to the trash if no live save holds its lock; returns where
    it went. The lock is held through the rename: checked, then let go before the removal, a
    save that took the directory in between lost it (a raw FileNotFoundError)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # gone, or not a folder (a file, a FIFO, a link): not lcache's to remove
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not os.path.samestat(os.fstat(fd), os.stat(path)):
            return None  # replaced since we opened it: someone else's now
        trash = _trash_path(os.path.dirname(path), os.path.basename(path))
        os.rename(path, trash)
        return trash
    except (BlockingIOError, FileNotFoundError):
        return None
    finally:
        close_file(fd)


def leftovers(root: str) -> list[str]:
    """Staging and trash directories in ``root`` (interrupted saves and deletions)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(root, n) for n in names if n.startswith((PARTIAL, TRASH)))


def clean_leftovers(root: str, keep: str | None = None) -> list[str]:
    """Remove what interrupted saves left in ``root`` (never a save still running, never
    ``keep``); returns the paths removed."""
    removed = []
    for path in leftovers(root):
        if path == keep:
            continue
        if os.path.basename(path).startswith(PARTIAL):
            taken = _take_if_unlocked(path)
            if taken is None:
                continue
            shutil.rmtree(taken, ignore_errors=True)
            if not os.path.exists(taken):
                removed.append(path)
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    if removed:
        fsync_dir(root)
    return removed


def publish(stage: str, root: str, name: str, manifest: bytes, expected: set[str]) -> str:
    """Make the staged checkpoint visible as ``root/name``; returns that path.

    Raises:
        CheckpointFailedError: a data file ``expected`` is not in the stage (a rank wrote
            its shard elsewhere): published, the checkpoint would miss it.
    """
    entries = os.listdir(stage)
    missing = sorted(expected - set(entries))
    if missing:
        raise CheckpointFailedError(f"{stage} lacks {', '.join(missing)}: a rank's shard is "
                                    "not there; the checkpoint was not published")
    for entry in entries:  # stale files of an earlier, interrupted save
        if entry not in expected:
            os.unlink(os.path.join(stage, entry))
    atomic_write(os.path.join(stage, MANIFEST), manifest, io_class=IO_CLASS)  # dir synced too
    final = os.path.join(root, name)
    if is_complete(final):
        raise CheckpointExistsError(f"a checkpoint named {name!r} appeared in {root} while "
                                    "this one was saved; it was not overwritten")
    os.rename(stage, final)  # atomic; replaces only an empty directory
    fsync_dir(root)
    return final


def read_info(path: str) -> CheckpointInfo:
    """The listing entry of the checkpoint at ``path`` (raises CorruptionError if damaged)."""
    where = os.path.join(path, MANIFEST)
    body = parse_manifest(read_small_file(where, MAX_MANIFEST_BYTES), where)  # fields checked
    shards = body["shards"]
    return CheckpointInfo(
        os.path.basename(path), path, float(body["created_unix"]), body["world_size"],
        sum(len(s["arrays"]) for s in shards), sum(s["data_bytes"] for s in shards),
        body.get("meta", {}), float(body.get("order", body["created_unix"])))


def require_dir(root: str) -> None:
    """Raise CheckpointNotFoundError unless ``root`` is a directory (a mistyped path must not
    read as "no checkpoint yet": a resume would silently start from scratch)."""
    if not os.path.isdir(root):
        why = "it is not a directory" if os.path.lexists(root) else "check the path"
        raise CheckpointNotFoundError(f"no checkpoint directory at {root} ({why})")


def list_checkpoints(root: str | os.PathLike[str]) -> tuple[list[CheckpointInfo], list[str]]:
    """Complete checkpoints in ``root``, oldest first, and the names of damaged ones.

    Staging and trash directories are never listed, nor links (a ``latest -> step-N`` kept by
    the user, a link to a checkpoint elsewhere): a link is not a checkpoint of ``root``, so
    retention neither counts nor removes it, and ``latest`` never returns it.

    Raises:
        CheckpointNotFoundError: ``root`` is not a directory (an empty one lists nothing).
    """
    root = path_argument(root, "checkpoint directory")
    require_dir(root)
    good: list[CheckpointInfo] = []
    bad: list[str] = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith(".") or os.path.islink(path) or not is_complete(path):
            continue
        try:
            good.append(read_info(path))
        except (LCacheError, OSError):
            bad.append(name)
    good.sort(key=lambda c: (c.order, c.name))
    return good, bad


def next_order(root: str, good: list[CheckpointInfo] | None = None) -> float:
    """The ``order`` of a checkpoint published in ``root`` now (under ``publishing``): the
    time, but after every other's. By the wall clock alone, a save after the clock was set
    back (or on a node whose clock is behind) sorted before its elders, and keep_last removed
    it as soon as it was published. Checkpoints of versions without it are in by their time.
    ``good``: the listing the caller made under the same hold (retention keeps the newest)."""
    if good is None:
        good, _ = list_checkpoints(root)
    newest = max((c.order for c in good), default=0.0)
    key = os.path.realpath(root)
    with _HOLDS_LOCK:  # threads of a process share the lock: their orders still differ
        order = max(time.time(), newest + 0.001, _LAST_ORDER.get(key, 0.0) + 0.001)
        _LAST_ORDER[key] = min(order, MAX_ORDER)
        return _LAST_ORDER[key]


# This process's holds of ``publishing``, by directory: [depth, fd]. The ``flock`` keeps
# other processes out; the threads of this one share it and never wait for each other: a
# signal handler's save while the main thread ran retention waited for that very thread
# (flock locks belong to open files, and another open of the directory is another one).
# Their orders stay distinct (``next_order``), and a save's retention spares its own.
_HOLDS: dict[str, list[int]] = {}
_HOLDS_LOCK = threading.RLock()  # re-entrant: a signal handler may publish in the holder
_LAST_ORDER: dict[str, float] = {}  # the last order this process gave, by directory


def _forget_holds() -> None:
    """In a forked child: the parent's holds are not its, nor is the lock another thread of
    the parent may have held."""
    _HOLDS.clear()
    _HOLDS_LOCK._at_fork_reinit()  # type: ignore[attr-defined]


os.register_at_fork(after_in_child=_forget_holds)


@contextlib.contextmanager
def publishing(root: str) -> Iterator[None]:
    """Held while a checkpoint is published in ``root`` and while retention runs there: two
    processes saving into one directory took the same place (read before either published)
    and the later one's retention removed it. Shared by the threads of a process: each takes
    the ``flock`` on the one open directory they share (taken once, it is theirs). A
    filesystem without ``flock`` on directories goes without (as before).

    Why so: a signal handler runs between any two calls, and one that raised or saved while
    the main thread held the lock left it held (later saves waited for ever). Registered
    before it is taken, released before it is forgotten, a hold never outlives its block."""
    key = os.path.realpath(root)
    hold: list[int] | None = None
    try:
        with _HOLDS_LOCK:
            held = _HOLDS.get(key)
            if held is None:
                held = _HOLDS[key] = [0, os.open(root, os.O_RDONLY | os.O_DIRECTORY |
                                                 os.O_CLOEXEC)]
            held[0] += 1
            hold = held  # no call in between: no signal handler runs between the two
        with contextlib.suppress(OSError):
            fcntl.flock(hold[1], fcntl.LOCK_EX)
        yield
    finally:
        if hold is not None:
            with _HOLDS_LOCK:
                hold[0] -= 1
                if hold[0] == 0:  # an entry left at 0 (interrupted here) is taken again
                    try:
                        # unlocked, not only closed: a child forked meanwhile (a DataLoader
                        # worker) shares the open file, and held the lock until it exited
                        with contextlib.suppress(OSError):
                            fcntl.flock(hold[1], fcntl.LOCK_UN)
                        close_file(hold[1])
                    finally:
                        _HOLDS.pop(key, None)


def latest(root: str | os.PathLike[str]) -> str | None:
    """The path of the newest complete checkpoint in ``root``, or None if it has none.

    Raises:
        CheckpointNotFoundError: ``root`` is not a directory.
    """
    good, _ = list_checkpoints(root)
    return good[-1].path if good else None


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Delete the published checkpoint at ``path``: renamed out of sight first, so no
    half-deleted one is listed.

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        ConfigError: ``path`` is not an lcache checkpoint (no readable lcache manifest, or a
            link to one); nothing is deleted.
    """
    given = path_argument(path, "checkpoint path")
    # absolute: a bare name's parent would be "" (which cannot be fsynced), and "ck/" would
    # be renamed into itself
    full = os.path.abspath(given)
    root, name = os.path.split(full)
    if not os.path.lexists(full):
        raise CheckpointNotFoundError(f"no checkpoint at {given} to remove (check the path)")
    why = ("it is a link" if os.path.islink(full) else
           "it is not a directory" if not os.path.isdir(full) else
           "it is a staging or trash directory" if name.startswith(".") else
           f"it has no {MANIFEST}" if not is_complete(full) else "")
    if not why:
        try:  # a directory of someone else's that happens to hold a manifest.json
            read_info(full)
        except (LCacheError, OSError) as exc:
            why = f"its {MANIFEST} is not a readable lcache manifest: {exc}"
    if why:
        raise ConfigError(f"{given} is not an lcache checkpoint ({why}); nothing was "
                          "deleted: remove_checkpoint deletes only checkpoints")
    trash = _trash_path(root, name)
    os.rename(full, trash)
    fsync_dir(root)
    shutil.rmtree(trash, ignore_errors=True)  # what is left, the next save's clean-up removes


def apply_retention(root: str | os.PathLike[str], keep_last: int) -> list[str]:
    """Keep the newest ``keep_last`` complete checkpoints in ``root``; returns paths removed.

    The newest complete checkpoint is never removed (``keep_last`` must be >= 1). One that
    cannot be removed (changed under us, a permission error) is kept with a warning, and the
    others are still removed: retention runs after a save, which it must never fail.

    Raises:
        ConfigError: ``keep_last`` is not a whole number >= 1.
        CheckpointNotFoundError: ``root`` is not a directory.
    """
    root = path_argument(root, "checkpoint directory")
    require_dir(root)
    with publishing(root):
        return retain(root, keep_last)


def retain(root: str, keep_last: int, spare: str | None = None,
           good: list[CheckpointInfo] | None = None) -> list[str]:
    """``apply_retention`` under ``publishing(root)``, which the caller holds; ``spare``
    (the checkpoint a save just published) is kept whatever its place: threads of one process
    publish side by side, and one's retention removed the other's. ``good``: the listing the
    caller made under the same hold (each manifest read once per save)."""
    keep_last = whole_number(keep_last, "keep_last", 1)  # 0 would delete the newest
    if good is None:
        good, _ = list_checkpoints(root)
    removed = []
    for info in good[:-keep_last]:
        if info.path == spare:
            continue
        try:
            remove_checkpoint(info.path)
        except CheckpointNotFoundError:
            continue  # removed meanwhile (by hand, or by a saver of an older version)
        except (LCacheError, OSError) as exc:
            log.warning("retention kept %s: it could not be removed (%s)", info.path, exc)
            continue
        removed.append(info.path)
    return removed
