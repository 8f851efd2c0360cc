"""The manifest reader's bounds: a damaged or crafted manifest costs bounded memory and time
and raises CorruptionError (so its intact siblings stay listed); a save refuses what the
reader would; ints of any size round-trip."""

from __future__ import annotations

import json
import os
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from lcache import checkpoint as ck
from lcache.checkpoint.format import checksum
from lcache.checkpoint.manifest import MAX_MANIFEST_BYTES, dump_manifest
from lcache.cli.main import cli
from lcache.errors import ConfigError, CorruptionError

MIB = 1 << 20


@contextmanager
def unlimited_int_digits() -> Iterator[None]:
    """Lets json.dumps write the huge ints a crafted manifest may hold."""
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(old)


def two_checkpoints(tmp_path: Path) -> Path:
    root = tmp_path / "ckpts"
    for step in (1, 2):
        ck.save({"w": np.full(100, step, np.float32), "step": step}, root / f"step-00000{step}")
    return root


def rewrite(path: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Change the manifest body and sign it again, so the reader gets past the checksum."""
    body = json.loads(json.dumps(ck.read_manifest(path)))
    mutate(body)
    with unlimited_int_digits():
        (path / "manifest.json").write_bytes(dump_manifest(body))


def assert_only_step1_listed(root: Path) -> None:
    assert ck.latest(root) == str(root / "step-000001")
    listed, damaged = ck.list_checkpoints(root)
    assert [c.name for c in listed] == ["step-000001"] and damaged == ["step-000002"]
    runner = CliRunner()
    out = runner.invoke(cli, ["ckpt", "ls", str(root)])
    assert out.exit_code == 0 and "damaged manifests (not listed): step-000002" in out.output
    out = runner.invoke(cli, ["ckpt", "verify", str(root), "--json"])
    assert out.exit_code == 2, out.output
    reports = {Path(r["path"]).name: r for r in json.loads(out.output)["checkpoints"]}
    assert reports["step-000001"]["ok"] and not reports["step-000002"]["ok"]
    out = runner.invoke(cli, ["ckpt", "verify", str(root)])
    assert out.exit_code == 2 and "Traceback" not in out.output


# --------------------------------------------------------------------------- nesting
def test_a_deeply_nested_sibling_is_listed_as_damaged_not_raised(tmp_path: Path) -> None:
    root = two_checkpoints(tmp_path)
    (root / "step-000002" / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    assert_only_step1_listed(root)
    with pytest.raises(CorruptionError, match="nested 100000 levels deep"):
        ck.load(root / "step-000002")


def test_deep_nesting_inside_a_signed_manifest_is_refused(tmp_path: Path) -> None:
    """Nesting in the body, built as text (json.dumps itself would recurse too deep)."""
    root = two_checkpoints(tmp_path)
    path = root / "step-000002"
    rewrite(path, lambda body: body["meta"].update(x="@DEEP@"))
    raw = (path / "manifest.json").read_bytes()
    (path / "manifest.json").write_bytes(raw.replace(b'"@DEEP@"', b"[" * 5000 + b"]" * 5000))
    assert_only_step1_listed(root)
    with pytest.raises(CorruptionError, match=r"nested 50.. levels deep"):
        ck.read_manifest(path)


def test_a_state_nested_too_deep_or_holding_itself_is_refused_before_writing(
        tmp_path: Path) -> None:
    deep: Any = 1
    for _ in range(101):
        deep = [deep]
    with pytest.raises(ck.UnsupportedValueError, match="nested more than 100 levels"):
        ck.save({"x": deep[0]}, tmp_path / "c" / "deep")  # 101 levels with the root dict
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ck.UnsupportedValueError, match="holds itself"):
        ck.save({"loop": loop}, tmp_path / "c" / "loop")
    assert os.listdir(tmp_path / "c") == []
    # the deepest state the format takes round-trips
    ck.save(deep[0][0], tmp_path / "c" / "ok")
    assert ck.load(tmp_path / "c" / "ok") == deep[0][0]
    assert ck.list_checkpoints(tmp_path / "c")[0][0].name == "ok"


def test_meta_must_be_a_small_json_object(tmp_path: Path) -> None:
    nested: Any = {}
    for _ in range(300):
        nested = {"a": nested}
    for meta, needle in [(nested, "nested more than"), ({"f": len}, "JSON values"),
                         ({"n": 10**5000}, "JSON values"), ([1], "must be a dict")]:
        with pytest.raises(ConfigError, match=needle):
            ck.save({"a": 1}, tmp_path / "c" / "s", meta=meta)
    assert not (tmp_path / "c").exists()  # refused before anything was made
    ck.save({"a": 1}, tmp_path / "c" / "s", meta={"loss": float("nan"), "n": 10**100})
    (info,) = ck.list_checkpoints(tmp_path / "c")[0]
    assert info.meta["n"] == 10**100 and info.meta["loss"] != info.meta["loss"]


# --------------------------------------------------------------------------- size
def test_an_oversized_sparse_manifest_is_refused_before_it_is_read(tmp_path: Path) -> None:
    root = two_checkpoints(tmp_path)
    manifest = root / "step-000002" / "manifest.json"
    os.truncate(manifest, MAX_MANIFEST_BYTES + 200 * MIB)  # a sparse file: costs no disk
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(CorruptionError, match="more than a manifest can be"):
            ck.read_manifest(root / "step-000002")
        assert_only_step1_listed(root)
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MIB, peak
    assert elapsed < 10


def test_a_state_whose_manifest_would_be_too_large_is_refused_before_writing(
        tmp_path: Path) -> None:
    root = tmp_path / "c"
    ck.save({"a": 1}, root / "before")
    with pytest.raises(ck.UnsupportedValueError, match=r"manifest would be about 6\d MiB"):
        ck.save({"text": "x" * MAX_MANIFEST_BYTES}, root / "huge")
    assert [c.name for c in ck.list_checkpoints(root)[0]] == ["before"]
    assert ck.leftovers(str(root)) == []  # the failed save removed its staging directory


# --------------------------------------------------------------------------- numbers, shapes
def test_ints_of_any_size_round_trip(tmp_path: Path) -> None:
    state = {"big": 10**5000, "neg": -(10**5000), "u64": 2**64, "i64": -(2**63), "m1": -1,
             10**5000: "int key", -(2**80): [2**65]}
    path = ck.save(state, tmp_path / "c" / "s")
    back = ck.load(path)
    assert back == state and all(type(k) is int for k in list(back)[5:])
    assert ck.verify(path).ok
    mismatch = {k: v for k, v in state.items() if k != "m1"}
    with pytest.raises(ck.StateMismatchError, match=r"/m1: in the checkpoint"):
        ck.load(path, like=mismatch)  # messages name huge keys without raising


def test_plain_big_ints_written_by_earlier_versions_still_read(tmp_path: Path) -> None:
    path = Path(ck.save({"x": 0, 5: 1}, tmp_path / "c" / "s"))

    def old_style(body: dict[str, Any]) -> None:
        tree = body["shards"][0]["tree"]
        tree["v"][0] = {"t": "plain", "v": -(2**70)}
        tree["k"][1] = {"int": 2**100}

    rewrite(path, old_style)
    assert ck.load(path) == {"x": -(2**70), 2**100: 1}


@pytest.mark.parametrize("mutate, needle", [
    (lambda b: b.update(created_unix=10**5000), "more than 4300 digits"),
    (lambda b: b["shards"][0]["tree"]["v"][1].update(v=-(10**4400)), "more than 4300 digits"),
    (lambda b: b["shards"][0]["arrays"][0].update(shape=[10**4301]), "more than 4300 digits"),
    (lambda b: b["shards"][0]["arrays"][0].update(shape=[1] * 65), "at most 64 sizes"),
    (lambda b: b["shards"][0]["arrays"][0].update(shape=[0, 2**62, 2**62], nbytes=0,
                                                  xxh3=checksum(b"")), "cannot be built"),
    (lambda b: b["shards"][0]["arrays"][0].update(shape=[2**63]), "at most 64 sizes"),
    (lambda b: b["shards"][0]["arrays"][0].update(offset=-4096), "invalid offset"),
    (lambda b: b["shards"][0]["arrays"][0].update(nbytes=float("inf")), "invalid offset"),
    (lambda b: b["shards"][0].update(data_bytes=float("nan")), "invalid data file size"),
    (lambda b: b.update(created_unix=1e300), "invalid creation time"),
    (lambda b: b.update(world_size=True), "does not match world_size"),
    (lambda b: b.update(world_size=0, shards=[]), "does not match world_size"),
    (lambda b: b["shards"][0].update(rank=-1), "invalid or repeated shard rank"),
    (lambda b: b.update(meta=[1]), "meta is not a JSON object"),
    (lambda b: b["shards"][0]["tree"].update(k=5), "unequal keys"),
    (lambda b: b["shards"][0]["tree"]["v"][1].update(t="int", v="12"), "int expected"),
    (lambda b: b["shards"][0]["tree"]["v"][0].update(i=-1), "array index -1"),
    (lambda b: b["shards"][0]["arrays"][0].update(dtype="V0"), "not a plain dtype"),
])
def test_crafted_fields_raise_corruption_error(tmp_path: Path, mutate: Any, needle: str) -> None:
    path = Path(ck.save({"w": np.zeros(4, np.float32), "step": 7}, tmp_path / "c" / "s"))
    rewrite(path, mutate)
    with pytest.raises(CorruptionError, match=needle):
        ck.load(path)
    assert not ck.verify(path).ok or needle == "cannot be built"
    ck.list_checkpoints(tmp_path / "c")  # never raises for a damaged manifest


def test_overlapping_arrays_are_refused(tmp_path: Path) -> None:
    """Each array entry claiming the whole data file would make a load checksum the file
    once per entry."""
    path = Path(ck.save({"a": np.zeros(4096, np.uint8), "b": np.ones(4096, np.uint8)},
                        tmp_path / "c" / "s"))

    def overlap(body: dict[str, Any]) -> None:
        arrays = body["shards"][0]["arrays"]
        arrays[1].update(offset=0, xxh3=arrays[0]["xxh3"])

    rewrite(path, overlap)
    with pytest.raises(CorruptionError, match="over the array before it"):
        ck.load(path)


def test_the_depth_scan_is_linear_on_unterminated_escaped_quotes(tmp_path: Path) -> None:
    """A regular expression that skips JSON strings rescans the rest of the file from every
    escaped quote of an unterminated string: quadratic (minutes for this one)."""
    root = two_checkpoints(tmp_path)
    (root / "step-000002" / "manifest.json").write_bytes(b'"' + b'\\"' * 500_000)
    t0 = time.perf_counter()
    assert_only_step1_listed(root)
    assert time.perf_counter() - t0 < 5


def test_ls_json_of_a_meta_holding_nan_is_strict_json(tmp_path: Path) -> None:
    """The finding (attack helper 98): meta={"loss": nan, "best": inf} was printed as
    ``NaN`` and ``Infinity`` by `ckpt ls --json`, which strict parsers (JavaScript's
    JSON.parse) refuse. They print as null; the checkpoint keeps them."""
    ck.save({"w": np.zeros(3)}, tmp_path / "step-1", meta={"loss": float("nan"),
                                                          "best": float("inf"), "lr": 0.1})

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    out = CliRunner().invoke(cli, ["ckpt", "ls", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    listed = json.loads(out.output, parse_constant=refuse)["checkpoints"][0]
    assert listed["meta"] == {"loss": None, "best": None, "lr": 0.1}
    meta = ck.list_checkpoints(tmp_path)[0][0].meta
    assert meta["lr"] == 0.1 and meta["best"] == float("inf") and meta["loss"] != meta["loss"]
