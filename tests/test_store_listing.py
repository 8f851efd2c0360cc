"""Each store handle keeps its listing of the segments between surveys (``space.Listing``) and
lists the directory again only when another handle took the meta lock: the listing must be
what is on disk whenever it is used, with handles in one process and across a fork."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from lcache.store import Store, space
from lcache.store.segment import list_segments, log_path, segment_file, sum_path

CONFIG: dict[str, Any] = {"capacity": 1 << 20, "segment_size": 64 << 10, "max_writers": 4,
                          "sync": "never", "direct_writes": False}


@pytest.fixture(autouse=True)
def never_relist(monkeypatch: pytest.MonkeyPatch) -> None:
    """No periodic relisting: it would hide a listing that went stale."""
    monkeypatch.setattr(space, "RELIST", 1 << 30)


def on_disk(root: Path) -> tuple[list[int], int]:
    logs, sums = list_segments(str(root))
    sealed = [s for s in logs if s in sums]
    size = sum(os.stat(p).st_size for s in sealed for p in (log_path(str(root), s),
                                                             sum_path(str(root), s)))
    return sealed, size


def check(store: Store, root: Path) -> None:
    """What ``store`` would use at its next survey is what is on disk."""
    with store._meta_lock():
        sealed, _, _ = store._survey()
        assert store._listing is not None
        assert (sealed, store._listing.sealed_bytes) == on_disk(root)
    assert store.counters.recovered_segments == 0  # nothing orphaned: every writer lives


def fill(store: Store, first: int, count: int) -> None:
    store.put_many(list(range(first, first + count)), [os.urandom(9000)] * count)


def test_two_handles_see_each_others_segments(tmp_path: Path) -> None:
    root = tmp_path / "store"
    a, b = Store.open(root, **CONFIG), Store.open(root, **CONFIG)
    try:
        for round_ in range(12):  # past the capacity: segments are cleaned, too
            fill(a, round_ * 100, 20)
            check(b, root)
            fill(b, round_ * 100 + 50, 15)
            check(a, root)
            a.delete(round_ * 100)
            b.gc(0.01)
            check(a, root)
            check(b, root)
        a.close()
        check(b, root)
    finally:
        a.close()
        b.close()


def test_a_forked_child_lists_for_itself(tmp_path: Path) -> None:
    root = tmp_path / "store"
    parent = Store.open(root, **CONFIG)
    try:
        fill(parent, 0, 40)
        check(parent, root)
        pid = os.fork()
        if pid == 0:  # the child inherits the parent's listing and must not trust it
            code = 1
            try:
                fill(parent, 1000, 60)
                check(parent, root)
                parent.close()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        check(parent, root)
        fill(parent, 2000, 30)
        check(parent, root)
    finally:
        parent.close()


def test_a_segment_file_id_past_32_bits_is_not_taken_for_a_segment(tmp_path: Path) -> None:
    """An index location holds the segment id in 32 bits: a planted ``4294967296.log`` was
    listed, its records indexed, and the next delete's journal entry failed to pack
    (struct.error from ``lcache fsck --repair``). Such names are not lcache's."""
    import shutil
    import subprocess
    import sys

    root = tmp_path / "store"
    store = Store.open(root, **CONFIG)
    fill(store, 0, 60)
    store.close()
    sealed, _ = on_disk(root)
    for suffix in (log_path, sum_path):
        shutil.copy(suffix(str(root), sealed[-1]), suffix(str(root), (1 << 32) + sealed[-1]))
    assert on_disk(root)[0] == sealed
    store = Store.open(root, **CONFIG)
    try:
        store.delete(59)
        fill(store, 60, 10)
    finally:
        store.close()
    run = subprocess.run([sys.executable, "-m", "lcache", "fsck", "--repair", "--json",
                          str(root)], capture_output=True, text=True, timeout=120)
    # the planted files are not the store's: named as such, left alone, never a traceback
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    problems = json.loads(run.stdout)["problems"]
    assert any(f"{(1 << 32) + sealed[-1]}.log is not a file a store writes" in p
               for p in problems), problems
    assert os.path.exists(log_path(str(root), (1 << 32) + sealed[-1]))


@pytest.mark.parametrize("name, parsed", [
    ("0000000001.log", (1, "log", False)),
    ("4294967294.sum", (4294967294, "sum", False)),
    ("0000000001.sum.tmp3", (1, "sum", True)),
    ("4294967295.log", None),  # ids of 2**32 - 1 and beyond are not a store's
    ("4294967295.log.tmp1", None),
    ("0000000000.sum", None),  # nor 0
    ("0000000000.log.tmp1", None),
    ("1.sum", None),  # unpadded
    ("000000000\u0661.log", None),  # an Arabic-Indic digit: isdigit() takes it
    ("+000000001.log", None),
    ("0000000001.LOG", None),
    ("0000000001.log\n", None),
])
def test_segment_file_names(name: str, parsed: tuple[int, str, bool] | None) -> None:
    """What a segment's name says, on the fast path of common names as on the others."""
    assert segment_file(name) == parsed
