"""Helper: a DataLoader with 2 workers reading 4 KiB records through lcache.io (run with
LCACHE_TRACE set); prints the number of items it loaded."""

import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

from lcache.io import open_file, pread_full


class Records(Dataset[torch.Tensor]):
    def __init__(self, path: str, n: int) -> None:
        self.path, self.n, self.fd = path, n, -1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.fd < 0:  # opened after the fork, in the worker
            self.fd = open_file(self.path, os.O_RDONLY)
        buf = bytearray(4096)
        pread_full(self.fd, i * 4096, memoryview(buf), "cache-read")
        return torch.tensor(buf[0])


if __name__ == "__main__":
    path, n = sys.argv[1], int(sys.argv[2])
    with open(path, "wb") as f:
        f.write(os.urandom(n * 4096))
    loader = DataLoader(Records(path, n), batch_size=8, num_workers=2)
    print(sum(len(batch) for batch in loader))


def spawned_child(path: str) -> None:
    """Target of a spawn-context process: inherits LCACHE_TRACE and records on its own."""
    import lcache.trace

    if not lcache.trace.enabled():
        raise SystemExit("LCACHE_TRACE was not honoured in the spawned child")
    fd = open_file(path, os.O_RDWR | os.O_CREAT)
    from lcache.io import pwrite_full

    pwrite_full(fd, 0, [b"s" * 512], "offload")
    os.close(fd)
