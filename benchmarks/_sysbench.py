"""System-side helpers for the store benchmark: sizes, page cache, disk counters, fio, and the
naive one-file-per-sample baseline. Nothing here imports lcache, so it works without the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def format_size(n: int) -> str:
    """4096 -> "4KiB": the label a human expects in a table."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def mbps(nbytes: int, seconds: float) -> float:
    """Throughput in MB/s (1 MB = 1e6 bytes), the unit fio and disk vendors report."""
    return nbytes / seconds / 1e6 if seconds > 0 else float("nan")


def drop_page_cache(fallback: Callable[[], None] | None = None) -> str:
    """Empty the page cache so reads hit the device; returns how it was done.

    As root the whole cache goes (sync, then drop_caches=1). Otherwise ``fallback`` (e.g. the
    store's per-file fadvise) is the best we can do.
    """
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        if fallback is not None:
            fallback()
            return "fadvise"
        return "none"


# --- disk counters -------------------------------------------------------------------------


def block_device_of(path: str) -> str | None:
    """The whole-disk name (e.g. "vda") holding ``path``, or None for tmpfs/overlay-like mounts.

    A partition's sysfs node sits inside its disk's, so the parent directory names the disk: a
    write counter on the disk is what the device actually sees.
    """
    dev = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not node.exists():
        return None
    real = node.resolve()
    if (real / "partition").exists():
        real = real.parent
    return real.name


def sectors_written(device: str) -> int:
    """Sectors (512 B, whatever the device's block size) written to ``device`` since boot."""
    for line in Path("/proc/diskstats").read_text().splitlines():
        fields = line.split()
        if len(fields) > 9 and fields[2] == device:
            return int(fields[9])  # field 10 of the line: sectors written
    raise LookupError(f"device {device!r} not in /proc/diskstats")


def proc_write_bytes() -> int:
    """Bytes this process caused to be sent to storage (``/proc/self/io`` write_bytes)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise LookupError("write_bytes missing from /proc/self/io")


@dataclass(frozen=True, slots=True)
class WriteCounters:
    """A snapshot of what has been written, to subtract from a later one."""

    device_bytes: int | None
    process_bytes: int

    @classmethod
    def take(cls, device: str | None) -> WriteCounters:
        os.sync()  # count write-back of what is dirty now, not whenever the kernel gets to it
        dev_bytes = sectors_written(device) * 512 if device is not None else None
        return cls(dev_bytes, proc_write_bytes())

    def since(self, start: WriteCounters) -> WriteCounters:
        dev = None
        if self.device_bytes is not None and start.device_bytes is not None:
            dev = self.device_bytes - start.device_bytes
        return WriteCounters(dev, self.process_bytes - start.process_bytes)


# --- fio -----------------------------------------------------------------------------------


def create_cost_us(folder: Path, files: int = 50) -> float:
    """Microseconds to create (and later remove) an empty file in ``folder``: directory
    operations on some filesystems slow down by 10-50x for a while after many files were
    removed (ext4 with ``discard``), which moves every file-per-segment or file-per-chunk
    cache with them."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f".create-probe-{os.getpid()}-{i}" for i in range(files)]
    t0 = time.perf_counter()
    for p in paths:
        os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    seconds = time.perf_counter() - t0
    for p in paths:
        p.unlink()
    return seconds / files * 1e6


def settle_directory_ops(folder: Path, quiet_us: float, wait_s: float) -> tuple[float, float]:
    """Wait (up to ``wait_s``) until a file creation in ``folder`` costs under ``quiet_us``;
    returns (the cost when done, seconds waited)."""
    t0 = time.perf_counter()
    cost = create_cost_us(folder)
    while cost > quiet_us and time.perf_counter() - t0 < wait_s:
        time.sleep(2)
        cost = create_cost_us(folder)
    return cost, time.perf_counter() - t0


def fio_available() -> bool:
    return shutil.which("fio") is not None


def ensure_fio(bench: str) -> None:
    """fio on the PATH, installed with apt-get if need be (root): every benchmark that
    compares with fio refuses, exit 2 and one line, rather than report a figure without it."""
    if fio_available():
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        done = subprocess.run(["apt-get", "install", "-y", "-q", "fio"], capture_output=True,
                              text=True, check=False)
        if done.returncode == 0 and fio_available():
            return
    print(f"{bench}: fio is needed as the reference and could not be installed; run "
          "'apt-get install -y fio' as root, then run this again", file=sys.stderr)
    sys.exit(2)


def _run_fio(args: Sequence[str], timeout_s: float) -> dict[str, Any]:
    cmd = ["fio", "--output-format=json", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    # fio may print notes before the JSON document
    result: dict[str, Any] = json.loads(proc.stdout[proc.stdout.index("{") :])
    return result


NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
HUGE_PAGE = 2 << 20


class HugePagesUnavailable(RuntimeError):
    """The hugetlb pages fio's buffers need could not be reserved."""


@contextlib.contextmanager
def hugetlb_pages(nbytes: int) -> Iterator[None]:
    """Reserve hugetlb pages for ``nbytes`` of buffers for as long as the block runs (root)."""
    want = -(-nbytes // HUGE_PAGE) + 2  # fio aligns its buffer inside the segment
    try:
        before = int(NR_HUGEPAGES.read_text())
        NR_HUGEPAGES.write_text(str(before + want))
        got = int(NR_HUGEPAGES.read_text()) - before
    except OSError as exc:
        raise HugePagesUnavailable(f"cannot reserve hugetlb pages for fio's buffers ({exc}); "
                                   "run as root") from exc
    try:
        if got < want:
            raise HugePagesUnavailable(f"the kernel gave {got} of {want} hugetlb pages for "
                                       "fio's buffers (memory too fragmented?)")
        yield
    finally:  # give back what this block took, not the count it saw: another bench may
        # have reserved pages meanwhile (restoring `before` left 66 pages reserved once)
        NR_HUGEPAGES.write_text(str(max(0, int(NR_HUGEPAGES.read_text()) - got)))


def fio_huge(args: Sequence[str], timeout_s: float, buffer_bytes: int) -> dict[str, Any]:
    """``_run_fio`` with fio's buffers (``buffer_bytes``: block size x depth or jobs) in
    hugetlb pages, as lcache's large buffers are in transparent huge pages: an O_DIRECT
    transfer pins every page of its buffer, and on this project's VM fio's default malloc
    buffers moved large blocks at half the speed."""
    with hugetlb_pages(buffer_bytes):
        return _run_fio([*args, "--mem=shmhuge"], timeout_s)


def _job_bw(result: dict[str, Any], direction: str) -> float:
    return float(result["jobs"][0][direction]["bw_bytes"]) / 1e6


def fio_pair(
    directory: str, file_bytes: int, block_bytes: int, iodepth: int, runtime_s: int
) -> tuple[float, float]:
    """(sequential write MB/s, random read MB/s) on a file of ``file_bytes`` in ``directory``.

    The write lays the file out; the random read then runs over exactly that file with
    O_DIRECT, so the page cache cannot flatter the device. The file is always removed.
    """
    path = os.path.join(directory, "fio-bench.dat")
    common = [f"--filename={path}", f"--size={file_bytes}", "--ioengine=libaio", "--direct=1"]
    try:
        write = _run_fio(
            [*common, "--name=seqwrite", "--rw=write", "--bs=1M", "--iodepth=16",
             "--end_fsync=1"],
            timeout_s=300,
        )  # fmt: skip
        read = _run_fio(
            [*common, "--name=randread", "--rw=randread", f"--bs={block_bytes}",
             f"--iodepth={iodepth}", "--time_based", f"--runtime={runtime_s}",
             "--norandommap", "--randrepeat=0"],
            timeout_s=runtime_s + 120,
        )  # fmt: skip
    finally:
        Path(path).unlink(missing_ok=True)
    return _job_bw(write, "write"), _job_bw(read, "read")


# --- naive baseline: one file per sample ---------------------------------------------------


def _sample_path(root: Path, key: int) -> Path:
    # hashed two-level fan-out, as file-per-object caches do, so no directory grows huge
    name = hashlib.sha256(str(key).encode()).hexdigest()
    return root / name[:2] / name[2:4] / name


def files_put(root: Path, values: Sequence[memoryview]) -> float:
    """Write one file per sample (open/write/close), then ``os.sync()``; returns seconds."""
    made: set[Path] = set()
    t0 = time.perf_counter()
    for key, value in enumerate(values):
        path = _sample_path(root, key)
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        with open(path, "wb") as f:
            f.write(value)
    os.sync()
    return time.perf_counter() - t0


def _read_files(paths: Sequence[Path]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            total += len(f.read())
    return total


def files_get(
    root: Path, values: Sequence[memoryview], concurrency: int, seed: int
) -> tuple[float, int]:
    """Read every sample file once in random order with ``concurrency`` threads.

    Returns (seconds, bytes read). Work is handed out in small chunks so thread hand-off costs
    do not dominate at 4 KiB; each thread still has one read in flight, so the device sees a
    queue of ``concurrency``.
    """
    order = list(range(len(values)))
    random.Random(seed).shuffle(order)
    paths = [_sample_path(root, key) for key in order]
    chunk = 32
    chunks = [paths[i : i + chunk] for i in range(0, len(paths), chunk)]
    drop_page_cache(lambda: _fadvise_tree(root))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        nbytes = sum(pool.map(_read_files, chunks))
    elapsed = time.perf_counter() - t0
    for key in order[:: max(1, len(order) // 8)]:  # spot-check contents outside the timing
        if _sample_path(root, key).read_bytes() != values[key]:
            raise RuntimeError(f"file baseline returned wrong bytes for sample {key}")
    return elapsed, nbytes


def _fadvise_tree(root: Path) -> None:
    for dirpath, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
