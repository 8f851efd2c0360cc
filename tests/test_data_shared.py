"""State the processes of a node share through the cache directory (``lcache.data.shared``):
per-process counter slots, and the claims that keep two fetchers off one sample; in real
forked processes and threads."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lcache.data.shared import FetchClaims, SharedCounters


def test_counter_slot_survives_totals(tmp_path: Path) -> None:
    path = str(tmp_path / "counters.bin")
    mine = SharedCounters(path)
    mine.add(accesses=1)
    mine.totals()
    proc = multiprocessing.get_context("fork").Process(
        target=lambda: SharedCounters(path).add(accesses=1000))
    proc.start()
    proc.join(30)
    assert mine.totals()["accesses"] == 1001
    assert int(mine._slot[0]) == 1, "another process counts in this process's slot"


def test_counter_file_of_another_size_starts_afresh(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The finding (attack helper 47): a 1,000-byte random counters.bin (a table is 131,072)
    was read as counts, and `lcache stats` printed ~1e19 of each."""
    path = tmp_path / "counters.bin"
    path.write_bytes(np.random.default_rng(0).bytes(1000))
    with caplog.at_level(logging.WARNING, logger="lcache"):
        totals = SharedCounters(str(path)).totals()
    assert set(totals.values()) == {0}
    assert "is 1000 bytes, not a table of counters" in caplog.text
    counters = SharedCounters(str(path))
    counters.add(accesses=3)
    assert counters.totals()["accesses"] == 3


def _count_and_wait(counters: SharedCounters, amount: int, ready: Any, done: Any) -> None:
    counters.add(accesses=amount)
    ready.set()
    done.wait(30)


def test_forked_workers_get_their_own_counter_slots(tmp_path: Path) -> None:
    path = str(tmp_path / "counters.bin")
    parent = SharedCounters(path)
    parent.add(accesses=1)  # this process owns slot 0
    ctx = multiprocessing.get_context("fork")
    done = ctx.Event()
    procs = []
    for amount in (1000, 1_000_000):  # workers use the inherited object, as DataLoader's do
        ready = ctx.Event()
        proc = ctx.Process(target=_count_and_wait, args=(parent, amount, ready, done))
        proc.start()
        assert ready.wait(30)
        procs.append(proc)
    rows = np.fromfile(path, dtype=np.uint64).reshape(-1, 16)[:, 0].tolist()
    done.set()
    for proc in procs:
        proc.join(30)
    assert sorted(r for r in rows if r) == [1, 1000, 1_000_000]


def test_fetch_claims_first_use_is_thread_safe(tmp_path: Path) -> None:
    """Threads that claim on a process's first use (the prefetcher's pool) see one claim."""
    problems = []
    for trial in range(30):
        claims = FetchClaims(str(tmp_path / f"claims{trial}"))
        start, tried = threading.Barrier(8), threading.Barrier(8)
        granted: list[bool] = []
        errors: list[str] = []

        def claim(claims: FetchClaims = claims, start: threading.Barrier = start,
                  tried: threading.Barrier = tried, granted: list[bool] = granted,
                  errors: list[str] = errors) -> None:
            start.wait()
            try:
                with claims.hold(7, blocking=False) as ok:
                    granted.append(ok)
                    tried.wait(timeout=60)  # the holder keeps its claim until all have tried
            except Exception as exc:
                errors.append(repr(exc))

        threads = [threading.Thread(target=claim) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if sum(granted) != 1 or errors:
            problems.append((trial, sum(granted), errors))
    assert not problems, problems[:3]


def test_counters_made_again_in_one_process_share_its_slot(tmp_path: Path) -> None:
    """The finding: each handle took a slot of its own, and a process that made its
    dataset 1,024 times (a loop of opens and closes) got "more than 1024 live processes"."""
    path = str(tmp_path / "counters.bin")
    for _ in range(1100):
        SharedCounters(path).add(accesses=1)
    assert SharedCounters(path).totals()["accesses"] == 1100


def test_claims_of_two_processes_each_with_a_holder_and_a_waiter(tmp_path: Path) -> None:
    """The finding: in each of two processes one thread holds a claim (a prefetcher) while
    another waits on the one the other process holds (a reader). The kernel owns lockf
    locks by process and called that a deadlock (EDEADLK), a traceback in training, though
    neither holder waited; each waiter gets its claim once the other's holder lets go."""
    path = str(tmp_path / "claims")

    def side(mine: int, theirs: int, late: float) -> str:
        claims = FetchClaims(path)
        held = threading.Event()

        def holder() -> None:
            with claims.hold_many([mine], blocking=False) as got:
                held.set()
                assert got == [mine]
                time.sleep(1.0)

        t = threading.Thread(target=holder)
        t.start()
        held.wait()
        time.sleep(0.3 + late)
        try:
            with claims.hold_many([theirs]):
                return "got"
        except OSError as exc:
            return f"error {exc}"
        finally:
            t.join()

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, side(2, 1, 0.0).encode())
        os._exit(0)
    os.close(write)
    mine = side(1, 2, 0.2)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        theirs = pipe.read().decode()
    assert (mine, theirs) == ("got", "got")
