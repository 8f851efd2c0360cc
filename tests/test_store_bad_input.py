"""Bad arguments to the store's API: each is an lcache error (that also derives from the
builtin a caller may catch), raised before anything is written, and names what to give."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from lcache import ConfigError
from lcache.io import SyncPolicy
from lcache.store import Store, fsck

from .conftest import SMALL


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
    import numpy as np

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
