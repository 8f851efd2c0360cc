"""``lcache fsck``: check a store's consistency, and repair what can be repaired.

Checked: the configuration (``store.json``); symbolic links among the store's files (never
followed); every sealed segment's summary and every record it lists (header, key, checksum);
segments left unsealed by a crashed writer; the index files (header, size) and every entry
(pointing at a missing segment, past a segment's end or at a damaged record); the delete
journal; leftover temp files and files of a replaced generation; files a store does not write
(reported, never removed).

Repair removes the links, rewrites a damaged or missing ``store.json`` (``layout.salvage_config``
says from what; a store whose ``store.json`` cannot be read and that holds no segment is
refused, not made a fresh store), seals orphans (cutting torn tails), rebuilds bad summaries
by a scan, drops index entries that cannot be served (those keys become misses), truncates
trailing garbage, deletes leftovers, rewrites a damaged journal with its intact entries, and
rebuilds a damaged or missing index from the intact records of the segments and the delete
journal (see ``_rebuild``). Segments held by a live writer are not judged.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import numpy as np

from lcache.checks import flag, path_argument
from lcache.errors import CorruptionError, StoreNotFoundError
from lcache.io import close_file, fsync_dir, pread_full, pwrite_full, sync_fd
from lcache.io.files import kind_of
from lcache.store import record
from lcache.store.deletes import DeleteJournal, decode, encode, journal_body, write_journal
from lcache.store.files import (
    current_generation,
    generation_path,
    open_in_store,
    stale_generation_files,
)
from lcache.store.hashindex import HashIndex, initial_slots
from lcache.store.index import IntIndex, pack_loc
from lcache.store.layout import (
    CONFIG_NAME,
    MetaPage,
    StoreConfig,
    foreign_entries,
    has_store,
    load_config,
    prepare_dir,
    salvage_config,
    save_config,
    temp_leftovers,
)
from lcache.store.segment import (
    Summary,
    list_segments,
    log_path,
    read_summary,
    scan_log,
    segments_dir,
    sum_path,
    try_lock,
    write_summary,
)

_Index = TypeVar("_Index", IntIndex, HashIndex)


@dataclass
class FsckReport:
    path: str
    segments: int = 0
    active_segments: int = 0
    records: int = 0
    indexed_keys: int = 0
    dead_bad_records: int = 0
    problems: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "clean": self.clean}


def fsck(path: str, repair: bool = False) -> FsckReport:
    """Check the store at ``path``; with ``repair``, fix what was found and check again.

    Raises:
        ConfigError: ``path`` is not a path (``""``, None) or ``repair`` not a bool.
        StoreNotFoundError: ``path`` holds no store (nothing is created there).
        CorruptionError: the ``lock`` file is not a regular file and ``repair`` is false.
    """
    root = os.path.abspath(path_argument(path, "path"))
    repair = flag(repair, "repair")  # "no" is truthy: it would repair
    if not has_store(root):
        raise StoreNotFoundError(f"no lcache store in {root}")
    unreadable = _config_without_segments(root)
    if unreadable is not None:
        # Nothing to rebuild a configuration from: repair would invent one (a fresh empty
        # store of the default size) and call it clean. Nothing is created or changed.
        if repair:
            raise CorruptionError(f"cannot repair {root}: {unreadable} and the store holds "
                                  "no segments to rebuild one from; restore store.json, or "
                                  "remove the folder and open a new store")
        return FsckReport(root, problems=[f"{unreadable}; the store holds no segments, so "
                                          "there is nothing else to check"])
    prepare_dir(root, create=False)
    fixed_lock = _check_lock_file(root, repair)
    meta = MetaPage(os.path.join(root, "lock"))
    try:
        fcntl.flock(meta.fd, fcntl.LOCK_EX)
        meta.take_over(0)  # a repair may change segments: open stores list them again
        if not repair:
            return _Checker(root, meta, fix=False).run()
        first = _Checker(root, meta, fix=True).run()
        final = _Checker(root, meta, fix=False).run()
        # what the repair left (a file lcache did not write) is a problem, not repaired
        final.repaired = fixed_lock + [p for p in first.problems if p not in final.problems]
        return final
    finally:
        meta.close()


def _config_without_segments(root: str) -> str | None:
    """What is wrong with ``store.json`` when it cannot be read and no segment file is there
    (the store's data, from which a configuration could be rebuilt); else None."""
    try:
        load_config(root)
        return None
    except CorruptionError as exc:
        # its advice to run fsck --repair is this very command: cut, however it is put
        damage = re.split(r";? \(?run `lcache fsck", str(exc))[0]
    try:
        logs, sums = list_segments(root)
    except OSError:
        logs, sums = [], set()
    if logs or sums:  # a name no store gives (a user's build.log) is no segment
        return None
    return damage


def _check_lock_file(root: str, repair: bool) -> list[str]:
    """The ``lock`` file must be a regular file (never followed); repair replaces it."""
    path = os.path.join(root, "lock")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return []
    if stat.S_ISREG(mode):
        return []
    what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
    if not repair or stat.S_ISDIR(mode):
        raise CorruptionError(f"{path} is {what}; " + (
            "remove it by hand" if stat.S_ISDIR(mode) else
            f"run `lcache fsck --repair {root}` to replace it"))
    os.unlink(path)
    return [f"{path} was {what}"]


class _Checker:
    def __init__(self, root: str, meta: MetaPage, fix: bool) -> None:
        self.root = root
        self.meta = meta
        self.fix = fix
        self.report = FsckReport(root)
        self.config = StoreConfig()
        self.ints: IntIndex | None = None
        self.hashes: HashIndex | None = None
        # loc -> (kind, key64, length) of every intact record of a sealed segment
        self.good: dict[int, tuple[int, int, int]] = {}
        self.bad: set[int] = set()
        self.bad_indexed: set[int] = set()
        self.sizes: dict[int, int] = {}
        self.active: set[int] = set()
        self.active_keys: set[tuple[int, int]] = set()  # (kind, key64) in live writers' segments
        self.links: set[str] = set()

    def problem(self, text: str) -> None:
        self.report.problems.append(text)

    def run(self) -> FsckReport:
        self._check_links()
        self._check_config()
        self._check_leftovers()
        logs, sums = list_segments(self.root)
        self.report.segments = len(logs)
        for seg in logs:
            if log_path(self.root, seg) not in self.links:
                self._check_segment(seg, seg in sums)
        for seg in sums - set(logs):
            self.problem(f"segment {seg}: summary without a log")
            if self.fix:
                os.unlink(sum_path(self.root, seg))
        floors = self._check_journal()
        self.ints = self._open_index(IntIndex, record.KIND_INT, floors)
        self.hashes = self._open_index(HashIndex, record.KIND_BYTES, floors)
        self._check_index()
        for index in (self.ints, self.hashes):
            if index is not None:
                if self.fix:
                    index.flush()
                index.close()
        return self.report

    # ------------------------------------------------------------------ files
    def _check_links(self) -> None:
        """Nothing inside a store is a symbolic link, a FIFO, a socket or a device (opening
        one could block or never end); repair removes them (not a link's target)."""
        for folder in (self.root, segments_dir(self.root)):
            for name in sorted(os.listdir(folder)):
                path = os.path.join(folder, name)
                mode = os.lstat(path).st_mode
                if stat.S_ISLNK(mode):
                    self.problem(f"{path} is a symbolic link (never followed)")
                elif stat.S_ISREG(mode) or stat.S_ISDIR(mode):
                    continue
                else:
                    self.problem(f"{path} is {kind_of(mode)}, not a regular file")
                self.links.add(path)
                if self.fix:
                    os.unlink(path)

    def _check_config(self) -> None:
        cfg_path = os.path.join(self.root, CONFIG_NAME)
        config: StoreConfig | None
        try:
            config = None if cfg_path in self.links else load_config(self.root)
            if config is None and cfg_path not in self.links:
                self.problem(f"{cfg_path} is missing")
        except CorruptionError as exc:
            self.problem(str(exc).split("; run `lcache fsck")[0])
            config = None
        if config is None:
            logs, _ = list_segments(self.root)
            largest = max((os.lstat(log_path(self.root, s)).st_size for s in logs), default=0)
            config = salvage_config(self.root, largest)
            if self.fix:
                save_config(self.root, config)
        self.config = config

    def _check_leftovers(self) -> None:
        foreign = set(foreign_entries(self.root)) - self.links
        for path in sorted(foreign):
            # Not the store's (a store opens as if it were not there): never removed.
            self.problem(f"{path} is not a file a store writes; lcache leaves it alone: move "
                         "it out of the store")
        for path in temp_leftovers(self.root):
            if path not in foreign:
                self.problem(f"leftover temp file {path}")
                if self.fix:
                    os.unlink(path)
        for path in stale_generation_files(self.root, self.meta):
            self.problem(f"leftover {path} of a replaced index or journal")
            if self.fix:
                os.unlink(path)

    # ------------------------------------------------------------------ segments
    def _check_segment(self, seg: int, sealed: bool) -> None:
        path = log_path(self.root, seg)
        fd = open_in_store(path, os.O_RDWR if self.fix else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if not sealed:
                if not try_lock(fd):
                    self.active.add(seg)
                    self.report.active_segments += 1
                    live = scan_log(fd, seg, size)  # its keys: a rebuild must not pick others
                    self.active_keys.update(zip(live.kinds.tolist(), live.keys.tolist(),
                                                strict=True))
                    return
                summary = scan_log(fd, seg, size)
                self.problem(f"segment {seg}: left unsealed by a crashed writer"
                             f" ({size - summary.data_len} torn bytes)")
                if self.fix:  # unsealed: no reader maps it, so it may shrink in place
                    self._truncate(fd, size, summary.data_len)
                    write_summary(self.root, summary, durable=True)
            else:
                try:
                    summary = read_summary(self.root, seg)
                except CorruptionError as exc:
                    self.problem(str(exc))
                    summary = scan_log(fd, seg, size)
                    if self.fix:
                        self._cut_sealed(path, fd, size, summary.data_len)
                        write_summary(self.root, summary, durable=True)
                        size = summary.data_len
                if size > summary.data_len:
                    self.problem(f"segment {seg}: {size - summary.data_len} bytes past its end")
                    if self.fix:
                        self._cut_sealed(path, fd, size, summary.data_len)
            self.sizes[seg] = summary.data_len
            self._check_records(fd, summary)
        finally:
            close_file(fd)

    def _truncate(self, fd: int, size: int, data_len: int) -> None:
        if size > data_len:
            os.ftruncate(fd, data_len)
            sync_fd(fd, False, "cache-fsck")

    def _cut_sealed(self, path: str, fd: int, size: int, data_len: int) -> None:
        """Replace a sealed segment by a copy of its first ``data_len`` bytes. Never in place:
        other processes may have it memory-mapped, and a page cut from under a mapping is a
        SIGBUS when touched; they keep the old file until they drop it."""
        if size <= data_len:
            return
        tmp = f"{path}.tmp{os.getpid()}"
        out = open_in_store(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            done = 0
            while done < data_len:
                chunk = bytearray(min(data_len - done, 8 << 20))
                n = pread_full(fd, done, memoryview(chunk), "cache-fsck")
                if n <= 0:
                    break
                pwrite_full(out, done, [memoryview(chunk)[:n]], "cache-fsck")
                done += n
            sync_fd(out, False, "cache-fsck")
        finally:
            close_file(out)
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))

    def _check_records(self, fd: int, summary: Summary) -> None:
        data = bytearray(summary.data_len)
        n = pread_full(fd, 0, memoryview(data), "cache-fsck")
        view = memoryview(data)[:n]
        for key, off, length, kind in zip(summary.keys.tolist(), summary.offsets.tolist(),
                                          summary.lengths.tolist(), summary.kinds.tolist(),
                                          strict=True):
            loc = pack_loc(summary.segment, off)
            head = record.verify_any(view[off : off + length])
            if head is None or head.key64 != key or head.size != length or head.kind != kind:
                self.bad.add(loc)
            else:
                self.good[loc] = (kind, key, length)
            self.report.records += 1

    # ------------------------------------------------------------------ journal and indexes
    def _check_journal(self) -> dict[int, dict[int, int]]:
        """The delete journal's entries, as {kind: {key64: highest floor}}."""
        gen = current_generation(self.root, self.meta, DeleteJournal.STEM)
        path = generation_path(self.root, DeleteJournal.STEM, gen)
        floors: dict[int, dict[int, int]] = {record.KIND_INT: {}, record.KIND_BYTES: {}}
        if path in self.links or not os.path.lexists(path):
            self.problem(f"{path} (the delete journal) is missing")
            body, broken = b"", True
        else:
            body = journal_body(path)
            try:
                DeleteJournal(self.root, self.meta).close()
                broken = False
            except CorruptionError as exc:
                self.problem(str(exc).split("; run `lcache fsck")[0])
                broken = True
        kinds, keys, entry_floors, bad = decode(body)
        if bad:
            self.problem(f"{path}: {bad} bytes of damaged entries")
        if self.fix and (broken or bad):
            write_journal(self.root, self.meta, gen + 1, encode(kinds, keys, entry_floors))
        for kind, key, floor in zip(kinds.tolist(), keys.tolist(), entry_floors.tolist(),
                                    strict=True):
            mine = floors[kind]
            mine[key] = max(mine.get(key, 0), floor)
        return floors

    def _open_index(self, cls: type[_Index], kind: int,
                    floors: dict[int, dict[int, int]]) -> _Index | None:
        try:
            return cls(self.root, self.meta, create=False)
        except CorruptionError as exc:
            text = str(exc).split("; run `lcache fsck")[0]
            if not self.report.records:  # not "while segments hold records" when none do
                text = text.replace(" while segments hold records", "")
            self.problem(text)
            if not self.fix:
                return None
        self._rebuild(kind, floors[kind])
        return cls(self.root, self.meta, create=False)

    def _rebuild(self, kind: int, floors: dict[int, int]) -> None:
        """Publish an index of ``kind`` holding every key that has exactly one intact record
        in the sealed segments, unless that record lies below the floor of a delete of the key.

        The log does not say which of two records of one key was written last (writers
        interleave across segments), so such keys are left out, and so are keys with a record
        in a live writer's segment: a miss, never a stale value; they are journaled like a
        delete, so a later rebuild, once the older record is gone, does not serve the other
        either. A record below a delete's floor may predate the delete (``deletes.py``): left
        out, so a deleted key stays deleted.
        """
        found: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for loc, (k, key, length) in self.good.items():
            if k == kind:
                found[key].append((loc, length))
        keys, locs, lens = [], [], []
        ambiguous: list[tuple[int, int]] = []
        for key, recs in found.items():
            if len(recs) != 1 or (kind, key) in self.active_keys:
                ambiguous.append((kind, key))
                continue
            loc, length = recs[0]
            if loc >> 32 < floors.get(key, 0):
                continue
            keys.append(key)
            locs.append(loc)
            lens.append(length)
        self._journal(ambiguous)
        arrays = (np.array(keys, np.uint64), np.array(locs, np.uint64),
                  np.array(lens, np.uint32))
        if kind == record.KIND_INT:
            IntIndex.rebuild(self.root, self.meta, *arrays)
        else:
            HashIndex.rebuild(self.root, self.meta, *arrays,
                              min_slots=initial_slots(self.config.capacity))

    def _check_index(self) -> None:
        dropped: list[tuple[int, int]] = []
        for index, kind in ((self.ints, record.KIND_INT), (self.hashes, record.KIND_BYTES)):
            if index is None:
                continue
            if self.fix and isinstance(index, HashIndex):
                index.recount()  # its count of used slots may be off after a crash
            for key, loc, length in list(index.items()):
                seg, off = loc >> 32, loc & 0xFFFFFFFF
                if seg in self.active:
                    self.report.indexed_keys += 1
                    continue
                reason = self._entry_problem(kind, key, loc, length, seg, off)
                if reason is None:
                    self.report.indexed_keys += 1
                    continue
                self.problem(f"index entry for key {key}: {reason}")
                if self.fix and index.remove(key, loc):
                    dropped.append((kind, key))
        self.report.dead_bad_records = len(self.bad - self.bad_indexed)
        self._journal(dropped)  # an older record of the key may be in the log

    def _journal(self, keys: list[tuple[int, int]]) -> None:
        """Journal keys that leave the index while records of them stay in the log."""
        if keys:
            journal = DeleteJournal(self.root, self.meta)
            try:
                journal.append(keys, self.meta.next_segment)
                journal.sync()
            finally:
                journal.close()

    def _entry_problem(self, kind: int, key: int, loc: int, length: int, seg: int,
                       off: int) -> str | None:
        if seg not in self.sizes:
            return f"points at missing segment {seg}"
        if off + length > self.sizes[seg]:
            return f"points past the end of segment {seg}"
        if loc in self.bad:
            self.bad_indexed.add(loc)
            return f"points at a damaged record (segment {seg}, offset {off})"
        good = self.good.get(loc)
        if good is None or good != (kind, key, length):
            return f"points at segment {seg} offset {off}, where no such record starts"
        return None


__all__ = ["FsckReport", "fsck"]
