"""Scale the traced job to a target cluster: per GPU and per node bandwidth, bytes per day,
drive writes per day. The traced figures are per traced GPU (one rank, unless told); with
``--model`` the cluster's own I/O comes from ``lcache model`` (docs/model.md)."""

from __future__ import annotations

import math
from typing import Any

from lcache.advise.advice import DAY_S, Targets
from lcache.errors import ConfigError
from lcache.model.config import MAX_COUNT, TrainingConfig

#: Figures taken from ``lcache model``'s prediction for the table (per node, MBps = 1e6 B/s).
_MODEL_KEYS = ("MBps_needed_overlap", "MBps_needed_no_overlap")


def scale(fitted: dict[str, Any], gpus: int | None, gpus_per_node: int, traced_gpus: int,
          t: Targets, model: str | None = None) -> dict[str, Any]:
    """The traced per-GPU demand times the cluster; and ``lcache model``'s for ``model``.
    Without ``gpus``: the preset's own GPU count, else one node."""
    pred = None
    if model is not None:
        from lcache.model import predict

        pred = predict(_preset_config(model, gpus, gpus_per_node)).to_dict()
        gpus = int(pred["gpus"])
    gpus = gpus or gpus_per_node
    nodes = math.ceil(gpus / gpus_per_node)
    per_node_gpus = min(gpus, gpus_per_node)
    out: dict[str, Any] = {"gpus": gpus, "gpus_per_node": gpus_per_node, "nodes": nodes,
                           "traced_gpus": traced_gpus}
    steps = fitted["steps"]
    if steps["step_s"]:
        per_gpu: dict[str, Any] = {}
        for name, g in fitted["groups"].items():
            per_step = (g["read_bytes"] + g["write_bytes"]) / max(1, steps["count"])
            per_gpu[name] = {
                "MBps": round(per_step / steps["step_s"] / traced_gpus / 1e6, 3),
                "write_bytes_per_day": round(g["write_bytes"] / max(1, steps["count"])
                                             / steps["step_s"] / traced_gpus * DAY_S)}
        write_day = sum(c["write_bytes_per_day"] for c in per_gpu.values()) * per_node_gpus
        out["from_trace"] = {
            "per_gpu_MBps": {k: v["MBps"] for k, v in per_gpu.items()},
            "per_node_MBps": {k: round(v["MBps"] * per_node_gpus, 3)
                              for k, v in per_gpu.items()},
            "write_bytes_per_day_per_node": write_day,
            "dwpd": round(write_day / (t.ssds * t.ssd_capacity_bytes), 4),
            "arithmetic": (f"per GPU = bytes per step / {steps['step_s']:.4f} s a step / "
                           f"{traced_gpus} traced GPU(s); per node x {per_node_gpus} GPUs; "
                           f"DWPD = writes a day / ({t.ssds} x "
                           f"{t.ssd_capacity_bytes / 1e12:g} TB)")}
    else:
        out["from_trace"] = None
        out["why"] = "no step time in the trace: " + (steps.get("why") or "")
    if pred is not None:
        out["model"] = pred
        out["model_per_node_MBps"] = {
            name: {k: round(c[k], 3) for k in _MODEL_KEYS} for name, c in pred["classes"].items()
            if c["enabled"]}
    return out


def _preset_config(model: str, gpus: int | None, per_node: int) -> TrainingConfig:
    """``model``'s preset on ``gpus`` (default: its own), with optimizer offload on so that
    the advice can say whether it fits (docs/advise.md). A GPU count the preset cannot run
    on is refused as ``lcache model --gpus`` refuses it, said with advise's options and the
    nearest counts that work, as the preset's own rules find them: the model's message alone
    named settings advise has no option for ("global_batch 512 is not a multiple of
    micro_batch x dp = 1 x 7"; attack helper 87)."""
    from lcache.model import config_from_preset

    def config(count: int | None) -> TrainingConfig:
        settings: dict[str, Any] = {"gpus_per_node": per_node, "optimizer_offload": True}
        return config_from_preset(model, **settings, **({} if count is None else
                                                         {"gpus": count}))

    try:
        return config(gpus)
    except ConfigError as exc:
        try:
            n = gpus or config_from_preset(model).gpus
        except ConfigError:  # the preset itself (an unknown name): its message says it
            raise exc from None
        near = [_nearest_count(config, n, step) for step in (-1, 1)]
        works = [f"{c:,}" for c in near if c is not None]
        if not works:
            raise
        given = f"its own {n:,} GPUs" if gpus is None else f"{n:,} GPUs (--scale-gpus {n})"
        raise ConfigError(f"--model {model} cannot run on {given} with --gpus-per-node "
                          f"{per_node}, as the preset's settings say ({exc}); give "
                          f"--scale-gpus {' or '.join(works)} (the nearest that "
                          f"work{'s' if len(works) == 1 else ''}), or another --gpus-per-node"
                          ) from None


def _nearest_count(config: Any, n: int, step: int) -> int | None:
    """The GPU count nearest ``n`` in direction ``step`` that ``config`` takes, tried by the
    preset's own rules among the 1,024 counts that way and the powers of two (each try
    builds a configuration: all counts up to 4,000,000 took 13 s); None if none."""
    most = int(MAX_COUNT["gpus"])
    near = range(n + step, 0 if step < 0 else most + 1, step)[:1024]
    powers = [1 << k for k in range(most.bit_length())]
    for count in sorted({*near, *(p for p in powers if (p - n) * step > 0)},
                        key=lambda c: abs(c - n)):
        try:
            config(count)
            return int(count)
        except ConfigError:
            continue
    return None
