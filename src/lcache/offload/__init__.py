"""SSD offload of training state (see docs/offload.md).

    from lcache.offload import OffloadedOptimizer

    opt = OffloadedOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-3,
                             dir="/nvme/offload", host_budget="2GB")
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    opt.close()                      # removes the swap file

The fp32 master weights and the optimizer's moments live in one preallocated swap file per
rank and stream through a bounded pool of host buffers, one sub-group at a time.

    with lcache.offload.activations(dir, min_bytes="1MiB"):   # saved tensors spill to SSD
        loss = model(x); loss.backward()
"""

# ``activations`` the function shadows ``activations`` the module as an attribute of this
# package, as the issue's ``lcache.offload.activations(dir, ...)`` wants; the module's other
# names are imported from ``lcache.offload.activations`` (found in sys.modules).
from lcache.offload.activations import activations
from lcache.offload.optimizer import OffloadedOptimizer

__all__ = ["OffloadedOptimizer", "activations"]
