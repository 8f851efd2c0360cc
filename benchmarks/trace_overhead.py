"""What tracing costs: in-library events, /proc sampling and strace, side by side in one run.

Two workloads, each timed inside a fresh process (setup excluded) under four modes:
  base      no tracing
  inlib     LCACHE_TRACE=path (lcache's own events)
  sampling  lcache trace --no-lib-events (only /proc sampling, every --interval seconds)
  syscalls  lcache trace --syscalls --no-lib-events (strace -f on every file I/O call)
Workloads: ``samples`` reads 4 KiB samples in random order through ``lcache.data``'s
``CachedDataset`` (the sample-cache read loop of a training job, cache warm), ``store`` reads
4 KiB records from an lcache ``Store`` one ``get`` at a time (the bare store read path: the
CPU-bound worst case for per-event costs, records in the page cache), ``plain`` reads 4 KiB at
random offsets of one file with ``os.pread`` (no lcache: in-library tracing has nothing to
record there, and the loop is ~1 us per read, the worst case for strace). Modes are
interleaved and repeated; overheads are median(mode) / median(base) - 1.

    python benchmarks/trace_overhead.py --json
    python benchmarks/trace_overhead.py --reps 7 --reads 50000 --dir /var/tmp/trace-bench
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("base", "inlib", "sampling", "syscalls")
KINDS = ("samples", "store", "plain")
RECORD = 4096


def _workload(kind: str, directory: str, reads: int, seed: int) -> None:
    """Runs in the child: the timed loop; prints {"seconds": wall, "cpu": CPU of all threads}."""
    rng = random.Random(seed)
    if kind == "samples":
        from lcache.data import CachedDataset

        n = int(Path(directory, "records").read_text())
        ds = CachedDataset(os.path.join(directory, "source"), os.path.join(directory, "cache"),
                           n * RECORD * 4)
        keys = [rng.randrange(n) for _ in range(reads)]
        for k in range(n):  # warm (a no-op after the first run: the cache persists)
            ds[k]
        t0, c0 = time.perf_counter(), time.process_time()
        for k in keys:
            ds[k]
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = ds.stats()
        if stats.get("fetches", 0) > n:
            raise SystemExit(f"the sample cache missed during the timed loop: {stats}")
    elif kind == "store":
        from lcache.store import Store

        store = Store.open(os.path.join(directory, "store"), create=False)
        n = int(Path(directory, "records").read_text())
        keys = [rng.randrange(n) for _ in range(reads)]
        t0, c0 = time.perf_counter(), time.process_time()
        for k in keys:
            if store.get(k) is None:
                raise SystemExit(f"record {k} missing from the benchmark store")
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        store.close()
    else:
        path = os.path.join(directory, "plain.bin")
        blocks = os.path.getsize(path) // RECORD
        offsets = [rng.randrange(blocks) * RECORD for _ in range(reads)]
        fd = os.open(path, os.O_RDONLY)
        t0, c0 = time.perf_counter(), time.process_time()
        for off in offsets:
            os.pread(fd, RECORD, off)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        os.close(fd)
    print(json.dumps({"seconds": seconds, "cpu": cpu}))


def _prepare(directory: str, records: int) -> None:
    from lcache.store import Store

    os.makedirs(directory, exist_ok=True)
    store = Store.open(os.path.join(directory, "store"), capacity=max(records * 2 * RECORD,
                                                                       1 << 30))
    value = os.urandom(RECORD)
    for start in range(0, records, 1000):
        keys = list(range(start, min(start + 1000, records)))
        store.put_many(keys, [value] * len(keys))
    store.close()
    Path(directory, "records").write_text(str(records))
    source = os.path.join(directory, "source")
    os.makedirs(source)
    for i in range(records):
        with open(os.path.join(source, f"{i:07d}.bin"), "wb") as f:
            f.write(value)
    with open(os.path.join(directory, "plain.bin"), "wb") as f:
        f.write(os.urandom(records * RECORD))


def _run(mode: str, kind: str, directory: str, reads: int, seed: int,
         interval: float) -> tuple[float, float]:
    me = [sys.executable, os.path.abspath(__file__), "--workload", kind, "--dir", directory,
          "--reads", str(reads), "--seed", str(seed)]
    env = {k: v for k, v in os.environ.items() if k != "LCACHE_TRACE"}
    trace = os.path.join(directory, f"{mode}-{kind}.trace")
    if os.path.exists(trace):
        os.unlink(trace)
    lcache = [sys.executable, "-m", "lcache", "trace", "-o", trace, "--interval", str(interval),
              "--no-lib-events"]
    if mode == "inlib":
        env["LCACHE_TRACE"] = trace
        cmd = me
    elif mode == "sampling":
        cmd = [*lcache, "--", *me]
    elif mode == "syscalls":
        cmd = [*lcache, "--syscalls", "--", *me]
    else:
        cmd = me
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{mode}/{kind} failed ({out.returncode}): {out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return float(got["seconds"]), float(got["cpu"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/var/tmp/lcache-trace-bench")
    p.add_argument("--records", type=int, default=20000, help="4 KiB records in the store")
    p.add_argument("--reads", type=int, default=100000, help="reads per timed run")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--interval", type=float, default=0.2, help="lcache trace --interval")
    p.add_argument("--json", action="store_true")
    p.add_argument("--workload", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.workload:
        _workload(args.workload, args.dir, args.reads, args.seed)
        return
    if shutil.which("strace") is None:
        raise SystemExit("strace is needed for the syscall mode: apt-get install strace")
    if os.path.exists(args.dir):
        shutil.rmtree(args.dir)
    _prepare(args.dir, args.records)
    times: dict[str, dict[str, list[float]]] = {k: {m: [] for m in MODES} for k in KINDS}
    cpus: dict[str, dict[str, list[float]]] = {k: {m: [] for m in MODES} for k in KINDS}
    for rep in range(args.reps):
        for kind in KINDS:
            modes = list(MODES)
            random.Random(rep).shuffle(modes)  # interleaved, in a different order each time
            for mode in modes:
                wall, cpu = _run(mode, kind, args.dir, args.reads, rep, args.interval)
                times[kind][mode].append(wall)
                cpus[kind][mode].append(cpu)
    result: dict[str, Any] = {"workloads": {}}
    for kind, by_mode in times.items():
        med = {m: statistics.median(v) for m, v in by_mode.items()}
        cpu_med = {m: statistics.median(v) for m, v in cpus[kind].items()}
        result["workloads"][kind] = {
            # CPU time of the traced process (all its threads, flush included) is far less
            # sensitive to other jobs on a shared machine; it leaves out strace and the sampler.
            "cpu_median_s": {m: round(v, 4) for m, v in cpu_med.items()},
            "cpu_overhead": {m: round(cpu_med[m] / cpu_med["base"] - 1, 4) for m in MODES[1:]},
            "median_s": {m: round(v, 4) for m, v in med.items()},
            "raw_s": {m: [round(x, 4) for x in v] for m, v in by_mode.items()},
            "overhead": {m: round(med[m] / med["base"] - 1, 4) for m in MODES[1:]},
            "us_per_read_base": round(med["base"] / args.reads * 1e6, 2),
        }
    w = result["workloads"]
    # Headline figures: the sample-cache read loop for in-library events (the store loop's is
    # in "workloads"), the worst of the workloads for sampling and strace.
    result.update({
        "inlib_overhead": w["samples"]["overhead"]["inlib"],
        "inlib_overhead_cpu": w["samples"]["cpu_overhead"]["inlib"],
        "inlib_overhead_store": w["store"]["overhead"]["inlib"],
        "sampling_overhead": max(w[k]["overhead"]["sampling"] for k in KINDS),
        "syscall_overhead": max(w[k]["overhead"]["syscalls"] for k in KINDS),
        "config": {"records": args.records, "reads": args.reads, "reps": args.reps,
                   "record_bytes": RECORD, "interval_s": args.interval,
                   "cpus": os.cpu_count(), "note": "medians; modes interleaved; shared machine"},
    })
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for kind, r in w.items():
        print(f"{kind:6s} base {r['median_s']['base']:.3f} s ({r['us_per_read_base']} us/read); "
              + ", ".join(f"{m} {o:+.1%}" for m, o in r["overhead"].items()))
    print(f"inlib_overhead {result['inlib_overhead']:+.1%}, sampling_overhead "
          f"{result['sampling_overhead']:+.1%}, syscall_overhead {result['syscall_overhead']:+.1%}")


if __name__ == "__main__":
    main()
