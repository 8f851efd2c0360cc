"""Emulate on real storage the I/O that ``lcache model`` predicts, time-scaled to a duration.

One checkpoint interval of real training (``checkpoint_interval_steps * step_time_s``) is
compressed into ``duration`` seconds by a factor ``f = duration / interval``. Time and bytes
shrink by the same factor, so every bandwidth the run demands equals the real one:

* ``steps`` emulated steps each sleep ``duration / steps`` in place of the GPUs, and each moves
  the per-node bytes of ``interval / steps`` real steps times ``f``: data reads through the
  DLIO reader (an indexed binary dataset), optimizer and activation offload as writes then
  reads of a per-rank file (``io_class="offload"``) while the step computes;
* one checkpoint of ``f`` times the node's share is written at the end (and read back with
  ``restart``), and its measured rate projects the full-size checkpoint's duration.

A class whose scaled bytes per step exceed ``max_step_bytes`` is capped (the run would fill
the disk or never end); the summary says so, since such a demand is not met by any local SSD.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from lcache.bench.config import Workload
from lcache.bench.run import BenchOptions, run_workload
from lcache.bench.traffic import StepIO
from lcache.checks import launch_rank_world
from lcache.errors import ConfigError
from lcache.store import format_size

_STEP_CLASSES = ("data-read", "optimizer-offload", "activation-offload")


@dataclass
class Plan:
    """What an emulation moves, per rank, and the figures it was derived from."""

    workload: Workload
    step_io: list[StepIO]
    prediction: dict[str, Any]
    scale: float
    steps: int
    classes: dict[str, dict[str, Any]]
    duration: float  # seconds the emulated interval takes: at most the real one


def plan(prediction: dict[str, Any], duration: float, steps: int = 20, world: int = 1,
         max_step_bytes: int = 1 << 30, restart: bool = False,
         name: str = "from-model") -> Plan:
    """Turn ``predict(cfg).to_dict()`` into a per-rank workload and step traffic.

    Args:
        prediction: the model's figures (``step_time_s``, ``checkpoint_interval_steps``,
            ``checkpoint_bytes_per_node``, ``classes``).
        duration: seconds the emulated checkpoint interval takes.
        steps: emulated steps (at least 3: DLIO's AU skips the first; at most one per real
            step of the interval).
        world: ranks on this node sharing its traffic.
        max_step_bytes: cap on one class's bytes per emulated step per node.
        restart: also read the checkpoint back (the ``checkpoint-read`` class).
    """
    if not 0 < duration < math.inf:  # NaN too
        raise ConfigError(f"--duration {duration} must be a positive number of seconds")
    if steps < 3:
        raise ConfigError(f"--steps {steps} must be at least 3 (AU skips the first step)")
    step_s = float(prediction["step_time_s"])
    interval = int(prediction.get("checkpoint_interval_steps") or steps)
    steps = min(steps, max(3, interval))
    # Time and bytes shrink together; an emulation longer than the real interval would
    # grow them instead (a 4.7 GB checkpoint emulated as 1.6 TB at 335x), so it is the
    # real interval at most.
    duration = min(duration, interval * step_s)
    scale = duration / (interval * step_s)
    real_per_emulated = interval / steps
    classes: dict[str, dict[str, Any]] = {}
    per_rank: dict[str, tuple[int, int]] = {}
    for cls in _STEP_CLASSES:
        c = prediction["classes"].get(cls)
        if not c or not c.get("enabled", True):
            continue
        node_step = float(c["per_node"]["bytes_per_step"])
        total = float(c["bytes_per_step"]) or 1.0
        read_frac = float(c.get("read_bytes_per_step", 0.0)) / total
        want = node_step * real_per_emulated * scale
        capped = want > max_step_bytes
        moved = min(want, float(max_step_bytes))
        per_rank[cls] = (int(moved * (1 - read_frac) / world), int(moved * read_frac / world))
        classes[cls] = {
            "required_MBps_per_node": node_step / step_s / 1e6,
            "emulated_bytes_per_step_per_node": moved,
            "capped": capped,
        }
    ck_node = float(prediction.get("checkpoint_bytes_per_node", 0.0))
    ck_rank = int(ck_node * scale / world)
    if ck_node:
        classes["checkpoint-write"] = {"bytes_per_node": ck_node,
                                       "emulated_bytes_per_node": ck_rank * world}
    data_write, data_read = per_rank.get("data-read", (0, 0))
    record = max(1, data_read + data_write)
    # zero_stage 1: every rank writes its model state (DLIO's writer rule for ZeRO >= 1).
    w = Workload(source=f"from-model {name}", model_name=name, framework="pytorch",
                 data_loader="pytorch", format="mmap_indexed_binary", num_files_train=1,
                 num_samples_per_file=steps * world, record_length=record,
                 batch_size=1, read_threads=1, generate_data=True, epochs=1,
                 computation_time=duration / steps, total_training_steps=steps,
                 do_checkpoint=ck_rank > 0, model_size=ck_rank, zero_stage=1,
                 steps_between_checkpoints=steps,
                 file_shuffle="seed", sample_shuffle="seed", au=0.90)
    io = [StepIO("offload", *per_rank[c]) for c in ("optimizer-offload", "activation-offload")
          if c in per_rank]
    return Plan(w, io, prediction, scale, steps, classes, duration)


def offload_step_io(prediction: dict[str, Any], step_s: float, world: int = 1,
                    max_step_bytes: int = 1 << 30) -> tuple[list[StepIO], dict[str, Any]]:
    """The optimizer/activation offload of ``prediction`` for steps of ``step_s`` seconds.

    For ``lcache bench run --offload-from``: each class moves its per-node bytes per model step
    scaled by ``step_s / step_time_s`` (so its bandwidth is the model's), split over ``world``
    ranks, capped at ``max_step_bytes`` per step and node.
    """
    if step_s <= 0:
        raise ConfigError("offload traffic needs train.computation_time > 0 to scale against")
    scale = step_s / float(prediction["step_time_s"])
    io: list[StepIO] = []
    info: dict[str, Any] = {"scale": scale, "classes": {}}
    for cls in ("optimizer-offload", "activation-offload"):
        c = prediction["classes"].get(cls)
        if not c or not c.get("enabled", True) or not c.get("bytes_per_step"):
            continue
        want = float(c["per_node"]["bytes_per_step"]) * scale
        moved = min(want, float(max_step_bytes))
        read_frac = float(c.get("read_bytes_per_step", 0.0)) / float(c["bytes_per_step"])
        io.append(StepIO("offload", int(moved * (1 - read_frac) / world),
                         int(moved * read_frac / world)))
        info["classes"][cls] = {
            "required_MBps_per_node": float(c["per_node"]["bytes_per_step"])
            / float(prediction["step_time_s"]) / 1e6,
            "emulated_bytes_per_step_per_node": moved, "capped": want > max_step_bytes}
    return io, info


def run_from_model(preset: str, duration: float, *, steps: int = 20, data_dir: str,
                   output: str, max_step_bytes: int = 1 << 30, restart: bool = False,
                   show_progress: bool = True, trace: bool = False,
                   **overrides: Any) -> dict[str, Any]:
    """Predict ``preset`` with ``overrides`` and emulate one node's I/O for ``duration`` s.

    Returns ``run_workload``'s summary plus a ``from_model`` section: the scale factor, what
    each class needs per node at full scale, what was moved, and the projected full-size
    checkpoint duration at the measured rate.
    """
    from lcache.model import config_from_preset, predict

    pred = predict(config_from_preset(preset, **overrides)).to_dict()
    world = launch_rank_world()[1]
    p = plan(pred, duration, steps, world, max_step_bytes, restart, name=preset)
    # One folder per dataset shape: files kept from a run with other steps or another scale
    # would be read with their own sample count and sizes, not the ones this run needs.
    w = p.workload
    data_dir = os.path.join(data_dir, f"{w.num_samples_per_file}x{w.record_length}B")
    opts = BenchOptions(data_dir=data_dir, output=output,
                        checkpoint_dir=os.path.join(output, "checkpoints"),
                        show_progress=show_progress, step_io=p.step_io, trace=trace,
                        drop_cache=True, progress_label=f"{preset} ",
                        read_back=1 if restart else 0)
    summary = run_workload(p.workload, opts)
    m = summary.get("metric", {})
    rate = m.get("save_checkpoint_io_mean_GB_per_second")
    ck_node = float(pred.get("checkpoint_bytes_per_node", 0.0))
    projected = ck_node / (rate * 2**30) if rate else None
    capped = [c for c, v in p.classes.items() if v.get("capped")]
    info = {
        "preset": preset, "overrides": overrides, "duration_s": p.duration,
        "duration_asked_s": duration, "scale": p.scale, "steps": p.steps,
        "steps_asked": steps,
        "step_time_s": pred["step_time_s"],
        "emulated_step_s": p.duration / p.steps,
        "checkpoint_interval_steps": pred.get("checkpoint_interval_steps"),
        "classes": p.classes, "capped": capped,
        "projected_checkpoint_write_s_per_node": projected,
        "checkpoint_interval_s": pred.get("checkpoint_interval_s"),
    }
    if "metric" in summary:
        verdict = summary.get("verdict", "")
        if capped:
            verdict = (f"NOT MET: {', '.join(capped)} asks more than --max-step-bytes "
                       f"({format_size(max_step_bytes)}) per emulated step, so the run moved "
                       "less than the model needs and its AU flatters the storage; " + verdict)
        interval_s = pred.get("checkpoint_interval_s")
        if projected is not None:
            verdict += (f"; a full {ck_node / 2**30:.1f} GiB node checkpoint would take "
                        f"{projected:.1f} s at the measured rate")
            if interval_s:
                verdict += (f", {projected / interval_s:.1%} of the {interval_s:.0f} s "
                            "checkpoint interval if training waits for it")
        summary["verdict"] = verdict
        summary["from_model"] = info
    return summary
