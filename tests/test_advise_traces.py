"""Traces with a known shape for the advise tests, written by lcache's own recorder (a
helper module of test_advise*.py; it holds no tests).

Each event goes through ``lcache.trace.record`` with chosen start times and durations, so the
answer (step period, batch, compute, checkpoint bandwidth) is known exactly, and the trace
file is what lcache writes (the loader reads it through its public API).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import lcache.trace

MS = 1_000_000  # ns
SAMPLE = 64 << 10


def record_trace(path: Path, body: Callable[[int], None], in_thread: bool) -> None:
    """Run ``body(t0_ns)`` with tracing on, in a reader thread or the main thread."""
    lcache.trace.enable(str(path))
    try:
        t0 = lcache.trace.now_ns()
        if in_thread:
            th = threading.Thread(target=body, args=(t0,))
            th.start()
            th.join()
        else:
            body(t0)
    finally:
        lcache.trace.disable()


def loop(steps: int, batch: int, period_ms: float, read_ms: float, *, ckpt_every: int = 0,
         ckpt_bytes: int = 0, ckpt_ms: float = 0.0, samples: int = 0, markers: bool = False,
         offload_bytes: int = 0, sample_cls: str = "data-source",
         prefix: str = "/data/s") -> Callable[[int], None]:
    """A training loop's events: each step reads ``batch`` samples back to back (``read_ms``
    for the batch), then the rest of ``period_ms`` computes; every ``ckpt_every`` steps a
    checkpoint of ``ckpt_bytes`` takes ``ckpt_ms`` (4 writes and an fsync) before the next
    step. Samples cycle through ``samples`` files (default: one per read)."""

    def body(t0: int) -> None:
        t = t0
        n = 0
        for step in range(steps):
            if markers:
                lcache.trace.record("step", "train", step, 0, "step", t + int(read_ms * MS),
                                    int((period_ms - read_ms) * MS), 0)
            each = int(read_ms * MS / batch)
            for k in range(batch):
                i = n % samples if samples else n
                lcache.trace.record("read", f"{prefix}{i:06d}.bin", 0, SAMPLE, sample_cls,
                                    t + k * each, each, SAMPLE)
                n += 1
            if offload_bytes:
                lcache.trace.record("write", "/nvme/offload.bin", 0, offload_bytes, "offload",
                                    t + int(read_ms * MS), MS, offload_bytes)
                lcache.trace.record("read", "/nvme/offload.bin", 0, offload_bytes, "offload",
                                    t + int(read_ms * MS) + MS, MS, offload_bytes)
            t += int(period_ms * MS)
            if ckpt_every and (step + 1) % ckpt_every == 0:
                part = ckpt_bytes // 4
                for k in range(4):
                    lcache.trace.record("write", f"/ckpt/step{step}.bin", k * part, part,
                                        "checkpoint", t + int(k * ckpt_ms * MS / 5),
                                        int(ckpt_ms * MS / 5), part)
                lcache.trace.record("fsync", f"/ckpt/step{step}.bin", 0, 0, "checkpoint",
                                    t + int(4 * ckpt_ms * MS / 5), int(ckpt_ms * MS / 5), 0)
                t += int(ckpt_ms * MS)

    return body
