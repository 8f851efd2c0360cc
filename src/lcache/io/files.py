"""Opening files for the engine: O_DIRECT where asked, owner-only permissions, block size."""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from lcache.errors import ConfigError
from lcache.io import tracer as _tracer

O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def open_file(path: str, flags: int, direct: bool = False, mode: int = 0o600,
              follow: bool = False) -> int:
    """``os.open`` with ``O_CLOEXEC`` and ``O_NOFOLLOW``, and ``O_DIRECT`` when ``direct`` is true.

    Every file lcache keeps lies in a directory of its own, where a symbolic link can only
    be a plant: it is refused (``OSError`` ELOOP), never followed. A user's file (a sample,
    an index) is opened with ``follow=True``, as any reader of it would. The fd is given a
    file id for the tracer (events name it without a system call); close it with
    :func:`close_file`.

    Raises:
        ConfigError: O_DIRECT was asked for on a platform or filesystem without it.
    """
    flags |= os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    if direct:
        if not O_DIRECT:
            raise ConfigError("O_DIRECT is not available on this platform; use direct_io=False")
        try:
            fd = os.open(path, flags | O_DIRECT, mode)
        except OSError as exc:
            if exc.errno == 22:  # EINVAL: the filesystem (e.g. tmpfs) refuses O_DIRECT
                raise ConfigError(
                    f"the filesystem of {path} does not support O_DIRECT; use direct_io=False"
                ) from exc
            raise
    else:
        fd = os.open(path, flags, mode)
    _tracer.note_open(fd, os.fsdecode(path))
    return fd


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str | None:
    """What a file of ``st_mode`` ``mode`` is when not a regular file ("a FIFO"...)."""
    return next((kind for test, kind in _KINDS if test(mode)), None)


class NotRegularFile(OSError):
    """:func:`open_regular` found something else under the name; ``kind`` says what."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(f"{path} is {kind}, not a regular file")
        self.kind = kind


def open_regular(path: str, flags: int, direct: bool = False, mode: int = 0o600,
                 follow: bool = False) -> int:
    """:func:`open_file` of a regular file only. Opened with ``O_NONBLOCK``, so a FIFO under
    the name never blocks the open; the fd is checked (``fstat``) and the flag cleared.

    Raises:
        NotRegularFile: a FIFO, a device, a socket or a directory is there.
    """
    try:
        fd = open_file(path, flags | os.O_NONBLOCK, direct, mode, follow)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO opened for writing, with no reader
            raise NotRegularFile(path, "a FIFO") from exc
        if exc.errno == errno.EISDIR:  # a directory opened for writing
            raise NotRegularFile(path, "a directory") from exc
        raise
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise NotRegularFile(path, kind_of(st_mode) or "not a regular file")
        if not flags & os.O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        close_file(fd)
        raise
    return fd


def open_owned(path: str, flags: int, place: str = "cache directory") -> int:
    """:func:`open_regular` of a file lcache keeps in a directory of its own (a lock, a
    listing, a table): anything else under its name was put there, and is refused.

    Raises:
        ConfigError: a symbolic link, a directory, a FIFO, a device or a socket is there;
            the message names it and says to remove it (or use another ``place``).
    """
    try:
        return open_regular(path, flags)
    except NotRegularFile as exc:
        kind = exc.kind
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        kind = "a symbolic link"
    raise ConfigError(f"{path} is {kind}, not a regular file; remove it (or use another "
                      f"{place})")


def close_file(fd: int) -> None:
    """Close an fd from :func:`open_file`, and forget its file id: an fd closed with a bare
    ``os.close`` keeps its id until ``open_file`` hands out the number again, so an fd that
    something else opens meanwhile would be traced under the old name."""
    _tracer.note_close(fd)
    os.close(fd)


def read_and_close(fd: int, limit: int = -1) -> bytes:
    """Read an fd from :func:`open_file` to its end (or ``limit`` bytes), then close it
    (:func:`close_file`; ``os.fdopen`` would close it with its file id kept)."""
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    finally:
        close_file(fd)


def logical_block_size(path: str) -> int:
    """The alignment O_DIRECT needs for ``path``'s filesystem (``f_bsize``, at least 512)."""
    try:
        return max(512, os.statvfs(path).f_bsize)
    except OSError:
        return 4096


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new, renamed or removed files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache(fd: int) -> None:
    """Ask the kernel to forget cached pages of ``fd`` (after they are written back)."""
    if hasattr(os, "posix_fadvise"):
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
