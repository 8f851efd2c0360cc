"""Child for the kill -9 test: trains the tiny GPT with its optimizer state offloaded,
checkpointing every 5 steps; at step ``--stall-at`` it stops in the middle of the step's
swap writes and says so, for the parent to kill it there."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch

from lcache import checkpoint
from lcache.io import set_tracer
from lcache.offload import OffloadedOptimizer
from tests._offload_model import SMALL, batch, loss_of, make_model

EVERY = 5


def main() -> None:
    root, stall_at = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    model = make_model()
    opt = OffloadedOptimizer(model.named_parameters(), lr=1e-2, dir=root / "swap", **SMALL)
    armed = False
    said = threading.Lock()  # the engine's threads may all reach a write at once: say it once

    def stall(event: object) -> None:
        if armed and getattr(event, "io_class", "") == "offload-write":
            if said.acquire(blocking=False):
                print("mid-step", flush=True)
            time.sleep(60)

    set_tracer(stall)
    for s in range(stall_at + 1):
        if s and s % EVERY == 0:
            checkpoint.save({"model": model.state_dict(), "optimizer": opt, "step": s},
                            root / "ckpt" / f"step-{s:04d}")
        loss_of(model, batch(s)).backward()
        armed = s == stall_at
        opt.step()
        opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
