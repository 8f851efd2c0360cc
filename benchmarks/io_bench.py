"""Benchmark lcache's I/O engine against fio on the same file, block size and queue depth.

For each block size (default 1, 4 and 8 MiB) and each of sequential read, random read,
sequential write and random write, fio (libaio, O_DIRECT, ``--iodepth`` = the queue depth) runs
for ``--runtime`` seconds, and so does the engine (``default_engine()``, the same queue depth,
the same file opened O_DIRECT): ``queue_depth`` operations kept in flight by
``submit_read``/``submit_write`` and reaped as they finish. Each row gives both MB/s (1 MB = 1e6
bytes, as fio reports) and ``ratio`` = engine / the faster fio; the project's target is >= 0.9.
``fio_huge_MBps`` is fio libaio with its buffers in hugetlb pages (``--mem=shmhuge``; the
pages are reserved for each pass, as root, and given back): the engine's large buffers are in
transparent huge pages, and an O_DIRECT transfer pins each page of its buffer, which on a VM
can cost more than the transfer (fio's default malloc buffers moved 8 MiB reads at half the
speed here). ``--fio-buffers malloc`` skips that pass.
``fio_psync_MBps`` is fio with ``queue_depth`` threads of blocking I/O, the engine's own
model: engine near it but both below libaio means the thread-per-operation model, not Python,
is what costs. ``engine_cpu`` is the CPU seconds the process spent per second of the engine's
pass (0.1: a tenth of one core): where it is small, the engine is not what limits the ratio.

    python benchmarks/io_bench.py --json
    python benchmarks/io_bench.py --dir /mnt/nvme/bench --file-size 4GiB --queue-depth 16 --json

fio is installed with apt-get when missing (as root); where it cannot be, the script refuses
(exit status 2) rather than print rows without their reference. On a shared machine the
device's speed swings (and a cloud disk's burst credit favours whoever runs first), so the
passes run back to back in an order that turns by one at each of ``--repeat`` rounds
(use 3 or more); each row reports medians, and ``ratio`` is the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

import _sysbench as sb

from lcache.errors import LCacheError
from lcache.io import (
    Completions,
    Pending,
    aligned_buffer,
    default_engine,
    open_direct,
    private_dir,
)
from lcache.store import parse_size

PATTERNS = ("read", "randread", "write", "randwrite")
ORDER = ["psync", "libaio", "libaio-huge", "engine"]  # turned by one at each repeat


def refuse(message: str) -> NoReturn:
    print(f"io_bench: {message}", file=sys.stderr)
    sys.exit(2)


def fio_mbps(path: Path, pattern: str, block: int, qd: int, file_bytes: int,
             runtime_s: float, threads: bool = False, huge: bool = False) -> float:
    """fio's MB/s: libaio with ``qd`` in flight from one thread, or (``threads``) ``qd``
    threads of blocking psync I/O, the engine's own model. ``huge``: its buffers in hugetlb
    pages (``--mem=shmhuge``), as the engine's are in transparent huge pages."""
    if threads:  # each thread its own slice, so "read" stays one pass over the file
        part = max(block, file_bytes // qd // block * block)
        shape = [f"--numjobs={qd}", "--thread", "--group_reporting", "--ioengine=psync",
                 f"--size={part}", f"--offset_increment={part}"]
    else:
        shape = ["--ioengine=libaio", f"--iodepth={qd}", f"--size={file_bytes}"]
    args = [f"--filename={path}", "--direct=1", *shape,
            f"--name={pattern}", f"--rw={pattern}", f"--bs={block}",
            "--time_based", f"--runtime={runtime_s}", "--norandommap", "--randrepeat=0",
            "--invalidate=1"]  # fmt: skip
    result = (sb.fio_huge(args, runtime_s + 120, block * qd) if huge
              else sb._run_fio(args, runtime_s + 120))
    return sb._job_bw(result, "write" if "write" in pattern else "read")


def engine_mbps(fd: int, pattern: str, block: int, qd: int, file_bytes: int,
                runtime_s: float, seed: int) -> tuple[float, float]:
    """Keep ``qd`` operations in flight for ``runtime_s``, each replaced as soon as it
    finishes (reaped in completion order, as fio reaps). Returns (MB/s moved, CPU seconds
    this process spent per second: what the engine costs beside the device)."""
    engine = default_engine()
    # one region cut in qd slots, as fio lays out its buffers: from 2 MiB up it is in huge
    # pages even where one block is smaller
    region = memoryview(aligned_buffer(qd * block))
    bufs = [region[i * block : (i + 1) * block] for i in range(qd)]
    blocks = file_bytes // block
    rng = random.Random(seed)
    submit = engine.submit_write if "write" in pattern else engine.submit_read
    done: Completions = queue.SimpleQueue()
    owner: dict[Pending, int] = {}  # handle -> the buffer it uses
    moved = i = 0

    def start(slot: int) -> None:
        nonlocal i
        index = rng.randrange(blocks) if pattern.startswith("rand") else i % blocks
        owner[submit(fd, index * block, bufs[slot], "bench", notify=done)] = slot
        i += 1

    cpu0 = time.process_time()
    t0 = time.perf_counter()
    deadline = t0 + runtime_s
    for slot in range(qd):
        start(slot)
    while owner:
        finished = done.get()
        moved += finished.wait()
        slot = owner.pop(finished)
        if time.perf_counter() < deadline:
            start(slot)
    wall = time.perf_counter() - t0
    return sb.mbps(moved, wall), (time.process_time() - cpu0) / wall


def lay_out(path: Path, file_bytes: int) -> None:
    """Write the whole file once so reads and overwrites meet allocated blocks."""
    fd, _ = open_direct(str(path), os.O_RDWR | os.O_CREAT)
    try:
        block = 8 << 20
        buf = memoryview(aligned_buffer(block))[:block]
        pending = [default_engine().submit_write(fd, off, buf[: min(block, file_bytes - off)])
                   for off in range(0, file_bytes, block)]
        for p in pending:
            p.wait()
        os.fsync(fd)
    finally:
        os.close(fd)


def run(directory: Path, file_bytes: int, blocks: list[int], qd: int, runtime_s: float,
        repeat: int, seed: int, huge: bool) -> dict[str, Any]:
    path = directory / "io-bench.dat"
    lay_out(path, file_bytes)
    fd, direct = open_direct(str(path), os.O_RDWR)
    rows = []
    try:
        if not direct:
            refuse(f"the filesystem of {directory} refuses O_DIRECT; pick a --dir on the SSD")
        for block in blocks:
            for pattern in PATTERNS:
                fio, fio_huge, psync, eng, cpu, ratios = [], [], [], [], [], []
                for r in range(repeat):
                    got: dict[str, Any] = {}
                    # the order turns each repeat: a cloud disk's burst credit or a busy
                    # neighbour favours whoever runs first, so no system always runs last
                    order = [w for w in ORDER if huge or w != "libaio-huge"]
                    for who in order[r % len(order):] + order[:r % len(order)]:
                        if who == "engine":
                            got[who] = engine_mbps(fd, pattern, block, qd, file_bytes,
                                                   runtime_s, seed + r)
                        else:
                            got[who] = fio_mbps(path, pattern, block, qd, file_bytes,
                                                runtime_s, threads=who == "psync",
                                                huge=who == "libaio-huge")
                    (e, c), f = got["engine"], max(got["libaio"], got.get("libaio-huge", 0))
                    psync.append(got["psync"])
                    fio.append(got["libaio"])
                    fio_huge.append(got.get("libaio-huge", 0.0))
                    eng.append(e)
                    cpu.append(c)
                    ratios.append(e / f if f > 0 else float("nan"))
                rows.append({"pattern": pattern, "block_bytes": block,
                             "block": sb.format_size(block), "queue_depth": qd,
                             "file_bytes": file_bytes,
                             "fio_MBps": round(statistics.median(fio), 1),
                             "fio_psync_MBps": round(statistics.median(psync), 1),
                             **({"fio_huge_MBps": round(statistics.median(fio_huge), 1)}
                                if huge else {}),
                             "engine_MBps": round(statistics.median(eng), 1),
                             "engine_cpu": round(statistics.median(cpu), 3),
                             "ratio": round(statistics.median(ratios), 3)})
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return {"rows": rows, "config": {"dir": str(directory), "file_bytes": file_bytes,
                                     "queue_depth": qd, "runtime_s": runtime_s,
                                     "repeat": repeat, "fio_ioengine": "libaio",
                                     "fio_buffers": "malloc and hugetlb" if huge else "malloc",
                                     "direct": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None,
                        help="directory on the device under test (default: a temporary one "
                             "under the current directory)")
    parser.add_argument("--file-size", default="1GiB")
    parser.add_argument("--blocks", default="1MiB,4MiB,8MiB")
    parser.add_argument("--queue-depth", type=int, default=16)
    parser.add_argument("--runtime", type=float, default=5.0, help="seconds per pass")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of the three passes per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fio-buffers", choices=("huge", "malloc"), default="huge",
                        help="huge (default, root): fio also runs with hugetlb buffers, the "
                             "like of the engine's, and ratio is against the faster fio")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    try:
        file_bytes = parse_size(args.file_size)
        blocks = [parse_size(b) for b in args.blocks.split(",")]
        if args.queue_depth < 1 or args.repeat < 1 or args.runtime <= 0:
            refuse("--queue-depth and --repeat must be >= 1 and --runtime > 0")
        if any(b % 4096 or b > file_bytes for b in blocks):
            refuse("each block must be a multiple of 4096 and fit in --file-size")
        sb.ensure_fio("io_bench")
        os.environ["LCACHE_IO_QUEUE_DEPTH"] = str(args.queue_depth)  # read by default_engine
        if args.dir is None:
            with tempfile.TemporaryDirectory(prefix="io-bench-", dir=".") as tmp:
                result = run(Path(tmp), file_bytes, blocks, args.queue_depth, args.runtime,
                             args.repeat, args.seed, args.fio_buffers == "huge")
        else:
            directory = Path(private_dir(str(args.dir), "benchmark directory"))
            result = run(directory, file_bytes, blocks, args.queue_depth, args.runtime,
                         args.repeat, args.seed, args.fio_buffers == "huge")
    except sb.HugePagesUnavailable as exc:
        refuse(f"{exc} (--fio-buffers malloc skips fio's huge-page pass)")
    except (LCacheError, OSError, RuntimeError) as exc:
        refuse(str(exc))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'pattern':<10} {'block':>6} {'QD':>3} {'fio MB/s':>10} {'psync MB/s':>10} "
          f"{'huge MB/s':>10} {'engine MB/s':>12} {'ratio':>6} {'CPU':>5}")
    for row in result["rows"]:
        huge = f"{row['fio_huge_MBps']:>10.1f}" if "fio_huge_MBps" in row else f"{'-':>10}"
        print(f"{row['pattern']:<10} {row['block']:>6} {row['queue_depth']:>3} "
              f"{row['fio_MBps']:>10.1f} {row['fio_psync_MBps']:>10.1f} {huge} "
              f"{row['engine_MBps']:>12.1f} {row['ratio']:>6.3f} "
              f"{row['engine_cpu']:>5.2f}")


if __name__ == "__main__":
    main()
