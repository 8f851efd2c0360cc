"""Page-aligned reusable buffers (O_DIRECT needs aligned memory, offsets and lengths)."""

from __future__ import annotations

import contextlib
import mmap
import threading

import numpy as np

from lcache.checks import whole_number

PAGE = mmap.PAGESIZE
HUGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)
#: The largest buffer asked for: past any memory, and within what mmap's length can say
#: once rounded up (10**30 was a bare OverflowError).
MAX_BUFFER = 1 << 62


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def align_down(n: int, alignment: int) -> int:
    return n // alignment * alignment


def aligned_buffer(nbytes: int, huge: bool = True) -> mmap.mmap:
    """A zero-filled, page-aligned, writable buffer of at least ``nbytes`` (anonymous mmap).

    With ``huge``, from ``HUGE`` (2 MiB) up it is a whole number of 2 MiB and backed by
    transparent huge pages where the kernel allows (``madvise``): an O_DIRECT transfer pins
    each page of its buffer, and on this project's VM 8 MiB reads by 16 threads moved 1.9-2.3
    GB/s into huge pages against 0.7-0.9 GB/s into 4 KiB pages. But the first touch of a huge
    page may wait for the kernel to compact memory: faulting in 1 GiB took 0.18-3.3 s in huge
    pages against 1.0 s in 4 KiB pages. So ask for ``huge`` for buffers kept and reused (a
    ``BufferPool``, a ring), not for one-shot ones. The mapping is private: a shared anonymous
    one is shmem, which gets no huge pages (``shmem_enabled`` is usually "never").

    Fresh pages cost a fault each on first touch (about 3 us per 4 KiB page on this class of
    VM, more than copying them), so keep such buffers for reuse (``BufferPool``).

    Raises:
        ConfigError: ``nbytes`` is not a whole number from 0 to ``MAX_BUFFER`` (a negative
            size was given a page, as 0 is).
    """
    nbytes = whole_number(nbytes, "nbytes", 0, MAX_BUFFER)
    huge = huge and nbytes >= HUGE
    size = max(PAGE, align_up(nbytes, HUGE if huge else PAGE))
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP disabled or absent: 4 KiB pages still work
            buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def aligned_empty(nbytes: int, alignment: int = PAGE) -> memoryview:
    """An uninitialised writable buffer whose start is ``alignment``-aligned.

    Taken from the allocator (which recycles freed memory, unlike a fresh mmap), so the
    per-batch buffers that get_many hands out as zero-copy views cost no page faults.
    """
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    skew = (-raw.ctypes.data) % alignment
    return raw[skew : skew + nbytes].data


class BufferPool:
    """Keeps aligned buffers for reuse so the hot path allocates nothing.

    ``take(n)`` returns a buffer of at least ``n`` bytes; ``give(buf)`` hands it back.
    At most ``max_cached`` buffers are kept; the rest are released.
    """

    def __init__(self, max_cached: int = 8) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._max_cached = max_cached

    def take(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= nbytes:
                    return self._free.pop(i)
        return aligned_buffer(nbytes)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self._max_cached:
                self._free.append(buf)
                return
        with contextlib.suppress(BufferError):  # a view still refers to it: GC frees it later
            buf.close()
