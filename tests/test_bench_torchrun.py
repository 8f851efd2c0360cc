"""lcache bench under a real ``torchrun --nproc_per_node 2`` (gloo): the ranks split the
samples like a distributed sampler, each writes its checkpoint shard between barriers, and
rank 0's summary aggregates both as DLIO does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import subprocess_env

TIMEOUT = 150


def torchrun() -> str:
    path = Path(sys.executable).parent / "torchrun"
    if not path.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    return str(path)


def files_read(trace: Path) -> set[str]:
    """Dataset files the trace shows a read of (data-source class)."""
    names: dict[tuple[int, int], str] = {}
    fids: set[tuple[int, int]] = set()
    for line in trace.read_text().splitlines():
        line = line.strip().rstrip(",")
        if not line.startswith("{"):
            continue
        ev = json.loads(line)
        if ev.get("name") == "file_name" and ev.get("ph") == "M":
            names[(ev["pid"], ev["args"]["fid"])] = ev["args"]["name"]
        elif ev.get("ph") == "X" and ev["cat"] == "data-source" and ev["name"] == "read":
            fids.add((ev["pid"], ev["args"]["fid"]))
    return {os.path.basename(names[f]) for f in fids if f in names}


@pytest.mark.slow
def test_two_ranks_split_data_and_checkpoint(tmp_path: Path) -> None:
    doc = {
        "model": {"name": "tiny", "model_size": 128 * 1024},
        "workflow": {"generate_data": True, "train": True, "checkpoint": True},
        "dataset": {"data_folder": str(tmp_path / "data"), "format": "npz",
                    "num_files_train": 16, "num_samples_per_file": 1,
                    "record_length_bytes": 32 * 1024},
        "reader": {"batch_size": 2, "read_threads": 1, "file_shuffle": "seed",
                   "sample_shuffle": "seed"},
        "train": {"epochs": 1, "computation_time": 0.005},
        "checkpoint": {"checkpoint_folder": str(tmp_path / "ckpt"),
                       "steps_between_checkpoints": 2, "num_checkpoints_read": 1},
        "output": {"folder": str(tmp_path / "out")},
    }
    cfg = tmp_path / "w.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    env = subprocess_env()
    env.update(OMP_NUM_THREADS="1")
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [torchrun(), "--standalone", "--nproc_per_node", "2", "-m", "lcache", "bench", "run",
           str(cfg), "--json", "--trace"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun ran over {TIMEOUT} s:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    assert proc.returncode == 0, stderr[-4000:]
    summary = json.loads(stdout)  # only rank 0 prints
    assert summary["num_accelerators"] == 2 and len(summary["per_rank"]) == 2
    # 16 samples, batch 2, 2 ranks: 4 steps each; a checkpoint after steps 2 and 4
    assert summary["per_epoch"][0]["steps"] == 4
    saves = [c for c in summary["checkpoints"] if c["kind"] == "save"]
    assert [c["name"] for c in saves] == ["global_epoch1_step2", "global_epoch1_step4"]
    assert summary["metric"]["checkpoint_size_GB"] * 2**30 == 2 * 128 * 1024
    for c in summary["checkpoints"]:
        assert c["bytes"] == 2 * 128 * 1024  # both ranks' shards
        assert c["duration_s"] >= c["slowest_rank"]  # barrier to barrier covers every rank
    for name in ("global_epoch1_step2", "global_epoch1_step4"):
        assert sorted(p.name for p in (tmp_path / "ckpt" / name).iterdir()) == [
            "model_states-0", "model_states-1"]
    # the ranks read disjoint halves of the dataset, together all of it
    out = tmp_path / "out"
    r0, r1 = files_read(out / "trace-rank0.pfw"), files_read(out / "trace-rank1.pfw")
    assert len(r0) == len(r1) == 8 and not (r0 & r1)
    assert r0 | r1 == {p.name for p in (tmp_path / "data" / "train").iterdir()}
    # AU is the mean over ranks, samples/s the sum (DLIO's allreduce)
    ranks = [r["epochs"]["1"] for r in summary["per_rank"]]
    assert summary["per_epoch"][0]["au_percentage"] == pytest.approx(
        sum(r["au_percentage"] for r in ranks) / 2)
    assert summary["per_epoch"][0]["throughput_samples_per_second"] == pytest.approx(
        sum(r["throughput_samples_per_second"] for r in ranks))
