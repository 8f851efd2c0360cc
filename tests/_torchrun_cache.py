"""One rank of the torchrun test in ``test_data_training.py`` (not collected by pytest).

``torchrun --standalone --nproc_per_node 2 tests/_torchrun_cache.py URL CACHE_DIR OUT_DIR
--samples N --size BYTES --capacity BYTES [--drop-last] ...``

Every rank reads ``URL`` through one ``CachedDataset`` on the shared ``CACHE_DIR``, checks each
sample's bytes, and writes the sample indices it got per epoch to ``OUT_DIR/rank{R}.json``.
Between epochs all ranks meet at a barrier and rank 0 requests ``/_mark/...`` from the server,
so the test can split the server's request log by epoch.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import urllib.error
import urllib.request

import numpy as np


def sample_bytes(index: int, size: int, seed: int = 0) -> bytes:
    """Sample ``index``: its index as a little-endian u64, then deterministic random bytes."""
    return index.to_bytes(8, "little") + np.random.default_rng([seed, index]).bytes(size - 8)


def sample_index(data: bytes, size: int, seed: int = 0) -> int:
    """The index a sample's bytes encode, after checking all of them; raises if damaged."""
    index = int.from_bytes(bytes(data[:8]), "little")
    if bytes(data) != sample_bytes(index, size, seed):
        raise AssertionError(f"sample {index}: {len(data)} bytes that are not its content")
    return index


def _mark(url: str, name: str) -> None:
    with contextlib.suppress(urllib.error.HTTPError):  # 404 as intended: the request counts
        urllib.request.urlopen(f"{url}/_mark/{name}", timeout=30).close()


def main() -> None:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lcache.data import CachedDataset, SeedAwareSampler

    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("cache_dir")
    p.add_argument("out_dir")
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--capacity", type=int, required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--drop-last", action="store_true")
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--watchdog", type=float, default=0, help="dump all stacks after S seconds")
    args = p.parse_args()
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = CachedDataset(args.url + "/", args.cache_dir, args.capacity)
    assert len(ds) == args.samples, (len(ds), args.samples)
    sampler = SeedAwareSampler(ds, seed=args.seed, drop_last=args.drop_last)
    assert (sampler.rank, sampler.world) == (rank, world)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, collate_fn=list)
    dist.barrier()
    if rank == 0:
        _mark(args.url, "start")
    dist.barrier()
    epochs: list[list[int]] = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        got = [sample_index(item, args.size, args.data_seed) for batch in loader
               for item in batch]
        epochs.append(got)
        dist.barrier()  # every rank's reads (and prefetches) of this epoch are done
        if rank == 0:
            _mark(args.url, f"end{epoch}")
        dist.barrier()
    out = {"rank": rank, "world": world, "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
           "node_ranks": list(sampler.node_ranks), "epochs": epochs,
           "stats": {k: v for k, v in ds.stats().items() if isinstance(v, int)}}
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    ds.cache.close()  # (a dropped, unclosed cache would leave its /dev/shm staging dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
