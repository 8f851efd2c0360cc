"""Activation offload (issue 12, 6): saved tensors spill to a file and come back for backward,
with gradients bit-identical to a run without offload."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional
StorageWeakRef = pytest.importorskip("torch.multiprocessing.reductions").StorageWeakRef

from lcache.errors import ConfigError, DiskFullError, LCacheError, StorePermissionError  # noqa: E402
from lcache.io import IOEvent, set_tracer  # noqa: E402
from lcache.offload.activations import (  # noqa: E402
    ActivationOffloadError,
    activations,
)

from .conftest import mounted_tmpfs  # noqa: E402


def spill_fds() -> list[str]:
    """Descriptors of this process still open on a spill file."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "lcache-act-" in target:
            found.append(target)
    return found


@pytest.fixture(autouse=True)
def nothing_left_open() -> Iterator[None]:
    yield
    assert spill_fds() == []


def grads_of(model: Any, run: Callable[[Any], Any]) -> list[Any]:
    model = copy.deepcopy(model)
    run(model).backward()
    return [p.grad for p in model.parameters()]


def assert_same_grads(model: Any, run: Callable[[Any], Any], where: Path, **kw: Any) -> Any:
    """Backward with and without offload; the gradients are bit-identical. The stats."""
    plain = grads_of(model, run)
    with activations(where, **kw) as act:
        spilled = grads_of(model, run)
    assert len(plain) == len(spilled)
    for a, b in zip(plain, spilled, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert os.listdir(where) == []
    return act.stats


def mlp(width: int, depth: int, dtype: Any = torch.float32) -> Any:
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())]
    return nn.Sequential(*layers, nn.Linear(width, 3)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_gradients_are_bit_identical(tmp_path: Path, dtype: Any) -> None:
    model = mlp(128, 6, dtype)
    x = torch.randn(64, 128, dtype=dtype)
    stats = assert_same_grads(model, lambda m: m(x).square().sum(), tmp_path / "act",
                              min_bytes=4096)
    assert stats.tensors_spilled >= 12 and stats.bytes_read > 0
    assert stats.held_bytes == 0 and 0 < stats.peak_held_bytes < stats.bytes_spilled


class Block(nn.Module):  # type: ignore[misc]
    """A pre-norm transformer block: causal attention from one qkv projection, SwiGLU MLP."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.w1, self.w3 = nn.Linear(dim, 4 * dim), nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Any) -> Any:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)  # three views of one storage
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.out(att.transpose(1, 2).reshape(b, t, d))
        h = self.ln2(x)  # saved by w1 and by w3: one spill
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def test_transformer_block_gradients_are_bit_identical(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(4, 16, 64)
    stats = assert_same_grads(model, lambda m: m(x).pow(2).mean(), tmp_path / "act",
                              min_bytes=1024)
    assert stats.tensors_spilled > 10
    # per block, the attention weights (by softmax and by the matmul, as a view) and h are
    # each saved twice
    assert stats.tensors_deduplicated >= 4


class SaveViews(torch.autograd.Function):  # type: ignore[misc]
    """Saves three views of its input's storage; backward checks they come back as saved."""

    @staticmethod
    def forward(ctx: Any, base: Any) -> Any:
        x = base * 1  # a temporary storage (base is a leaf that requires grad: never spilled)
        views = (x.t(), x[2:, 1:], x[3].expand(5, -1))
        ctx.expected = [(v.clone(), v.stride(), v.storage_offset()) for v in views]
        ctx.save_for_backward(*views)
        return base.sum()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        saved = ctx.saved_tensors  # each access unpacks again: once
        for got, (value, stride, offset) in zip(saved, ctx.expected, strict=True):
            assert torch.equal(got, value)
            assert (got.stride(), got.storage_offset()) == (stride, offset)
        assert len({t.untyped_storage().data_ptr() for t in saved}) == 1
        return torch.ones(8, 6) * grad


class CheckSaved(torch.autograd.Function):  # type: ignore[misc]
    """Passes ``x`` on; saves ``keep`` and checks in backward it comes back as saved: values,
    strides, and its address modulo 64 (kernels may round otherwise on other alignments)."""

    @staticmethod
    def forward(ctx: Any, x: Any, keep: Any) -> Any:
        ctx.expected = (keep.clone(), keep.stride(), keep.data_ptr() % 64)
        ctx.save_for_backward(keep)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        (got,) = ctx.saved_tensors
        value, stride, alignment = ctx.expected
        assert torch.equal(got, value)
        assert (got.stride(), got.data_ptr() % 64) == (stride, alignment)
        return grad, None


def test_views_of_one_storage_are_one_spill_and_come_back_as_the_same_views(
        tmp_path: Path) -> None:
    base = torch.randn(8, 6, requires_grad=True)
    with activations(tmp_path / "act", min_bytes=1) as act:
        SaveViews.apply(base).backward()
    assert act.stats.tensors_spilled == 1 and act.stats.tensors_deduplicated == 2
    assert act.stats.bytes_spilled == 8 * 6 * 4
    assert torch.equal(base.grad, torch.ones(8, 6))


def test_a_batch_sliced_from_a_dataset_in_memory_spills_only_its_bytes(tmp_path: Path) -> None:
    """A small view of a big storage: its own bytes (from a 64-byte boundary) are spilled,
    not the 1 MiB dataset, and come back at the same offset and strides."""
    torch.manual_seed(0)
    data = torch.randn(4096, 64)
    batch = data[101:165, 3:35]  # strided, 12 bytes past a 64-byte boundary
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
    other = data[3000:3016]  # another part of the dataset: a spill of its own

    def run(m: Any) -> Any:
        return CheckSaved.apply(CheckSaved.apply(m(batch), batch), other).sum()

    stats = assert_same_grads(model, run, tmp_path / "act", min_bytes=1024)
    assert stats.tensors_deduplicated >= 1  # Linear saved the batch too
    assert 0 < stats.bytes_spilled < data.nbytes // 16


def test_a_storage_changed_in_place_between_two_saves_is_spilled_again(tmp_path: Path) -> None:
    """Dedup follows the version counter: the second save of x sees its new values."""
    x = torch.full((64, 64), 2.0)
    w1, w2 = torch.ones(64, 64, requires_grad=True), torch.ones(64, 64, requires_grad=True)
    with activations(tmp_path / "act", min_bytes=1024, write_behind=1) as act:
        y1 = x * w1  # saves x at version 0
        y2 = (w1 * 3).sigmoid()  # a second write: with write_behind=1, x's is done
        with torch.no_grad():
            x.add_(1)
        y3 = x * w2  # saves x at version 1
        (y1 + y2 + y3).sum().backward()
    assert act.stats.tensors_spilled == 3 and act.stats.tensors_deduplicated == 0
    assert torch.equal(w2.grad, torch.full((64, 64), 3.0))


def test_a_storage_grown_between_two_saves_is_spilled_again(tmp_path: Path) -> None:
    """UntypedStorage.resize_ keeps the version: the first spill lacks the new bytes."""
    x = torch.full((64, 64), 2.0)
    w1, w2 = torch.ones(64, 64, requires_grad=True), torch.ones(128, 64, requires_grad=True)
    with activations(tmp_path / "act", min_bytes=1024) as act:
        y1 = x * w1
        storage = x.untyped_storage()
        storage.resize_(2 * storage.nbytes())
        torch.empty(0).set_(storage)[64 * 64:] = 3.0
        x2 = x.as_strided((128, 64), (64, 1))  # a view of x: the same version counter
        (y1.sum() + (x2 * w2).sum()).backward()
    assert act.stats.tensors_spilled == 2
    assert torch.equal(w2.grad, torch.cat([torch.full((64, 64), 2.0), torch.full((64, 64), 3.0)]))


def test_parameters_their_views_and_leaves_that_require_grad_stay_in_memory(
        tmp_path: Path) -> None:
    """Linear saves weight.t() (a view of the parameter); a frozen weight is not spilled
    either, nor a leaf the caller made to get its .grad. Only these are big enough here."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    model[1].weight.requires_grad_(False)
    x = torch.randn(2, 256, requires_grad=True)
    leaf = torch.randn(256, 256, requires_grad=True)
    with activations(tmp_path / "act", min_bytes=64 * 1024) as act:
        model(x).sum().backward()
        (leaf * leaf).sum().backward()
    assert act.stats.tensors_spilled == 0 and act.stats.tensors_kept >= 4
    assert torch.equal(leaf.grad, 2 * leaf.detach())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_tensors_that_are_not_plain_memory_stay_as_they_are(tmp_path: Path) -> None:
    """A nested tensor has no strides to restore from (pack raised on it before)."""
    parts = [torch.randn(20, 30), torch.randn(40, 30)]
    nested = torch.nested.nested_tensor(parts, requires_grad=True)
    with activations(tmp_path / "act", min_bytes=1) as act:
        doubled = nested * 2
        (doubled * doubled).to_padded_tensor(0.0).sum().backward()
    assert act.stats.tensors_spilled == 0 and act.stats.tensors_kept >= 2
    for got, part in zip(nested.grad.unbind(), parts, strict=True):
        assert torch.equal(got, 8 * part)


def test_memory_held_is_bounded_and_backward_reads_ahead_in_reverse(tmp_path: Path) -> None:
    """40 layers of 16 KiB activations: at most write_behind + read_ahead + 2 of them are in
    memory at once, each is read once, and backward finds nearly all read ahead."""
    model = mlp(64, 40)
    x = torch.randn(64, 64)
    size = 64 * 64 * 4
    stats = assert_same_grads(model, lambda m: m(x).sum(), tmp_path / "act", min_bytes=size,
                              read_ahead=2, write_behind=2)
    assert stats.bytes_spilled >= 70 * size
    assert stats.peak_held_bytes <= (2 + 2 + 2) * size
    assert stats.bytes_read <= stats.bytes_spilled
    assert stats.reads_on_demand <= 1


def test_the_forward_pass_frees_the_activations_it_spilled(tmp_path: Path) -> None:
    """What the stats count is memory really freed: after the forward pass, the outputs of
    40 layers are gone but for the writes still in flight and the output itself."""
    model = mlp(64, 20)
    outputs = []
    for layer in model:
        layer.register_forward_hook(
            lambda _m, _i, out: outputs.append(StorageWeakRef(out.untyped_storage())))
    with activations(tmp_path / "act", min_bytes=1024, write_behind=2) as act:
        out = model(torch.randn(64, 64))
        alive = sum(not ref.expired() for ref in outputs)
        held = act.stats.held_bytes
        out.sum().backward()
    assert len(outputs) == 41 and alive <= 2 + 1
    assert held <= 2 * 64 * 64 * 4


def test_a_long_run_reuses_the_spill_file(tmp_path: Path) -> None:
    model = mlp(128, 4)
    x = torch.randn(32, 128)
    with activations(tmp_path / "act", min_bytes=1024) as act:
        model(x).sum().backward()
        one_step = act.stats.peak_file_bytes
        for _ in range(3):
            model(x).sum().backward()
    assert 0 < act.stats.peak_file_bytes == one_step


def test_backward_twice_with_retain_graph_reads_again(tmp_path: Path) -> None:
    model = mlp(64, 3)
    x = torch.randn(16, 64)
    expected = grads_of(model, lambda m: m(x).sum() * 2)
    with activations(tmp_path / "act", min_bytes=1024) as act:
        loss = model(x).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    for p, g in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p.grad, g)
    assert act.stats.bytes_read >= act.stats.bytes_spilled


def test_offload_io_is_traced_under_its_own_classes(tmp_path: Path) -> None:
    events: list[IOEvent] = []
    previous = set_tracer(events.append)
    try:
        with activations(tmp_path / "act", min_bytes=1024) as act:
            mlp(64, 3)(torch.randn(16, 64)).sum().backward()
    finally:
        set_tracer(previous)
    writes = [e for e in events if e.io_class == "offload-act-write"]
    reads = [e for e in events if e.io_class == "offload-act-read"]
    assert {e.op for e in writes} == {"write"} and {e.op for e in reads} == {"read"}
    assert sum(e.result for e in writes) == act.stats.bytes_spilled
    assert sum(e.result for e in reads) == act.stats.bytes_read > 0


def test_a_tensor_kept_in_memory_and_changed_in_place_is_refused_as_autograd_does(
        tmp_path: Path) -> None:
    x = torch.randn(4, requires_grad=True)
    with activations(tmp_path / "act", min_bytes="1MiB"):
        y = (x * 2).sigmoid()  # saves its output: small, kept
        y.mul_(3)
        with pytest.raises(ActivationOffloadError, match="modified in place") as err:
            y.sum().backward()
    assert "\n" not in str(err.value)


def test_an_output_kept_in_memory_is_freed_with_its_graph(tmp_path: Path) -> None:
    """sigmoid saves its own output: kept as it is, it would hold its grad_fn, which holds
    it, a cycle only the garbage collector frees."""
    gc.disable()
    try:
        with activations(tmp_path / "act", min_bytes="1MiB"):
            y = torch.randn(1000, requires_grad=True).sigmoid()
            storage = StorageWeakRef(y.untyped_storage())
            del y
            assert storage.expired()
    finally:
        gc.enable()


def test_backward_after_the_block_exited_is_a_clear_error(tmp_path: Path) -> None:
    model = mlp(64, 2)
    with activations(tmp_path / "act", min_bytes=1024):
        loss = model(torch.randn(16, 64)).sum()
    with pytest.raises(ActivationOffloadError, match="inside the block"):
        loss.backward()


def test_an_error_in_forward_closes_the_spill_file(tmp_path: Path) -> None:
    model = mlp(64, 2)
    with pytest.raises(KeyError), activations(tmp_path / "act", min_bytes=1024):
        model(torch.randn(16, 64)).sum()
        raise KeyError("boom")
    assert os.listdir(tmp_path / "act") == []  # and no descriptor left: the autouse fixture


@pytest.mark.parametrize("bad", [-1, 0, 1.5, "lots", True, None])
def test_bad_min_bytes_is_one_line_config_error(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ConfigError, match="min_bytes") as err:
        activations(tmp_path, min_bytes=bad)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kw", [{"read_ahead": -1}, {"write_behind": 0},
                                {"read_ahead": 1.0}, {"write_behind": True}])
def test_bad_depths_are_config_errors(tmp_path: Path, kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kw))):
        activations(tmp_path, **kw)


@pytest.mark.parametrize("bad", [None, "", "/tmp/a\0b"])
def test_a_directory_that_is_no_path_is_a_config_error(bad: Any) -> None:
    """Were a TypeError and a bare ValueError ("embedded null byte") when entered."""
    with pytest.raises(ConfigError, match="dir="):
        activations(bad)


def test_a_directory_that_cannot_be_written_is_one_line_error(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "ro", "1m") as ro:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        with pytest.raises(StorePermissionError, match="choose a directory") as err, \
                activations(ro, min_bytes=1):
            pass
        assert "\n" not in str(err.value)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(LCacheError), activations(tmp_path / "file", min_bytes=1):
        pass


def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory away needs root")
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(other, 12345, 12345)
    with pytest.raises(StorePermissionError, match="uid 12345"), activations(other):
        pass


def test_disk_full_mid_forward_is_disk_full_error_and_leaves_nothing(tmp_path: Path) -> None:
    """A 1 MiB filesystem, 4 MiB of activations: DiskFullError out of the block, the
    directory empty and every byte of the filesystem free again."""
    model = mlp(256, 8)
    x = torch.randn(256, 256)  # 256 KiB per activation
    with mounted_tmpfs(tmp_path / "small", "1m") as small:
        free = os.statvfs(small).f_bfree
        with pytest.raises(DiskFullError, match=r"no space left in .* to spill") as err, \
                activations(small / "act", min_bytes=1024):
            model(x).sum()
            pytest.fail("the forward pass went on")
        assert "\n" not in str(err.value)
        assert os.listdir(small / "act") == []
        assert os.statvfs(small).f_bfree == free
