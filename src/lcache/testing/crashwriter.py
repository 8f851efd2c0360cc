"""A writer process for crash tests: run it, ``kill -9`` it at any moment, check the store.

    python -m lcache.testing.crashwriter DIR JOURNAL --seed N --version-base V [options]

It opens the store in DIR, prints ``ready`` and then loops forever over puts (int and byte keys,
mixed sizes, values from ``make_value(key, version)``), deletes, gets (checking every hit), and
now and then ``gc()``; every ``--flush-bytes`` of puts it calls ``flush()``.

The journal tells the parent what may be in the store, with two kinds of JSON lines:

* ``{"i": [op, key, version]}`` before every put/delete (plain ``write``, no fsync: a page-cache
  write survives ``kill -9``, and the parent only needs it to know which keys an unfinished
  operation may have touched);
* ``{"g": 1}`` before every ``gc()`` (no fsync, as intents): a gc copies live records of
  many segments, and the parent cannot bound those appends if the kill lands before the
  next flush line;
* ``{"f": appended}`` after ``flush()`` returned, ``fsync``'d: every intent line before it is
  durable. ``appended`` counts the bytes this store has appended in total (records put, records
  copied by GC or CLOCK, their summary entries), starting from ``--appended-base``; the parent
  uses it to bound what FIFO/CLOCK eviction may have removed.

Deletes only touch keys for which ``deletable(key)`` holds, so the parent knows that every
other key can only lose its record to eviction. Exit status 3 means a get returned wrong bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from lcache.store import Store
from lcache.testing.values import (
    SUMMARY_BYTES_PER_RECORD,
    key_from_repr,
    key_repr,
    make_value,
    parse_version,
    record_bytes,
    value_size,
)

Key = int | bytes
WRONG_BYTES = 3


def int_key(i: int) -> int:
    return i


def byte_key(i: int) -> bytes:
    return b"bk-%05d" % i


def deletable(key: Key) -> bool:
    """Keys the writer may delete: a fifth of each kind."""
    if isinstance(key, int):
        return key % 5 == 0
    return int(key[-5:]) % 5 == 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lcache.testing.crashwriter")
    p.add_argument("dir")
    p.add_argument("journal")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--version-base", type=int, default=0)
    p.add_argument("--appended-base", type=int, default=0)
    p.add_argument("--capacity", type=int, default=4 << 20)
    p.add_argument("--segment-size", type=int, default=64 << 10)
    p.add_argument("--max-writers", type=int, default=2)
    p.add_argument("--max-byte-keys", type=int, default=1024)
    p.add_argument("--policy", default="lru")
    p.add_argument("--int-keys", type=int, default=600)
    p.add_argument("--byte-keys", type=int, default=200)
    p.add_argument("--flush-bytes", type=int, default=64 << 10)
    p.add_argument("--gc-every", type=int, default=5, help="gc() before every Nth flush")
    return p.parse_args(argv)


class _Journal:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def intent(self, op: str, key: Key, version: int) -> None:
        os.write(self.fd, json.dumps({"i": [op, key_repr(key), version]}).encode() + b"\n")

    def gc(self) -> None:
        os.write(self.fd, b'{"g": 1}\n')

    def flushed(self, appended: int) -> None:
        os.write(self.fd, json.dumps({"f": appended}).encode() + b"\n")
        os.fsync(self.fd)


def appended_bytes(store: Store, base: int) -> int:
    """Bytes appended by this process's store, summary entries included (an upper bound)."""
    c = store.counters
    copied_records = c.gc_bytes_copied // (record_bytes(0, 16) - SUMMARY_BYTES_PER_RECORD)
    return (base + c.bytes_written + c.gc_bytes_copied
            + SUMMARY_BYTES_PER_RECORD * (c.puts + copied_records))


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    store = Store.open(
        args.dir, capacity=args.capacity, segment_size=args.segment_size,
        max_writers=args.max_writers, policy=args.policy, max_byte_keys=args.max_byte_keys,
    )
    journal = _Journal(args.journal)
    version = args.version_base
    unflushed = 0
    flushes = 0
    print("ready", flush=True)

    def pick() -> Key:
        if rng.random() < 0.7:
            return int_key(rng.randrange(args.int_keys))
        return byte_key(rng.randrange(args.byte_keys))

    def check(key: Key, got: bytes | memoryview | None) -> None:
        if got is not None and parse_version(key, got) is None:
            print(f"wrong bytes for {key!r}", file=sys.stderr, flush=True)
            os._exit(WRONG_BYTES)

    while True:
        r = rng.random()
        if r < 0.6:
            key = pick()
            version += 1
            journal.intent("put", key, version)
            value = make_value(key, version, value_size(key, version))
            store.put(key, value)
            unflushed += len(value)
        elif r < 0.68:
            key = pick()
            if deletable(key):
                version += 1
                journal.intent("del", key, version)
                store.delete(key)
        elif r < 0.93:
            key = pick()
            check(key, store.get(key))
        else:
            batch = [pick() for _ in range(rng.randrange(1, 24))]
            for key, got in zip(batch, store.get_many(batch), strict=True):
                check(key, got)
        if unflushed >= args.flush_bytes:
            flushes += 1
            if args.gc_every and flushes % args.gc_every == 0:
                journal.gc()
                store.gc(rng.choice([0.3, 0.5, 0.8]))
            store.flush()
            journal.flushed(appended_bytes(store, args.appended_base))
            unflushed = 0


# ---------------------------------------------------------------------------- parent side
@dataclass
class Durable:
    """What a key held at the last durability point the parent knows of."""

    present: bool
    version: int
    #: bytes the store had appended before the record was written (lower bound of its place)
    appended_before: int


@dataclass
class Verdict:
    checked: int = 0
    hits: int = 0
    must_be_present: int = 0
    failures: list[str] = field(default_factory=list)


@dataclass
class CrashModel:
    """The parent's knowledge of the store across rounds of ``kill -9``.

    Args:
        capacity, segment_size, max_writers: the store's configuration.
    """

    capacity: int
    segment_size: int
    max_writers: int
    durable: dict[Key, Durable] = field(default_factory=dict)
    appended: int = 0  # at the last flush the parent knows of (upper bound after a kill)
    version: int = 0  # highest version any writer may have used
    gc_unflushed: bool = False  # the last round's writer began a gc after its last flush

    def read_round(self, journal: str) -> dict[Key, list[tuple[str, int]]]:
        """Apply one round's journal; returns the unflushed intents (key -> [(op, version)])."""
        pending: dict[Key, list[tuple[str, int]]] = {}
        base = self.appended
        self.gc_unflushed = False
        try:
            with open(journal, "rb") as f:
                lines = f.read().split(b"\n")
        except FileNotFoundError:  # killed before it opened the journal
            lines = []
        for raw in lines:
            try:
                entry = json.loads(raw)
            except ValueError:
                continue  # empty, or the last line cut by the kill
            if "i" in entry:
                op, text, version = entry["i"]
                pending.setdefault(key_from_repr(text), []).append((op, int(version)))
                self.version = max(self.version, int(version))
            elif "g" in entry:
                self.gc_unflushed = True
            elif "f" in entry:
                for key, ops in pending.items():
                    op, version = ops[-1]
                    self.durable[key] = Durable(op == "put", version, base)
                pending = {}
                self.gc_unflushed = False
                base = self.appended = int(entry["f"])
        return pending

    def window(self, index_bytes: int) -> int:
        """Bytes appended after a record that FIFO/CLOCK eviction cannot have removed it in.

        A record is evicted only once its segment is the oldest and the sealed segments, the
        reservations of up to ``max_writers`` active ones, the compaction spare and the indexes
        no longer fit: so at least capacity - (max_writers + 3) x segment_size - index bytes
        were appended after it (one extra segment for the record's own segment).
        """
        return self.capacity - (self.max_writers + 3) * self.segment_size - index_bytes

    def unflushed_bound(self, pending: dict[Key, list[tuple[str, int]]]) -> int:
        """Most bytes the writer can have appended after its last flush."""
        put_bytes = sum(record_bytes(key, value_size(key, version))
                        for key, ops in pending.items() for op, version in ops if op == "put")
        allocations = put_bytes // self.segment_size + 2  # each may copy a segment forward
        per_copy = self.segment_size * 2  # summary entries of tiny records: < 2x
        # a gc cut short copied at most every live record, with its summary entry
        gc_copies = 2 * self.capacity if self.gc_unflushed else 0
        return put_bytes + allocations * per_copy + gc_copies

    def verify(self, store: Store, all_keys: Sequence[Key],
               pending: dict[Key, list[tuple[str, int]]], index_bytes: int) -> Verdict:
        """Check every key after a kill and fold what was seen into the durable state."""
        verdict = Verdict()
        appended_max = self.appended + self.unflushed_bound(pending)
        window = self.window(index_bytes)
        for key, got in zip(all_keys, store.get_many(list(all_keys)), strict=True):
            verdict.checked += 1
            seen = None if got is None else parse_version(key, got)
            if got is not None and seen is None:
                verdict.failures.append(f"{key!r}: {len(got)} bytes that were never written")
                continue
            known = self.durable.get(key)
            ops = pending.get(key, [])
            allowed = {known.version} if known is not None and known.present else set()
            allowed |= {version for op, version in ops if op == "put"}
            recent = (known is not None and known.present and not ops
                      and appended_max - known.appended_before <= window)
            verdict.must_be_present += int(recent)
            if seen is not None:
                verdict.hits += 1
                if seen not in allowed:
                    verdict.failures.append(
                        f"{key!r}: version {seen}, expected one of {sorted(allowed)} "
                        "(stale or deleted bytes came back)"
                    )
                    continue
            elif recent:
                assert known is not None
                verdict.failures.append(
                    f"{key!r}: version {known.version} was flushed at most "
                    f"{appended_max - known.appended_before} bytes before the kill, within the "
                    f"{window} bytes eviction cannot reach, and is missing"
                )
                continue
            # What was seen is durable now (the parent's close makes it so).
            if seen is None:
                self.durable[key] = Durable(False, 0, 0)
            elif known is None or not known.present or seen != known.version:
                self.durable[key] = Durable(True, seen, self.appended)
        self.appended = appended_max
        return verdict


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
