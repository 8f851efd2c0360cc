"""Phase two of a save, and the reads of a load: large aligned I/O through ``lcache.io``.

Data files are written from the snapshot's host buffer in ``CHUNK``-sized writes with
``queue_depth`` of them in flight on the process's I/O engine (``lcache.io.default_engine``),
with O_DIRECT where the filesystem allows it, so a checkpoint neither waits on the page cache
nor evicts the training job's useful pages. Every operation carries ``io_class="checkpoint"``
for the tracer.
"""

from __future__ import annotations

import errno
import os
import queue
import stat
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from lcache.checkpoint.format import ALIGN, ArrayRef
from lcache.errors import CorruptionError
from lcache.io import (
    Completions,
    Pending,
    ReadRequest,
    aligned_buffer,
    close_file,
    default_engine,
    open_direct,
    open_file,
    pread_full,
    settle,
    sync_fd,
)

IO_CLASS = "checkpoint"
CHUNK = 8 << 20  # large enough to stream at device speed, small enough to keep several busy


def _open(path: str, flags: int, direct: bool) -> tuple[int, bool]:
    """Open with O_DIRECT when asked and the filesystem allows it; returns (fd, direct)."""
    if direct and os.statvfs(os.path.dirname(path) or ".").f_bsize <= ALIGN:
        return open_direct(path, flags)
    return open_file(path, flags), False


def open_member(path: str, what: str, direct: bool = False) -> tuple[int, bool, int]:
    """Open a file of a checkpoint for reading; returns (fd, direct, size).

    A symbolic link is refused, not followed (``open_file`` adds O_NOFOLLOW), and so is
    anything but a regular file, opened with O_NONBLOCK so that a FIFO cannot hang the load:
    a crafted checkpoint cannot make a load read outside its directory.

    Raises:
        CorruptionError: the file is missing, a symbolic link, or not a regular file.
    """
    try:
        fd, used_direct = _open(path, os.O_RDONLY | os.O_NONBLOCK, direct)
    except FileNotFoundError as exc:
        raise CorruptionError(f"{what} {path} is missing; the checkpoint is damaged") from exc
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise CorruptionError(f"{what} {path} is a symbolic link; a checkpoint's files never "
                              "are, so it is refused, not followed") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        close_file(fd)
        raise CorruptionError(f"{what} {path} is not a regular file; the checkpoint is damaged")
    return fd, used_direct, st.st_size


def open_data_file(path: str, nbytes: int, direct: bool) -> tuple[int, bool]:
    """``open_member`` for a data file that must hold at least ``nbytes``: (fd, direct)."""
    fd, used_direct, size = open_member(path, "data file", direct)
    if size < nbytes:
        close_file(fd)
        raise CorruptionError(f"data file {path} is {size} bytes, the manifest says {nbytes}: "
                              "it was truncated")
    return fd, used_direct


class _Checksums:
    """The arrays' xxh3, computed chunk by chunk in the writing thread while the chunks
    submitted before it are written (xxh3 is several times faster than the device)."""

    def __init__(self, data: memoryview, arrays: list[ArrayRef]) -> None:
        self.data = data
        self.todo = sorted(arrays, key=lambda r: r.offset)
        self.done = 0  # arrays finished
        self.pos = 0  # bytes hashed
        self.hash = xxhash.xxh3_64()

    def upto(self, end: int) -> None:
        """Hash every byte of the arrays below ``end``; finish the arrays that end there."""
        while self.done < len(self.todo):
            ref = self.todo[self.done]
            stop = ref.offset + ref.nbytes
            lo, hi = max(ref.offset, self.pos), min(stop, end)
            if hi > lo:
                self.hash.update(self.data[lo:hi])
                self.pos = hi
            if hi < stop:
                return
            ref.xxh3 = self.hash.hexdigest()
            self.hash.reset()
            self.done += 1


def _write_all(fd: int, data: memoryview, queue_depth: int, sums: _Checksums) -> None:
    # Size the file first: ext4 serializes O_DIRECT writes that extend a file, and writes
    # inside its size run side by side (about +20% for 1 GiB here).
    os.ftruncate(fd, len(data))
    engine = default_engine()
    done: Completions = queue.SimpleQueue()
    in_flight: set[Pending] = set()
    try:
        for off in range(0, len(data), CHUNK):
            if len(in_flight) >= queue_depth:  # reap whichever finished first, not the oldest
                finished = done.get()
                in_flight.discard(finished)
                finished.wait()
            in_flight.add(engine.submit_write(fd, off, data[off : off + CHUNK], IO_CLASS,
                                              notify=done))
            sums.upto(off + CHUNK)
        sums.upto(len(data))
        for p in list(in_flight):
            p.wait()
            in_flight.discard(p)
    finally:
        settle(in_flight)  # after an error: no write outlives fd, which the caller closes


def write_data_file(path: str, data: memoryview, arrays: list[ArrayRef], *,
                    direct: bool = True, queue_depth: int = 8) -> bool:
    """Write ``data`` (length a multiple of ``ALIGN``) to a new file at ``path``, fill in the
    arrays' checksums, and fsync. Returns whether O_DIRECT was used.

    Raises:
        DiskFullError: the device filled up; the caller removes the partial file.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd, used_direct = _open(path, flags, direct)
    sums = _Checksums(data, arrays)
    try:
        try:
            _write_all(fd, data, queue_depth, sums)
        except OSError as exc:
            if not used_direct or exc.errno != errno.EINVAL:
                raise
            # the filesystem took O_DIRECT at open but refuses the I/O: go buffered
            close_file(fd)
            fd, used_direct = _open(path, flags, False)
            _write_all(fd, data, queue_depth, sums)
        sync_fd(fd, data_only=False, io_class=IO_CLASS)
    finally:
        close_file(fd)
    return used_direct


def read_small_file(path: str, limit: int) -> bytearray:
    """A whole manifest through ``lcache.io`` (see ``open_member``), refused before any
    byte is read if it is over ``limit`` bytes (a sparse file costs nothing to make).

    Raises:
        CorruptionError: as ``open_member``, or the file is over ``limit``.
    """
    fd, _, size = open_member(path, "manifest")
    try:
        if size > limit:
            raise CorruptionError(f"{path} is {size} bytes, more than a manifest can be "
                                  f"({limit >> 20} MiB); the checkpoint is damaged")
        buf = bytearray(size)
        with memoryview(buf) as view:
            got = pread_full(fd, 0, view, IO_CLASS)
        del buf[got:]  # shorter only if it shrank meanwhile; no copy
        return buf
    finally:
        close_file(fd)


def read_data_file(path: str, nbytes: int, *, direct: bool = True, queue_depth: int = 8,
                   on_chunk: Callable[[np.ndarray[Any, Any], int], None] | None = None
                   ) -> tuple[np.ndarray[Any, Any], int]:
    """Read the first ``nbytes`` of ``path`` into a new page-aligned array.

    Returns (array of ``align_up(nbytes)`` bytes, bytes actually read: short only if the file
    shrank while it was read).
    Each load gets its own buffer: the loaded arrays are views of it, with no further copy.
    ``on_chunk(array, k)`` runs in an I/O thread once chunk ``k`` (``CHUNK`` bytes at
    ``k * CHUNK``) is in, so checksums overlap the reads still in flight.

    Raises:
        CorruptionError: the file is missing, not a regular file, or shorter than ``nbytes``.
    """
    padded = -(-nbytes // ALIGN) * ALIGN
    engine = default_engine()
    fd, used_direct = open_data_file(path, nbytes, direct)
    try:
        buf = aligned_buffer(max(padded, ALIGN), huge=False)  # one-shot: see aligned_buffer
        array = np.frombuffer(buf, dtype=np.uint8, count=padded)
        view = memoryview(buf)[:padded]
        requests = [ReadRequest(fd, off, view[off : off + CHUNK])
                    for off in range(0, padded, CHUNK)]
        done = None if on_chunk is None else (lambda k, _n: on_chunk(array, k))
        try:
            got = engine.read_batch(requests, IO_CLASS, done, queue_depth)
        except OSError as exc:
            if not used_direct or exc.errno != errno.EINVAL:
                raise
            close_file(fd)
            fd, used_direct = open_data_file(path, nbytes, False)
            for req in requests:
                req.fd = fd
            got = engine.read_batch(requests, IO_CLASS, done, queue_depth)
    finally:
        close_file(fd)
    total = 0
    for req, n in zip(requests, got, strict=False):
        total += n
        if n < len(req.buf):
            break
    return array, min(total, nbytes)
