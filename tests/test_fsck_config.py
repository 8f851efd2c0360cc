"""``store.json`` whose values are of the right type but no store can have them.

Regression: ``lcache fsck`` said "clean" for a ``store.json`` holding ``"capacity": -5`` (or a
zero segment size...), which ``Store.open`` and ``lcache stats`` refuse, and
``fsck --repair`` left it as it was; ``Store.open`` said "raise capacity" as if the user had
typed the value instead of naming the file as damaged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lcache import ConfigError, CorruptionError
from lcache.store import Store, fsck

from .conftest import SMALL, subprocess_env

KEYS = list(range(20))

#: (field, bad value, words of the problem fsck reports)
BAD = [
    ("capacity", -5, "capacity -5 is below the minimum"),
    ("capacity", 1000, "capacity 1000 is below the minimum"),
    ("segment_size", 0, "segment_size 0 B must be between"),
    ("max_writers", 0, "max_writers must be >= 1, got 0"),
    ("max_byte_keys", -1, "max_byte_keys must be >= 16, got -1"),
    ("max_byte_keys", 0, "max_byte_keys must be >= 16, got 0"),
]


def _make(store_dir: Path) -> None:
    with Store.open(store_dir, **SMALL) as store:
        for key in KEYS:
            store.put(key, b"value %d" % key)


def _set(store_dir: Path, name: str, value: Any) -> None:
    path = store_dir / "store.json"
    doc = json.loads(path.read_text())
    doc[name] = value
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(("name", "value", "words"), BAD)
def test_out_of_range_config_is_damage_that_repair_fixes(store_dir: Path, name: str,
                                                         value: Any, words: str) -> None:
    _make(store_dir)
    _set(store_dir, name, value)

    with pytest.raises(CorruptionError) as info:
        Store.open(store_dir, create=False)
    message = str(info.value)
    assert "store.json is damaged" in message and words in message, message
    assert f"lcache fsck --repair {store_dir}" in message, message
    assert "raise capacity" not in message, message

    report = fsck(store_dir)
    assert not report.clean
    assert any("store.json" in p and words in p for p in report.problems), report.problems

    repaired = fsck(store_dir, repair=True)
    assert repaired.clean, repaired.problems
    assert any("store.json" in p for p in repaired.repaired), repaired.repaired
    assert fsck(store_dir).clean

    doc = json.loads((store_dir / "store.json").read_text())
    with Store.open(store_dir, create=False) as store:
        got = store.get_many(KEYS)
        assert [bytes(v) for v in got if v is not None] == [b"value %d" % k for k in KEYS]
        # the settings that were valid are kept; the bad one got its default
        for other in ("max_writers", "max_byte_keys", "policy"):
            if other != name:
                assert doc[other] == SMALL.get(other, "lru"), doc
        if name == "max_writers" or (name, value) == ("capacity", -5):
            assert doc[name] == {"max_writers": 8, "capacity": 8 << 30}[name], doc
        if name == "max_byte_keys":
            assert doc[name] is None, doc
        if name == "capacity" and value == 1000:  # a size, but too small: raised to fit
            assert doc[name] == store.config.minimum_capacity(), doc


def test_a_policy_unknown_to_the_process_names_store_json(store_dir: Path) -> None:
    """The finding (attack helper 98): store.json naming policy "nope" made every open fail
    with "unknown eviction policy 'nope'; choose one of fifo, lru, planned", as if the
    caller had chosen it. It is not damage: a program's register_policy makes names other
    processes do not know (attack helper 99), so fsck leaves it alone."""
    _make(store_dir)
    _set(store_dir, "policy", "nope")
    with pytest.raises(ConfigError, match=r"store.json names the eviction policy 'nope', "
                                          r"which this process does not know .*register_policy"):
        Store.open(store_dir, create=False)
    assert fsck(store_dir).clean
    with Store.open(store_dir, create=False, policy="fifo") as store:  # a policy given: used
        assert store.config.policy == "fifo" and store.get(3) == b"value 3"


def _lcache(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lcache", *args], capture_output=True,
                          text=True, timeout=120, env={**subprocess_env(), "COLUMNS": "1000"})


@pytest.mark.parametrize(("name", "value", "words"), [BAD[0], BAD[2]])
def test_cli_fsck_reports_and_repairs_an_out_of_range_config(store_dir: Path, name: str,
                                                             value: Any, words: str) -> None:
    _make(store_dir)
    _set(store_dir, name, value)

    stats = _lcache("stats", str(store_dir))
    assert stats.returncode == 2 and "Traceback" not in stats.stderr, stats.stderr
    assert stats.stderr.count("\n") == 1, stats.stderr
    assert "store.json is damaged" in stats.stderr and "lcache fsck --repair" in stats.stderr

    check = _lcache("fsck", str(store_dir), "--json")
    assert check.returncode == 2, check.stdout + check.stderr
    doc = json.loads(check.stdout)
    assert doc["clean"] is False
    assert any(words in p for p in doc["problems"]), doc["problems"]

    repair = _lcache("fsck", "--repair", str(store_dir))
    assert repair.returncode == 0, repair.stdout + repair.stderr
    again = _lcache("fsck", str(store_dir))
    assert again.returncode == 0 and "clean" in again.stdout, again.stdout
    assert _lcache("stats", str(store_dir)).returncode == 0


def test_unreadable_config_without_segments_is_reported_and_not_repaired(tmp_path: Path) -> None:
    """Regression: a folder holding only a garbage store.json was made a fresh 8 GiB store by
    ``fsck --repair`` and called clean; without --repair fsck said the index files were
    "missing while segments hold records" when there were no segments."""
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    garbage = bytes(range(256)) * 4
    (store_dir / "store.json").write_bytes(garbage)

    report = fsck(store_dir)
    assert not report.clean
    assert len(report.problems) == 1 and "store.json is unreadable" in report.problems[0]
    assert "no segments" in report.problems[0]
    with pytest.raises(CorruptionError, match="cannot repair"):
        fsck(store_dir, repair=True)

    check = _lcache("fsck", str(store_dir))
    assert check.returncode == 2, check.stdout + check.stderr
    assert "segments hold records" not in check.stdout and "NOT clean" in check.stdout
    repair = _lcache("fsck", "--repair", str(store_dir))
    assert repair.returncode == 2 and repair.stdout == "", repair.stdout
    assert repair.stderr.startswith(f"error: cannot repair {store_dir}: ")
    assert repair.stderr.count("\n") == 1 and "Traceback" not in repair.stderr
    assert "no segments" in repair.stderr
    # nothing was created or changed
    assert [p.name for p in store_dir.iterdir()] == ["store.json"]
    assert (store_dir / "store.json").read_bytes() == garbage
    # the finding: a FIFO (or folder, or link) there was told to run this very command
    (store_dir / "store.json").unlink()
    os.mkfifo(store_dir / "store.json")
    with pytest.raises(CorruptionError, match="is a FIFO") as info:
        fsck(store_dir, repair=True)
    assert "lcache fsck" not in str(info.value)
