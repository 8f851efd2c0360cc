"""Extra I/O per training step beside the dataset reads: the optimizer and activation offload
that ``lcache model`` predicts (``--offload-from``, ``bench from-model``), written then read back
from a per-rank file while the step computes."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from lcache.io import close_file, drop_page_cache, open_file, pread_full, pwrite_full, sync_fd


@dataclass
class StepIO:
    """Extra traffic per training step (offload emulation, from ``lcache model``).

    ``write_bytes`` then ``read_bytes`` go to a per-rank file with ``io_class`` while the step's
    compute sleeps; a step whose I/O outlasts the sleep waits for it, lowering AU.
    """

    io_class: str
    write_bytes: int = 0
    read_bytes: int = 0


class StepTraffic:
    """Per-rank offload file: the extra per-step I/O of :class:`StepIO` entries."""

    def __init__(self, folder: str, rank: int, items: list[StepIO]) -> None:
        self.items = [i for i in items if i.write_bytes or i.read_bytes]
        self.fds: list[int] = []
        self.bufs: list[memoryview] = []
        for n, item in enumerate(self.items):
            path = os.path.join(folder, f"offload-{item.io_class}-{n}-rank{rank}.bin")
            fd = open_file(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            self.fds.append(fd)
            size = max(item.write_bytes, item.read_bytes)
            self.bufs.append(memoryview(np.random.default_rng().bytes(min(size, 64 << 20))))
            # The reads need bytes to read: lay the file out once, outside any step.
            self._write(fd, self.bufs[-1], item.read_bytes, item.io_class)

    @staticmethod
    def _write(fd: int, buf: memoryview, nbytes: int, io_class: str) -> None:
        off = 0
        while off < nbytes:
            n = min(len(buf), nbytes - off)
            pwrite_full(fd, off, [buf[:n]], io_class=io_class)
            off += n
        if nbytes:
            sync_fd(fd, io_class=io_class)
            drop_page_cache(fd)  # the read-back must come from storage, not memory

    def run_step(self) -> None:
        for fd, buf, item in zip(self.fds, self.bufs, self.items, strict=True):
            self._write(fd, buf, item.write_bytes, item.io_class)
            rbuf = memoryview(bytearray(len(buf)))
            off = 0
            while off < item.read_bytes:
                n = pread_full(fd, off, rbuf[:min(len(rbuf), item.read_bytes - off)],
                               io_class=item.io_class)
                if n == 0:
                    break
                off += n

    def close(self) -> None:
        for fd in self.fds:
            close_file(fd)
