"""Store directory layout, configuration file and the node-wide meta lock.

::

    DIR/store.json           configuration (atomic publish)
    DIR/lock                 flock target; its first page holds shared counters (see MetaPage)
    DIR/stats.json           counters summed over processes at flush/close
    DIR/index-int-G.bin      flat index for int keys (generation G, see files.py)
    DIR/index-bytes-G.bin    hash index for byte keys
    DIR/deletes-G.bin        delete journal (see deletes.py)
    DIR/segments/NNNNNNNNNN.log   records
    DIR/segments/NNNNNNNNNN.sum   summary of a sealed segment (its existence = sealed)
"""

from __future__ import annotations

import errno
import json
import mmap
import numbers
import os
import re
import stat
import struct
import tempfile
from contextlib import suppress
from dataclasses import asdict, dataclass, fields, replace
from fractions import Fraction
from typing import Any

from lcache import jsondoc
from lcache.errors import (
    ConfigError,
    CorruptionError,
    DiskFullError,
    StoreFullError,
    StoreNotFoundError,
    StorePermissionError,
)
from lcache.io import close_file, pread_full, pwrite_full, read_and_close, sync_fd
from lcache.io.dirs import check_private_dir, private_dir
from lcache.io.publish import atomic_write
from lcache.store.files import STEMS, allocate, open_in_store
from lcache.store.hashindex import initial_slots, table_bytes
from lcache.store.index import INDEX_HEADER
from lcache.store.segment import (
    MAX_SEGMENT,
    holds_written_segment,
    list_segments,
    segment_file,
)

CONFIG_NAME = "store.json"
FORMAT = 1
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(i?)b?|b)?\s*$", re.IGNORECASE | re.ASCII)
#: The largest size: far beyond any disk or memory, and within numpy's int64 with room.
MAX_SIZE = 1 << 62
_SIZES_ALLOWED = ("a size is a whole number of bytes (4096) or a number with a unit (512KiB, "
                  "1.5GiB, 50GB; KiB/MiB/GiB are powers of 1024, KB/MB/GB of 1000)")


def parse_size(value: int | str, name: str | None = None) -> int:
    """Bytes from an int or a string such as ``"64MiB"``, ``"1.5GiB"``, ``"50GB"`` or ``"4096"``.

    ``KiB/MiB/GiB`` are powers of 1024; ``KB/MB/GB`` powers of 1000. A bare number is a whole
    number of bytes; a fraction needs a unit. At least one byte, at most ``MAX_SIZE``.

    Raises:
        ConfigError: anything else (``"0.4"``, 0, negatives, ``"nan"``, ``""``, ``True``,
            ``10**40``...), its message starting with ``name`` when given.
    """
    said = f"{name}: " if name else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral | str):
        raise ConfigError(f"{said}cannot read {value!r:.200} as a size: {_SIZES_ALLOWED}")
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ConfigError(f"{said}cannot read {value!r:.200} as a size: {_SIZES_ALLOWED}")
        number, unit, binary = m.groups()
        if unit is None:
            if "." in number:
                raise ConfigError(f"{said}cannot read {value!r} as a size: a bare number is a "
                                  f"whole number of bytes, and a fraction needs a unit; "
                                  f"{_SIZES_ALLOWED}")
            size = int(number)
        else:
            base = 1024 if binary else 1000
            size = int(Fraction(number) * base ** " kmgtp".index(unit.lower()))
    else:
        size = int(value)
    if size < 1:
        raise ConfigError(f"{said}{value!r} is not a size: a size is at least one byte; "
                          f"{_SIZES_ALLOWED}")
    if size > MAX_SIZE:  # 10**40 was taken as a capacity
        raise ConfigError(f"{said}{value!r:.60} is not a size: above 2**62 bytes (4 EiB), "
                          "more than any disk or memory holds")
    return size


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_decimal_size(n: float) -> str:
    """``n`` bytes in decimal units (kB, MB, GB...), 3 significant digits or more: the
    units of bandwidth and of the figures advice computes with."""
    for i, unit in enumerate(("B", "kB", "MB", "GB", "TB", "PB", "EB")):
        if abs(n) < 1000 ** (i + 1) or unit == "EB":
            x = n / 1000**i
            return f"{n:.0f} B" if not i else \
                f"{x:.2f} {unit}" if abs(x) < 10 else f"{x:.1f} {unit}"
    raise AssertionError("unreachable")


def index_floor(capacity: int) -> int:
    """Bytes on disk of a new store's indexes and delete journal: the int index's header
    page, the first hash table (sized from the capacity), the journal's first block."""
    return INDEX_HEADER + table_bytes(initial_slots(capacity)) + 4096


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """What a store is, fixed at creation except where noted.

    Attributes:
        capacity: hard bound on bytes on disk (segments, summaries, indexes, delete journal);
            may change on reopen (the open evicts in the policy's order to fit it, and open
            handles take it at their next segment).
        segment_size: bytes per segment file before it is sealed.
        max_writers: processes that may hold an active segment at once; may change on reopen.
        policy: eviction policy name (``fifo``, ``lru`` or ``planned``); may change on reopen.
        max_byte_keys: most byte keys the byte-key index grows to hold (``None``: as many as
            the capacity allows); may change on reopen.
    """

    capacity: int = 8 << 30
    segment_size: int = 64 << 20
    max_writers: int = 8
    policy: str = "lru"
    max_byte_keys: int | None = None

    def check_types(self) -> None:
        for name in ("capacity", "segment_size", "max_writers", "max_byte_keys"):
            value = getattr(self, name)
            if name == "max_byte_keys" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be a whole number, got {value!r}")
        if not isinstance(self.policy, str):
            raise ConfigError(f"policy must be a name, got {self.policy!r}")

    def minimum_capacity(self) -> int:
        return self.segment_size * (self.max_writers + 1) + index_floor(self.capacity)

    def validate(self, *, stored: bool = False) -> None:
        """Raise :class:`ConfigError` naming the first setting no store can have.

        Args:
            stored: the values were read from ``store.json`` rather than given by the caller:
                the message names the value found instead of saying what to raise.
        """
        self.check_types()
        if not 4096 <= self.segment_size <= 1 << 32:
            raise ConfigError(
                f"segment_size {format_size(self.segment_size)} must be between 4 KiB and 4 GiB"
            )
        if self.max_writers < 1:
            raise ConfigError(f"max_writers must be >= 1, got {self.max_writers}")
        if self.max_byte_keys is not None and self.max_byte_keys < 16:
            raise ConfigError(f"max_byte_keys must be >= 16, got {self.max_byte_keys}")
        segments = self.segment_size * (self.max_writers + 1)
        if self.capacity < self.minimum_capacity() and stored:
            raise ConfigError(
                f"capacity {self.capacity} is below the minimum "
                f"{format_size(self.minimum_capacity())} for segment_size "
                f"{format_size(self.segment_size)} x (max_writers {self.max_writers} + 1) "
                "plus the indexes")
        if self.capacity < self.minimum_capacity():
            raise ConfigError(
                f"cache capacity {format_size(self.capacity)} is smaller than one segment "
                f"({format_size(self.segment_size)}) x (writers ({self.max_writers}) + 1 for "
                f"compaction) = {format_size(segments)}, plus "
                f"{format_size(index_floor(self.capacity))} for the indexes; raise capacity, "
                "or lower segment_size or max_writers"
            )


# The files a store writes in its directory (a ``.tmpPID`` suffix is an interrupted atomic
# publish, ``.probe`` prepare_dir's probe or a new lock page before it is linked in;
# ``origin`` and ``users`` are a sample cache's staging area's): [0-9], not \d (which takes
# other scripts' digits), and \Z, not $ (which takes a name ending in a newline).
_OWN_TOP = re.compile(r"^(?:(?:store\.json|lock|stats\.json|origin|users|"
                      r"(?:index-int|index-bytes|deletes)-[0-9]+\.bin)(?P<temp>\.tmp[0-9]+)?|"
                      r"\.probe.*)\Z", re.DOTALL)


def temp_leftovers(path: str) -> list[str]:
    """The temp files of the store's own atomic publishes (``NAME.tmpPID`` of the names
    ``_OWN_TOP`` and ``segment_file`` take) in the store directory ``path`` and its
    ``segments``: only these are what a killed publish leaves; any other name there (a
    user's ``notes.tmpl``) is not the store's to delete."""
    found = [os.path.join(path, name) for name in sorted(os.listdir(path))
             if (m := _OWN_TOP.match(name)) is not None and m.group("temp") is not None]
    segments = os.path.join(path, "segments")
    found += [os.path.join(segments, name) for name in sorted(os.listdir(segments))
              if (seg := segment_file(name)) is not None and seg[2]]
    return [p for p in found if not stat.S_ISDIR(os.lstat(p).st_mode)]  # folders: not ours


def foreign_entries(path: str) -> list[str]:
    """The entries of the store directory ``path`` (and of its ``segments``) that no store
    writes, as paths: what must never be deleted with the store, nor passed over by fsck.
    Reads nothing but the two listings and the entries' types (a folder under a file's name
    is not the store's)."""
    found = [os.path.join(path, name) for name in sorted(os.listdir(path))
             if name != "segments" and not (_OWN_TOP.match(name) and
                                            stat.S_ISREG(os.lstat(os.path.join(path, name))
                                                         .st_mode))]
    segments = os.path.join(path, "segments")
    if os.path.isdir(segments) and not os.path.islink(segments):
        found += [os.path.join(segments, name) for name in sorted(os.listdir(segments))
                  if segment_file(name) is None or
                  not stat.S_ISREG(os.lstat(os.path.join(segments, name)).st_mode)]
    elif os.path.lexists(segments):
        found.append(segments)  # a file or a link under the folder's name
    return found


def _names_segments(path: str) -> bool:
    """Whether ``segments/`` holds a file under a name a store gives its segments (what its
    content is, ``holds_written_segment`` tells)."""
    try:
        logs, sums = list_segments(path)
    except OSError:
        return False
    return bool(logs or sums)


def has_store(path: str) -> bool:
    """Whether ``path`` looks like a store: its ``store.json``, or files named as segments
    (a store whose configuration was lost, for ``fsck --repair``). Creates nothing; what is
    there is then checked to be lcache's (``_refuse_foreign``)."""
    return os.path.lexists(os.path.join(path, CONFIG_NAME)) or _names_segments(path)


def _refuse_foreign(path: str) -> None:
    """Refuse a directory whose ``store.json`` or ``lock`` is not lcache's, before anything
    in it is created or changed: a folder named as a store may hold a user's files under
    those names (a ``lock`` was zero-padded to a page, and ``stats`` made ``segments/``).

    A directory with a valid configuration is a store; one with segments a store wrote
    (``holds_written_segment``: their content, not only their names) too, whatever else is
    lost (``fsck --repair`` rebuilds the rest from them). Otherwise nothing there is proven
    a store's, and an existing ``lock`` must be one lcache made (``lock_is_ours``).

    Raises:
        CorruptionError: ``store.json`` is not lcache's configuration and there are no
            segments a store wrote (no advice to run ``fsck --repair``: it has nothing to
            rebuild from).
        ConfigError: a ``lock`` lcache did not write.
    """
    try:
        config = load_config(path, repair_advice=False)
    except CorruptionError as exc:
        if holds_written_segment(path):
            return
        raise CorruptionError(
            f"{exc}, and {path} holds no segments: it is not an lcache store (or one with "
            "nothing to rebuild a configuration from), and nothing was changed; choose "
            "another directory, or restore store.json") from exc
    if config is not None or holds_written_segment(path):
        return
    lock = os.path.join(path, "lock")
    if os.path.lexists(lock) and not lock_is_ours(lock):
        raise ConfigError(
            f"{lock} is not the lock file of an lcache store, and a store there would "
            "overwrite it; nothing was changed: move it, or choose another directory")


def prepare_dir(path: str, create: bool) -> None:
    """Check (or create, owner-only) the store directory.

    Without ``create``, nothing is created or changed unless the directory already holds a
    store (``has_store``). Nothing in a directory is changed before its ``store.json`` and
    ``lock``, where present, are known to be lcache's (``_refuse_foreign``).

    Raises:
        StoreNotFoundError: no store there and ``create`` is false.
        StorePermissionError: not private to you (see ``lcache.io.dirs``), not writable, or
            its ``segments`` is a symbolic link.
        CorruptionError, ConfigError: see ``_refuse_foreign``.
    """
    if not create and not has_store(path):
        raise StoreNotFoundError(f"no lcache store in {path}")
    private_dir(path, "cache directory", create=create)
    _refuse_foreign(path)
    try:
        fd, probe = tempfile.mkstemp(prefix=".probe", dir=path)
        close_file(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StorePermissionError(
            f"the cache directory {path} is not writable ({exc.strerror}); "
            "fix its permissions or choose another directory"
        ) from exc
    segments = os.path.join(path, "segments")
    # made if missing, then checked whoever made it: a check for it first, then mkdir, was
    # a race that another process creating the store lost with a bare FileExistsError
    with suppress(FileExistsError):
        os.mkdir(segments, 0o700)
    if os.path.islink(segments):  # even one of ours: nothing inside a store is followed
        raise StorePermissionError(
            f"the segment directory {segments} is a symbolic link, and a store never follows "
            "one; remove the link (its target is not touched)")
    check_private_dir(segments, "segment directory")


def _config_error(cfg_path: str, why: str, repair_advice: bool) -> CorruptionError:
    root = os.path.dirname(cfg_path)
    advice = f"; run `lcache fsck --repair {root}` to rewrite it from what the store holds"
    return CorruptionError(f"{cfg_path} {why}{advice if repair_advice else ''}")


def load_config(path: str, *, repair_advice: bool = True) -> StoreConfig | None:
    """The stored configuration, or ``None`` if the directory has none yet.

    Args:
        repair_advice: end an error with the advice to run ``lcache fsck --repair``.

    Raises:
        CorruptionError: it is unreadable, not a configuration, a symbolic link, or holds a
            value no store can have (a capacity below the minimum, an unknown policy...).
    """
    cfg_path = os.path.join(path, CONFIG_NAME)
    try:
        fd = open_in_store(cfg_path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except CorruptionError as exc:
        if repair_advice:
            raise
        raise CorruptionError(re.split(r";? \(?run `lcache fsck", str(exc))[0]) from exc
    try:
        raw = jsondoc.loads(read_and_close(fd, 1 << 20))
    except (OSError, ValueError) as exc:
        raise _config_error(cfg_path, f"is unreadable ({exc})", repair_advice) from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise _config_error(cfg_path, f"is not an lcache store configuration (format {FORMAT})",
                            repair_advice)
    known = {f.name for f in fields(StoreConfig)}
    try:
        config = StoreConfig(**{k: raw[k] for k in known if k in raw})
        # every value, not only its type: a user never typed these, so the message says the
        # file is damaged and how to repair it rather than "raise capacity"
        config.validate(stored=True)
    except (TypeError, ConfigError) as exc:
        raise _config_error(cfg_path, f"is damaged ({exc})", repair_advice) from exc
    return config


def config_stamp(path: str) -> tuple[int, int, int] | None:
    """(inode, modification time, size) of the store's ``store.json``, None without one: a
    handle reads the file again only when it changed (``Space._follow_capacity``)."""
    try:
        st = os.stat(os.path.join(path, CONFIG_NAME))
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


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
        if "segment_size" in given and given["segment_size"] != stored.segment_size:
            raise ConfigError(
                f"segment_size is fixed when a store is created ({stored.segment_size}); "
                f"got {given['segment_size']}: use a new directory to change it"
            )
        config = replace(stored, **given)
    config.validate()
    return config


_FIELD_RE = re.compile(r'"(\w+)"\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+|null)')


def salvage_config(root: str, largest_segment: int) -> StoreConfig:
    """A configuration for a store whose ``store.json`` is damaged or missing (fsck --repair).

    Each setting still readable in the damaged file and valid is kept (a file cut short keeps
    the settings before the cut); the others (of the wrong type or out of range: a capacity
    below one byte, max_writers below 1...) get their defaults, except
    ``segment_size``: the smallest power of two (at least 4 KiB) that holds the largest segment
    file found, or the default when there is none. A capacity that is a size but below the
    minimum is raised to the minimum.
    """
    try:
        fd = open_in_store(os.path.join(root, CONFIG_NAME), os.O_RDONLY)
        text = read_and_close(fd, 1 << 20).decode("utf-8", "replace")
    except (OSError, CorruptionError):
        text = ""
    try:
        doc = jsondoc.loads(text)
        found = doc if isinstance(doc, dict) else {}
    except ValueError:
        found = {m.group(1): jsondoc.loads(m.group(2)) for m in _FIELD_RE.finditer(text)}
    defaults = StoreConfig()
    kept: dict[str, Any] = {}
    for setting in fields(StoreConfig):
        name = setting.name
        if name in found:
            try:
                replace(defaults, **{name: found[name]}).check_types()
                kept[name] = found[name]
            except (ConfigError, TypeError):
                pass
    seg = kept.get("segment_size")
    if not isinstance(seg, int) or not 4096 <= seg <= 1 << 32 or seg < largest_segment:
        seg = defaults.segment_size if not largest_segment else \
            max(4096, 1 << (largest_segment - 1).bit_length())
    kept["segment_size"] = seg
    if kept.get("capacity", 1) < 1:
        del kept["capacity"]
    if kept.get("max_writers", 1) < 1:
        del kept["max_writers"]
    if kept.get("max_byte_keys") is not None and kept["max_byte_keys"] < 16:
        del kept["max_byte_keys"]
    config = replace(defaults, **kept)
    if config.capacity < config.minimum_capacity():
        config = replace(config, capacity=config.minimum_capacity())
    config.validate()
    return config


# The mark at the end of the first 4 KiB of a lock page lcache made (the shared words sit at
# its start): how a store being created tells its own ``lock`` from a user's file of that name.
_LOCK_MARK = b"lcache lock page"
_LOCK_MARK_AT = 4096 - len(_LOCK_MARK)


def lock_is_ours(path: str) -> bool:
    """Whether ``path`` is a regular file lcache made as a store's lock: one with the mark;
    or, as lcache made them before the mark, an empty one (a creation killed right after
    making it, or, before locks were synced, its page lost to a power cut) or one page with
    nothing past the shared words (``MetaPage``). Locks of stores made before the mark are
    also known by the store around them."""
    try:
        fd = open_in_store(path, os.O_RDONLY)
    except (OSError, CorruptionError):
        return False
    try:
        size = os.fstat(fd).st_size
        mark = bytearray(len(_LOCK_MARK))
        if size == 0 or (pread_full(fd, _LOCK_MARK_AT, memoryview(mark)) == len(mark) and
                         mark == _LOCK_MARK):
            return True
        if size != mmap.PAGESIZE:
            return False
        page = bytearray(size)
        return pread_full(fd, 0, memoryview(page)) == size and \
            not any(page[MetaPage.WORDS_END:])
    except OSError:
        return False
    finally:
        close_file(fd)


def _open_lock(path: str) -> int:
    """Open the ``lock`` file, making it if missing. A new one appears whole, its page
    written (so never a hole of the mapping, see ``files.allocate``) and marked: it is built
    under a temp name and hard-linked in, so a process creating the store beside us never
    sees an empty ``lock`` it would take for a user's file."""
    while True:
        try:
            return open_in_store(path, os.O_RDWR)
        except FileNotFoundError:
            pass
        fd, tmp = tempfile.mkstemp(prefix=".probe-lock", dir=os.path.dirname(path))
        try:
            page = bytearray(max(mmap.PAGESIZE, 4096))
            page[_LOCK_MARK_AT:_LOCK_MARK_AT + len(_LOCK_MARK)] = _LOCK_MARK
            pwrite_full(fd, 0, [page], "cache-meta")
            # its page is on disk before its name: after a power cut, never an empty lock (or
            # one without the mark) where a store was made. Once per store, so always.
            sync_fd(fd, io_class="cache-meta")
            close_file(fd)
            fd = -1
            with suppress(FileExistsError):  # another process made it first: use theirs
                os.link(tmp, path)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(f"no space left on the device for {path}") from exc
            raise
        finally:
            if fd >= 0:
                close_file(fd)
            os.unlink(tmp)


class MetaPage:
    """The ``lock`` file: an ``flock`` target whose first page holds shared u64 words.

    ``next_segment`` makes segment ids unique forever (a reader's cached descriptor of a deleted
    segment can never be confused with a new one); ``gc_generation`` tells readers that
    segments were deleted so they drop descriptors of unlinked files; ``holder`` names the
    store handle that last took the lock, so a handle that finds its own name there knows no
    other changed the segments since (``space.py`` keeps its listing of them); one word per
    file that is replaced by generations (``files.py``) holds its current generation. The
    page is allocated for real when the file is opened, so it is never a hole of the mapping
    (see ``files.allocate``).
    """

    _WORD = struct.Struct("<Q")
    _WORDS = {"next_segment": 0, "gc_generation": 1} | \
        {s: 2 + i for i, s in enumerate(STEMS)} | {"holder": 2 + len(STEMS)}
    #: Where the shared words end: the rest of the page is zeros (and the mark, see
    #: ``lock_is_ours``).
    WORDS_END = 8 * len(_WORDS)

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = _open_lock(path)
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):
                raise CorruptionError(f"{path} is not a regular file; remove it (run "
                                      f"`lcache fsck --repair {os.path.dirname(path)}`)")
            allocate(self.fd, path, 0, mmap.PAGESIZE)
            if os.fstat(self.fd).st_size < mmap.PAGESIZE:  # where fallocate is not supported
                os.ftruncate(self.fd, mmap.PAGESIZE)
            self._mm = mmap.mmap(self.fd, mmap.PAGESIZE)
        except BaseException:
            close_file(self.fd)
            raise

    def _get(self, word: str) -> int:
        value: int = self._WORD.unpack_from(self._mm, 8 * self._WORDS[word])[0]
        return value

    def _set(self, word: str, value: int) -> None:
        self._WORD.pack_into(self._mm, 8 * self._WORDS[word], value)

    def take_segment_id(self, at_least: int) -> int:
        """A new segment id; the caller holds the lock.

        Raises:
            StoreFullError: the ids are used up (or the counter was damaged past them).
        """
        seg = max(self._get("next_segment"), at_least, 1)
        if seg > MAX_SEGMENT:
            raise StoreFullError(
                f"{os.path.dirname(self.path)} has used every segment id (up to "
                f"{MAX_SEGMENT:,}; the next would be {seg:,}): copy what it holds into a new "
                "store")
        self._set("next_segment", seg + 1)
        return seg

    @property
    def next_segment(self) -> int:
        """The id the next new segment gets (at least), at most ``MAX_SEGMENT + 1``: a
        delete's floor, which must fit 32 bits. A counter damaged past it made a delete
        raise struct.error after its key had left the index and before it was journaled,
        so an index rebuilt from the segments served the key again (attack helper 102);
        the highest floor hides every record of the key, which only errs toward a miss."""
        return min(max(self._get("next_segment"), 1), MAX_SEGMENT + 1)

    def ensure_next_segment(self, at_least: int) -> None:
        """After a lost ``lock``: ids continue above the segments on disk (lock held)."""
        if self._get("next_segment") < at_least:
            self._set("next_segment", at_least)

    @property
    def gc_generation(self) -> int:
        return self._get("gc_generation")

    def bump_gc_generation(self) -> None:
        self._set("gc_generation", self._get("gc_generation") + 1)

    def take_over(self, token: int) -> bool:
        """Record ``token`` as the lock's holder (the caller holds the lock); True if it
        already was: nobody else held the lock since."""
        if self._get("holder") == token:
            return True
        self._set("holder", token)
        return False

    def generation(self, stem: str) -> int:
        return self._get(stem)

    def set_generation(self, stem: str, gen: int) -> None:
        self._set(stem, gen)

    def close(self) -> None:
        self._mm.close()
        close_file(self.fd)
