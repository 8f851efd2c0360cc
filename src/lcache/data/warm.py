"""``lcache warm``: fill a cache from its source ahead of training."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from lcache.checks import whole_number
from lcache.data.cache import SampleCache, check_locations
from lcache.data.cachedir import first_missing, remove_made_cache_dir
from lcache.data.sources import FileSource, Source
from lcache.errors import ConfigError

GROUP = 8  # samples per fetch_many (consecutive paths: a source may coalesce them)


def warm_cache(source: str | Source, cache_dir: str, capacity: int | str, *,
               threads: int = 16, storage_options: dict[str, Any] | None = None,
               show_progress: bool = True, name: str | None = None,
               fingerprint: str | None = None,
               segment_size: int | str | None = None) -> dict[str, Any]:
    """Fetch the samples a sampler's plan holds for good where its node reads every sample
    (``SampleCache.fixed_set``, with one writer's room), in index order.

    ``source`` is a URL or directory (its files are the samples: a ``FileSource``, which is
    what ``lcache warm`` makes) or a source object such as ``ImageFolderSource(url)``: the
    cache is the one ``CachedDataset`` opens for that source with the same ``name`` and
    ``fingerprint`` (and ``segment_size``, which a new cache is made with, as
    ``CachedDataset`` takes it). Samples already cached are skipped. The sampler's plan
    decides later which of them stay; warming only spares the first epoch those fetches.
    """
    # threads=0, -1, 1.5 or 10**9 were taken (as 1, or as a billion threads to ask for)
    threads = whole_number(threads, "threads", 1, 1024)
    check_locations(source, cache_dir)  # before listing the source
    if isinstance(source, str):
        source = FileSource(source, storage_options=storage_options)
    elif storage_options:
        raise ConfigError("storage_options is for a source given as a URL; pass the options "
                          "to the source object")
    # A directory this call makes goes again if the call fails before caching a sample (a
    # failed `lcache warm` left an empty cache behind); what it fetched is kept for a rerun.
    target = os.path.abspath(os.fspath(cache_dir))
    made = first_missing(target)
    try:
        cache = SampleCache(source, cache_dir, capacity, name=name, fingerprint=fingerprint,
                            segment_size=segment_size)
    except BaseException:
        if made is not None:
            remove_made_cache_dir(target, made)
        raise
    done: list[int] = []  # what this run fetched; another warm of this cache may fetch the rest
    try:  # closed however it ends: its staging area in /dev/shm went only with a next open
        return _warm(cache, threads, show_progress, done)
    except BaseException:
        cache.close()
        if made is not None and not done:
            remove_made_cache_dir(target, made)
        raise
    finally:
        cache.close()


def _warm(cache: SampleCache, threads: int, show_progress: bool,
          done: list[int]) -> dict[str, Any]:
    sizes = cache.record_sizes()
    held = np.flatnonzero(cache.fixed_set(cache.plan_capacity(writers=1))).tolist()
    todo = [i for i in held if i not in cache.store()]
    fetched = 0
    start = time.perf_counter()
    with Progress(*Progress.get_default_columns()[:1], BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), transient=True,
                  # on a pipe or a file the bar would leave an empty line (and, on an error,
                  # print it before the message)
                  disable=not (show_progress and sys.stdout.isatty())) as bar:
        task = bar.add_task("warming", total=int(sizes[todo].sum()) if todo else 0)
        groups = [todo[lo : lo + GROUP] for lo in range(0, len(todo), GROUP)]
        pool = ThreadPoolExecutor(threads)
        try:
            for n in pool.map(lambda g: cache.prefetch_many(g, [True] * len(g), done=done),
                              groups):
                fetched += n
                bar.advance(task, n)
        finally:  # on Ctrl-C or SIGTERM the groups not begun are dropped, not fetched first
            pool.shutdown(cancel_futures=True)
    seconds = time.perf_counter() - start
    store = cache.store()
    store.flush()
    stats = cache.stats()
    # what the cache holds now (whoever fetched it), not what would fit: a sample the disk
    # refused is not in it
    cached = sum(1 for i in range(len(cache.source)) if i in store)
    return {
        "samples": len(cache.source), "dataset_bytes": cache.dataset_bytes,
        "capacity": cache.capacity, "cached_samples": cached,
        "fetched_samples": len(done), "fetched_bytes": fetched,
        "seconds": round(seconds, 3),
        "MBps": round(fetched / seconds / 1e6, 1) if seconds > 0 else 0.0,
        "admit_failures": stats["admit_failures"],
    }
