"""The collectives of a multi-rank checkpoint (torch.distributed, any backend for training).

Every rank's persist thread votes on its checkpoint as soon as its shard is durable, and rank 0
publishes it then: no collective runs on the training thread. The votes go over a gloo process
group of the checkpoint's own, made once by every rank in their first multi-rank save
(``new_group`` is itself collective), as torch's ``async_save`` does: gloo deadlocks when two
threads of one rank issue collectives on one group, so the training's groups are never used
from the background. Votes run in the order their saves started, the same on every rank, even
with several checkpointers. Messages are JSON in byte tensors: nothing a rank sends is
unpickled.
"""

from __future__ import annotations

import atexit
import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lcache.forksafe import fork_safe_lock


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


_group: tuple[Any, Any] | None = None  # (the default group it was made in, the vote group)
_group_lock = fork_safe_lock()


def vote_group() -> Any:
    """The checkpoints' own gloo group of every rank.

    Call it on the thread that saves, where every rank reaches it in the same order: the first
    call (and the first after the default group is replaced) is a collective.
    """
    import torch.distributed as dist

    global _group
    with _group_lock:
        world = dist.group.WORLD
        if _group is None or _group[0] is not world:
            if _group is None:
                atexit.register(_forget_group)
            _group = (world, dist.new_group(backend="gloo", timeout=_timeout_of(world)))
        return _group[1]


def _timeout_of(group: Any) -> Any:
    """The timeout ``group`` was made with (``init_process_group(timeout=)``), or None for
    torch's default: without it the vote group waited torch's 30 minutes for a rank that had
    failed on its own, whatever the job's timeout."""
    import torch

    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # no such backend on the group, or torch's private API moved
            continue
    return None


def _forget_group() -> None:
    """Let the groups go while the interpreter is whole: a gloo group still referenced when it
    is torn down aborts the process (4 of 60 runs of the two-rank test) with "terminate called
    without an active exception"."""
    global _group
    with _group_lock:
        _group = None


class _Turns:
    """Tickets taken in save order on the saving thread; votes run in ticket order."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued = 0
        self._serving = 0

    def ticket(self) -> int:
        with self._cond:
            self._issued += 1
            return self._issued - 1

    @contextmanager
    def turn(self, ticket: int) -> Iterator[None]:
        """Hold the turn of ``ticket`` (every ticket must take its turn once, or later votes
        wait forever)."""
        with self._cond:
            self._cond.wait_for(lambda: self._serving == ticket)
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self._cond.notify_all()


turns = _Turns()


def _to_tensor(obj: Any) -> Any:
    import torch

    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def _from_tensor(tensor: Any, size: int) -> Any:
    return json.loads(tensor[:size].numpy().tobytes())


def all_gather(obj: Any, group: Any, world: int) -> list[Any]:
    """Every rank's ``obj`` (JSON values), in rank order."""
    import torch
    import torch.distributed as dist

    mine = _to_tensor(obj)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: mine.numel()] = mine
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [_from_tensor(t, int(n)) for t, n in zip(out, sizes, strict=True)]


def broadcast(obj: Any, group: Any, rank: int) -> Any:
    """Rank 0's ``obj`` (JSON values) on every rank (the others pass anything)."""
    import torch
    import torch.distributed as dist

    data = _to_tensor(obj) if rank == 0 else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buf = data if data is not None else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return _from_tensor(buf, int(size))
