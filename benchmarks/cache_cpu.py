"""Per-sample CPU cost of the sample cache's warm read path (no network, no cold reads), and
of admitting samples into its store.

Every sample is already cached and in the page cache, so what is measured is the Python and
system-call work per sample: the store's reads and checks, the cache's claims and counters,
the sampler's plan and the DataLoader's worker path.

    python benchmarks/cache_cpu.py
    python benchmarks/cache_cpu.py --samples 8000 --sample-size 4KiB --dir /nvme/tmp

Prints one JSON object: a row per path with ``us_per_sample`` (wall time per sample),
``cpu_us_per_sample`` (CPU time of this process and its reaped children, every thread) and
``samples_per_s``:

  store_get              ``Store.get`` one key at a time, random keys
  store_get_many_B       ``Store.get_many`` in random batches of B keys (8, 32, 128)
  dataset_int            ``CachedDataset[i]`` with plain int keys, one process
  dataset_sampler        ``CachedDataset[a]`` for each ``Access`` of ``SeedAwareSampler``
  dataset_getitems       ``CachedDataset.__getitems__`` on the sampler's batches (when the
                         code has it; the DataLoader calls it with automatic batching)
  loader_lcache          DataLoader, 2 persistent workers, collation off, over the
                         CachedDataset with the sampler (epochs after the first)
  loader_memory          the same DataLoader over the same bytes held in a Python list
  store_admit_128        ``Store.put_many`` of 128 samples at a time into a store set up as a
                         cache of half the samples sets up its own (segment size, policy,
                         writers), the oldest samples read and removed as the newest arrive:
                         a full cache in steady state, every new segment cleaning an old one

Every row takes the best of ``--repeats`` runs (the machine's noise is one-sided); ``create_us``
is what creating a file cost in ``--dir`` at the start (see the admit row). The
``cpu_us_per_sample`` of the loader rows counts this process only (its workers live on).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _sysbench as sb
import numpy as np

from lcache.data import CachedDataset, SeedAwareSampler
from lcache.data.cache import MAX_WRITERS
from lcache.data.sizing import choose_segment_size
from lcache.store import Store, parse_size

BATCHES = (8, 32, 128)
ADMIT_BATCH = 128  # samples per put_many of the admit row (a shard's misses, say)


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def drain(items: Any) -> None:
    """Consume an iterable, keeping nothing: results kept alive would cost the page faults
    of fresh memory on every sample, which is not what is measured."""
    for _ in items:
        pass


def measure(name: str, samples: int, run: Callable[[], None], repeats: int) -> dict[str, Any]:
    """Best of ``repeats`` runs of ``run``, which serves ``samples`` samples."""
    best: tuple[float, float] | None = None
    for _ in range(repeats):
        c0, t0 = _cpu(), time.perf_counter()
        run()
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        if best is None or wall < best[0]:
            best = (wall, cpu)
    assert best is not None
    wall, cpu = best
    return {"path": name, "samples": samples, "us_per_sample": round(wall / samples * 1e6, 2),
            "cpu_us_per_sample": round(cpu / samples * 1e6, 2),
            "samples_per_s": round(samples / wall)}


def store_rows(root: Path, payloads: list[bytes], repeats: int, seed: int) -> list[dict[str, Any]]:
    n = len(payloads)
    size = len(payloads[0])
    store = Store.open(root / "store", capacity=max(64 << 20, 3 * n * (size + 64)),
                       segment_size=min(64 << 20, max(1 << 20, 64 * size)), sync="never")
    try:
        for lo in range(0, n, 256):
            store.put_many(list(range(lo, min(n, lo + 256))), payloads[lo : lo + 256])
        store.flush()
        keys = np.random.default_rng(seed).permutation(n).tolist()
        rows = [measure("store_get", n, lambda: drain(store.get(k) for k in keys), repeats)]
        for b in BATCHES:
            batches = [keys[i : i + b] for i in range(0, n - n % b, b)]
            rows.append(measure(f"store_get_many_{b}", len(batches) * b,
                                lambda batches=batches: drain(store.get_many(k) for k in batches),
                                repeats))
        return rows
    finally:
        store.close()


def admit_row(root: Path, payloads: list[bytes], repeats: int) -> dict[str, Any]:
    n, size = len(payloads), len(payloads[0])
    capacity = n * size // 2
    segment = choose_segment_size(capacity, 512, size)
    live_most = capacity // 2 // size  # what the reader leaves cached
    runs = iter(range(repeats))

    def admit() -> None:
        store = Store.open(root / f"admit-{next(runs)}", capacity=capacity, segment_size=segment,
                           policy="planned", sync="never", direct_writes=False,
                           max_writers=min(MAX_WRITERS, capacity // segment - 2))
        try:
            live: list[int] = []
            for lo in range(0, n, ADMIT_BATCH):
                keys = list(range(lo, min(n, lo + ADMIT_BATCH)))
                store.put_many(keys, payloads[lo : lo + len(keys)])
                live += keys
                if len(live) > live_most:  # the reader takes the oldest, as keep=False reads do
                    gone, live = live[: len(live) - live_most], live[len(live) - live_most :]
                    store.get_many(gone, remove=[True] * len(gone))
        finally:
            store.close()

    return measure(f"store_admit_{ADMIT_BATCH}", n, admit, repeats)


class MemoryDataset:
    """The same samples as bytes in a list: what a DataLoader costs without any cache."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = payloads

    def __len__(self) -> int:
        return len(self.payloads)

    def __getitem__(self, i: int) -> bytes:
        return self.payloads[i]


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


def cache_rows(root: Path, payloads: list[bytes], repeats: int, batch: int,
               seed: int) -> list[dict[str, Any]]:
    from torch.utils.data import DataLoader

    n = len(payloads)
    data = root / "data"
    data.mkdir()
    for i, p in enumerate(payloads):
        (data / f"{i:07d}.bin").write_bytes(p)
    capacity = max(64 << 20, 2 * n * len(payloads[0]))
    ds = CachedDataset(str(data), root / "cache", capacity)
    try:
        for i in range(n):
            ds[i]  # admit everything: what follows reads warm
        keys = np.random.default_rng(seed).permutation(n).tolist()
        rows = [measure("dataset_int", n, lambda: drain(ds[k] for k in keys), repeats)]
        sampler = SeedAwareSampler(ds, seed=seed, num_replicas=1, rank=0)
        rows.append(measure("dataset_sampler", n, lambda: drain(ds[a] for a in sampler), repeats))
        if hasattr(ds, "__getitems__"):
            def batched() -> None:
                accesses = list(sampler)
                for lo in range(0, n, batch):
                    ds.__getitems__(accesses[lo : lo + batch])

            rows.append(measure("dataset_getitems", n, batched, repeats))
        # Persistent workers, timed from their second epoch: the start of the workers (fork,
        # opening the stores) is paid once per job, not per sample.
        loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=2,
                            collate_fn=_as_list, persistent_workers=True)
        memory = DataLoader(MemoryDataset(payloads), batch_size=batch, shuffle=True,
                            num_workers=2, collate_fn=_as_list, persistent_workers=True)
        for name, each in (("loader_lcache", loader), ("loader_memory", memory)):
            drain(each)
            rows.append(measure(name, n, lambda each=each: drain(each), repeats))
        stats = ds.stats()
        for row in rows:
            row["batch"] = batch if row["path"].startswith(("loader", "dataset_getitems")) \
                else 1
        if stats["fetches"] != n:
            raise SystemExit(f"warm paths fetched from the source: {stats}")
        return rows
    finally:
        ds.cache.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--sample-size", default="32KiB")
    p.add_argument("--batch-size", type=int, default=64,
                   help="batch size of the DataLoader and __getitems__ rows")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to build the store (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    size = parse_size(args.sample_size)
    if args.samples < max(BATCHES) or size < 8:
        p.error(f"--samples must be >= {max(BATCHES)} and --sample-size >= 8 bytes")
    rng = np.random.default_rng(args.seed)
    if args.dir is not None and not os.path.isdir(args.dir):
        p.error(f"--dir {args.dir}: not a folder (make it first)")
    payloads = [i.to_bytes(8, "little") + rng.bytes(size - 8) for i in range(args.samples)]
    root = Path(tempfile.mkdtemp(prefix="lcache-cpu-", dir=args.dir))
    # the admit row makes and removes two files a segment: what a file creation costs here
    # now (it rises 10-50x for a while after many removals on some filesystems) goes with it
    create_us = sb.create_cost_us(root / "probe")
    try:
        rows = store_rows(root, payloads, args.repeats, args.seed)
        rows.append(admit_row(root, payloads, args.repeats))
        rows += cache_rows(root, payloads, args.repeats, args.batch_size, args.seed)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    json.dump({"samples": args.samples, "sample_size": size, "python": sys.version.split()[0],
               "cpus": os.cpu_count(), "create_us": round(create_us), "rows": rows},
              sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
