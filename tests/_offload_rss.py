"""Child for the memory test: trains a model whose optimizer state is 4x ``host_budget``,
checkpoints and restores it, and prints JSON with the peak RSS before and after the
optimizer existed (``VmHWM``, read from /proc/self/status)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from lcache import checkpoint
from lcache.offload import OffloadedOptimizer

BUDGET = 24 << 20


def peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    root = Path(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    x = torch.randn(4, 1024)
    model(x).square().mean().backward()  # the gradients exist before the baseline
    # torch's first optimizer step imports its compiler stack (~70 MB, once per process):
    # an import, so before the baseline
    warm = torch.zeros(2, requires_grad=True)
    warm.grad = torch.ones(2)
    torch.optim.AdamW([warm], fused=True).step()
    # and an offloaded step, a save and a load, once on a tiny model: the library pages
    # they first touch count in VmHWM as they fault in, and how many depends on the page
    # cache (without this, 37.4 MiB over the baseline in one venv and 40.2 in a fresh copy
    # of it, same packages and code: over the limit; with it, 31.2 and 31.5)
    tiny = torch.nn.Linear(8, 8)
    tiny(torch.randn(2, 8)).sum().backward()
    with OffloadedOptimizer(tiny.named_parameters(), lr=1e-3, dir=root / "warm-swap",
                            host_budget=1 << 20) as first:
        first.step()
        checkpoint.save({"optimizer": first}, root / "warm-ckpt" / "step-1")
        checkpoint.load(root / "warm-ckpt" / "step-1", like={"optimizer": first})
    baseline = peak()
    opt = OffloadedOptimizer(model.named_parameters(), lr=1e-3, dir=root / "swap",
                             host_budget=BUDGET)
    for _ in range(3):
        # as before the baseline's backward: accumulating into existing gradients would
        # allocate temporaries of the model's size, which are not the optimizer's
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    checkpoint.save({"optimizer": opt}, root / "ckpt" / "step-3")
    checkpoint.load(root / "ckpt" / "step-3", like={"optimizer": opt})
    print(json.dumps({"baseline": baseline, "peak": peak(), "budget": BUDGET,
                      "state_bytes": opt.state_bytes()}))
    opt.close()


if __name__ == "__main__":
    main()
