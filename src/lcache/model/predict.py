"""Per-I/O-class demand of a training configuration, and whether the node's SSDs keep up.

Each class is described by the bytes it moves per occurrence ("event": a step, a checkpoint, a
restart) and the time window the I/O may use: with overlap it runs behind compute (a step, or
the whole checkpoint interval); without overlap the GPUs wait for it, so it must fit in
``max_stall_fraction`` of that window. A restart has nothing to overlap with: it must load within
``restart_budget_s``. Global bytes are split evenly over nodes and GPUs (sharded checkpoints and
offload, as torch.distributed.checkpoint and ZeRO-Infinity write them). MBps are 1e6 B/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lcache.errors import ConfigError
from lcache.model import formulas as f
from lcache.model.config import DAY_S, DEFAULT_CHECKPOINT_MINUTES, TrainingConfig

CLASSES = ("data-read", "checkpoint-write", "checkpoint-read", "optimizer-offload",
           "activation-offload")
MB = 1e6
__all__ = ["CLASSES", "DAY_S", "MB", "ClassDemand", "Prediction", "predict", "ssd_verdict"]


@dataclass
class ClassDemand:
    """One I/O class's traffic. Bytes are global (all nodes) unless a key says otherwise.

    Attributes:
        name: the class (``data-read``...).
        direction: ``read``, ``write`` or ``readwrite``.
        enabled: False when the configuration does not do this I/O (offload off); figures are 0.
        read_bytes_per_event: bytes read per occurrence.
        write_bytes_per_event: bytes written per occurrence.
        per_step: True when the event is a training step.
        events_per_day: occurrences per day.
        overlap_window_s: time the I/O of one event may take behind compute.
        no_overlap_window_s: time it may take when the GPUs wait for it.
        nodes: nodes the bytes are spread over.
        gpus: GPUs the bytes are spread over.
        note: how the bytes are computed.
        steps_per_day: training steps a day, to spread a class's daily bytes over the steps.
    """

    name: str
    direction: str
    enabled: bool
    read_bytes_per_event: float
    write_bytes_per_event: float
    per_step: bool
    events_per_day: float
    overlap_window_s: float
    no_overlap_window_s: float
    nodes: int
    gpus: int
    note: str = ""
    steps_per_day: float = 0.0

    @property
    def bytes_per_event(self) -> float:
        return self.read_bytes_per_event + self.write_bytes_per_event

    def _mbps(self, nbytes: float, window: float) -> float:
        return nbytes / self.nodes / window / MB if window > 0 and nbytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        per_day = self.bytes_per_event * self.events_per_day
        read_day = self.read_bytes_per_event * self.events_per_day
        write_day = self.write_bytes_per_event * self.events_per_day
        step = self.per_step

        # A class that happens per checkpoint or restart moves nothing at most steps; spread
        # over the steps, its daily bytes are what it costs a step on average.
        amortized = per_day / self.steps_per_day if self.steps_per_day else 0.0

        def split(n: int) -> dict[str, float]:
            return {"bytes_per_step": self.bytes_per_event / n if step else 0.0,
                    "amortized_bytes_per_step": amortized / n,
                    "bytes_per_event": self.bytes_per_event / n,
                    "read_bytes_per_day": read_day / n, "write_bytes_per_day": write_day / n,
                    "bytes_per_day": per_day / n}

        return {
            "direction": self.direction,
            "enabled": self.enabled,
            "event": "step" if step else ("checkpoint" if self.name == "checkpoint-write"
                                          else "restart"),
            "bytes_per_step": self.bytes_per_event if step else 0.0,
            "read_bytes_per_step": self.read_bytes_per_event if step else 0.0,
            "write_bytes_per_step": self.write_bytes_per_event if step else 0.0,
            "amortized_bytes_per_step": amortized,
            "steps_per_event": (self.steps_per_day / self.events_per_day
                                if self.events_per_day else None),
            "bytes_per_event": self.bytes_per_event,
            "read_bytes_per_event": self.read_bytes_per_event,
            "write_bytes_per_event": self.write_bytes_per_event,
            "events_per_day": self.events_per_day,
            "bytes_per_day": per_day,
            "read_bytes_per_day": read_day,
            "write_bytes_per_day": write_day,
            "per_node": split(self.nodes),
            "per_gpu": split(self.gpus),
            "per_node_bytes_per_day": per_day / self.nodes,
            "per_gpu_bytes_per_day": per_day / self.gpus,
            "overlap_window_s": self.overlap_window_s,
            "no_overlap_window_s": self.no_overlap_window_s,
            "MBps_needed_overlap": self._mbps(self.bytes_per_event, self.overlap_window_s),
            "MBps_needed_no_overlap": self._mbps(self.bytes_per_event, self.no_overlap_window_s),
            "read_MBps_needed_overlap": self._mbps(self.read_bytes_per_event,
                                                   self.overlap_window_s),
            "write_MBps_needed_overlap": self._mbps(self.write_bytes_per_event,
                                                    self.overlap_window_s),
            "read_MBps_needed_no_overlap": self._mbps(self.read_bytes_per_event,
                                                      self.no_overlap_window_s),
            "write_MBps_needed_no_overlap": self._mbps(self.write_bytes_per_event,
                                                       self.no_overlap_window_s),
            "note": self.note,
        }


@dataclass
class Prediction:
    """What :func:`predict` computed; :meth:`to_dict` is the JSON ``lcache model`` prints."""

    config: TrainingConfig
    params: int
    flops_per_token: float
    step_time_s: float
    tokens_per_step: int
    checkpoint_bytes: float
    checkpoint_interval_steps: int
    checkpoint_interval_s: float
    memory: dict[str, Any]
    classes: dict[str, ClassDemand]
    ssd: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures (units in the key names: bytes, s, MBps = 1e6 B/s)."""
        cfg = self.config
        return {
            "model": cfg.model.name,
            "params": self.params,
            "flops_per_token": self.flops_per_token,
            "tokens_per_step": self.tokens_per_step,
            "step_time_s": self.step_time_s,
            "steps_per_day": DAY_S / self.step_time_s,
            "tokens_per_day": DAY_S / self.step_time_s * self.tokens_per_step,
            "checkpoint_bytes": self.checkpoint_bytes,
            "checkpoint_bytes_per_param": f.checkpoint_bytes_per_param(
                cfg.weight_dtype, cfg.master_dtype, cfg.optimizer_state_dtype),
            "checkpoint_bytes_per_node": self.checkpoint_bytes / cfg.nodes,
            "checkpoint_bytes_per_gpu": self.checkpoint_bytes / cfg.gpus,
            "checkpoint_interval_steps": self.checkpoint_interval_steps,
            "checkpoint_interval_s": self.checkpoint_interval_s,
            "gpus": cfg.gpus,
            "nodes": cfg.nodes,
            "dp": cfg.data_parallel,
            "memory": self.memory,
            "classes": {name: demand.to_dict() for name, demand in self.classes.items()},
            "ssd": self.ssd,
            "config": cfg.to_dict(),
        }


def _checkpoint_interval(cfg: TrainingConfig, step_s: float) -> int:
    if cfg.checkpoint_interval_steps is not None:
        return cfg.checkpoint_interval_steps
    minutes = cfg.checkpoint_interval_minutes or DEFAULT_CHECKPOINT_MINUTES
    return max(1, round(minutes * 60 / step_s))


def _memory(cfg: TrainingConfig, params: int) -> dict[str, Any]:
    m = cfg.model
    weight_b = f.dtype_bytes(cfg.weight_dtype)
    opt_b = f.optimizer_bytes_per_param(cfg.master_dtype, cfg.optimizer_state_dtype)
    states = f.model_state_bytes_per_gpu(
        params, tp=cfg.tp, pp=cfg.pp, dp=cfg.data_parallel, zero_stage=cfg.zero_stage,
        weight_bytes=weight_b, grad_bytes=weight_b, optimizer_bytes=opt_b,
        optimizer_offloaded=cfg.optimizer_offload)
    per_layer = f.activation_bytes_per_layer(
        m.seq_len, cfg.micro_batch, m.hidden, m.heads, tp=cfg.tp, recompute=cfg.recompute,
        sequence_parallel=cfg.sequence_parallel)
    # 1F1B keeps up to pp micro-batches in flight on the first stage, each holding L/pp layers:
    # L layers' worth in all (Korthikanti et al. 2022, section 4.2.3).
    in_flight = min(cfg.pp, cfg.micro_batches_per_step)
    resident = per_layer * m.layers / cfg.pp * in_flight
    on_gpu = sum(states.values()) + (0.0 if cfg.activation_offload else resident)
    return {
        "bytes_per_param": f.memory_bytes_per_param(cfg.weight_dtype, cfg.weight_dtype,
                                                    cfg.master_dtype, cfg.optimizer_state_dtype),
        "model_state_bytes": params * f.memory_bytes_per_param(
            cfg.weight_dtype, cfg.weight_dtype, cfg.master_dtype, cfg.optimizer_state_dtype),
        **{f"per_gpu_{k}": v for k, v in states.items()},
        "activation_bytes_per_layer": per_layer,
        "per_gpu_activation_bytes": resident,
        "per_gpu_bytes": on_gpu,
        "hbm_bytes": cfg.gpu_hbm_bytes,
        "fits": on_gpu <= cfg.gpu_hbm_bytes,
    }


def predict(cfg: TrainingConfig) -> Prediction:
    """Step time, per-class I/O and the SSD verdict for one training configuration.

    Raises:
        ConfigError: the configuration is invalid (see :meth:`TrainingConfig.validate`), or
            its settings, each finite, are so far apart that a figure leaves float range.
    """
    if not isinstance(cfg, TrainingConfig):  # None raised "has no attribute 'validate'"
        raise ConfigError(f"cfg={cfg!r:.200}: give a TrainingConfig (from "
                          "config_from_preset, load_model_file or build_config)")
    cfg.validate()
    try:
        pred = _predict(cfg)
        doc = pred.to_dict()
    except (ZeroDivisionError, OverflowError) as exc:
        raise _out_of_range(cfg, f"the arithmetic fails ({exc})") from None
    where = _first_non_finite(doc)
    if where is not None:
        raise _out_of_range(cfg, f"{where[0]} comes out as {where[1]!r}")
    return pred


def _out_of_range(cfg: TrainingConfig, what: str) -> ConfigError:
    # validate() keeps every setting finite and in range on its own; only extreme
    # combinations (a huge peak_flops with a huge checkpoint interval...) get here.
    return ConfigError(
        f"settings out of range for the model: {what}; check the extreme ones among gpus "
        f"{cfg.gpus}, peak_flops {cfg.gpu_peak_flops:g}, global_batch {cfg.global_batch}, "
        f"seq_len {cfg.model.seq_len}, checkpoint_interval_minutes "
        f"{cfg.checkpoint_interval_minutes!r}, checkpoint_interval_steps "
        f"{cfg.checkpoint_interval_steps!r}, restarts_per_day {cfg.restarts_per_day!r}")


def _first_non_finite(doc: Any, path: str = "") -> tuple[str, float] | None:
    """The first (key path, value) of ``doc`` that is an infinite or NaN float."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            found = _first_non_finite(value, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(doc, float) and not math.isfinite(doc):
        return path, doc
    return None


def _predict(cfg: TrainingConfig) -> Prediction:
    m = cfg.model
    params = f.param_count(m)
    fpt = f.flops_per_token(m, params)
    tokens = cfg.global_batch * m.seq_len
    step_s = f.step_time_s(tokens_per_step=tokens, flops_per_token=fpt, gpus=cfg.gpus,
                           peak_flops=cfg.gpu_peak_flops, mfu=cfg.mfu)
    steps_per_day = DAY_S / step_s
    ckpt_per_param = f.checkpoint_bytes_per_param(cfg.weight_dtype, cfg.master_dtype,
                                                  cfg.optimizer_state_dtype)
    ckpt_bytes = float(params * ckpt_per_param)
    interval = _checkpoint_interval(cfg, step_s)
    interval_s = interval * step_s
    memory = _memory(cfg, params)
    stall = cfg.max_stall_fraction
    common: dict[str, Any] = {"nodes": cfg.nodes, "gpus": cfg.gpus,
                              "steps_per_day": steps_per_day}

    token_b = cfg.bytes_per_token or f.token_bytes_for_vocab(m.vocab)
    opt_b = f.optimizer_bytes_per_param(cfg.master_dtype, cfg.optimizer_state_dtype)
    # Without ZeRO every data-parallel replica updates (and so offloads) its own full copy.
    opt_copies = 1 if cfg.zero_stage >= 1 else cfg.data_parallel
    opt_bytes = float(params * opt_b * opt_copies) if cfg.optimizer_offload else 0.0
    # Every micro-batch's saved activations go out in forward and come back in backward.
    act_per_gpu = (memory["activation_bytes_per_layer"] * m.layers / cfg.pp
                   * cfg.micro_batches_per_step)
    act_bytes = act_per_gpu * cfg.gpus if cfg.activation_offload else 0.0

    classes = {
        "data-read": ClassDemand(
            "data-read", "read", True, float(tokens * token_b), 0.0, True, steps_per_day,
            step_s, stall * step_s, **common,
            note=f"global_batch x seq_len x {token_b} B/token"),
        "checkpoint-write": ClassDemand(
            "checkpoint-write", "write", True, 0.0, ckpt_bytes, False, DAY_S / interval_s,
            interval_s, stall * interval_s, **common,
            note=f"params x {ckpt_per_param} B every {interval} steps"),
        "checkpoint-read": ClassDemand(
            "checkpoint-read", "read", True, ckpt_bytes, 0.0, False, cfg.restarts_per_day,
            cfg.restart_budget_s, cfg.restart_budget_s, **common,
            note=f"the checkpoint, {cfg.restarts_per_day:g} restarts/day, "
                 f"{cfg.restart_budget_s:g} s to load"),
        "optimizer-offload": ClassDemand(
            "optimizer-offload", "readwrite", cfg.optimizer_offload, opt_bytes, opt_bytes,
            True, steps_per_day, step_s, stall * step_s, **common,
            note=f"params x {opt_b} B read and written back per step"),
        "activation-offload": ClassDemand(
            "activation-offload", "readwrite", cfg.activation_offload, act_bytes, act_bytes,
            True, steps_per_day, step_s, stall * step_s, **common,
            note=f"{cfg.recompute} recomputation, per micro-batch saved activations out in "
                 "forward, back in backward"),
    }
    pred = Prediction(cfg, params, fpt, step_s, tokens, ckpt_bytes, interval, interval_s,
                      memory, classes)
    pred.ssd = ssd_verdict(cfg, pred)
    return pred


def ssd_verdict(cfg: TrainingConfig, pred: Prediction) -> dict[str, Any]:
    """Whether the node's SSDs sustain the overlapped demand, hold what must stay, and last."""
    docs = {name: c.to_dict() for name, c in pred.classes.items()}
    n = cfg.ssds_per_node
    write_day = sum(d["per_node"]["write_bytes_per_day"] for d in docs.values())
    # Restarts are rare and the GPUs idle through them: sized separately, not summed with
    # the steady-state traffic.
    steady = [d for name, d in docs.items() if name != "checkpoint-read"]
    write_need = sum(d["write_MBps_needed_overlap"] for d in steady) * MB
    read_need = sum(d["read_MBps_needed_overlap"] for d in steady) * MB
    restart_need = docs["checkpoint-read"]["read_MBps_needed_overlap"] * MB
    write_have, read_have = n * cfg.ssd_write_bytes_per_s, n * cfg.ssd_read_bytes_per_s
    capacity = n * cfg.ssd_capacity_bytes
    held = cfg.retention * pred.checkpoint_bytes / cfg.nodes
    if cfg.optimizer_offload:
        held += pred.classes["optimizer-offload"].read_bytes_per_event / cfg.nodes
    if cfg.activation_offload:
        held += pred.memory["per_gpu_activation_bytes"] * min(cfg.gpus, cfg.gpus_per_node)
    dwpd = write_day / capacity
    ratios = {
        "write_bandwidth": write_have / write_need if write_need else float("inf"),
        "read_bandwidth": read_have / read_need if read_need else float("inf"),
        "restart_read_bandwidth": read_have / restart_need if restart_need else float("inf"),
        "capacity": capacity / held if held else float("inf"),
    }
    keeps_up = all(r >= 1 for r in ratios.values())
    limit = min(ratios, key=lambda k: ratios[k])
    margin = ratios[limit]
    endurance_ok = dwpd <= cfg.ssd_rated_dwpd
    verdict = (
        f"{'keeps up' if keeps_up else 'does NOT keep up'}: {n} SSDs per node, tightest is "
        f"{limit.replace('_', ' ')} at {margin:.2f}x of need "
        f"(write {write_need / MB:,.0f} of {write_have / MB:,.0f} MB/s, read "
        f"{read_need / MB:,.0f} of {read_have / MB:,.0f} MB/s, restart "
        f"{restart_need / MB:,.0f} MB/s, holds {held / 1e12:,.2f} of {capacity / 1e12:,.2f} TB); "
        f"{dwpd:.3f} DWPD against {cfg.ssd_rated_dwpd:g} rated"
        f"{'' if endurance_ok else ' -- wears out early'}")
    return {
        "ssds_per_node": n,
        "write_bytes_per_day_per_node": write_day,
        "dwpd": dwpd,
        "rated_dwpd": cfg.ssd_rated_dwpd,
        "endurance_ok": endurance_ok,
        "write_MBps_needed_per_node": write_need / MB,
        "read_MBps_needed_per_node": read_need / MB,
        "restart_read_MBps_needed_per_node": restart_need / MB,
        "write_MBps_available_per_node": write_have / MB,
        "read_MBps_available_per_node": read_have / MB,
        "bytes_held_per_node": held,
        "capacity_bytes_per_node": capacity,
        "ratios": {k: (v if v != float("inf") else None) for k, v in ratios.items()},
        "limited_by": limit,
        "keeps_up": keeps_up,
        "margin": margin if margin != float("inf") else None,
        "verdict": verdict,
    }
