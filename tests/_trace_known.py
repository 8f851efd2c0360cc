"""Helper for the known-answer test: 100 x 1 MiB sequential writes, then 4 KiB reads at
1,000 random offsets, all through lcache.io; prints the read offsets as JSON."""

import json
import os
import random
import sys

from lcache.io import open_file, pread_full, pwrite_full

path = sys.argv[1]
mib = 1 << 20
fd = open_file(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
block = os.urandom(mib)
for i in range(100):
    pwrite_full(fd, i * mib, [block], "checkpoint")
rng = random.Random(int(sys.argv[2]))
offsets = [rng.randrange(0, 100 * mib - 4096) for _ in range(1000)]
buf = memoryview(bytearray(4096))
for off in offsets:
    pread_full(fd, off, buf, "cache-read")
os.close(fd)
print(json.dumps(offsets))
