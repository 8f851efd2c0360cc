"""OffloadedOptimizer as a torch.optim.Optimizer: LR schedulers, GradScaler, step hooks and
state_dict() work with it as with torch's own, to the bit (issue 12)."""

from __future__ import annotations

import copy
import inspect
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    OneCycleLR,
    SequentialLR,
)

from lcache import checkpoint
from lcache.errors import ConfigError
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

STEPS = 30




def one_cycle(opt: torch.optim.Optimizer) -> LRScheduler:
    return OneCycleLR(opt, max_lr=3e-2, total_steps=STEPS)  # moves lr and beta1 each step


def warmup_cosine(opt: torch.optim.Optimizer) -> LRScheduler:
    return SequentialLR(opt, [LinearLR(opt, 0.1, total_iters=5),
                              CosineAnnealingLR(opt, STEPS - 5)], milestones=[5])


def run(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: LRScheduler,
        steps: range) -> None:
    for s in steps:
        if s == 12:  # an option changed by hand, as some training loops do
            opt.param_groups[0]["weight_decay"] = 0.3
        loss_of(model, batch(s)).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("schedule", [one_cycle, warmup_cosine], ids=["one-cycle",
                                                                       "warmup-cosine"])
def test_schedulers_drive_it_to_the_same_bits_as_adamw(
        tmp_path: Path, schedule: Callable[[torch.optim.Optimizer], LRScheduler]) -> None:
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    with OffloadedOptimizer(model.named_parameters(), lr=1e-3, weight_decay=0.1,
                            dir=tmp_path, **SMALL) as opt:
        assert isinstance(opt, torch.optim.Optimizer)
        ref_sched, sched = schedule(ref), schedule(opt)
        run(ref_model, ref, ref_sched, range(STEPS))
        run(model, opt, sched, range(STEPS))
        assert same(ref_model, model)
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
        assert len(opt.state) == 0  # the state is in the swap file only


@pytest.mark.parametrize("unscale", [True, False], ids=["unscale_", "in-the-step"])
@pytest.mark.parametrize("init_scale", [2.0**16, 1000.0])
def test_grad_scaler_unscales_and_skips_steps_as_with_adamw(
        tmp_path: Path, unscale: bool, init_scale: float) -> None:
    """The finding: at a scale that is not a power of 2 (1000), left to the step to unscale,
    the results drifted by an ulp a step: the scaler multiplied by 1/scale, where torch's
    fused AdamW divides by the scale in its kernel."""
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with OffloadedOptimizer(model.parameters(), lr=1e-2, dir=tmp_path, **SMALL) as opt:
        scales: list[list[float]] = [[], []]
        for i, (m, o) in enumerate(((ref_model, ref), (model, opt))):
            scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2,
                                          backoff_factor=0.3)
            for s in range(12):
                loss = loss_of(m, batch(s))
                if s in (3, 8):  # gradients that overflow: the step is skipped
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
                if unscale:
                    scaler.unscale_(o)
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                scaler.step(o)
                scaler.update()
                o.zero_grad(set_to_none=True)
                scales[i].append(scaler.get_scale())
        assert scales[0] == scales[1]
        assert scales[1][0] < scales[1][1] > scales[1][3]  # grew, then fell at step 3
        assert same(ref_model, model)
        assert not torch.equal(model.head.weight, make_model().head.weight)


def test_step_hooks_run_and_add_param_group_and_copies_are_refused(tmp_path: Path) -> None:
    model = make_model()
    with OffloadedOptimizer(model.parameters(), dir=tmp_path, **SMALL) as opt:
        calls: list[str] = []
        opt.register_step_pre_hook(lambda o, args, kw: calls.append("pre"))
        opt.register_step_post_hook(lambda o, args, kw: calls.append("post"))
        loss_of(model, batch(0)).backward()
        opt.step()
        assert calls == ["pre", "post"]
        with pytest.raises(ConfigError, match="cannot add a param group"):
            opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})
        assert len(opt.param_groups) == 1
        with pytest.raises(ConfigError, match="cannot be pickled or copied"):
            copy.deepcopy(opt)
    with pytest.raises(ConfigError, match="non-leaf"):
        OffloadedOptimizer([torch.zeros(4, requires_grad=True) * 2], dir=tmp_path, **SMALL)


def reference(steps: int) -> torch.nn.Module:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    run(model, opt, one_cycle(opt), range(steps))
    return model


def fresh(root: Path) -> tuple[torch.nn.Module, OffloadedOptimizer, LRScheduler]:
    model = make_model(seed=5)  # other weights: all of them must come from the checkpoint
    opt = OffloadedOptimizer(model.named_parameters(), lr=1e-3, weight_decay=0.1,
                             dir=root, host_budget="4MB", direct=False)
    return model, opt, one_cycle(opt)  # the scheduler's first step sets lr: restored below


def test_resume_mid_schedule_through_lcache_checkpoint_is_bit_exact(tmp_path: Path) -> None:
    model = make_model()
    with OffloadedOptimizer(model.named_parameters(), lr=1e-3, weight_decay=0.1,
                            dir=tmp_path / "a", **SMALL) as opt:
        sched = one_cycle(opt)
        run(model, opt, sched, range(14))
        checkpoint.save({"model": model.state_dict(), "optimizer": opt,
                         "scheduler": sched.state_dict()}, tmp_path / "ckpt" / "step-14")
    model, opt, sched = fresh(tmp_path / "b")
    with opt:
        state = checkpoint.load(tmp_path / "ckpt" / "step-14",
                                like={"model": model.state_dict(), "optimizer": opt,
                                      "scheduler": sched.state_dict()})
        model.load_state_dict(state["model"])
        sched.load_state_dict(state["scheduler"])
        run(model, opt, sched, range(14, STEPS))
    assert same(model, reference(STEPS))


def test_state_dict_round_trips_through_torch_save_and_load_state_dict(
        tmp_path: Path) -> None:
    model = make_model()
    with OffloadedOptimizer(model.named_parameters(), lr=1e-3, weight_decay=0.1,
                            dir=tmp_path / "a", **SMALL) as opt:
        sched = one_cycle(opt)
        run(model, opt, sched, range(14))
        saved: dict[str, Any] = opt.state_dict()
        assert saved["state"]["head.weight"]["exp_avg"].shape == (97, 32)
        blob = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": saved,
                    "scheduler": sched.state_dict()}, blob)
        run(model, opt, sched, range(14, 16))  # the saved tensors are the state of step 14
    blob.seek(0)
    loaded = torch.load(blob, weights_only=True)
    model, opt, sched = fresh(tmp_path / "b")
    with opt:
        opt.load_state_dict(loaded["optimizer"])  # sets the parameters from the masters
        sched.load_state_dict(loaded["scheduler"])
        run(model, opt, sched, range(14, STEPS))
        with pytest.raises(ConfigError, match="not an OffloadedOptimizer's state"):
            opt.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    assert same(model, reference(STEPS))


@pytest.mark.parametrize(("optimizer_class", "options"), [
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "foreach": False}),
    (torch.optim.RMSprop, {"lr": 1e-3}),
    (torch.optim.Adagrad, {"lr": 1e-2}),
], ids=["sgd-momentum", "sgd-nesterov", "rmsprop", "adagrad"])
def test_other_elementwise_optimizers_match_torch_through_a_resume(
        tmp_path: Path, optimizer_class: type, options: dict[str, Any]) -> None:
    """SGD keeps no ``step``: its momentum was dropped at every step, which then ran as the
    first (plain SGD). Resumed half-way from ``state_dict()``, as a restart would."""
    ref_model, model = make_model(), make_model()
    # the offload's default: torch's fused path where the optimizer has one
    fused = {"fused": True} if "foreach" not in options and \
        "fused" in inspect.signature(optimizer_class).parameters else {}
    ref = optimizer_class(ref_model.parameters(), **options, **fused)
    train(ref_model, ref, range(8))
    with OffloadedOptimizer(model.named_parameters(), optimizer_class, dir=tmp_path / "a",
                            **SMALL, **options) as opt:
        train(model, opt, range(4))
        saved = opt.state_dict()
    with OffloadedOptimizer(model.named_parameters(), optimizer_class, dir=tmp_path / "b",
                            **SMALL, **options) as opt:
        opt.load_state_dict(saved)
        train(model, opt, range(4, 8))
    assert same(ref_model, model)


def test_sgd_momentum_of_a_parameter_whose_first_gradient_comes_later(tmp_path: Path) -> None:
    """Fused SGD (the default here) got one sub-group's parameters with momentum and one
    without yet, and raised torch's TypeError 'expected Tensor as element 1 ... NoneType'
    (attack helper 48), as torch's SGD(fused=True) does for them. The reference: torch's
    fused SGD, one optimizer per parameter (its update is per parameter)."""
    def run(make: Callable[[list[torch.nn.Parameter]], list[Any]]) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(100, generator=gen)) for _ in range(2)]
        opts = make(params)
        for step in range(4):
            for p in params[: 1 if step == 0 else 2]:  # the second has no gradient at first
                p.grad = torch.randn(100, generator=gen)
            for opt in opts:
                opt.step()
        for opt in opts:
            if isinstance(opt, OffloadedOptimizer):
                opt.close()
        return [p.detach() for p in params]

    options = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
    ref = run(lambda ps: [torch.optim.SGD([p], fused=True, **options) for p in ps])
    got = run(lambda ps: [OffloadedOptimizer(ps, torch.optim.SGD, dir=tmp_path, **SMALL,
                                             **options)])
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


class NormalizedSGD(torch.optim.Optimizer):
    """Steps by the gradient over its norm: each element's update depends on all others."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm(), alpha=-group["lr"])


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adafactor, NormalizedSGD])
def test_an_optimizer_that_is_not_elementwise_is_refused(
        tmp_path: Path, optimizer_class: type) -> None:
    """Run a sub-group at a time, it would train to other weights than in memory."""
    with pytest.raises(ConfigError, match="not an elementwise optimizer"):
        OffloadedOptimizer(make_model().parameters(), optimizer_class, dir=tmp_path, **SMALL)
    assert list(tmp_path.iterdir()) == []


def test_a_groups_own_implementation_choice_is_kept_and_bad_options_are_config_errors(
        tmp_path: Path) -> None:
    """``fused=True`` was added beside a group's ``foreach=True`` (a bare RuntimeError), and
    an option the optimizer asserts on (capturable on the CPU) was a bare AssertionError."""
    ref_model, model = make_model(), make_model()
    head = ["head.weight"]

    def groups(m: torch.nn.Module) -> list[dict[str, Any]]:
        return [{"params": [p for n, p in m.named_parameters() if n not in head]},
                {"params": [p for n, p in m.named_parameters() if n in head],
                 "foreach": True}]

    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2)
    with OffloadedOptimizer(groups(model), lr=1e-2, dir=tmp_path / "a", **SMALL) as opt:
        train(ref_model, ref, range(5))
        train(model, opt, range(5))
    assert same(ref_model, model)
    with pytest.raises(ConfigError, match="capturable"):
        OffloadedOptimizer(model.parameters(), capturable=True, fused=False,
                           dir=tmp_path / "b", **SMALL)
