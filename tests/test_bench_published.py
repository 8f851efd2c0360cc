"""Every published DLIO (24) and MLPerf Storage (13) workload file, as checked in under
tests/data/dlio, goes through lcache's parser: unchanged, and with the size overrides of
benchmarks/dlio_configs.py (which runs them all). None is refused. The rank-hungry llama files
run in MLPerf's subset mode on one rank; the whole job's checkpoint is DLIO's size."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from lcache.bench import BenchOptions, load_workload, run_workload
from lcache.bench import checkpoint as ckpt

DATA = Path(__file__).parent / "data" / "dlio"
FILES = sorted(DATA.glob("*/*.yaml"))
GIB = 2**30


def _configs_benchmark() -> ModuleType:
    """benchmarks/dlio_configs.py, whose ``shrink`` the test shares."""
    path = Path(__file__).parents[1] / "benchmarks" / "dlio_configs.py"
    spec = importlib.util.spec_from_file_location("dlio_configs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONFIGS = _configs_benchmark()


def test_every_published_file_is_here_with_its_source() -> None:
    assert len(list((DATA / "dlio_benchmark").glob("*.yaml"))) == 24
    assert len(list((DATA / "mlperf_storage").glob("*.yaml"))) == 13
    readme = (DATA / "README.md").read_text()
    for commit in ("e1919d7b6ccffbe15143cd616517da9e5d7b26a7",
                   "caa90c9c7d6a543de815222fff834a846823f922"):
        assert commit in readme
    assert (DATA / "dlio_benchmark" / "LICENSE").read_text().lstrip().startswith(
        "Apache License")
    assert (DATA / "mlperf_storage" / "LICENSE.md").read_text().lstrip().startswith(
        "Apache License")


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_published_file_parses_unchanged_and_shrunk(path: Path, tmp_path: Path) -> None:
    w = load_workload(str(path))
    assert w.do_train or w.do_checkpoint or w.generate_data
    small = load_workload(str(path), CONFIGS.shrink(path, tmp_path))
    assert small.num_files_train <= 8 and small.record_length <= 64 * 1024
    if w.tensor_parallelism * w.pipeline_parallelism > 1:
        assert small.checkpoint_mode == "subset"


@pytest.mark.parametrize(("name", "data", "job_gib"), [
    ("llama3_405b", 2, 5292.2), ("llama3_1t", 2, 15426.6)])
def test_rank_hungry_llama_runs_a_subset(name: str, data: int, job_gib: float,
                                         tmp_path: Path) -> None:
    """MLPerf's subset mode: this rank writes its share of a 512- or 1024-rank job."""
    path = DATA / "mlperf_storage" / f"{name}.yaml"
    full = load_workload(str(path), ["checkpoint.mode=subset",
                                     f"model.parallelism.data={data}"])
    assert ckpt.job_bytes(full, 1) / GIB == pytest.approx(job_gib, rel=1e-4)
    # rank 0 is tensor rank 0 of pipeline stage 0: the embedding and its stage's layers
    names = [f.name for f in ckpt.rank_files(full, 0, 1)]
    assert names[0] == "layer_0-model_0_model_states.pt" and names[-1].endswith(
        "zero_pp_rank_0_mp_rank_0_optim_states.pt")
    w = load_workload(str(path), CONFIGS.shrink(path, tmp_path))
    s = run_workload(w, BenchOptions(show_progress=False))
    assert [c["kind"] for c in s["checkpoints"]] == ["save", "save", "load", "load"]
    assert s["metric"]["checkpoint_size_GB"] * GIB == ckpt.total_bytes(w, 1)
    assert s["checkpoint_job_size_GB"] * GIB == ckpt.job_bytes(w, 1) > ckpt.total_bytes(w, 1)
