"""The few collectives a multi-rank checkpoint needs (torch.distributed, any backend).

They run only on the thread that called ``save``/``wait``: gloo deadlocks when two threads of
one rank issue collectives, so the background persist never touches the process group.
"""

from __future__ import annotations

import sys
from typing import Any


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) without one."""
    if "torch.distributed" not in sys.modules:  # no process group can exist; importing
        return 0, 1  # torch here would cost seconds for a numpy-only state
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj`` (small JSON-able values), in rank order."""
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any, world: int) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if world == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
