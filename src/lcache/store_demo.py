"""The store demo behind ``lcache demo``: write, read, crash a writer, recover, check.

Values are a pure function of the key (``sample_value``), so any process can verify any record
it reads without keeping a copy.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from rich.progress import Progress

from lcache.bench.resources import bytes_under, need_space
from lcache.errors import ConfigError
from lcache.store import Store, StoreConfig, format_size, fsck, parse_size

SEGMENT_SIZE = 8 << 20
MAX_WRITERS = 2
BATCH = 256


def sample_value(key: int, size: int) -> bytes:
    """Deterministic pseudo-random bytes for ``key``."""
    return np.random.default_rng(key).bytes(size)


@contextmanager
def _progress(show: bool, label: str, total: int) -> Iterator[Any]:
    if not show:
        yield lambda n: None
        return
    with Progress(transient=True) as progress:
        task = progress.add_task(label, total=total)
        yield lambda n: progress.advance(task, n)


def _put_samples(store: Store, samples: int, size: int, advance: Any) -> float:
    """Put samples 0..samples-1, made a batch at a time (the dataset may not fit in memory);
    returns the seconds spent in the store."""
    spent = 0.0
    for lo in range(0, samples, BATCH):
        keys = range(lo, min(lo + BATCH, samples))
        batch = [sample_value(key, size) for key in keys]
        t0 = time.perf_counter()
        store.put_many(keys, batch)
        spent += time.perf_counter() - t0
        advance(len(batch))
    t0 = time.perf_counter()
    store.flush()
    return spent + time.perf_counter() - t0


def crash_writer(root: str, first_key: int, size: int, progress_file: str,
                 batches: int) -> None:
    """Child of the demo: put ``batches`` batches, recording each as it is flushed, then half
    a batch it does not flush (into an open segment), and wait to be killed. Why stop: a
    writer that went on while the demo chose its moment wrote past what the cache holds, and
    the first batches it flushed were evicted, reported as lost (5 runs in 12)."""
    store = Store.open(root)
    key = first_key
    with open(progress_file, "w") as marks:
        for _ in range(batches):
            store.put_many(range(key, key + BATCH),
                           [sample_value(k, size) for k in range(key, key + BATCH)])
            key += BATCH
            store.flush()
            marks.write(f"{key}\n")  # every key below this one is durable
            marks.flush()
            os.fsync(marks.fileno())
        half = BATCH // 2
        store.put_many(range(key, key + half),
                       [sample_value(k, size) for k in range(key, key + half)])
        marks.write(f"{key}+\n")  # the unflushed half is in: kill me now
        marks.flush()
        time.sleep(3600)


def _start_crash_writer(root: str, first_key: int, size: int, marks: str,
                        batches: int) -> subprocess.Popen[bytes]:
    args = f"{root!r}, {first_key}, {size}, {marks!r}, {batches}"
    code = f"from lcache.store_demo import crash_writer; crash_writer({args})"
    return subprocess.Popen([sys.executable, "-c", code])


def _flushed_up_to(marks: str) -> tuple[int, bool]:
    """(the key below which the writer flushed everything, whether it waits to be killed)."""
    try:
        with open(marks) as f:
            lines = f.read().split()
    except FileNotFoundError:
        return 0, False
    return (int(lines[-1].rstrip("+")), lines[-1].endswith("+")) if lines else (0, False)


def _kill_mid_write(root: str, first_key: int, size: int, batches: int, marks: str) -> int:
    """Run a writer until it flushed ``batches`` batches, kill -9 it; returns keys flushed.
    The writer records its progress in the file ``marks``."""
    child = _start_crash_writer(root, first_key, size, marks, batches)
    try:
        deadline = time.monotonic() + 120
        while not _flushed_up_to(marks)[1]:
            if child.poll() is not None:
                raise RuntimeError(f"the demo's writer process exited with {child.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("the demo's writer process made no progress in 120 s")
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)  # its unflushed half batch is in an open segment
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return _flushed_up_to(marks)[0]


def _read_all(store: Store, keys: list[int], size: int, advance: Any
              ) -> tuple[int, int, float]:
    """(hits, wrong, seconds spent in the store) over ``keys`` in the given order, checking
    every byte."""
    hits = wrong = 0
    spent = 0.0
    for lo in range(0, len(keys), BATCH):
        batch = keys[lo : lo + BATCH]
        t0 = time.perf_counter()
        views = store.get_many(batch)
        spent += time.perf_counter() - t0
        for key, view in zip(batch, views, strict=True):
            if view is not None:
                hits += 1
                wrong += view != sample_value(key, size)
        advance(len(batch))
    return hits, wrong, spent


def run_store_demo(directory: str | None, samples: int, sample_size: str | int,
                   show_progress: bool = True) -> dict[str, Any]:
    """Run the demo; returns its figures (MB = 1e6 bytes)."""
    size = parse_size(sample_size)
    if not 16 <= size <= SEGMENT_SIZE // 4:
        raise ConfigError(f"--sample-size {sample_size}: the demo writes samples of 16 B to "
                          f"{SEGMENT_SIZE // 4 >> 20} MiB (a quarter of its segments)")
    dataset = samples * size
    capacity = int(dataset * 0.75)
    capacity = max(capacity, StoreConfig(capacity=capacity, segment_size=SEGMENT_SIZE,
                                         max_writers=MAX_WRITERS).minimum_capacity())
    # a store an earlier run left in --dir is reused: its space counts as free
    need_space(directory or tempfile.gettempdir(), capacity,
               f"--samples {samples} x --sample-size {format_size(size)}, a "
               f"{format_size(dataset)} dataset: the demo's store (3/4 of it)",
               "--samples or --sample-size (or choose another --dir)",
               reusable=bytes_under(os.path.join(directory, "store")) if directory else 0)
    with tempfile.TemporaryDirectory(prefix="lcache-demo-") as tmp:
        root = os.path.join(directory or tmp, "store")
        os.makedirs(os.path.dirname(root), exist_ok=True)
        store = Store.open(root, capacity=capacity, segment_size=SEGMENT_SIZE,
                           max_writers=MAX_WRITERS)
        with _progress(show_progress, "put", samples) as advance:
            put_s = _put_samples(store, samples, size, advance)

        store.drop_page_cache()
        order = list(range(samples))
        random.shuffle(order)
        with _progress(show_progress, "get (random order)", samples) as advance:
            hits, wrong, get_s = _read_all(store, order, size, advance)
        stats = store.stats()
        store.close()

        # Records the crashed writer flushed must all survive, so it writes no more than the
        # cache is sure to hold: capacity less the active and compaction-reserve segments,
        # less the half batch it is killed in.
        sure = capacity - SEGMENT_SIZE * (MAX_WRITERS + 1)
        batches = max(1, min(4, sure // (BATCH * size) - 1))
        # the writer's progress file goes in the private temporary folder, removed at the
        # end, even when the store is in the caller's --dir
        flushed_to = _kill_mid_write(root, samples, size, batches,
                                     os.path.join(tmp, "crash-writer.marks"))
        t0 = time.perf_counter()
        store = Store.open(root)
        recovery_s = time.perf_counter() - t0
        recovered = store.counters.recovered_segments
        flushed = list(range(samples, flushed_to))
        found, wrong_after, _ = _read_all(store, flushed, size, lambda n: None)
        store.close()
        report = fsck(root)
        return {
            "sample_bytes": size,
            "samples": samples,
            "dataset_bytes": dataset,
            "capacity_bytes": capacity,
            "put_MBps": round(samples * size / put_s / 1e6, 1),
            "get_MBps_random_cold": round(hits * size / get_s / 1e6, 1),
            "hit_ratio": round(hits / samples, 3),
            "wrong_bytes_served": wrong + wrong_after,
            "evictions": stats["evictions"],
            "gc_bytes_copied": stats["gc_bytes_copied"],
            "crash_flushed_records": len(flushed),
            "crash_flushed_records_lost": len(flushed) - found,
            "crash_segments_recovered": recovered,
            "reopen_after_crash_s": round(recovery_s, 4),
            "fsck_clean": report.clean,
        }
