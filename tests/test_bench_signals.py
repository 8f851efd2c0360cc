"""SIGTERM ends ``lcache bench run`` as it would any program (status 143), without leaving
a partial checkpoint file behind (``timeout``, ``docker stop`` and batch schedulers send it)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from .conftest import subprocess_env
from .test_bench import small


def test_sigterm_during_a_checkpoint_write_leaves_no_partial_file(tmp_path: Path) -> None:
    """The finding (attack helper 98): a 136 MB model_states-0.pt.tmpPID was left behind,
    while SIGINT removed it."""
    doc = small(tmp_path, model={"model_size_bytes": 512 << 20},
                workflow={"checkpoint": True},
                train={"epochs": 50, "computation_time": 0.001},
                checkpoint={"steps_between_checkpoints": 2})
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(doc))
    proc = subprocess.Popen([sys.executable, "-m", "lcache", "bench", "run",
                             str(tmp_path / "w.yaml"), "--json"], env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "ckpt").glob("*/*.tmp*")):  # a checkpoint being written
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, err)
    assert "Traceback" not in err, err
    assert list((tmp_path / "ckpt").glob("*/*.tmp*")) == []
