"""Every layer does its file I/O on the process's one engine (``default_engine()``): no pool
of its own, so the whole process keeps a single bounded set of I/O threads, re-created after
fork. Checked through the tracer: the thread that ran each operation."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lcache import checkpoint as ck
from lcache.checkpoint import persist
from lcache.io import IOEvent, set_tracer
from lcache.testing import pattern_bytes


@pytest.fixture
def io_threads() -> Iterator[list[tuple[IOEvent, str]]]:
    seen: list[tuple[IOEvent, str]] = []
    previous = set_tracer(lambda e: seen.append((e, threading.current_thread().name)))
    try:
        yield seen
    finally:
        set_tracer(previous)


def _engine_or_caller(names: set[str]) -> set[str]:
    """The names in ``names`` that are neither an engine worker nor this test's thread."""
    me = threading.current_thread().name
    return {n for n in names if not n.startswith("lcache-io-") and n != me}


def _state() -> dict[str, np.ndarray]:
    return {"w": np.arange(3 * persist.CHUNK // 4 + 5, dtype=np.float32), "b": np.ones(7)}


def test_checkpoint_save_and_load_run_on_the_engine(tmp_path: Path,
                                                    io_threads: list[tuple[IOEvent, str]]) -> None:
    state = _state()
    path = ck.save(state, tmp_path / "c" / "s", queue_depth=4)
    # data-file writes are whole pages; the small manifest is written by the saving thread
    writes = {name for e, name in io_threads
              if e.op == "write" and e.io_class == "checkpoint" and e.size >= 4096}
    assert writes and _engine_or_caller(writes) == set(), writes
    io_threads.clear()
    back = ck.load(path)
    reads = {name for e, name in io_threads if e.op == "read" and e.io_class == "checkpoint"}
    assert reads and _engine_or_caller(reads) == set(), reads
    assert np.array_equal(back["w"], state["w"]) and np.array_equal(back["b"], state["b"])


def test_checkpoint_load_into_runs_on_the_engine(tmp_path: Path,
                                                 io_threads: list[tuple[IOEvent, str]]) -> None:
    state = _state()
    path = ck.save(state, tmp_path / "c" / "s")
    like = {"w": np.zeros_like(state["w"]), "b": np.zeros(7)}
    io_threads.clear()
    ck.load(path, like=like, into=True)
    reads = {name for e, name in io_threads if e.op == "read" and e.io_class == "checkpoint"}
    assert reads and _engine_or_caller(reads) == set(), reads
    assert np.array_equal(like["w"], state["w"]) and np.array_equal(like["b"], state["b"])


@pytest.mark.parametrize("direct_writes", [True, False])
def test_store_appends_run_on_the_engine(open_store: Any, direct_writes: bool,
                                         io_threads: list[tuple[IOEvent, str]]) -> None:
    store = open_store(segment_size=8 << 20, capacity=64 << 20, direct_writes=direct_writes)
    values = [pattern_bytes(100_000 + i, i) for i in range(40)]  # > 1 MiB: split writes
    store.put_many(list(range(40)), values)
    store.put(99, b"small")
    writes = {name for e, name in io_threads if e.op == "write" and e.io_class == "cache-write"}
    assert writes and _engine_or_caller(writes) == set(), writes
    assert [store.get(i) for i in range(40)] == values and store.get(99) == b"small"
