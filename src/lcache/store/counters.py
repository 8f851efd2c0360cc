"""Counters every store keeps, as plain numbers (per process; summed into stats.json)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, fields

from lcache import jsondoc
from lcache.io import read_and_close
from lcache.io.publish import atomic_write
from lcache.store.files import open_in_store

STATS_NAME = "stats.json"
log = logging.getLogger("lcache")


@dataclass(slots=True)
class Counters:
    puts: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    deletes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    gc_segments: int = 0
    gc_bytes_copied: int = 0
    verify_failures: int = 0
    recovered_segments: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def minus(self, other: Counters) -> Counters:
        return Counters(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                           for f in fields(self)})

    def copy(self) -> Counters:
        return Counters(**asdict(self))


def read_totals(root: str) -> Counters:
    """Counters summed over every process that flushed or closed this store."""
    try:
        raw = jsondoc.loads(read_and_close(open_in_store(os.path.join(root, STATS_NAME),
                                                      os.O_RDONLY), 1 << 20))
        return Counters(**{f.name: int(raw.get(f.name, 0)) for f in fields(Counters)})
    except (OSError, ValueError, TypeError, AttributeError, OverflowError):
        # advisory: a bad one reads as 0 (1e400 is infinity, which no int holds)
        return Counters()


def add_to_totals(root: str, delta: Counters) -> None:
    """Add ``delta`` to stats.json; the caller holds the meta lock."""
    totals = read_totals(root)
    for f in fields(Counters):
        setattr(totals, f.name, getattr(totals, f.name) + getattr(delta, f.name))
    atomic_write(os.path.join(root, STATS_NAME), json.dumps(totals.as_dict()).encode(),
                 io_class="cache-meta", durable=False)


class RateLimitedWarning:
    """Logs the first ``burst`` occurrences, then one in every ``every``."""

    def __init__(self, burst: int = 5, every: int = 1000) -> None:
        self.count = 0
        self.burst = burst
        self.every = every

    def __call__(self, message: str, *args: object) -> None:
        self.count += 1
        if self.count <= self.burst or self.count % self.every == 0:
            log.warning(message + " (occurrence %d)", *args, self.count)
