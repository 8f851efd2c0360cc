"""How big a sample cache's parts are: its capacity (a size, or a fraction of the dataset),
its segments, the prefetch staging area, and the room the plan leaves the store
(``plan_overhead``) and its inverse (``capacity_for``, the capacity ``lcache advise`` gives
for a number of sample bytes)."""

from __future__ import annotations

import math
import re

from lcache.errors import ConfigError
from lcache.store import parse_size
from lcache.store.deletes import COMPACT_ABOVE
from lcache.store.record import HEADER_SIZE
from lcache.store.segment import SUMMARY_ENTRY, SUMMARY_HEAD

STAGING_WRITERS = 8
MIN_SEGMENTS = 40
DEFAULT_STAGING = 256 << 20

MAX_FRACTION = 100  # a capacity given as a fraction of the dataset is at most this
_PERCENT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*", re.ASCII)


def cache_capacity(capacity: int | float | str, dataset_bytes: int) -> int:
    """Bytes from a size (``"500GB"``, an int) or from a fraction of the dataset's bytes: a
    float (``0.4``) or a percentage (``"40%"``). Sizes stay ``parse_size``'s, which refuses
    ``"0.4"``: a fraction is a float or a percentage, never a bare string number."""
    if isinstance(capacity, str) and capacity.strip().endswith("%"):
        # not float(): it takes "1_0" and other scripts' digits
        number = _PERCENT.fullmatch(capacity)
        fraction = float(number.group(1)) / 100 if number else math.nan
        what = capacity
    elif isinstance(capacity, float):
        fraction, what = capacity, str(capacity)
    else:
        return parse_size(capacity, "capacity")
    if not (math.isfinite(fraction) and fraction > 0):
        raise ConfigError(f"cannot read {what!r} as a capacity: a fraction of the dataset is "
                          "a float above 0 (0.4) or a percentage (\"40%\")")
    if fraction > MAX_FRACTION:  # capacity=4e7 meant as bytes is 4e7 datasets
        raise ConfigError(f"capacity {what} is {fraction:g} times the dataset: a float is a "
                          f"fraction of it (at most {MAX_FRACTION}); give bytes as an int or "
                          "a size (\"40MB\")")
    return max(1, int(fraction * dataset_bytes))


def choose_segment_size(space: int, count: int, largest: int) -> int:
    """About ``space / count`` rounded down to a power of two, within 64 KiB..64 MiB, and
    room for at least four of the largest records."""
    size = 1 << (max(space // count, 64 << 10).bit_length() - 1)
    size = min(size, 64 << 20)
    while size < 4 * (largest + HEADER_SIZE):
        size *= 2
    return size


def staging_area(requested: int, capacity: int, largest: int, on_ssd: bool
                 ) -> tuple[int, int]:
    """Bytes and segment size of the prefetch staging area: ``requested``, with room for its
    writers; on the SSD it is carved out of the capacity, so kept to a 50th of it. About 64
    segments: each rank's prefetcher and its readers hold two (``staging_window``); with 16,
    the default 256 MiB left no window at all to 7 or more ranks of a node."""
    def sized(size: int) -> tuple[int, int]:
        segment = choose_segment_size(size, 64, largest)
        return max(size, (STAGING_WRITERS + 4) * segment), segment

    size, segment = sized(requested)
    return sized(min(size, capacity // 50)) if on_ssd else (size, segment)


def plan_overhead(segment_size: int, samples: int, writers: int, capacity: int) -> int:
    """What ``plan_capacity`` holds back of ``capacity``: one free segment and an active one
    per writer; the index (16 bytes a sample, and 64 KiB); the segments' summaries (17 bytes
    a sample and 40 a segment); and the delete journal between compactions (8 KiB). The
    store counts all of them against its capacity: without the summaries, a nearly full
    cache of small samples evicted samples the plan kept."""
    segments = capacity // segment_size + writers
    return segment_size * (2 + writers) + (16 + SUMMARY_ENTRY) * samples + (64 << 10) + \
        SUMMARY_HEAD * segments + 2 * COMPACT_ABOVE


def capacity_for(record_bytes: int, samples: int, largest: int, writers: int,
                 staging_on_ssd: bool = True) -> int:
    """The smallest capacity whose ``SampleCache.plan_capacity(writers)`` holds ``record_bytes``
    (records: samples + headers) of a new cache of ``samples`` samples, the largest
    ``largest`` bytes, sized as ``SampleCache`` sizes it. ``staging_on_ssd``: the prefetch
    staging area is carved out of the capacity (when /dev/shm has no room for it).

    The overheads grow with the capacity (segments are sized from it, staging takes a
    50th), so the shortfall is added until none is left: the plan's room minus the
    capacity never rises, so no smaller capacity holds the bytes."""
    def staging(capacity: int) -> int:  # SampleCache's staging_bytes on the SSD
        return staging_area(DEFAULT_STAGING, capacity, largest, True)[0] \
            if staging_on_ssd else 0

    capacity = max(1, record_bytes)
    while True:
        segment = choose_segment_size(capacity, 512, largest)
        room = capacity - staging(capacity) - plan_overhead(segment, samples, writers,
                                                            capacity)
        short = max(record_bytes - room, MIN_SEGMENTS * segment + staging(capacity)
                    - capacity)
        if short <= 0:
            return capacity
        capacity += short
