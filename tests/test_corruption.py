"""Bit flips and truncation in segment, summary and index files.

A damaged record must read as a miss (counted in ``verify_failures``), never as wrong bytes;
every other record stays readable; ``fsck`` reports the damage and ``repair=True`` cleans it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from lcache import CorruptionError
from lcache.store import Store, fsck
from lcache.store.record import HEADER_SIZE
from lcache.testing import faults, flip_bit, locate, pattern_bytes, truncate

from .conftest import SMALL

Key = int | bytes
#: Segments large enough that every record of a test stays in the active one.
ONE_SEGMENT = {"segment_size": 1 << 20, "capacity": 8 << 20}
KEYS: list[Key] = [*range(24), *(b"key-%02d" % i for i in range(12))]


def value_of(key: Key) -> bytes:
    n = key if isinstance(key, int) else 100 + int(key[-2:])
    return pattern_bytes(1500 + 211 * n, n)


def populate(store: Store, keys: list[Key] = KEYS) -> None:
    for key in keys:
        store.put(key, value_of(key))


def assert_intact(store: Store, keys: list[Key]) -> None:
    got = store.get_many(keys)
    for key, view in zip(keys, got, strict=True):
        assert view is not None, f"{key!r} went missing"
        assert bytes(view) == value_of(key), f"{key!r}: wrong bytes"


def reopen(path: Path) -> Store:
    return Store.open(path, **SMALL)


def others(key: Key) -> list[Key]:
    return [k for k in KEYS if k != key]


# --------------------------------------------------------------------------- sealed segments
@pytest.mark.parametrize("key", [7, b"key-03"])
@pytest.mark.parametrize("where", ["payload", "header", "key-or-checksum"])
def test_bit_flip_in_sealed_segment(open_store: Any, store_dir: Path, key: Key,
                                    where: str) -> None:
    store = open_store()
    populate(store)
    store.close()
    store = open_store()
    loc = locate(store, key)
    assert loc is not None
    offset = {"payload": loc.offset + loc.length - 5, "header": loc.offset + 9,
              "key-or-checksum": loc.offset + HEADER_SIZE if isinstance(key, bytes)
              else loc.offset + 21}[where]
    flip_bit(loc.path, offset, 3)

    assert store.get(key) is None
    assert store.counters.verify_failures == 1
    assert_intact(store, others(key))

    report = fsck(store_dir)
    assert not report.clean
    assert any("damaged record" in p for p in report.problems), report.problems
    store.close()

    repaired = fsck(store_dir, repair=True)
    assert repaired.clean, repaired.problems
    assert repaired.repaired
    assert fsck(store_dir).clean
    store = open_store()
    assert store.get(key) is None
    assert_intact(store, others(key))
    # A repaired store goes on working: overwrite the damaged key, compact everything.
    store.put(key, value_of(key))
    store.gc(0.0)
    assert_intact(store, KEYS)
    store.close()
    assert fsck(store_dir).clean


def test_truncated_sealed_segment(open_store: Any, store_dir: Path) -> None:
    store = open_store()
    populate(store)
    store.close()
    store = open_store()
    loc = locate(store, 10)
    assert loc is not None
    truncate(loc.path, loc.offset + loc.length // 2)  # cut inside record 10
    same_segment_before = [k for k in KEYS if (x := locate(store, k)) is not None
                           and x.segment == loc.segment and x.offset < loc.offset]
    lost = [k for k in KEYS if (x := locate(store, k)) is not None
            and x.segment == loc.segment and x.offset >= loc.offset]
    assert lost and 10 in lost
    for key in lost:
        assert store.get(key) is None
    assert store.counters.verify_failures == len(lost)
    kept = [k for k in KEYS if k not in lost]
    assert_intact(store, kept)
    assert set(same_segment_before) <= set(kept)
    store.close()

    assert not fsck(store_dir).clean
    repaired = fsck(store_dir, repair=True)
    assert repaired.clean, repaired.problems
    store = open_store()
    assert_intact(store, kept)
    assert store.get_many(lost) == [None] * len(lost)


def test_garbage_after_a_sealed_segment(open_store: Any, store_dir: Path) -> None:
    store = open_store()
    populate(store)
    store.close()
    seg = faults.segment_ids(store_dir)[0][0]
    log = faults.segment_log(store_dir, seg)
    with open(log, "ab") as f:
        f.write(b"\x00garbage" * 100)
    report = fsck(store_dir)
    assert any("past its end" in p for p in report.problems), report.problems
    # A reader may have mapped the sealed segment, garbage included: the repair replaces
    # the file instead of cutting it in place (a page cut under a mapping is a SIGBUS).
    with open(log, "rb") as mapped_before:
        size_before = os.fstat(mapped_before.fileno()).st_size
        assert fsck(store_dir, repair=True).clean
        assert os.fstat(mapped_before.fileno()).st_size == size_before
    assert os.path.getsize(log) == size_before - len(b"\x00garbage" * 100)
    store = open_store()
    assert_intact(store, KEYS)


@pytest.mark.parametrize("cut", [0, 10, 47, -3])
def test_truncated_summary(open_store: Any, store_dir: Path, cut: int) -> None:
    store = open_store()
    populate(store)
    store.close()
    seg = faults.segment_ids(store_dir)[0][0]
    path = faults.segment_sum(store_dir, seg)
    truncate(path, cut if cut >= 0 else os.path.getsize(path) + cut)

    report = fsck(store_dir)
    assert not report.clean
    assert any("summary" in p for p in report.problems), report.problems
    # The store does not need the summary to read, and rebuilds it by a scan to compact.
    store = open_store()
    assert_intact(store, KEYS)
    for k in KEYS[::2]:
        store.delete(k)
    store.gc(0.0)
    assert_intact(store, KEYS[1::2])
    store.close()
    assert fsck(store_dir, repair=True).clean
    store = open_store()
    assert_intact(store, KEYS[1::2])


@pytest.mark.parametrize(("byte", "bit"), [(25, 7), (28, 6), (24, 0), (8, 1), (16, 0)],
                         ids=["data_len-down", "data_len-up", "data_len-low", "segment",
                              "count"])
def test_a_bit_flip_in_a_summary_header_is_caught(open_store: Any, store_dir: Path,
                                                  byte: int, bit: int) -> None:
    """The finding (attack helper 100): the checksum covered a summary's body, not its
    header. One flipped bit of data_len made fsck --repair cut 32 intact records off the
    segment ("32768 bytes past its end"), or a cleaning allocate 2**38 bytes (MemoryError).
    The header is checksummed now; damage is found, the summary rebuilt by a scan."""
    store = open_store()
    populate(store)
    store.close()
    seg = min(faults.segment_ids(store_dir)[1])
    flip_bit(faults.segment_sum(store_dir, seg), byte, bit)
    report = fsck(store_dir)
    assert any("summary" in p for p in report.problems), report.problems
    store = open_store()
    store.gc(0.0)  # the cleaning reads the summary, or rebuilds it
    assert_intact(store, KEYS)
    store.close()
    assert fsck(store_dir, repair=True).problems == []
    store = open_store()
    assert_intact(store, KEYS)


def test_a_summary_of_the_first_version_still_reads(open_store: Any, store_dir: Path) -> None:
    """Stores written before the header was checksummed keep their summaries (version 1,
    the body's checksum), and a data_len that ends before the last record is damage."""
    import struct

    import xxhash

    from lcache.store.segment import read_summary

    store = open_store()
    populate(store)
    store.close()
    seg = min(faults.segment_ids(store_dir)[1])
    path = faults.segment_sum(store_dir, seg)
    raw = Path(path).read_bytes()
    head = struct.Struct("<4sIQQQQ")
    body = raw[head.size:]
    magic, _, segment, count, data_len, _ = head.unpack_from(raw)

    def write(length: int) -> None:
        with open(path, "wb") as f:
            f.write(head.pack(magic, 1, segment, count, length, xxhash.xxh3_64_intdigest(body))
                    + body)

    write(data_len)
    assert read_summary(str(store_dir), seg).data_len == data_len
    assert fsck(store_dir).problems == []
    write(data_len - 4096)
    with pytest.raises(CorruptionError, match="ends at"):
        read_summary(str(store_dir), seg)
    # past its segment file: fsck and a cleaning allocated up to 4 GiB (attack helper 102)
    write(os.path.getsize(faults.segment_log(store_dir, seg)) + 1)
    with pytest.raises(CorruptionError, match="within its"):
        read_summary(str(store_dir), seg)
    assert fsck(store_dir, repair=True).problems == []
    assert_intact(open_store(), KEYS)


def test_truncated_summary_repaired_by_fsck(open_store: Any, store_dir: Path) -> None:
    store = open_store()
    populate(store)
    store.close()
    for seg in faults.segment_ids(store_dir)[1]:
        truncate(faults.segment_sum(store_dir, seg), 20)
    repaired = fsck(store_dir, repair=True)
    assert repaired.clean, repaired.problems
    assert len(repaired.repaired) == len(faults.segment_ids(store_dir)[1])
    store = open_store()
    assert_intact(store, KEYS)


# --------------------------------------------------------------------------- unsealed segments
def test_bit_flip_in_active_segment_is_a_miss(open_store: Any, store_dir: Path) -> None:
    store = open_store(**ONE_SEGMENT)  # everything stays in the active segment
    populate(store)
    store.flush()
    loc = locate(store, 5)
    assert loc is not None
    assert faults.unsealed_segments(store_dir) == [loc.segment]
    flip_bit(loc.path, loc.offset + loc.length - 1, 0)
    assert store.get(5) is None
    assert store.counters.verify_failures == 1
    assert_intact(store, others(5))
    assert fsck(store_dir).clean  # a live writer's segment is not fsck's to judge
    store.close()  # sealing keeps the writer's own summary: the record is damaged, listed
    report = fsck(store_dir)
    assert any("damaged record" in p for p in report.problems), report.problems
    assert fsck(store_dir, repair=True).clean
    store = open_store(**ONE_SEGMENT)
    assert_intact(store, others(5))


def test_bit_flip_in_crashed_segment_loses_only_that_record(open_store: Any,
                                                            store_dir: Path) -> None:
    """Recovery scans an orphaned segment: a damaged record in the middle must not take every
    record after it down with it (only a torn *tail* is cut)."""
    store = open_store(**ONE_SEGMENT)
    populate(store)
    store.flush()
    loc = locate(store, 5)
    assert loc is not None
    store._abandon()  # kill -9
    flip_bit(loc.path, loc.offset + loc.length - 1, 0)
    store = open_store(**ONE_SEGMENT)
    assert store.counters.recovered_segments == 1
    assert store.get(5) is None
    assert_intact(store, others(5))
    store.close()
    assert fsck(store_dir).clean


def test_torn_tail_of_crashed_segment(open_store: Any, store_dir: Path) -> None:
    store = open_store(**ONE_SEGMENT)
    populate(store)
    store.flush()
    durable = list(KEYS)
    late = [100, 101, b"late"]
    for key in late:
        store.put(key, pattern_bytes(5000, 7))
    loc = locate(store, 101)
    assert loc is not None
    store._abandon()
    truncate(loc.path, loc.offset + 40)  # 101 is torn, 100 is whole, "late" is gone
    report = fsck(store_dir)
    assert any("left unsealed" in p for p in report.problems), report.problems
    store = open_store(**ONE_SEGMENT)
    assert_intact(store, durable)
    assert store.get(100) == pattern_bytes(5000, 7)
    assert store.get(101) is None
    assert store.get(b"late") is None
    store.close()
    assert fsck(store_dir).clean


def test_crashed_segment_shorter_than_its_index_entries(open_store: Any,
                                                        store_dir: Path) -> None:
    """Regression: recovery dropped index entries past the intact end only when it cut a tail
    itself; a file already cut at a record boundary (a lost tail) kept entries pointing past
    its end, and fsck stayed unclean."""
    store = open_store(**ONE_SEGMENT, direct_writes=False)  # no zero padding at the end
    populate(store)
    store.flush()
    store.put(b"lost", b"written after the flush")
    loc = locate(store, b"lost")
    assert loc is not None
    store._abandon()
    truncate(loc.path, loc.offset)  # exactly the records before it remain
    store = open_store(**ONE_SEGMENT)
    assert store.get(b"lost") is None
    assert_intact(store, KEYS)
    store.close()
    report = fsck(store_dir)
    assert report.clean, report.problems


def test_fsck_repair_seals_a_crashed_segment(open_store: Any, store_dir: Path) -> None:
    store = open_store(**ONE_SEGMENT)
    populate(store)
    store.flush()
    store._abandon()
    report = fsck(store_dir)
    assert [p for p in report.problems if "left unsealed" in p]
    assert fsck(store_dir, repair=True).clean
    store = open_store(**ONE_SEGMENT)
    assert store.counters.recovered_segments == 0  # fsck already sealed it
    assert_intact(store, KEYS)


# --------------------------------------------------------------------------- indexes
@pytest.mark.parametrize("kind", ["int", "bytes"])
def test_damaged_index_header(open_store: Any, store_dir: Path, kind: str) -> None:
    store = open_store()
    populate(store)
    store.close()
    path = faults.index_path(store_dir, kind)
    flip_bit(path, 1, 2)  # inside the magic

    with pytest.raises(CorruptionError) as info:  # at the open, not at some later get
        open_store()
    assert path in str(info.value) and f"lcache fsck --repair {store_dir}" in str(info.value)

    report = fsck(store_dir)
    assert any("bad header" in p for p in report.problems), report.problems
    repaired = fsck(store_dir, repair=True)
    assert repaired.clean, repaired.problems
    store = open_store()
    assert_intact(store, KEYS)


@pytest.mark.parametrize("kind", ["int", "bytes"])
def test_rebuilt_index_does_not_resurrect_deleted_keys(open_store: Any, store_dir: Path,
                                                       kind: str) -> None:
    """Regression (was an xfail, 'deletes leave no trace in the log'): the delete journal."""
    store = open_store()
    populate(store)
    gone: Key = 4 if kind == "int" else b"key-04"
    assert store.delete(gone)
    store.close()
    flip_bit(faults.index_path(store_dir, kind), 1, 2)
    assert fsck(store_dir, repair=True).clean
    store = open_store()
    assert store.get(gone) is None
    assert_intact(store, others(gone))


@pytest.mark.parametrize("kind", ["int", "bytes"])
@pytest.mark.parametrize("damage", ["cut-in-header", "cut-mid-entry", "cut-whole-entries",
                                    "extended-by-garbage"])
def test_index_of_the_wrong_size(open_store: Any, store_dir: Path, kind: str,
                                 damage: str) -> None:
    """Regression: a truncated or extended index file made every get raise a raw ValueError
    ("buffer size must be a multiple of element size", "mmap length is greater than file
    size"), and fsck and fsck --repair too."""
    store = open_store()
    populate(store)
    store.close()
    path = faults.index_path(store_dir, kind)
    size = os.path.getsize(path)
    if damage == "extended-by-garbage":
        with open(path, "ab") as f:
            f.write(b"\x07" * 5)
    else:
        truncate(path, {"cut-in-header": 100, "cut-mid-entry": size - 13,
                        "cut-whole-entries": size - 4096}[damage])

    with pytest.raises(CorruptionError) as info:
        open_store()
    message = str(info.value)
    assert path in message and f"run `lcache fsck --repair {store_dir}`" in message, message

    report = fsck(store_dir)
    assert any(path in p for p in report.problems), report.problems
    repaired = fsck(store_dir, repair=True)
    assert repaired.clean, repaired.problems
    store = open_store()
    assert_intact(store, KEYS)  # rebuilt from the segments: every key has one record


def _config_damage(store_dir: Path, damage: str) -> None:
    cfg = store_dir / "store.json"
    text = cfg.read_text()
    if damage == "cut-short":
        cfg.write_text(text[: text.index('"policy"')])
    elif damage == "garbage":
        cfg.write_bytes(b"\x00\xff" * 50)
    elif damage == "wrong-types":
        cfg.write_text(text.replace('"max_writers": 2', '"max_writers": "two"'))
    elif damage == "missing":
        cfg.unlink()
    elif damage == "symlink":
        cfg.unlink()
        cfg.symlink_to(store_dir / "stats.json")


@pytest.mark.parametrize("damage", ["cut-short", "garbage", "wrong-types", "missing",
                                    "symlink"])
def test_damaged_config_is_repaired(open_store: Any, store_dir: Path, damage: str) -> None:
    """Regression: a damaged store.json could not be repaired (fsck raised on it)."""
    store = open_store()
    populate(store)
    store.close()
    _config_damage(store_dir, damage)

    with pytest.raises(CorruptionError) as info:
        Store.open(store_dir, create=False)
    assert "store.json" in str(info.value)
    assert f"lcache fsck --repair {store_dir}" in str(info.value)
    assert not fsck(store_dir).clean

    repaired = fsck(store_dir, repair=True)
    assert repaired.clean, repaired.problems
    assert any("store.json" in p for p in repaired.repaired), repaired.repaired
    assert not (store_dir / "store.json").is_symlink()
    store = Store.open(store_dir, create=False)
    # what the damaged file still said is kept; segment_size holds the segments on disk
    assert store.config.segment_size == SMALL["segment_size"]
    if damage in ("cut-short", "wrong-types"):
        assert store.config.capacity == SMALL["capacity"]
    assert_intact(store, KEYS)
    store.put(b"after repair", b"works")
    assert store.get(b"after repair") == b"works"
    store.close()
    assert fsck(store_dir).clean


def test_leftover_temp_files_are_cleaned_on_reopen(open_store: Any, store_dir: Path) -> None:
    """A writer killed inside an atomic publish leaves ``NAME.tmpPID`` behind."""
    store = open_store()
    populate(store)
    store.close()
    for name in ("stats.json.tmp99999", "index-int-0.bin.tmp99999", "store.json.tmp99999",
                 "segments/0000000001.sum.tmp99999"):
        (store_dir / name).write_bytes(b"half")
    store = open_store()
    assert_intact(store, KEYS)
    store.close()
    report = fsck(store_dir)
    assert report.clean, report.problems


def test_only_the_stores_own_temp_files_are_removed_at_open(store_dir: Path) -> None:
    """Every open deleted any name holding ".tmp" in the store folder and segments/ (a
    user's notes.tmpl); it removes only the temp names of the store's own atomic publishes."""
    Store.open(store_dir, **SMALL).close()
    kept = ["notes.tmpl", "segments/x.tmp", "my.tmp12345", "stats.json.tmp", "x.json.tmp1",
            "segments/1.sum.tmp5", "segments/0000000001.sum.tmpl"]
    for name in kept:
        (store_dir / name).write_bytes(b"mine")
    leftovers = ["segments/0000000001.sum.tmp12345", "stats.json.tmp12345"]
    for name in leftovers:
        (store_dir / name).write_bytes(b"half")
    Store.open(store_dir, **SMALL).close()
    assert all((store_dir / name).read_bytes() == b"mine" for name in kept)
    assert not any((store_dir / name).exists() for name in leftovers)


def test_files_a_store_does_not_write_are_reported_and_kept(open_store: Any,
                                                           store_dir: Path) -> None:
    """The finding (attack helper 47): stray files in segments/ (an id of 22 digits, a name
    that is no number, a negative one) were passed over and fsck said
    clean. They are a problem now, never removed (not lcache's), and the store opens as it
    did, passing them over."""
    store = open_store()
    populate(store)
    store.close()
    # 999.sum was read as 0000000999.sum, a summary without a log, whose removal at open
    # was a bare FileNotFoundError
    stray = ["segments/9999999999999999999999.log", "segments/zzz.log", "segments/-1.log",
             "segments/1.sum", "segments/999.sum", "notes.txt"]
    for name in stray:
        (store_dir / name).write_bytes(b"mine")
    for repair in (False, True):
        report = fsck(store_dir, repair=repair)
        assert not report.clean
        assert sorted(report.problems) == sorted(
            f"{store_dir / name} is not a file a store writes; lcache leaves it alone: move "
            "it out of the store" for name in stray)
        assert report.repaired == []  # left alone: not said to be repaired (helper 98)
    store = open_store()
    assert_intact(store, KEYS)
    store.close()
    assert all((store_dir / name).read_bytes() == b"mine" for name in stray)


@pytest.mark.parametrize("name", ["0000000000.log", "4294967295.log", "dir:0000000077.log",
                                  "dir:0000000001.log.tmp5", "dir:0000000099.sum"])
def test_segment_names_no_store_writes_are_passed_over(open_store: Any, store_dir: Path,
                                                       name: str) -> None:
    """The findings (attack helper 100): a file of segment id 0 was recovered as a crashed
    segment, and its index locations, those of empty slots, put a journal entry for every
    empty slot; one of id 2**32 - 1 made every later put an OverflowError; a folder under a
    segment's name made every open and ``fsck --repair`` fail (IsADirectoryError, or a
    CorruptionError that said to run ``fsck --repair``). Each is foreign now: passed over,
    reported, kept."""
    store = open_store()
    populate(store)
    store.delete(KEYS[0])
    journal = store._journal().size()
    store.close()
    folder, _, file = name.rpartition(":")
    path = store_dir / "segments" / file
    path.mkdir() if folder else path.write_bytes(b"junk" * 30)
    for repair in (False, True):
        assert fsck(store_dir, repair=repair).problems == [
            f"{path} is not a file a store writes; lcache leaves it alone: move it out of "
            "the store"]
    store = open_store()
    assert store._journal().size() == journal
    assert_intact(store, KEYS[1:])
    assert store.get(KEYS[0]) is None
    store.put(b"after", b"works")
    assert store.get(b"after") == b"works"
    store.close()
    assert path.is_dir() if folder else path.read_bytes() == b"junk" * 30


def test_summary_without_log_is_removed(open_store: Any, store_dir: Path) -> None:
    store = open_store()
    populate(store)
    store.close()
    (store_dir / "segments" / "0000000999.sum").write_bytes(b"x")
    assert not fsck(store_dir).clean
    store = open_store()
    store.close()
    assert fsck(store_dir).clean


def test_rebuilt_index_leaves_out_keys_with_two_records(open_store: Any,
                                                         store_dir: Path) -> None:
    store = open_store()
    populate(store)
    store.put(4, b"new value of four")  # key 4 now has two records in the log
    store.close()
    flip_bit(faults.index_path(store_dir, "int"), 1, 2)
    assert fsck(store_dir, repair=True).clean
    store = open_store()
    assert store.get(4) is None  # which record is newer is unknown: a miss, not a stale value
    assert store.get(5) is not None
