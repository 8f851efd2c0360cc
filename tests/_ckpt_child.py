"""A process that checkpoints forever, for the kill -9 torture in test_checkpoint_crash.py.

``python tests/_ckpt_child.py ROOT FIRST_STEP ELEMENTS``: saves ``expected_state(step)`` as
``ROOT/step-NNNNNN`` for step = FIRST_STEP, FIRST_STEP + 1, ... with keep_last=3, printing
``saving N`` before and ``saved N`` after each save, until it is killed.
"""

from __future__ import annotations

import os
import sys

import numpy as np


def expected_state(step: int, elements: int) -> dict[str, object]:
    """The state saved at ``step``: cheap to make, different at every step and position."""
    base = np.arange(elements, dtype=np.uint32) * np.uint32(2654435761)
    return {"step": step, "w": base + np.uint32(step),
            "b": np.full(1000 + step % 7, step, dtype=np.float64),
            "extra": {"name": f"run-{step}", "lr": 1.0 / (step + 1), "hist": (step, [step])}}


def main() -> None:
    from lcache import checkpoint as ck

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
