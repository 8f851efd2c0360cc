"""Round trip of `lcache advise`: trace a known workload, advise it, run what it emits.

For each of three lcache bench workloads (read-bound, compute-bound, checkpoint-heavy):
  1. `lcache trace -o T1 -- lcache bench run W.yaml ...` (the original run, traced);
  2. `lcache advise T1 --emit E.yaml --json` (the fitted, emitted workload);
  3. `lcache trace -o T2 -- lcache bench run E.yaml ...` (the emitted workload, same options);
  4. `lcache advise T2 --json` fits the re-run the same way,
and prints, per class group, the relative error of the re-run against the original in bytes
per step (read and written), request-size p50 and read fraction, and of AU (DLIO's, from the
two summaries). The issue's target is 10% for each.

The demo case: `lcache demo`'s own trace -> `lcache advise --hit-ratio 0.9` -> the capacity
(as a fraction of the dataset) -> `lcache demo --cache-fraction F`: the hit ratio of its warm
epochs (2 and later) should be 0.9 +- 0.05.

    python benchmarks/advise_roundtrip.py --json
    python benchmarks/advise_roundtrip.py --dir /nvme/advise-bench --skip-demo
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

WORKLOADS: dict[str, dict[str, Any]] = {
    # Reads in the training loop (no reader threads), from storage (--drop-cache): each step
    # waits for its batch, AU well under 90%.
    "read-bound": {
        "dataset": {"format": "npy", "num_files_train": 64, "record_length_bytes": 1 << 20},
        "reader": {"batch_size": 4, "read_threads": 0, "prefetch_size": 0},
        "train": {"epochs": 2, "computation_time": 0.01},
    },
    # Reader threads run ahead of 20 ms of compute: AU near 100%.
    "compute-bound": {
        "dataset": {"format": "npy", "num_files_train": 64, "record_length_bytes": 256 << 10},
        "reader": {"batch_size": 4, "read_threads": 2, "prefetch_size": 2},
        "train": {"epochs": 2, "computation_time": 0.02},
    },
    # A 64 MiB checkpoint (fsync) every 4 steps of 10 ms.
    "checkpoint-heavy": {
        "model": {"model_size_bytes": 64 << 20},
        "dataset": {"format": "npy", "num_files_train": 48, "record_length_bytes": 64 << 10},
        "reader": {"batch_size": 2, "read_threads": 1, "prefetch_size": 2},
        "train": {"epochs": 1, "computation_time": 0.01},
        "checkpoint": {"steps_between_checkpoints": 4, "fsync": True},
    },
}
FIGURES = ("read_bytes_per_step", "write_bytes_per_step", "size_p50", "read_fraction")


def _lcache(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LCACHE_TRACE"}
    run = subprocess.run([sys.executable, "-m", "lcache", *args], capture_output=True,
                         text=True, timeout=timeout, env=env)
    if run.returncode != 0:
        raise SystemExit(f"lcache {' '.join(args)} failed ({run.returncode}): "
                         f"{run.stderr.strip()[-500:]}")
    return run


def _doc(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": {"name": name}, "framework": "pytorch",
                           "workflow": {"generate_data": True, "train": True,
                                        "checkpoint": "checkpoint" in spec}}
    for section, keys in spec.items():
        doc.setdefault(section, {}).update(keys)
    doc["reader"]["data_loader"] = "pytorch"
    doc["dataset"]["num_samples_per_file"] = 1
    return doc


def _traced_run(workload: Path, where: Path, tag: str) -> tuple[dict[str, Any], Path]:
    """`lcache bench run` under `lcache trace`: its summary and the trace."""
    trace = where / f"{tag}.trace"
    run = _lcache("trace", "-o", str(trace), "--", sys.executable, "-m", "lcache", "bench",
                  "run", str(workload), "--data-dir", str(where / f"{tag}-data"), "--output",
                  str(where / f"{tag}-out"), "--checkpoint-dir", str(where / f"{tag}-ckpt"),
                  "--drop-cache", "--json")
    return json.loads(run.stdout), trace


def _err(new: float | None, old: float | None) -> float | None:
    if new is None or old is None:
        return None
    if old == 0:
        return 0.0 if new == 0 else None
    return round(abs(new - old) / abs(old), 4)


def round_trip(name: str, spec: dict[str, Any], where: Path) -> dict[str, Any]:
    where.mkdir(parents=True, exist_ok=True)
    original = where / "original.yaml"
    original.write_text(yaml.safe_dump(_doc(name, spec), sort_keys=False))
    first, t1 = _traced_run(original, where, "original")
    emitted = where / "emitted.yaml"
    fit1 = json.loads(_lcache("advise", str(t1), "--emit", str(emitted), "--json").stdout)
    second, t2 = _traced_run(emitted, where, "emitted")
    fit2 = json.loads(_lcache("advise", str(t2), "--json").stdout)
    errors: dict[str, Any] = {}
    for group, g1 in fit1["fit"]["groups"].items():
        g2 = fit2["fit"]["groups"].get(group, {})
        errors[group] = {f: _err(g2.get(f), g1[f]) for f in FIGURES}
    au = [s["metric"].get("train_au_mean_percentage") for s in (first, second)]
    errors["au"] = _err(au[1], au[0])
    worst = max((v for g in errors.values() for v in (g.values() if isinstance(g, dict)
                                                         else [g]) if v is not None),
                default=None)
    return {"workload": name, "au_percent": {"original": au[0], "emitted": au[1]},
            "steps": fit1["fit"]["steps"], "emitted": fit1["workload"]["doc"],
            "notes": fit1["workload"]["notes"], "unfitted": fit1["unfitted"],
            "error": errors, "worst_error": worst,
            "within_10_percent": worst is not None and worst <= 0.10}


def _warm_hit_ratio(figures: dict[str, Any]) -> float:
    rows = [r["hit_ratio"] for r in figures["epochs"] if r["system"] == "lcache"
            and r["epoch"] >= 2]
    return round(sum(rows) / len(rows), 4)


def demo_case(where: Path, samples: int, target: float) -> dict[str, Any]:
    where.mkdir(parents=True, exist_ok=True)
    first = json.loads(_lcache("demo", "--dir", str(where), "--samples", str(samples),
                               "--json").stdout)
    doc = json.loads(_lcache("advise", first["report"]["trace"], "--hit-ratio", str(target),
                             "--json").stdout)
    cap = doc["advice"][0]
    again = json.loads(_lcache("demo", "--dir", str(where), "--samples", str(samples),
                               "--cache-fraction", str(cap["fraction_of_dataset"]),
                               "--json").stdout)
    hit = _warm_hit_ratio(again)
    return {"samples": samples, "target_hit_ratio": target,
            "advised_capacity_bytes": cap["value"],
            "advised_fraction_of_dataset": cap["fraction_of_dataset"],
            "arithmetic": cap["arithmetic"], "unfitted": doc["unfitted"],
            "measured_hit_ratio_warm_epochs": hit,
            "first_run_hit_ratio_warm_epochs": _warm_hit_ratio(first),
            "first_run_cache_fraction": first["cache_fraction"],
            "within_0_05": abs(hit - target) <= 0.05}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="Where to run (default: a temporary folder).")
    p.add_argument("--demo-samples", type=int, default=2000)
    p.add_argument("--hit-ratio", type=float, default=0.9)
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--only", choices=sorted(WORKLOADS), action="append",
                   help="Run only this workload (repeatable).")
    p.add_argument("--json", action="store_true", help="Print the result as JSON.")
    args = p.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="lcache-advise-bench-"))
    try:
        out: dict[str, Any] = {"workloads": [
            round_trip(name, spec, root / name) for name, spec in WORKLOADS.items()
            if not args.only or name in args.only]}
        if not args.skip_demo:
            out["demo"] = demo_case(root / "demo", args.demo_samples, args.hit_ratio)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for w in out["workloads"]:
        print(f"{w['workload']}: worst error {w['worst_error']}, AU {w['au_percent']}")
        for group, e in w["error"].items():
            print(f"  {group}: {e}")
    if "demo" in out:
        d = out["demo"]
        print(f"demo: advised {d['advised_fraction_of_dataset']} x dataset for "
              f"{d['target_hit_ratio']}; measured {d['measured_hit_ratio_warm_epochs']}")


if __name__ == "__main__":
    main()
