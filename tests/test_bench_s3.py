"""DLIO's S3 workloads (``storage_type: s3`` with ``storage_options``) against a real
``moto_server`` on loopback: the dataset is written and read through fsspec, with DLIO's object
names, and every byte read is an object's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lcache.bench import BenchOptions, load_workload, run_workload
from lcache.errors import ConfigError

from .conftest import moto_s3

DLIO = Path(__file__).parent / "data" / "dlio" / "dlio_benchmark"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_s3() as url:
        yield url


def shrunk(name: str, endpoint: str, bucket: str, tmp: Path, *more: str) -> list[str]:
    return [f"storage.storage_options.endpoint_url={endpoint}",
            f"dataset.data_folder=s3://{bucket}", "dataset.num_files_train=6",
            "dataset.record_length_bytes=32768", "reader.batch_size=2", "train.epochs=2",
            "train.computation_time=0.002", f"output.folder={tmp / 'out'}", *more]


@pytest.mark.parametrize(("name", "suffix"), [("unet3d_h100_s3", "npz"),
                                              ("unet3d_v100_s3", "npy")])
def test_published_s3_workload_writes_and_reads_objects(s3_endpoint: str, tmp_path: Path,
                                                        name: str, suffix: str) -> None:
    import s3fs

    bucket = name.replace("_", "-")
    w = load_workload(str(DLIO / f"{name}.yaml"), shrunk(name, s3_endpoint, bucket, tmp_path))
    assert w.storage_options["access_key_id"] == "access-key"  # the file's own options
    s = run_workload(w, BenchOptions(show_progress=False))
    fs = s3fs.S3FileSystem(key="access-key", secret="secret-key", endpoint_url=s3_endpoint,
                           skip_instance_cache=True)
    objects = {p: info["size"] for p, info in fs.find(bucket, detail=True).items()}
    assert sorted(objects) == [f"{bucket}/train/img_{i}_of_6.{suffix}" for i in range(6)]
    assert s["generated"] == {"files": 6, "bytes": sum(objects.values())}
    # 6 samples, batch 2: 3 steps an epoch, each object read whole once per epoch
    assert [e["steps"] for e in s["per_epoch"]] == [3, 3]
    assert [e["bytes_read"] for e in s["per_epoch"]] == [sum(objects.values())] * 2
    assert s["data_folder"] == f"s3://{bucket}" and not s["potential_caching"]
    # a second run keeps the objects and reads them again
    again = run_workload(w, BenchOptions(show_progress=False))
    assert again["generated"]["files"] == 0 and again["per_epoch"][0]["bytes_read"] == sum(
        objects.values())


def test_s3_refusals_are_one_clear_error(s3_endpoint: str, tmp_path: Path) -> None:
    path = str(DLIO / "unet3d_h100_s3.yaml")
    with pytest.raises(ConfigError, match="read npz and npy from S3"):
        load_workload(path, ["dataset.format=indexed_binary"])
    with pytest.raises(ConfigError, match="checkpoints on S3 are not emulated"):
        load_workload(path, ["workflow.checkpoint=True"])
    nowhere = load_workload(path, shrunk("x", "http://127.0.0.1:1", "nowhere", tmp_path,
                                         "storage.storage_options.s3_max_attempts=1"))
    with pytest.raises(ConfigError, match="cannot reach or create the bucket nowhere"):
        run_workload(nowhere, BenchOptions(show_progress=False))
