"""The swap file of one rank: a stable name, a manifest, a kernel lock, aligned I/O.

``DIR/rankNNNNN.swap`` holds the state; ``DIR/rankNNNNN.json`` describes its layout (written
with ``atomic_write``). Names depend only on the rank, never on Python object ids, so the files
of a killed run are found by the next start in the same directory (DeepSpeed PR #4416: swap
files named by ``id()`` piled up). The owner holds an exclusive ``flock`` on the swap file,
released by the kernel when it dies: a start that gets the lock reuses the file (a killed
run's), one that does not is refused (a live run's). A start also removes the files of other
ranks whose lock it gets (a killed run of more ranks than this one left them, each the size of
a rank's whole state); it opens and locks its own file, and reclaims, under an exclusive
``flock`` on the directory, so no rank's file is ever taken for dead between its creation and
its lock. ``close()`` removes both files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import logging
import os
import re
import socket
import stat
from typing import Any

from lcache.errors import (
    ConfigError,
    CorruptionError,
    DiskFullError,
    LCacheError,
    StorePermissionError,
)
from lcache.io import (
    Pending,
    atomic_write,
    close_file,
    default_engine,
    logical_block_size,
    open_file,
    private_dir,
)

log = logging.getLogger("lcache.offload")

IO_READ = "offload-read"
IO_WRITE = "offload-write"
CHUNK = 4 << 20  # one engine operation: several in flight keep the device busy
FORMAT = "lcache-offload-swap"
VERSION = 1
_SWAP_NAME = re.compile(r"rank(\d{5})\.swap")


def swap_names(directory: str, rank: int) -> tuple[str, str]:
    """(swap file, manifest) paths of ``rank`` in ``directory``."""
    base = os.path.join(directory, f"rank{rank:05d}")
    return base + ".swap", base + ".json"


class SwapFile:
    """An open, locked, sized swap file.

    Args:
        directory: where the files live (created owner-only; another user's is refused).
        rank: this process's rank (names the files).
        size: bytes the file holds.
        manifest: the layout, stored beside it as JSON.
        direct: use O_DIRECT where the filesystem allows it (the page cache would hold a
            second copy of the state the offload exists to keep out of memory).
        preallocate: reserve the blocks now (``posix_fallocate``), so a full device is found
            here and not in the middle of a step.

    Raises:
        ConfigError: a running process holds this rank's swap file in ``directory``.
        DiskFullError: ``preallocate`` and the device cannot hold ``size`` bytes.
        StorePermissionError: ``directory`` is not private to this user.
    """

    def __init__(self, directory: str | os.PathLike[str], rank: int, size: int,
                 manifest: dict[str, Any], *, direct: bool = True,
                 preallocate: bool = True) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        private_dir(self.directory, "offload directory")
        self.path, self.manifest_path = swap_names(self.directory, rank)
        self.size = size
        self.reused = os.path.lexists(self.path)
        self.direct = direct and logical_block_size(self.directory) <= 4096
        self.plain_fd = -1
        try:
            self.fd = self._open_locked()
        except OSError as exc:  # e.g. /proc, where no file can be created
            if isinstance(exc, LCacheError):
                raise
            raise StorePermissionError(f"cannot create the swap file {self.path} in the offload "
                                       f"directory: {exc.strerror}; choose a directory you "
                                       "can write") from exc
        try:
            # a buffered descriptor for the unaligned reads and writes of checkpoints
            self.plain_fd = open_file(self.path, os.O_RDWR) if self.direct else self.fd
            # the manifest first: it is what marks the file as ours to another rank's start
            # (_reclaim), and preallocating a large file takes a while to be killed in
            body = {"format": FORMAT, "version": VERSION, "pid": os.getpid(), "rank": rank,
                    "host": socket.gethostname(), "bytes": size, **manifest}
            atomic_write(self.manifest_path, json.dumps(body).encode(), io_class=IO_WRITE,
                         durable=False)
            self._size_file(preallocate)
        except BaseException:
            self.close()
            raise
        if self.reused:
            log.info("reusing the swap file of a run that ended without close(): %s", self.path)

    def _open_locked(self) -> int:
        # Starts in one directory take turns: a reclaiming start must never lock another
        # rank's file between that rank's open (which creates it) and its flock.
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(dir_fd, fcntl.LOCK_EX)
            except OSError:  # a filesystem without flock on directories: reclaim nothing
                return self._open_own()
            fd = self._open_own()
            try:
                self._reclaim()
            except OSError as exc:  # leftovers stay; this rank's file is good
                log.warning("could not remove other ranks' swap files in %s: %s",
                            self.directory, exc)
            return fd
        finally:
            close_file(dir_fd)  # releases the directory's lock

    def _open_own(self) -> int:
        flags = os.O_RDWR | os.O_CREAT
        for _ in range(10):
            if self.direct:
                try:
                    fd = open_file(self.path, flags, direct=True)
                except ConfigError:  # tmpfs and some network filesystems refuse O_DIRECT
                    self.direct = False
                    fd = open_file(self.path, flags)
            else:
                fd = open_file(self.path, flags)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                close_file(fd)
                raise ConfigError(f"{self.path} is in use by a running process; give each "
                                  "run (and each rank's process) its own offload directory, "
                                  "or stop the other run") from None
            try:
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    self._remove_temps()
                    return fd
            except FileNotFoundError:
                pass
            close_file(fd)  # its owner closed and removed it between our open and lock: again
        raise ConfigError(f"cannot hold {self.path}: something keeps removing it")

    def _remove_temps(self, manifest_path: str | None = None) -> None:
        """Manifest temp files a killed run of a rank left (we hold the rank's lock)."""
        for tmp in glob.glob(glob.escape(manifest_path or self.manifest_path) + ".tmp*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _reclaim(self) -> None:
        """Remove the swap files of other ranks that no live process holds (a killed run's,
        e.g. of more ranks than this one); called under the directory's lock."""
        for name in sorted(os.listdir(self.directory)):
            match = _SWAP_NAME.fullmatch(name)
            path = os.path.join(self.directory, name)
            if match is None or path == self.path:
                continue
            try:  # never a symbolic link; a FIFO must not block the open
                fd = open_file(path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError:  # gone, or a link
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                manifest_path = swap_names(self.directory, int(match.group(1)))[1]
                # only a regular file still under its name, whose manifest says it is ours
                # and of that rank: never another program's file that happens to match
                st = os.fstat(fd)
                if not (stat.S_ISREG(st.st_mode) and os.path.samestat(st, os.lstat(path))
                        and _is_manifest_of(manifest_path, int(match.group(1)))):
                    continue
                for gone in (manifest_path, path):  # as close() does, before the lock goes
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(gone)
                self._remove_temps(manifest_path)
                log.info("removed the swap file of a run that ended without close(): %s", path)
            except OSError:  # BlockingIOError: a live rank's; or gone meanwhile
                continue
            finally:
                close_file(fd)

    def _size_file(self, preallocate: bool) -> None:
        os.ftruncate(self.fd, 0)  # a reused file's old bytes are meaningless
        os.ftruncate(self.fd, self.size)
        if not preallocate or not hasattr(os, "posix_fallocate"):
            return
        try:
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                free = os.statvfs(self.directory)
                raise DiskFullError(
                    f"the offload swap file needs {self.size:,} bytes in {self.directory}, "
                    f"which has {free.f_bavail * free.f_frsize:,} free; free space, pick "
                    "another dir, or lower the state (fewer parameters per rank)") from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise

    # --- I/O -----------------------------------------------------------------------------
    def read(self, offset: int, buf: memoryview) -> list[Any]:
        """Start reading ``len(buf)`` bytes at ``offset`` (both aligned) into ``buf``; each
        handle's ``wait()`` raises ``CorruptionError`` if fewer came (the file was cut short:
        the buffer would keep another sub-group's bytes)."""
        engine = default_engine()
        return [_WholeRead(engine.submit_read(self.fd, offset + at, buf[at : at + CHUNK],
                                              IO_READ), min(CHUNK, len(buf) - at),
                           offset + at, self.path)
                for at in range(0, len(buf), CHUNK)]

    def write(self, offset: int, buf: memoryview) -> list[Pending]:
        """Start writing ``buf`` at ``offset`` (both aligned)."""
        engine = default_engine()
        return [engine.submit_write(self.fd, offset + at, buf[at : at + CHUNK], IO_WRITE)
                for at in range(0, len(buf), CHUNK)]

    def close(self) -> None:
        """Remove the files and release the lock (idempotent)."""
        if self.fd < 0:
            return
        for path in (self.manifest_path, self.path):  # unlinked before the lock goes
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if self.plain_fd not in (self.fd, -1):
            close_file(self.plain_fd)
        close_file(self.fd)
        self.fd = self.plain_fd = -1


def _is_manifest_of(path: str, rank: int) -> bool:
    """Whether ``path`` is the manifest :class:`SwapFile` on this host writes for ``rank``."""
    try:
        fd = open_file(path, os.O_RDONLY | os.O_NONBLOCK)  # never a link; a FIFO: no wait
        try:
            doc = json.loads(os.read(fd, 1 << 20))
        finally:
            close_file(fd)
    except (OSError, ValueError):  # missing, not a file, not JSON
        return False
    # of this host: on a directory shared between nodes, flock may be each node's own
    # (Lustre's localflock, NFS's local_lock), and another node's live rank would look dead
    return (isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("rank") == rank
            and doc.get("host") == socket.gethostname())


class _WholeRead:
    """A read of the swap file that must come back whole."""

    __slots__ = ("offset", "path", "pending", "size")

    def __init__(self, pending: Pending, size: int, offset: int, path: str) -> None:
        self.pending, self.size, self.offset, self.path = pending, size, offset, path

    def done(self) -> bool:
        return self.pending.done()

    def wait(self, timeout: float | None = None) -> int:
        got = self.pending.wait(timeout)
        if got != self.size:
            raise CorruptionError(f"{self.path}: {got} of {self.size} bytes at offset "
                                  f"{self.offset}: the swap file was cut short while in use")
        return got


def wait_all(pending: list[Any]) -> None:
    """Wait for every handle; raise the first error after all are done (a buffer must not be
    reused while an operation on it is still running)."""
    first: BaseException | None = None
    for p in pending:
        try:
            p.wait()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first
