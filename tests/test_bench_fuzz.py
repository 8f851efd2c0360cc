"""Fuzzing the workload parser (bench/config.py): random structures, wrong types in every
field, huge and special numbers, deep nesting, random YAML text. Only ConfigError escapes, in
bounded time and memory, and whatever parses has every number inside its published range."""

from __future__ import annotations

import time
import tracemalloc
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lcache.bench import parse_workload
from lcache.bench.config import Workload
from lcache.bench.schema import NESTED as _NESTED
from lcache.bench.schema import RANGES as _RANGES
from lcache.bench.schema import SCHEMA as _SCHEMA
from lcache.bench.schema import TOP as _TOP
from lcache.bench.yamlfile import load_yaml
from lcache.errors import ConfigError

SPECIAL: list[Any] = [
    "1e12", "1e18", ".inf", "-.inf", ".nan", "nan", "inf", "1e400", "-0", "9" * 5000,
    10**30, -(10**30), 2**64, 2**63, 1e308, -1e-308, float("inf"), float("nan"), "0x10",
    "1_000", " 7 ", "", "\0", "true", "off", "a\0b", "x" * 5000, 114660.07, -1, 0, 1,
]
LEAVES = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
          | st.sampled_from(SPECIAL))
VALUES = st.recursive(
    LEAVES, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8) | st.sampled_from(sorted(_TOP)), inner, max_size=4),
    max_leaves=16)
FIELDS = sorted({(s, k) for s, body in _SCHEMA.items() for k in body}
                | {(s, f"{k}.{sub}") for (s, k), subs in _NESTED.items() for sub in subs})
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _place(doc: dict[str, Any], section: str, key: str, value: Any) -> None:
    node = doc.setdefault(section, {})
    *parents, last = key.split(".")
    for p in parents:  # a value placed earlier where a table goes is replaced by the table
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[last] = value


def check(doc: Any, overrides: tuple[str, ...] = ()) -> None:
    """Parse ``doc``: a Workload in range or a ConfigError, fast and in little memory."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        w = parse_workload(doc, "fuzz.yaml", overrides)
    except ConfigError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 2000, str(exc)[:300]
        w = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 5.0
    assert peak < 16 << 20, peak
    if w is not None:
        assert isinstance(w, Workload)
        for attr, key, kind, lo, hi in _RANGES:
            value = getattr(w, attr)
            assert type(value) is kind and lo <= value <= hi, (key, value)


@SETTINGS
@given(st.dictionaries(st.sampled_from(sorted(_TOP)) | st.text(max_size=8), VALUES,
                       max_size=6) | VALUES)
def test_random_structures(doc: Any) -> None:
    check(doc)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(FIELDS), VALUES), min_size=1, max_size=6))
def test_wrong_types_and_special_numbers_in_every_field(items: list[tuple[Any, Any]]) -> None:
    doc: dict[str, Any] = {}
    for (section, key), value in items:
        _place(doc, section, key, value)
    check(doc)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(FIELDS), st.integers(min_value=100, max_value=20_000))
def test_deep_nesting_in_any_field(field: tuple[str, str], depth: int) -> None:
    doc: dict[str, Any] = {}
    _place(doc, *field, _nested(depth))
    check(doc)


def test_deep_nesting_through_set() -> None:
    # The YAML loader refuses it at depth 17, before the composer's recursion runs out.
    for depth in (17, 3000):
        check({}, ("train.epochs=" + "[" * depth + "]" * depth,))
        check({}, ("train.epochs=" + "{a: " * depth + "}" * depth,))


@SETTINGS
@given(st.sampled_from(FIELDS), st.sampled_from(SPECIAL) | st.text(max_size=40))
def test_set_values(field: tuple[str, str], value: Any) -> None:
    check({}, (f"{field[0]}.{field[1]}={value}",))


def _yaml_or_error(text: str | bytes) -> Any:
    t0 = time.perf_counter()
    try:
        doc = load_yaml(text, "fuzz.yaml")
    except ConfigError as exc:
        assert "\n" not in str(exc), str(exc)
        return None
    finally:
        assert time.perf_counter() - t0 < 5.0
    return doc


@SETTINGS
@given(st.text(max_size=300) | st.binary(max_size=300))
def test_random_yaml_text(text: str | bytes) -> None:
    doc = _yaml_or_error(text)
    if doc is not None:
        check(doc)


@SETTINGS
@given(VALUES, st.sampled_from(["&a ", "*a ", "!!python/object:os.system ", "!!binary ",
                                "!!set ", "? ", "<<: *a\n", "!!timestamp "]),
       st.integers(min_value=0, max_value=400))
def test_mutated_yaml(doc: Any, insert: str, at: int) -> None:
    try:
        text = yaml.safe_dump(doc)
    except (yaml.YAMLError, ValueError):
        return  # not representable (a str of 5,000 digits may trip int conversion in dump)
    at = min(at, len(text))
    parsed = _yaml_or_error(text[:at] + insert + text[at:])
    if parsed is not None:
        check(parsed)


def test_every_special_value_in_every_field() -> None:
    """Exhaustively, not left to chance: anything but a ConfigError fails check()."""
    for section, key in FIELDS:
        for value in SPECIAL:
            doc: dict[str, Any] = {}
            _place(doc, section, key, value)
            check(doc)
