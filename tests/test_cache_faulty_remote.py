"""Training through the cache from an HTTP remote that misbehaves on a third of its objects
(resets, bodies cut short, 5xx and 429, a range answered whole, a range labelled from the
start): DataLoader workers, the prefetcher and the lean HTTP client together serve every
sample exactly once per epoch, and every byte of every sample is the source's."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

from torch.utils.data import DataLoader

from lcache.data import SeedAwareSampler

from ._cache_data import _close_datasets, open_dataset, write_samples  # noqa: F401
from ._torchrun_cache import sample_index

N, SIZE = 600, 4000
FAULTS = ["reset", "cut", "500", "503", "429", "ignore-range", "gzip", "misplaced"]
FAILING = {"reset", "cut", "500", "503", "429"}  # the others answer the right bytes oddly
# The server runs in a process of its own. In this one, the DataLoader workers forked from
# here would hold its sockets too: a connection it closes (a reset, a cut body) would stay
# open until they exit, and the client would wait for its end until the timeout.
SERVER = """
import sys
sys.path.insert(0, sys.argv[2])
from lcache.testing.remote import ThrottledServer
from tests.test_cache_faulty_remote import fault
import collections, json
applied = collections.Counter()
def counted(path, nth):
    kind = fault(path, nth)
    applied[kind] += kind is not None
    return kind
with ThrottledServer(sys.argv[1], fault=counted) as server:
    print(server.url, flush=True)
    sys.stdin.read()  # until the test is done: then the faults it answered with
    print(json.dumps(applied), flush=True)
"""


def fault(path: str, nth: int) -> str | None:
    """The first two GETs of a third of the objects fail or come in an odd form, the same
    ones in every run; retries (4) always get past them."""
    rng = random.Random(f"{path}-{nth}")
    return rng.choice(FAULTS) if nth <= 2 and rng.random() < 0.33 else None


def test_a_misbehaving_remote_never_yields_wrong_bytes(tmp_path: Path) -> None:
    write_samples(tmp_path / "remote" / "d", N, SIZE)
    repo = str(Path(__file__).resolve().parent.parent)
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(tmp_path / "remote"), repo],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdin is not None and server.stdout is not None
        url = server.stdout.readline().strip()
        ds = open_dataset(url + "/d/", tmp_path / "cache", 0.5, segment_size="16KiB",
                          backoff=0.001)
        sampler = SeedAwareSampler(ds, seed=1, loader_workers=2)
        loader = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2,
                            collate_fn=list)
        for epoch in range(3):
            sampler.set_epoch(epoch)
            got = [sample_index(item, SIZE) for batch in loader for item in batch]
            counts = Counter(got)
            assert len(got) == N and set(counts) == set(range(N)), (epoch, len(counts))
        server.stdin.close()
        applied = json.loads(server.stdout.readline())
    finally:
        server.kill()
        server.wait()
    # The faults were met, by the server's own count: every object was asked for at least
    # once, so at least every one whose first GET fails had that GET fail.
    first = sum(fault(f"/d/{i:06d}.bin", 1) in FAILING for i in range(N))
    met = sum(applied.get(kind, 0) for kind in FAILING)
    assert met >= first > N // 10, (applied, first)
