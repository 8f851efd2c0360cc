"""The advice, each item with the arithmetic behind its figure.

Each item is ``{"topic", "figure", "value", "arithmetic"}``, or ``{"topic", "missing"}`` when
the trace does not hold what the figure needs (the reason says what would).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lcache.checks import real_number, whole_number
from lcache.data.sizing import (
    MIN_SEGMENTS,
    capacity_for,
    choose_segment_size,
    plan_overhead,
)
from lcache.store.layout import MAX_SIZE, format_decimal_size
from lcache.store.record import HEADER_SIZE

DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class Targets:
    """What the advice aims at (CLI options of ``lcache advise``)."""

    hit_ratio: float = 0.9
    max_stall: float = 0.05
    ssd_write_Bps: float = 3.8e9  # one drive: lcache model's default (PM1733 3.84 TB)
    ssd_read_Bps: float = 7.0e9
    ssd_capacity_bytes: float = 3.84e12
    ssds: int = 8  # per node, as lcache model (a DGX H100's data drives)
    rated_dwpd: float = 1.0

    def __post_init__(self) -> None:
        # the ranges of lcache advise's options: a str or NaN here failed deep in the
        # arithmetic, a TypeError that named no target
        for name, (low, high) in _TARGET_RANGES.items():
            object.__setattr__(self, name, real_number(getattr(self, name), name, low, high))
        object.__setattr__(self, "ssds", whole_number(self.ssds, "ssds", 1, 1024))


#: the range of each float field of :class:`Targets` (as ``lcache advise`` checks its options)
_TARGET_RANGES = {"hit_ratio": (0.001, 1.0), "max_stall": (0.0001, 0.99),
                  "ssd_write_Bps": (1.0, float(MAX_SIZE)), "ssd_read_Bps": (1.0, float(MAX_SIZE)),
                  "ssd_capacity_bytes": (1.0, float(MAX_SIZE)), "rated_dwpd": (0.001, 1000.0)}


def _loader_workers() -> int:
    """DataLoader workers per rank that ``SeedAwareSampler`` leaves room for by default."""
    import inspect

    from lcache.data.sampler import SeedAwareSampler

    return int(inspect.signature(SeedAwareSampler).parameters["loader_workers"].default)


def cache_capacity(fitted: dict[str, Any], t: Targets) -> dict[str, Any]:
    """Seed-aware eviction hits C/N of an epoch (Belady on the known order; docs/cache.md):
    to hit ``h``, the plan holds ``ceil(h N)`` records (header + sample), and the cache is
    the smallest whose plan has that room once the store's own overhead is held back
    (``SampleCache.plan_capacity``: a free segment, one per writer, the index)."""
    topic = "cache capacity"
    ds = fitted["dataset"]
    if ds is None:
        return {"topic": topic, "missing": "no reads from the data source: the dataset's size "
                "is unknown; trace a run that reads its data through lcache"}
    n, mean = ds["samples"], ds["record_bytes_mean"]
    largest = ds.get("record_bytes_max", math.ceil(mean))  # fits before it was kept
    keep = math.ceil(t.hit_ratio * n - 1e-9)
    need = math.ceil(keep * (mean + HEADER_SIZE))
    workers = _loader_workers()
    writers = 1 + workers  # one rank per trace: its sampler and its loader workers
    cap = capacity_for(need, n, largest, writers, staging_on_ssd=False)
    on_ssd = capacity_for(need, n, largest, writers, staging_on_ssd=True)
    segment = choose_segment_size(cap, 512, largest)
    held = plan_overhead(segment, n, writers, cap)
    total = (f"capacity = {need:,} + {held:,} = {cap:,} B" if cap == need + held else
             f"{need + held:,} B is below a cache's minimum of {MIN_SEGMENTS} segments: "
             f"capacity = {MIN_SEGMENTS} x {segment:,} = {cap:,} B")
    return {"topic": topic, "figure": "capacity_bytes", "value": cap,
            "fraction_of_dataset": round(cap / ds["bytes"], 4),
            "plan_bytes": need, "overhead_bytes": cap - need,
            "capacity_bytes_staging_on_ssd": on_ssd,
            "arithmetic": (f"hit ratio = C/N with seed-aware eviction: {t.hit_ratio:g} x "
                           f"{n:,} samples = {keep:,} samples x ({mean:,.0f} B + "
                           f"{HEADER_SIZE} B record header) = {need:,} B the plan holds; "
                           f"the store holds back (2 spare + {writers} writers: 1 rank + "
                           f"{workers} DataLoader workers) x {segment:,} B segments (capacity "
                           f"/ 512 down to a power of two in 64 KiB..64 MiB, at least 4 x the "
                           f"largest record {largest + HEADER_SIZE:,} B) + 16 B x {n:,} "
                           f"samples + 64 KiB of index = {held:,} B; {total} = "
                           f"{format_decimal_size(cap)} ({cap / ds['bytes']:.3f} x the "
                           f"{format_decimal_size(ds['bytes'])} dataset); "
                           f"where /dev/shm cannot hold the prefetch staging area it is "
                           f"carved out of the capacity: {on_ssd:,} B; the source then sends "
                           f"(1 - {t.hit_ratio:g}) x dataset = "
                           f"{format_decimal_size((1 - t.hit_ratio) * ds['bytes'])} per epoch")}


def readers(fitted: dict[str, Any]) -> dict[str, Any]:
    """Reader threads so a batch is read within a step's compute, and batches read ahead."""
    topic = "reader threads and prefetch depth"
    steps, data = fitted["steps"], fitted["groups"].get("data")
    if not steps["source"] or not steps["compute_s"]:
        return {"topic": topic, "missing": "no steps in the trace, so no compute time to "
                "hide reads behind: " + (steps.get("why") or "")}
    if data is None or not data["read_bytes"]:
        return {"topic": topic, "missing": "no data reads in the trace"}
    # a rank's step: the count is a rank's, the bytes all ranks'
    batch_bytes = data["read_bytes"] / max(1, steps["count"] * steps.get("ranks", 1))
    # One thread's rate: bytes over the time the reads were in flight, summed over reads.
    thread_Bps = data["read_bytes"] / max(data["busy_s"], 1e-9)
    batch_s = batch_bytes / thread_Bps
    threads = max(1, math.ceil(batch_s / steps["compute_s"] - 1e-9))
    depth = threads + 1
    return {"topic": topic, "figure": "read_threads", "value": threads,
            "prefetch_batches": depth,
            "arithmetic": (f"a step reads {batch_bytes / 1e6:,.3f} MB from the data source "
                           "(cache hits left out); one reader thread moved "
                           f"{thread_Bps / 1e6:,.1f} MB/s, so it reads that in "
                           f"{batch_s * 1e3:,.2f} ms; compute per step is "
                           f"{steps['compute_s'] * 1e3:,.2f} ms: ceil({batch_s * 1e3:,.2f} / "
                           f"{steps['compute_s'] * 1e3:,.2f}) = {threads} thread(s) keep up, "
                           f"each with a batch in flight plus one ready: prefetch {depth} "
                           f"batches (trace: {data['threads']} thread(s))")}


def checkpoint_interval(fitted: dict[str, Any], t: Targets) -> dict[str, Any]:
    """Steps between checkpoints so that saving stalls at most ``max_stall`` of the time."""
    topic = "checkpoint interval"
    ck, steps = fitted["checkpoint"], fitted["steps"]
    if ck is None:
        return {"topic": topic, "missing": "no checkpoint writes in the trace"}
    if not ck["persist_MBps"]:
        return {"topic": topic, "missing": "the checkpoint writes took no measurable time"}
    stall = ck["bytes_p50"] / (ck["persist_MBps"] * 1e6)
    if not steps["step_s"]:
        return {"topic": topic, "missing": "no step time in the trace to set the stall "
                f"against (a save stalls {stall:.3f} s): " + (steps.get("why") or "")}
    k = max(1, math.ceil(stall * (1 - t.max_stall) / (t.max_stall * steps["step_s"]) - 1e-9))
    now = ""
    if ck["interval_steps"]:
        k0 = ck["interval_steps"]
        now = (f"; the traced interval of {k0} steps stalls "
               f"{stall / (stall + k0 * steps['step_s']):.1%}")
    return {"topic": topic, "figure": "steps_between_checkpoints", "value": k,
            "seconds_between": round(k * steps["step_s"], 3),
            "arithmetic": (f"a save of {format_decimal_size(ck['bytes_p50'])} at the measured "
                           f"persist bandwidth {ck['persist_MBps']:,.1f} MB/s stalls "
                           f"{stall:.3f} s; "
                           f"stall / (stall + k x {steps['step_s']:.4f} s) <= "
                           f"{t.max_stall:g} gives k >= {stall:.3f} x (1 - {t.max_stall:g}) / "
                           f"({t.max_stall:g} x {steps['step_s']:.4f}) = {k} steps{now}")}


def offload(fitted: dict[str, Any], scaled: dict[str, Any] | None,
            t: Targets) -> dict[str, Any]:
    """Whether optimizer offload fits the SSDs' bandwidth and endurance: from the offload
    traffic in the trace, else from ``lcache model`` for ``--model``."""
    topic = "optimizer offload"
    off, steps = fitted["groups"].get("offload"), fitted["steps"]
    drives = f"{t.ssds} SSD(s) of {t.ssd_capacity_bytes / 1e12:g} TB"
    if off is not None and steps["step_s"]:
        w = off["write_bytes"] / max(1, steps["count"])
        r = off["read_bytes"] / max(1, steps["count"])
        step = steps["step_s"]
        source = f"the trace: {w / 1e6:,.1f} MB written and {r / 1e6:,.1f} MB read per step"
    elif scaled is not None and "model" in scaled:
        pred = scaled["model"]
        c = pred["classes"]["optimizer-offload"]["per_node"]
        step = pred["step_time_s"]
        w = r = c["bytes_per_event"] / 2
        source = (f"lcache model {pred['model']} on {pred['gpus']} GPUs, per node: "
                  f"{format_decimal_size(w)} read and written back per step of {step:.2f} s")
    else:
        return {"topic": topic, "missing": "no offload traffic in the trace and no --model "
                "to predict it from"}
    write_need, read_need = w / step, r / step
    write_have, read_have = t.ssds * t.ssd_write_Bps, t.ssds * t.ssd_read_Bps
    dwpd = w * DAY_S / step / (t.ssds * t.ssd_capacity_bytes)
    bw = min(write_have / write_need if w else math.inf, read_have / read_need if r else math.inf)
    fits = bw >= 1 and dwpd <= t.rated_dwpd
    return {"topic": topic, "figure": "fits", "value": fits,
            "bandwidth_margin": round(bw, 3) if bw != math.inf else None,
            "dwpd": round(dwpd, 3),
            "arithmetic": (f"{source}; needs {write_need / 1e6:,.0f} MB/s write and "
                           f"{read_need / 1e6:,.0f} MB/s read against {drives} "
                           f"({write_have / 1e6:,.0f} / {read_have / 1e6:,.0f} MB/s): "
                           f"margin {bw:.2f}x; writes {w * DAY_S / step / 1e12:,.1f} TB a day "
                           f"= {dwpd:.2f} drive writes per day against {t.rated_dwpd:g} rated"
                           f"{'' if dwpd <= t.rated_dwpd else ': wears the drives out early'}")}


def advise_all(fitted: dict[str, Any], scaled: dict[str, Any] | None,
               t: Targets) -> list[dict[str, Any]]:
    return [cache_capacity(fitted, t), readers(fitted), checkpoint_interval(fitted, t),
            offload(fitted, scaled, t)]
