"""Round trip: a known lcache bench workload, traced, advised; the emitted workload reproduces
its bytes per step per class, request sizes and mix. (AU, a timing, is compared by
benchmarks/advise_roundtrip.py, not here.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lcache.advise import advise
from lcache.bench import BenchOptions, parse_workload, run_workload

ORIGINAL: dict[str, Any] = {
    "model": {"name": "known", "model_size_bytes": 1 << 20},
    "framework": "pytorch",
    "workflow": {"generate_data": True, "train": True, "checkpoint": True},
    "dataset": {"format": "npy", "num_files_train": 24, "num_samples_per_file": 1,
                "record_length_bytes": 65536},
    "reader": {"data_loader": "pytorch", "batch_size": 2, "read_threads": 1,
               "prefetch_size": 2},
    "train": {"epochs": 1, "computation_time": 0.01},
    "checkpoint": {"steps_between_checkpoints": 4, "fsync": True},
}


def _run(doc: dict[str, Any], where: Path) -> tuple[dict[str, Any], Path]:
    summary = run_workload(parse_workload(doc), BenchOptions(
        data_dir=str(where / "data"), output=str(where / "out"),
        checkpoint_dir=str(where / "ckpt"), generate=True, trace=True, show_progress=False))
    return summary, where / "out" / "trace-rank0.pfw"


def test_round_trip_compute_bound(tmp_path: Path) -> None:
    _, trace = _run(ORIGINAL, tmp_path / "a")
    doc = advise(trace)
    w = doc["workload"]["doc"]
    assert doc["fit"]["steps"]["source"] == "markers", doc["unfitted"]  # the bench marks steps
    assert w["reader"]["batch_size"] == 2 and w["reader"]["read_threads"] == 1
    assert w["dataset"]["num_files_train"] == 24 and w["train"]["epochs"] == 1
    # The compute the markers measured: the bench's sleep, never less.
    assert w["train"]["computation_time"] >= 0.01
    assert w["checkpoint"]["steps_between_checkpoints"] == 4
    assert w["model"]["model_size_bytes"] == 1 << 20
    _, trace2 = _run(w, tmp_path / "b")
    again = advise(trace2)["fit"]["groups"]
    for name, g in doc["fit"]["groups"].items():
        for key in ("read_bytes_per_step", "write_bytes_per_step", "size_p50"):
            assert again[name][key] == pytest.approx(g[key], rel=0.10), (name, key)
        assert again[name]["read_fraction"] == pytest.approx(g["read_fraction"], abs=0.1)


def test_reads_in_the_training_loop_stay_there(tmp_path: Path) -> None:
    """Reads made by the training thread itself (read_threads 0): the markers give the compute,
    and the emitted workload reads in its loop too, not ahead of it in reader threads."""
    doc = {**ORIGINAL, "reader": {**ORIGINAL["reader"], "read_threads": 0, "prefetch_size": 0},
           "workflow": {"generate_data": True, "train": True}}
    doc.pop("checkpoint")
    _, trace = _run(doc, tmp_path / "a")
    fitted = advise(trace)
    assert fitted["fit"]["steps"]["source"] == "markers"
    assert fitted["fit"]["steps"]["reads_in_training_thread"] is True
    assert fitted["workload"]["doc"]["reader"]["read_threads"] == 0


@pytest.mark.parametrize("dataset", [
    {"format": "npy", "num_files_train": 64, "num_samples_per_file": 1,
     "record_length_bytes": 256},
    {"format": "indexed_binary", "num_files_train": 8, "num_samples_per_file": 16,
     "record_length_bytes": 4096},
], ids=["npy", "indexed_binary"])
def test_the_emitted_dataset_is_the_original(tmp_path: Path, dataset: dict[str, Any]) -> None:
    """The findings: npy files read whole carry np.save's 128-byte header, which the emitted
    record length kept (each round trip grew samples by 128 bytes: 256 became 384), and the
    index files of an indexed binary dataset were read as samples (8 files of 16 became 24
    of 6, records 3,655 +- 1,247 bytes, a checkpoint every 10 steps instead of 8)."""
    doc = {**ORIGINAL, "dataset": dataset,
           "reader": {**ORIGINAL["reader"], "batch_size": 4, "read_threads": 2},
           "checkpoint": {"steps_between_checkpoints": 8}}
    _, trace = _run(doc, tmp_path / "a")
    w = advise(trace)["workload"]["doc"]
    assert {k: w["dataset"][k] for k in dataset} == dataset
    assert w["reader"]["batch_size"] == 4
    assert w["checkpoint"]["steps_between_checkpoints"] == 8
