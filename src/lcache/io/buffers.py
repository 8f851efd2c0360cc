"""Page-aligned reusable buffers (O_DIRECT needs aligned memory, offsets and lengths)."""

from __future__ import annotations

import mmap
import threading

PAGE = mmap.PAGESIZE


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def align_down(n: int, alignment: int) -> int:
    return n // alignment * alignment


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A zero-filled, page-aligned, writable buffer of at least ``nbytes`` (anonymous mmap)."""
    return mmap.mmap(-1, max(PAGE, align_up(nbytes, PAGE)))


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
        buf.close()
