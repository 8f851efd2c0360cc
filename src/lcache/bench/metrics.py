"""DLIO's metrics: accelerator utilization (AU), throughput, I/O rate, checkpoint durations.

Per rank (DLIO ``utils/statscounter.py``): steps are grouped in *blocks*, a block ending at each
checkpoint so checkpoint time never counts against AU. For each step the rank records ``load``
(waiting for the batch), ``proc`` (load + compute), ``compute`` (the sleep) and the bytes its
batch read. For a block::

    AU         = sum(compute[s..e]) / (block wall time - sum(proc outside s..e))
    throughput = (e - s + 1) * batch_size / (block wall time - sum(proc outside s..e))
    measured   = sum(bytes[s..e]) / (the same time)

where steps ``s..e`` exclude ``output.metric.exclude_start_steps`` (default 1: the first step
pays the reader's warm-up) and ``exclude_end_steps`` (default 0). An epoch's AU is the
step-weighted mean of its blocks' (DLIO's); its throughput and measured rate are the samples
and bytes of all its blocks' metric steps over their summed time, one time base for both (a
step-weighted mean of block rates, DLIO's throughput, overstates the rate when blocks run at
different speeds: 2,572 samples/s beside 2,218 MiB/s of 1 MiB samples); the mean wait for a
batch is over the same steps.

Across ranks (DLIO's allreduce): AU is the mean over ranks, samples/s the sum over ranks (the
job's rate). Two read rates: ``train_io_mean_MB_per_second = samples/s * record_length /
2**20`` (DLIO's formula, the nominal size) and ``train_io_measured_mean_MB_per_second``, the
bytes the batches of the measured steps read over their time; they differ when samples are
not ``record_length`` bytes (``record_length_stdev``, npz headers, whole-file reads).
Checkpoint durations are the slowest rank's (every rank waits at the barrier for it), so a
checkpoint's rate is ``checkpoint_size_GB / duration``: the whole checkpoint over the slowest
rank's time, which is the minimum of the ranks' rates, not their sum. Each save and each load
is its own row. ``GB`` in DLIO's key names is GiB (2**30).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lcache.io import atomic_write

GIB = float(1 << 30)
MIB = float(1 << 20)


@dataclass
class _Block:
    start: float
    end: float = 0.0
    load: list[float] = field(default_factory=list)
    proc: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Window:
    """A block's metric steps ``s..e`` and the time they took (DLIO's denominator)."""

    s: int
    e: int
    seconds: float

    @property
    def steps(self) -> int:
        return self.e - self.s + 1 if self.seconds > 0 else 0


def _window(b: _Block, skip_start: int, skip_end: int) -> _Window:
    s, e = skip_start, len(b.compute) - 1 - skip_end
    if e < s:
        return _Window(s, e, 0.0)
    return _Window(s, e, b.end - b.start - sum(b.proc[:s]) - sum(b.proc[e + 1:]))


def block_metrics(b: _Block, batch_size: int, skip_start: int, skip_end: int
                  ) -> tuple[float, float, int]:
    """(AU percent, samples/s, metric steps) of one block, DLIO's formula."""
    win = _window(b, skip_start, skip_end)
    if not win.steps:
        return 0.0, 0.0, 0
    compute = sum(b.compute[win.s:win.e + 1])
    au = 100.0 * compute / win.seconds if compute > 0 else 0.0
    return au, win.steps * batch_size / win.seconds, win.steps


class RankRecorder:
    """One rank's timings, in DLIO's shape; ``to_dict`` is this rank's ``{rank}_output.json``."""

    def __init__(self, rank: int, batch_size: int, skip_start: int = 1, skip_end: int = 0,
                 batch_size_eval: int | None = None) -> None:
        self.rank = rank
        self.batch_size = batch_size
        self.skip_start = skip_start
        self.skip_end = skip_end
        self.epochs: dict[int, list[_Block]] = {}
        self.epoch_wall: dict[int, tuple[float, float]] = {}
        self.checkpoints: list[dict[str, Any]] = []
        self.evals: dict[int, _Block] = {}
        self.batch_size_eval = batch_size_eval or batch_size
        self.generated = {"files": 0, "bytes": 0}

    def start_epoch(self, epoch: int) -> None:
        self.epochs[epoch] = []
        self.epoch_wall[epoch] = (time.time(), 0.0)
        self.start_block(epoch)

    def end_epoch(self, epoch: int) -> None:
        blocks = self.epochs[epoch]
        if blocks and blocks[-1].end == 0.0:
            blocks[-1].end = time.time()
        if blocks and not blocks[-1].compute:
            blocks.pop()  # an empty block after a final checkpoint
        self.epoch_wall[epoch] = (self.epoch_wall[epoch][0], time.time())

    def start_block(self, epoch: int) -> None:
        self.epochs[epoch].append(_Block(start=time.time()))

    def end_block(self, epoch: int) -> None:
        self.epochs[epoch][-1].end = time.time()

    def step(self, epoch: int, load_s: float, compute_s: float, proc_s: float,
             nbytes: int) -> None:
        _add(self.epochs[epoch][-1], load_s, compute_s, proc_s, nbytes)

    def start_eval(self, epoch: int) -> None:
        self.evals[epoch] = _Block(start=time.time())

    def eval_step(self, epoch: int, load_s: float, compute_s: float, proc_s: float,
                  nbytes: int) -> None:
        _add(self.evals[epoch], load_s, compute_s, proc_s, nbytes)

    def end_eval(self, epoch: int) -> None:
        self.evals[epoch].end = time.time()

    def eval_metrics(self, epoch: int) -> dict[str, Any]:
        b = self.evals[epoch]
        return _phase_metrics([b], self.batch_size_eval, self.skip_start, self.skip_end,
                              (b.start, b.end))

    def checkpoint(self, kind: str, name: str, duration_s: float, own_s: float,
                   nbytes: int) -> None:
        """Record a ``save`` or ``load``: barrier-to-barrier duration and this rank's own."""
        self.checkpoints.append({"kind": kind, "name": name, "duration_s": duration_s,
                                 "rank_duration_s": own_s, "bytes": nbytes})

    def epoch_metrics(self, epoch: int) -> dict[str, Any]:
        return _phase_metrics(self.epochs[epoch], self.batch_size, self.skip_start,
                              self.skip_end, self.epoch_wall[epoch])

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank,
                "epochs": {str(e): self.epoch_metrics(e) for e in self.epochs},
                "evals": {str(e): self.eval_metrics(e) for e in self.evals},
                "checkpoints": self.checkpoints, "generated": self.generated}


def _add(b: _Block, load_s: float, compute_s: float, proc_s: float, nbytes: int) -> None:
    b.load.append(load_s)
    b.compute.append(compute_s)
    b.proc.append(proc_s)
    b.nbytes.append(nbytes)


def _phase_metrics(blocks: list[_Block], batch_size: int, skip_start: int, skip_end: int,
                   wall: tuple[float, float]) -> dict[str, Any]:
    """One rank's figures of an epoch (or an evaluation) from its blocks."""
    rows = [block_metrics(b, batch_size, skip_start, skip_end) for b in blocks]
    wins = [_window(b, skip_start, skip_end) for b in blocks]
    steps = sum(r[2] for r in rows)
    seconds = sum(w.seconds for w in wins if w.steps)
    measured = sum(sum(b.nbytes[w.s:w.e + 1]) for b, w in zip(blocks, wins, strict=True)
                   if w.steps)
    load = [x for b, w in zip(blocks, wins, strict=True) if w.steps
            for x in b.load[w.s:w.e + 1]]
    compute = sum(sum(b.compute[w.s:w.e + 1]) for b, w in zip(blocks, wins, strict=True)
                  if w.steps)
    return {
        "au_percentage": sum(r[0] * r[2] for r in rows) / steps if steps else 0.0,
        # samples over the same seconds as the bytes below, so that the two rates agree
        "throughput_samples_per_second": steps * batch_size / seconds if seconds > 0 else 0.0,
        "measured_io_MB_per_second": measured / MIB / seconds if seconds > 0 else 0.0,
        "steps": sum(len(b.compute) for b in blocks), "metric_steps": steps,
        "blocks": len(blocks), "duration_s": wall[1] - wall[0],
        "bytes_read": sum(sum(b.nbytes) for b in blocks),
        # over the metric steps: the excluded warm-up does not hide in the mean
        "load_mean_s": float(np.mean(load)) if load else 0.0,
        "metric_seconds": seconds, "metric_compute_s": compute,
        "compute_total_s": sum(sum(b.compute) for b in blocks),
    }


def write_json_atomic(path: str, doc: Any) -> None:
    """Publish ``doc`` as JSON at ``path``: temp file, fsync, rename."""
    atomic_write(path, json.dumps(doc, indent=2, default=_jsonable).encode(), mode=0o644)


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    return float(np.mean(values)), float(np.std(values))


def aggregate(ranks: list[dict[str, Any]], record_length: int, au_target: float,
              checkpoint_bytes: int) -> dict[str, Any]:
    """DLIO's ``summary['metric']`` from every rank's output, plus per-epoch and per-rank rows.

    Args:
        ranks: each rank's :meth:`RankRecorder.to_dict`, in rank order.
        record_length: ``dataset.record_length`` (DLIO's I/O-rate formula uses it).
        au_target: ``metric.au`` as a fraction.
        checkpoint_bytes: one whole checkpoint, all ranks.
    """
    metric: dict[str, Any] = {}
    per_epoch = _phase(ranks, "epochs", "train", record_length, au_target, metric)
    per_eval = _phase(ranks, "evals", "eval", record_length, au_target, metric)
    ckpt_rows = _checkpoint_rows(ranks, checkpoint_bytes / GIB, metric)
    per_rank = [{"rank": r["rank"], "epochs": r["epochs"], "evals": r.get("evals", {}),
                 "checkpoints": r["checkpoints"]} for r in ranks]
    generated = {k: sum(r.get("generated", {}).get(k, 0) for r in ranks)
                 for k in ("files", "bytes")}
    return {"metric": metric, "per_epoch": per_epoch, "per_eval": per_eval,
            "checkpoints": ckpt_rows, "per_rank": per_rank, "epochs": len(per_epoch),
            "generated": generated}


def _checkpoint_rows(ranks: list[dict[str, Any]], size_gib: float,
                     metric: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per checkpoint event (the n-th save or load of every rank), and the metric
    keys: every rank records the same sequence of events between barriers."""
    rows: list[dict[str, Any]] = []
    for i, first in enumerate(ranks[0]["checkpoints"] if ranks else []):
        events = [r["checkpoints"][i] for r in ranks]
        d = max(c["duration_s"] for c in events)
        rows.append({"kind": first["kind"], "name": first["name"], "duration_s": d,
                     "slowest_rank": max(c["rank_duration_s"] for c in events),
                     "GB_per_second": size_gib / d if d > 0 else 0.0,
                     "bytes": sum(c["bytes"] for c in events)})
    for kind in ("save", "load"):
        durations = [c["duration_s"] for c in rows if c["kind"] == kind]
        if durations:
            d_mean, d_std = _mean_std(durations)
            r_mean, r_std = _mean_std([size_gib / d for d in durations if d > 0])
            metric[f"{kind}_checkpoint_duration_mean_seconds"] = d_mean
            metric[f"{kind}_checkpoint_duration_stdev_seconds"] = d_std
            metric[f"{kind}_checkpoint_io_mean_GB_per_second"] = r_mean
            metric[f"{kind}_checkpoint_io_stdev_GB_per_second"] = r_std
    if rows:
        metric["checkpoint_size_GB"] = size_gib
    return rows


def _phase(ranks: list[dict[str, Any]], field_name: str, prefix: str, record_length: int,
           au_target: float, metric: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-epoch rows of one phase (train or eval) and its DLIO metric keys."""
    epochs = sorted({int(e) for r in ranks for e in r.get(field_name, {})})
    rows_out = []
    au_list, thr_list, io_list = [], [], []
    for e in epochs:
        rows = [r[field_name][str(e)] for r in ranks if str(e) in r.get(field_name, {})]
        au = float(np.mean([x["au_percentage"] for x in rows]))
        thr = float(sum(x["throughput_samples_per_second"] for x in rows))
        measured = float(sum(x["measured_io_MB_per_second"] for x in rows))
        au_list.append(au)
        thr_list.append(thr)
        io_list.append(measured)
        rows_out.append({
            "epoch": e, "au_percentage": au, "throughput_samples_per_second": thr,
            "duration_s": max(x["duration_s"] for x in rows),
            "bytes_read": sum(x["bytes_read"] for x in rows),
            "measured_io_MB_per_second": measured,
            "min_rank_throughput_samples_per_second":
                min(x["throughput_samples_per_second"] for x in rows),
            "steps": rows[0]["steps"], "metric_steps": rows[0]["metric_steps"],
        })
    if epochs:
        au_mean, au_std = _mean_std(au_list)
        thr_mean, thr_std = _mean_std(thr_list)
        metric.update({
            f"{prefix}_au_percentage": au_list,
            f"{prefix}_au_mean_percentage": au_mean,
            f"{prefix}_au_meet_expectation":
                "success" if au_mean >= au_target * 100 else "fail",
            f"{prefix}_au_stdev_percentage": au_std,
            f"{prefix}_throughput_samples_per_second": thr_list,
            f"{prefix}_throughput_mean_samples_per_second": thr_mean,
            f"{prefix}_throughput_stdev_samples_per_second": thr_std,
            f"{prefix}_io_mean_MB_per_second": thr_mean * record_length / MIB,
            f"{prefix}_io_stdev_MB_per_second": thr_std * record_length / MIB,
            f"{prefix}_io_measured_mean_MB_per_second": float(np.mean(io_list)),
        })
    return rows_out


def _unmeasured_training(summary: dict[str, Any]) -> str:
    """Why training measured nothing ("" when it measured something, or did not train)."""
    rows = summary.get("per_epoch", [])
    if not rows or any(r["metric_steps"] for r in rows):
        return ""
    steps = rows[0]["steps"]
    skip = summary.get("exclude_steps", (1, 0))
    return (f"nothing was measured: {steps} step{'s' if steps != 1 else ''} per epoch, and "
            f"output.metric.exclude_start_steps = {skip[0]} with exclude_end_steps = {skip[1]} "
            "leave none to measure; add files (dataset.num_files_train), lower "
            "reader.batch_size or exclude fewer steps")


def verdict(summary: dict[str, Any], au_target: float) -> str:
    """One line: AU met or not, and why (the figure that decides it)."""
    m = summary["metric"]
    if not summary.get("per_epoch") and not summary.get("checkpoints"):
        gen = summary.get("generated") or {}
        if gen.get("files") or summary.get("generate_only"):
            return (f"generated {gen.get('files', 0)} files ({gen.get('bytes', 0):,} bytes) "
                    f"in {summary.get('data_folder')} (a data-generation run: no training "
                    "or checkpoint to measure)")
        return "nothing was measured"
    parts = []
    empty = _unmeasured_training(summary)
    if empty:
        parts.append(empty)
    elif "train_au_mean_percentage" in m:
        au = m["train_au_mean_percentage"]
        target = au_target * 100
        rows = summary["per_epoch"]
        epochs = [r for rank in summary["per_rank"] for r in rank["epochs"].values()]
        steps = sum(x["metric_steps"] for x in epochs) or 1
        wait = sum(x["load_mean_s"] * x["metric_steps"] for x in epochs) / steps
        # Time per measured step beyond compute: data waits plus barriers and step overhead.
        over = sum(x["metric_seconds"] - x["metric_compute_s"] for x in epochs) / steps
        if summary.get("computation_time") == 0:
            parts.append(f"AU {au:.1f}%: the workload has no train.computation_time, so there "
                         "is no compute for storage to keep busy and AU means nothing; read "
                         f"{m['train_throughput_mean_samples_per_second']:.1f} samples/s and "
                         f"{rows[-1]['measured_io_MB_per_second']:.1f} MiB/s (last epoch)")
        elif au >= target:
            parts.append(f"AU {au:.1f}% >= {target:g}%: MET, storage kept the accelerators "
                         f"busy ({m['train_throughput_mean_samples_per_second']:.1f} samples/s, "
                         f"mean wait for a batch {wait * 1000:.1f} ms)")
        elif wait >= 0.5 * over:
            parts.append(f"AU {au:.1f}% < {target:g}%: NOT MET, each step waited "
                         f"{wait * 1000:.1f} ms on average for its batch "
                         f"({rows[-1]['measured_io_MB_per_second']:.1f} MiB/s read in the last "
                         "epoch): storage or too few reader threads are the bottleneck")
        else:
            parts.append(f"AU {au:.1f}% < {target:g}%: NOT MET, but not for data: batches "
                         f"waited {wait * 1000:.1f} ms per step while {over * 1000:.1f} ms per "
                         "step went beyond compute (barriers between ranks, step overhead, "
                         "checkpoints); computation_time is too short for this host to "
                         "emulate faithfully")
    if "eval_au_mean_percentage" in m:
        ok = m["eval_au_mean_percentage"] >= au_target * 100
        parts.append(f"evaluation AU {m['eval_au_mean_percentage']:.1f}%: "
                     f"{'met' if ok else 'NOT MET'}")
    if "save_checkpoint_duration_mean_seconds" in m:
        parts.append(f"checkpoint {m['checkpoint_size_GB']:.3f} GiB saved in "
                     f"{m['save_checkpoint_duration_mean_seconds']:.2f} s "
                     f"({m['save_checkpoint_io_mean_GB_per_second']:.3f} GiB/s)")
    if "load_checkpoint_duration_mean_seconds" in m:
        parts.append(f"{'' if parts else 'checkpoint '}loaded in "
                     f"{m['load_checkpoint_duration_mean_seconds']:.2f} s "
                     f"({m['load_checkpoint_io_mean_GB_per_second']:.3f} GiB/s)")
        if not summary.get("drop_cache") and "save_checkpoint_duration_mean_seconds" in m:
            parts.append("the loads may have come from the page cache that the saves "
                         "filled (use --drop-cache to measure the storage)")
    ahead = summary.get("prefetch_batches", 0)
    short = [r for r in summary.get("per_epoch", []) if 0 < r["metric_steps"] <= ahead]
    if short:
        parts.append(f"WARNING: {short[0]['steps']} steps per epoch against {ahead} batches "
                     "the readers fetch ahead: the measured steps are mostly served by "
                     "reads made during the excluded first step; use more files or epochs")
    if summary.get("potential_caching"):
        parts.append("WARNING: the dataset fits in this host's page cache and was not "
                     "dropped; later epochs may measure memory (use --drop-cache or "
                     "reader.odirect)")
    return "; ".join(parts) if parts else "nothing was measured"
