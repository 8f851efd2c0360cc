"""This process's rank, the run's rank count, and what ranks agree on: gloo under torchrun,
nothing to do alone (``WORLD_SIZE`` unset or 1)."""

from __future__ import annotations

from typing import Any

from lcache.checks import launch_rank_world
from lcache.errors import ConfigError


class Comm:
    """Rank, world size, a barrier and an all-ranks check; gloo under torchrun, a no-op alone."""

    def __init__(self) -> None:
        self.rank, self.world = launch_rank_world()
        self._dist: Any = None
        if self.world > 1:
            try:
                import torch.distributed as dist  # only multi-rank runs need torch
            except ImportError as exc:
                raise ConfigError("WORLD_SIZE > 1 (torchrun) needs torch for its gloo "
                                  "barrier: pip install 'lcache[torch]'") from exc

            if not dist.is_initialized():
                dist.init_process_group("gloo")
            self._dist = dist

    def barrier(self) -> None:
        if self._dist is not None:
            self._dist.barrier()

    def all_ok(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (so all ranks stop together, none hangs)."""
        if self._dist is None:
            return ok
        import torch

        flag = torch.tensor([1 if ok else 0])
        self._dist.all_reduce(flag, op=self._dist.ReduceOp.MIN)
        return bool(flag.item())

    def close(self) -> None:
        if self._dist is not None and self._dist.is_initialized():
            self._dist.destroy_process_group()
