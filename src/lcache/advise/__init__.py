"""``lcache advise``: from a trace to what storage must do, whether it does, and what to change.

Fit the trace (steps, per-class bytes per step, request sizes, mix, concurrency, the dataset,
the checkpoints), emit a DLIO workload that reproduces it, scale it to a cluster with
``lcache model``, run it on candidate storage with ``lcache bench``, and advise, with the
arithmetic behind every figure. See docs/advise.md.

Example:
    >>> from lcache.advise import Targets
    >>> Targets().hit_ratio
    0.9
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from lcache.advise.advice import Targets, advise_all
from lcache.advise.emit import to_yaml, workload
from lcache.advise.fit import fit
from lcache.checks import flag, path_argument, whole_number
from lcache.errors import ConfigError
from lcache.io import atomic_write
from lcache.model.config import MAX_COUNT
from lcache.report.load import load

__all__ = ["Targets", "advise"]

PathLike = str | os.PathLike[str]


def advise(paths: PathLike | Sequence[PathLike], targets: Targets | None = None, *,
           scale_gpus: int | None = None, model: str | None = None, gpus_per_node: int = 8,
           traced_gpus: int | None = None, storage: str | None = None, check_epochs: int = 1,
           html_path: PathLike | None = None, show_progress: bool = False) -> dict[str, Any]:
    """Fit, emit, scale (with ``scale_gpus`` or ``model``), check (with ``storage``) and advise.

    ``traced_gpus``: the GPUs (ranks) the traces hold; default one per trace file (as
    ``lcache bench --trace`` writes them), or the processes that recorded step markers at
    once where more.

    Returns ``{"fit", "workload": {"doc", "yaml", "notes"}, "scale", "check", "advice",
    "unfitted"}``; writes the advice page to ``html_path``.

    Raises:
        lcache.trace.TraceFormatError: a trace file is missing, truncated or not a trace.
        ConfigError: an argument of the wrong kind or out of range (the ranges of
            ``lcache advise``'s options), an unknown ``model``, or a ``storage`` that is not
            an existing directory or cannot be used.
    """
    names = _trace_names(paths)
    if targets is not None and not isinstance(targets, Targets):
        raise ConfigError(f"targets={targets!r:.200}: give a lcache.advise.Targets (or None), "
                          "such as Targets(hit_ratio=0.9)")
    t = targets or Targets()
    if scale_gpus is not None:
        whole_number(scale_gpus, "scale_gpus", 1, MAX_COUNT["gpus"])
    if model is not None and not isinstance(model, str):
        raise ConfigError(f"model={model!r:.200}: give a preset's name (lcache model --list)")
    whole_number(gpus_per_node, "gpus_per_node", 1, MAX_COUNT["gpus_per_node"])
    if traced_gpus is not None:
        whole_number(traced_gpus, "traced_gpus", 1, 1 << 24)
    if storage is not None:
        storage = path_argument(storage, "storage")
    whole_number(check_epochs, "check_epochs", 1, 1000)
    if html_path is not None:
        path_argument(html_path, "html_path")
    flag(show_progress, "show_progress")
    if storage is not None:
        from lcache.advise.check import check_storage

        check_storage(storage)  # up front: refused whatever the trace holds, never created
    trace = load(paths)
    fitted = fit(trace)
    doc, notes = workload(fitted)
    out: dict[str, Any] = {"fit": fitted, "workload": {"doc": doc, "notes": notes,
                                                       "yaml": to_yaml(doc, notes,
                                                                       ", ".join(names))},
                           "scale": None, "check": None, "unfitted": fitted["unfitted"]}
    if scale_gpus is not None or model is not None:
        from lcache.advise.scale import scale

        out["scale"] = scale(fitted, scale_gpus, gpus_per_node,
                             traced_gpus or max(len(names), fitted["steps"].get("ranks", 1)),
                             t, model)
    if storage is not None:
        from lcache.advise.check import run_check

        if not doc["workflow"]["train"] and not doc["workflow"]["checkpoint"]:
            out["check"] = None
            out["unfitted"].append({"what": "check", "why": f"nothing to check on {storage}: "
                                    "the emitted workload does nothing (no data reads, no "
                                    "checkpoints) to run there"})
        else:
            out["check"] = run_check(doc, storage, fitted, t.max_stall, check_epochs,
                                     show_progress)
    out["advice"] = advise_all(fitted, out["scale"], t)
    if html_path is not None:
        from lcache.advise.page import render_page

        atomic_write(os.fspath(html_path), render_page(trace, out).encode(), mode=0o644)
    return out


def _trace_names(paths: Any) -> list[str]:
    """``paths`` (one path or a sequence of them) as a list of path strings, or a ConfigError
    (an int was iterated: "'int' object is not iterable"). A missing or empty one is the
    loader's to refuse, naming the file."""
    many = isinstance(paths, Sequence) and not isinstance(paths, (str, bytes))
    given = list(paths) if many else [paths]
    if not given or not all(isinstance(p, (str, os.PathLike)) for p in given):
        raise ConfigError(f"paths={paths!r:.200}: give a trace file's path or a non-empty "
                          "list of them")
    return [os.fspath(p) for p in given]
