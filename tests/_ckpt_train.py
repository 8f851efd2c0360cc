"""Deterministic CPU training with checkpoints, for the exact-resume test.

``python tests/_ckpt_train.py ROOT --steps N [--every K] [--kill-at S] [--forget-data-order]``

Trains a small MLP (dropout, AdamW) for N steps on a fixed synthetic dataset, drawing batches
with a ``RandomSampler`` driven by a seeded ``torch.Generator``. Every K steps it calls
``async_save`` and trains on while the checkpoint is written. With ``--kill-at S`` it waits for
its last save and sends itself SIGKILL at step S. On start it resumes from the newest complete
checkpoint in ROOT, if any. At the end it prints one JSON line: the step it resumed from, the
losses of the steps it ran, and a SHA-256 of every parameter and optimizer tensor.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler

from lcache import checkpoint as ck

SAMPLES, BATCH = 200, 16


def digest(state: Any) -> str:
    h = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(str(k).encode())
                walk(value[k])
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, torch.Tensor):
            h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())

    walk(state)
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--forget-data-order", action="store_true",
                   help="resume without the sampler's state (the test's negative control)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    data = torch.randn(SAMPLES, 12)
    target = (data[:, :3].sum(1, keepdim=True) > 0).float()
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(42)
    sampler = BatchSampler(RandomSampler(range(SAMPLES), generator=gen), BATCH, drop_last=True)
    per_epoch = len(sampler)
    step, epoch, position = 0, 0, 0
    epoch_gen_state = gen.get_state()
    resumed_from = None
    # a first run has no directory yet; latest() raises for a missing one (a typo)
    latest = ck.latest(args.root) if os.path.isdir(args.root) else None
    if latest is not None:
        state = ck.load(latest)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step, epoch, position = state["step"], state["epoch"], state["position"]
        if not args.forget_data_order:
            epoch_gen_state = state["epoch_gen_state"]
        resumed_from = step
    losses = []
    handle = None
    while step < args.steps:
        gen.set_state(epoch_gen_state)  # the epoch's order is drawn from this state
        batches = iter(sampler)
        for _ in range(position):  # batches this epoch already used before the checkpoint
            next(batches)
        for batch in batches:
            if args.kill_at is not None and step == args.kill_at:
                if handle is not None:
                    handle.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                model(data[batch]), target[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
            position += 1
            if position == per_epoch:
                epoch, position = epoch + 1, 0
                epoch_gen_state = gen.get_state()
            if step % args.every == 0:
                handle = ck.async_save(
                    {"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "rng": torch.get_rng_state(), "step": step, "epoch": epoch,
                     "position": position, "epoch_gen_state": epoch_gen_state},
                    os.path.join(args.root, f"step-{step:06d}"), keep_last=2)
            if step >= args.steps or position == 0:
                break
    if handle is not None:
        handle.wait()
    print(json.dumps({"resumed_from": resumed_from, "losses": losses, "steps": step,
                      "digest": digest({"model": model.state_dict(),
                                        "optimizer": opt.state_dict()})}))


if __name__ == "__main__":
    main()
