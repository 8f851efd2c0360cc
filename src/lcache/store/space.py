"""The store's space: what the segments on disk use, allocating a new segment after evicting
what the capacity bound requires, cleaning segments (copy forward the records worth keeping,
evict the rest), compacting the delete journal, sealing the segments of dead writers, and
``gc``.

A mixin of ``Store`` (the methods' ``self`` is the store), as ``reading.py`` is: every method
here runs under the store's meta lock, which the caller holds.
"""

from __future__ import annotations

import bisect
import logging
import os
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from lcache.checks import real_number
from lcache.errors import CorruptionError, StoreFullError
from lcache.io import BufferPool, SyncPolicy, close_file
from lcache.store.compaction import (
    copy_forward,
    evict_records,
    live_bytes,
    live_records,
    referenced_records,
)
from lcache.store.deletes import Needed
from lcache.store.files import open_in_store, stale_generation_files
from lcache.store.layout import StoreConfig, config_stamp, format_size, load_config
from lcache.store.parts import StoreParts
from lcache.store.recovery import remove_leftovers, seal_if_orphan
from lcache.store.segment import (
    SegmentWriter,
    Summary,
    list_segments,
    log_path,
    read_summary,
    scan_log,
    sum_path,
)

log = logging.getLogger("lcache")
GREEDY_WINDOW = 64  # segments a greedy policy compares when it must free space
GREEDY_RECORDS = 1 << 16  # records it may look up to find one with room, past the window
RELIST = 64  # surveys between listings of the directory even when nobody else changed it


@dataclass(slots=True)
class Listing:
    """The segments on disk as this store handle last listed them, kept up to date with its
    own changes: listing a directory of thousands of files for every new segment cost more
    than writing the segment's records. Every change to the segments is made under the meta
    lock, so the listing holds while no other handle took it (``MetaPage.take_over``)."""

    sealed: list[int]  # sorted ids of segments with a summary
    unsealed: list[int]  # segments of live writers, or of dead ones not yet recovered
    sealed_bytes: int  # what the sealed segments use on disk
    uses: int = 0


class Space(StoreParts):
    config: StoreConfig
    direct_writes: bool
    _buffers: BufferPool
    _summaries: dict[int, Summary]
    _sealed_bytes: dict[int, int]
    _journal_checked: int
    _listing: Listing | None
    _config_stamp: tuple[int, int, int] | None

    def _meta_lock(self) -> AbstractContextManager[None]:
        raise NotImplementedError

    def _writer_with_room(self, size: int) -> SegmentWriter:
        raise NotImplementedError

    def _segment_bytes(self, seg: int) -> int:
        size = self._sealed_bytes.get(seg)
        if size is None:
            size = 0
            for path in (log_path(self.root, seg), sum_path(self.root, seg)):
                with suppress(FileNotFoundError):
                    size += os.stat(path).st_size
            self._sealed_bytes[seg] = size
        return size

    def _list(self) -> Listing:
        listing = self._listing
        if listing is None or listing.uses >= RELIST:
            logs, sums = list_segments(self.root)
            sealed = [seg for seg in logs if seg in sums]
            listing = self._listing = Listing(
                sealed, [seg for seg in logs if seg not in sums],
                sum(self._segment_bytes(seg) for seg in sealed))
        listing.uses += 1
        return listing

    def _listed_new(self, seg: int) -> None:
        if self._listing is not None:
            self._listing.unsealed.append(seg)

    def _listed_sealed(self, seg: int) -> None:
        listing = self._listing
        if listing is not None and seg in listing.unsealed:
            listing.unsealed.remove(seg)
            bisect.insort(listing.sealed, seg)
            listing.sealed_bytes += self._segment_bytes(seg)

    def _listed_gone(self, seg: int, freed: int = 0) -> None:
        listing = self._listing
        if listing is None:
            return
        if seg in listing.unsealed:
            listing.unsealed.remove(seg)
        else:
            i = bisect.bisect_left(listing.sealed, seg)
            if i < len(listing.sealed) and listing.sealed[i] == seg:
                del listing.sealed[i]
                listing.sealed_bytes -= freed

    def _survey(self) -> tuple[list[int], int, int]:
        """(sealed segment ids, bytes they use, active segments of live writers).

        Recovers orphans on the way; the caller holds the meta lock.
        """
        self._follow_capacity()
        listing = self._list()
        actives = 0
        for seg in list(listing.unsealed):
            if not self._recover_if_orphan(seg):
                actives += 1
            elif self._listing is None:  # recovered: list again
                return self._survey()
        used = listing.sealed_bytes
        used += self._ints().bytes_on_disk() + self._hashes().bytes_on_disk()
        journal = self._journal().size()
        self._journal_checked = journal
        return list(listing.sealed), used + journal, actives

    def _follow_capacity(self) -> None:
        """Take the capacity ``store.json`` holds now (the caller holds the meta lock, under
        which every open writes it). Why: a handle opened before another open lowered the
        capacity wrote on under the old one, and the store stayed over the new one (attack
        helper 102). A file that cannot be read now leaves the capacity as it was."""
        stamp = config_stamp(self.root)
        if stamp is None or stamp == self._config_stamp:
            return
        self._config_stamp = stamp
        with suppress(CorruptionError):
            stored = load_config(self.root)
            if stored is not None and stored.capacity != self.config.capacity:
                self.config = replace(self.config, capacity=stored.capacity)

    def _allocate_writer(self, need: int = 0) -> SegmentWriter:
        """A new active segment, after evicting what the capacity bound requires.

        ``need`` bytes of it are kept free of eviction copies for the caller's records.
        """
        sealed, used, actives = self._survey()
        if actives >= self.config.max_writers:
            raise StoreFullError(
                f"{actives} processes already write to {self.root} (max_writers="
                f"{self.config.max_writers}); reopen the store with a larger max_writers"
            )
        seg = self._meta.take_segment_id((max(sealed) + 1) if sealed else 1)
        writer = SegmentWriter(self.root, seg, self.config.segment_size, self.direct_writes,
                               self._buffers)
        self._listed_new(seg)
        try:
            self._evict_to_fit(sealed, used, actives + 1, writer, need)
        except BaseException:
            writer.close()
            os.unlink(writer.path)
            self._listed_gone(seg)
            raise
        return writer

    def _evict_to_fit(self, sealed: list[int], used: int, segments: int,
                      dest: SegmentWriter | None, need: int = 0) -> None:
        """Clean sealed segments in the policy's order until ``used`` bytes and ``segments``
        whole segments fit the capacity with one segment kept free for compaction; records
        the policy keeps are copied into ``dest``. The caller holds the meta lock.

        Raises:
            StoreFullError: nothing is left to clean and it still does not fit.
        """
        if self._over_capacity(used, segments):
            victims = self.policy.victim_order(sealed)
            if self.policy.greedy:
                victims = self._deadest_first(victims, dest.room_leaving(need) if dest else 0)
            for victim in victims:
                used -= self._clean_segment(victim, dest, need=need)
                used -= self._compact_journal()  # older segments gone: entries may go too
                if not self._over_capacity(used, segments):
                    break
            else:
                raise StoreFullError(
                    f"cannot free space in {self.root}: {format_size(used)} in use, capacity "
                    f"{format_size(self.config.capacity)}; raise the capacity"
                )
        self._compact_journal()

    def _over_capacity(self, used: int, segments: int) -> bool:
        """Whether ``used`` bytes and ``segments`` whole active segments leave less than one
        free segment of the capacity (kept for compaction)."""
        size = self.config.segment_size
        return used + size * segments > self.config.capacity - size

    def _deadest_first(self, victims: list[int], room: int) -> list[int]:
        """``victims`` with the deadest of the oldest first: those of the first window, or
        of as many windows as it takes (up to ``GREEDY_RECORDS`` records looked up) to find
        one whose live records fit in ``room``. Why look past the oldest: in a nearly full
        cache the few dead records lie anywhere, and a victim with none evicted a live
        record the plan keeps (a cache of the whole dataset lost 45 samples an epoch)."""
        ints, hashes = self._ints(), self._hashes()
        seen: list[int] = []
        live: list[int] = []
        records = 0
        while len(seen) < len(victims):
            window = victims[len(seen):len(seen) + GREEDY_WINDOW]
            summaries = [self._summary(s) for s in window]
            seen += window
            live += live_bytes(summaries, ints, hashes)
            records += sum(len(s.keys) for s in summaries)
            if min(live) <= room or records >= GREEDY_RECORDS:
                break
        order = np.argsort(live, kind="stable")
        return [seen[i] for i in order] + victims[len(seen):]

    def _compact_journal(self) -> int:
        """Drop the delete entries no segment still needs, when the journal has grown (past
        a 512th of the sealed segments' bytes too: each compaction reads every summary);
        returns the bytes freed."""
        journal = self._journal()
        listing = self._listing  # as last listed: a survey here would list again
        if not journal.wants_compaction(listing.sealed_bytes // 512 if listing else 0):
            return 0
        before = journal.size()
        logs, sums = list_segments(self.root)
        journal.compact(min(logs, default=self._meta.next_segment),
                        self._entries_needed(logs, sums))
        return before - journal.size()

    def _entries_needed(self, logs: list[int], sums: set[int]) -> Needed:
        """Whether a segment below each entry's floor may hold a record of its key: a sealed
        one whose summary lists the key, or any unsealed one (no summary yet). Why: an entry
        otherwise stayed while any segment below its floor did, and in a nearly full cache
        the oldest segments, wholly live, are never cleaned; the journal grew by every
        delete, counted against the capacity, and the store evicted samples the plan kept."""
        def needed(kinds: npt.NDArray[np.uint8], keys: npt.NDArray[np.uint64],
                   floors: npt.NDArray[np.uint32]) -> npt.NDArray[np.bool_]:
            unsealed = min((seg for seg in logs if seg not in sums), default=1 << 32)
            summaries = [self._summary(seg) for seg in logs if seg in sums]
            held_kinds = np.concatenate([s.kinds for s in summaries] or [np.zeros(0, np.uint8)])
            held_keys = np.concatenate([s.keys for s in summaries] or [np.zeros(0, np.uint64)])
            held_in = np.repeat(np.array([s.segment for s in summaries], np.int64),
                                [len(s.keys) for s in summaries])
            out = floors > unsealed
            for kind in np.unique(kinds):
                mine, theirs = kinds == kind, held_kinds == kind
                if not theirs.any():
                    continue
                k, seg = held_keys[theirs], held_in[theirs]
                order = np.lexsort((seg, k))  # by key, then segment: the lowest first
                k, seg = k[order], seg[order]
                first = np.r_[True, k[1:] != k[:-1]]
                k, lowest = k[first], seg[first]
                at = np.minimum(np.searchsorted(k, keys[mine]), len(k) - 1)
                out[mine] |= (k[at] == keys[mine]) & (lowest[at] < floors[mine])
            return out

        return needed

    # ----------------------------------------------------------------------- recovery
    def _recover_orphans(self) -> None:
        logs, sums = list_segments(self.root)
        if logs:  # a lost ``lock`` restarts its counter: ids must stay above the segments
            self._meta.ensure_next_segment(max(logs) + 1)
        for seg in logs:
            if seg not in sums:
                self._recover_if_orphan(seg)
        remove_leftovers(self.root)
        for path in stale_generation_files(self.root, self._meta):
            os.unlink(path)

    def _recover_if_orphan(self, seg: int) -> bool:
        """Seal ``seg`` if its writer is dead; False if a live writer holds it."""
        dropped: list[tuple[int, int]] = []
        result = seal_if_orphan(self.root, seg, self._ints(), self._hashes(),
                                self.sync is not SyncPolicy.NEVER, dropped)
        self._journal().append(dropped, self._meta.next_segment)  # see deletes.py
        if result is not False:  # sealed or gone
            self._listing = None
        if isinstance(result, Summary):
            self._summaries[seg] = result
            self.counters.recovered_segments += 1
            return True
        return result

    # ----------------------------------------------------------------------- cleaning
    def _summary(self, seg: int) -> Summary:
        summary = self._summaries.get(seg)
        if summary is None:
            try:
                summary = read_summary(self.root, seg)
            except (CorruptionError, FileNotFoundError):
                log.warning("segment %d: summary unreadable, rebuilding it by a scan", seg)
                fd = open_in_store(log_path(self.root, seg), os.O_RDONLY)
                try:
                    summary = scan_log(fd, seg, os.fstat(fd).st_size)
                finally:
                    close_file(fd)
            self._summaries[seg] = summary
        return summary

    def _clean_segment(self, seg: int, dest: SegmentWriter | None, keep_all: bool = False,
                       need: int = 0) -> int:
        """Copy the records worth keeping into ``dest``, evict the rest, delete ``seg``.

        Order matters for crashes: copies are written (and synced) and the index re-pointed
        before the segment is unlinked, so a crash at any point loses no kept record.
        Returns the bytes freed. The caller holds the meta lock.
        """
        summary = self._summary(seg)
        ints, hashes = self._ints(), self._hashes()
        live = live_records(summary, ints, hashes)
        if keep_all:
            keep = live.copy()
        else:
            refs = referenced_records(summary, ints, hashes) if self.policy.tracks_references \
                else np.zeros(len(live), dtype=bool)
            keep = live & self.policy.keep(summary.keys, summary.kinds, refs)
        # Copies may take at most half of the new segment, so the writer that asked for room
        # always gets some: without this, a cache whose records were all read (every CLOCK bit
        # set) would fill each new segment with copies and starve new writes.
        # Why ``need``: half a segment is not enough for a record larger than that; the new
        # segment then overflowed segment_size (and gc() evicted live records it meant to copy).
        # A greedy policy cleans the deadest segments first, so its copies are few and may
        # fill the segment up to what the writer needs.
        reserve = 0 if keep_all else need if self.policy.greedy else \
            max(self.config.segment_size // 2, need)
        copied = 0
        if keep.any() and dest is not None:
            copied = copy_forward(self.root, summary, keep, dest, reserve, ints, hashes)
        else:
            keep[:] = False
        evicted = evict_records(summary, live & ~keep, ints, hashes)
        # Why journal evictions: another writer's segment may hold an older record of the key,
        # which an index rebuilt from the segments would otherwise serve (see deletes.py).
        self._journal().append(evicted, self._meta.next_segment)
        self.counters.evictions += len(evicted)
        if copied and dest is not None and self.sync is not SyncPolicy.NEVER:
            dest.sync()
        freed = self._segment_bytes(seg)
        for path in (log_path(self.root, seg), sum_path(self.root, seg)):
            with suppress(FileNotFoundError):
                os.unlink(path)
        self._listed_gone(seg, freed)
        self._meta.bump_gc_generation()
        self._forget_segment(seg)
        self.counters.gc_segments += 1
        self.counters.gc_bytes_copied += copied
        return freed

    def _forget_segment(self, seg: int) -> None:
        self._summaries.pop(seg, None)
        self._sealed_bytes.pop(seg, None)
        fd = self._fds.pop(seg, None)
        if fd is not None:
            close_file(fd)

    def gc(self, min_dead_fraction: float = 0.5) -> int:
        """Compact sealed segments whose dead share is at least ``min_dead_fraction``.

        Live records are copied forward into this process's segment. Returns bytes freed.

        Raises:
            ConfigError: ``min_dead_fraction`` is not a number from 0 to 1.
        """
        self._check_process()
        min_dead_fraction = real_number(min_dead_fraction, "min_dead_fraction", 0.0, 1.0)
        freed = 0
        with self._meta_lock():
            sealed, _, _ = self._survey()
            for seg in sealed:
                if not os.path.exists(log_path(self.root, seg)):
                    continue  # cleaned while making room for a new writer
                summary = self._summary(seg)
                live = live_records(summary, self._ints(), self._hashes())
                live_bytes = int(summary.lengths[live].sum())
                if summary.data_len and 1 - live_bytes / summary.data_len < min_dead_fraction:
                    continue
                # a fully dead segment is just deleted: no new segment (and eviction) for it
                dest = self._writer_with_room(live_bytes) if live_bytes else None
                if not os.path.exists(log_path(self.root, seg)):
                    continue
                freed += self._clean_segment(seg, dest, keep_all=True)
            self._compact_journal()
        return freed
