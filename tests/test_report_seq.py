"""Sequential vs random as the device sees it: lcache's checkpoint writer (large writes,
several in flight, one file), writes started out of order, fio's sequential and random jobs."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

import lcache.trace
from lcache import checkpoint
from lcache.report import summarize
from lcache.report.load import Trace, load
from lcache.report.stats import data_mask, sequential

from .conftest import run_lcache

MIB = 1 << 20


def _seq_of(trace: Trace, path: str, op: str) -> tuple[int, int]:
    """(sequential ops, ops) of direction ``op`` on the file ``path``."""
    rows = (trace.file == trace.files.index(path)) & (trace.op == trace.ops.index(op))
    seq = sequential(trace, data_mask(trace))
    return int(seq[rows].sum()), int(rows.sum())


def test_checkpoint_writes_in_flight_are_sequential(tmp_path: Path) -> None:
    t = tmp_path / "t.trace"
    state = {"w": np.arange(96 * MIB // 8, dtype=np.int64)}  # 12 writes of 8 MiB
    lcache.trace.enable(str(t))
    try:
        checkpoint.save(state, tmp_path / "ckpt", queue_depth=8)
    finally:
        lcache.trace.disable()
    trace = load(t)
    big = max(range(len(trace.files)), key=lambda i: int(
        trace.result[(trace.file == i) & (trace.op == trace.ops.index("write"))].sum()))
    seq, n = _seq_of(trace, trace.files[big], "write")
    assert n >= 12 and seq == n - 1  # all but the first write of the file


def _event(off: int, ts: float, pid: int = 7, size: int = MIB) -> str:
    return json.dumps({"name": "write", "cat": "checkpoint", "pid": pid, "tid": pid,
                       "ts": ts, "dur": 400.0, "ph": "X",
                       "args": {"fid": 1, "off": off, "size": size, "ret": size}})


def test_writes_started_out_of_order_and_random_offsets(tmp_path: Path) -> None:
    """8 writes in flight whose starts interleave in any order: sequential; 4 KiB writes at
    random offsets of a 1 GiB file: random."""
    rng = random.Random(5)
    meta = json.dumps({"name": "file_name", "ph": "M", "pid": 7, "tid": 7,
                       "args": {"fid": 1, "name": "/nvme/ckpt.bin"}})
    lines = [meta]
    for wave in range(16):
        chunks = list(range(wave * 8, wave * 8 + 8))
        rng.shuffle(chunks)  # the threads start their writes in any order
        lines += [_event(c * MIB, 1000.0 * wave + k) for k, c in enumerate(chunks)]
    t = tmp_path / "seq.trace"
    t.write_text("\n".join(lines) + "\n")
    assert summarize(t)["classes"]["checkpoint"]["seq_fraction"] == 127 / 128
    lines = [meta] + [_event(rng.randrange(1 << 18) * 4096, 10.0 * i, size=4096)
                      for i in range(2000)]
    t.write_text("\n".join(lines) + "\n")
    assert summarize(t)["classes"]["checkpoint"]["seq_fraction"] < 0.01


def _fio(tmp_path: Path, name: str, *job: str) -> Trace:
    t = tmp_path / f"{name}.trace"
    run = run_lcache("trace", "-o", str(t), "--syscalls", "--interval", "1", "--", "fio",
                     f"--name={name}", f"--filename={tmp_path / 'data.bin'}",
                     "--ioengine=psync", "--thread", *job, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    return load(t)


def test_fio_sequential_and_random_jobs(tmp_path: Path) -> None:
    if shutil.which("fio") is None or shutil.which("strace") is None:
        pytest.skip("fio and strace are needed (apt-get install -y fio strace)")
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(16 * MIB))
    # 4 streams through one file, each reading its own 4 MiB in 64 KiB reads
    seq = _fio(tmp_path, "seq", "--rw=read", "--bs=64k", "--numjobs=4", "--size=4M",
               "--offset_increment=4M")
    got, n = _seq_of(seq, str(data), "read")
    assert n == 256 and got >= 252, (got, n)  # only each stream's first read is not
    rand = _fio(tmp_path, "rand", "--rw=randread", "--bs=4k", "--size=16M", "--io_size=4M")
    got, n = _seq_of(rand, str(data), "read")
    assert n == 1024 and got / n < 0.05, (got, n)
