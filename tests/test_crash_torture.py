"""kill -9 of a real writer process, over and over, on one store directory.

Each round starts ``python -m lcache.testing.crashwriter`` (puts of mixed sizes under int and
byte keys, deletes, gets that set CLOCK bits, gc(), flushes; 64 KiB segments, so it seals
often; a capacity below the key space, so it evicts all the time), kills it with SIGKILL at a
random moment (now and then during start-up, i.e. inside its own recovery), then checks:

* before recovery, fsck finds nothing but crash leftovers (the unsealed segment, temp files,
  the summary of a segment whose clean-up was cut short);
* recovery is either ``Store.open`` or, every third round, ``fsck(repair=True)`` first;
* every key reads as exactly one of the values that may be there, or a miss
  (``CrashModel.verify``): never bytes that were not written, never a deleted value back;
* every value flushed before the kill whose key was not touched afterwards is present if
  less than capacity - (max_writers + 3) x segment_size - index and delete journal bytes were
  appended after it (what FIFO and CLOCK, both oldest-segment-first, guarantee);
* afterwards fsck is clean, the bytes on disk are within the capacity and no segment is longer
  than segment_size.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lcache.store import Store, fsck
from lcache.store.counters import read_totals
from lcache.testing import disk_usage, largest_segment
from lcache.testing.crashwriter import CrashModel, byte_key, int_key

from .conftest import KIB, MIB, subprocess_env

ROUNDS = int(os.environ.get("LCACHE_TORTURE_ROUNDS", "60"))
SEGMENT = 64 * KIB
CAPACITY = 4 * MIB
MAX_WRITERS = 2
INT_KEYS = 600
BYTE_KEYS = 200
CRASH_LEFTOVERS = ("left unsealed by a crashed writer", "leftover temp file",
                   "summary without a log", "of a replaced index or journal")


def _index_bytes(root: Path) -> int:
    """The indexes and the delete journal: the capacity counts them too."""
    return sum(os.stat(p).st_blocks * 512 for p in [*root.glob("index-*.bin"),
                                                     *root.glob("deletes-*.bin")])


def _wait_ready(child: subprocess.Popen[bytes], timeout: float) -> None:
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    line = child.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        child.kill()
        _, err = child.communicate(timeout=30)
        pytest.fail(f"the writer did not start (exit {child.returncode}): {err.decode()[-2000:]}")


@pytest.mark.slow
def test_kill_9_torture(tmp_path: Path) -> None:
    root = tmp_path / "store"
    Store.open(root, capacity=CAPACITY, segment_size=SEGMENT, max_writers=MAX_WRITERS,
               policy="lru", max_byte_keys=1024).close()
    model = CrashModel(CAPACITY, SEGMENT, MAX_WRITERS)
    all_keys = [*map(int_key, range(INT_KEYS)), *map(byte_key, range(BYTE_KEYS))]
    rng = random.Random(20250)
    must_total = hits_total = 0
    for rnd in range(ROUNDS):
        journal = tmp_path / f"journal-{rnd:03d}"
        policy = "fifo" if rnd % 4 == 3 else "lru"
        child = subprocess.Popen(
            [sys.executable, "-m", "lcache.testing.crashwriter", str(root), str(journal),
             "--seed", str(rnd), "--version-base", str(model.version + 1),
             "--appended-base", str(model.appended), "--capacity", str(CAPACITY),
             "--segment-size", str(SEGMENT), "--max-writers", str(MAX_WRITERS),
             "--policy", policy, "--int-keys", str(INT_KEYS), "--byte-keys", str(BYTE_KEYS)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(),
        )
        if rnd % 10 == 9:  # anywhere from interpreter start-up to its own recovery
            time.sleep(rng.uniform(0.0, 0.5))
        else:
            _wait_ready(child, 60)
            time.sleep(rng.uniform(0.02, 0.4))
        child.send_signal(signal.SIGKILL)
        _, err = child.communicate(timeout=60)
        assert child.returncode == -signal.SIGKILL, (
            f"round {rnd}: the writer ended by itself (exit {child.returncode}; 3 means a get "
            f"returned wrong bytes): {err.decode()[-2000:]}"
        )
        pending = model.read_round(str(journal))

        before = fsck(root)
        odd = [p for p in before.problems if not any(s in p for s in CRASH_LEFTOVERS)]
        assert odd == [], f"round {rnd}: fsck after the kill, before recovery: {odd}"
        if rnd % 3 == 2:
            repaired = fsck(root, repair=True)
            assert repaired.clean, f"round {rnd}: fsck --repair left {repaired.problems}"
        store = Store.open(root)
        try:
            verdict = model.verify(store, all_keys, pending, _index_bytes(root))
        finally:
            store.close()
        assert verdict.failures == [], f"round {rnd}: " + "\n".join(verdict.failures[:20])
        must_total += verdict.must_be_present
        hits_total += verdict.hits
        after = fsck(root)
        assert after.clean, f"round {rnd}: fsck after recovery: {after.problems}"
        assert disk_usage(root) <= CAPACITY
        assert largest_segment(root) <= SEGMENT

    totals = read_totals(str(root))
    # The run was meaningful: eviction and CLOCK copies happened, recoveries happened, and
    # many checks were of the "must be present" kind, not just "a miss is fine".
    assert totals.evictions > 0 and totals.gc_bytes_copied > 0, totals
    assert totals.recovered_segments >= ROUNDS // 3, totals
    assert must_total > 20 * ROUNDS, (must_total, hits_total)
