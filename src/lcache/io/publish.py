"""Atomic publish: a file is either absent, its old version, or whole under its final name."""

from __future__ import annotations

import errno
import os

from lcache.errors import ConfigError, DiskFullError
from lcache.io.engine import pwrite_full, sync_fd
from lcache.io.files import close_file, fsync_dir, kind_of, open_file


def atomic_write(path: str, data: bytes, *, io_class: str = "other", durable: bool = True,
                 mode: int = 0o600) -> None:
    """Write ``data`` to ``path.tmpPID`` beside ``path``, fsync, rename; never half-written.

    With ``durable`` the file and its directory entry are synced before returning. Killed
    processes leave ``.tmpPID`` files, which the owners' clean-ups remove by that name.

    Raises:
        DiskFullError: the device is full (an ``OSError`` too); nothing is left behind.
        ConfigError: ``path`` is a directory, a device, a FIFO or a socket: replacing it
            would remove it (as root, ``-o /dev/null`` would replace the system's).
    """
    _refuse_special(path)
    tmp = f"{path}.tmp{os.getpid()}"
    made = False
    try:
        # open_file: O_NOFOLLOW, and a file id the trace names this write by. O_EXCL: a link,
        # FIFO or folder under that name is not ours (a link was removed on the error); a
        # regular file is taken for the leftover of a killed lcache process that had our pid
        # (a restarted container's pids repeat), removed, and made again
        for attempt in range(2):
            try:
                fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode=mode)
                break
            except FileExistsError:
                if attempt or special_kind(tmp) is not None or os.path.islink(tmp):
                    raise ConfigError(f"{tmp} is in the way of writing {path} (the name "
                                      "lcache writes it under first); move it away") from None
                os.unlink(tmp)
        made = True
        try:
            os.fchmod(fd, mode)  # exactly ``mode``, whatever the umask
            pwrite_full(fd, 0, [data], io_class)
            if durable:
                sync_fd(fd, False, io_class)
        finally:
            close_file(fd)
        os.replace(tmp, path)
        if durable:
            fsync_dir(os.path.dirname(path) or ".")
    except BaseException as exc:
        if made and os.path.lexists(tmp):
            os.unlink(tmp)
        # Why: a full disk must surface as DiskFullError wherever it happens (sealing a
        # segment, writing stats.json, a manifest), not as a bare OSError.
        if isinstance(exc, OSError) and not isinstance(exc, DiskFullError) and exc.errno in (
            errno.ENOSPC, errno.EDQUOT
        ):
            raise DiskFullError(f"no space left on the device writing {path}") from exc
        raise


def special_kind(path: str) -> str | None:
    """What ``path`` is when it is neither absent nor a regular file ("a character device",
    "a directory"...), else None."""
    try:
        return kind_of(os.stat(path).st_mode)
    except OSError:
        return None  # absent (or unreadable: the write says why)


def names_directory(path: str) -> bool:
    """Whether ``path`` names a directory by its spelling, whatever is there: it ends in
    ``/``, ``.`` or ``..`` as a last part. ``os.path.abspath`` drops a trailing slash, and
    ``lcache trace -o tdir/`` wrote a file ``tdir``."""
    return os.path.basename(path) in ("", ".", "..")


def _refuse_special(path: str) -> None:
    kind = special_kind(path)
    if kind is not None:
        raise ConfigError(f"{path} is {kind}; lcache writes a file whole and replaces what "
                          "was there, so it writes only to a regular file or a new name")
