"""Activation offload: tensors saved for backward spill to a local SSD and come back for it.

    from lcache.offload.activations import activations

    with activations("/nvme/act", min_bytes="1MiB") as act:
        loss = model(batch).sum()
        loss.backward()          # inside the block: the spill file goes when it exits
    print(act.stats)

Autograd hands every tensor it saves for backward to ``saved_tensors_hooks``. One whose
storage holds at least ``min_bytes`` is written, without waiting, through the process's I/O
engine to one spill file; backward reads it back, ``read_ahead`` spills ahead in the reverse
order of saving. The unit of a spill is a storage: a tensor and its views (a transpose, the
q/k/v chunks of one projection) are one write, and come back as the same views of one buffer,
with the same strides and alignment, so backward computes bit-identical gradients. A tensor
that is a small part of a big storage (a batch sliced from a dataset in memory) spills only
its own bytes.

Not spilled, because it frees nothing or cannot be restored from raw bytes: parameters
(trainable or frozen) and views of them, leaves that require grad, tensor subclasses, and
tensors that are not plain strided memory (sparse, nested, quantized, conjugate or negative
views). Tensors off the CPU stay where they are too, for now.

The spill file is unlinked as soon as it is created: the open descriptor keeps it, so nothing
is left in the directory, even after ``kill -9``; its space goes back when the block exits.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import errno
import itertools
import os
import secrets
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lcache.checks import path_argument, whole_number
from lcache.errors import (
    ConfigError,
    CorruptionError,
    DiskFullError,
    LCacheError,
    StorePermissionError,
)
from lcache.io import Pending, close_file, default_engine, open_file, private_dir
from lcache.store.layout import parse_size

__all__ = ["ActivationOffload", "ActivationOffloadError", "ActivationStats", "activations"]

WRITE_CLASS = "offload-act-write"
READ_CLASS = "offload-act-read"

_EXTENT = 4096  # spill offsets are page aligned: no partial page shared by two spills
# A part of a storage spilled starts at this alignment, which its copy read back keeps (the
# storage's own): kernels may take other paths, and round differently, on other alignments.
_ALIGN = 64
_SCAN = 64  # positions looked at below the one backward unpacks, to find what to read ahead


class ActivationOffloadError(LCacheError, RuntimeError):
    """A saved tensor cannot be given back: the block has exited, or the tensor was changed in
    place (autograd's own check, which its saved-tensor hooks skip)."""


@dataclass(slots=True)
class ActivationStats:
    """Counters of an :class:`ActivationOffload`, summed over every ``with`` block.

    Attributes:
        tensors_spilled: storages written to the spill file.
        tensors_deduplicated: saved tensors that reused the spill of their storage.
        tensors_kept: saved tensors left in memory (under ``min_bytes``, parameters...).
        bytes_spilled: bytes written.
        bytes_read: bytes read back (a spill still being written when backward needs it
            is handed back from memory, unread).
        reads_on_demand: spills backward had to read when it needed them, as none was read
            ahead (a few per backward pass at most when its order follows the forward's).
        held_bytes: spilled bytes in memory now: still being written, or read back and not
            yet handed to backward.
        peak_held_bytes: the most ``held_bytes`` were; with the kept tensors, what saved
            tensors cost in memory (without offload, the total of every one of them).
        peak_file_bytes: the largest the spill file grew (freed space is reused).
    """

    tensors_spilled: int = 0
    tensors_deduplicated: int = 0
    tensors_kept: int = 0
    bytes_spilled: int = 0
    bytes_read: int = 0
    reads_on_demand: int = 0
    held_bytes: int = 0
    peak_held_bytes: int = 0
    peak_file_bytes: int = 0

    def hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)


def activations(dir: str | os.PathLike[str], min_bytes: int | str = "1MiB", *,
                read_ahead: int = 2, write_behind: int = 4) -> ActivationOffload:
    """Spill tensors saved for backward to ``dir`` while the returned context is active.

    Args:
        dir: directory of the spill file, created owner-only if missing.
        min_bytes: spill a saved tensor whose storage holds at least this many bytes (an int
            or a size such as ``"1MiB"``); smaller ones stay in memory.
        read_ahead: spills read ahead of backward (0: each is read when backward needs it).
        write_behind: spills being written at once before the forward pass waits.

    Raises:
        ConfigError: a bad ``dir``, ``min_bytes``, ``read_ahead`` or ``write_behind``.
    """
    return ActivationOffload(dir, min_bytes, read_ahead, write_behind)


class ActivationOffload:
    """The context :func:`activations` returns; ``stats`` counts what it moved."""

    def __init__(self, dir: str | os.PathLike[str], min_bytes: int | str, read_ahead: int,
                 write_behind: int) -> None:
        try:
            self.min_bytes = parse_size(min_bytes)
        except ConfigError as exc:
            raise ConfigError(f"min_bytes={min_bytes!r}: {exc}") from None
        self.read_ahead = whole_number(read_ahead, "read_ahead", 0)
        self.write_behind = whole_number(write_behind, "write_behind", 1)
        self.dir = path_argument(dir, "dir")
        self.stats = ActivationStats()
        self._session: _Session | None = None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> ActivationOffload:
        if self._session is not None:
            raise ActivationOffloadError("this activations() context is already active; "
                                         "create another one to nest")
        where = private_dir(self.dir, "activation spill directory")
        self._session = _Session(where, self)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
        session, self._session = self._session, None
        if session is not None:
            error = session.close()
            if error is not None and exc is None:
                raise error

    def _pack(self, t: torch.Tensor) -> Any:
        session = self._session
        if session is None or not self._spillable(t):
            # detach(): the same storage and version counter, without a grad_fn that would
            # make a cycle through the node that saved it.
            self.stats.tensors_kept += 1
            return _Kept(t.detach(), t._version)
        return session.pack(t)

    def _spillable(self, t: torch.Tensor) -> bool:
        base = t if t._base is None else t._base
        return (type(t) is torch.Tensor and t.device.type == "cpu"
                and t.layout == torch.strided and not t.is_nested and not t.is_quantized
                and not t.is_conj() and not t.is_neg() and t.numel() > 0
                and not isinstance(base, torch.nn.Parameter)
                and not (base.is_leaf and base.requires_grad)
                and t.untyped_storage().nbytes() >= self.min_bytes)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.unpack()  # type: ignore[no-any-return]


class _Kept:
    """A saved tensor left in memory, with the version autograd would have checked."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version

    def unpack(self) -> torch.Tensor:
        _check_version(self.tensor, self.version)
        return self.tensor


def _check_version(tensor: torch.Tensor, version: int) -> None:
    if tensor._version != version:
        raise ActivationOffloadError(
            f"a tensor saved for backward was modified in place (version {version} -> "
            f"{tensor._version}); clone it before changing it, as autograd requires")


class _Spill:
    """One storage written to the spill file, shared by every saved tensor that views it."""

    __slots__ = ("ahead", "dead", "error", "handles", "io", "key", "lo", "mem", "nbytes",
                 "offset", "source", "version", "waiting", "writing")

    def __init__(self, key: StorageWeakRef, version: int, lo: int, hi: int,
                 offset: int) -> None:
        self.key = key
        self.version = version
        self.lo = lo  # it holds bytes lo:hi of the storage
        self.nbytes = hi - lo
        self.offset = offset  # in the spill file
        self.mem: torch.Tensor | None = None  # bytes lo:hi in memory (uint8), if they are
        self.source: torch.Tensor | None = None  # the saved tensor, while its bytes are mem
        self.io: Pending | None = None
        self.writing = False  # io is a write
        self.error: BaseException | None = None
        self.handles = 0  # saved tensors alive that view it
        self.waiting = 0  # ... and that backward has not unpacked yet
        self.ahead = False  # read ahead and not yet unpacked
        self.dead = False


class _Saved:
    """What autograd keeps for a spilled tensor: where it lies in its storage."""

    __slots__ = ("dtype", "offset", "pos", "session", "shape", "spill", "stride", "unpacked")

    def __init__(self, session: _Session, spill: _Spill, pos: int, t: torch.Tensor) -> None:
        self.session = session
        self.spill = spill
        self.pos = pos
        self.dtype = t.dtype
        self.offset = t.storage_offset()
        self.shape = t.shape
        self.stride = t.stride()
        self.unpacked = False

    def unpack(self) -> torch.Tensor:
        return self.session.unpack(self)

    def __del__(self) -> None:
        # Autograd frees saved tensors from whatever thread runs backward; a deque append is
        # atomic, and the session settles it under its lock at its next call.
        self.session.released.append((self.spill, self.pos, self.unpacked))


class _Space:
    """Extents of the spill file: freed ones are reused (first fit) before the file grows, so
    a long run's file stays about as large as the most it held at once."""

    def __init__(self) -> None:
        self.end = 0
        self._free: list[tuple[int, int]] = []  # (offset, length), sorted and coalesced

    def take(self, nbytes: int) -> int:
        size = -(-nbytes // _EXTENT) * _EXTENT
        for i, (offset, length) in enumerate(self._free):
            if length >= size:
                self._free[i:i + 1] = [(offset + size, length - size)] if length > size else []
                return offset
        offset, self.end = self.end, self.end + size
        return offset

    def give(self, offset: int, nbytes: int) -> None:
        size = -(-nbytes // _EXTENT) * _EXTENT
        i = bisect.bisect(self._free, (offset, size))
        if i < len(self._free) and offset + size == self._free[i][0]:
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            i -= 1
            offset, size = self._free[i][0], self._free.pop(i)[1] + size
        if offset + size == self.end:
            self.end = offset
        else:
            self._free.insert(i, (offset, size))


class _Session:
    """One ``with`` block: the spill file, its spills and the I/O in flight on them."""

    def __init__(self, where: str, owner: ActivationOffload) -> None:
        self.fd = _create_spill_file(where)
        self.where = where
        self.owner = owner
        self.stats = owner.stats
        self.engine = default_engine()
        self.space = _Space()
        self.lock = threading.Lock()
        self.closed = False
        self.by_storage: dict[StorageWeakRef, list[_Spill]] = {}
        self.order: dict[int, _Spill] = {}  # saved tensor's position -> its spill, until unpacked
        self.positions = itertools.count()
        self.inflight: collections.deque[_Spill] = collections.deque()
        self.writes = 0
        self.ahead = 0
        self.released: collections.deque[tuple[_Spill, int, bool]] = collections.deque()

    def pack(self, t: torch.Tensor) -> _Saved:
        with self.lock:
            self._settle()
            storage = t.untyped_storage()
            key = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
            start, end = _span(t)
            # A spill holds what the storage held then if the version has not changed since
            # (a tensor and its views share the counter) and it holds the bytes asked for (a
            # storage may have grown: UntypedStorage.resize_ keeps the version).
            spill = next((s for s in self.by_storage.get(key, ()) if s.error is None
                          and s.version == t._version
                          and s.lo <= start and end <= s.lo + s.nbytes), None)
            if spill is not None:
                self.stats.tensors_deduplicated += 1
            else:
                spill = self._write(t, storage, key, start, end)
            spill.handles += 1
            spill.waiting += 1
            pos = next(self.positions)
            self.order[pos] = spill
            return _Saved(self, spill, pos, t)

    def unpack(self, saved: _Saved) -> torch.Tensor:
        with self.lock:
            if self.closed:
                raise ActivationOffloadError(
                    "a spilled activation was freed when its `with activations(...)` block "
                    "exited; call backward() inside the block")
            self._settle()
            spill = saved.spill
            if not saved.unpacked:
                saved.unpacked = True
                del self.order[saved.pos]
                spill.waiting -= 1
            self._read_ahead(saved.pos)
            mem = self._load(spill)
            # mem holds the storage's bytes from lo, at its own offset: the original's in the
            # storage itself while it is being written, 0 in a buffer read back
            at = mem.storage_offset() - spill.lo + saved.offset * saved.dtype.itemsize
            out = torch.empty(0, dtype=saved.dtype).set_(
                mem.untyped_storage(), at // saved.dtype.itemsize, saved.shape, saved.stride)
            if spill.ahead:
                spill.ahead = False
                self.ahead -= 1
            if spill.waiting == 0 and spill.io is None:
                self._drop(spill)  # backward holds ``out``; a second pass reads it again
            return out

    def close(self) -> BaseException | None:
        """Wait for the I/O in flight, free every buffer and close the spill file; the first
        error an operation met, if any."""
        with self.lock:
            self.closed = True
            error = None
            while self.inflight:
                try:
                    self._finish(self.inflight.popleft())
                except BaseException as exc:
                    error = error or exc
            for spill in self.order.values():
                self._drop(spill)
            self.order.clear()
            self.by_storage.clear()
            close_file(self.fd)
            return error

    def _write(self, t: torch.Tensor, storage: torch.UntypedStorage, key: StorageWeakRef,
               start: int, end: int) -> _Spill:
        while self.writes >= self.owner.write_behind:  # before anything changes: it may raise
            self._finish(self.inflight.popleft())
        size = storage.nbytes()
        # The whole storage, so that the other views of it (q, k and v of one projection)
        # share the spill; only the tensor's bytes when it is a small part of a storage that
        # lives on anyway (a batch sliced from a dataset held in memory).
        lo, hi = (0, size) if 2 * (end - start) >= size else (start - start % _ALIGN, end)
        spill = _Spill(key, t._version, lo, hi, self.space.take(hi - lo))
        self.stats.peak_file_bytes = max(self.stats.peak_file_bytes, self.space.end)
        spill.mem = torch.empty(0, dtype=torch.uint8).set_(storage, lo, (hi - lo,), (1,))
        spill.source = t.detach()  # its version is checked once the write is done
        self.stats.hold(spill.nbytes)
        self._submit(spill, write=True)
        self.by_storage.setdefault(key, []).append(spill)
        self.stats.tensors_spilled += 1
        self.stats.bytes_spilled += spill.nbytes
        return spill

    def _submit(self, spill: _Spill, write: bool) -> None:
        buf = _bytes_of(spill.mem)  # type: ignore[arg-type]
        if write:
            spill.io = self.engine.submit_write(self.fd, spill.offset, buf, WRITE_CLASS)
            spill.writing = True
            self.writes += 1
        else:
            spill.io = self.engine.submit_read(self.fd, spill.offset, buf, READ_CLASS)
        self.inflight.append(spill)

    def _finish(self, spill: _Spill) -> None:
        """Wait for the operation in flight on ``spill`` (already out of ``inflight``)."""
        pending, spill.io = spill.io, None
        assert pending is not None
        writing, spill.writing = spill.writing, False
        if writing:
            self.writes -= 1
        try:
            done = pending.wait()
            if not writing and done != spill.nbytes:
                raise CorruptionError(f"the activation spill file ended {spill.nbytes - done} "
                                      f"bytes early at offset {spill.offset}")
        except DiskFullError as exc:
            spill.error = DiskFullError(
                f"no space left in {self.where} to spill {spill.nbytes} bytes of activations; "
                "free some, raise min_bytes or choose another directory")
            self._free(spill)
            raise spill.error from exc
        except BaseException as exc:
            spill.error = exc
            self._free(spill)
            raise
        if not writing:
            self.stats.bytes_read += done
        elif spill.source is not None and spill.source._version != spill.version:
            spill.error = ActivationOffloadError(
                f"a tensor saved for backward was modified in place (version {spill.version} "
                f"-> {spill.source._version}) while it was being spilled; clone it before "
                "changing it, as autograd requires")
            self._drop(spill)
        elif not 0 < spill.waiting < spill.handles:
            # else backward already holds views of the tensor itself, and the others share
            # it rather than a second copy read back
            self._drop(spill)
        if spill.dead:
            self._free(spill)

    def _free(self, spill: _Spill) -> None:
        """Drop its bytes in memory, and its extent of the file once nothing views it."""
        self._drop(spill)
        if spill.dead:
            self.space.give(spill.offset, spill.nbytes)

    def _settle(self) -> None:
        """Account for saved tensors autograd freed and for I/O that finished."""
        while self.released:
            spill, pos, unpacked = self.released.popleft()
            if not unpacked:
                del self.order[pos]
                spill.waiting -= 1
            spill.handles -= 1
            if spill.handles == 0:
                spill.dead = True
                same = self.by_storage.get(spill.key, [])
                if spill in same:
                    same.remove(spill)
                    if not same:
                        del self.by_storage[spill.key]
                if spill.io is None:
                    self._free(spill)
            elif spill.waiting == 0 and spill.io is None:
                self._drop(spill)
        while self.inflight and self.inflight[0].io.done():  # type: ignore[union-attr]
            self._finish(self.inflight.popleft())

    def _read_ahead(self, pos: int) -> None:
        """Start reading the spills of the tensors saved just before ``pos``: backward
        unpacks in about the reverse order of saving."""
        for j in range(pos - 1, max(pos - 1 - _SCAN, -1), -1):
            if self.ahead >= self.owner.read_ahead:
                return
            spill = self.order.get(j)
            if spill is None or spill.mem is not None or spill.io is not None or spill.error:
                continue
            self._start_read(spill)
            spill.ahead = True
            self.ahead += 1

    def _start_read(self, spill: _Spill) -> None:
        spill.mem = torch.empty(spill.nbytes, dtype=torch.uint8)
        self.stats.hold(spill.nbytes)
        self._submit(spill, write=False)

    def _load(self, spill: _Spill) -> torch.Tensor:
        """The bytes of ``spill`` in memory, waiting for or starting their read."""
        if spill.error is not None:
            raise spill.error
        if spill.source is not None:  # its bytes in memory are the saved tensor's own
            _check_version(spill.source, spill.version)
        elif spill.mem is None:
            self.stats.reads_on_demand += 1
            self._start_read(spill)
        if spill.io is not None and not spill.writing:
            self.inflight.remove(spill)
            self._finish(spill)
        return spill.mem  # type: ignore[return-value]

    def _drop(self, spill: _Spill) -> None:
        spill.source = None
        if spill.mem is not None:
            self.stats.held_bytes -= spill.nbytes
            spill.mem = None
        if spill.ahead:
            spill.ahead = False
            self.ahead -= 1


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage ``t`` reaches, first and past the last (strides are >= 0)."""
    size = t.element_size()
    start = int(t.storage_offset()) * size
    reach = sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + size * (1 + reach)


def _bytes_of(mem: torch.Tensor) -> memoryview:
    """The bytes of a uint8 tensor for the engine. Not through numpy: a storage numpy has seen
    can never be resized again, and the storage written is the caller's."""
    return memoryview((ctypes.c_ubyte * mem.numel()).from_address(mem.data_ptr())).cast("B")


def _create_spill_file(where: str) -> int:
    path = os.path.join(where, f"lcache-act-{os.getpid()}-{secrets.token_hex(6)}.spill")
    try:
        fd = open_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"no space left in {where} for an activation spill file; "
                                "free some or choose another directory") from exc
        raise StorePermissionError(f"cannot create an activation spill file in {where}: "
                                   f"{exc.strerror}; choose a directory you can write") from exc
    os.unlink(path)  # the descriptor keeps the file: nothing is left behind, even on kill -9
    return fd
