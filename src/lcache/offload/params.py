"""The parameters an ``OffloadedOptimizer`` is given: named, grouped, and refused up front
where the swap could not hold them or would train them otherwise than torch."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch

from lcache.errors import ConfigError


def named_groups(params: Iterable[Any]) -> tuple[list[str], list[Any], list[dict[str, Any]]]:
    """(names, tensors, groups) from tensors, ``(name, tensor)`` pairs or param-group dicts;
    each group dict keeps its options and gets ``"params"``: the indices of its tensors."""
    if isinstance(params, torch.Tensor):
        raise ConfigError("params must be an iterable of tensors, (name, tensor) pairs or "
                          "param-group dicts, not one tensor")
    try:
        items = list(params)
    except TypeError:  # None, a number: nothing to iterate
        raise ConfigError(f"params={params!r:.100}: give an iterable of tensors, (name, "
                          "tensor) pairs or param-group dicts, e.g. model.parameters()") from None
    if not items:
        raise ConfigError("OffloadedOptimizer got an empty parameter list")
    raw_groups = items if isinstance(items[0], dict) else [{"params": items}]
    names: list[str] = []
    tensors: list[Any] = []
    groups: list[dict[str, Any]] = []
    for g, raw in enumerate(raw_groups):
        if not isinstance(raw, dict) or "params" not in raw:
            raise ConfigError("parameters must be all tensors, all (name, tensor) pairs, or "
                              "all param-group dicts with a 'params' key")
        # a bare tensor is one parameter, as torch takes it (list() split it into rows)
        members = [raw["params"]] if isinstance(raw["params"], torch.Tensor) else \
            list(raw["params"])
        group = {k: v for k, v in raw.items() if k != "params"}
        group["params"] = []
        for i, item in enumerate(members):
            name, tensor = item if isinstance(item, tuple) else (f"{g}.{i}", item)
            if not getattr(tensor, "is_floating_point", lambda: False)():
                raise ConfigError(f"parameter {name!r} is not a floating-point tensor")
            if tensor.dtype == torch.float64:  # the masters are fp32: it would lose bits
                raise ConfigError(f"parameter {name!r} is float64; the swap keeps fp32 master "
                                  "weights: train it as float32, bfloat16 or float16")
            check_layout(str(name), tensor)
            group["params"].append(len(tensors))
            names.append(str(name))
            tensors.append(tensor)
        groups.append(group)
    if len(set(names)) != len(names):
        raise ConfigError("parameter names must be unique (they name the state in the swap "
                          "file and in checkpoints)")
    if len({id(t) for t in tensors}) != len(tensors):
        raise ConfigError("a parameter appears twice in the parameter list")
    if not tensors:  # groups all empty: nothing to swap (a checkpoint's pin never let go)
        raise ConfigError("OffloadedOptimizer got param groups with no parameters")
    _refuse_shared_memory(names, tensors)
    return names, tensors, groups


def _refuse_shared_memory(names: list[str], tensors: list[Any]) -> None:
    """Two parameters over one memory (a view made a Parameter) are updated one after the
    other from one swap each: the second overwrote the first's update in another order than
    torch's, and training drifted from step 1."""
    spans = sorted((str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(),
                    n) for n, t in zip(names, tensors, strict=True) if t.numel())
    for (dev, _, end, first), (dev2, start, _, second) in itertools.pairwise(spans):
        if dev == dev2 and start < end:
            raise ConfigError(f"parameters {first!r} and {second!r} share memory; give the "
                              "optimizer each storage once (tie them as one Parameter)")


def check_layout(name: str, tensor: Any, numel: int | None = None) -> None:
    """A parameter the swap can hold and the steps can write: dense, contiguous, with
    storage (of ``numel`` elements, once laid out)."""
    if tensor.is_meta or tensor.layout != torch.strided:
        raise ConfigError(f"parameter {name!r} has no dense storage ({tensor.device.type} "
                          f"device, {tensor.layout} layout); materialize the model (dense, "
                          "on the CPU or a GPU) before making its optimizer")
    if not tensor.is_contiguous():
        raise ConfigError(f"parameter {name!r} is not contiguous; make it so before making "
                          "its optimizer (p.data = p.data.contiguous())")
    if numel is not None and tensor.numel() != numel:
        raise ConfigError(f"parameter {name!r} now has {tensor.numel()} elements, not the "
                          f"{numel} the swap file was laid out for")
