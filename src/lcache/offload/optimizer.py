"""``OffloadedOptimizer``: an elementwise torch optimizer whose state lives on the SSD.

A step is a pipeline over sub-groups (``plan.py``) through ``buffers`` host buffers: while
sub-group i is updated on the CPU, i+1 is being read and i-1 written by the process's I/O
engine. The update is the wrapped optimizer's own ``step()`` on fp32 views of the buffer, so
the bits are the optimizer's (fused or foreach, on torch's intra-op threads).

It is a ``torch.optim.Optimizer``: ``param_groups`` is the live list LR schedulers, GradScaler
and training frameworks read and change (a new ``lr`` or ``betas`` applies from the next
sub-group updated), and step hooks run as torch's do. Its ``state`` stays empty: the state
is in the swap file, never whole in memory.

Lifecycle of a step: every sub-group with gradients is read from its committed slot, updated,
its parameters set from the new master weights, and written to its other slot; only when
every write is done do those slots become the committed ones. A step that fails (a full
device, any I/O error) puts the parameters back from the committed slots and raises: memory
and swap are as before the step, and it can be retried. Parameters written between steps
(weights loaded into the model after the optimizer was made, a broadcast) become the master
weights at the next step or checkpoint, as they would for a torch optimizer.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import mmap
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lcache.checkpoint.dist import rank_and_world
from lcache.checks import flag, path_argument
from lcache.errors import ConfigError
from lcache.io import Pending, aligned_buffer
from lcache.offload.overlap import LATER, Feed, Overlap
from lcache.offload.params import check_layout, named_groups
from lcache.offload.plan import ALIGN, CUT, F32, SubGroup, buffer_bytes, choose_numel, plan
from lcache.offload.swap import SwapFile, wait_all
from lcache.store.layout import parse_size

log = logging.getLogger("lcache")


class _Pins:
    """Slots a checkpoint in progress reads: a step must not overwrite them meanwhile."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.live: dict[int, list[int]] = {}
        self._next = 0

    def pin(self, slots: list[int]) -> Callable[[], None]:
        with self.cond:
            key = self._next
            self._next += 1
            self.live[key] = list(slots)

        def release() -> None:
            with self.cond:
                self.live.pop(key, None)
                self.cond.notify_all()

        return release

    def wait_free(self, sub_group: int, slot: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: all(s[sub_group] != slot for s in self.live.values()))

    def wait_none(self) -> None:
        """Until no checkpoint reads the swap (a save streams it for as long as it takes)."""
        with self.cond:
            while not self.cond.wait_for(lambda: not self.live, timeout=30):
                log.warning("lcache: closing an OffloadedOptimizer waits for a checkpoint "
                               "save that still reads its state")


class OffloadedOptimizer(torch.optim.Optimizer):
    """Wraps an elementwise torch optimizer (AdamW, Adam...) and keeps its state on the SSD.

    A ``torch.optim.Optimizer``: LR schedulers, ``GradScaler`` and step hooks work with it.
    ``state_dict()`` returns the whole state in memory, as torch's does; give the optimizer
    itself to ``lcache.checkpoint`` to stream it instead (see docs/offload.md).

    Args:
        params: tensors, ``model.named_parameters()`` (the names then name the state in the
            swap file and in checkpoints), or param-group dicts with per-group options.
        optimizer_class: the torch optimizer to run (default ``torch.optim.AdamW``).
        dir: directory of the swap files (one per rank, removed by ``close()``).
        host_budget: host memory for the pipeline's buffers, an int or a size such as
            ``"2GB"``; it sets the sub-group size.
        sub_group_size: elements per sub-group (at least 64), instead of the largest the
            budget allows.
        buffers: host buffers in the pipeline (3: read i+1, update i, write i-1).
        direct: O_DIRECT I/O where the filesystem allows it.
        preallocate: reserve the swap file's blocks at construction (a full device is then
            refused here with ``DiskFullError``, not found in the middle of a step).
        **options: the optimizer's options (``lr``, ``betas``, ``weight_decay``...). Unless
            ``fused`` or ``foreach`` is given, ``fused=True`` is used where the optimizer
            has it (torch's fastest CPU path).

    Raises:
        ConfigError: bad parameters or options, or a budget too small for one sub-group per
            buffer (the message says the minimum).
        DiskFullError: ``preallocate`` and the swap file does not fit.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: Any = None, *,
                 dir: Any, host_budget: int | str = "2GB", sub_group_size: int | None = None,
                 buffers: int = 3, direct: bool = True, preallocate: bool = True,
                 **options: Any) -> None:
        dir = path_argument(dir, "dir")
        # taken by truthiness, direct="no" meant yes
        direct, preallocate = flag(direct, "direct"), flag(preallocate, "preallocate")
        # `is None`, not `or`: '', 0 or [] ran AdamW as if nothing were given
        self.optimizer_class = torch.optim.AdamW if optimizer_class is None else optimizer_class
        if not (isinstance(self.optimizer_class, type)
                and issubclass(self.optimizer_class, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer_class={self.optimizer_class!r}: give a torch "
                              "optimizer class, e.g. torch.optim.AdamW")
        if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 2:
            raise ConfigError(f"buffers={buffers!r}: the pipeline needs at least 2 buffers")
        self.names, self._params, groups = named_groups(params)
        accepted = inspect.signature(self.optimizer_class).parameters
        chosen = {"fused", "foreach"} & {k for d in (options, *groups) for k in d}
        if "fused" in accepted and not chosen:  # a group's own choice is kept too
            options["fused"] = True
        # the wrapped optimizer's full defaults, as schedulers look for "betas" or "momentum"
        self.state_names, self._scalar_kinds, defaults = self._probe(options)
        layouts = {}  # per group with options of its own: the state it keeps
        for g, group in enumerate(groups):
            own = {k: v for k, v in group.items() if k in accepted and k != "params"}
            if own:
                names, kinds, _ = self._probe({**options, **own})
                layouts[g] = (names, kinds)
        if layouts and len(layouts) == len(groups):  # e.g. amsgrad given to every group
            self.state_names, self._scalar_kinds = layouts[0]
        for g, (names, kinds) in layouts.items():  # the swap holds one layout for all
            if names != self.state_names or set(kinds) != set(self._scalar_kinds):
                raise ConfigError(
                    f"param group {g}'s options make {names} the optimizer's per-element "
                    f"state, where another group keeps {self.state_names}; the swap holds "
                    "one layout for all groups: give options such as amsgrad to every group "
                    "(or as an argument), not to some")
        self._members = [g.pop("params") for g in groups]  # parameter indices per group
        self._laid_out = False  # add_param_group is torch's until the swap is laid out
        try:
            super().__init__([{**g, "params": [self._params[i] for i in members]}
                              for g, members in zip(groups, self._members, strict=True)],
                             defaults)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"OffloadedOptimizer: {exc}") from exc
        self._laid_out = True
        self.arrays = 1 + len(self.state_names)
        self.host_budget = parse_size(host_budget)
        self._numels = [p.numel() for p in self._params]
        sizes = [[(p, self._numels[p]) for p in members] for members in self._members]
        # room in the buffers for gradients to copy, unless every one is fp32 on the CPU
        self._grad_room = any(p.dtype != torch.float32 or p.device.type != "cpu"
                              for p in self._params)
        numel = choose_numel(self.host_budget, buffers, self.arrays,
                             max(sum(n for _, n in g) for g in sizes), sub_group_size,
                             self._grad_room)
        self.sub_groups = plan(sizes, numel, self.arrays)
        self.sub_group_size = numel
        self.slot_bytes = sum(sg.nbytes for sg in self.sub_groups)
        self._on_cuda = any(p.device.type == "cuda" for p in self._params)
        self._pieces_of: list[list[tuple[SubGroup, Any]]] = [[] for _ in self._params]
        for sg in self.sub_groups:
            for piece in sg.pieces:
                self._pieces_of[piece.param].append((sg, piece))
        # one per group, made with the options its constructor takes; a step sets them all
        try:
            self._inner = [self.optimizer_class([torch.zeros(1)], **{
                k: v for k, v in self._options(g).items() if k in accepted})
                for g in range(len(self.param_groups))]
        except (TypeError, ValueError, RuntimeError, AssertionError) as exc:
            raise ConfigError(f"OffloadedOptimizer: a param group's options: {exc}") from exc
        # A fused optimizer unscales the gradients in its kernel, dividing by GradScaler's
        # scale; the scaler's other path multiplies by its inverse, which differs by an ulp
        # unless the scale is a power of 2: it must be handed the scale as torch's would be.
        self._step_supports_amp_scaling = all(
            getattr(o, "_step_supports_amp_scaling", False) for o in self._inner)
        # each parameter's non-array state ("step"), None until its first update: SGD keeps
        # none, and its momentum must still be carried from step to step
        self._scalars: list[dict[str, Any] | None] = [None for _ in self._params]
        self._slot_of = [0] * len(self.sub_groups)
        self._pins = _Pins()
        rank, world = rank_and_world()
        self._swap = SwapFile(dir, rank, 2 * self.slot_bytes, self._manifest(world),
                              direct=direct, preallocate=preallocate)
        self._closer = weakref.finalize(self, self._swap.close)
        self._buffers = [self._new_buffer(buffer_bytes(numel, self.arrays, self._grad_room))
                         for _ in range(buffers)]
        self.read_bytes = 0
        self.write_bytes = 0
        #: bytes a step did not read because the sub-group's block was still in a buffer
        self.reused_bytes = 0
        # sub-group index -> the buffer that still holds its committed block (the last ones
        # a step wrote): the next step updates those first, without reading them
        self._resident: dict[int, Any] = {}
        self._backward: Any = None  # the loss of a step_with_backward, for _step
        self._write_initial()
        self._versions = self._param_versions()

    # --- construction --------------------------------------------------------------------
    def _options(self, group: int) -> dict[str, Any]:
        """Group ``group``'s options as they are now (a scheduler may have changed them)."""
        return {k: v for k, v in self.param_groups[group].items()
                if k not in ("params", "param_names")}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once constructed: the swap file is laid out for the groups given then.

        Raises:
            ConfigError: always, after construction.
        """
        if self._laid_out:
            raise ConfigError("OffloadedOptimizer cannot add a param group after "
                              "construction (its swap file is laid out for the groups it "
                              "was made with); pass every group to the constructor: a "
                              "parameter without a gradient is not updated")
        super().add_param_group(param_group)

    def _probe(self, options: dict[str, Any]
               ) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
        """(names of the optimizer's per-element state tensors, its other state (``step``)
        as examples a loaded state is checked against, its defaults with ``options``), from
        steps on a small 2-D dummy, once whole and once as the swap holds
        it: flat pieces whose state is carried from step to step by this wrapper. The two
        must agree to the bit, so an optimizer whose update of an element depends on other
        elements (Adafactor's factored moments, a norm over the tensor) is refused, not run
        to other results."""
        name = self.optimizer_class.__name__
        values = torch.linspace(-1.0, 1.0, 150).view(3, 50)
        grads = [torch.sin(torch.arange(150.0) * (s + 1)).view(3, 50) for s in range(3)]
        whole = values.clone().requires_grad_()
        try:
            probe = self.optimizer_class([whole], **options)
            for grad in grads:
                whole.grad = grad.clone()
                probe.step()
            state = probe.state[whole]
            names = sorted(k for k, v in state.items()
                           if isinstance(v, torch.Tensor) and v.shape == whole.shape)
            pieces = self._probe_in_pieces(values, grads, options)
        except (TypeError, ValueError, RuntimeError, KeyError, IndexError,
                AssertionError) as exc:
            raise ConfigError(f"{name}({options}) cannot run offloaded: {exc}") from exc
        # torch takes weight_decay=inf and turns the weights to inf/NaN without a word
        # (eps=inf keeps them finite: taken). In Python: torch.isfinite's first call costs
        # 0.75 MiB of peak RSS, which the memory test counts against the optimizer.
        if not all(math.isfinite(v) for v in whole.detach().view(-1).tolist()):
            bad = {k: v for k, v in options.items()
                   if isinstance(v, float) and not math.isfinite(v)}
            raise ConfigError(f"{name}({bad or options}) turns finite weights into inf or NaN "
                              "in the first steps; " + ("give finite options" if bad else
                              "the options are finite, but the weights overflow: give "
                              "smaller ones"))
        shared = [k for k, v in state.items() if isinstance(v, torch.Tensor)
                  and k not in names and v.numel() != 1]
        if shared or not torch.equal(pieces, whole.detach().view(-1)):
            raise ConfigError(f"{name} is not an elementwise optimizer (its update of an "
                              "element depends on others"
                              + (f": state {shared} is not one value per element" if shared
                                 else "") + "), so it cannot be run a sub-group at a time; "
                              "use AdamW, Adam, SGD or another elementwise optimizer")
        return names, {k: v for k, v in state.items() if k not in names}, dict(probe.defaults)

    def _probe_in_pieces(self, values: Any, grads: list[Any], options: dict[str, Any]
                         ) -> Any:
        """``values`` after the steps of ``grads``, run as ``_update`` runs them: on flat
        pieces, each a fresh tensor every step, handed the state the last step left."""
        flat = values.clone().view(-1)
        bounds = [(0, CUT), (CUT, flat.numel())]  # cut as plan() cuts a parameter
        states: list[dict[str, Any] | None] = [None, None]
        inner = self.optimizer_class([torch.zeros(1)], **options)
        for grad in grads:
            proxies = []
            for i, (lo, hi) in enumerate(bounds):
                proxy = flat[lo:hi]
                proxy.grad = grad.view(-1)[lo:hi].clone()
                if states[i] is not None:
                    inner.state[proxy] = dict(states[i] or {})
                proxies.append(proxy)
            inner.param_groups[0]["params"] = proxies
            inner.step()
            for i, proxy in enumerate(proxies):
                states[i] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                             for k, v in inner.state[proxy].items()}
            inner.state.clear()
        return flat

    def _manifest(self, world: int) -> dict[str, Any]:
        return {"world": world, "optimizer": self.optimizer_class.__name__,
                "arrays": ["master", *self.state_names], "slot_bytes": self.slot_bytes,
                "sub_groups": [[sg.offset, sg.numel, sg.nbytes] for sg in self.sub_groups],
                "params": [{"name": n, "shape": list(p.shape),
                            "pieces": [[sg.index, pc.start, pc.stop, pc.at]
                                       for sg, pc in self._pieces_of[i]]}
                           for i, (n, p) in enumerate(zip(self.names, self._params,
                                                          strict=True))]}

    def _new_buffer(self, nbytes: int) -> Any:
        if self._on_cuda:  # pinned: device copies run asynchronously at full speed
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return aligned_buffer(nbytes)

    def _view(self, buf: Any) -> memoryview:
        if isinstance(buf, mmap.mmap):
            return memoryview(buf)
        return memoryview(buf.numpy()).cast("B")

    def _f32(self, buf: Any, offset_elems: int, count: int) -> Any:
        """A leaf fp32 tensor over ``count`` elements of ``buf`` from element ``offset``."""
        if isinstance(buf, mmap.mmap):
            return torch.frombuffer(buf, dtype=torch.float32, count=count,
                                          offset=offset_elems * F32)
        return buf[offset_elems * F32 : (offset_elems + count) * F32].view(torch.float32)

    def _write_initial(self) -> None:
        """Slot 0 gets the master weights (the states start empty: the optimizer makes them
        on a parameter's first update, as it would in memory)."""
        buf = self._buffers[0]
        for sg in self.sub_groups:
            master = self._f32(buf, 0, sg.numel)
            for piece in sg.pieces:
                src = self._flat(self._params[piece.param])[piece.start : piece.stop]
                master[piece.at : piece.at + piece.numel].copy_(src)
            self._io(self._swap.write(self._offset(sg, 0), self._view(buf)[: sg.nbytes]),
                     sg.nbytes, write=True)

    def _param_versions(self) -> list[tuple[int, int]]:
        """Each parameter's in-place version counter (torch bumps it at every write) and
        address (``p.data = other`` changes it)."""
        return [(p._version, p.data_ptr()) for p in self._params]

    def _adopt_changed_params(self, also: set[int] | None = None) -> None:
        """Make the parameters written since this optimizer last set them (weights loaded
        into the model after the optimizer was made, a broadcast from rank 0), and those in
        ``also``, the committed master weights of their sub-groups, as a torch optimizer
        takes whatever its parameters hold. Without it a step updated the stale masters and
        wrote them over the loaded weights (bf16), and a failed step rolled back to them
        (fp32).

        Each changed sub-group's block is written to its other slot, which is committed only
        once written: an error leaves every sub-group consistent, and it is tried again."""
        changed = {i for i, (p, seen) in enumerate(zip(self._params, self._versions,
                                                       strict=True))
                   if (p._version, p.data_ptr()) != seen} | (also or set())
        if not changed:
            return
        for i in changed:  # replaced by ``p.data = other``: still one the swap holds?
            check_layout(self.names[i], self._params[i], self._numels[i])
        self._resident = {}  # buffers[0] is overwritten, and the committed slots change
        buf = self._buffers[0]
        for sg in self.sub_groups:
            if not any(piece.param in changed for piece in sg.pieces):
                continue
            slot = self._slot_of[sg.index]
            view = self._view(buf)[: sg.nbytes]
            self._io(self._swap.read(self._offset(sg, slot), view), sg.nbytes, write=False)
            for piece in sg.pieces:
                if piece.param in changed:
                    self._take_written(piece, self._f32(buf, piece.at, piece.numel))
            self._pins.wait_free(sg.index, 1 - slot)
            self._io(self._swap.write(self._offset(sg, 1 - slot), view), sg.nbytes,
                     write=True)
            self._slot_of[sg.index] = 1 - slot
        self._versions = self._param_versions()

    def _take_written(self, piece: Any, master: Any) -> None:
        """Set ``master`` (fp32, on the host) to ``piece``'s parameter if that is no longer
        ``master``'s rounding: written since. A bf16 parameter written with the value it
        had (a model reloaded from the checkpoint the optimizer was resumed from, a
        broadcast of the same weights) keeps its fp32 master, or resume was not bit-exact."""
        current = self._flat(self._params[piece.param])[piece.start : piece.stop]
        if not torch.equal(current, master.to(current.device, current.dtype)):
            master.copy_(current)

    # --- helpers -------------------------------------------------------------------------
    def _flat(self, tensor: Any) -> Any:
        return (tensor if tensor.is_contiguous() else tensor.contiguous()).detach().view(-1)

    def _offset(self, sg: SubGroup, slot: int) -> int:
        return slot * self.slot_bytes + sg.offset

    def _io(self, pending: list[Pending], nbytes: int, write: bool) -> None:
        wait_all(pending)
        if write:
            self.write_bytes += nbytes
        else:
            self.read_bytes += nbytes

    # --- the step ------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every parameter that has a gradient.

        Raises:
            DiskFullError, OSError: the step failed; parameters and swap are as before it,
                and it can be retried.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open()
        with torch.no_grad():
            self._step()
        return loss

    def step_with_backward(self, loss: Any) -> None:
        """``loss.backward()`` and then ``step()``, run together: each sub-group is updated
        as soon as backward has finished its parameters' gradients, so its reads and writes
        run under the rest of backward rather than after it. The same bits as the two calls.

        For a step whose gradients are final when backward ends: accumulate micro-batches
        with ``loss.backward()`` and give the last one here, but clip gradients or unscale
        them (``GradScaler``) and it is too late (use ``backward()`` and ``step()``). Step
        pre-hooks run before backward, post-hooks after the step. A parameter updated while
        backward still needs its value (a weight used detached elsewhere in the graph), or
        whose gradient comes twice in one pass (reentrant activation checkpointing), fails
        it, undone. On GPUs and across ranks (whose gradients are reduced when backward
        ends) it runs the two calls one after the other.

        Raises:
            what ``backward()`` and ``step()`` raise; a failed step is undone, as ``step()``'s.
        """
        self._check_open()
        is_tensor = isinstance(loss, torch.Tensor)  # not narrowed: torch's backward is untyped
        if not is_tensor:
            raise ConfigError(f"step_with_backward(loss={loss!r:.80}): give the loss tensor, "
                              "whose backward() computes the gradients")
        if self._on_cuda or rank_and_world()[1] > 1:
            loss.backward()
            self.step()
            return
        # run by _step, inside step(): after the step pre-hooks (an lr one sets applies to
        # every sub-group) and before the post-hooks, as for any step
        self._backward = loss
        try:
            self.step()
        finally:
            self._backward = None

    def _step_with_backward(self, loss: Any) -> None:
        self._adopt_changed_params()  # before the thread reads any parameter
        overlap = Overlap(self)
        try:
            with torch.enable_grad():
                loss.backward()
        except BaseException as exc:
            updated = overlap.abort(exc)
            if updated and isinstance(exc, RuntimeError) and "inplace operation" in str(exc):
                raise ConfigError(
                    "backward needed the value of a parameter that step_with_backward had "
                    "already updated (a weight used detached, or under no_grad, elsewhere in "
                    "the graph?): use backward() and step() for this model (this step was "
                    f"undone). Autograd said: {exc}") from exc
            raise
        overlap.finish()

    def _step(self) -> None:
        loss, self._backward = self._backward, None
        if loss is not None:
            self._step_with_backward(loss)
            return
        self._check_grads()
        work = [sg for sg in self.sub_groups
                if any(self._params[pc.param].grad is not None for pc in sg.pieces)]
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step (see __init__)
        if not work or (found_inf is not None and found_inf.item()):
            return  # an overflow: the fused step would change nothing, so nothing is read
        self._adopt_changed_params()
        # the blocks still in buffers first: their buffers are free once they are written;
        # those of sub-groups without gradients are free now
        self._resident = {sg.index: self._resident[sg.index] for sg in work
                          if sg.index in self._resident}
        work = [sg for sg in work if sg.index in self._resident] + \
            [sg for sg in work if sg.index not in self._resident]
        feed = Feed()
        for sg in work:
            feed.put(sg)
        feed.put(None)
        self._run_step(feed)

    def _check_grads(self, params: Iterable[int] | None = None) -> None:
        for i in range(len(self._params)) if params is None else params:
            grad = self._params[i].grad
            if grad is not None and grad.layout != torch.strided:
                raise ConfigError(f"parameter {self.names[i]!r} has a sparse gradient, which "
                                  f"{self.optimizer_class.__name__} does not take (as in "
                                  "torch): use dense gradients, or torch.optim.SparseAdam")

    def _run_step(self, feed: Feed, overlap: Overlap | None = None) -> None:
        """Update the sub-groups ``feed`` gives, in its order, through the buffers: read the
        next while one is updated and the last ones are written; then commit them all. On
        any error, the parameters of those updated are set back from their committed slots
        and the error raised: memory and swap are as before the step. ``overlap``: the step
        runs under backward (``step_with_backward``)."""
        keep, self._resident = self._resident, {}  # rebuilt only if the step succeeds
        free = [b for b in self._buffers if all(b is not r for r in keep.values())]
        written: list[tuple[SubGroup, Any]] = []
        reads: dict[int, tuple[Any, list[Pending], int]] = {}
        writes: deque[tuple[Any, list[Pending], int]] = deque()
        scalars: dict[int, dict[str, Any]] = {}
        updated: list[SubGroup] = []

        def take() -> Any:
            if not free and writes:
                buf, pending, nbytes = writes.popleft()
                self._io(pending, nbytes, write=True)
                free.append(buf)
            if not free:  # blocks kept from the last step that have not come yet
                free.append(keep.popitem()[1])
            return free.pop()

        def start_read(sg: SubGroup) -> None:
            # in place, the parameters are the master weights: read only the states
            skip = sg.numel * F32 if self._in_place(sg) and sg.numel * F32 % ALIGN == 0 else 0
            if sg.index in keep:  # its block is still in a buffer: nothing to read
                self.reused_bytes += sg.nbytes - skip
                reads[sg.index] = (keep.pop(sg.index), [], 0)
                return
            buf = take()
            view = self._view(buf)[skip : sg.nbytes]
            at = self._offset(sg, self._slot_of[sg.index]) + skip
            reads[sg.index] = (buf, self._swap.read(at, view), sg.nbytes - skip)

        try:
            sg = feed.get(block=True)
            if sg is not None:
                start_read(sg)
            while sg is not None:
                following = feed.get(block=False)
                if isinstance(following, SubGroup):
                    start_read(following)
                buf, pending, nbytes = reads.pop(sg.index)
                self._io(pending, nbytes, write=False)
                updated.append(sg)
                self._update(sg, buf, scalars)
                if overlap is not None:
                    self._changed_in_place(sg)
                    overlap.updated += 1
                target = 1 - self._slot_of[sg.index]
                self._pins.wait_free(sg.index, target)
                view = self._view(buf)[: sg.nbytes]
                writes.append((buf, self._swap.write(self._offset(sg, target), view),
                               sg.nbytes))
                written.append((sg, buf))
                if following is LATER:  # the next one is not ready yet: wait for it
                    following = feed.get(block=True)
                    if following is not None:
                        start_read(following)
                sg = following
            while writes:
                buf, pending, nbytes = writes.popleft()
                self._io(pending, nbytes, write=True)
            feed.check()  # the caller gave up on the step (Ctrl-C): undone, not committed
        except BaseException:
            for _, pending, _ in reads.values():
                _drain(pending)
            for _, pending, _ in writes:
                _drain(pending)
            self._params_from_slots(updated)
            raise
        for sg in updated:
            self._slot_of[sg.index] ^= 1
        self._versions = self._param_versions()  # the step's own writes are no change
        last = {id(buf): (sg.index, buf) for sg, buf in written}  # each buffer's last block
        self._resident = dict(last.values())
        for p, values in scalars.items():
            self._scalars[p] = values

    def _changed_in_place(self, sg: SubGroup) -> None:
        """Tell autograd that ``sg``'s parameters changed: torch's fused optimizers update in
        place without, and a node of the backward still under way that saved one of them
        (a weight used detached) then computed from the new value without a word."""
        for p in {pc.param for pc in sg.pieces}:
            if self._params[p].grad is not None:  # updated (a frozen one backward may need)
                torch.autograd.graph.increment_version(self._params[p])

    def _in_place(self, sg: SubGroup) -> bool:
        """Whether ``sg``'s parameters can be updated where they are: fp32, contiguous, on
        the CPU. They are then bit for bit the master weights (set from them by every step),
        so the update runs on them and the master block is only written (for a failed
        step's rollback and for checkpoints), never read: 8 bytes a parameter read, not 12."""
        return all(p.dtype == torch.float32 and p.device.type == "cpu" and p.is_contiguous()
                   for p in (self._params[pc.param] for pc in sg.pieces))

    def _update(self, sg: SubGroup, buf: Any, scalars: dict[int, dict[str, Any]]) -> None:
        """Run the optimizer on sub-group ``sg``'s block in ``buf``; set its parameters (or,
        updating them in place, the block's master weights from them)."""
        n = sg.numel
        in_place = self._in_place(sg)
        inner = self._inner[sg.group]
        proxies: list[tuple[Any, Any]] = []
        fresh: list[int] = []
        for piece in sg.pieces:
            param = self._params[piece.param]
            if param.grad is None:
                continue
            at, count = piece.at, piece.numel
            if in_place:
                proxy = param.detach().view(-1)[piece.start : piece.stop]
            else:  # a write torch did not count (``p.data.copy_(w)``) is taken here
                proxy = self._f32(buf, at, count)
                self._take_written(piece, proxy)
            grad = self._flat(param.grad)[piece.start : piece.stop]
            if grad.dtype != torch.float32 or grad.device.type != "cpu":
                if not self._grad_room:
                    raise ConfigError(f"parameter {self.names[piece.param]!r} is no longer "
                                      "fp32 on the CPU; move or cast the model before "
                                      "making its optimizer")
                grad = self._f32(buf, sg.nbytes // F32 + at, count).copy_(grad)
            proxy.grad = grad
            known = self._scalars[piece.param]
            if known is not None:
                state = {k: v.clone() if isinstance(v, torch.Tensor) else v
                         for k, v in known.items()}
                for a, name in enumerate(self.state_names, start=1):
                    state[name] = self._f32(buf, a * n + at, count)
                inner.state[proxy] = state
            else:
                fresh.append(len(proxies))  # the optimizer makes its state, as in memory
            proxies.append((piece, proxy))
        group = inner.param_groups[0]
        group.update(self._options(sg.group))
        # torch's fused SGD takes a list's momentum as all new or all carried (a mix is its
        # TypeError): parameters updated the first time step apart; the update is elementwise
        batches = [[proxy for i, (_, proxy) in enumerate(proxies) if (i in fresh) == new]
                   for new in (False, True)]
        batches = [b for b in batches if b] or [[]]
        scale = getattr(self, "grad_scale", None)
        if scale is not None:  # the fused kernel unscales, as it would in memory
            inner.grad_scale = scale.to("cpu")  # type: ignore[attr-defined]
        try:
            for batch in batches:
                group["params"] = batch
                inner.step()
            for i, (piece, proxy) in enumerate(proxies):
                state = inner.state[proxy]
                if i in fresh:
                    for a, name in enumerate(self.state_names, start=1):
                        self._f32(buf, a * n + piece.at, piece.numel).copy_(state[name])
                scalars[piece.param] = {k: v for k, v in state.items()
                                        if k not in self.state_names}
                if not in_place:
                    self._set_param(piece, proxy)
            if in_place:  # every piece: the block's master weights were not read
                master = self._f32(buf, 0, n)
                for piece in sg.pieces:
                    param = self._params[piece.param].detach().view(-1)
                    master[piece.at : piece.at + piece.numel].copy_(
                        param[piece.start : piece.stop])
            if self._on_cuda:  # the buffer is read into again once written
                torch.cuda.synchronize()
        finally:
            inner.state.clear()
            group["params"] = []
            inner.__dict__.pop("grad_scale", None)

    def _set_param(self, piece: Any, master: Any) -> None:
        param = self._params[piece.param]
        dst = param.detach().view(-1)[piece.start : piece.stop]
        dst.copy_(master, non_blocking=dst.device.type == "cuda")

    def _params_from_slots(self, sub_groups: list[SubGroup]) -> None:
        """Set the parameters of ``sub_groups`` from their committed master weights."""
        self._resident = {}  # buffers[0] is overwritten; a restore changes the slots
        buf = self._buffers[0]
        for sg in sub_groups:
            view = self._view(buf)[: sg.nbytes]
            self._io(self._swap.read(self._offset(sg, self._slot_of[sg.index]), view),
                     sg.nbytes, write=False)
            for piece in sg.pieces:
                self._set_param(piece, self._f32(buf, piece.at, piece.numel))
        if self._on_cuda:
            torch.cuda.synchronize()
        self._versions = self._param_versions()

    # --- checkpoints (lcache.checkpoint streams them; see state.py) -------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state keyed by parameter name, its arrays read from the swap into tensors:
        the whole state in memory, as torch's ``state_dict()``. ``lcache.checkpoint``
        streams it instead when handed the optimizer itself (``{"optimizer": opt}``)."""
        from lcache.offload.state import memory_state

        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        saved = memory_state(self)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            saved = post_hook(self, saved) or saved
        return saved

    def load_state_dict(self, state_dict: Any) -> None:
        """Load a ``state_dict()`` of an OffloadedOptimizer, or what ``lcache.checkpoint``
        loaded of one, into the swap; parameters are set from its master weights.

        Raises:
            ConfigError: not such a state, or one for other parameters.
            CorruptionError: an array of the wrong size or dtype (the state stays as it was).
        """
        from lcache.offload.state import restore_state

        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        restore_state(self, state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __lcache_checkpoint__(self) -> dict[str, Any]:
        from lcache.offload.state import checkpoint_state

        return checkpoint_state(self)

    def __lcache_restore__(self, saved: Any) -> OffloadedOptimizer:
        from lcache.offload.state import restore_state

        return restore_state(self, saved)

    # --- life ----------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # a copy would share the swap file, and the first to close would remove it
        raise ConfigError("an OffloadedOptimizer cannot be pickled or copied (its state is in "
                          "its swap file); save it with lcache.checkpoint or state_dict()")

    @property
    def swap_path(self) -> str:
        return self._swap.path

    def state_bytes(self) -> int:
        """Bytes of optimizer state (master weights and per-element states) in the swap."""
        return int(sum(p.numel() for p in self._params)) * self.arrays * F32

    def _check_open(self) -> None:
        if self._swap.fd < 0:
            raise ConfigError("this OffloadedOptimizer is closed")

    def close(self) -> None:
        """Remove the swap file and its manifest, and free the host buffers, once no
        checkpoint save still reads them (an ``async_save`` of it waits to be streamed)."""
        self._pins.wait_none()
        self._closer()
        self._buffers = []
        self._resident = {}

    def __enter__(self) -> OffloadedOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"OffloadedOptimizer({self.optimizer_class.__name__}, {len(self._params)} "
                f"params, {len(self.sub_groups)} sub-groups of up to "
                f"{max(sg.numel for sg in self.sub_groups):,} elements, swap {self._swap.path})")


def _drain(pending: list[Pending]) -> None:
    for p in pending:
        with contextlib.suppress(Exception):  # the step's first error is the one raised
            p.wait()

