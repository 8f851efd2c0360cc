"""One rank of the two-rank checkpoint test in test_checkpoint_dist.py (not collected).

``torchrun --standalone --nproc_per_node 2 tests/_ckpt_torchrun.py ROOT``

Each rank saves its own state (async, then a second save that waits for the first), loads both
back and checks them bit for bit; a third save that fails on rank 1 must fail on both ranks
and publish nothing; a fourth succeeds and keep_last=2 retires the first; a fifth is polled
with done() alone (no wait()) and must be the newest visible checkpoint once done() is True; a
sixth with bad meta on rank 1 fails on both; a seventh to another path on each rank, and an
eighth with an option only rank 1 gets wrong, fail on both; a ninth is published.
Rank R writes ``ROOT/../rank{R}.json`` with what it saw, and at exit ``ROOT/../rank{R}.exit``
with whether lcache still held its process groups (it must not: gloo aborts the process when a
group is torn down with the interpreter).
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lcache import checkpoint as ck
from lcache.checkpoint import dist as ck_dist


def report_groups_at_exit(path: str) -> None:
    """Registered before the first save, so it runs after lcache's own exit handler."""
    def write() -> None:
        with open(path, "w") as f:
            f.write("held" if ck_dist._group is not None else "released")
    atexit.register(write)


def rank_state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"model": {"w": torch.full((1000 + rank,), float(step * 10 + rank)),
                      "bf": torch.randn(7, 5, generator=g).to(torch.bfloat16)},
            "rank": rank, "step": step, "np": np.arange(rank + 3, dtype=np.int16)}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["rank"] == b["rank"] and a["step"] == b["step"]
            and a["np"].tobytes() == b["np"].tobytes()
            and all(torch.equal(a["model"][k], b["model"][k]) for k in ("w", "bf")))


def main() -> None:
    faulthandler.dump_traceback_later(80, exit=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = sys.argv[1]
    report_groups_at_exit(os.path.join(os.path.dirname(root), f"rank{rank}.exit"))
    saver = ck.Checkpointer(keep_last=2)
    report: dict[str, Any] = {"rank": rank, "world": world}

    state = rank_state(rank, 1)
    first = saver.async_save(state, os.path.join(root, "step-1"), meta={"step": 1})
    state["model"]["w"].add_(100.0)  # the snapshot was taken: this must not reach the disk
    second = saver.async_save(rank_state(rank, 2), os.path.join(root, "step-2"))
    report["first_done"] = first.done() and first.state is ck.CkptState.PUBLISHED
    second.wait()
    for step in (1, 2):
        back = ck.load(os.path.join(root, f"step-{step}"), like=rank_state(rank, step))
        report[f"load{step}"] = same(back, rank_state(rank, step))

    bad = rank_state(rank, 3)
    if rank == 1:
        bad["extra"] = object()  # cannot be saved: rank 1 fails, so both must fail
    third = saver.async_save(bad, os.path.join(root, "step-3"))
    try:
        third.wait()
        report["third"] = "published"
    except Exception as exc:  # the test checks which error each rank saw
        report["third"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    report["listed_after_third"] = [c.name for c in ck.list_checkpoints(root)[0]]
    report["leftovers_after_third"] = ck.leftovers(root)
    dist.barrier()  # both have looked before either starts the next save

    saver.save(rank_state(rank, 4), os.path.join(root, "step-4"))
    dist.barrier()
    report["listed_after_fourth"] = [c.name for c in ck.list_checkpoints(root)[0]]
    report["load4"] = same(ck.load(os.path.join(root, "step-4")), rank_state(rank, 4))

    # done() means published on every rank, without wait() and without a collective here
    fifth = saver.async_save(rank_state(rank, 5), os.path.join(root, "step-5"))
    deadline = time.monotonic() + 30
    while not fifth.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    report["fifth_done"] = fifth.done()
    report["fifth_state"] = fifth.state.value
    report["latest_when_done"] = ck.latest(root)

    # meta that cannot be stored, on rank 1 only: both fail, neither hangs
    sixth = saver.async_save(rank_state(rank, 6), os.path.join(root, "step-6"),
                             meta={"fn": len} if rank == 1 else {"ok": True})
    try:
        sixth.wait(timeout=60)
        report["sixth"] = "published"
    except Exception as exc:  # the test checks which error each rank saw
        report["sixth"] = f"{type(exc).__name__}: {exc}"

    # ranks that save to different checkpoints (a rank that skipped a save is one save
    # ahead): both fail, nothing is published (a mixed checkpoint was; attack helper 85)
    other = ck.Checkpointer()  # no retention: step-4 stays for the test's checks
    seventh = other.async_save(rank_state(rank, 7),
                               os.path.join(root, "step-7" if rank == 0 else "step-8"))
    # an option only rank 1 gets wrong: it fails at once there, and votes (rank 0 waited
    # for it 30 minutes)
    eighth = other.async_save(rank_state(rank, 8), os.path.join(root, "step-8"),
                              **({"keep_lst": 2} if rank == 1 else {}))
    for name, handle in (("seventh", seventh), ("eighth", eighth)):
        try:
            handle.wait(timeout=60)
            report[name] = "published"
        except Exception as exc:  # the test checks which error each rank saw
            report[name] = f"{type(exc).__name__}: {exc}"
    other.save(rank_state(rank, 9), os.path.join(root, "step-9"))  # in step again
    other.close()
    dist.barrier()
    report["listed_at_the_end"] = [c.name for c in ck.list_checkpoints(root)[0]]
    with open(os.path.join(os.path.dirname(root), f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    saver.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
