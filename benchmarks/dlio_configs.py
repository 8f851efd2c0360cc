"""Every published DLIO and MLPerf Storage workload file through ``lcache bench run``, shrunk.

    python benchmarks/dlio_configs.py --json

Runs the 37 files of tests/data/dlio (DLIO's 24 ``configs/workload/*.yaml``, MLPerf Storage's
13 ``configs/dlio/workload/*.yaml``) unchanged, each with size overrides only (``shrink``):
at most 8 files of 16 samples of 64 KiB, batches of 4, 2 epochs of 5 ms steps, checkpoints of
a transformer of a few MiB every 2 steps, 2 checkpoint writes and reads. Files whose tensor x
pipeline parallelism needs more ranks than this one process run in MLPerf Storage's subset
mode (``checkpoint.mode=subset``, ``model.parallelism.data``: MLPerf's value for its llama3
files, else 1); the S3 files run against a ``moto_server`` on loopback (``pip install
'moto[server]'``). Data is generated first (``--generate``), as a storage engineer would.

Prints one row per file, ``{config, result, seconds, notes}``: ``result`` is ``ran``,
``refused: MESSAGE`` (a clear ConfigError) or ``failed: ERROR``; ``notes`` are the verdict,
the run's notes and the overrides. Exit status 1 unless every file ran. tests/test_bench_
published.py parses every file with the same overrides.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = REPO / "tests" / "data" / "dlio"
sys.path.insert(0, str(REPO / "src"))

from lcache.bench import BenchOptions, load_workload, run_workload  # noqa: E402
from lcache.errors import ConfigError  # noqa: E402

# MLPerf Storage's data-parallel width of the whole job, which subset mode needs
# (mlcommons/storage mlpstorage/config.py LLM_ALLOWED_VALUES: closed GPUs / GPUs per DP).
MLPERF_DATA_PARALLEL = {"llama3_70b": 8, "llama3_405b": 2, "llama3_1t": 2}
KIB = 1024


def published() -> list[Path]:
    """The 37 published files, DLIO's then MLPerf Storage's, by name."""
    return sorted((PUBLISHED / "dlio_benchmark").glob("*.yaml")) + sorted(
        (PUBLISHED / "mlperf_storage").glob("*.yaml"))


def label(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def shrink(path: Path, work: Path, endpoint: str = "http://127.0.0.1:1") -> list[str]:
    """Size overrides (and where to write) that make ``path`` run in seconds on one rank."""
    w = load_workload(str(path))
    sets = {
        "dataset.num_files_train": min(w.num_files_train, 8),
        "dataset.num_files_eval": min(w.num_files_eval, 4),
        "dataset.num_samples_per_file": min(w.num_samples_per_file, 16),
        "dataset.record_length_bytes": min(w.record_length, 64 * KIB),
        "reader.batch_size": min(w.batch_size, 4),
        "reader.batch_size_eval": min(w.batch_size_eval, 2),
        "train.epochs": min(w.epochs, 2),
        "train.computation_time": min(w.computation_time, 0.005),
        "evaluation.eval_time": min(w.eval_time, 0.005),
        "checkpoint.checkpoint_after_epoch": min(w.checkpoint_after_epoch, 2),
        "checkpoint.time_between_checkpoints": 0,
        "model.model_size_bytes": min(w.model_size, 64 * KIB),
        "output.folder": work / "out",
        "checkpoint.checkpoint_folder": work / "ckpt",
    }
    if w.steps_between_checkpoints > 0:
        sets["checkpoint.steps_between_checkpoints"] = 2
    for key in ("num_checkpoints_write", "num_checkpoints_read"):
        if getattr(w, key) > 0:
            sets[f"checkpoint.{key}"] = min(getattr(w, key), 2)
    if w.num_layers > 0:
        sets.update({"model.num_layers": max(w.pipeline_parallelism, min(w.num_layers, 4)),
                     "model.transformer.hidden_size": 64,
                     "model.transformer.ffn_hidden_size": 128,
                     "model.transformer.vocab_size": 256,
                     "model.transformer.num_attention_heads": 4,
                     "model.transformer.num_kv_heads": 2})
    for key in ("layer_parameters", "optimization_groups"):
        if getattr(w, key):
            sets[f"model.{key}"] = "[" + ",".join(
                str(min(v, 16 * KIB)) for v in getattr(w, key)) + "]"
    if w.tensor_parallelism * w.pipeline_parallelism > 1:
        sets["checkpoint.mode"] = "subset"
        sets["model.parallelism.data"] = MLPERF_DATA_PARALLEL.get(path.stem, 1)
    if w.on_s3:
        sets["storage.storage_options.endpoint_url"] = endpoint
    else:
        sets["dataset.data_folder"] = work / "data"
    return [f"{k}={v}" for k, v in sets.items()]


@contextlib.contextmanager
def moto_server() -> Iterator[str | None]:
    """A moto S3 server on loopback for the S3 files (None when moto is not installed)."""
    exe = Path(sys.executable).with_name("moto_server")
    if not exe.exists():
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                opener.open(url + "/moto-api/", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    yield None
                    return
                time.sleep(0.1)
        for name, value in (("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "y")):
            os.environ.setdefault(name, value)
        yield url
    finally:
        proc.kill()
        proc.wait(30)


def run_one(path: Path, work: Path, endpoint: str | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    row: dict[str, Any] = {"config": label(path)}
    try:
        sets = shrink(path, work, endpoint or "http://127.0.0.1:1")
        w = load_workload(str(path), sets)
        if w.on_s3 and endpoint is None:
            raise ConfigError("no moto_server to stand in for S3: pip install 'moto[server]'")
        s = run_workload(w, BenchOptions(show_progress=False, generate=True))
        row["result"] = "ran"
        row["notes"] = [s["verdict"], *s.get("notes", []), "overrides: " + " ".join(sets)]
    except ConfigError as exc:
        row["result"] = f"refused: {exc}"
    except Exception as exc:  # a crash is a finding: report it, run the others
        row["result"] = f"failed: {type(exc).__name__}: {exc}"
    row["seconds"] = round(time.perf_counter() - t0, 3)
    row.setdefault("notes", [])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print JSON (the only output form)")
    ap.add_argument("--only", action="append", help="run only this config (repeatable), "
                    "e.g. mlperf_storage/unet3d_h100")
    args = ap.parse_args()
    rows = []
    with moto_server() as endpoint:
        for path in published():
            if args.only and label(path) not in args.only:
                continue
            work = Path(tempfile.mkdtemp(prefix=f"dlio-{path.stem}-"))
            try:
                rows.append(run_one(path, work, endpoint))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    ran = sum(r["result"] == "ran" for r in rows)
    print(json.dumps({"ran": ran, "of": len(rows), "rows": rows}, indent=2))
    sys.exit(0 if ran == len(rows) else 1)


if __name__ == "__main__":
    main()
