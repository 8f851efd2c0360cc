"""Fuzzing the checkpoint manifest reader: random JSON-ish structures, deep nesting, huge and
special numbers, wrong types in every field, random bytes and truncations of a real manifest.
Every reader (read_manifest, load, load(into=True), verify, list_checkpoints, latest) may only
raise an LCacheError (verify and list_checkpoints nothing), within bounded time and memory."""

from __future__ import annotations

import contextlib
import json
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lcache import checkpoint as ck
from lcache.checkpoint.manifest import dump_manifest, scan_json
from lcache.errors import LCacheError

torch = pytest.importorskip("torch")

SETTINGS = settings(max_examples=120, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
SPECIAL: list[Any] = [float("nan"), float("inf"), -float("inf"), -1, 0, 2**64, 2**63,
                      -(2**63) - 1, 1e308, 4096, True, "", "0x" + "f" * 5000, "-0x1",
                      "rank00000.data", "../x", "torch", "float32", "<f4", [], {}]
# ints past CPython's 4300-digit limit, built after drawing (hypothesis reprs its choices)
HUGE = st.sampled_from([4300, 4301, -5000]).map(lambda d: (-1 if d < 0 else 1) * 10 ** abs(d))
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
           | st.sampled_from(SPECIAL) | HUGE)
JSONISH = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)


def like_state() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16)},
            "np": np.zeros(300, np.int16), "step": 0, "big": 0, 3: (0.0, [None, ""])}


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, bytes]]:
    root = tmp_path_factory.mktemp("fuzz") / "ckpts"
    state = {"model": {"w": torch.randn(3, 5), "b": torch.ones(7, dtype=torch.bfloat16)},
             "np": np.arange(300, dtype=np.int16), "step": 12, "big": -(10**60),
             3: (1.5, [None, "x"])}
    path = Path(ck.save(state, root / "step-1", meta={"loss": 0.5}))
    yield path, (path / "manifest.json").read_bytes()


def read_everything(path: Path, raw: bytes) -> ck.VerifyReport:
    """Every reader over a checkpoint whose manifest is ``raw``: only LCacheError escapes,
    within bounded time and memory. Returns ``verify``'s report."""
    (path / "manifest.json").write_bytes(raw)
    like, like_into = like_state(), like_state()
    tracemalloc.start()  # only here: it would slow hypothesis' own work tenfold
    try:
        t0 = time.perf_counter()
        for read in (ck.read_manifest, ck.load, lambda p: ck.load(p, like=like),
                     lambda p: ck.load(p, like=like_into, into=True)):
            with contextlib.suppress(LCacheError):
                read(path)
        report = ck.verify(path)  # never raises for damage
        ck.list_checkpoints(path.parent)
        ck.latest(path.parent)
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 5, elapsed
    assert peak < 64 * len(raw) + (16 << 20), (peak, len(raw))
    return report


def signed(body: Any) -> bytes:
    """A manifest with a valid checksum for ``body`` (huge ints written as the crafter would)."""
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return dump_manifest(body)
    finally:
        sys.set_int_max_str_digits(old)


def mutate(data: st.DataObject, node: Any, depth: int = 0) -> Any:
    """``node`` with one place somewhere below it replaced, removed or wrapped."""
    if isinstance(node, (dict, list)) and node and depth < 12 and data.draw(st.booleans()):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = data.draw(st.sampled_from(keys))
        node[key] = mutate(data, node[key], depth + 1)
        return node
    how = data.draw(st.sampled_from(["replace", "replace", "drop", "wrap", "deep"]))
    if how == "drop" and isinstance(node, (dict, list)) and node:
        node.pop(data.draw(st.sampled_from(list(node) if isinstance(node, dict)
                                           else list(range(len(node))))))
        return node
    if how == "wrap":
        return [node] if data.draw(st.booleans()) else {"t": node}
    if how == "deep":
        deep: Any = data.draw(SCALARS)
        for _ in range(data.draw(st.integers(1, 400))):
            deep = [deep]
        return deep
    return data.draw(JSONISH)


@SETTINGS
@given(data=st.data())
def test_mutated_signed_manifests(real: tuple[Path, bytes],
                                  data: st.DataObject) -> None:
    """A field anywhere in the body replaced, removed, wrapped or nested deep, then signed
    again, so the checks behind the checksum are what is exercised."""
    path, raw = real
    body = json.loads(raw)["body"]
    for _ in range(data.draw(st.integers(1, 3))):
        body = mutate(data, body)
    read_everything(path, signed(body))


@SETTINGS
@given(data=st.data())
def test_damaged_manifest_bytes(real: tuple[Path, bytes],
                                data: st.DataObject) -> None:
    """Truncations, flipped bytes, random bytes, brackets nested past any limit."""
    path, raw = real
    kind = data.draw(st.sampled_from(["truncate", "flip", "random", "nest", "splice"]))
    if kind == "truncate":
        damaged = raw[: data.draw(st.integers(0, len(raw)))]
    elif kind == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        damaged = raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1 :]
    elif kind == "random":
        damaged = data.draw(st.binary(max_size=4000))
    elif kind == "nest":
        n = data.draw(st.integers(100, 200_000))
        damaged = b"[" * n + b"]" * data.draw(st.sampled_from([0, n]))
    else:  # a JSON-ish value, or quotes and escapes, spliced in at a random place
        at = data.draw(st.integers(0, len(raw)))
        piece = data.draw(st.sampled_from([b'"' + b'\\"' * 5000, b"1" * 5000, b"-" + b"9" * 4400,
                                           b"[" * 3000, b"\\", b"\x00", b"\xff\xfe",
                                           b"NaN", b"1e999999"]))
        damaged = raw[:at] + piece + raw[at:]
    # damage is never taken for a checkpoint: only the intact bytes verify, or bytes that
    # are the same JSON ("model\/w" is "model/w": hypothesis found that splice)
    try:
        same = json.loads(damaged) == json.loads(raw)
    except (ValueError, RecursionError):
        same = False
    assert read_everything(path, damaged).ok == same


def reference_scan(raw: bytes) -> tuple[int, int]:
    """``scan_json`` as a plain loop (valid JSON has backslashes only inside strings)."""
    depth = deepest = run = longest = 0
    inside = escaped = False
    for byte in raw:
        c = chr(byte)
        if inside:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                inside = False
            continue
        run = run + 1 if c.isdigit() else 0
        longest = max(longest, run)
        if c == '"':
            inside = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest, longest


@settings(max_examples=200, deadline=None, database=None)
@given(value=JSONISH, text=st.text(alphabet='[]{}"\\0123456789a', max_size=30))
def test_the_scan_matches_a_reference_tokenizer(value: Any, text: str) -> None:
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        raw = json.dumps([value, text, {text: [value]}]).encode()
    finally:
        sys.set_int_max_str_digits(old)
    assert scan_json(raw) == reference_scan(raw)
