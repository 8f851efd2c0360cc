"""Exact resume: training killed with SIGKILL after a checkpoint and resumed from it ends
bit-identical to an uninterrupted run (CPU, deterministic), the data order included."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lcache import checkpoint as ck

from .conftest import subprocess_env

pytest.importorskip("torch")
TRAIN = str(Path(__file__).with_name("_ckpt_train.py"))
STEPS, EVERY, KILL_AT = 60, 10, 37  # 12 batches an epoch: the checkpoint at 30 is mid-epoch


def train(root: Path, *extra: str, expect_rc: int = 0) -> dict[str, Any]:
    done = subprocess.run([sys.executable, TRAIN, str(root), "--steps", str(STEPS),
                           "--every", str(EVERY), *extra], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == expect_rc, done.stderr[-3000:]
    return json.loads(done.stdout) if expect_rc == 0 else {}


@pytest.mark.slow
def test_killed_and_resumed_training_is_bit_identical(tmp_path: Path) -> None:
    straight = train(tmp_path / "straight")
    assert straight["resumed_from"] is None and straight["steps"] == STEPS

    train(tmp_path / "crashed", "--kill-at", str(KILL_AT), expect_rc=-signal.SIGKILL)
    listed = [c.name for c in ck.list_checkpoints(tmp_path / "crashed")[0]]
    assert listed == ["step-000020", "step-000030"]  # keep_last=2
    resumed = train(tmp_path / "crashed")
    assert resumed["resumed_from"] == 30
    assert resumed["losses"] == straight["losses"][30:]
    assert resumed["digest"] == straight["digest"]

    # negative control: the same resume without the sampler's state diverges
    train(tmp_path / "forgot", "--kill-at", str(KILL_AT), expect_rc=-signal.SIGKILL)
    forgot = train(tmp_path / "forgot", "--forget-data-order")
    assert forgot["resumed_from"] == 30 and forgot["digest"] != straight["digest"]
