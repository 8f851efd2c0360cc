"""One rank of the two-rank ``step_with_backward`` test in test_offload_overlap.py (not
collected).

``torchrun --standalone --nproc_per_node 2 tests/_offload_ddp.py OUT_DIR``

Each rank trains a DDP model with ``step_with_backward`` and a twin with torch's fused AdamW
(``backward()`` then ``step()``) on batches of its own, and writes ``OUT_DIR/rank{R}.json``:
whether the two models are equal bit for bit. Under DDP the gradients are averaged when
backward ends: an update made from a gradient before that would leave them apart.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lcache.offload import OffloadedOptimizer
from tests._offload_model import SMALL, batch, loss_of, make_model


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ref_model, model = DistributedDataParallel(make_model()), DistributedDataParallel(make_model())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    opt = OffloadedOptimizer(model.parameters(), lr=1e-2, dir=out / "swap", **SMALL)
    for s in range(3):
        loss_of(ref_model, batch(10 * s + rank)).backward()
        ref.step()
        ref.zero_grad()
        opt.step_with_backward(loss_of(model, batch(10 * s + rank)))
        opt.zero_grad()
    same = all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters(),
                                                 strict=True))
    opt.close()
    (out / f"rank{rank}.json").write_text(json.dumps({"same": same}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
