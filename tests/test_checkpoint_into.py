"""``load(into=True)``: a checkpoint read into the caller's own arrays and tensors, every
destination checked before any byte is written (shapes, dtypes, strides, memory shared
between destinations, read-only memory)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lcache import checkpoint as ck
from lcache.errors import ConfigError, CorruptionError

from .conftest import subprocess_env
from .test_checkpoint import assert_same_state, small_model_state

torch = pytest.importorskip("torch")

def test_load_into_fills_the_callers_tensors(tmp_path: Path) -> None:
    state = small_model_state()
    state["extra"] = {"arr": np.arange(7.0), "scalar": np.int64(9), "strided":
                      torch.arange(24.0).reshape(4, 6).t(), "big": torch.randn(3 << 20)}
    ck.save(state, tmp_path / "c" / "s")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 4))
    sd = model.state_dict()
    like = {"model": sd, "optimizer": state["optimizer"],
            "extra": {"arr": np.zeros(7), "scalar": np.int64(0),
                      "strided": torch.zeros(4, 6).t(), "big": torch.zeros(3 << 20)}}
    weight = model[0].weight
    out = ck.load(tmp_path / "c" / "s", like=like, into=True)
    assert out["model"]["0.weight"] is sd["0.weight"]
    assert torch.equal(weight, state["model"]["0.weight"])  # the model's own parameter
    assert out["extra"]["arr"] is like["extra"]["arr"]
    assert_same_state(state["extra"], out["extra"])
    assert like["extra"]["strided"].equal(state["extra"]["strided"])


def test_load_into_checks_before_writing(tmp_path: Path) -> None:
    ck.save({"a": torch.ones(4), "b": torch.ones(5)}, tmp_path / "c" / "s")
    like = {"a": torch.zeros(4), "b": torch.zeros(6)}
    with pytest.raises(ck.StateMismatchError, match=r"/b: checkpoint has tensor float32\[5\]"):
        ck.load(tmp_path / "c" / "s", like=like, into=True)
    assert not like["a"].any()  # nothing was written
    with pytest.raises(ConfigError, match="into=True"):
        ck.load(tmp_path / "c" / "s", into=True)


@pytest.mark.parametrize(("dest", "why"), [
    (5, r"/a: checkpoint has tensor float32\[4\], like= int"),
    (torch.zeros(1).expand(4), "a: like= holds an array whose elements share memory"),
], ids=["int", "expanded"])
def test_load_into_a_destination_that_cannot_take_the_array_writes_nothing(
        tmp_path: Path, dest: Any, why: str) -> None:
    """Were an AttributeError and a RuntimeError after other keys had been written."""
    ck.save({"a": torch.ones(4), "b": torch.ones(5)}, tmp_path / "c" / "s")
    like = {"b": torch.zeros(5), "a": dest}
    with pytest.raises(ck.StateMismatchError, match=why):
        ck.load(tmp_path / "c" / "s", like=like, into=True)
    assert not like["b"].any()


def test_load_into_arrays_strided_over_themselves_writes_nothing(tmp_path: Path) -> None:
    """The finding: a tensor as_strided over itself, or a writable numpy array with a zero
    stride, took the load and held other values than were saved, reported as a success."""
    ck.save({"t": torch.arange(9.0).view(3, 3), "n": np.arange(4.0)}, tmp_path / "c" / "s")
    over = torch.zeros(5).as_strided((3, 3), (1, 1))
    flat = np.lib.stride_tricks.as_strided(np.zeros(1), (4,), (0,), writeable=True)
    for like in ({"t": over, "n": np.zeros(4)}, {"t": torch.zeros(3, 3), "n": flat}):
        with pytest.raises(ck.StateMismatchError, match="elements share memory"):
            ck.load(tmp_path / "c" / "s", like=like, into=True)
    out = ck.load(tmp_path / "c" / "s", like={"t": torch.zeros(3, 3).t(), "n": np.zeros(4)},
                  into=True)  # a transposed tensor is its own
    assert out["t"].tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


READ_ONLY_LOAD = """
import sys, warnings
import numpy as np, torch
from lcache import checkpoint as ck
root = sys.argv[1]
np.arange(128, dtype=np.float32).tofile(root + "/w.bin")
ro = np.memmap(root + "/w.bin", dtype=np.float32, mode="r")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch: the array is not writable
    w = torch.from_numpy(ro)
ck.save({"a": torch.zeros(64), "w": torch.zeros(64), "v": torch.zeros(32)}, root + "/c/s")
mine = torch.full((64,), 7.0)
try:  # w in place, v (strided) through a staging copy
    ck.load(root + "/c/s", like={"a": mine, "w": w[:64], "v": w[64::2]}, into=True)
except ck.StateMismatchError as exc:
    print(exc)
print(mine.eq(7).all().item(), ro.tolist() == list(range(128)))
"""


def test_load_into_a_tensor_over_read_only_memory_is_refused(tmp_path: Path) -> None:
    """The finding: like= holding torch.from_numpy of np.memmap(mode="r") (a tensor has no
    writeable flag) took the load, and the copy into the read-only page killed the process
    with SIGSEGV. Now refused, as every unfit destination, before anything is written."""
    (tmp_path / "c").mkdir()
    done = subprocess.run([sys.executable, "-c", READ_ONLY_LOAD, str(tmp_path)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    why = ("like= holds a tensor over read-only memory (torch.from_numpy of a read-only "
           "array, such as np.memmap(mode='r')); give a writable one")
    assert sorted(line for line in lines if "read-only memory" in line) == [
        f"  v: {why}", f"  w: {why}"]
    assert lines[-1] == "True True"  # nothing written, the file's values kept
    ck.save({"w": torch.arange(4.0)}, tmp_path / "c" / "t")
    out = ck.load(tmp_path / "c" / "t", like={"w": torch.zeros(4)}, into=True)
    assert out["w"].tolist() == [0, 1, 2, 3]  # writable host memory still loads in place


def test_load_into_two_arrays_sharing_memory_writes_nothing(tmp_path: Path) -> None:
    """Regression (attack helper 82): like={"a": t, "b": t[:3]} took b's saved values over
    a's first three, reported as a success. One tensor under two keys (tied weights, saved
    twice with the same bytes) still loads."""
    ck.save({"a": torch.arange(12.0), "b": torch.full((3,), -1.0)}, tmp_path / "c" / "s")
    t = torch.zeros(12)
    cols = torch.zeros(12, 2)
    ck.save({"a": np.arange(12.0), "b": np.full(3, -1.0)}, tmp_path / "c" / "n")
    n = np.zeros(12)
    for name, like in (("s", {"a": t, "b": t[:3]}), ("s", {"a": t, "b": t[9:]}),
                       ("s", {"a": cols[:, 0], "b": cols[:6:2, 0]}),
                       ("n", {"a": n, "b": n[::-1][2:5]})):
        with pytest.raises(ck.StateMismatchError, match="a and b: like= holds arrays that "
                                                        "share memory"):
            ck.load(tmp_path / "c" / name, like=like, into=True)
    assert not t.any() and not cols.any() and not n.any()
    # views that interleave without sharing an element (q, k and v of one fused weight)
    ck.save({"a": torch.arange(12.0), "b": torch.full((3,), -1.0)}, tmp_path / "c" / "i")
    out = ck.load(tmp_path / "c" / "i", like={"a": cols[:, 0], "b": cols[:3, 1]}, into=True)
    assert cols[:, 0].tolist() == list(range(12)) and cols[:3, 1].tolist() == [-1.0] * 3
    assert out["b"].tolist() == [-1.0] * 3
    tied = torch.nn.Linear(4, 4)
    ck.save({"emb": tied.weight, "head": tied.weight}, tmp_path / "c" / "tied")
    fresh = torch.nn.Linear(4, 4)
    out = ck.load(tmp_path / "c" / "tied", like={"emb": fresh.weight.data,
                                                 "head": fresh.weight.data}, into=True)
    assert torch.equal(fresh.weight, tied.weight) and torch.equal(out["head"], tied.weight)


def test_load_into_a_read_only_array_returns_a_new_one(tmp_path: Path) -> None:
    ck.save({"n": np.arange(3.0)}, tmp_path / "c" / "s")
    frozen = np.zeros(3)
    frozen.setflags(write=False)
    out = ck.load(tmp_path / "c" / "s", like={"n": frozen}, into=True)
    assert out["n"].tolist() == [0.0, 1.0, 2.0] and not frozen.any()


def test_load_into_detects_a_flipped_byte(tmp_path: Path) -> None:
    path = Path(ck.save({"w": torch.arange(100_000.0)}, tmp_path / "c" / "s"))
    with open(path / "rank00000.data", "r+b") as f:
        f.seek(200_000)
        f.write(b"\x01")
    with pytest.raises(CorruptionError, match=r"rank00000\.data for array 'w'.*holds part"):
        ck.load(path, like={"w": torch.zeros(100_000)}, into=True)
