"""A process that checkpoints forever, for the kill -9 tests.

``python tests/_ckpt_child.py ROOT FIRST_STEP ELEMENTS``: saves ``expected_state(step)`` as
``ROOT/step-NNNNNN`` for step = FIRST_STEP, FIRST_STEP + 1, ... with keep_last=3, printing
``saving N`` before and ``saved N`` after each save, until it is killed
(test_checkpoint_crash.py).

``python tests/_ckpt_child.py --dist ROOT RANK WORLD INIT_FILE ELEMENTS``: one of WORLD gloo
ranks (``file://INIT_FILE`` rendezvous) saving ``rank_state(step, rank)`` for step = 1, 2, ...
with async_save and keep_last=3, each polled with ``done()`` alone (never ``wait()``): prints
``published N`` once it is done and published, ``failed N`` or ``stuck N`` (not done within
20 s) otherwise (test_checkpoint_dist.py).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np


def expected_state(step: int, elements: int) -> dict[str, object]:
    """The state saved at ``step``: cheap to make, different at every step and position."""
    base = np.arange(elements, dtype=np.uint32) * np.uint32(2654435761)
    return {"step": step, "w": base + np.uint32(step),
            "b": np.full(1000 + step % 7, step, dtype=np.float64),
            "extra": {"name": f"run-{step}", "lr": 1.0 / (step + 1), "hist": (step, [step])}}


def rank_state(step: int, rank: int, elements: int) -> dict[str, object]:
    """What ``rank`` saves at ``step`` in ``--dist`` mode."""
    return expected_state(10 * step + rank, elements)


def main_dist() -> None:
    import torch.distributed as dist

    from lcache import checkpoint as ck

    root, rank, world, init, elements = (sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                         sys.argv[5], int(sys.argv[6]))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    saver = ck.Checkpointer(keep_last=3)
    step = 1
    while True:
        handle = saver.async_save(rank_state(step, rank, elements),
                                  os.path.join(root, f"step-{step:06d}"))
        deadline = time.monotonic() + 20
        while not handle.done():
            if time.monotonic() > deadline:
                print(f"stuck {step}", flush=True)
                time.sleep(3600)
            time.sleep(0.005)
        ok = handle.exception() is None and handle.state is ck.CkptState.PUBLISHED
        print(f"{'published' if ok else 'failed'} {step}", flush=True)
        step += 1


def main() -> None:
    from lcache import checkpoint as ck

    if sys.argv[1] == "--dist":
        main_dist()
        return
    root, step, elements = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    saver = ck.Checkpointer(keep_last=3)
    while True:
        state = expected_state(step, elements)
        print(f"saving {step}", flush=True)
        saver.save(state, os.path.join(root, f"step-{step:06d}"))
        print(f"saved {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
