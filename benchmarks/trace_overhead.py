"""What tracing costs: in-library events, /proc sampling and strace, side by side in one run.

Three read loops (workloads):
  samples  4 KiB samples in random order through lcache.data's CachedDataset (the sample-cache
           read loop of a training job, cache warm, records in the page cache)
  store    4 KiB records from an lcache Store, one get at a time (the bare store read path)
  plain    4 KiB os.pread at random offsets of one file (no lcache; ~1 us per read, the worst
           case for strace)
In-library events (LCACHE_TRACE / lcache.trace.enable) are measured inside one process that
alternates untraced and traced blocks of the same loop in a shuffled order (loop and flush
timed): on a shared, noisy machine only that resolves a few percent. That is tracing left on,
as the recorder is meant to be: one recorder for the run, its hook installed for the traced
blocks. The fixed cost of enable plus disable (a file created, the files named, the final
write) is given apart (enable_disable_ms): an enable and disable around each 70 ms block read
as 2-4% on this VM. /proc sampling is measured the same way: one process runs blocks of the
loop (--reads reads, about a second each), and the benchmark runs the sampler that lcache trace
runs (ProcSampler, same --interval) on it during the sampled blocks; whole processes run again
differed by up to 19% here, untraced. strace (lcache trace --syscalls) wraps whole processes,
so it is measured as process-level runs, interleaved with untraced runs and repeated. Overheads
are median(traced) / median(untraced) - 1; sampling_cpu_fraction is the CPU the sampler itself
used, as a fraction of the sampled blocks' time. The in-library and sampling blocks include a
control mode, the untraced loop again, interleaved like the rest: its "overhead"
(inlib_control, sampling_control) is what the harness reads where nothing differs, the noise
floor below which a traced figure means nothing.

    python benchmarks/trace_overhead.py --json
    python benchmarks/trace_overhead.py --reps 7 --blocks 90 --sampled-blocks 20 --dir /var/tmp/tb
    python benchmarks/trace_overhead.py --instructions --json    # valgrind; ~5 min

Wall-clock figures on a shared 2-core VM move by 5-10% between runs of the same code; with
``--instructions`` the samples and store loops instead run under valgrind's callgrind, which
counts the CPU instructions of the traced and untraced loops whatever the machine's load
(in-library events only: sampling and strace act outside the process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KINDS = ("samples", "store", "plain")
BLOCK_MODES = ("base", "inlib", "control")
SAMPLED_MODES = ("base", "sampling", "control")
RECORD = 4096
# --instructions: a smaller store (the samples loop warms every record, 50x slower under
# callgrind) and loops of 2,000 and 20,000 reads
INSTRUCTION_RECORDS = 2000
INSTRUCTION_READS = 2000


def _loop(kind: str, directory: str, reads: int, seed: int) -> Callable[[], None]:
    """Set up a workload in this process; returns its timed loop."""
    rng = random.Random(seed)
    n = int(Path(directory, "records").read_text())
    if kind == "samples":
        from lcache.data import CachedDataset

        ds = CachedDataset(os.path.join(directory, "source"), os.path.join(directory, "cache"),
                           n * RECORD * 4)
        for k in range(n):  # warm (a no-op after the first run: the cache persists)
            ds[k]
        keys = [rng.randrange(n) for _ in range(reads)]

        def run_samples() -> None:
            for k in keys:
                ds[k]
        return run_samples
    if kind == "store":
        from lcache.store import Store

        store = Store.open(os.path.join(directory, "store"), create=False)
        keys = [rng.randrange(n) for _ in range(reads)]

        def run_store() -> None:
            for k in keys:
                if store.get(k) is None:
                    raise SystemExit(f"record {k} missing from the benchmark store")
        return run_store
    path = os.path.join(directory, "plain.bin")
    offsets = [rng.randrange(n) * RECORD for _ in range(reads)]
    fd = os.open(path, os.O_RDONLY)

    def run_plain() -> None:
        for off in offsets:
            os.pread(fd, RECORD, off)
    return run_plain


def _workload(kind: str, directory: str, reads: int, seed: int, blocks: int,
              traced: bool = False) -> None:
    """Runs in the child. Without ``blocks``: time the loop once and print {"seconds", "cpu"}
    (with ``traced``, in-library events on for the loop alone).

    With ``blocks``: alternate untraced and traced blocks of the loop in this one process
    (one recorder enabled for the run, its hook installed for the traced blocks, whose loop
    and ``flush`` are timed), in a shuffled order, and print the block times per mode.
    Alternating within one process is what makes a few percent measurable on a shared, noisy
    machine.
    """
    run = _loop(kind, directory, reads, seed)
    import lcache.trace

    if not blocks:
        t0, c0 = time.perf_counter(), time.process_time()
        if traced:
            lcache.trace.enable(os.path.join(directory, f"traced-{kind}.trace"))
        run()
        if traced:
            lcache.trace.disable()
        print(json.dumps({"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0}))
        return

    trace = os.path.join(directory, f"alternate-{kind}.trace")
    out: dict[str, list[float]] = {m: [] for m in BLOCK_MODES}
    cpu: dict[str, list[float]] = {m: [] for m in BLOCK_MODES}  # the reading thread's CPU
    order = random.Random(seed)
    # Tracing left on: one recorder for the whole run, its hook installed for the traced
    # blocks only. Each block's records are flushed inside its time, so untraced blocks never
    # pay for them; the files are named once, at the first flush, as in a long job.
    from lcache.io import get_tracer, set_tracer

    lcache.trace.enable(trace)
    recorder = get_tracer()
    set_tracer(None)
    for _ in range(blocks):
        modes = list(out)
        order.shuffle(modes)
        for mode in modes:
            if mode == "inlib":
                set_tracer(recorder, binary=True)
            t0, c0 = time.perf_counter(), time.thread_time()
            run()
            if mode == "inlib":
                lcache.trace.flush()  # writing the records is part of what they cost
            out[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.thread_time() - c0)
            if mode == "inlib":
                set_tracer(None)
    set_tracer(recorder, binary=True)
    lcache.trace.disable()
    from lcache.report.load import load

    # A tracer that drops events would look cheap: every traced block's events must be there.
    events = len(load(trace))
    if events < reads * blocks:
        raise SystemExit(f"the traced blocks recorded {events} events for {reads * blocks} "
                         "reads")
    starts = []  # what a job that leaves tracing on pays once: enable and disable
    for _ in range(20):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(trace)
        t0 = time.perf_counter()
        lcache.trace.enable(trace)
        lcache.trace.disable()
        starts.append(time.perf_counter() - t0)
    print(json.dumps({**out, "cpu": cpu, "events_per_read": events / reads / blocks,
                      "enable_disable_s": statistics.median(starts)}))


def _paced(kind: str, directory: str, reads: int, seed: int, blocks: int) -> None:
    """Runs in the child for the sampling figure: blocks of the loop in a shuffled order of
    SAMPLED_MODES; before each it prints the mode and waits for the parent's go (the parent
    starts the /proc sampler on this process for a "sampling" block), after it the seconds."""
    run = _loop(kind, directory, reads, seed)
    order = random.Random(seed)
    for _ in range(blocks):
        modes = list(SAMPLED_MODES)
        order.shuffle(modes)
        for mode in modes:
            print(mode, flush=True)
            sys.stdin.readline()
            t0 = time.perf_counter()
            run()
            print(time.perf_counter() - t0, flush=True)


def _sampled(kind: str, directory: str, reads: int, blocks: int, interval: float,
             env: dict[str, str]) -> dict[str, Any]:
    """The /proc sampler (the one ``lcache trace`` runs) on one process whose blocks of the
    loop alternate with untraced ones: as steady as the in-library blocks, where whole
    processes run again differ by up to 19% on this VM."""
    from lcache.trace.sampler import ProcSampler
    from lcache.trace.writer import TraceWriter

    out: dict[str, list[float]] = {m: [] for m in SAMPLED_MODES}
    cpu = []
    writer = TraceWriter(os.path.join(directory, f"sampled-{kind}.trace"))
    child = subprocess.Popen([*_child(kind, directory, reads, 0, blocks), "--paced"], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        for _ in range(blocks * len(SAMPLED_MODES)):
            mode = child.stdout.readline().strip()
            if mode not in out:
                raise SystemExit(f"sampled/{kind}: the loop's process ended early "
                                 f"(exit {child.wait()})")
            sampler = ProcSampler(child.pid, writer, interval) if mode == "sampling" else None
            if sampler is not None:
                sampler.start()
            child.stdin.write("go\n")
            child.stdin.flush()
            seconds = float(child.stdout.readline())
            if sampler is not None:
                sampler.stop()
                cpu.append(sampler.cpu_s / seconds)
            out[mode].append(seconds / reads * 1e6)
    finally:
        child.kill()
        child.wait()
        writer.close()
    med = {m: _med(v) for m, v in out.items()}
    return {"reads_per_block": reads,
            "median_us_per_read": {m: round(v, 3) for m, v in med.items()},
            "raw_us_per_read": {m: [round(x, 3) for x in v] for m, v in out.items()},
            "overhead": round(med["sampling"] / med["base"] - 1, 4),
            "overhead_min": round(min(out["sampling"]) / min(out["base"]) - 1, 4),
            "control": round(med["control"] / med["base"] - 1, 4),
            "sampler_cpu_fraction": round(_med(cpu), 5)}


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


def _child(kind: str, directory: str, reads: int, seed: int,
           blocks: int = 0) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--workload", kind, "--dir", directory,
            "--reads", str(reads), "--seed", str(seed), "--blocks", str(blocks)]


def _check(out: subprocess.CompletedProcess[str], what: str) -> Any:
    if out.returncode != 0:
        raise SystemExit(f"{what} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run(mode: str, kind: str, directory: str, reads: int, seed: int) -> float:
    """One process-level run, untraced ("base") or under ``lcache trace --syscalls``: the
    seconds of the loop."""
    cmd = _child(kind, directory, reads, seed)
    if mode == "syscalls":
        trace = os.path.join(directory, f"syscalls-{kind}.trace")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(trace)
        cmd = [sys.executable, "-m", "lcache", "trace", "-o", trace, "--no-lib-events",
               "--syscalls", "--", *cmd]
    out = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=900)
    return float(_check(out, f"{mode}/{kind}")["seconds"])


def _child_env() -> dict[str, str]:
    # one hash seed for every process: dict layouts, hence the loop's speed and instruction
    # counts, differ between processes else, and the runs compared are different processes
    return {**{k: v for k, v in os.environ.items() if k != "LCACHE_TRACE"},
            "PYTHONHASHSEED": "0"}


def _callgrind(cmd: list[str], env: dict[str, str]) -> int:
    """Instructions the process's main thread ran under callgrind, the thread that reads and
    records (the loops' other threads come and go with the clock, which callgrind slows)."""
    with tempfile.TemporaryDirectory(prefix="callgrind-") as tmp:
        out = subprocess.run(["valgrind", "--tool=callgrind", "--separate-threads=yes",
                              f"--callgrind-out-file={tmp}/cg.out", *cmd], env=env,
                             capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise SystemExit(f"valgrind failed ({out.returncode}): {out.stderr[-2000:]}")
        for line in Path(tmp, "cg.out-01").read_text().splitlines():
            if line.startswith("totals:"):
                return int(line.split()[1])
    raise SystemExit("no instruction total in callgrind's output for the main thread")


def _instructions(directory: str, reads: int) -> dict[str, Any]:
    """Instructions per read of the samples and store loops, untraced and with in-library
    events, counted on the main thread. Each runs under callgrind at ``reads`` and 10 x
    ``reads``; the difference over 9 x ``reads`` cancels start-up, set-up and enable."""
    # no background flush: its count would follow callgrind's slow clock, not the events (the
    # final flush at disable() writes them all and is counted)
    env = {**_child_env(), "LCACHE_TRACE_FLUSH_S": "36000"}
    result: dict[str, Any] = {}
    for kind in ("samples", "store"):
        # a first run outside callgrind fills the sample cache, which later runs only read
        _check(subprocess.run(_child(kind, directory, reads, 0), env=env, capture_output=True,
                              text=True, timeout=900), f"warm-up/{kind}")
        per_read = {}
        for mode in ("base", "inlib"):
            flag = ["--traced"] if mode == "inlib" else []
            lo, hi = (_callgrind([*_child(kind, directory, n, 0), *flag], env)
                      for n in (reads, 10 * reads))
            per_read[mode] = (hi - lo) / (9 * reads)
        extra = per_read["inlib"] - per_read["base"]
        result[kind] = {"instructions_per_read": round(per_read["base"]),
                        "inlib_instructions_per_read": round(extra),
                        "inlib_overhead": round(extra / per_read["base"], 4)}
    return result


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _process_reads(kind: str, mode: str, reads: int) -> int:
    """Reads in one process-level run. The plain loop's reads take ~2 us: 50,000 of them last
    0.1 s, less than one sampler interval, and such runs varied 0.09-0.52 s here, so its base
    and sampling runs read 20x more (its strace runs are 40-100x slower already)."""
    return reads * 20 if kind == "plain" and mode != "syscalls" else reads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/var/tmp/lcache-trace-bench")
    p.add_argument("--records", type=int, default=20000, help="4 KiB records in the store")
    p.add_argument("--reads", type=int, default=50000,
                   help="reads per process-level run and per sampled block")
    p.add_argument("--reps", type=int, default=5, help="process-level runs per mode")
    p.add_argument("--blocks", type=int, default=60,
                   help="in-process blocks per mode for the in-library figure")
    p.add_argument("--block-reads", type=int, default=4000, help="reads per block")
    p.add_argument("--interval", type=float, default=0.2, help="lcache trace --interval")
    p.add_argument("--sampled-blocks", type=int, default=10,
                   help="blocks per mode for the sampling figure (each of --reads reads)")
    p.add_argument("--instructions", action="store_true",
                   help="count CPU instructions under callgrind instead of timing (valgrind)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--workload", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--paced", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.workload and args.paced:
        _paced(args.workload, args.dir, args.reads, args.seed, args.blocks)
        return
    if args.workload:
        _workload(args.workload, args.dir, args.reads, args.seed, args.blocks, args.traced)
        return
    if args.instructions:
        if shutil.which("valgrind") is None:
            raise SystemExit("--instructions needs valgrind: apt-get install valgrind")
        if os.path.exists(args.dir):
            shutil.rmtree(args.dir)
        _prepare(args.dir, INSTRUCTION_RECORDS)
        counts = _instructions(args.dir, INSTRUCTION_READS)
        shutil.rmtree(args.dir, ignore_errors=True)
        counts["config"] = {"records": INSTRUCTION_RECORDS, "reads": INSTRUCTION_READS,
                            "record_bytes": RECORD, "tool": "valgrind --tool=callgrind"}
        print(json.dumps(counts, indent=2) if args.json else counts)
        return
    if shutil.which("strace") is None:
        raise SystemExit("strace is needed for the syscall mode: apt-get install strace")
    if os.path.exists(args.dir):
        shutil.rmtree(args.dir)
    _prepare(args.dir, args.records)
    env = _child_env()
    result: dict[str, Any] = {"workloads": {}}
    for kind in ("samples", "store"):  # in-library events: alternating blocks, one process
        blocks = _check(subprocess.run(
            _child(kind, args.dir, args.block_reads, 0, args.blocks), env=env,
            capture_output=True, text=True, timeout=900), f"inlib/{kind}")
        base, inlib = _med(blocks["base"]), _med(blocks["inlib"])
        cpu = blocks["cpu"]
        result["workloads"][kind] = {
            "inlib": {"block_median_s": {m: round(_med(blocks[m]), 5) for m in BLOCK_MODES},
                      "raw_s": {m: [round(x, 5) for x in blocks[m]] for m in BLOCK_MODES},
                      "events_per_read": blocks["events_per_read"],
                      "overhead": round(inlib / base - 1, 4),
                      # best blocks, as timeit does: other jobs only ever make a block slower
                      "overhead_min": round(min(blocks["inlib"]) / min(blocks["base"]) - 1, 4),
                      # untraced blocks again: what the harness reads where nothing differs
                      "control": round(_med(blocks["control"]) / base - 1, 4),
                      # The reading thread's CPU time: blind to the time other jobs hold the
                      # core (the wall clock's noise here), not to what the records cost.
                      "cpu_overhead": round(_med(cpu["inlib"]) / _med(cpu["base"]) - 1, 4),
                      "cpu_control": round(_med(cpu["control"]) / _med(cpu["base"]) - 1, 4),
                      "us_per_event": round((inlib - base) / args.block_reads * 1e6, 3),
                      "enable_disable_ms": round(blocks["enable_disable_s"] * 1e3, 3)}}
    for kind in KINDS:
        result["workloads"].setdefault(kind, {})["sampling"] = _sampled(
            kind, args.dir, _process_reads(kind, "sampling", args.reads), args.sampled_blocks,
            args.interval, env)
    proc_modes = ("base", "syscalls")
    times: dict[str, dict[str, list[float]]] = {k: {m: [] for m in proc_modes} for k in KINDS}
    for rep in range(args.reps):
        for kind in KINDS:
            modes = list(proc_modes)
            random.Random(rep).shuffle(modes)  # interleaved, in a different order each time
            for mode in modes:
                reads = _process_reads(kind, mode, args.reads)
                times[kind][mode].append(_run(mode, kind, args.dir, reads, rep) / reads * 1e6)
    for kind, by_mode in times.items():
        med = {m: _med(v) for m, v in by_mode.items()}
        result["workloads"].setdefault(kind, {})["process"] = {
            "reads": {m: _process_reads(kind, m, args.reads) for m in proc_modes},
            "median_us_per_read": {m: round(v, 3) for m, v in med.items()},
            "raw_us_per_read": {m: [round(x, 3) for x in v] for m, v in by_mode.items()},
            "overhead": {m: round(med[m] / med["base"] - 1, 4) for m in proc_modes[1:]},
            # Best-of-reps, as timeit does: other jobs only ever make a run slower.
            "overhead_min": {m: round(min(by_mode[m]) / min(by_mode["base"]) - 1, 4)
                             for m in proc_modes[1:]},
            "us_per_read_base": round(med["base"], 2),
        }
    w = result["workloads"]
    # Headline figures: in-library events on the sample-cache read loop (the bare store loop
    # is in "workloads"); sampling and strace on the worst of the three loops.
    result.update({
        "inlib_overhead": w["samples"]["inlib"]["overhead"],
        "inlib_overhead_store": w["store"]["inlib"]["overhead"],
        "inlib_overhead_min": w["samples"]["inlib"]["overhead_min"],
        "inlib_overhead_store_min": w["store"]["inlib"]["overhead_min"],
        "inlib_control": {k: w[k]["inlib"]["control"] for k in ("samples", "store")},
        "inlib_cpu_overhead": {k: w[k]["inlib"]["cpu_overhead"] for k in ("samples", "store")},
        "inlib_cpu_control": {k: w[k]["inlib"]["cpu_control"] for k in ("samples", "store")},
        "sampling_control": {k: w[k]["sampling"]["control"] for k in KINDS},
        "sampling_overhead": max(w[k]["sampling"]["overhead"] for k in KINDS),
        "sampling_overhead_min": max(w[k]["sampling"]["overhead_min"] for k in KINDS),
        "sampling_cpu_fraction": max(w[k]["sampling"]["sampler_cpu_fraction"] for k in KINDS),
        "syscall_overhead": max(w[k]["process"]["overhead"]["syscalls"] for k in KINDS),
        "syscall_overhead_by_workload": {k: w[k]["process"]["overhead"]["syscalls"]
                                         for k in KINDS},
        "config": {"records": args.records, "reads": args.reads, "reps": args.reps,
                   "blocks": args.blocks, "block_reads": args.block_reads,
                   "sampled_blocks": args.sampled_blocks,
                   "record_bytes": RECORD, "interval_s": args.interval, "cpus": os.cpu_count(),
                   "note": "medians; modes interleaved; machine shared with other jobs"},
    })
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for kind, r in w.items():
        proc = r["process"]
        line = f"{kind:8s} base {proc['us_per_read_base']} us/read; " + ", ".join(
            f"{m} {o:+.1%}" for m, o in proc["overhead"].items())
        line += (f", sampling {r['sampling']['overhead']:+.1%} (control "
                 f"{r['sampling']['control']:+.1%})")
        if "inlib" in r:
            line += (f", inlib {r['inlib']['overhead']:+.1%} ({r['inlib']['us_per_event']} "
                     f"us/event; control {r['inlib']['control']:+.1%}; thread CPU "
                     f"{r['inlib']['cpu_overhead']:+.1%}, control "
                     f"{r['inlib']['cpu_control']:+.1%})")
        print(line)
    print(f"inlib_overhead {result['inlib_overhead']:+.1%}, sampling_overhead "
          f"{result['sampling_overhead']:+.1%} (sampler CPU {result['sampling_cpu_fraction']:.3%}"
          f" of a core), syscall_overhead {result['syscall_overhead']:+.1%}")


if __name__ == "__main__":
    main()
