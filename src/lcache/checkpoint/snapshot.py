"""Phase one of a save: copy the state's arrays into a reusable, page-aligned host buffer.

This copy is the only part of a save the training loop waits for (CheckFreq's snapshot). The
buffer is laid out exactly as the data file, so the persist phase writes it with large aligned
writes and no further copy. It is kept between saves: fresh pages cost a fault each on first
touch, more than the copy itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lcache.checkpoint.format import (
    ArrayRef,
    StreamedArray,
    encode_tree,
    layout,
    streamed_last,
    torch_dtype,
)
from lcache.io import align_up, aligned_buffer
from lcache.io.buffers import HUGE

_memmove = ctypes.memmove  # releases the GIL; runs at memory bandwidth


class HostBuffer:
    """A page-aligned host buffer that grows on demand and is reused between saves.

    When the state holds CUDA tensors the buffer is pinned memory (so device-to-host copies
    run asynchronously at full speed); otherwise an anonymous mmap with transparent huge pages
    asked for (512 times fewer page faults on first touch).
    """

    def __init__(self) -> None:
        self._owner: Any = None
        self.view: memoryview = memoryview(bytearray(0))
        self.pinned = False

    def ensure(self, nbytes: int, pinned: bool) -> memoryview:
        """A view of at least ``nbytes`` (contents undefined); reallocates only to grow."""
        if len(self.view) >= nbytes and self.pinned == pinned:
            return self.view
        self.release()
        size = align_up(max(nbytes, 1), HUGE)
        if pinned:
            import torch

            tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._owner = tensor
            self.view = memoryview(tensor.numpy().data).cast("B")
        else:
            buf = aligned_buffer(size)
            self._owner = buf
            self.view = memoryview(buf)
        self.pinned = pinned
        return self.view

    def release(self) -> None:
        self.view.release()
        self.view = memoryview(bytearray(0))
        if isinstance(self._owner, mmap.mmap):
            with contextlib.suppress(BufferError):  # a view still refers to it: GC frees it
                self._owner.close()
        self._owner = None


@dataclass(slots=True)
class Snapshot:
    """A state copied to host memory: its tree, its arrays' layout and the bytes.

    Attributes:
        tree: the JSON form of the state (``format.encode_tree``).
        arrays: one ``ArrayRef`` per array, offsets set, checksums filled in by the persist.
        nbytes: the data file's padded size (a multiple of ``format.ALIGN``).
        data: the host buffer's bytes: the data file up to the first streamed array.
        cuda_event: recorded after the device-to-host copies; the persist waits for it.
        streamed: the arrays copied from their files by the persist (the table's last ones;
            their ``source`` is a ``StreamedArray``), not held in the host buffer.
    """

    tree: Any
    arrays: list[ArrayRef]
    nbytes: int
    data: memoryview
    cuda_event: Any = None
    array_bytes: int = field(default=0)
    streamed: list[ArrayRef] = field(default_factory=list)

    def release(self) -> None:
        """Let the streamed arrays' owners go on (once the persist is done with them)."""
        release_streamed(self.streamed)


def release_streamed(arrays: list[ArrayRef]) -> None:
    for ref in arrays:
        if isinstance(ref.source, StreamedArray):
            ref.source.release()


def _plain_address(src: Any, kind: str) -> int:
    """The address of ``src``'s bytes when they are one contiguous host block, else 0."""
    if kind == "torch":
        if (src.device.type != "cpu" or not src.is_contiguous() or src.is_conj()
                or src.is_neg() or type(src).__name__ not in ("Tensor", "Parameter")):
            return 0
        return int(src.data_ptr())
    if src.flags.c_contiguous:
        return int(src.ctypes.data)
    return 0


def take_snapshot(state: Any, buffer: HostBuffer) -> Snapshot:
    """Copy ``state``'s arrays into ``buffer`` and return the snapshot (caller holds the lock).

    Raises:
        UnsupportedValueError: the state holds a value that cannot be saved (names its key).
    """
    arrays: list[ArrayRef] = []
    try:
        tree, arrays = streamed_last(encode_tree(state, arrays), arrays)
    except BaseException:
        release_streamed(arrays)  # an offloaded optimizer must not wait for this save
        raise
    nbytes = layout(arrays)
    streamed = [ref for ref in arrays if isinstance(ref.source, StreamedArray)]
    held = arrays[: len(arrays) - len(streamed)]
    in_memory = streamed[0].offset if streamed else nbytes
    try:
        data, event = _copy_arrays(held, in_memory, buffer)
    except BaseException:
        release_streamed(streamed)
        raise
    return Snapshot(tree, arrays, nbytes, data, event, sum(r.nbytes for r in arrays), streamed)


def _copy_arrays(held: list[ArrayRef], in_memory: int, buffer: HostBuffer
                 ) -> tuple[memoryview, Any]:
    """Copy the ``held`` arrays into the first ``in_memory`` bytes of ``buffer``; returns
    those bytes and the CUDA event recorded after the copies (None without CUDA)."""
    on_cuda = any(ref.kind == "torch" and ref.source.device.type == "cuda" for ref in held)
    data = buffer.ensure(in_memory, pinned=on_cuda)[:in_memory]
    event = None
    base = np.frombuffer(data, dtype=np.uint8).ctypes.data if in_memory else 0
    for ref in held:
        src = ref.source
        ref.source = None  # the snapshot must not keep the live state alive
        if ref.nbytes == 0:
            continue
        address = _plain_address(src, ref.kind)
        if address:
            # One memmove per contiguous array: torch's copy_ opens a parallel region per
            # tensor, which costs more than the copy for the many small tensors of an
            # optimizer state (and far more when other processes hold the cores).
            _memmove(base + ref.offset, address, ref.nbytes)
            continue
        raw = np.frombuffer(data, dtype=np.uint8, count=ref.nbytes, offset=ref.offset)
        if ref.kind == "torch":
            import torch

            dst = torch.from_numpy(raw).view(torch_dtype(ref.dtype, ref.key)).reshape(ref.shape)
            with torch.no_grad():
                # non_blocking from CUDA into pinned memory: the copies queue on the current
                # stream, so later in-place updates of the training loop run after them
                dst.copy_(src.detach(), non_blocking=src.device.type == "cuda")
        else:
            np.copyto(raw.view(np.dtype(ref.dtype)).reshape(ref.shape), src, casting="no")
    if on_cuda:
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
    return data, event
