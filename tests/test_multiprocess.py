"""Several processes on one store directory at once, and the max_writers limit."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

from lcache import StoreFullError
from lcache.store import Store, fsck
from lcache.testing import make_value, parse_version

from .conftest import KIB, MIB, subprocess_env

WORKERS = 4
ROUNDS = 400
SHARED_INT = range(40)  # every worker writes these
SHARED_BYTES = [b"shared-%d" % i for i in range(10)]
CONFIG = {"capacity": 64 * MIB, "segment_size": 256 * KIB, "max_writers": 6,
          "max_byte_keys": 1024}

Key = int | bytes


def own_keys(worker: int) -> list[Key]:
    """Keys only ``worker`` writes."""
    return [*range(1000 * (worker + 1), 1000 * (worker + 1) + 30),
            *(b"own-%d-%d" % (worker, i) for i in range(8))]


def version_of(worker: int, i: int) -> int:
    return worker * 1_000_000 + i


def writer_of(version: int) -> int:
    return version // 1_000_000


def _work(worker: int, store: Store | None, root: str, seed: int,
          start: Any) -> dict[str, Any]:
    """Puts (overwrites of shared and own keys), gets and get_many; checks every hit."""
    rng = random.Random(seed)
    if store is None:
        store = Store.open(root)
    start.wait(60)  # all workers at once
    shared: list[Key] = [*SHARED_INT, *SHARED_BYTES]
    mine = own_keys(worker)
    last: dict[Key, int] = {}
    bad: list[str] = []

    def check(key: Key, got: Any) -> None:
        if got is None:
            return
        version = parse_version(key, got)
        if version is None:
            bad.append(f"{key!r}: bytes never written")
        elif key in mine and writer_of(version) != worker:
            bad.append(f"{key!r}: written by worker {writer_of(version)}, not {worker}")

    for i in range(ROUNDS):
        key = rng.choice(shared) if rng.random() < 0.5 else rng.choice(mine)
        version = version_of(worker, i)
        store.put(key, make_value(key, version, 200 + rng.randrange(6000)))
        last[key] = version
        probe = rng.choice(shared + mine)
        check(probe, store.get(probe))
        if i % 10 == 0:
            batch = rng.sample(shared + mine, 12)
            for k, got in zip(batch, store.get_many(batch), strict=True):
                check(k, got)
        if i % 50 == 0:
            store.flush()
    store.close()
    return {"last": {repr(k): v for k, v in last.items() if k in mine}, "bad": bad}


def _child(worker: int, store: Store | None, root: str, queue: Any, start: Any) -> None:
    try:
        queue.put((worker, _work(worker, store, root, worker * 7919, start)))
    except BaseException:
        queue.put((worker, {"error": traceback.format_exc()}))


def _run_workers(method: str, root: Path, store: Store | None) -> dict[int, dict[str, Any]]:
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    start = ctx.Barrier(WORKERS)
    procs = [ctx.Process(target=_child, args=(w, store, str(root), queue, start))
             for w in range(WORKERS)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0, f"worker exited with {p.exitcode}"
    return results


def _check_final(root: Path, results: dict[int, dict[str, Any]]) -> None:
    for worker, result in results.items():
        assert "error" not in result, f"worker {worker} failed:\n{result['error']}"
        assert result["bad"] == [], f"worker {worker} saw: {result['bad']}"
    report = fsck(root)
    assert report.clean, report.problems
    assert report.active_segments == 0
    store = Store.open(root)
    try:
        shared: list[Key] = [*SHARED_INT, *SHARED_BYTES]
        for key, got in zip(shared, store.get_many(shared), strict=True):
            assert got is not None, f"shared key {key!r} is missing"
            version = parse_version(key, got)
            assert version is not None, f"shared key {key!r} holds bytes never written"
            assert 0 <= writer_of(version) < WORKERS
        for worker, result in results.items():
            mine = own_keys(worker)
            for key, got in zip(mine, store.get_many(mine), strict=True):
                expected = result["last"].get(repr(key))
                if expected is None:
                    assert got is None, f"{key!r} was never written but is there"
                    continue
                assert got is not None, f"{key!r} of worker {worker} is missing"
                assert parse_version(key, got) == expected, (
                    f"{key!r}: not the last value worker {worker} wrote"
                )
        assert store.counters.verify_failures == 0
    finally:
        store.close()


@pytest.mark.slow
def test_processes_each_opening_the_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    Store.open(root, **CONFIG).close()
    results = _run_workers("spawn", root, None)
    _check_final(root, results)


@pytest.mark.slow
def test_store_opened_before_fork_used_by_children(tmp_path: Path) -> None:
    root = tmp_path / "store"
    parent = Store.open(root, **CONFIG)
    parent.put(7, make_value(7, version_of(0, 10**5)))  # the parent holds an active segment
    parent.get_many([7, 8, 9])  # and has started its I/O threads
    results = _run_workers("fork", root, parent)
    # The parent's own store still works after its children used their copies.
    assert parse_version(7, parent.get(7) or b"") is not None
    parent.put(b"parent", b"after fork")
    assert parent.get(b"parent") == b"after fork"
    parent.close()
    _check_final(root, results)


HOLD_WRITER = """
import sys
from lcache.store import Store
store = Store.open(sys.argv[1])
store.put(int(sys.argv[2]), b"x" * 100)
print("holding", flush=True)
sys.stdin.read()
store.close()
"""


def test_more_writers_than_max_writers_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    Store.open(root, capacity=4 * MIB, segment_size=64 * KIB, max_writers=2).close()
    holders = []
    try:
        for i in range(2):
            p = subprocess.Popen([sys.executable, "-c", HOLD_WRITER, str(root), str(i)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=subprocess_env())
            holders.append(p)
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "holding"
        store = Store.open(root)
        assert store.get(0) == b"x" * 100  # readers are not limited
        with pytest.raises(StoreFullError, match=r"max_writers=2") as info:
            store.put(5, b"one writer too many")
        assert "2 processes already write" in str(info.value)
        assert "larger max_writers" in str(info.value)
        assert isinstance(info.value, RuntimeError)
        store.close()
    finally:
        for p in holders:
            p.communicate("", timeout=30)
    # Once they are gone (closed, or killed: the kernel drops their locks) a writer fits.
    store = Store.open(root)
    store.put(5, b"now it fits")
    assert store.get(5) == b"now it fits"
    store.close()
    assert fsck(root).clean


def test_killed_writers_do_not_count_against_max_writers(tmp_path: Path) -> None:
    root = tmp_path / "store"
    Store.open(root, capacity=4 * MIB, segment_size=64 * KIB, max_writers=1).close()
    p = subprocess.Popen([sys.executable, "-c", HOLD_WRITER, str(root), "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=subprocess_env())
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "holding"
    p.kill()
    p.wait(30)
    store = Store.open(root)
    store.put(2, b"y")
    assert store.get(1) == b"x" * 100
    assert store.get(2) == b"y"
    store.close()
    assert fsck(root).clean


PARENT_DIES = """
import os, signal, sys, time
from lcache.store import Store
store = Store.open(sys.argv[1])
store.put(1, b"from the parent")
store.flush()
pid = os.fork()
if pid == 0:  # a worker that used the store, then lingers
    store.get(1)
    print(os.getpid(), flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(0.3)
os.kill(os.getpid(), signal.SIGKILL)  # the parent crashes, its segment still active
"""


def test_forked_child_does_not_keep_a_dead_parents_segment_alive(tmp_path: Path) -> None:
    """Regression: a forked child kept the inherited descriptor of the parent's active segment,
    and with it the parent's flock: after the parent died its segment stayed 'live' (never
    recovered, counted against max_writers) for as long as the child ran."""
    root = tmp_path / "store"
    Store.open(root, capacity=4 * MIB, segment_size=64 * KIB, max_writers=1).close()
    parent = subprocess.Popen([sys.executable, "-c", PARENT_DIES, str(root)],
                              stdout=subprocess.PIPE, text=True, env=subprocess_env())
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    parent.wait(30)
    try:
        store = Store.open(root)
        store.put(2, b"a new writer")  # max_writers=1: only possible if the parent's is gone
        assert store.counters.recovered_segments == 1
        assert store.get(1) == b"from the parent"
        store.close()
    finally:
        os.kill(child_pid, signal.SIGKILL)
    assert fsck(root).clean


def test_threads_of_a_forked_child_reopen_the_store_once(tmp_path: Path) -> None:
    """A forked child whose first use of an inherited store comes from several threads at
    once (a DataLoader worker whose transform uses threads) reopens it once. Each thread
    that saw the child's pid closed the inherited descriptors again, and one could close the
    descriptor another had just opened under that number, or use the parent's closed ones
    before the new ones were set. Opening is made slow here so that the threads overlap."""
    import threading
    import time

    from lcache.store import store as store_module

    root = tmp_path / "store"
    parent = Store.open(root, **CONFIG)
    values = {k: make_value(k, version_of(0, k)) for k in range(64)}
    parent.put_many(list(values), list(values.values()))
    parent.flush()
    pid = os.fork()
    if pid == 0:
        failed = True
        try:
            meta_page = store_module.MetaPage

            def slowly(*args: Any, **kwargs: Any) -> Any:
                time.sleep(0.05)
                return meta_page(*args, **kwargs)

            store_module.MetaPage = slowly  # type: ignore[misc,assignment]
            errors: list[str] = []

            def first_use(worker: int) -> None:
                try:
                    keys = list(range(worker, 64, 8))
                    if parent.get_many(keys) != [values[k] for k in keys]:
                        errors.append(f"thread {worker}: wrong values")
                    parent.put(1000 + worker, b"from thread %d" % worker)
                except BaseException:
                    errors.append(traceback.format_exc())

            threads = [threading.Thread(target=first_use, args=(w,)) for w in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            parent.close()
            sys.stderr.write("".join(errors))
            failed = bool(errors)
        finally:
            os._exit(1 if failed else 0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [parent.get(1000 + w) for w in range(8)] == [b"from thread %d" % w for w in range(8)]
    assert parent.get_many(list(values)) == list(values.values())
    parent.close()
    assert fsck(root).clean
