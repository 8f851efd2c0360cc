"""An offloaded optimizer's state through lcache.checkpoint: streamed, bit-exact on resume,
after kill -9 too, within its memory budget (issue 12, 4-5 and "Bad input and faults")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lcache import checkpoint
from lcache.errors import ConfigError, CorruptionError
from lcache.io import IOEvent, set_tracer
from lcache.offload import OffloadedOptimizer
from tests._offload_model import SMALL, make_model, one_thread, same, train  # noqa: F401
from tests.conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[1]




def reference(steps: int) -> torch.nn.Module:
    model = make_model()
    train(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), range(steps))
    return model


def test_async_save_while_training_then_resume_is_bit_exact(tmp_path: Path) -> None:
    model = make_model()
    opt = OffloadedOptimizer(model.named_parameters(), lr=1e-2, dir=tmp_path / "swap", **SMALL)
    train(model, opt, range(5))
    slow = threading.Event()

    def slow_save(event: IOEvent) -> None:  # the save's first swap read lasts 0.5 s
        if threading.current_thread().name.startswith("lcache-ckpt") and not slow.is_set():
            slow.set()
            time.sleep(0.5)

    previous = set_tracer(slow_save)
    try:
        handle = checkpoint.async_save({"model": model.state_dict(), "optimizer": opt,
                                        "step": 5}, tmp_path / "ckpt" / "step-5")
        train(model, opt, range(5, 8))  # step 7 waits until the save has read step 5's slots
        handle.wait()
    finally:
        set_tracer(previous)
    assert slow.is_set()
    opt.close()
    assert checkpoint.verify(tmp_path / "ckpt" / "step-5").ok
    plain = checkpoint.load(tmp_path / "ckpt" / "step-5")  # readable without an optimizer
    assert plain["optimizer"]["state"]["head.weight"]["exp_avg"].shape == (97, 32)

    # another budget, so other sub-groups: the state is keyed by parameter name
    fresh = make_model(seed=7)
    again = OffloadedOptimizer(fresh.named_parameters(), lr=0.5, dir=tmp_path / "swap",
                               host_budget="4MB", direct=False)
    state = checkpoint.load(tmp_path / "ckpt" / "step-5",
                            like={"model": fresh.state_dict(), "optimizer": again, "step": 0})
    assert state["optimizer"] is again and state["step"] == 5
    assert again.param_groups[0]["lr"] == 1e-2
    fresh.load_state_dict(state["model"])
    train(fresh, again, range(5, 12))
    assert same(fresh, reference(12))
    again.close()


def test_a_damaged_checkpoint_leaves_the_optimizer_as_it_was(tmp_path: Path) -> None:
    model = make_model()
    with OffloadedOptimizer(model.named_parameters(), lr=1e-2, dir=tmp_path / "swap",
                            **SMALL) as opt:
        train(model, opt, range(3))
        path = checkpoint.save({"optimizer": opt}, tmp_path / "ckpt" / "step-3")
        train(model, opt, range(3, 5))
        data = Path(path) / "rank00000.data"
        arrays = checkpoint.read_manifest(path)["shards"][0]["arrays"]
        last = arrays[-1]  # a streamed one: they lie last
        assert last["key"].endswith("exp_avg_sq")
        raw = bytearray(data.read_bytes())
        raw[last["offset"] + last["nbytes"] - 1] ^= 0xFF
        data.write_bytes(bytes(raw))
        with pytest.raises(CorruptionError, match="checksum mismatch"):
            checkpoint.load(path, like={"optimizer": opt})
        with pytest.raises(ConfigError, match="into=True"):
            checkpoint.load(path, like={"optimizer": opt}, into=True)
        train(model, opt, range(5, 8))  # nothing of the damaged state was taken
        assert same(model, reference(8))


def test_a_state_for_other_parameters_is_refused(tmp_path: Path) -> None:
    model = make_model()
    with OffloadedOptimizer(model.named_parameters(), dir=tmp_path / "a", **SMALL) as opt:
        train(model, opt, range(1))
        path = checkpoint.save({"optimizer": opt}, tmp_path / "ckpt" / "step-1")
    other = torch.nn.Linear(4, 4)
    with OffloadedOptimizer(other.named_parameters(), dir=tmp_path / "b", **SMALL) as opt, \
            pytest.raises(ConfigError, match="other parameters"):
        checkpoint.load(path, like={"optimizer": opt})


def test_a_state_of_another_shape_or_options_is_a_mismatch_not_damage(tmp_path: Path) -> None:
    """The finding: a sound checkpoint of Linear(16, 8) loaded into Linear(16, 9), or one
    saved without amsgrad into an amsgrad optimizer, was a CorruptionError blaming the file
    (which verify() finds sound) without the saved size."""
    small = torch.nn.Linear(16, 8)
    with OffloadedOptimizer(small.named_parameters(), dir=tmp_path / "a", lr=0.01) as opt:
        small(torch.ones(2, 16)).sum().backward()
        opt.step()
        path = checkpoint.save({"optimizer": opt}, tmp_path / "ckpt")
    wider = torch.nn.Linear(16, 9)
    with OffloadedOptimizer(wider.named_parameters(), dir=tmp_path / "b", lr=0.01) as opt, \
            pytest.raises(checkpoint.StateMismatchError, match=r"'weight'/master holds 128 "
                          r"elements; this optimizer's 'weight' has 144"):
        checkpoint.load(path, like={"optimizer": opt})
    same_shape = torch.nn.Linear(16, 8)
    with OffloadedOptimizer(same_shape.named_parameters(), dir=tmp_path / "c", lr=0.01,
                            amsgrad=True) as opt, \
            pytest.raises(checkpoint.StateMismatchError, match="has no max_exp_avg_sq"):
        checkpoint.load(path, like={"optimizer": opt})
    assert checkpoint.verify(path).ok


def test_kill_9_mid_step_then_resume_from_the_last_checkpoint_is_bit_exact(
        tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-m", "tests._offload_train", str(tmp_path),
                              "12"], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env=subprocess_env())
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "mid-step"  # writing step 12's state
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert sorted(os.listdir(tmp_path / "swap")) == ["rank00000.json", "rank00000.swap"]
    last = checkpoint.latest(tmp_path / "ckpt")
    assert last is not None and last.endswith("step-0010")

    model = make_model(seed=3)
    with OffloadedOptimizer(model.named_parameters(), lr=1e-2, dir=tmp_path / "swap",
                            **SMALL) as opt:  # finds and reuses the killed run's file
        state = checkpoint.load(last, like={"model": model.state_dict(), "optimizer": opt,
                                            "step": 0})
        model.load_state_dict(state["model"])
        train(model, opt, range(state["step"], 20))
    assert same(model, reference(20))
    assert os.listdir(tmp_path / "swap") == []


# What the optimizer may add to the peak RSS besides host_budget: the states the optimizer
# makes on a first update, for one sub-group (4 MiB here), the save's 8 MiB chunk buffer,
# the load's 4 MiB chunk (measured 3-4 MiB in all). AdamW in memory would add 64 MiB.
RSS_CONSTANT = 16 << 20


def test_peak_rss_stays_under_the_budget_plus_a_constant(tmp_path: Path) -> None:
    # A fixed mmap threshold: glibc's moving one (raised by the first large free) keeps the
    # gradients that backward frees and makes again in the heap, and peak RSS then wandered
    # 10-30 MiB from run to run with the training loop's allocations, not the optimizer's.
    env = {**subprocess_env(), "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
    done = subprocess.run([sys.executable, "-m", "tests._offload_rss", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["state_bytes"] >= 3 * got["budget"]
    assert got["peak"] - got["baseline"] <= got["budget"] + RSS_CONSTANT, got


def test_loading_an_earlier_checkpoint_into_the_trained_optimizer_rewinds_it(
        tmp_path: Path) -> None:
    model = make_model()
    with OffloadedOptimizer(model.named_parameters(), lr=1e-2, dir=tmp_path / "swap",
                            **SMALL) as opt:
        train(model, opt, range(3))
        path = checkpoint.save({"model": model.state_dict(), "optimizer": opt},
                               tmp_path / "ckpt" / "step-3")
        train(model, opt, range(3, 6))  # its last blocks are in the buffers: now stale
        state = checkpoint.load(path, like={"model": model.state_dict(), "optimizer": opt})
        model.load_state_dict(state["model"])
        train(model, opt, range(3, 8))
    assert same(model, reference(8))


def test_a_failed_save_does_not_leave_the_next_step_waiting(tmp_path: Path) -> None:
    """A save pins the slots it reads; one that fails before streaming a byte (an option
    that cannot be saved) must unpin them, or the next step waits for it forever."""
    model = make_model()
    with OffloadedOptimizer(model.named_parameters(), lr=1e-2, dir=tmp_path / "swap",
                            **SMALL) as opt:
        train(model, opt, range(1))
        opt.param_groups[0]["callback"] = object()
        with pytest.raises(checkpoint.UnsupportedValueError, match="callback"):
            checkpoint.save({"optimizer": opt}, tmp_path / "ckpt")
        del opt.param_groups[0]["callback"]
        stepper = threading.Thread(target=train, args=(model, opt, range(1, 3)), daemon=True)
        stepper.start()
        stepper.join(60)
        assert not stepper.is_alive(), "the step waits for a save that failed"


@pytest.mark.parametrize("tamper", ["step is text", "step missing", "betas of one",
                                    "lr is text"])
def test_a_tampered_state_is_refused_at_load_and_changes_nothing(
        tmp_path: Path, tamper: str) -> None:
    """Not a bare TypeError or KeyError in the middle of the next step, nor moments silently
    started again (a state without its ``step``)."""
    model = make_model()
    with OffloadedOptimizer(model.named_parameters(), lr=1e-2, dir=tmp_path, **SMALL) as opt:
        train(model, opt, range(3))
        saved = opt.state_dict()
        entry, group = saved["state"]["head.weight"], saved["param_groups"][0]
        if tamper == "step is text":
            entry["step"] = "abc"
        elif tamper == "step missing":
            del entry["step"]
        elif tamper == "betas of one":
            group["betas"] = (0.5,)
        else:
            group["lr"] = "fast"
        with pytest.raises(CorruptionError, match=r"step|betas|lr"):
            opt.load_state_dict(saved)
        train(model, opt, range(3, 6))
    assert same(model, reference(6))


@pytest.mark.parametrize("how", ["close", "drop"])
def test_an_optimizer_closed_or_dropped_while_a_save_streams_it_is_saved_whole(
        tmp_path: Path, how: str) -> None:
    """close() closed the swap under a streaming async_save (EBADF, or another file's bytes
    published once its descriptor number was reused); an optimizer collected when the function
    that made it returned its save's handle lost the checkpoint the same way."""
    import gc

    model = make_model()
    opt = OffloadedOptimizer(model.named_parameters(), lr=1e-2, dir=tmp_path / "swap", **SMALL)
    train(model, opt, range(3))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    slow = threading.Event()

    def slow_save(event: IOEvent) -> None:  # the save's first swap read lasts 0.5 s
        if threading.current_thread().name.startswith("lcache-ckpt") and not slow.is_set():
            slow.set()
            time.sleep(0.5)

    previous = set_tracer(slow_save)
    try:
        handle = checkpoint.async_save({"optimizer": opt}, tmp_path / "ckpt" / "step-3")
        if how == "close":
            opt.close()  # waits for the save
        del opt
        gc.collect()
        handle.wait()
    finally:
        set_tracer(previous)
    assert slow.is_set()
    saved = checkpoint.load(tmp_path / "ckpt" / "step-3")["optimizer"]["state"]
    for name, w in weights.items():
        assert torch.equal(saved[name]["master"].view(w.shape), w), name
    del handle
    gc.collect()
    assert list((tmp_path / "swap").iterdir()) == []


def test_a_closed_optimizer_and_zero_size_parameters(tmp_path: Path) -> None:
    """state_dict(), saves and loads of a closed optimizer were EBADF; a parameter of no
    elements made a checkpoint's weight check a bare ValueError."""
    empty = torch.nn.Parameter(torch.zeros(0))
    model = make_model()
    opt = OffloadedOptimizer([("empty", empty), *model.named_parameters()], lr=1e-2,
                             dir=tmp_path / "swap", **SMALL)
    empty.grad = torch.zeros(0)
    train(model, opt, range(2))
    saved = opt.state_dict()
    assert saved["state"]["empty"]["master"].numel() == 0
    checkpoint.save({"optimizer": opt}, tmp_path / "ckpt")
    opt.close()
    for call in (opt.state_dict, lambda: opt.load_state_dict(saved),
                 lambda: checkpoint.save({"optimizer": opt}, tmp_path / "again"),
                 opt.step):
        with pytest.raises(ConfigError, match="closed"):
            call()


def test_bf16_resume_as_the_docs_show_is_bit_exact(tmp_path: Path) -> None:
    """The finding: loading the model's weights after the optimizer (docs/offload.md's
    resume) bumped their version counters, and the next step took the bf16 weights for the
    fp32 masters: 1,004 of 4,096 weights off after 3 more steps."""
    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(64, 64).bfloat16()

    def run(model: torch.nn.Module, opt: OffloadedOptimizer, steps: range) -> None:
        for s in steps:
            torch.manual_seed(1000 + s)
            model(torch.randn(8, 64).bfloat16()).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    whole = fresh()
    with OffloadedOptimizer(whole.named_parameters(), lr=1e-3, dir=tmp_path / "a",
                            **SMALL) as opt:
        run(whole, opt, range(6))
    first = fresh()
    with OffloadedOptimizer(first.named_parameters(), lr=1e-3, dir=tmp_path / "b",
                            **SMALL) as opt:
        run(first, opt, range(3))
        checkpoint.save({"model": first.state_dict(), "optimizer": opt}, tmp_path / "ck")
    resumed = fresh()
    with OffloadedOptimizer(resumed.named_parameters(), lr=1e-3, dir=tmp_path / "c",
                            **SMALL) as opt:
        state = checkpoint.load(tmp_path / "ck",
                                like={"model": resumed.state_dict(), "optimizer": opt})
        resumed.load_state_dict(state["model"])
        run(resumed, opt, range(3, 6))
    assert same(whole, resumed)


def test_an_optimizer_in_a_tuple_is_restored_and_one_with_no_place_is_refused(
        tmp_path: Path) -> None:
    """The finding: ``like=(weights, opt)`` (or a list for a saved tuple) left the optimizer
    fresh and returned a plain dict in its place, without a word."""
    from lcache.checkpoint import StateMismatchError

    model = make_model()
    with OffloadedOptimizer(model.named_parameters(), lr=1e-2, dir=tmp_path / "a",
                            **SMALL) as opt:
        train(model, opt, range(3))
        checkpoint.save((model.state_dict(), opt), tmp_path / "ck")
    for shape in (tuple, list):
        fresh = make_model(seed=7)
        with OffloadedOptimizer(fresh.named_parameters(), lr=1e-2, dir=tmp_path / "b",
                                **SMALL) as again:
            state = checkpoint.load(tmp_path / "ck", like=shape((fresh.state_dict(), again)))
            assert state[1] is again and isinstance(state, tuple)
            fresh.load_state_dict(state[0])
            train(fresh, again, range(3, 6))
        assert same(fresh, reference(6))
    with OffloadedOptimizer(make_model().named_parameters(), lr=1e-2, dir=tmp_path / "c",
                            **SMALL) as other, \
            pytest.raises(StateMismatchError, match="at /x, where the checkpoint holds none"):
        checkpoint.load(tmp_path / "ck", like={"x": other})


def test_a_damaged_group_option_leaves_the_optimizer_as_it_was(tmp_path: Path) -> None:
    """The finding: a checkpoint damaged only in a tensor lr (as fused AdamW takes it) was
    found damaged after its slots and scalars were committed: the optimizer was left with
    the checkpoint's moments and step and its own parameters."""
    model = make_model()
    with OffloadedOptimizer(model.named_parameters(), lr=torch.tensor(1e-2),
                            dir=tmp_path / "swap", **SMALL) as opt:
        train(model, opt, range(3))
        path = Path(checkpoint.save({"optimizer": opt}, tmp_path / "ckpt" / "step-3"))
        train(model, opt, range(3, 6))
        before = opt.state_dict()
        manifest = json.loads((path / "manifest.json").read_text())
        shard = manifest["body"]["shards"][0]
        lr = next(a for a in shard["arrays"] if a["key"].endswith("param_groups/0/lr"))
        with open(path / shard["file"], "r+b") as f:
            f.seek(lr["offset"])
            byte = f.read(1)
            f.seek(lr["offset"])
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(CorruptionError, match="param_groups/0/lr"):
            checkpoint.load(path, like={"optimizer": opt})
        after = opt.state_dict()
        for name, entry in before["state"].items():
            for key, value in entry.items():
                assert torch.equal(torch.as_tensor(after["state"][name][key]),
                                   torch.as_tensor(value)), (name, key)
