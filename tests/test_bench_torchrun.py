"""lcache bench under a real ``torchrun --nproc_per_node 2`` (gloo): the ranks split the
samples like a distributed sampler, each writes its checkpoint shard between barriers, and
rank 0's summary aggregates both as DLIO does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lcache.bench import parse_workload
from lcache.bench.order import epoch_order
from lcache.report.load import json_lines

from .conftest import run_torchrun

TIMEOUT = 150


def data_reads(trace: Path) -> int:
    """Bytes of data-source reads in a trace."""
    total = 0
    for line in json_lines(str(trace)):  # binary blocks as JSON lines
        line = line.strip().rstrip(",")
        if line.startswith("{"):
            ev = json.loads(line)
            if ev.get("ph") == "X" and ev["cat"] == "data-source" and ev["name"] == "read":
                total += ev["args"]["ret"]
    return total


@pytest.mark.slow
def test_two_ranks_split_data_and_checkpoint(tmp_path: Path) -> None:
    doc = {
        # ZeRO 1: every rank writes its model state (ZeRO 0: the ranks below tp x pp only)
        "model": {"name": "tiny", "model_size_bytes": 128 * 1024,
                  "parallelism": {"zero_stage": 1}},
        "framework": "pytorch",
        "workflow": {"generate_data": True, "train": True, "checkpoint": True},
        "dataset": {"data_folder": str(tmp_path / "data"), "format": "npz",
                    "num_files_train": 16, "num_samples_per_file": 1,
                    "record_length_bytes": 32 * 1024,
                    # files of different sizes: a rank's bytes tell which files it read
                    "record_length_bytes_stdev": 8 * 1024},
        "reader": {"batch_size": 2, "read_threads": 1, "file_shuffle": "seed",
                   "sample_shuffle": "seed"},
        "train": {"epochs": 1, "computation_time": 0.005},
        "checkpoint": {"checkpoint_folder": str(tmp_path / "ckpt"),
                       "steps_between_checkpoints": 2},
        "output": {"folder": str(tmp_path / "out")},
    }
    cfg = tmp_path / "w.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    stdout, _ = run_torchrun(["-m", "lcache", "bench", "run", str(cfg), "--json", "--trace"],
                             TIMEOUT)
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
            "model_states-0.pt", "model_states-1.pt"]
    # the ranks read disjoint halves of the dataset (the sampler's), together all of it:
    # each rank's bytes are exactly those of the files its half names
    w = parse_workload(doc)
    files = sorted((tmp_path / "data" / "train").iterdir())
    halves = [epoch_order(w, 1, r, 2, 16) for r in range(2)]
    assert not set(halves[0]) & set(halves[1]) and len(set(halves[0]) | set(halves[1])) == 16
    for rank, half in enumerate(halves):
        expect = sum(files[i].stat().st_size for i in half)
        assert summary["per_rank"][rank]["epochs"]["1"]["bytes_read"] == expect
        # and the rank's trace holds those reads (--trace)
        assert data_reads(tmp_path / "out" / f"trace-rank{rank}.pfw") == expect
    # AU is the mean over ranks, samples/s the sum (DLIO's allreduce)
    ranks = [r["epochs"]["1"] for r in summary["per_rank"]]
    assert summary["per_epoch"][0]["au_percentage"] == pytest.approx(
        sum(r["au_percentage"] for r in ranks) / 2)
    assert summary["per_epoch"][0]["throughput_samples_per_second"] == pytest.approx(
        sum(r["throughput_samples_per_second"] for r in ranks))


@pytest.mark.slow
def test_llama3_70b_checkpoints_on_eight_ranks(tmp_path: Path) -> None:
    """MLPerf Storage's llama3_70b (tensor 8, ZeRO 3) on 8 real ranks, shrunk by overrides:
    each rank writes DLIO's files for its tensor-parallel rank, then reads them back."""
    from lcache.bench import checkpoint as ckpt
    from lcache.bench import load_workload

    cfg = Path(__file__).parent / "data" / "dlio" / "mlperf_storage" / "llama3_70b.yaml"
    sets = ["model.num_layers=2", "model.transformer.hidden_size=64",
            "model.transformer.ffn_hidden_size=128", "model.transformer.vocab_size=256",
            "model.transformer.num_attention_heads=4", "model.transformer.num_kv_heads=2",
            "checkpoint.num_checkpoints_write=1", "checkpoint.num_checkpoints_read=1",
            "checkpoint.time_between_checkpoints=0",
            f"checkpoint.checkpoint_folder={tmp_path / 'ck'}", f"output.folder={tmp_path / 'o'}"]
    args = [a for s in sets for a in ("--set", s)]
    stdout, _ = run_torchrun(["-m", "lcache", "bench", "run", str(cfg), "--json", *args],
                             TIMEOUT, nproc=8)
    summary = json.loads(stdout)
    assert summary["num_accelerators"] == 8
    assert [(c["kind"], c["name"]) for c in summary["checkpoints"]] == [
        ("save", "global_epoch1_step1"), ("load", "global_epoch1_step1")]
    names = sorted(p.name for p in (tmp_path / "ck" / "global_epoch1_step1").iterdir())
    assert names == sorted(f"zero_pp_rank_0_mp_rank_{r}_{k}_states.pt" for r in range(8)
                           for k in ("model", "optim"))
    w = load_workload(str(cfg), sets)
    whole = ckpt.total_bytes(w, 8)
    assert summary["metric"]["checkpoint_size_GB"] * 2**30 == whole
    assert sum(p.stat().st_size for p in (tmp_path / "ck").rglob("*.pt")) == whole
    assert all(c["bytes"] == whole for c in summary["checkpoints"])
