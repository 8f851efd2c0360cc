"""lcache bench side by side with DLIO itself, on the same YAML and the same data directory.

    python benchmarks/dlio_compare.py --json

1. Installs dlio-benchmark 2.0.0 into its own virtual environment (default
   /var/tmp/dlio-venv) the way that works (../shared/DESIGN.md): Debian's openmpi-bin and
   libopenmpi-dev, ``pip install --no-deps dlio-benchmark==2.0.0`` (a plain install fails on
   its ``nvidia-dali-cuda110`` stub dependency), then its real dependencies by hand.
2. For each workload writes one YAML file that both tools accept (DLIO 2.0.0 ignores keys it
   does not know; lcache refuses them, so only keys both read are used), runs DLIO under
   ``mpirun`` (it generates the data), then ``lcache bench run`` on the same file and data.
   The page cache is dropped before each run.
3. Prints both tools' figures and the ratios lcache / DLIO as JSON.

Workloads: ``unet3d_small`` (npz, compute-bound: storage is not the bottleneck, AU and samples/s
should agree within 10%), ``unet3d_readbound`` (large samples, 1 ms of compute: the read path is
the bottleneck, both should fail AU), ``checkpoint_small`` (training with a 512 MiB checkpoint
every 5 steps; DLIO 2.0.0 records checkpoint durations only in per_epoch_stats.json, at 10 ms
resolution, and has no checkpoint read phase), ``llama_checkpoint`` (MLPerf's checkpoint-only
llama3 workflow, shrunk to a 1.7 GiB ZeRO-3 checkpoint: 2 writes then 2 reads). DLIO 2.0.0 has
no checkpoint-only workflow, so that one runs a newer DLIO: ``--dlio-src`` names a local
checkout of argonne-lcf/dlio_benchmark (MLPerf Storage v2.0 pins its ``mlperf_storage_v2.0``
branch), pip-installed into a second venv; without it the row says it was skipped. Newer DLIO
never fsyncs a checkpoint (it reads ``checkpoint.fsync`` into a misspelled attribute), so the
file sets ``fsync: False`` for both.

Both run ``framework: pytorch`` (MLPerf's unet3d setting), so DLIO needs torch in its
environment too (PyPI's build, several GB). With ``framework: tensorflow`` DLIO 2.0.0 writes
empty checkpoints: its TF checkpointing hands ``tf.train.Checkpoint`` a plain tensor, which is
not trackable, so 4 "512 MiB" checkpoints put 2.7 KB on disk (measured here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DLIO_DEPS = ["Pillow", "PyYAML", "h5py", "mpi4py", "numpy", "omegaconf", "pandas", "psutil",
             "pydftracer==1.0.2", "hydra-core", "tensorflow-cpu", "torch"]


def workloads(work: Path) -> dict[str, dict[str, Any]]:
    base: dict[str, Any] = {"framework": "pytorch",
            "reader": {"data_loader": "pytorch", "file_shuffle": "seed",
                       "sample_shuffle": "seed"},
            "metric": {"au": 0.90}}
    return {
        "unet3d_small": {**base, "model": {"name": "unet3d_small"},
                         "workflow": {"generate_data": True, "train": True},
                         "dataset": {"data_folder": str(work / "data" / "unet3d_small"),
                                     "format": "npz", "num_files_train": 160,
                                     "num_samples_per_file": 1, "record_length": 1048576},
                         "reader": {**base["reader"], "batch_size": 4, "read_threads": 2},
                         "train": {"epochs": 2, "computation_time": 0.1}},
        "unet3d_readbound": {**base, "model": {"name": "unet3d_readbound"},
                             "workflow": {"generate_data": True, "train": True},
                             "dataset": {"data_folder": str(work / "data" / "readbound"),
                                         "format": "npz", "num_files_train": 64,
                                         "num_samples_per_file": 1,
                                         "record_length": 16777216},
                             "reader": {**base["reader"], "batch_size": 4, "read_threads": 2},
                             "train": {"epochs": 2, "computation_time": 0.001}},
        # ZeRO 1: every lcache rank writes its model state, as 2.0.0's all_ranks (which
        # ignores model.parallelism)
        "checkpoint_small": {**base, "model": {"name": "checkpoint_small",
                                               "parallelism": {"zero_stage": 1}},
                             "workflow": {"generate_data": True, "train": True,
                                          "checkpoint": True},
                             "dataset": {"data_folder": str(work / "data" / "ckpt_small"),
                                         "format": "npz", "num_files_train": 40,
                                         "num_samples_per_file": 1, "record_length": 65536},
                             "reader": {**base["reader"], "batch_size": 2, "read_threads": 1},
                             "train": {"epochs": 1, "computation_time": 0.05},
                             "checkpoint": {"checkpoint_folder": "PLACEHOLDER",
                                            "steps_between_checkpoints": 5,
                                            "model_size": 536870912,
                                            # 2.0.0's default is rank_zero; with all_ranks
                                            # every rank writes there
                                            "type": "all_ranks",
                                            # DLIO 2.0.0 never fsyncs (and ignores the key)
                                            "fsync": False}},
        "llama_checkpoint": {
            "framework": "pytorch",
            "model": {"name": "llama_checkpoint", "type": "transformer", "num_layers": 4,
                      "model_datatype": "fp16", "optimizer_datatype": "fp32",
                      "parallelism": {"tensor": 1, "pipeline": 1, "zero_stage": 3},
                      "transformer": {"vocab_size": 32000, "hidden_size": 1024,
                                      "ffn_hidden_size": 4096, "num_attention_heads": 16,
                                      "num_kv_heads": 8}},
            "workflow": {"generate_data": False, "train": False, "checkpoint": True},
            "checkpoint": {"checkpoint_folder": "PLACEHOLDER", "time_between_checkpoints": 1,
                           "num_checkpoints_write": 2, "num_checkpoints_read": 2,
                           "fsync": False}},
    }


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no output"


def sh(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
       cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd, check=False)


# Workloads DLIO 2.0.0 cannot run (it has no checkpoint-only workflow): run by --dlio-src.
NEEDS_NEWER_DLIO = {"llama_checkpoint"}


def install(venv: Path, source: str = "dlio-benchmark==2.0.0") -> dict[str, Any]:
    """Install DLIO (2.0.0 from PyPI, or a local checkout) and OpenMPI; returns what was done
    and what failed, exactly."""
    steps: list[dict[str, Any]] = []

    def step(name: str, cmd: list[str], timeout: float = 1200) -> bool:
        t0 = time.time()
        res = sh(cmd, timeout)
        steps.append({"step": name, "cmd": " ".join(cmd), "rc": res.returncode,
                      "seconds": round(time.time() - t0, 1),
                      "tail": (res.stdout + res.stderr)[-1500:] if res.returncode else ""})
        return res.returncode == 0

    ok = True
    if shutil.which("mpirun") is None:
        ok = step("apt-get update", ["apt-get", "update"]) and step(
            "openmpi", ["apt-get", "install", "-y", "openmpi-bin", "libopenmpi-dev"])
    if ok and not (venv / "bin" / "dlio_benchmark").exists():
        ok = (step("venv", [sys.executable, "-m", "venv", str(venv)])
              and step("dlio-benchmark (no deps)", [str(venv / "bin" / "pip"), "install",
                                                    "--no-deps", source])
              and step("dlio dependencies", [str(venv / "bin" / "pip"), "install",
                                             *DLIO_DEPS]))
    return {"ok": ok and (venv / "bin" / "dlio_benchmark").exists(), "steps": steps}


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_dlio(venv: Path, conf: Path, name: str, out: Path, ranks: int,
             timeout: float, batch_size: int) -> dict[str, Any]:
    env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ['PATH']}",
               TF_CPP_MIN_LOG_LEVEL="3", OMPI_MCA_btl_vader_single_copy_mechanism="none")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np",
           str(ranks), str(venv / "bin" / "dlio_benchmark"), "--config-dir", str(conf),
           f"workload={name}", f"++workload.output.folder={out}", f"hydra.run.dir={out}"]
    t0 = time.time()
    res = sh(cmd, timeout, env=env)
    wall = time.time() - t0
    doc: dict[str, Any] = {"cmd": " ".join(cmd), "rc": res.returncode,
                           "wall_s": round(wall, 2)}
    summary = out / "summary.json"
    if res.returncode or not summary.exists():
        doc["error"] = (res.stdout + res.stderr)[-3000:]
        return doc
    s = json.loads(summary.read_text())
    s["batch_size"] = batch_size
    doc["metric"] = s.get("metric", {})
    # DLIO 2.0.0 writes per_epoch_stats.json, newer DLIO one {rank}_per_epoch_stats.json each
    stats_file = out / "per_epoch_stats.json"
    if not stats_file.exists():
        stats_file = out / "0_per_epoch_stats.json"
    stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    # DLIO 2.0.0 prints durations with 2 decimals; the ISO start/end stamps beside them are
    # exact. Newer DLIO has the save_/load_checkpoint_* keys in its summary.
    ckpt = [_span(v) for e in stats.values() if isinstance(e, dict)
            for k, v in e.items() if k.startswith("ckpt") and "end" in v]
    if ckpt and "save_checkpoint_duration_mean_seconds" not in doc["metric"]:
        doc["save_checkpoint_durations_s"] = ckpt
        doc["metric"]["save_checkpoint_duration_mean_seconds"] = sum(ckpt) / len(ckpt)
    steady = _steady_throughput(out, stats, ranks, s)
    if steady is not None:
        doc["metric"]["train_throughput_steady_mean_samples_per_second"] = steady
    return doc


def _span(entry: dict[str, Any]) -> float:
    from datetime import datetime

    t0, t1 = (datetime.fromisoformat(entry[k]) for k in ("start", "end"))
    return (t1 - t0).total_seconds()


def _steady_throughput(out: Path, stats: dict[str, Any], ranks: int,
                       summary: dict[str, Any]) -> float | None:
    """DLIO's own step timings with the first step of each block left out.

    DLIO 2.0.0 divides all steps by the whole block, so the first step, which waits for the
    DataLoader workers to start (seconds with torch), weighs on samples/s; newer DLIO
    excludes it (metric.exclude_start_steps = 1), as lcache does. Same timings, newer formula.
    """
    try:
        outputs = [json.loads((out / f"{r}_output.json").read_text()) for r in range(ranks)]
        batch = int(summary.get("batch_size") or 0) or None
    except (OSError, ValueError):
        return None
    per_epoch = []
    for epoch, entry in stats.items():
        if not isinstance(entry, dict):
            continue
        total = 0.0
        for o in outputs:  # per rank: steps over time, blocks pooled; ranks add up
            steps, wall = 0, 0.0
            for block, times in o.get(epoch, {}).get("proc", {}).items():
                if block not in entry or "end" not in entry[block] or len(times) < 2:
                    continue
                steps += len(times) - 1
                wall += _span(entry[block]) - times[0]
            total += steps / wall if wall > 0 else 0.0
        per_epoch.append(total)
    if not per_epoch or batch is None:
        return None
    return batch * sum(per_epoch) / len(per_epoch)


def run_lcache(cfg: Path, out: Path, ranks: int, timeout: float) -> dict[str, Any]:
    base = [sys.executable, "-m", "lcache"]
    if ranks > 1:
        base = [str(Path(sys.executable).parent / "torchrun"), "--standalone",
                "--nproc_per_node", str(ranks), "-m", "lcache"]
    cmd = [*base, "bench", "run", str(cfg), "--no-generate", "--output", str(out), "--json"]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    t0 = time.time()
    res = sh(cmd, timeout, env=env)
    doc: dict[str, Any] = {"cmd": " ".join(cmd), "rc": res.returncode,
                           "wall_s": round(time.time() - t0, 2)}
    if res.returncode:
        doc["error"] = res.stderr[-3000:]
        return doc
    s = json.loads(res.stdout)
    doc["metric"] = s["metric"]
    doc["verdict"] = s["verdict"]
    return doc


KEYS = ("train_au_mean_percentage", "train_throughput_mean_samples_per_second",
        "train_throughput_steady_mean_samples_per_second",
        "train_io_mean_MB_per_second", "save_checkpoint_duration_mean_seconds",
        "load_checkpoint_duration_mean_seconds", "checkpoint_size_GB")


def compare(dlio: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dm, om = dlio.get("metric", {}), ours.get("metric", {})
    for key in KEYS:
        # lcache's samples/s already leaves the first step out: compare it with both of DLIO's
        ours = om.get("train_throughput_mean_samples_per_second"
                      if key == "train_throughput_steady_mean_samples_per_second" else key)
        if isinstance(dm.get(key), (int, float)) and isinstance(ours, (int, float)) and dm[key]:
            out[key] = {"dlio": dm[key], "lcache": ours, "ratio": ours / dm[key]}
    if "train_au_meet_expectation" in dm and "train_au_meet_expectation" in om:
        out["same_verdict"] = dm["train_au_meet_expectation"] == om["train_au_meet_expectation"]
        out["verdicts"] = {"dlio": dm["train_au_meet_expectation"],
                           "lcache": om["train_au_meet_expectation"]}
    return out


def one_run(args: argparse.Namespace, conf: Path, name: str, doc: dict[str, Any],
            tool: str) -> dict[str, Any]:
    import yaml

    ck = args.work / "ckpt" / f"{name}-{tool}"
    shutil.rmtree(ck, ignore_errors=True)
    if "checkpoint" in doc:
        doc["checkpoint"]["checkpoint_folder"] = str(ck)
    cfg = conf / "workload" / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = args.work / "out" / f"{name}-{tool}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    dropped = drop_caches()
    if tool == "dlio":
        venv = args.new_venv if name in NEEDS_NEWER_DLIO else args.venv
        row = run_dlio(venv, conf, name, out, args.ranks, args.timeout,
                       doc.get("reader", {}).get("batch_size", 1))
    else:
        row = run_lcache(cfg, out, args.ranks, args.timeout)
    row["page_cache_dropped"] = dropped
    if ck.exists():  # what the checkpoints really put on disk
        row["checkpoint_bytes_on_disk"] = sum(
            p.stat().st_size for p in ck.rglob("*") if p.is_file())
    shutil.rmtree(ck, ignore_errors=True)
    return row


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of KEYS as medians over the runs that worked (and their verdicts)."""
    ok = [r for r in runs if "metric" in r]
    if not ok:
        return runs[-1]
    metric: dict[str, Any] = {}
    for key in KEYS:
        values = sorted(r["metric"][key] for r in ok if key in r["metric"])
        if values:
            metric[key] = values[len(values) // 2]
    verdicts = [r["metric"].get("train_au_meet_expectation") for r in ok]
    if any(verdicts):
        metric["train_au_meet_expectation"] = max(set(verdicts), key=verdicts.count)
    return {"metric": metric, "runs_ok": len(ok), "verdicts": verdicts,
            "checkpoint_bytes_on_disk": ok[-1].get("checkpoint_bytes_on_disk")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--venv", type=Path, default=Path("/var/tmp/dlio-venv"))
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/dlio-compare"))
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--only", action="append", help="run only this workload (repeatable)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--repeat", type=int, default=3, help="runs per tool; medians reported")
    ap.add_argument("--dlio-src", help="a local checkout of argonne-lcf/dlio_benchmark (e.g. "
                    "its mlperf_storage_v2.0 branch) for the workloads DLIO 2.0.0 cannot run")
    ap.add_argument("--new-venv", type=Path, default=Path("/var/tmp/dlio-new-venv"))
    ap.add_argument("--json", action="store_true", help="print JSON (the only output form)")
    args = ap.parse_args()
    # lcache's runs use this interpreter: without lcache's dependencies every one of them
    # would fail, each with a traceback in its row
    check = subprocess.run([sys.executable, "-c", "import lcache.cli.main"],
                           env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
                           capture_output=True, text=True)
    if check.returncode:
        print(f"lcache cannot run under {sys.executable} ({_last_line(check.stderr)}); run "
              "this script with the repo's venv: .venv/bin/python benchmarks/dlio_compare.py "
              "(make test creates it)", file=sys.stderr)
        sys.exit(2)
    report: dict[str, Any] = {"dlio_version": "2.0.0", "ranks": args.ranks,
                              "note": "one shared 2-core VM; both tools run one after the "
                                      "other on the same files; page cache dropped before "
                                      "each run"}
    report["install"] = install(args.venv)
    if not report["install"]["ok"]:
        report["error"] = "DLIO could not be installed; see install.steps for the failing step"
        print(json.dumps(report, indent=2))
        sys.exit(1)
    conf = args.work / "conf"
    (conf / "workload").mkdir(parents=True, exist_ok=True)
    pkg = args.venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages" / "dlio_benchmark" / "configs"
    shutil.copy(pkg / "config.yaml", conf / "config.yaml")
    shutil.copytree(pkg / "hydra", conf / "hydra", dirs_exist_ok=True)

    chosen = {n: d for n, d in workloads(args.work).items() if not args.only or n in args.only}
    newer_ok = False
    if args.dlio_src and NEEDS_NEWER_DLIO & set(chosen):
        report["install_newer"] = install(args.new_venv, args.dlio_src)
        newer_ok = report["install_newer"]["ok"]
    report["workloads"] = {}
    for name, doc in chosen.items():
        if name in NEEDS_NEWER_DLIO and not newer_ok:
            report["workloads"][name] = {
                "skipped": "DLIO 2.0.0 has no checkpoint-only workflow; give --dlio-src, a "
                           "checkout of a newer DLIO (MLPerf Storage v2.0 pins its "
                           "mlperf_storage_v2.0 branch)"}
            continue
        runs: dict[str, list[dict[str, Any]]] = {"dlio": [], "lcache": []}
        for _ in range(args.repeat):  # interleaved, so drift on a shared host hits both
            for tool in ("dlio", "lcache"):
                runs[tool].append(one_run(args, conf, name, doc, tool))
        row: dict[str, Any] = {"runs": runs}
        row["dlio"], row["lcache"] = median_run(runs["dlio"]), median_run(runs["lcache"])
        row["compare"] = compare(row["dlio"], row["lcache"])
        report["workloads"][name] = row
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
