"""Memory and threads a checkpoint load keeps between calls: the read ring of load(into=True)
is reused, and reads with changing queue depths leave no threads behind."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from lcache import checkpoint as ck
from lcache.checkpoint import inplace, persist


def test_two_loads_into_reuse_one_ring(tmp_path: Path) -> None:
    state = {"w": np.arange(300_000, dtype=np.float32)}
    path = ck.save(state, tmp_path / "c" / "s")
    like = {"w": np.zeros(300_000, dtype=np.float32)}
    ck.load(path, like=like, into=True)
    (ring,) = inplace._RING
    ck.load(path, like=like, into=True)
    assert len(inplace._RING) == 1 and inplace._RING[0] is ring  # not reallocated
    assert like["w"].tobytes() == state["w"].tobytes()


def _data_file(tmp_path: Path) -> tuple[str, bytes]:
    """A checkpoint data file of three read chunks (so reads use helper threads)."""
    data = np.random.default_rng(0).integers(0, 255, 3 * persist.CHUNK, np.uint8)
    path = ck.save({"d": data}, tmp_path / "c" / "big")
    return f"{path}/rank00000.data", data.tobytes()


def test_reads_with_changing_queue_depths_leave_no_threads(tmp_path: Path) -> None:
    data_path, want = _data_file(tmp_path)
    persist.read_data_file(data_path, len(want), queue_depth=2)
    before = threading.active_count()
    for depth in (3, 2, 4, 3, 2):
        buf, got = persist.read_data_file(data_path, len(want), queue_depth=depth)
        assert got == len(want) and buf.tobytes() == want
    assert threading.active_count() <= before


def test_reads_from_two_threads_with_different_queue_depths(tmp_path: Path) -> None:
    data_path, want = _data_file(tmp_path)
    errors: list[BaseException] = []

    def reader(depth: int) -> None:
        try:
            for _ in range(4):
                buf, got = persist.read_data_file(data_path, len(want), queue_depth=depth)
                assert got == len(want) and buf.tobytes() == want
        except BaseException as exc:  # reported by the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(d,)) for d in (2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and not any(t.is_alive() for t in threads)
