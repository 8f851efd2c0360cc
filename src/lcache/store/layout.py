"""Store directory layout, configuration file and the node-wide meta lock.

::

    DIR/store.json           configuration (atomic publish)
    DIR/lock                 flock target; its first page holds shared counters (see MetaPage)
    DIR/stats.json           counters summed over processes at flush/close
    DIR/index-int.bin        flat index for int keys
    DIR/index-bytes.bin      hash index for byte keys
    DIR/segments/NNNNNNNNNN.log   records
    DIR/segments/NNNNNNNNNN.sum   summary of a sealed segment (its existence = sealed)
"""

from __future__ import annotations

import json
import mmap
import numbers
import os
import re
import stat
import struct
import tempfile
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from typing import Any

from lcache.errors import (
    ConfigError,
    CorruptionError,
    StoreNotFoundError,
    StorePermissionError,
)
from lcache.io.dirs import check_private_dir, private_dir
from lcache.io.publish import atomic_write

CONFIG_NAME = "store.json"
FORMAT = 1
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(i?)b?|b)?\s*$", re.IGNORECASE)
_SIZES_ALLOWED = ("a size is a whole number of bytes (4096) or a number with a unit (512KiB, "
                  "1.5GiB, 50GB; KiB/MiB/GiB are powers of 1024, KB/MB/GB of 1000)")


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"64MiB"``, ``"1.5GiB"``, ``"50GB"`` or ``"4096"``.

    ``KiB/MiB/GiB`` are powers of 1024; ``KB/MB/GB`` powers of 1000. A bare number is a whole
    number of bytes; a fraction needs a unit. At least one byte.

    Raises:
        ConfigError: anything else (``"0.4"``, 0, negatives, ``"nan"``, ``""``, ``True``...).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral | str):
        raise ConfigError(f"cannot read {value!r} as a size: {_SIZES_ALLOWED}")
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ConfigError(f"cannot read {value!r} as a size: {_SIZES_ALLOWED}")
        number, unit, binary = m.groups()
        if unit is None:
            if "." in number:
                raise ConfigError(f"cannot read {value!r} as a size: a bare number is a whole "
                                  f"number of bytes, and a fraction needs a unit; "
                                  f"{_SIZES_ALLOWED}")
            size = int(number)
        else:
            base = 1024 if binary else 1000
            size = int(Fraction(number) * base ** " kmgtp".index(unit.lower()))
    else:
        size = int(value)
    if size < 1:
        raise ConfigError(f"{value!r} is not a size: a size is at least one byte; "
                          f"{_SIZES_ALLOWED}")
    return size


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """What a store is, fixed at creation except where noted.

    Attributes:
        capacity: hard bound on bytes on disk (segments, summaries, indexes); may change on reopen.
        segment_size: bytes per segment file before it is sealed.
        max_writers: processes that may hold an active segment at once; may change on reopen.
        policy: eviction policy name (``fifo`` or ``lru``); may change on reopen.
        max_byte_keys: slots of the byte-key hash index.
    """

    capacity: int = 8 << 30
    segment_size: int = 64 << 20
    max_writers: int = 8
    policy: str = "lru"
    max_byte_keys: int = 1 << 20

    def validate(self) -> None:
        if not 4096 <= self.segment_size <= 1 << 32:
            raise ConfigError(
                f"segment_size {format_size(self.segment_size)} must be between 4 KiB and 4 GiB"
            )
        if self.max_writers < 1:
            raise ConfigError(f"max_writers must be >= 1, got {self.max_writers}")
        if self.max_byte_keys < 16:
            raise ConfigError(f"max_byte_keys must be >= 16, got {self.max_byte_keys}")
        minimum = self.segment_size * (self.max_writers + 1)
        if self.capacity < minimum:
            raise ConfigError(
                f"cache capacity {format_size(self.capacity)} is smaller than one segment "
                f"({format_size(self.segment_size)}) x (writers ({self.max_writers}) + 1 for "
                f"compaction) = {format_size(minimum)}; raise capacity, or lower segment_size "
                "or max_writers"
            )


def prepare_dir(path: str, create: bool) -> None:
    """Check (or create, owner-only) the store directory.

    Raises:
        StoreNotFoundError: no store there and ``create`` is false.
        StorePermissionError: not private to you (see ``lcache.io.dirs``), or not writable.
    """
    if not os.path.lexists(path) and not create:
        raise StoreNotFoundError(f"no lcache store at {path}")
    private_dir(path, "cache directory", create=create)
    try:
        fd, probe = tempfile.mkstemp(prefix=".probe", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StorePermissionError(
            f"the cache directory {path} is not writable ({exc.strerror}); "
            "fix its permissions or choose another directory"
        ) from exc
    segments = os.path.join(path, "segments")
    if not os.path.lexists(segments):
        os.makedirs(segments, mode=0o700, exist_ok=True)
    check_private_dir(segments, "segment directory")


def load_config(path: str) -> StoreConfig | None:
    """The stored configuration, or ``None`` if the directory has none yet."""
    cfg_path = os.path.join(path, CONFIG_NAME)
    try:
        with open(cfg_path, "rb") as f:
            raw = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CorruptionError(f"{cfg_path} is unreadable: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CorruptionError(f"{cfg_path} is not an lcache store configuration (format {FORMAT})")
    fields = {k: raw[k] for k in StoreConfig.__dataclass_fields__ if k in raw}
    try:
        return StoreConfig(**fields)
    except TypeError as exc:
        raise CorruptionError(f"{cfg_path}: {exc}") from exc


def save_config(path: str, config: StoreConfig) -> None:
    doc: dict[str, Any] = {"format": FORMAT, **asdict(config)}
    atomic_write(os.path.join(path, CONFIG_NAME), json.dumps(doc, indent=1).encode(),
                 io_class="cache-meta")


def merge_config(stored: StoreConfig | None, overrides: dict[str, Any]) -> StoreConfig:
    """The configuration to use: stored values, with the changeable ones overridden."""
    given = {k: v for k, v in overrides.items() if v is not None}
    for key in ("capacity", "segment_size"):
        if key in given:
            given[key] = parse_size(given[key])
    if stored is None:
        config = StoreConfig(**given)
    else:
        for fixed in ("segment_size", "max_byte_keys"):
            if fixed in given and given[fixed] != getattr(stored, fixed):
                raise ConfigError(
                    f"{fixed} is fixed when a store is created ({getattr(stored, fixed)}); "
                    f"got {given[fixed]}: use a new directory to change it"
                )
        config = replace(stored, **given)
    config.validate()
    return config


class MetaPage:
    """The ``lock`` file: an ``flock`` target whose first page holds two shared u64 counters.

    ``next_segment`` makes segment ids unique forever (a reader's cached descriptor of a deleted
    segment can never be confused with a new one); ``gc_generation`` tells readers that
    segments were deleted so they drop descriptors of unlinked files.
    """

    _FIELDS = struct.Struct("<QQ")

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(self.fd).st_size < mmap.PAGESIZE:
            os.ftruncate(self.fd, mmap.PAGESIZE)
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            raise CorruptionError(f"{path} is not a regular file")
        self._mm = mmap.mmap(self.fd, mmap.PAGESIZE)

    def _get(self) -> tuple[int, int]:
        values: tuple[int, int] = self._FIELDS.unpack_from(self._mm, 0)
        return values

    def take_segment_id(self, at_least: int) -> int:
        """A new segment id; the caller holds the lock."""
        nxt, gen = self._get()
        seg = max(nxt, at_least, 1)
        self._FIELDS.pack_into(self._mm, 0, seg + 1, gen)
        return seg

    @property
    def gc_generation(self) -> int:
        return self._get()[1]

    def bump_gc_generation(self) -> None:
        nxt, gen = self._get()
        self._FIELDS.pack_into(self._mm, 0, nxt, gen + 1)

    def close(self) -> None:
        self._mm.close()
        os.close(self.fd)
