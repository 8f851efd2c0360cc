"""The systems under test of ``cache_bench.py``: one child process per (system, cache fraction).

    python _peers.py write ROOT SHARD_BYTES   # MDS shards and litdata chunks from ROOT/samples
    python _peers.py run CONFIG_JSON          # 3 epochs of one system; one JSON line per epoch
    python _peers.py versions                 # the versions of what the systems run on

Runs in the benchmark's own venv (torch, mosaicml-streaming, litdata, lcache), never in the
package's. Every system yields the same items, ``(index, uint8 tensor of the sample's bytes)``,
through a torch DataLoader with the same batch size and workers; the index is the first 8
bytes of each sample, so each epoch can be checked for duplicates and gaps.

How each system reaches the remote (all of it is one ThrottledServer run by the parent):
  lcache, none      HTTP GET per sample file (fsspec's HTTP filesystem, as lcache uses it);
                    with --shape shards, lcache reads ranges of WebDataset tars instead
  fsspec-filecache  HTTP GET per sample file through fsspec's ``filecache`` (no size limit)
  mosaicml-streaming, litdata
                    S3 GetObject of whole shards: the server answers path-style S3 reads
                    (``/BUCKET/KEY`` with ETag and Last-Modified) since neither reads HTTP

The bytes each epoch took from the remote are read from the server's counters
(``GET /__stats``, neither throttled nor counted) right before and after the epoch.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

BUCKET = "bench"  # the "S3 bucket": ROOT/bench on the server
SAMPLES_DIR = "samples"
WDS_DIR = "wds"  # --shape shards: WebDataset tars of the samples


def sample_name(index: int) -> str:
    return f"{index:07d}.bin"


def sample_index(data: bytes | memoryview) -> int:
    return int.from_bytes(bytes(data[:8]), "little")


def import_streaming() -> Any:
    """``streaming``, without its vision datasets: the package's ``__init__`` imports them and
    they import torchvision, whose PyPI build is linked against CUDA torch and fails to load
    beside the CPU torch 2.13.0 ("operator torchvision::nms does not exist"). Unused here."""
    import types

    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


# ----------------------------------------------------------------------------- shard writers
def _sample_files(root: str) -> list[str]:
    folder = os.path.join(root, SAMPLES_DIR)
    return [os.path.join(folder, name) for name in sorted(os.listdir(folder))]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _litdata_item(path: str) -> dict[str, bytes]:
    return {"data": _read(path)}


def write_mds(root: str, shard_bytes: int) -> str:
    MDSWriter = import_streaming().MDSWriter

    out = os.path.join(root, BUCKET, "mds")
    shutil.rmtree(out, ignore_errors=True)
    with MDSWriter(out=out, columns={"data": "bytes"}, size_limit=shard_bytes) as writer:
        for path in _sample_files(root):
            writer.write({"data": _read(path)})
    return out


def write_litdata(root: str, shard_bytes: int) -> str:
    import litdata

    out = os.path.join(root, BUCKET, "litdata")
    shutil.rmtree(out, ignore_errors=True)
    # keep_data_ordered: chunk i holds the samples in index order, like the MDS shards.
    litdata.optimize(fn=_litdata_item, inputs=_sample_files(root), output_dir=out,
                     chunk_bytes=shard_bytes, num_workers=1, keep_data_ordered=True,
                     verbose=False)
    return out


def stored_bytes(folder: str) -> int:
    """Bytes of a peer's shards (what "the whole dataset" is for its cache limit)."""
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
               if not f.endswith(".json"))


# ----------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class Config:
    system: str
    shape: str  # objects, shards (lcache reads WebDataset tars) or scarce
    url: str  # the server's base URL
    fraction: float
    budget: int | None  # cache bytes the system may use (None: no cache or no limit)
    cache_dir: str
    samples: int
    epochs: int
    workers: int
    batch_size: int
    seed: int


def server_stats(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/__stats", timeout=30) as r:
        return json.loads(r.read())


def collate(items: list[bytes | memoryview]) -> tuple[Any, Any]:
    """Raw sample bytes -> (indices, uint8 batch): the same work for every system. A sample
    whose first bytes are not an index (wrong bytes served) gets index -1."""
    import torch

    found = [sample_index(b) for b in items]
    indices = torch.tensor([i if i < 1 << 40 else -1 for i in found], dtype=torch.int64)
    data = torch.stack([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in items])
    return indices, data


def _payload(item: Any) -> bytes:
    """The sample's bytes: MDS and litdata items are {"data": ...}, a WebDataset sample
    {"__key__": ..., "bin": ...}."""
    if isinstance(item, dict):
        return item["data"] if "data" in item else item["bin"]
    return item


def _collate_payloads(items: list[Any]) -> tuple[Any, Any]:
    return collate([_payload(x) for x in items])


class _HttpFiles:
    """Map-style dataset of the sample files over HTTP, through ``protocol`` (``http`` or
    ``filecache``); the filesystem is made lazily in each worker (not shared over fork)."""

    def __init__(self, url: str, n: int, protocol: str, options: dict[str, Any]) -> None:
        self.urls = [f"{url}/{SAMPLES_DIR}/{sample_name(i)}" for i in range(n)]
        self.protocol, self.options = protocol, options
        self._fs: Any = None

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, index: int) -> bytes:
        if self._fs is None:
            import fsspec

            self._fs = fsspec.filesystem(self.protocol, **self.options)
        return bytes(self._fs.cat_file(self.urls[index]))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}


# Each builder returns (dataset, DataLoader keyword arguments, set_epoch(epoch)).
Built = tuple[Any, dict[str, Any], Callable[[int], None]]


def _shuffled(cfg: Config) -> dict[str, Any]:
    import torch

    return {"shuffle": True, "generator": torch.Generator().manual_seed(cfg.seed)}


def build_lcache(cfg: Config) -> Built:
    from lcache.data import CachedDataset, SeedAwareSampler, WebDatasetSource

    # capacity as a fraction of the dataset's bytes as the source gives them (a WebDataset
    # sample is its members' tar bytes, headers included)
    source: Any = WebDatasetSource(f"{cfg.url}/{WDS_DIR}/") if cfg.shape == "shards" else \
        f"{cfg.url}/{SAMPLES_DIR}/"
    ds = CachedDataset(source, cfg.cache_dir, cfg.fraction)
    # In shards, a shard-local order (shards shuffled, then samples within runs of 4 shards),
    # as litdata shuffles chunks, so nearby misses coalesce; objects have no shards.
    sampler = SeedAwareSampler(ds, seed=cfg.seed, loader_workers=cfg.workers,
                               shard_window=4 if cfg.shape == "shards" else 0)
    return ds, {"sampler": sampler}, sampler.set_epoch


def build_none(cfg: Config) -> Built:
    return _HttpFiles(cfg.url, cfg.samples, "http", {}), _shuffled(cfg), lambda e: None


def build_fsspec(cfg: Config) -> Built:
    # filecache keeps whole files (here: whole samples) with no size limit; it has no
    # eviction, so the cache fraction does not apply to it.
    options = {"target_protocol": "http", "cache_storage": cfg.cache_dir}
    return _HttpFiles(cfg.url, cfg.samples, "filecache", options), _shuffled(cfg), \
        lambda e: None


def build_streaming(cfg: Config) -> Built:
    streaming = import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    # cache_limit: the bytes of shards kept in `local`; over it, the least recently used
    # shards are evicted (it must be at least 4 shards). Its shuffle (py1e) is left at its
    # defaults: a shuffle block of 262,144 samples, here the whole dataset, so the order is
    # as random as the others' and a cache below the dataset re-downloads whole shards.
    ds = streaming.StreamingDataset(remote=f"s3://{BUCKET}/mds", local=cfg.cache_dir,
                                    shuffle=True, shuffle_seed=cfg.seed,
                                    batch_size=cfg.batch_size, cache_limit=cfg.budget)
    # Its index was fetched here, and its S3 client keeps that connection open; forked
    # workers would inherit the client and share one socket, reading each other's responses
    # (shards with shifted bytes, then wrong samples). Drop it: each worker makes its own.
    for stream in ds.streams:
        stream._downloader.clean_up()
    return ds, {}, lambda e: None  # it counts its epochs itself, one per iteration


def build_litdata(cfg: Config) -> Built:
    from litdata import StreamingDataset
    from litdata.streaming import downloader
    from litdata.streaming.resolver import Dir

    # Its chunk GETs go through obstore, whose client refuses plain http unless told; the
    # loopback server has no TLS. Only the scheme changes (workers inherit it over fork).
    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS,
                                          "allow_http": True}
    # max_cache_size: when the dataset's chunks exceed it, each chunk is deleted once the
    # worker has read it (and the cache folder is kept under the limit); else all stay.
    ds = StreamingDataset(Dir(path=cfg.cache_dir, url=f"s3://{BUCKET}/litdata"),
                          shuffle=True, seed=cfg.seed, max_cache_size=cfg.budget,
                          storage_options={"endpoint_url": cfg.url})
    return ds, {}, lambda e: ds.set_epoch(e + 1)  # litdata counts epochs from 1


BUILDERS: dict[str, Callable[[Config], Built]] = {
    "lcache": build_lcache,
    "none": build_none,
    "fsspec-filecache": build_fsspec,
    "mosaicml-streaming": build_streaming,
    "litdata": build_litdata,
}


def run_epoch(loader: Iterable[tuple[Any, Any]]) -> tuple[list[int], int]:
    """(indices seen, sample bytes served) over one pass of ``loader``."""
    seen: list[int] = []
    served = 0
    for indices, data in loader:
        seen.extend(indices.tolist())
        served += data.numel()
    return seen, served


def run(cfg: Config) -> None:
    from torch.utils.data import DataLoader

    t0 = time.perf_counter()
    dataset, loader_args, set_epoch = BUILDERS[cfg.system](cfg)
    setup_s = time.perf_counter() - t0
    loader = DataLoader(dataset, batch_size=cfg.batch_size, num_workers=cfg.workers,
                        collate_fn=_collate_payloads, **loader_args)
    for epoch in range(cfg.epochs):
        set_epoch(epoch)
        before = server_stats(cfg.url)
        t0 = time.perf_counter()
        seen, served = run_epoch(loader)
        seconds = time.perf_counter() - t0
        after = server_stats(cfg.url)
        remote = after["bytes_sent"] - before["bytes_sent"]
        row = {
            "system": cfg.system, "cache_fraction": cfg.fraction, "epoch": epoch + 1,
            "seconds": round(seconds, 3), "samples_per_s": round(len(seen) / seconds, 1),
            "remote_bytes": remote,
            # Byte hit ratio: the share of the bytes served that did not come from the remote
            # in this epoch (negative: it fetched more than it served, e.g. whole shards).
            "hit_ratio": round(1 - remote / served, 4) if served else None,
            "requests": after["requests"] - before["requests"],
            "samples": len(seen), "unique_samples": len(set(seen) - {-1}),
            "wrong_samples": seen.count(-1), "served_bytes": served,
            "cache_limit": cfg.budget, "setup_s": round(setup_s, 3) if epoch == 0 else 0.0,
        }
        if cfg.system == "lcache":
            row["lcache_stats"] = _lcache_counters(dataset)
        print(json.dumps(row), flush=True)


def _lcache_counters(dataset: Any) -> dict[str, Any]:
    """lcache's own cumulative counters (its claims, next to the server's figures)."""
    stats = dataset.stats()
    return {k: stats[k] for k in ("hit_ratio", "fetches", "prefetched", "demand_misses",
                                  "from_ssd", "remote_bytes") if k in stats}


def main(argv: list[str]) -> None:
    if argv[:1] == ["write"]:
        root, shard_bytes = argv[1], int(argv[2])
        mds, lit = write_mds(root, shard_bytes), write_litdata(root, shard_bytes)
        print(json.dumps({"mds_bytes": stored_bytes(mds), "litdata_bytes": stored_bytes(lit)}))
    elif argv[:1] == ["versions"]:
        from importlib.metadata import version

        names = ("torch", "numpy", "fsspec", "mosaicml-streaming", "litdata", "obstore",
                 "boto3", "lcache")
        print(json.dumps({n: version(n) for n in names}))
    elif argv[:1] == ["run"]:
        run(Config(**json.loads(argv[1])))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
