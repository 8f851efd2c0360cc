"""Epoch time and remote traffic of lcache against the caching data loaders people use instead.

One synthetic dataset (``--samples`` x ``--sample-size``, one file per sample, also written
as MDS shards for mosaicml-streaming and as litdata chunks) is served by one throttled
loopback server (``lcache.testing.remote.ThrottledServer``: ``--latency`` per request,
``--bandwidth`` shared by all connections). Each system, at each cache fraction, runs
``--epochs`` epochs of a torch DataLoader (``--workers`` workers, shuffled, same batch size)
in its own process, with a fresh cache directory:

  lcache              CachedDataset + SeedAwareSampler (capacity = fraction x dataset bytes)
  none                the same files read from the remote every time (no cache)
  mosaicml-streaming  StreamingDataset over MDS shards, cache_limit = fraction x shard bytes
  litdata             StreamingDataset over optimized chunks, max_cache_size = fraction x
                      chunk bytes
  fsspec-filecache    fsspec ``filecache::`` over the sample files: NO size limit (it has no
                      eviction), so every fraction is the same run for it
  opt                 not run: Belady/OPT's hit ratio on lcache's 3-epoch order
                      (``lcache.data.plan``), the most any cache of that size can hit

    python benchmarks/cache_bench.py --json                     # --shape objects
    python benchmarks/cache_bench.py --shape shards --json
    python benchmarks/cache_bench.py --shape scarce --json
    python benchmarks/cache_bench.py --samples 20000 --sample-size 128KiB --latency 0.02

Three source shapes (``--shape``; the flags override a shape's figures):

  objects  3,000 x 32 KiB samples, one object each; 3 ms per request, 200 MB/s; the peers'
           shards of 1 MiB
  shards   the same samples in 4 MiB shards: lcache reads WebDataset tars (written here with
           the standard library's tarfile, as WebDataset's TarWriter does) in a shard-local
           order (``shard_window=4``, as litdata shuffles chunks), the peers their own 4 MiB
           shards (``none`` and fsspec-filecache still read one object per sample)
  scarce   1,500 x 128 KiB samples, one object each; 5 ms per request, 50 MB/s

Every epoch row carries ``floor_s``, the least time the epoch's traffic allows,
``max(missed bytes / bandwidth, requests x latency / 32 in flight, hit bytes / SSD random
read bandwidth at the sample size (fio, O_DIRECT))`` (no compute: the loop only collates),
``over_floor`` (seconds / floor_s) and ``floor_by``, the term that sets it: a system far over
its floor is limited by something else (CPU, its own concurrency). ``create_us`` is what
creating a file in the cache directory cost just before the system's run: each run waits
(up to ``SETTLE_WAIT_S``) for it to fall under ``SETTLED_US``, since on this project's VM it
rose from 20 us to 0.3-1 ms for a while after a run removed its files, and moved lcache's
epochs by up to 1.6x (``settle_wait_s``: how long it waited).

The peers live in their own venv (``--venv``, created on first use from
``benchmarks/requirements-peers.txt``, torch pinned to the local CPU build), never in the
package's requirements; lcache is installed there too (editable), so every system runs with
the same torch, numpy and fsspec. A system that cannot run keeps its rows, with an "error".
What each peer needed to read this remote at all is said where it is done, in ``_peers.py``.

remote_bytes is what the server sent during the epoch (counted at the server). hit_ratio is
1 - remote_bytes / sample bytes the epoch served, for every system alike: the share of the
epoch's data that did not cross the network in that epoch (negative: more was fetched than
served, e.g. whole shards for a few samples). With equal sample sizes it is the sample hit
ratio, comparable to opt's. At the end the issue's targets are checked (``"summary"`` rows,
also on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _sysbench as sb
import numpy as np
from _peers import SAMPLES_DIR, WDS_DIR
from rich.console import Console
from rich.table import Table

from lcache.data.order import node_order
from lcache.data.plan import belady, simulate_opt
from lcache.store import parse_size
from lcache.testing import remote

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PEER_SCRIPT = HERE / "_peers.py"
REQUIREMENTS = HERE / "requirements-peers.txt"
SYSTEMS = ("lcache", "none", "mosaicml-streaming", "litdata", "fsspec-filecache")
PEERS = ("mosaicml-streaming", "litdata", "fsspec-filecache")
UNBOUNDED = ("fsspec-filecache",)  # ignores the cache fraction
TARGET_FRACTION, FULL_FRACTION = 0.5, 1.0
# The figures of each --shape (the three shapes of a remote dataset).
SHAPES: dict[str, dict[str, Any]] = {
    "objects": {"samples": 3000, "sample_size": "32KiB", "latency": 0.003,
                "bandwidth": 200e6, "shard_size": "1MiB"},
    "shards": {"samples": 3000, "sample_size": "32KiB", "latency": 0.003,
               "bandwidth": 200e6, "shard_size": "4MiB"},
    "scarce": {"samples": 1500, "sample_size": "128KiB", "latency": 0.005,
               "bandwidth": 50e6, "shard_size": "1MiB"},
}
FLOOR_CONCURRENCY = 32  # requests in flight the floor assumes (lcache's fetch_many default)
SETTLED_US = 100  # a file creation in the cache directory costs less than this before a run
SETTLE_WAIT_S = 90  # ... or the run starts anyway after this long (its rows say the cost)
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Timeout)\b")

log = Console(stderr=True, soft_wrap=True)


@dataclass(frozen=True)
class Options:
    shape: str
    samples: int
    sample_size: int
    latency: float
    bandwidth: float
    fractions: list[float]
    epochs: int
    systems: list[str]
    workers: int
    batch_size: int
    shard_size: int
    seed: int
    venv: Path
    data_dir: Path
    cache_dir: Path
    timeout: int
    as_json: bool

    @property
    def dataset_bytes(self) -> int:
        return self.samples * self.sample_size


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="objects",
                   help="the source's shape (see above); sets the next five figures")
    p.add_argument("--samples", type=int)
    p.add_argument("--sample-size", help="bytes per sample (e.g. 32KiB)")
    p.add_argument("--latency", type=float, help="seconds per request")
    p.add_argument("--bandwidth", type=float, help="bytes/s, all connections")
    p.add_argument("--fractions", default="0.25,0.5,1.0", help="cache size / dataset size")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS)}")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--shard-size", help="WebDataset tar / MDS shard / litdata chunk bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--venv", default="/var/tmp/lcache-bench-venv", help="the peers' venv")
    p.add_argument("--data-dir", default="/var/tmp/lcache-bench-data",
                   help="the served dataset (reused when its parameters match)")
    p.add_argument("--cache-dir", default="/var/tmp/lcache-bench-cache",
                   help="the systems' cache directories (emptied before each run)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per system and fraction")
    p.add_argument("--json", action="store_true", dest="as_json", help="print a JSON list")
    a = p.parse_args(argv)
    for name, value in SHAPES[a.shape].items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    return Options(
        shape=a.shape, samples=a.samples, sample_size=parse_size(a.sample_size),
        latency=a.latency, bandwidth=a.bandwidth,
        fractions=[float(f) for f in a.fractions.split(",")],
        epochs=a.epochs, systems=systems, workers=a.workers, batch_size=a.batch_size,
        shard_size=parse_size(a.shard_size), seed=a.seed, venv=Path(a.venv),
        data_dir=Path(a.data_dir), cache_dir=Path(a.cache_dir), timeout=a.timeout,
        as_json=a.as_json)


# ----------------------------------------------------------------------------- the remote
def bench_server(root: str, opt: Options) -> remote.ThrottledServer:
    """The remote: ETags and Last-Modified because S3 clients read objects from it as
    path-style S3 (/BUCKET/KEY) and obstore (litdata) refuses a GET without them; the
    counters at /__stats, read around each epoch (free, uncounted)."""
    return remote.ThrottledServer(root, latency=opt.latency, bandwidth=opt.bandwidth,
                                  etags=True, stats_path="/__stats")


# ----------------------------------------------------------------------------- the data
def sample_bytes(index: int, size: int, seed: int) -> bytes:
    """Random bytes that start with the index (so a child can check what it was served)."""
    return index.to_bytes(8, "little") + np.random.default_rng([seed, index]).bytes(size - 8)


def write_tars(samples: Path, out: Path, shard_size: int) -> int:
    """The samples as WebDataset shards (``KEY.bin`` members, about ``shard_size`` bytes
    each); returns their bytes."""
    out.mkdir(parents=True)
    files = sorted(samples.iterdir())
    member = 512 + -(-files[0].stat().st_size // 512) * 512  # header + padded data
    per_shard = max(1, shard_size // member)
    for shard, first in enumerate(range(0, len(files), per_shard)):
        with tarfile.open(out / f"shard-{shard:06d}.tar", "w",
                          format=tarfile.USTAR_FORMAT) as tar:
            for path in files[first:first + per_shard]:
                tar.add(path, arcname=path.name)
    return sum(p.stat().st_size for p in out.iterdir())


def prepare_data(opt: Options, python: str | None) -> tuple[Path, dict[str, Any]]:
    """The served root (made once per set of parameters) and its shard sizes."""
    key = f"{opt.samples}x{opt.sample_size}-seed{opt.seed}-shard{opt.shard_size}" + \
        ("-wds" if opt.shape == "shards" else "")
    root = opt.data_dir / key
    ready = root / "ready.json"
    if ready.exists():
        return root, json.loads(ready.read_text())
    shutil.rmtree(root, ignore_errors=True)
    samples = root / SAMPLES_DIR
    samples.mkdir(parents=True)
    log.print(f"writing {opt.samples} samples of {opt.sample_size} B to {samples}")
    for i in range(opt.samples):
        (samples / f"{i:07d}.bin").write_bytes(sample_bytes(i, opt.sample_size, opt.seed))
    info: dict[str, Any] = {}
    if opt.shape == "shards":
        info["wds_bytes"] = write_tars(samples, root / WDS_DIR, opt.shard_size)
    if python is not None:
        log.print("writing the MDS shards and litdata chunks")
        out = subprocess.run([python, str(PEER_SCRIPT), "write", str(root),
                              str(opt.shard_size)], capture_output=True, text=True)
        if out.returncode != 0:
            info["shard_error"] = _tail(out.stderr)
        else:
            info.update(json.loads(out.stdout.strip().splitlines()[-1]))
    if "shard_error" not in info and python is not None:
        ready.write_text(json.dumps(info))
    return root, info


# ----------------------------------------------------------------------------- the peers' venv
def ensure_venv(path: Path) -> tuple[str | None, str | None]:
    """(python of the peers' venv, None) or (None, why it could not be made). Installs torch
    with the peers in one pip command, pinned, so no peer swaps in another torch build."""
    python = path / "bin" / "python"
    stamp = path / ".lcache-bench"
    want = hashlib.sha256(REQUIREMENTS.read_bytes() + str(REPO).encode()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text() == want:
        return str(python), None
    log.print(f"creating the peers' venv {path} (a few minutes)")
    steps = [[sys.executable, "-m", "venv", str(path)],
             [str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)],
             [str(python), "-m", "pip", "install", "-q", "-c", str(REQUIREMENTS),
              "-e", str(REPO)]]
    for step in steps:
        out = subprocess.run(step, capture_output=True, text=True)
        if out.returncode != 0:
            return None, f"{' '.join(step[-3:])} failed: {_tail(out.stderr)}"
    stamp.write_text(want)
    return str(python), None


def peer_versions(python: str | None) -> dict[str, str]:
    if python is None:
        return {}
    out = subprocess.run([python, str(PEER_SCRIPT), "versions"], capture_output=True,
                         text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": _tail(out.stderr)}


def _tail(text: str, lines: int = 3) -> str:
    """The last exception line of a traceback (else the last lines): why a step failed."""
    errors = [ln.strip() for ln in text.splitlines() if EXCEPTION_LINE.match(ln)]
    if errors:
        return errors[-1]
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


# ----------------------------------------------------------------------------- running
def child_env(url: str) -> dict[str, str]:
    """The S3 settings of the peers that read shards as S3 objects from the server."""
    env = dict(os.environ)
    env.update({
        "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
        "S3_ENDPOINT_URL": url,  # mosaicml-streaming's S3 endpoint
        # litdata waits this long for a chunk before failing (default 120 s); its force
        # download still comes at 30 s. Only bounds how long a stalled run takes to fail.
        "MAX_WAIT_TIME": "60",
    })
    return env


def budget(system: str, fraction: float, opt: Options, info: dict[str, Any]) -> int | None:
    """Cache bytes for ``system``: the fraction of the dataset as that system stores it."""
    stored = {"lcache": opt.dataset_bytes, "mosaicml-streaming": info.get("mds_bytes"),
              "litdata": info.get("litdata_bytes")}.get(system)
    return int(fraction * stored) if stored else None


def run_system(python: str, system: str, fraction: float, url: str, opt: Options,
               info: dict[str, Any]) -> list[dict[str, Any]]:
    cache_dir = opt.cache_dir / system
    shutil.rmtree(cache_dir, ignore_errors=True)  # a fresh cache for every fraction
    cache_dir.mkdir(parents=True)
    # Every system starts on a settled disk: after the previous run removed its files, file
    # creation here cost 0.3-1 ms for a while instead of 20 us, and lcache's epochs (two
    # files per small segment) took up to 1.6x as long. The cost is kept in each row.
    create_us, waited = sb.settle_directory_ops(cache_dir, SETTLED_US, SETTLE_WAIT_S)
    cfg = {"system": system, "shape": opt.shape, "url": url, "fraction": fraction,
           "budget": budget(system, fraction, opt, info), "cache_dir": str(cache_dir),
           "samples": opt.samples, "epochs": opt.epochs, "workers": opt.workers,
           "batch_size": opt.batch_size, "seed": opt.seed}
    base = {"system": system, "cache_fraction": fraction}
    # Its own session, killed whole on a timeout: DataLoader workers (and streaming's
    # helpers) outlive a killed parent and would go on writing into the next run's cache.
    child = subprocess.Popen([python, str(PEER_SCRIPT), "run", json.dumps(cfg)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=child_env(url), start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=opt.timeout)
        code = child.returncode
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, _ = child.communicate()
        stderr, code = f"timed out after {opt.timeout} s", -1
    with contextlib.suppress(ProcessLookupError):  # what it left behind, if anything
        os.killpg(child.pid, signal.SIGKILL)
    rows = [{**json.loads(line), "create_us": round(create_us), "settle_wait_s": round(waited, 1)}
            for line in stdout.splitlines() if line.startswith("{")]
    logfile = opt.cache_dir / "logs" / f"{system}-{fraction}.log"
    logfile.parent.mkdir(exist_ok=True)
    logfile.write_text(stderr)
    if code != 0 or len(rows) < opt.epochs:
        done = {r["epoch"] for r in rows}
        why = f"exit {code}: {_tail(stderr)} (log: {logfile})"
        rows += [{**base, "epoch": e, "error": why}
                 for e in range(1, opt.epochs + 1) if e not in done]
    shutil.rmtree(cache_dir, ignore_errors=True)
    return rows


def plan_runs(opt: Options) -> list[tuple[str, float]]:
    """(system, fraction) pairs. ``none`` has no cache: one run, at fraction 0. An unbounded
    cache ignores the fraction: one run, at the first fraction (see ``unbounded_copies``)."""
    runs: list[tuple[str, float]] = []
    for s in opt.systems:
        fractions = [0.0] if s == "none" else opt.fractions[:1] if s in UNBOUNDED else \
            opt.fractions
        runs += [(s, f) for f in fractions]
    return runs


def unbounded_copies(rows: list[dict[str, Any]], opt: Options) -> list[dict[str, Any]]:
    """The one run of an unbounded cache, reported at every other fraction too."""
    note = f"no size limit: the run at fraction {opt.fractions[0]} stands for every fraction"
    return [{**r, "cache_fraction": f, "note": note} for f in opt.fractions[1:] for r in rows]


def opt_rows(opt: Options) -> list[dict[str, Any]]:
    """Belady/OPT on lcache's node order over all epochs: overall (``simulate_opt``, the
    issue's reference) and per epoch (the same run's hits, split)."""
    orders = [node_order(opt.samples, opt.seed, e, range(1), 1) for e in range(opt.epochs)]
    seq = np.concatenate(orders)
    rows: list[dict[str, Any]] = []
    for fraction in opt.fractions:
        capacity = int(fraction * opt.dataset_bytes)
        rows.append({"system": "opt", "cache_fraction": fraction,
                     "hit_ratio": round(simulate_opt(seq, opt.sample_size, capacity), 4)})
        hits = belady(seq, opt.sample_size, capacity).hits.reshape(opt.epochs, -1)
        rows += [{"system": "opt", "cache_fraction": fraction, "epoch": e + 1,
                  "hit_ratio": round(float(h.mean()), 4)} for e, h in enumerate(hits)]
    return rows


# ----------------------------------------------------------------------------- the floor
def ssd_read_bandwidth(opt: Options) -> float:
    """Bytes/s of random O_DIRECT reads of one sample size in the cache directory (fio, 16
    in flight): what serving the hits can take at least. Refuses without fio."""
    sb.ensure_fio("cache_bench")
    opt.cache_dir.mkdir(parents=True, exist_ok=True)
    block = max(4096, opt.sample_size // 4096 * 4096)
    _, read_mbps = sb.fio_pair(str(opt.cache_dir), 256 << 20, block, 16, 5)
    return read_mbps * 1e6


def add_floor(row: dict[str, Any], opt: Options, ssd_bw: float) -> dict[str, Any]:
    """``floor_s``, ``floor_by`` and ``over_floor`` of an epoch row (see the module doc)."""
    if "error" in row:
        return row
    remote, requests = row["remote_bytes"], row["requests"]
    hit_bytes = max(0, row["served_bytes"] - remote)
    terms = {"bandwidth": remote / opt.bandwidth,
             "latency": requests * opt.latency / FLOOR_CONCURRENCY,
             "ssd": hit_bytes / ssd_bw}
    by = max(terms, key=lambda k: terms[k])
    floor = terms[by]
    return {**row, "floor_s": round(floor, 3), "floor_by": by,
            "over_floor": round(row["seconds"] / floor, 2) if floor > 0 else None}


# ----------------------------------------------------------------------------- the targets
def _mean(rows: list[dict[str, Any]], system: str, fraction: float, key: str,
          epochs: range) -> float | None:
    vals = [r[key] for r in rows if r["system"] == system and r.get("cache_fraction") == fraction
            and r.get("epoch") in epochs and r.get(key) is not None and "error" not in r]
    return sum(vals) / len(vals) if vals and len(vals) == len(epochs) else None


def _best_peer(rows: list[dict[str, Any]], fraction: float, key: str, epochs: range,
               best: Any, bounded: bool) -> tuple[str | None, float | None]:
    found = [(p, _mean(rows, p, fraction, key, epochs)) for p in PEERS
             if not (bounded and p in UNBOUNDED)]
    found = [(p, v) for p, v in found if v is not None]
    return best(found, key=lambda pv: pv[1]) if found else (None, None)


def _target(name: str, measured: float | None, threshold: float | None, higher: bool,
            peer: str | None = None) -> dict[str, Any]:
    met = None if measured is None or threshold is None else \
        (measured >= threshold if higher else measured <= threshold)
    row = {"system": "summary", "target": name,
           "measured": None if measured is None else round(measured, 4),
           "threshold": None if threshold is None else round(threshold, 4), "met": met}
    return {**row, "best_peer": peer} if peer else row


def summarize(rows: list[dict[str, Any]], opt: Options) -> list[dict[str, Any]]:
    """The issue's targets, on per-epoch means: warm epochs are 2..E. Peer comparisons are
    made twice: against every peer, and against the peers that honour the cache fraction
    (fsspec-filecache's cache is unbounded)."""
    later, f = range(2, opt.epochs + 1), TARGET_FRACTION
    out = [_target(f"remote_bytes per warm epoch <= {1 - g + 0.05:.2f} x dataset bytes "
                   f"(f={g:g}, epochs 2+)", _mean(rows, "lcache", g, "remote_bytes", later),
                   (1 - g + 0.05) * opt.dataset_bytes, higher=False) for g in opt.fractions]
    out.append(_target(f"hit_ratio >= 0.95 x opt (f={f:g}, epochs 2+)",
                       _mean(rows, "lcache", f, "hit_ratio", later),
                       _scaled(_mean(rows, "opt", f, "hit_ratio", later), 0.95), higher=True))
    for bounded in (False, True):
        tag = " (peers with a size limit)" if bounded else ""
        peer, t = _best_peer(rows, f, "seconds", later, min, bounded)
        out.append(_target(f"warm epoch seconds <= 0.6 x best peer's (f={f:g}, epochs 2+){tag}",
                           _mean(rows, "lcache", f, "seconds", later), _scaled(t, 0.6),
                           higher=False, peer=peer))
        one = range(2, 3)
        peer, v = _best_peer(rows, FULL_FRACTION, "samples_per_s", one, max, bounded)
        out.append(_target(f"epoch-2 samples/s >= 1 x best peer's (f={FULL_FRACTION:g}){tag}",
                           _mean(rows, "lcache", FULL_FRACTION, "samples_per_s", one), v,
                           higher=True, peer=peer))
        for g in opt.fractions:
            peer, v = _best_peer(rows, g, "samples_per_s", range(1, 2), max, bounded)
            out.append(_target(f"epoch-1 samples/s >= 0.9 x best peer's (f={g:g}){tag}",
                               _mean(rows, "lcache", g, "samples_per_s", range(1, 2)),
                               _scaled(v, 0.9), higher=True, peer=peer))
    over = [r["over_floor"] for r in rows if r["system"] == "lcache" and r.get("over_floor")]
    out.append(_target("lcache's epoch seconds <= 1.25 x its floor (worst epoch)",
                       max(over) if over else None, 1.25, higher=False))
    return out


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


# ----------------------------------------------------------------------------- output
def print_table(rows: list[dict[str, Any]]) -> None:
    table = Table("system", "fraction", "epoch", "seconds", "samples/s", "remote MB", "hit ratio",
                  "x floor", "note")
    for r in rows:
        if r["system"] == "summary":
            continue
        mb = r.get("remote_bytes")
        table.add_row(r["system"], str(r.get("cache_fraction")), str(r.get("epoch", "all")),
                      str(r.get("seconds", "")), str(r.get("samples_per_s", "")),
                      "" if mb is None else f"{mb / 1e6:.1f}", str(r.get("hit_ratio", "")),
                      str(r.get("over_floor", "")), r.get("error", "")[:60])
    Console(width=max(132, shutil.get_terminal_size().columns)).print(table)


def _progress_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"  epoch {r['epoch']}: error: {r['error']}"
    return (f"  epoch {r['epoch']}: {r['seconds']} s, {r['samples_per_s']} samples/s, "
            f"{r['remote_bytes'] / 1e6:.1f} MB from the remote, hit ratio {r['hit_ratio']}, "
            f"{r['over_floor']} x its floor ({r['floor_by']})"
            + (f"; a file creation took {r.get('create_us')} us before the run"
               if r["epoch"] == 1 else ""))


def print_summary(summary: list[dict[str, Any]]) -> None:
    for s in summary:
        peer = f" [{s['best_peer']}]" if "best_peer" in s else ""
        log.print(f"{'MET ' if s['met'] else 'MISS' if s['met'] is False else 'n/a '} "
                  f"{s['target']}{peer}: measured {s['measured']}, threshold {s['threshold']}")


def main(argv: list[str] | None = None) -> None:
    opt = parse_args(argv)
    started = time.perf_counter()
    python, venv_error = ensure_venv(opt.venv)
    versions = peer_versions(python)
    root, info = prepare_data(opt, python)
    ssd_bw = ssd_read_bandwidth(opt)
    info["ssd_random_read_MBps"] = round(ssd_bw / 1e6, 1)
    rows: list[dict[str, Any]] = []
    with bench_server(str(root), opt) as server:
        for system, fraction in plan_runs(opt):
            log.print(f"{system} at cache fraction {fraction} ...")
            if python is None or (system in PEERS[:2] and "shard_error" in info):
                why = venv_error or info.get("shard_error")
                rows += [{"system": system, "cache_fraction": fraction, "epoch": e,
                          "error": why} for e in range(1, opt.epochs + 1)]
                continue
            got = [add_floor(r, opt, ssd_bw)
                   for r in run_system(python, system, fraction, server.url, opt, info)]
            for r in got:
                log.print(_progress_line(r))
            rows += got + (unbounded_copies(got, opt) if system in UNBOUNDED else [])
        info["server_connection_errors"] = server.connection_errors
    rows += opt_rows(opt)
    summary = summarize(rows, opt)
    setup = {"system": "setup", **{k: str(v) if isinstance(v, Path) else v
                                   for k, v in asdict(opt).items()},
             "dataset_bytes": opt.dataset_bytes, **info, "versions": versions,
             "wall_s": round(time.perf_counter() - started, 1)}
    print_summary(summary)
    if opt.as_json:
        print(json.dumps([setup, *rows, *summary], indent=1))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
