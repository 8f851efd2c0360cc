"""OffloadedOptimizer: the same bits as torch's optimizers, bounded memory, files that never
pile up, refusals up front (issue 12, 2-5)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lcache.errors import ConfigError, DiskFullError, StorePermissionError
from lcache.io import set_tracer
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
from tests.conftest import (
    CHECKS_ITSELF,
    doc_blocks,
    mounted_tmpfs,
    run_doc_python,
    subprocess_env,
)


@pytest.mark.parametrize(("impl", "size"), [({}, 3000), ({"foreach": False}, 3000),
                                            ({}, 3072)],
                         ids=["fused", "single-tensor", "fused-aligned"])
def test_fp32_bit_identical_to_adamw_for_100_steps(tmp_path: Path, impl: dict,
                                                   size: int) -> None:
    ref_model, model = make_model(), make_model()
    # the offload's default is torch's fused CPU AdamW; foreach=False is torch's CPU default
    ref = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, weight_decay=0.1,
                            **(impl or {"fused": True}))
    with OffloadedOptimizer(model.named_parameters(), torch.optim.AdamW, lr=3e-3,
                            weight_decay=0.1, dir=tmp_path, **{**SMALL, "sub_group_size": size},
                            **impl) as opt:
        assert len(opt.sub_groups) > 5
        train(ref_model, ref, range(100))
        train(model, opt, range(100))
        assert same(ref_model, model)
        # fp32 parameters are their own master weights: a block whose states start on a
        # page boundary is read without them (3072 elements: all but the groups' last blocks)
        skipped = sum(sg.numel * 4 for sg in opt.sub_groups if sg.numel * 4 % 4096 == 0)
        assert (skipped > 0) == (size == 3072)
        assert opt.write_bytes == 101 * opt.slot_bytes  # + the initial masters
        # the blocks a step wrote last are still in its buffers: the next step starts with
        # them and does not read them again
        assert 0 < opt.reused_bytes < opt.read_bytes
        assert opt.read_bytes + opt.reused_bytes == 100 * (opt.slot_bytes - skipped)
        masters = opt.state_dict()["state"]
        assert all(torch.equal(masters[n]["master"], p) for n, p in model.named_parameters())


def test_a_parameter_cut_across_sub_groups_keeps_fused_adamws_bits(tmp_path: Path) -> None:
    """torch's fused CPU AdamW computes a tensor's last, partial vector in another way than
    its full vectors: cut at any element, a parameter's pieces put other elements in that
    path (62,769 of 301,000 differed after 20 steps with these shapes and defaults)."""
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 301), torch.nn.GELU(),
                                   torch.nn.Linear(301, 1000))

    ref_model, offloaded = model(), model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with OffloadedOptimizer(offloaded.named_parameters(), lr=1e-2, dir=tmp_path,
                            host_budget="4MB", direct=False) as opt:
        assert any(pc.start > 0 for sg in opt.sub_groups for pc in sg.pieces)  # cut
        g = torch.Generator().manual_seed(1)
        for _ in range(20):
            x = torch.randn(8, 5, generator=g)
            for m, o in ((ref_model, ref), (offloaded, opt)):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
    assert same(ref_model, offloaded)


def test_its_repr_gives_the_sub_groups_it_made(tmp_path: Path) -> None:
    """Regression: a parameter is cut at multiples of 64 elements, so sub_group_size=100 made
    sub-groups of 64, which the repr gave as "16 sub-groups of 100 elements"."""
    param = torch.nn.Parameter(torch.zeros(1000))
    with OffloadedOptimizer([param], lr=1e-2, dir=tmp_path, sub_group_size=100,
                            direct=False) as opt:
        assert {sg.numel for sg in opt.sub_groups} == {64, 40}
        assert "16 sub-groups of up to 64 elements" in repr(opt), repr(opt)


def test_adam_with_amsgrad_keeps_its_third_state(tmp_path: Path) -> None:
    ref_model, model = make_model(), make_model()
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2, amsgrad=True, fused=True)
    with OffloadedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2, amsgrad=True,
                            dir=tmp_path, **{**SMALL, "direct": True}) as opt:
        assert opt.state_names == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
        train(ref_model, ref, range(10))
        train(model, opt, range(10))
    assert same(ref_model, model)


def test_amsgrad_given_in_the_param_groups_keeps_its_third_state_in_the_swap(
        tmp_path: Path) -> None:
    """The state was probed with the constructor's options only: ``max_exp_avg_sq`` was
    taken for a scalar, kept in memory and handed from one piece of a parameter to the next
    (0.58 off after 10 steps)."""
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW([{"params": list(ref_model.parameters()), "amsgrad": True}],
                            lr=1e-2, fused=True)
    with OffloadedOptimizer([{"params": list(model.parameters()), "amsgrad": True}],
                            lr=1e-2, dir=tmp_path / "a", **SMALL) as opt:
        assert opt.state_names == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
        train(ref_model, ref, range(10))
        train(model, opt, range(10))
    assert same(ref_model, model)
    head = list(model.head.parameters())
    rest = [p for n, p in model.named_parameters() if not n.startswith("head")]
    with pytest.raises(ConfigError, match="give options such as amsgrad to every group"):
        OffloadedOptimizer([{"params": rest}, {"params": head, "amsgrad": True}],
                           dir=tmp_path / "b", **SMALL)


def test_bf16_params_match_adamw_on_an_fp32_master_copy(tmp_path: Path) -> None:
    model = make_model(dtype=torch.bfloat16)
    master = make_model(dtype=torch.bfloat16).float()  # the fp32 copy of the bf16 start
    ref = torch.optim.AdamW(master.parameters(), lr=3e-3, fused=True)
    with OffloadedOptimizer(model.parameters(), lr=3e-3, dir=tmp_path, **SMALL) as opt:
        for s in range(20):
            step_bf16_and_master(model, opt, master, ref, s)
        assert same(model, master.to(torch.bfloat16))


def step_bf16_and_master(model: torch.nn.Module, opt: OffloadedOptimizer,
                         master: torch.nn.Module, ref: torch.optim.Optimizer, s: int) -> None:
    """One step of the bf16 model and of AdamW on its fp32 master copy; checks they agree."""
    loss_of(model, batch(s)).backward()
    for p, m in zip(model.parameters(), master.parameters(), strict=True):
        m.grad = p.grad.float()
    opt.step()
    ref.step()
    opt.zero_grad(set_to_none=True)
    for p, m in zip(model.parameters(), master.parameters(), strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], how: str) -> None:
    """``load_state_dict``, or writes torch does not count: ``p.data.copy_`` and
    ``p.data = w`` (older training scripts load weights that way)."""
    if how == "load_state_dict":
        model.load_state_dict(weights)
        return
    for name, p in model.named_parameters():
        if how == "data.copy_":
            p.data.copy_(weights[name])
        else:
            p.data = weights[name].clone()


@pytest.mark.parametrize("how", ["load_state_dict", "data.copy_", "data ="])
def test_bf16_weights_loaded_between_steps_become_the_master_weights(tmp_path: Path,
                                                                     how: str) -> None:
    """A model loaded after its optimizer was made (a pretrained checkpoint, a broadcast) is
    trained from the loaded weights, not overwritten by the old masters at the next step."""
    model = make_model(dtype=torch.bfloat16)
    master = make_model(dtype=torch.bfloat16).float()
    ref = torch.optim.AdamW(master.parameters(), lr=3e-3, fused=True)
    loaded = make_model(seed=1, dtype=torch.bfloat16).state_dict()
    with OffloadedOptimizer(model.named_parameters(), lr=3e-3, dir=tmp_path, **SMALL) as opt:
        for s in range(6):
            if s == 3:
                load_weights(model, loaded, how)
                with torch.no_grad():
                    for m, p in zip(master.parameters(), model.parameters(), strict=True):
                        m.copy_(p.float())
                saved = opt.state_dict()["state"]  # a checkpoint now holds the loaded weights
                for name, p in model.named_parameters():
                    assert torch.equal(saved[name]["master"].view(p.shape), p.float()), name
            step_bf16_and_master(model, opt, master, ref, s)


@pytest.mark.parametrize("how", ["data.copy_", "data ="])
def test_fp32_weights_written_behind_torchs_back_are_what_a_checkpoint_saves(
        tmp_path: Path, how: str) -> None:
    model = make_model()
    loaded = make_model(seed=1).state_dict()
    with OffloadedOptimizer(model.named_parameters(), lr=3e-3, dir=tmp_path, **SMALL) as opt:
        train(model, opt, range(2))
        load_weights(model, loaded, how)
        saved = opt.state_dict()["state"]
        for name, p in model.named_parameters():
            assert torch.equal(saved[name]["master"].view(p.shape), loaded[name]), name


def test_accumulation_zero_grad_and_params_without_grads(tmp_path: Path) -> None:
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with OffloadedOptimizer(model.parameters(), lr=1e-2, dir=tmp_path, **SMALL) as opt:
        for m, o in ((ref_model, ref), (model, opt)):
            for s in range(6):
                for micro in range(3):  # gradients accumulate over micro-batches
                    loss_of(m, batch(10 * s + micro)).backward()
                if s % 2:  # a frozen part: no gradient, no update, its step count stays
                    m.head.weight.grad = None
                o.step()
                o.zero_grad(set_to_none=s % 3 != 0)
        assert all(p.grad is None for p in model.parameters())
    assert same(ref_model, model)


def test_a_budget_too_small_for_one_sub_group_is_refused_with_the_minimum(
        tmp_path: Path) -> None:
    # 3 buffers x 65,536 elements x (master, m, v): fp32 gradients on the CPU are used where
    # they are, others get room in the buffers
    with pytest.raises(ConfigError, match=r"at least 2,359,296 bytes") as info:
        OffloadedOptimizer([torch.zeros(1 << 20, requires_grad=True)], dir=tmp_path,
                           host_budget="1MB")
    assert "raise host_budget" in str(info.value)
    with pytest.raises(ConfigError, match=r"\+ gradients\) = at least 3,145,728 bytes"):
        OffloadedOptimizer([torch.zeros(1 << 20, dtype=torch.bfloat16, requires_grad=True)],
                           dir=tmp_path, host_budget="1MB")
    assert os.listdir(tmp_path) == []  # refused before any file was made
    with pytest.raises(ConfigError, match="at least"):
        OffloadedOptimizer(make_model().parameters(), dir=tmp_path, host_budget=4096)
    with pytest.raises(ConfigError, match="cannot read"):
        OffloadedOptimizer(make_model().parameters(), dir=tmp_path, host_budget="lots")


def test_a_model_cast_after_its_optimizer_was_made_is_refused_clearly(tmp_path: Path) -> None:
    model = make_model()
    with OffloadedOptimizer(model.named_parameters(), dir=tmp_path, **SMALL) as opt:
        model.to(torch.bfloat16)  # its buffers have no room for gradients to copy
        loss_of(model, batch(0)).backward()
        with pytest.raises(ConfigError, match="no longer fp32 on the CPU"):
            opt.step()


def test_swap_files_have_stable_names_and_close_removes_them(tmp_path: Path) -> None:
    opt = OffloadedOptimizer(make_model().named_parameters(), dir=tmp_path, **SMALL)
    assert sorted(os.listdir(tmp_path)) == ["rank00000.json", "rank00000.swap"]
    assert os.stat(opt.swap_path).st_size == 2 * opt.slot_bytes
    assert oct(os.stat(tmp_path).st_mode & 0o777) == "0o700"
    with pytest.raises(ConfigError, match="in use by a running process"):
        OffloadedOptimizer(make_model().parameters(), dir=tmp_path, **SMALL)
    opt.close()
    opt.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ConfigError, match="closed"):
        opt.step()


HOLDER = """
import sys, time, torch
from lcache.offload import OffloadedOptimizer
opt = OffloadedOptimizer([torch.zeros(5000, requires_grad=True)], dir=sys.argv[1],
                         host_budget="1MB")
print("ready", flush=True)
time.sleep(60)
"""


def test_a_killed_runs_swap_file_is_found_and_reused(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with pytest.raises(ConfigError, match="in use"):  # alive: its lock is held
            OffloadedOptimizer([torch.zeros(10, requires_grad=True)], dir=tmp_path, **SMALL)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert sorted(os.listdir(tmp_path)) == ["rank00000.json", "rank00000.swap"]  # left over
    model = make_model()
    with OffloadedOptimizer(model.parameters(), dir=tmp_path, **SMALL) as opt:
        assert opt._swap.reused
        assert sorted(os.listdir(tmp_path)) == ["rank00000.json", "rank00000.swap"]
        train(model, opt, range(2))
    assert os.listdir(tmp_path) == []


RANK_HOLDER = """
import sys, time
from lcache.offload.swap import SwapFile
swap = SwapFile(sys.argv[1], int(sys.argv[2]), 1 << 20, {}, direct=False)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_killed_runs_other_ranks_swap_files_are_removed_but_not_a_live_ranks(
        tmp_path: Path) -> None:
    # ranks 1 and 2 of a run; rank 1 is killed, then a one-rank run starts in the directory
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_HOLDER, str(tmp_path), str(r)],
                              stdout=subprocess.PIPE, text=True, env=subprocess_env())
             for r in (1, 2)]
    try:
        for child in ranks:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        ranks[0].send_signal(signal.SIGKILL)
        ranks[0].wait()
        # named like swap files, but not ours to remove: no manifest, another format's, another
        # rank's, a symbolic link, another host's
        (tmp_path / "rank00003.swap").write_bytes(b"x")
        (tmp_path / "rank00004.swap").write_bytes(b"x")
        (tmp_path / "rank00004.json").write_text('{"format": "other", "rank": 4}')
        (tmp_path / "rank00005.swap").write_bytes(b"x")
        (tmp_path / "rank00005.json").write_text('{"format": "lcache-offload-swap", "rank": 6}')
        (tmp_path / "rank00006.swap").symlink_to(tmp_path / "rank00003.swap")
        (tmp_path / "rank00008.swap").write_bytes(b"x")  # another node's, on a shared disk
        (tmp_path / "rank00008.json").write_text(
            '{"format": "lcache-offload-swap", "rank": 8, "host": "another-node"}')
        (tmp_path / "rank00007.json.tmp1").write_bytes(b"x")
        (tmp_path / "rank00001.json.tmp1").write_bytes(b"x")  # the killed rank's half-written
        planted = sorted(n for n in os.listdir(tmp_path) if not n.startswith("rank00001"))
        assert len(planted) == 11
        model = make_model()
        with OffloadedOptimizer(model.parameters(), dir=tmp_path, **SMALL) as opt:
            # the killed rank's files are gone; the live rank's stay, and it still holds them
            assert sorted(os.listdir(tmp_path)) == sorted(
                [*planted, "rank00000.json", "rank00000.swap"])
            train(model, opt, range(1))
    finally:
        ranks[1].send_signal(signal.SIGKILL)
        ranks[1].wait()
    with OffloadedOptimizer(make_model().parameters(), dir=tmp_path, **SMALL):
        pass
    assert sorted(os.listdir(tmp_path)) == [n for n in planted if not n.startswith("rank00002")]


STARTS = """
import os, sys
from lcache.io import close_file
from lcache.offload.swap import SwapFile
for _ in range(40):
    swap = SwapFile(sys.argv[1], int(sys.argv[2]), 4096, {}, direct=False, preallocate=False)
    assert os.path.samestat(os.fstat(swap.fd), os.stat(swap.path))
    close_file(swap.fd)  # as if killed: the lock goes, the files stay for others to remove
    swap.fd = -1
print("ok", flush=True)
"""


def test_ranks_starting_at_once_among_killed_files_never_take_each_other_for_dead(
        tmp_path: Path) -> None:
    # each start removes the others' dead files while they reuse or recreate them: none may
    # be refused as "in use", or lose the file it holds
    ranks = [subprocess.Popen([sys.executable, "-c", STARTS, str(tmp_path), str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=subprocess_env())
             for r in range(4)]
    outs = [child.communicate(timeout=120)[0] for child in ranks]
    assert all(out.strip().endswith("ok") for out in outs), outs


def test_offload_io_is_traced_under_its_own_classes(tmp_path: Path) -> None:
    seen: list[str] = []
    previous = set_tracer(lambda ev: seen.append(ev.io_class))
    try:
        model = make_model()
        with OffloadedOptimizer(model.parameters(), dir=tmp_path, **SMALL) as opt:
            train(model, opt, range(1))
    finally:
        set_tracer(previous)
    assert {"offload-read", "offload-write"} <= set(seen)


@pytest.mark.root
def fail_for_room_then_retry(model: torch.nn.Module, opt: OffloadedOptimizer,
                             small: Path) -> None:
    """With room for half a step, a step raises DiskFullError and leaves the parameters as
    they were; the same step, retried once there is room, goes through."""
    filler = small / "filler"
    free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
    filler.write_bytes(b"x" * (free - opt.slot_bytes // 2))
    loss_of(model, batch(0)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DiskFullError):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    filler.unlink()
    opt.step()
    opt.zero_grad()


def test_disk_full_mid_step_leaves_params_and_swap_as_before_and_the_step_retries(
        tmp_path: Path) -> None:
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with mounted_tmpfs(tmp_path / "small", "1m") as small:
        # not preallocated, so the second slot's blocks are allocated by the first step
        opt = OffloadedOptimizer(model.parameters(), lr=1e-2, dir=small, preallocate=False,
                                 **SMALL)
        fail_for_room_then_retry(model, opt, small)
        train(ref_model, ref, range(1))
        assert same(ref_model, model)  # the retried step: the same bits as one clean step
        train(ref_model, ref, range(1, 4))
        train(model, opt, range(1, 4))
        assert same(ref_model, model)
        opt.close()


def test_a_failed_step_after_weights_were_loaded_keeps_the_loaded_weights(
        tmp_path: Path) -> None:
    ref_model, model = make_model(seed=1), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with mounted_tmpfs(tmp_path / "small", "1m") as small:
        opt = OffloadedOptimizer(model.parameters(), lr=1e-2, dir=small, preallocate=False,
                                 **SMALL)
        model.load_state_dict(make_model(seed=1).state_dict())  # after the optimizer
        fail_for_room_then_retry(model, opt, small)  # the failed step keeps the loaded weights
        train(ref_model, ref, range(1))
        assert same(ref_model, model)
        opt.close()


@pytest.mark.root
def test_a_swap_file_that_does_not_fit_is_refused_up_front(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "small", "256k") as small:
        with pytest.raises(DiskFullError, match=r"needs .* bytes") as info:
            OffloadedOptimizer(make_model().parameters(), dir=small, **SMALL)
        assert "free space" in str(info.value)
        assert os.listdir(small) == []


def bytes_of_one_step(layer: torch.nn.Module, root: Path) -> tuple[int, int]:
    with OffloadedOptimizer(layer.parameters(), dir=root, host_budget="64MB",
                            direct=False) as opt:
        x = torch.ones(2, 1024, dtype=layer.weight.dtype)
        layer(x).float().sum().backward()
        opt.step()  # the first update reads what the construction wrote
        r0, w0 = opt.read_bytes + opt.reused_bytes, opt.write_bytes
        layer(x).float().sum().backward()
        opt.step()  # its one sub-group is still in a buffer: reused, not read
        assert opt.reused_bytes > 0
        return opt.read_bytes + opt.reused_bytes - r0, opt.write_bytes - w0


def test_bytes_per_step_are_what_lcache_model_predicts(tmp_path: Path) -> None:
    from lcache.model import config_from_preset, predict

    pred = predict(config_from_preset("llama3-8b", gpus=8, optimizer_offload=True))
    demand = pred.classes["optimizer-offload"]
    per_param = demand.read_bytes_per_event / pred.params  # 12: fp32 master, m and v
    assert demand.write_bytes_per_event == demand.read_bytes_per_event
    # the model's case, bf16 weights: the same per parameter, but for the padding of one
    # block to 4 KiB
    layer = torch.nn.Linear(1024, 1024).to(torch.bfloat16)
    n = sum(p.numel() for p in layer.parameters())
    read, written = bytes_of_one_step(layer, tmp_path / "bf16")
    assert per_param * n <= read == written <= per_param * n + 4096
    # fp32 weights are their own master copy: it is written (a failed step's rollback,
    # checkpoints) but not read
    read, written = bytes_of_one_step(torch.nn.Linear(1024, 1024), tmp_path / "fp32")
    assert read == written - 4 * n == 8 * n


#: what the activations example prints; the page gives one run's line, and the bounds of the
#: figures that depend on timing
_ACT_LINE = re.compile(r"spilled (\d+) MiB \((\d+) storages, (\d+) shared\), read back "
                       r"([\d.]+) MiB; at most ([\d.]+) MiB of them in memory at once")
_ACT_BOUNDS = re.compile(r"reads back between (\d+) and (\d+) MiB.*?holds at most ([\d.]+) MiB",
                         re.DOTALL)


@pytest.mark.parametrize("code", doc_blocks("docs/offload.md"))
def test_docs_example_runs(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    printed = run_doc_python("docs/offload.md", code, tmp_path, monkeypatch)
    if CHECKS_ITSELF.search(code):
        return
    # The activations example: the spilled figures are the page's; bytes read back and the
    # peak held depend on timing (a spill still being written when backward needs it is not
    # read), so the page gives bounds, which hold here and for its own line. It said "read back
    # 17 MiB; at most 1.5 MiB", and 4 runs printed 16 MiB and 2.0-3.0 MiB (attack helper 87).
    page = (Path(__file__).parent.parent / "docs/offload.md").read_text()
    shown, got = _ACT_LINE.search(" ".join(page.split())), _ACT_LINE.search(printed)
    bounds = _ACT_BOUNDS.search(page)
    assert shown and got and bounds, printed
    low, high, peak = int(bounds[1]), int(bounds[2]), float(bounds[3])
    for line in (shown, got):
        assert line.groups()[:3] == ("17", "34", "0"), printed
        assert low <= float(line[4]) <= high and float(line[5]) <= peak, printed
    # unread: at most write_behind (4) spills of 0.5 MiB per backward pass (2); held: at most
    # write_behind + read_ahead (2) + 2 spills
    assert (low, high, peak) == (17 - 2 * 4 * 0.5, 17, (4 + 2 + 2) * 0.5)


def test_a_missing_directory_or_a_class_that_is_no_optimizer_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    params = [torch.zeros(10, requires_grad=True)]
    for bad in (None, ""):  # "" would have put the swap file in the current directory
        with pytest.raises(ConfigError, match="dir="):
            OffloadedOptimizer(params, dir=bad)
    with pytest.raises(ConfigError, match="torch optimizer class"):
        OffloadedOptimizer(params, int, dir=tmp_path / "swap")
    assert os.listdir(tmp_path) == []


def test_bad_arguments_are_config_errors_and_a_weight_decay_of_inf_is_refused(
        tmp_path: Path) -> None:
    """params=None was a bare TypeError, dir='/proc' a bare FileNotFoundError;
    optimizer_class '' / 0 / [] ran AdamW; weight_decay=inf or lr=inf, which torch takes,
    turned the weights to inf and NaN without a word (attack helper 47). eps=inf, which
    torch takes and which keeps the weights finite, is taken too."""
    params = [torch.zeros(10, requires_grad=True)]
    with pytest.raises(ConfigError, match="params=None: give an iterable"):
        OffloadedOptimizer(None, dir=tmp_path / "a")  # type: ignore[arg-type]
    for bad in ("", 0, []):
        with pytest.raises(ConfigError, match=re.escape(f"optimizer_class={bad!r}: give a torch")):
            OffloadedOptimizer(params, bad, dir=tmp_path / "a")
    with pytest.raises(StorePermissionError, match="/proc"):
        OffloadedOptimizer(params, dir="/proc")
    for option in ("weight_decay", "lr"):
        with pytest.raises(ConfigError, match=f"'{option}': inf.*inf or NaN"):
            OffloadedOptimizer(params, dir=tmp_path / "a", **{option: float("inf")})
    OffloadedOptimizer(params, dir=tmp_path / "a", eps=float("inf")).close()
    # finite options that overflow the weights are not told to be finite (helper 64)
    with pytest.raises(ConfigError, match="the options are finite, but the weights overflow"):
        OffloadedOptimizer(params, dir=tmp_path / "a", lr=1e30)
    # "no" is truthy: it turned on what it meant to turn off (helper 104)
    for option in ("direct", "preallocate"):
        with pytest.raises(ConfigError, match=f"{option}='no': give True or False"):
            OffloadedOptimizer(params, dir=tmp_path / "a", **{option: "no"})


@pytest.mark.parametrize(("make", "word"), [
    (lambda: torch.randn(4, 6).t(), "not contiguous"),
    (lambda: torch.empty(10, device="meta"), "no dense storage"),
    (lambda: torch.randn(10).to_sparse(), "no dense storage"),
], ids=["transposed", "meta", "sparse"])
def test_parameters_the_swap_cannot_hold_are_refused_up_front(
        tmp_path: Path, make: Any, word: str) -> None:
    """They were RuntimeErrors in the middle of the first step."""
    with pytest.raises(ConfigError, match=word):
        OffloadedOptimizer([torch.nn.Parameter(make())], dir=tmp_path, **SMALL)


def test_a_parameter_replaced_by_one_of_another_size_is_refused_at_the_step(
        tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.randn(4, 6))
    with OffloadedOptimizer([param], dir=tmp_path, **SMALL) as opt:
        param.data = torch.randn(5)
        param.grad = torch.ones(5)
        with pytest.raises(ConfigError, match="now has 5 elements, not the 24"):
            opt.step()


def test_a_swap_file_cut_short_is_an_error_not_other_bytes(tmp_path: Path) -> None:
    """Regression: a short read of the swap file was ignored, and the buffer's old bytes (of
    another sub-group) became parameters and moments."""
    from lcache.errors import CorruptionError

    p = torch.nn.Parameter(torch.randn(1 << 20, dtype=torch.bfloat16))
    with OffloadedOptimizer([p], dir=tmp_path, host_budget="4MB", lr=0.0,
                            weight_decay=0.0) as opt:
        p.grad = torch.ones_like(p)
        opt.step()
        os.truncate(opt.swap_path, 4096)
        p.grad = torch.ones_like(p)
        with pytest.raises(CorruptionError, match="swap file was cut short"):
            opt.step()
        with pytest.raises(CorruptionError, match="swap file was cut short"):
            opt.state_dict()


def test_parameters_the_swap_would_train_otherwise_are_refused(tmp_path: Path) -> None:
    """The findings: float64 parameters trained at fp32 precision; two Parameters over one
    storage drifted from torch from step 1; groups all empty made close() wait forever after
    a state_dict(); a sparse gradient was a bare RuntimeError."""
    base = torch.nn.Parameter(torch.randn(10, 20))
    view = torch.nn.Parameter(base.data.view(20, 10))
    for params, why in [([torch.nn.Parameter(torch.randn(4, dtype=torch.float64))], "float64"),
                        ([{"params": []}], "no parameters"),
                        ([base, view], "share memory")]:
        with pytest.raises(ConfigError, match=why):
            OffloadedOptimizer(params, lr=1e-2, dir=tmp_path, **SMALL)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    with OffloadedOptimizer(emb.parameters(), lr=1e-2, dir=tmp_path, **SMALL) as opt:
        emb(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(ConfigError, match=r"sparse gradient.*SparseAdam"):
            opt.step()


def test_a_group_of_one_bare_tensor_is_one_parameter(tmp_path: Path) -> None:
    """The finding: {"params": tensor}, which torch takes, was split into its rows."""
    ref_w = torch.nn.Parameter(torch.randn(6, 5))
    w = torch.nn.Parameter(ref_w.detach().clone())
    ref = torch.optim.AdamW([{"params": ref_w}], lr=1e-2, fused=True)
    with OffloadedOptimizer([{"params": w}], lr=1e-2, dir=tmp_path, **SMALL) as opt:
        for o, p in ((ref, ref_w), (opt, w)):
            for _ in range(3):
                (p * p).sum().backward()
                o.step()
                o.zero_grad()
        assert len(opt.names) == 1
    assert torch.equal(ref_w, w)


def test_a_state_of_groups_in_another_order_is_refused(tmp_path: Path) -> None:
    """The finding: groups [decay, no_decay] loaded into [no_decay, decay] swapped their
    options (weights got weight_decay 0 and the biases 0.1), where torch refuses."""
    model = make_model()
    decay = [(n, p) for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [(n, p) for n, p in model.named_parameters() if not n.endswith("weight")]
    with OffloadedOptimizer([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-2,
                            dir=tmp_path / "a", **SMALL) as opt:
        train(model, opt, range(2))
        saved = opt.state_dict()
    with OffloadedOptimizer([{"params": no_decay, "weight_decay": 0.0},
                             {"params": decay, "weight_decay": 0.1}], lr=1e-2,
                            dir=tmp_path / "b", **SMALL) as other:
        with pytest.raises(ConfigError, match="param group 0 of the checkpoint holds other"):
            other.load_state_dict(saved)
        assert other.param_groups[0]["weight_decay"] == 0.0
