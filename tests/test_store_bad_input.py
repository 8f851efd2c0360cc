"""Bad arguments to the store's API: each is an lcache error (that also derives from the
builtin a caller may catch), raised before anything is written, and names what to give."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lcache import ConfigError, LCacheError
from lcache.io import SyncPolicy
from lcache.store import ArgumentTypeError, Store, fsck

from .conftest import SEG, SMALL


@pytest.mark.parametrize(("settings", "words"), [
    ({"sync": "bogus"}, "sync='bogus': use never, flush or always"),
    ({"sync": None}, "sync=None: use never, flush or always"),
    ({"direct_io": "yes"}, "direct_io='yes': give True or False"),
    ({"direct_io": "no"}, "direct_io='no': give True or False"),  # truthy: it meant yes
    ({"direct_writes": None}, "direct_writes=None: give True or False"),
    ({"create": "no"}, "create='no': give True or False"),
    ({"queue_depth": 0}, "queue_depth=0: give a whole number from 1 to 1,024"),
    ({"queue_depth": -1}, "queue_depth=-1: give a whole number from 1 to 1,024"),
    ({"queue_depth": "x"}, "queue_depth='x': give a whole number from 1 to 1,024"),
    ({"queue_depth": 2.5}, "queue_depth=2.5: give a whole number from 1 to 1,024"),
    ({"queue_depth": True}, "queue_depth=True: give a whole number from 1 to 1,024"),
    ({"queue_depth": 10**6}, "queue_depth=1000000: give a whole number from 1 to 1,024"),
])
def test_open_refuses_bad_settings_before_creating_anything(
        store_dir: Path, settings: dict[str, Any], words: str) -> None:
    """sync="bogus" was enum's bare ValueError; queue_depth="x" was accepted and failed at
    the first get_many with a TypeError; direct_io="yes" and queue_depth=10**6 were taken."""
    with pytest.raises(ConfigError) as info:
        Store.open(store_dir, **{**SMALL, **settings})
    assert str(info.value) == words
    assert not store_dir.exists(), "a refused open must not create the store"


def test_settings_given_as_their_types_still_open(store_dir: Path) -> None:
    with Store.open(store_dir, **SMALL, sync=SyncPolicy.NEVER, direct_io=np.bool_(False),
                    queue_depth=np.int64(1024)) as store:
        assert store.sync is SyncPolicy.NEVER and store.direct_io is False
        assert store.queue_depth == 1024 and type(store.queue_depth) is int
    with Store.open(store_dir, sync="always", queue_depth=1, create=False) as store:
        assert store.sync is SyncPolicy.ALWAYS and store.queue_depth == 1


def test_negative_queue_depth_with_direct_io_no_longer_hangs(store_dir: Path) -> None:
    """queue_depth=-1 was accepted, and with direct_io get_many waited for ever for I/O
    workers that were never asked to help."""
    with Store.open(store_dir, **SMALL) as store:
        store.put_many(list(range(20)), [b"a" * 5000] * 20)
    with pytest.raises(ConfigError, match="queue_depth=-1"):
        Store.open(store_dir, queue_depth=-1, direct_io=True)
    with Store.open(store_dir, queue_depth=1, direct_io=True) as store:
        assert [bytes(v) for v in store.get_many(list(range(20)))] == [b"a" * 5000] * 20


@pytest.mark.parametrize("path", ["", "   ", None, 3])
def test_open_and_fsck_need_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   path: Any) -> None:
    """Store.open("") made a store in the current directory; None was a bare TypeError."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"path=.*: give a path"):
        Store.open(path)
    with pytest.raises(ConfigError, match=r"path=.*: give a path"):
        fsck(path)
    assert os.listdir(tmp_path) == []


def test_fsck_repair_must_be_a_bool(open_store: Any, store_dir: Path) -> None:
    """repair="no" is truthy: it repaired."""
    open_store().close()
    with pytest.raises(ConfigError, match="repair='no': give True or False"):
        fsck(store_dir, repair="no")
    assert fsck(store_dir, repair=False).clean


def test_max_byte_keys_given_on_reopen_is_taken_and_kept(open_store: Any,
                                                         store_dir: Path) -> None:
    """Open's docstring said "fixed at creation"; it is a bound that may change on reopen
    (what IndexFullError advises), and one given is written to store.json."""
    open_store(max_byte_keys=1 << 20).close()
    with Store.open(store_dir, max_byte_keys=64) as store:
        assert store.config.max_byte_keys == 64
    with Store.open(store_dir) as store:
        assert store.config.max_byte_keys == 64


# ----------------------------------------------------------------- keys, values, batches
def _raised(call: Any) -> BaseException:
    try:
        call()
    except BaseException as exc:
        return exc
    raise AssertionError("no error raised")


@pytest.mark.parametrize(("call", "builtin", "words"), [
    (lambda s: s.put(-1, b"x"), ValueError, "int keys must be in [0, 2**63), got -1"),
    (lambda s: s.get(2**64), ValueError, "int keys must be in [0, 2**63)"),
    (lambda s: s.put(b"", b"x"), ValueError, "byte keys must be 1..1024 bytes long, got 0"),
    (lambda s: s.delete(-1), ValueError, "int keys must be in [0, 2**63)"),
    (lambda s: -1 in s, ValueError, "int keys must be in [0, 2**63)"),
    (lambda s: s.get("k"), TypeError, "keys are int or bytes, got str"),
    (lambda s: s.put(None, b"x"), TypeError, "keys are int or bytes, got NoneType"),
    (lambda s: s.put(True, b"x"), TypeError, "keys are int or bytes, got bool"),
    (lambda s: s.get(np.bool_(True)), TypeError, "keys are int or bytes, got bool"),
    (lambda s: s.put(2.0, b"x"), TypeError, "keys are int or bytes, got float"),
    (lambda s: s.put(1, None), TypeError, "a value must be bytes or a buffer"),
    (lambda s: s.put(1, memoryview(b"abcd")[::2]), TypeError,
     "C-contiguous buffer, not a strided view"),
    (lambda s: s.put(1, b"x" * (2 * SEG)), ValueError, "does not fit in a segment"),
    (lambda s: s.put_many([1, 2], [b"a"]), ValueError, "2 keys but 1 values"),
    (lambda s: s.put_many(None, None), TypeError, "keys=None: give a sequence of keys"),
    (lambda s: s.put_many([1], None), TypeError, "values=None: give a sequence of values"),
    (lambda s: s.put_many(iter([1]), [b"a"]), TypeError, "give a sequence of keys"),
    (lambda s: s.get_many(None), TypeError, "keys=None: give a sequence of keys"),
    # one key is not a batch: b"key" was read as the int keys 107, 101, 121
    (lambda s: s.get_many(b"key"), TypeError, "keys=b'key': give a sequence of keys"),
    (lambda s: s.get_many(np.zeros((2, 2), np.int64)), TypeError, "a 1-d numpy array"),
    (lambda s: s.get_many([3], remove=True), TypeError, "remove=True: give one bool per key"),
    (lambda s: s.get_many([3], remove=["no"]), TypeError, "remove=['no']: give one bool"),
    (lambda s: s.get_many([3], remove=np.array([1])), TypeError, "give one bool per key"),
    (lambda s: s.get_many([3, 4], remove=[True]), ValueError, "2 keys but 1 remove flags"),
])
def test_api_errors_are_lcache_errors_and_the_builtin_as_before(
        open_store: Any, call: Any, builtin: type[Exception], words: str) -> None:
    """They were bare ValueErrors and TypeErrors, which ``except LCacheError`` missed."""
    store = open_store()
    store.put(3, b"three")
    exc = _raised(lambda: call(store))
    assert isinstance(exc, ConfigError) and isinstance(exc, LCacheError), repr(exc)
    assert isinstance(exc, builtin), repr(exc)
    if builtin is TypeError:
        assert isinstance(exc, ArgumentTypeError)
    assert words in str(exc)
    assert store.get(3) == b"three" and 1 not in store and 2 not in store


def test_use_after_close_is_a_config_error_as_for_a_cached_dataset(open_store: Any) -> None:
    store = open_store()
    store.close()
    for call in (lambda: store.get(1), lambda: store.put(1, b"x"), lambda: store.delete(1),
                 lambda: 1 in store, lambda: store.get_many([1]), lambda: store.flush(),
                 lambda: store.stats(), lambda: store.gc()):
        exc = _raised(call)
        assert isinstance(exc, ConfigError), repr(exc)
        assert f"the store at {store.root} is closed; open it again" in str(exc)


@pytest.mark.parametrize("value", [
    np.array(["hello", 42, None], dtype=object),
    np.zeros(3, dtype=[("n", "i4"), ("obj", "O")]),  # a field that holds objects
    memoryview(np.array([object()] * 2, dtype=object)),
    np.array([[1, None]], dtype=object).T.copy(),
])
def test_values_holding_python_objects_are_refused(open_store: Any, value: Any) -> None:
    """An object array's buffer is its PyObject pointers: put stored 24 bytes of addresses
    for three objects, meaningless once read back and a leak of the process's layout."""
    store = open_store()
    with pytest.raises(ArgumentTypeError, match="not Python objects") as info:
        store.put(1, value)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, TypeError)
    assert 1 not in store


def test_plain_structured_and_numeric_values_are_still_stored(open_store: Any) -> None:
    store = open_store()
    # a field named with an "O" is not the object code "O" of a buffer's format
    plain = np.zeros(3, dtype=[("Occupancy", "i4"), ("x", "f8")])
    plain["Occupancy"] = [1, 2, 3]
    store.put(1, plain)
    assert store.get(1) == plain.tobytes()
    store.put(2, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert store.get(2) == np.arange(6, dtype=np.float32).tobytes()


@pytest.mark.parametrize("kind", [np.int64, np.uint64, np.int32, np.uint8, int])
def test_numpy_integer_keys_work_as_ints_everywhere(open_store: Any, kind: Any) -> None:
    """put(np.int64(3)) was refused ("keys are int or bytes, got int64") while get took it."""
    store = open_store()
    store.put(kind(3), b"three")
    assert store.get(3) == b"three" and store.get(kind(3)) == b"three"
    assert kind(3) in store and 3 in store
    store.put_many([kind(4), kind(5)], [b"four", b"five"])
    assert [bytes(v) for v in store.get_many(np.array([3, 4, 5], dtype=kind))] == \
        [b"three", b"four", b"five"]
    assert store.delete(kind(4)) and 4 not in store and not store.delete(4)
    got = store.get_many([kind(3), kind(5)], remove=np.array([True, False]))
    assert [bytes(v) for v in got if v is not None] == [b"three", b"five"]
    assert 3 not in store and 5 in store


def test_a_numpy_array_of_keys_is_put_as_int_keys(open_store: Any) -> None:
    """put_many counted each numpy integer as a byte key (and refused it); 1,000 of them
    are more than this store's byte-key index may hold (max_byte_keys 256)."""
    store = open_store()
    keys = np.arange(1000, dtype=np.int64)
    store.put_many(keys, [b"%d" % k for k in keys])
    assert store.get(999) == b"999"
    assert store.stats()["live_keys"] == 1000


def test_a_key_past_the_int_range_is_refused_alike_by_every_call(open_store: Any) -> None:
    """np.uint64(2**64-1): put raised TypeError, get ValueError."""
    store = open_store()
    key = np.uint64(2**64 - 1)
    for call in (lambda: store.put(key, b"x"), lambda: store.get(key),
                 lambda: store.delete(key), lambda: key in store,
                 lambda: store.get_many([key, 1]), lambda: store.get_many(np.array([key]))):
        exc = _raised(call)
        assert type(exc) is ConfigError, repr(exc)
        assert "int keys must be in [0, 2**63), got 18446744073709551615" in str(exc)


@pytest.mark.parametrize("bad", ["0.5", None, float("nan"), 1.5, -0.1])
def test_gc_takes_a_fraction_of_dead_bytes_only(open_store: Any, bad: Any) -> None:
    """gc("0.5") was a TypeError deep in the loop; nan compacted nothing without a word."""
    store = open_store()
    with pytest.raises(ConfigError, match=r"min_dead_fraction=.*: give a number from 0 to 1"):
        store.gc(bad)
    assert store.gc(0.5) == 0
