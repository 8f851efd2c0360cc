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
import fcntl
import os
import re
import stat
from typing import Protocol

from lcache.errors import CorruptionError, DiskFullError
from lcache.io import close_file, fsync_dir, open_file
from lcache.io.publish import kind_of

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


def not_regular_error(path: str, mode: int) -> CorruptionError:
    what = kind_of(mode) or "not a regular file"
    return CorruptionError(
        f"{path} is {what}, not a regular file, and lcache never reads one inside a store; "
        f"remove it (run `lcache fsck --repair {store_root(path)}`)")


def open_in_store(path: str, flags: int, direct: bool = False, mode: int = 0o600) -> int:
    """``open_file`` (``O_NOFOLLOW``, ``O_CLOEXEC``) of a regular file, with a planted link
    or anything else (a FIFO, a device, a socket) as a clear error.

    Opened with ``O_NONBLOCK``, so a FIFO planted under a store file's name never blocks the
    open; the fd is checked (``fstat``) and the flag cleared for a regular file.

    Raises:
        CorruptionError: ``path`` is a symbolic link or not a regular file.
    """
    try:
        fd = open_file(path, flags | os.O_NONBLOCK, direct, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise symlink_error(path) from exc
        if exc.errno == errno.ENXIO:  # a FIFO opened for writing, with no reader
            raise not_regular_error(path, stat.S_IFIFO) from exc
        raise
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise not_regular_error(path, st_mode)
        if not flags & os.O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        close_file(fd)
        raise
    return fd


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
