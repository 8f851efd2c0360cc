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
