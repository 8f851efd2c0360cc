"""Scale the traced job to a target cluster: per GPU and per node bandwidth, bytes per day,
drive writes per day. The traced figures are per traced GPU (one rank, unless told); with
``--model`` the cluster's own I/O comes from ``lcache model`` (docs/model.md)."""

from __future__ import annotations

import math
from typing import Any

from lcache.advise.advice import DAY_S, Targets

#: Figures taken from ``lcache model``'s prediction for the table (per node, MBps = 1e6 B/s).
_MODEL_KEYS = ("MBps_needed_overlap", "MBps_needed_no_overlap")


def scale(fitted: dict[str, Any], gpus: int | None, gpus_per_node: int, traced_gpus: int,
          t: Targets, model: str | None = None) -> dict[str, Any]:
    """The traced per-GPU demand times the cluster; and ``lcache model``'s for ``model``.
    Without ``gpus``: the preset's own GPU count, else one node."""
    pred = None
    if model is not None:
        from lcache.model import config_from_preset, predict

        # Offload on, so that the advice can say whether it fits (docs/advise.md).
        settings: dict[str, Any] = {"gpus_per_node": gpus_per_node, "optimizer_offload": True}
        if gpus is not None:
            settings["gpus"] = gpus
        pred = predict(config_from_preset(model, **settings)).to_dict()
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
