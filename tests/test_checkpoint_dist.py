"""Two ranks under torchrun (gloo): each writes its shard, rank 0 publishes after both have
persisted, a failure on one rank fails the checkpoint on both, and loads need the same world
size (or an explicit rank); done() means published on every rank, so a kill -9 right after it
keeps that checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lcache import checkpoint as ck
from lcache.errors import ConfigError

from ._ckpt_child import rank_state
from .conftest import gloo_env, run_torchrun
from .test_checkpoint_crash import assert_state_equal, read_line

torch = pytest.importorskip("torch")
SCRIPT = str(Path(__file__).with_name("_ckpt_torchrun.py"))
CHILD = str(Path(__file__).with_name("_ckpt_child.py"))
TIMEOUT_S = 120


@pytest.mark.slow
def test_two_ranks_save_and_load(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    run_torchrun([SCRIPT, str(root)], TIMEOUT_S)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rep in reports:
        assert rep["world"] == 2
        assert rep["first_done"] and rep["load1"] and rep["load2"] and rep["load4"], rep
        assert rep["listed_after_third"] == ["step-1", "step-2"], rep
        assert rep["leftovers_after_third"] == [], rep
        assert rep["listed_after_fourth"] == ["step-2", "step-4"], rep  # keep_last=2
        # done() without wait(): published, and visible to every rank
        assert rep["fifth_done"] and rep["fifth_state"] == "published", rep
        assert rep["latest_when_done"] == str(root / "step-5"), rep
    assert reports[1]["third"].startswith("UnsupportedValueError"), reports[1]
    assert reports[0]["third"].startswith("CheckpointFailedError"), reports[0]
    assert "rank 1" in reports[0]["third"] and "extra" in reports[0]["third"]
    assert reports[1]["sixth"].startswith("ConfigError: meta"), reports[1]
    assert reports[0]["sixth"].startswith("CheckpointFailedError"), reports[0]
    assert not (root / "step-6").exists()
    for r in (0, 1):
        assert reports[r]["seventh"].startswith("CheckpointFailedError") and \
            "the ranks saved to different checkpoints" in reports[r]["seventh"], reports[r]
    assert reports[1]["eighth"].startswith("ConfigError: unknown checkpoint option"), reports[1]
    assert reports[0]["eighth"].startswith("CheckpointFailedError") and \
        "rank 1: ConfigError" in reports[0]["eighth"], reports[0]
    assert reports[0]["listed_at_the_end"] == ["step-4", "step-5", "step-9"], reports[0]
    assert [(tmp_path / f"rank{r}.exit").read_text() for r in (0, 1)] == ["released"] * 2

    body = ck.read_manifest(root / "step-4")
    assert body["world_size"] == 2 and [s["rank"] for s in body["shards"]] == [0, 1]
    assert sorted(os.listdir(root / "step-4")) == ["manifest.json", "rank00000.data",
                                                   "rank00001.data"]
    assert ck.verify(root / "step-4").ok
    with pytest.raises(ConfigError, match="saved by 2 ranks"):
        ck.load(root / "step-4")
    one = ck.load(root / "step-4", rank=1)
    assert one["rank"] == 1 and one["model"]["w"].shape == (1001,)
    assert torch.equal(one["model"]["w"], torch.full((1001,), 41.0))


@pytest.mark.slow
def test_kill_minus_9_of_every_rank_after_done_keeps_that_checkpoint(tmp_path: Path) -> None:
    """Two real gloo ranks save step 1, 2, ... polling done() alone; once both have reported
    step N done, both are killed with SIGKILL (perhaps inside a later save): the newest
    checkpoint either rank reported done must be listed (or one newer, published just before
    the kill landed), and every listed one must load bit-exact for both ranks. A publish left
    to wait() or the next save lost up to two saves here."""
    root, elements = tmp_path / "ckpts", 1 << 16
    env = gloo_env()
    procs = [subprocess.Popen([sys.executable, CHILD, "--dist", str(root), str(rank), "2",
                               str(tmp_path / "rendezvous"), str(elements)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for rank in (0, 1)]
    target = random.Random().randint(1, 3)
    try:
        deadline = time.monotonic() + 90
        for proc in procs:
            while (line := read_line(proc, deadline)) != f"published {target}":
                assert line.startswith("published"), line  # not "stuck" or "failed"
        time.sleep(random.uniform(0, 0.05))
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reported = [int(line.split()[1]) for proc in procs if proc.stdout
                for line in proc.stdout.read().split("\n") if line.startswith("published")]
    newest_done = max([target, *reported])  # the ranks may have gone on before the kill
    listed, damaged = ck.list_checkpoints(root)
    assert damaged == []
    names = [c.name for c in listed]
    assert f"step-{newest_done:06d}" in names, (names, newest_done)
    # a rank prints only after done(), and the next vote needs both ranks: at most one newer
    assert names[-1] in (f"step-{newest_done:06d}", f"step-{newest_done + 1:06d}"), names
    for info in listed:
        step = int(info.name.split("-")[1])
        for rank in (0, 1):
            assert_state_equal(ck.load(info.path, rank=rank), rank_state(step, rank, elements))


def test_the_vote_group_keeps_the_jobs_timeout(tmp_path: Path) -> None:
    """The finding (attack helper 85): the checkpoints' own gloo group was made without a
    timeout, so a rank waited torch's 30 minutes for one that had failed on its own, whatever
    init_process_group(timeout=) said."""
    code = (
        "import datetime, sys, torch.distributed as dist\n"
        "from lcache.checkpoint import dist as ck_dist\n"
        "dist.init_process_group('gloo', init_method='file://' + sys.argv[1], rank=0,\n"
        "                        world_size=1, timeout=datetime.timedelta(seconds=7))\n"
        "print(ck_dist._timeout_of(ck_dist.vote_group()).total_seconds())\n"
        "ck_dist._forget_group()\n"
        "dist.destroy_process_group()\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "init")],
                          capture_output=True, text=True, timeout=120, env=gloo_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["7.0"]
