"""Benchmark the lcache segment store against the device (fio) and one file per sample.

For each sample size it measures, in one run on one directory:
  put/get throughput of the store, fio's sequential-write and random-read limits, the naive
  file-per-sample cache, write amplification under capacity churn, index bytes per sample, and
  reopen time after a clean close and after ``kill -9``.

    python benchmarks/store_bench.py --dir /mnt/nvme/bench --json
    python benchmarks/store_bench.py --dir /tmp/bench --sizes 4KiB,1MiB --total-bytes 256MiB

Run as root for honest cold reads: the page cache is then dropped before every read phase.
Prints one JSON object per sample size with ``--json``, else a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _sysbench as sb
import numpy as np
from rich.console import Console
from rich.table import Table

from lcache.store import Store, parse_size
from lcache.store.layout import StoreConfig

SEGMENT_BYTES = 64 * 1024**2
MAX_WRITERS = 8
# The store's floor: a segment per writer + 1, and its indexes.
MIN_CAPACITY = StoreConfig(capacity=SEGMENT_BYTES * (MAX_WRITERS + 1), segment_size=SEGMENT_BYTES,
                           max_writers=MAX_WRITERS).minimum_capacity()
PUT_BATCH_BYTES = 64 * 1024**2
GET_BATCH_KEYS = 256
GET_BATCH_BYTES = 32 * 1024**2
CRASH_SAMPLES = 300
SUBPROCESS_TIMEOUT_S = 300
MEDIAN_KEYS = ("fio_seqwrite_MBps", "fio_randread_MBps", "put_MBps", "get_MBps",
               "get_direct_MBps")

log = Console(stderr=True)


@dataclass(frozen=True, slots=True)
class Options:
    """The command line, parsed."""

    directory: Path
    sizes: list[int]
    total_bytes: int
    concurrency: int
    fio_runtime_s: int
    repeat: int
    seed: int
    as_json: bool


@dataclass(frozen=True, slots=True)
class Dataset:
    """``samples`` random samples of ``sample_bytes`` as zero-copy views into one buffer."""

    sample_bytes: int
    values: list[memoryview]

    @classmethod
    def make(cls, sample_bytes: int, total_bytes: int, seed: int) -> Dataset:
        n = max(1, total_bytes // sample_bytes)
        # random bytes so that a record served from the wrong offset cannot pass verification
        buf = memoryview(np.random.default_rng(seed).bytes(n * sample_bytes))
        return cls(sample_bytes, [buf[i * sample_bytes : (i + 1) * sample_bytes] for i in range(n)])

    @property
    def samples(self) -> int:
        return len(self.values)

    @property
    def nbytes(self) -> int:
        return self.samples * self.sample_bytes


def store_kwargs(capacity: int) -> dict[str, Any]:
    return {
        "capacity": capacity,
        "segment_size": SEGMENT_BYTES,
        "max_writers": MAX_WRITERS,
        "policy": "fifo",
        "sync": "flush",
    }


def batches(n: int, size: int) -> Iterator[slice]:
    size = max(1, size)
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700, parents=True)
    return path


# --- store phases ---------------------------------------------------------------------------


def bench_put(path: Path, data: Dataset, kwargs: dict[str, Any]) -> dict[str, Any]:
    """put_many in 64 MiB calls (the store pipelines its 16 MiB write batches within a call)
    into a fresh store, then flush: payload MB/s."""
    keys = list(range(data.samples))
    with Store.open(str(path), **kwargs) as store:
        t0 = time.perf_counter()
        for part in batches(data.samples, PUT_BATCH_BYTES // data.sample_bytes):
            store.put_many(keys[part], data.values[part])
        store.flush()
        elapsed = time.perf_counter() - t0
        stats = store.stats()
    index_bytes = stats.get("index_bytes")
    return {
        "put_MBps": sb.mbps(data.nbytes, elapsed),
        "put_s": elapsed,
        # 16 B/sample (segment, offset, length) is the design's assumption until stats say more
        "index_bytes_per_sample": (index_bytes if index_bytes is not None else 16 * data.samples)
        / data.samples,
        "index_bytes_source": "stats" if index_bytes is not None else "assumed_16",
        "put_evictions": stats.get("evictions"),
        "store_bytes_on_disk": stats.get("bytes_on_disk"),
        "segments": stats.get("segments"),
    }


def timed_open(path: Path, kwargs: dict[str, Any]) -> tuple[Store, float]:
    sb.drop_page_cache()  # a reopen after reboot finds nothing cached
    t0 = time.perf_counter()
    store = Store.open(str(path), **kwargs)
    return store, time.perf_counter() - t0


def bench_get(store: Store, data: Dataset, concurrency: int, seed: int) -> dict[str, Any]:
    """Read every sample once in random order with get_many, from a cold page cache."""
    order = np.random.default_rng(seed).permutation(data.samples).tolist()
    per_batch = min(GET_BATCH_KEYS, GET_BATCH_BYTES // data.sample_bytes)
    method = sb.drop_page_cache(store.drop_page_cache)
    misses = wrong = nbytes = 0
    t0 = time.perf_counter()
    for i, part in enumerate(batches(data.samples, per_batch)):
        keys = order[part]
        results = store.get_many(keys)
        for value in results:
            if value is None:
                misses += 1
            else:
                nbytes += len(value)
        # spot-check one record per 64 batches: cheap, and wrong bytes anywhere would show
        if i % 64 == 0 and results[0] is not None and results[0] != data.values[keys[0]]:
            wrong += 1
    elapsed = time.perf_counter() - t0
    if wrong:
        raise RuntimeError(f"get_many returned wrong bytes in {wrong} spot checks")
    return {
        "get_MBps": sb.mbps(nbytes, elapsed),
        "get_s": elapsed,
        "get_concurrency": concurrency,
        "get_misses": misses,
        "get_cache_drop": method,
    }


_CRASH_CHILD = """
import json, os, signal, sys
from lcache.store import Store, parse_size
from lcache.store.layout import StoreConfig
path, size, n, kwargs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
store = Store.open(path, **kwargs)
store.put_many(list(range(n)), [bytes([k % 251]) * size for k in range(n)])
store.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def bench_crash_reopen(path: Path, data: Dataset, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A child puts, flushes and kills itself with SIGKILL; time the reopen and check contents."""
    n = min(CRASH_SAMPLES, data.samples)
    argv = [sys.executable, "-c", _CRASH_CHILD, str(path), str(data.sample_bytes), str(n)]
    child = subprocess.run(
        [*argv, json.dumps(kwargs)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=False,
    )
    if child.returncode != -signal.SIGKILL:
        raise RuntimeError(f"crash child exited {child.returncode}: {child.stderr[-1000:]}")
    store, elapsed = timed_open(path, kwargs)
    with store:
        flushed_ok = all(
            store.get(k) == bytes([k % 251]) * data.sample_bytes for k in range(0, n, 7)
        )
        last = data.samples - 1  # a record the child never touched must survive as it was
        untouched_ok = last < n or store.get(last) == bytes(data.values[last])
    return {
        "reopen_after_crash_s": elapsed,
        "crash_check": "ok" if flushed_ok and untouched_ok else "wrong or missing records",
    }


def bench_store(path: Path, data: Dataset, opts: Options) -> dict[str, Any]:
    """put -> close -> timed reopen -> cold random get (buffered, then O_DIRECT) -> crash ->
    timed reopen."""
    kwargs = store_kwargs(capacity=max(2 * data.nbytes, MIN_CAPACITY))
    out = bench_put(fresh_dir(path), data, kwargs)
    read_kwargs = {**kwargs, "queue_depth": opts.concurrency}
    store, reopen_s = timed_open(path, read_kwargs)
    with store:
        out.update(bench_get(store, data, opts.concurrency, opts.seed))
    with Store.open(str(path), **read_kwargs, direct_io=True) as store:
        direct = bench_get(store, data, opts.concurrency, opts.seed + 1)
    out["get_direct_MBps"] = direct["get_MBps"]
    out["reopen_s"] = reopen_s
    out.update(bench_crash_reopen(path, data, kwargs))
    shutil.rmtree(path)
    return out


def bench_reopen_million(path: Path) -> dict[str, Any]:
    """Reopen time of a store holding a million records, after a clean close and after a
    writer was killed with half a segment unsealed (measured, not scaled from a smaller run)."""
    n, size = 1_000_000, 64
    kwargs = store_kwargs(capacity=MIN_CAPACITY)
    value = bytes(size)
    with Store.open(str(fresh_dir(path)), **kwargs) as store:
        for part in batches(n, 65536):
            store.put_many(range(part.start, part.stop), [value] * (part.stop - part.start))
    _, clean_s = timed_open(path, kwargs)
    child = subprocess.run(
        [sys.executable, "-c", _CRASH_CHILD, str(path), str(size), str(200_000),
         json.dumps(kwargs)],
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False,
    )
    if child.returncode != -signal.SIGKILL:
        raise RuntimeError(f"crash child exited {child.returncode}: {child.stderr[-1000:]}")
    store, crash_s = timed_open(path, kwargs)
    with store:
        recovered = store.counters.recovered_segments
        live = store.stats()["live_keys"]
    shutil.rmtree(path)
    return {
        "reopen_s_per_million": clean_s,
        "reopen_after_crash_s_per_million": crash_s,
        "reopen_million_recovered_segments": recovered,
        "reopen_million_live_keys": live,
    }


def bench_churn(path: Path, data: Dataset, device: str | None) -> dict[str, Any]:
    """Fill a store to capacity, then admit 2x capacity more; device bytes / payload bytes.

    Keys cycle through the dataset; with capacity below the dataset size every key has been
    evicted (FIFO) before it comes round again, so each put is a fresh admission.
    """
    capacity = max(data.nbytes // 2, MIN_CAPACITY)
    if data.nbytes <= capacity:
        log.log("churn: dataset fits in the capacity, so puts overwrite live keys")
    keys = list(range(data.samples))
    # one cursor over both phases: the churn goes on where the fill stopped
    parts = itertools.cycle(list(batches(data.samples, PUT_BATCH_BYTES // data.sample_bytes)))

    def admit(store: Store, nbytes: int) -> int:
        done = 0
        while done < nbytes:
            part = next(parts)
            store.put_many(keys[part], data.values[part])
            done += (part.stop - part.start) * data.sample_bytes
        return done

    with Store.open(str(fresh_dir(path)), **store_kwargs(capacity)) as store:
        admit(store, capacity)
        store.flush()
        before_stats = store.stats()
        start = sb.WriteCounters.take(device)
        t0 = time.perf_counter()
        payload = admit(store, 2 * capacity)
        store.flush()
        elapsed = time.perf_counter() - t0
        written = sb.WriteCounters.take(device).since(start)
        after_stats = store.stats()
    shutil.rmtree(path)

    live = after_stats.get("live_keys")

    def delta(key: str) -> int | None:
        if key not in after_stats or key not in before_stats:
            return None
        return int(after_stats[key]) - int(before_stats[key])

    return {
        "write_amplification": ratio(written.device_bytes, payload),
        "write_amplification_process": written.process_bytes / payload,
        "churn_payload_bytes": payload,
        "churn_device_bytes": written.device_bytes,
        "churn_process_write_bytes": written.process_bytes,
        "churn_store_bytes_written": delta("bytes_written"),
        "churn_gc_bytes_copied": delta("gc_bytes_copied"),
        "churn_evictions": delta("evictions"),
        "churn_capacity_bytes": capacity,
        "churn_bytes_on_disk": after_stats.get("bytes_on_disk"),
        # how much of the capacity still holds servable samples once the store is full
        "churn_live_fraction": ratio(live * data.sample_bytes, capacity) if live else None,
        "churn_put_MBps": sb.mbps(payload, elapsed),
        "churn_device": device,
    }


# --- baselines ------------------------------------------------------------------------------


def bench_fio(directory: Path, data: Dataset, opts: Options) -> dict[str, Any]:
    try:
        write, read = sb.fio_pair(
            str(directory), data.nbytes, data.sample_bytes, opts.concurrency, opts.fio_runtime_s
        )
    except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
        raise SystemExit(f"store_bench: fio failed: {exc}") from exc
    return {"fio_seqwrite_MBps": write, "fio_randread_MBps": read}


def bench_files(path: Path, data: Dataset, opts: Options) -> dict[str, Any]:
    root = fresh_dir(path)
    put_s = sb.files_put(root, data.values)
    get_s, nbytes = sb.files_get(root, data.values, opts.concurrency, opts.seed)
    shutil.rmtree(root)
    return {
        "files_put_MBps": sb.mbps(data.nbytes, put_s),
        "files_get_MBps": sb.mbps(nbytes, get_s),
    }


# --- driver ---------------------------------------------------------------------------------


def run_size(sample_bytes: int, opts: Options, device: str | None) -> dict[str, Any]:
    data = Dataset.make(sample_bytes, opts.total_bytes, opts.seed)
    label = sb.format_size(sample_bytes)
    row: dict[str, Any] = {"sample_bytes": sample_bytes, "samples": data.samples}
    # This class of VM swings 2x between minutes (the host caches the disk), so fio and the
    # store alternate `repeat` times and the row keeps each figure's median, with its spread.
    repeated: list[dict[str, Any]] = []
    for rep in range(opts.repeat):
        for name, phase in (
            ("fio", lambda: bench_fio(opts.directory, data, opts)),
            ("store", lambda: bench_store(opts.directory / f"store-{label}", data, opts)),
        ):
            t0 = time.perf_counter()
            if name == "fio":
                repeated.append({})
            repeated[-1].update(phase())
            log.log(f"{label}: {name} #{rep + 1} done in {time.perf_counter() - t0:.1f} s")
    row.update(repeated[-1])
    for key in MEDIAN_KEYS:
        values = sorted(r[key] for r in repeated if r.get(key) is not None)
        if values:
            row[key] = values[len(values) // 2]
            row[f"{key}_range"] = [values[0], values[-1]]
    for name, phase in (
        ("churn", lambda: bench_churn(opts.directory / f"churn-{label}", data, device)),
        ("files", lambda: bench_files(opts.directory / f"files-{label}", data, opts)),
    ):
        t0 = time.perf_counter()
        row.update(phase())
        log.log(f"{label}: {name} done in {time.perf_counter() - t0:.1f} s")
    row.update(
        # other work on a shared machine skews every figure; keep the evidence with them
        load_1m=os.getloadavg()[0],
        get_vs_fio=ratio(row["get_MBps"], row["fio_randread_MBps"]),
        get_direct_vs_fio=ratio(row["get_direct_MBps"], row["fio_randread_MBps"]),
        put_vs_fio=ratio(row["put_MBps"], row["fio_seqwrite_MBps"]),
        put_vs_files=ratio(row["put_MBps"], row["files_put_MBps"]),
        get_vs_files=ratio(row["get_MBps"], row["files_get_MBps"]),
    )
    return row


def _fmt(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    table = Table(title="lcache store vs device (fio) vs file per sample; MB/s = 1e6 B/s")
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("sample", lambda r: sb.format_size(r["sample_bytes"])),
        ("samples", lambda r: _fmt(r["samples"])),
        ("put", lambda r: _fmt(r["put_MBps"])),
        ("fio seq write", lambda r: _fmt(r["fio_seqwrite_MBps"])),
        ("files put", lambda r: _fmt(r["files_put_MBps"])),
        (f"get QD{rows[0]['get_concurrency']}", lambda r: _fmt(r["get_MBps"])),
        ("fio rand read", lambda r: _fmt(r["fio_randread_MBps"])),
        ("files get", lambda r: _fmt(r["files_get_MBps"])),
        ("get/fio", lambda r: _fmt(r["get_vs_fio"], 2)),
        ("WA", lambda r: _fmt(r["write_amplification"], 2)),
        ("index B/sample", lambda r: _fmt(r["index_bytes_per_sample"], 1)),
        ("reopen s/M", lambda r: _fmt(r["reopen_s_per_million"], 2)),
        ("crash reopen s", lambda r: _fmt(r["reopen_after_crash_s"], 2)),
    ]
    for name, _ in columns:
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(*(cell(row) for _, cell in columns))
    # piped output would otherwise wrap at 80 columns and truncate every header
    Console(width=max(shutil.get_terminal_size().columns, 150)).print(table)


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="directory on the disk to test")
    parser.add_argument("--sizes", default="4KiB,64KiB,1MiB",
                        help="sample sizes, comma separated (KiB/MiB binary, KB/MB decimal)")
    parser.add_argument("--total-bytes", default="1GiB", help="bytes of samples per size")
    parser.add_argument("--concurrency", type=int, default=16, help="queue depth for reads")
    parser.add_argument("--fio-runtime", type=int, default=10, help="seconds of fio randread")
    parser.add_argument("--repeat", type=int, default=3,
                        help="alternate fio and the store this many times; report medians")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object per size")
    args = parser.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
        total_bytes = parse_size(args.total_bytes)
    except ValueError as exc:
        parser.error(str(exc))
    if args.concurrency < 1 or min(sizes) < 1 or args.repeat < 1:
        parser.error("--concurrency, --repeat and every --sizes entry must be at least 1")
    return Options(
        args.dir, sizes, total_bytes, args.concurrency, args.fio_runtime, args.repeat, args.seed,
        args.json,
    )


def main(argv: Sequence[str] | None = None) -> None:
    opts = parse_args(argv)
    sb.ensure_fio("store_bench")
    opts.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    device = sb.block_device_of(str(opts.directory))
    if os.geteuid() != 0:
        log.log("not root: page cache dropped per file only (store.drop_page_cache / fadvise)")
    # reopen cost depends on the record count, not the sample size: measure it once, at 1M
    million = bench_reopen_million(opts.directory / "reopen-1M")
    log.log(f"reopen with 1M records: {million}")
    rows = []
    for size in opts.sizes:
        row = {**run_size(size, opts, device), **million}
        rows.append(row)
        if opts.as_json:
            print(json.dumps(row), flush=True)
    if not opts.as_json:
        print_table(rows)


if __name__ == "__main__":
    main()
