"""A power loss never brings back a cached sample the cache dropped: the drops reach the disk
before the new listing that relies on them (the store itself writes with sync="never").

A power loss cannot be caused here, so the order of the syscalls is checked under strace:
what is on disk after a power loss is what was synced before it."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lcache.data import CachedDataset

from .conftest import subprocess_env

OPEN = """
import sys
from lcache.data import CachedDataset
ds = CachedDataset(sys.argv[1], sys.argv[2], "16MiB")
print(ds.cache.invalidated)
ds.cache.close()
"""


def _strace_open(data: Path, cache: Path, log: Path) -> tuple[int, list[str]]:
    """Open the cache under strace; (samples dropped, the syncs and renames in order)."""
    if shutil.which("strace") is None:
        pytest.fail("strace is missing: run .ci/run (apt-get install strace)")
    run = subprocess.run(
        ["strace", "-f", "-y", "-o", str(log), "-e",
         "trace=fsync,fdatasync,msync,rename,renameat,renameat2",
         sys.executable, "-c", OPEN, str(data), str(cache)],
        capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    calls = [line for line in log.read_text().splitlines()
             if re.search(r"\b(fsync|fdatasync|msync|rename\w*)\(", line)]
    return int(run.stdout.split()[-1]), calls


def test_dropped_samples_are_durable_before_the_new_listing(tmp_path: Path) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    for i in range(8):
        (data / f"s{i}.bin").write_bytes(random.Random(i).randbytes(4096))
    ds = CachedDataset(str(data), cache, "16MiB")
    assert all(len(ds[i]) == 4096 for i in range(8))
    ds.cache.close()
    (data / "s3.bin").write_bytes(b"new" * 1000)  # another size: the listing changes

    dropped, calls = _strace_open(data, cache, tmp_path / "strace.txt")
    assert dropped == 1
    published = [i for i, c in enumerate(calls)
                 if "rename" in c and re.search(r"cache\.json[^/\"]*\", .*cache\.json", c)]
    assert published, calls
    before = calls[:published[0]]
    # the delete journal of the main store is synced, and its index written back (msync)
    assert any(re.search(r"f(data)?sync\(\d+</[^>]*/store/deletes-", c) for c in before), before
    assert any(c.split(None, 1)[-1].startswith("msync(") for c in before), before

    again = CachedDataset(str(data), cache, "16MiB")
    assert again[3] == b"new" * 1000
    again.cache.close()
