"""What tracing costs: in-library events, /proc sampling and strace, side by side in one run.

Two workloads, each timed inside a fresh process (setup excluded) under four modes:
  base      no tracing
  inlib     LCACHE_TRACE=path (lcache's own events)
  sampling  lcache trace --no-lib-events (only /proc sampling, every --interval seconds)
  syscalls  lcache trace --syscalls --no-lib-events (strace -f on every file I/O call)
Workloads: ``store`` reads 4 KiB records from an lcache Store one ``get`` at a time in random
order (the sample-cache read path; records sit in the page cache, so this is the CPU-bound
worst case for per-event costs), ``plain`` reads 4 KiB at random offsets of one file with
``os.pread`` (no lcache: in-library tracing has nothing to record there). Modes are
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
RECORD = 4096


def _workload(kind: str, directory: str, reads: int, seed: int) -> None:
    """Runs in the child: the timed loop; prints {"seconds": ...}."""
    rng = random.Random(seed)
    if kind == "store":
        from lcache.store import Store

        store = Store.open(os.path.join(directory, "store"), create=False)
        n = int(Path(directory, "records").read_text())
        keys = [rng.randrange(n) for _ in range(reads)]
        t0 = time.perf_counter()
        for k in keys:
            if store.get(k) is None:
                raise SystemExit(f"record {k} missing from the benchmark store")
        seconds = time.perf_counter() - t0
        store.close()
    else:
        path = os.path.join(directory, "plain.bin")
        blocks = os.path.getsize(path) // RECORD
        offsets = [rng.randrange(blocks) * RECORD for _ in range(reads)]
        fd = os.open(path, os.O_RDONLY)
        t0 = time.perf_counter()
        for off in offsets:
            os.pread(fd, RECORD, off)
        seconds = time.perf_counter() - t0
        os.close(fd)
    print(json.dumps({"seconds": seconds}))


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
    with open(os.path.join(directory, "plain.bin"), "wb") as f:
        f.write(os.urandom(records * RECORD))


def _run(mode: str, kind: str, directory: str, reads: int, seed: int, interval: float) -> float:
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
    return float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/var/tmp/lcache-trace-bench")
    p.add_argument("--records", type=int, default=20000, help="4 KiB records in the store")
    p.add_argument("--reads", type=int, default=30000, help="reads per timed run")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--interval", type=float, default=0.2, help="lcache trace --interval")
    p.add_argument("--json", action="store_true")
    p.add_argument("--workload", choices=("store", "plain"), help=argparse.SUPPRESS)
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
    times: dict[str, dict[str, list[float]]] = {k: {m: [] for m in MODES}
                                                for k in ("store", "plain")}
    for rep in range(args.reps):
        for kind in ("store", "plain"):
            modes = list(MODES)
            random.Random(rep).shuffle(modes)  # interleaved, in a different order each time
            for mode in modes:
                times[kind][mode].append(_run(mode, kind, args.dir, args.reads, rep,
                                              args.interval))
    result: dict[str, Any] = {"workloads": {}}
    for kind, by_mode in times.items():
        med = {m: statistics.median(v) for m, v in by_mode.items()}
        result["workloads"][kind] = {
            "median_s": {m: round(v, 4) for m, v in med.items()},
            "raw_s": {m: [round(x, 4) for x in v] for m, v in by_mode.items()},
            "overhead": {m: round(med[m] / med["base"] - 1, 4) for m in MODES[1:]},
            "us_per_read_base": round(med["base"] / args.reads * 1e6, 2),
        }
    w = result["workloads"]
    result.update({
        "inlib_overhead": w["store"]["overhead"]["inlib"],
        "sampling_overhead": max(w["store"]["overhead"]["sampling"],
                                 w["plain"]["overhead"]["sampling"]),
        "syscall_overhead": max(w["store"]["overhead"]["syscalls"],
                                w["plain"]["overhead"]["syscalls"]),
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
