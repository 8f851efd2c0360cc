"""Private directories: the one check every cache, store, checkpoint and bench directory passes.

Other users of the machine must not be able to read, swap or plant files in what lcache writes,
so a directory is accepted the way ssh accepts ``~/.ssh``: it is a real directory of the
effective user, nobody else can write it, and nobody but that user and root can replace it or
any directory above it (a directory writable by others above it is fine only if it is sticky,
as ``/tmp`` is). A symbolic link is followed only if it belongs to the user too: a link planted
by someone else (in ``/tmp``, say) is refused.
"""

from __future__ import annotations

import os
import stat

from lcache.errors import ConfigError, StorePermissionError


def make_private_dirs(path: str) -> None:
    """Create ``path`` and every missing parent with mode 0700, whatever the umask."""
    missing = []
    head = os.path.abspath(path)
    while not os.path.lexists(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue  # another process made it first; it is checked like any other
        os.chmod(d, 0o700)  # exactly 0700 (mkdir's mode is masked by the umask)


def _refuse(path: str, what: str, why: str, fix: str) -> StorePermissionError:
    return StorePermissionError(f"{what} {path} {why}; {fix}")


def check_private_dir(path: str, what: str = "directory") -> None:
    """Refuse ``path`` unless it is a directory only the effective user can change.

    Raises:
        StorePermissionError: another user owns it, can write it, or can replace it or a
            directory above it; or it is a symbolic link another user owns.
        ConfigError: it exists but is not a directory.
        FileNotFoundError: it does not exist.
    """
    uid = os.geteuid()
    full = os.path.abspath(path)
    st = os.lstat(full)
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid not in (uid, 0):
            raise _refuse(full, what, f"is a symbolic link owned by uid {st.st_uid}",
                          "links in a directory others can write are never followed: give the "
                          "real path")
        full = os.path.realpath(full)
        st = os.stat(full)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {full} exists and is not a directory")
    if st.st_uid != uid:
        raise _refuse(full, what, f"belongs to uid {st.st_uid}, not to you (uid {uid})",
                      "it is never shared between users: choose a directory of your own")
    if st.st_mode & 0o022:
        raise _refuse(full, what, f"can be written by other users (mode {st.st_mode & 0o777:o})",
                      _chmod_advice(full))
    _check_ancestors(full, what, uid)


def _chmod_advice(path: str) -> str:
    """What to do about ``path`` that others can write: chmod, unless its file system is
    read-only (a tmpfs mounted ro with mode 777), where only its mount can change it."""
    if os.statvfs(path).f_flag & os.ST_RDONLY:
        return ("its file system is read-only, so chmod cannot change it: mount it with a "
                "mode without go+w, or choose another directory")
    return f"run `chmod go-w {path}` or choose another directory"


def _check_ancestors(full: str, what: str, uid: int, parent: str | None = None) -> None:
    """Refuse ``full`` if ``parent`` (default: its parent) or a directory above can be
    replaced by another user."""
    parent = os.path.realpath(parent or os.path.dirname(os.path.realpath(full)))
    while True:
        st = os.stat(parent)
        if st.st_uid not in (uid, 0):
            raise _refuse(full, what, f"lies in {parent}, which uid {st.st_uid} owns and can "
                          "replace", "choose a directory under one of your own or root's")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise _refuse(full, what, f"lies in {parent}, which other users can write "
                          f"(mode {st.st_mode & 0o777:o}, not sticky)",
                          _chmod_advice(parent))
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up


def private_dir(path: str | os.PathLike[str], what: str = "directory",
                create: bool = True) -> str:
    """The absolute path of a checked private directory, created 0700 (parents too) if missing.

    Raises:
        StorePermissionError: see :func:`check_private_dir`, or it cannot be created or
            written.
        FileNotFoundError: it does not exist and ``create`` is false.
    """
    full = os.path.abspath(os.fspath(path))
    if create and not os.path.lexists(full):
        existing = os.path.dirname(full)
        while not os.path.lexists(existing):
            existing = os.path.dirname(existing)
        if os.path.isdir(existing):  # refuse before creating anything under it
            _check_ancestors(full, what, os.geteuid(), existing)
        try:
            make_private_dirs(full)
        except NotADirectoryError as exc:
            raise ConfigError(f"cannot create the {what} {full}: a parent is not a "
                              "directory") from exc
        except OSError as exc:  # no permission, a read-only file system, an immutable parent
            raise StorePermissionError(f"cannot create the {what} {full}: {exc.strerror}; "
                                       "choose a directory you can write") from exc
    check_private_dir(full, what)
    # Every caller writes there: say so now, not as a bare OSError from the first file made
    # (root passes permission bits, not a read-only mount or an immutable directory).
    if not os.access(full, os.W_OK | os.X_OK):
        os.stat(full)  # removed meanwhile (a closing process's staging dir): the caller retries
        raise StorePermissionError(f"the {what} {full} is not writable by this user (its "
                                   "permissions, a read-only file system or an immutable "
                                   "directory); fix its permissions or choose a directory you "
                                   "can write")
    return full
