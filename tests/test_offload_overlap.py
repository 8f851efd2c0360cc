"""``OffloadedOptimizer.step_with_backward``: sub-groups updated while backward still runs,
with the bits of ``backward()`` then ``step()``, and a failure anywhere undone."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from lcache.errors import ConfigError, DiskFullError
from lcache.offload import OffloadedOptimizer
from tests._offload_model import (  # one_thread: an autouse fixture
    SMALL,
    batch,
    loss_of,
    make_model,
    one_thread,  # noqa: F401
    same,
    train,
)
from tests.conftest import mounted_tmpfs, run_torchrun


def train_overlapped(model: torch.nn.Module, opt: OffloadedOptimizer, steps: range) -> None:
    for s in steps:
        opt.step_with_backward(loss_of(model, batch(s)))
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_same_bits_as_backward_then_step(tmp_path: Path, dtype: Any) -> None:
    ref_model, model = make_model(dtype=dtype), make_model(dtype=dtype)
    with OffloadedOptimizer(ref_model.parameters(), lr=3e-3, weight_decay=0.1,
                            dir=tmp_path / "a", **SMALL) as ref, \
            OffloadedOptimizer(model.parameters(), lr=3e-3, weight_decay=0.1,
                               dir=tmp_path / "b", **SMALL) as opt:
        assert len(opt.sub_groups) > 5
        train(ref_model, ref, range(30))
        train_overlapped(model, opt, range(30))
        assert same(ref_model, model)
        assert opt.write_bytes == ref.write_bytes
    if dtype == torch.float32:  # and torch's own AdamW's
        plain = make_model()
        train(plain, torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.1,
                                       fused=True), range(30))
        assert same(plain, model)


def test_accumulation_frozen_unused_and_hand_set_gradients(tmp_path: Path) -> None:
    """Micro-batches accumulated with backward() and the last one given here; a frozen
    part, a parameter the pass does not use and a gradient set by hand: those sub-groups
    get no hook call and are updated when backward ends."""
    def build() -> torch.nn.Module:
        model = make_model()
        model.spare = torch.nn.Linear(8, 8)  # never in the graph
        model.head.weight.requires_grad_(False)
        return model

    ref_model, model = build(), build()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with OffloadedOptimizer(model.parameters(), lr=1e-2, dir=tmp_path, **SMALL) as opt:
        for s in range(5):
            for m in (ref_model, model):
                loss_of(m, batch(10 * s)).backward()
                m.spare.bias.grad = torch.full((8,), 0.5 * s)
            loss_of(ref_model, batch(10 * s + 1)).backward()
            ref.step()
            ref.zero_grad()
            opt.step_with_backward(loss_of(model, batch(10 * s + 1)))
            opt.zero_grad()
    assert same(ref_model, model)


class _Waits(torch.autograd.Function):
    """Identity; its backward, the last of the pass, waits until ``event`` is set and
    appends whether it was to ``seen``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, event: threading.Event, seen: list[bool]
                ) -> torch.Tensor:
        ctx.event, ctx.seen = event, seen
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.seen.append(ctx.event.wait(20))
        return grad, None, None


@contextmanager
def _when_changed(tensor: torch.Tensor) -> Iterator[threading.Event]:
    """An event set once ``tensor`` no longer holds the values it holds now (a thread
    watches it until the block ends)."""
    before = tensor.detach().clone()
    changed = threading.Event()
    watching = True

    def watch() -> None:
        while watching and not changed.is_set():
            if not torch.equal(tensor.detach(), before):
                changed.set()
            changed.wait(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield changed
    finally:
        watching = False
        watcher.join()


def test_updates_run_while_backward_still_computes(tmp_path: Path) -> None:
    """The first layers' gradients wait in backward until the output layer's parameters
    have changed: only an update made during backward lets it go on in time."""
    model = make_model()
    with OffloadedOptimizer(model.parameters(), lr=1e-2, dir=tmp_path, **SMALL) as opt, \
            _when_changed(model.head.weight) as changed:
        idx = batch(0)
        seen: list[bool] = []
        x = _Waits.apply(model.tok(idx[:, :-1]), changed, seen)
        h = model.head(model.ln(model.blocks(x + model.pos[: idx.shape[1] - 1])))
        loss = torch.nn.functional.cross_entropy(h.reshape(-1, h.shape[-1]),
                                                 idx[:, 1:].reshape(-1))
        opt.step_with_backward(loss)
        assert seen == [True]


class _Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed here")


def test_a_backward_that_fails_midway_leaves_every_parameter_as_it_was(tmp_path: Path) -> None:
    """The last layers were updated by the time the first ones' backward failed: their
    updates are undone, and training goes on with the bits of a run that never failed."""
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with OffloadedOptimizer(model.parameters(), lr=1e-2, dir=tmp_path, **SMALL) as opt:
        train_overlapped(model, opt, range(2))
        train(ref_model, ref, range(2))
        before = [p.detach().clone() for p in model.parameters()]
        idx = batch(7)
        x = _Fails.apply(model.tok(idx[:, :-1]))
        h = model.head(model.ln(model.blocks(x + model.pos[: idx.shape[1] - 1])))
        loss = torch.nn.functional.cross_entropy(h.reshape(-1, h.shape[-1]),
                                                 idx[:, 1:].reshape(-1))
        with pytest.raises(RuntimeError, match="backward failed here"):
            opt.step_with_backward(loss)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        opt.zero_grad()
        train_overlapped(model, opt, range(2, 4))
        train(ref_model, ref, range(2, 4))
    assert same(ref_model, model)


def test_a_full_device_mid_step_is_undone_and_the_step_retries(tmp_path: Path) -> None:
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with mounted_tmpfs(tmp_path / "small", "1m") as small:
        # not preallocated, so the second slot's blocks are allocated by the first step
        opt = OffloadedOptimizer(model.parameters(), lr=1e-2, dir=small, preallocate=False,
                                 **SMALL)
        filler = small / "filler"
        free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
        filler.write_bytes(b"x" * (free - opt.slot_bytes // 2))
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(DiskFullError):
            opt.step_with_backward(loss_of(model, batch(0)))
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        filler.unlink()
        opt.step()  # the gradients are still there: the same step, retried
        opt.zero_grad()
        train(ref_model, ref, range(1))
        assert same(ref_model, model)
        train_overlapped(model, opt, range(1, 3))
        train(ref_model, ref, range(1, 3))
        assert same(ref_model, model)
        opt.close()


def test_step_pre_hooks_run_before_backward(tmp_path: Path) -> None:
    """A pre-hook that halves the lr: it ran after the sub-groups were updated during
    backward, so they all took the old one (attack helper 107). One that raises stops the
    step before backward runs."""
    def halve(opt: Any, *_: Any) -> None:
        for group in opt.param_groups:
            group["lr"] *= 0.5

    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    ref.register_step_pre_hook(halve)
    with OffloadedOptimizer(model.parameters(), lr=1e-2, dir=tmp_path, **SMALL) as opt:
        opt.register_step_pre_hook(halve)
        train(ref_model, ref, range(3))
        train_overlapped(model, opt, range(3))
        assert same(ref_model, model)

        def refuse(*_: Any) -> None:
            raise ValueError("not this step")

        opt.register_step_pre_hook(refuse)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match="not this step"):
            opt.step_with_backward(loss_of(model, batch(3)))
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        assert all(p.grad is None for p in model.parameters())  # backward did not run


def test_a_weight_backward_still_needs_is_refused_not_used_updated(tmp_path: Path) -> None:
    """The output layer's weight is also used detached at the input: the update made when
    its gradient was complete changed the value the input's backward then read, and the
    bits differed without a word (torch's fused AdamW tells autograd nothing). Now
    autograd sees the change, and the step is refused and undone (attack helper 107)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(40, 40) for _ in range(4))
    x = torch.randn(8, 40)
    with OffloadedOptimizer(layers.parameters(), lr=1e-2, dir=tmp_path, host_budget="1MB",
                            sub_group_size=1640, direct=False) as opt, \
            _when_changed(layers[3].weight) as changed:
        h = torch.tanh(layers[0](x))
        h = h + torch.tanh(h @ layers[3].weight.detach().T)
        seen: list[bool] = []
        h = _Waits.apply(h, changed, seen)  # the input's backward: once the weight changed
        for layer in layers[1:]:
            h = torch.tanh(layer(h))
        before = [p.detach().clone() for p in layers.parameters()]
        with pytest.raises(ConfigError, match="backward needed the value of a parameter that "
                           "step_with_backward had already updated"):
            opt.step_with_backward(h.square().mean())
        assert seen == [True]
        assert all(torch.equal(p, b) for p, b in zip(layers.parameters(), before, strict=True))


def test_ctrl_c_while_the_step_runs_undoes_it_before_the_call_returns(tmp_path: Path) -> None:
    """SIGINT after backward, while the thread still updated: the call raised, and the
    thread committed the step behind the caller's back (attack helper 107)."""
    model = make_model()
    with OffloadedOptimizer(model.parameters(), lr=1e-2, dir=tmp_path, **SMALL) as opt:
        real = opt._update

        def slow(*args: Any) -> None:  # a large sub-group, a slow device
            time.sleep(0.1)
            real(*args)

        opt._update = slow  # type: ignore[method-assign]
        before = [p.detach().clone() for p in model.parameters()]
        slots = list(opt._slot_of)
        loss = loss_of(model, batch(0))
        interrupt = threading.Timer(0.25, lambda: os.kill(os.getpid(), signal.SIGINT))
        interrupt.start()
        with pytest.raises(KeyboardInterrupt):
            opt.step_with_backward(loss)
        interrupt.join()
        for thread in threading.enumerate():  # the step's: done, ending
            if thread.name == "lcache-offload-step":
                thread.join(5)
                assert not thread.is_alive()
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        assert opt._slot_of == slots
        opt._update = real  # type: ignore[method-assign]
        ref_model = make_model()
        train(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True),
              range(1))
        opt.step()  # the gradients are still there: the same step, whole
        assert same(ref_model, model)


def test_a_gradient_that_comes_twice_in_one_pass_is_refused_and_undone(
        tmp_path: Path) -> None:
    """Reentrant activation checkpointing runs a second backward inside the first: a
    weight used inside and outside the checkpointed part gets its gradient in two parts,
    and was updated from the first. Refused, with the step undone."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(4, 64, requires_grad=True)
    with OffloadedOptimizer(lin.parameters(), lr=1e-2, dir=tmp_path, host_budget="1MB",
                            sub_group_size=64 * 64, direct=False) as opt:
        before = [p.detach().clone() for p in lin.parameters()]
        loss = lin(checkpoint(lin, x, use_reentrant=True)).square().sum()
        with pytest.raises(ConfigError, match=r"'0\.[01]' got its gradient twice in one "
                           r"backward pass \(reentrant activation checkpointing\?\)"):
            opt.step_with_backward(loss)
        assert all(torch.equal(p, b) for p, b in zip(lin.parameters(), before, strict=True))
        opt.zero_grad()
        lin(checkpoint(lin, x, use_reentrant=True)).square().sum().backward()
        opt.step()  # the two calls: the whole gradient
        assert not torch.equal(lin.weight, before[0])


def test_across_ranks_the_update_waits_for_the_reduced_gradients(tmp_path: Path) -> None:
    run_torchrun([str(Path(__file__).with_name("_offload_ddp.py")), str(tmp_path)], 120)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"same": True}


def test_a_loss_that_is_no_tensor_is_a_config_error(tmp_path: Path) -> None:
    model = make_model()
    with OffloadedOptimizer(model.parameters(), lr=1e-2, dir=tmp_path, **SMALL) as opt, \
            pytest.raises(ConfigError, match=r"loss=3.5\): give the loss tensor"):
        opt.step_with_backward(3.5)  # type: ignore[arg-type]
