"""Opening a store's files, and the files that are replaced whole by a new generation.

Never through a symbolic link: the store directory is private, so a link inside it can only be
a plant or damage; every file is opened with ``O_NOFOLLOW`` and a link is a CorruptionError
that says how to get rid of it. Nor anything but a regular file: a FIFO, a device or a socket
under a store file's name is opened without blocking (``O_NONBLOCK``) and refused the same way.

The indexes and the delete journal are replaced whole (an index grows into a larger table,
``fsck --repair`` rebuilds one, the journal is compacted), while other processes hold them
mapped or open. Each lives in ``STEM-G.bin``; the current generation G of each is a word of the
shared ``lock`` page (``layout.MetaPage``). A new generation is built under a temp name,
renamed to ``STEM-G+1.bin`` and only then published by bumping the word, so a name with no
``.tmp`` is always whole and no process ever opens a half-built file; every user of the file
compares the word with the generation it holds (one load from a shared page) before each use
and reopens when it moved. A crash between the rename and the bump leaves a complete file that
nobody uses; a crash after it, the old file. Either is removed at the next open (under the meta
lock, when no process can be publishing).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from typing import Protocol

from lcache.errors import CorruptionError, DiskFullError
from lcache.io import fsync_dir
from lcache.io.files import NotRegularFile, open_regular

STEMS = ("index-int", "index-bytes", "deletes")
_GENERATIONAL = re.compile(r"^(index-int|index-bytes|deletes)-(\d+)\.bin$")


class Generations(Protocol):
    """Where the current generation of each stem is kept (the shared ``lock`` page)."""

    def generation(self, stem: str) -> int: ...

    def set_generation(self, stem: str, gen: int) -> None: ...


def store_root(path: str) -> str:
    """The store directory holding ``path`` (a top-level file or one in ``segments/``)."""
    parent = os.path.dirname(path)
    return os.path.dirname(parent) if os.path.basename(parent) == "segments" else parent


def symlink_error(path: str) -> CorruptionError:
    return CorruptionError(
        f"{path} is a symbolic link, and lcache never follows one inside a store; remove it "
        f"(run `lcache fsck --repair {store_root(path)}`)")


def open_in_store(path: str, flags: int, direct: bool = False, mode: int = 0o600) -> int:
    """``open_regular`` (``O_NOFOLLOW``, ``O_CLOEXEC``, never blocking on a FIFO) with a
    planted link or anything but a regular file (a FIFO, a device, a socket) as a clear
    error.

    Raises:
        CorruptionError: ``path`` is a symbolic link or not a regular file.
    """
    try:
        return open_regular(path, flags, direct, mode)
    except NotRegularFile as exc:
        raise CorruptionError(
            f"{path} is {exc.kind}, not a regular file, and lcache never reads one inside a "
            f"store; remove it (run `lcache fsck --repair {store_root(path)}`)") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise symlink_error(path) from exc
        raise


def allocate(fd: int, path: str, start: int, length: int) -> None:
    """Give the file real blocks under [start, start + length) (``posix_fallocate``).

    Why: a store through a shared mapping into a hole needs a new block, and on tmpfs even a
    read of a hole does; on a full filesystem the kernel answers with SIGBUS, which kills the
    process. Asked for here first, the space can fail as DiskFullError instead.
    """
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, start, length)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"no space left on the device for {path}") from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def generation_path(root: str, stem: str, gen: int) -> str:
    return os.path.join(root, f"{stem}-{gen}.bin")


def existing_generations(root: str, stem: str) -> list[int]:
    found = []
    for name in os.listdir(root):
        m = _GENERATIONAL.match(name)
        if m and m.group(1) == stem:
            found.append(int(m.group(2)))
    return sorted(found)


def current_generation(root: str, meta: Generations, stem: str) -> int:
    """The generation of ``stem`` to use; the caller holds the meta lock.

    A newer file than the ``lock`` page names means the page was lost (a recreated ``lock``
    starts at 0): that file is adopted. An older one is never adopted (it is stale).
    """
    gen = meta.generation(stem)
    if not os.path.lexists(generation_path(root, stem, gen)):
        newer = [g for g in existing_generations(root, stem) if g > gen]
        if newer:
            gen = newer[-1]
            meta.set_generation(stem, gen)
    return gen


def publish_generation(root: str, meta: Generations, stem: str, tmp: str, gen: int) -> str:
    """Make the complete file ``tmp`` generation ``gen`` of ``stem``; returns its path.

    The caller holds the meta lock and has synced ``tmp``. The old generation's file is
    unlinked; processes that have it open move on when they see the new generation.
    """
    path = generation_path(root, stem, gen)
    os.replace(tmp, path)
    fsync_dir(root)
    bump_generation(root, meta, stem, gen)
    return path


def bump_generation(root: str, meta: Generations, stem: str, gen: int) -> None:
    """Make the complete, durable file of generation ``gen`` the current one and unlink the
    old one (meta lock held)."""
    old = generation_path(root, stem, meta.generation(stem))
    meta.set_generation(stem, gen)
    if old != generation_path(root, stem, gen):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(old)


def stale_generation_files(root: str, meta: Generations) -> list[str]:
    """Files of a generation that is not the current one (left by a crash or a lost
    ``lock``); the caller holds the meta lock."""
    stale = []
    for name in sorted(os.listdir(root)):
        m = _GENERATIONAL.match(name)
        if m and int(m.group(2)) != meta.generation(m.group(1)):
            stale.append(os.path.join(root, name))
    return stale
