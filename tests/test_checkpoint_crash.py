"""Crash safety of checkpoints: ``kill -9`` of a saving process at random moments, and a
disk that fills up during a persist (a real 8 MiB tmpfs)."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lcache import checkpoint as ck
from lcache.errors import DiskFullError

from ._ckpt_child import expected_state
from .conftest import MIB, mounted_tmpfs, subprocess_env

CHILD = str(Path(__file__).with_name("_ckpt_child.py"))
ELEMENTS = 2 << 20  # 8 MiB of uint32 per checkpoint: the persist takes a while
ROUNDS = 40


def assert_state_equal(got: Any, want: Any) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype and got[key].tobytes() == value.tobytes(), key
        else:
            assert got[key] == value, key


def read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    """The child's next stdout line (fails the test if it takes past ``deadline``)."""
    assert proc.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail("the checkpointing child stopped reporting")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            line = proc.stdout.readline()
            if not line:
                err = proc.stderr.read() if proc.stderr else ""
                pytest.fail(f"the child exited with {proc.wait()}: {err}")
            return line.strip()


@pytest.mark.slow
def test_kill_minus_9_during_saves_never_exposes_a_partial_checkpoint(tmp_path: Path) -> None:
    """Each round starts a saver, lets it save a few times and kills it with SIGKILL at a
    random moment (often in the middle of a persist). After each kill: every listed
    checkpoint loads bit-exact, the last reported one is among them, and the leftovers of the
    previous round are gone once the next saver has saved."""
    root = tmp_path / "ckpts"
    rng = random.Random(1234)
    last_started, last_saved = -1, -1
    kills_mid_save = 0
    previous_leftovers: list[str] = []
    for _ in range(ROUNDS):
        # a new name each round: a killed save may have published without saying so
        proc = subprocess.Popen([sys.executable, CHILD, str(root), str(last_started + 1),
                                 str(ELEMENTS)], env=subprocess_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            saves_before_kill = rng.randint(1, 3)
            saved_this_round = 0
            while True:
                kind, n = read_line(proc, deadline).split()
                if kind == "saved":
                    last_saved = int(n)
                    saved_this_round += 1
                    if saved_this_round == 1:  # the first save cleaned the earlier leftovers
                        assert not any(os.path.exists(p) for p in previous_leftovers)
                    continue
                last_started = int(n)
                if saved_this_round + 1 >= saves_before_kill:
                    break  # a save has just begun: kill it somewhere inside
            time.sleep(rng.uniform(0, 0.06))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        for line in (proc.stdout.read() if proc.stdout else "").split("\n"):
            if line.startswith("saved"):  # written just before the kill landed
                last_saved = int(line.split()[1])
            elif line.startswith("saving"):
                last_started = int(line.split()[1])
        listed, damaged = ck.list_checkpoints(root)
        assert damaged == []
        names = [c.name for c in listed]
        steps = [int(name.split("-")[1]) for name in names]
        assert max(steps, default=-1) <= last_started, (names, last_started)  # none unbegun
        # the last reported save is there, unless kills that each landed between a publish
        # and its "saved" line left keep_last newer ones, and retention removed it
        unreported = [n for n in steps if n > last_saved]
        assert last_saved in steps or len(unreported) >= 3, (names, last_saved)
        assert len(listed) <= 4  # keep_last=3, plus one if killed before its retention ran
        for info in listed:
            n = int(info.name.split("-")[1])
            assert_state_equal(ck.load(info.path), expected_state(n, ELEMENTS))
        previous_leftovers = ck.leftovers(str(root))
        kills_mid_save += bool(previous_leftovers)
    # SIGKILL caught a persist in progress in some rounds (random timing, many rounds)
    print(f"{kills_mid_save} of {ROUNDS} kills interrupted a save")
    assert kills_mid_save >= 3, kills_mid_save
    # and the next save, in this process, cleans what the last kill left
    ck.save({"done": True}, root / "final")
    assert ck.leftovers(str(root)) == []
    assert ck.verify(ck.latest(root) or "").ok


@pytest.mark.root
def test_disk_full_fails_that_checkpoint_and_keeps_the_previous(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "small", "8m") as mnt:
        root = mnt / "ckpts"
        first = {"w": np.arange(3 * MIB // 8, dtype=np.float64), "step": 1}
        ck.save(first, root / "step-1")
        saver = ck.Checkpointer()
        handle = saver.async_save({"w": np.ones(6 * MIB // 8), "step": 2}, root / "step-2")
        with pytest.raises(DiskFullError, match="no space left"):
            handle.wait()
        assert isinstance(handle.exception(), OSError)
        assert handle.state is ck.CkptState.FAILED
        assert [c.name for c in ck.list_checkpoints(root)[0]] == ["step-1"]
        assert ck.leftovers(str(root)) == []  # the failed save removed its partial files
        back = ck.load(root / "step-1")
        assert back["step"] == 1 and back["w"].tobytes() == first["w"].tobytes()
        # the space came back: the next save of a size that fits works
        saver.save({"w": np.zeros(3 * MIB // 8), "step": 3}, root / "step-3")
        assert [c.name for c in ck.list_checkpoints(root)[0]] == ["step-1", "step-3"]
        saver.close()


HOLDER = """
import sys, time
from lcache.checkpoint import dirs
stage, fd = dirs.open_staging(sys.argv[1], "live")
print("holding", flush=True)
time.sleep(60)
"""


def test_clean_up_never_removes_a_save_in_progress(tmp_path: Path) -> None:
    """Another process's staging directory survives our saves while that process lives (it
    holds a flock), and goes with the first save after it is killed."""
    root = tmp_path / "ckpts"
    root.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], env=subprocess_env(),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert read_line(proc, time.monotonic() + 30) == "holding"
        ck.save({"a": 1}, root / "one")
        assert ck.leftovers(str(root)) == [str(root / ".lcache-partial-live")]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ck.save({"a": 2}, root / "two")
    assert ck.leftovers(str(root)) == []
    assert [c.name for c in ck.list_checkpoints(root)[0]] == ["one", "two"]
