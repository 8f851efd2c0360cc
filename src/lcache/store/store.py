"""The log-structured store: put/get records by int or byte key on local SSD.

One ``Store`` object per process (it re-initialises itself after ``fork``). Processes of a node
share a directory: each appends to its own active segment, all share the memory-mapped index,
and everything else (allocating segments, eviction, compaction, recovery) happens under an
``flock`` on ``DIR/lock`` that the kernel releases if the holder dies.

Space: ``capacity`` bounds the bytes on disk (segments, indexes, delete journal). Each active
segment reserves a whole segment, and one more segment is kept free for compaction, so copying
live records forward never pushes the directory past the bound; the byte-key index grows only
into what is left beside them (``_reserve_byte_slots``).

Reading (lookups, planned batch reads, the single-key path) lives in ``reading.py``; space
(allocating segments, eviction, cleaning, recovery of dead writers' segments, ``gc``) in
``space.py``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, NamedTuple

import numpy as np

from lcache.checks import flag, path_argument, whole_number
from lcache.errors import (
    ConfigError,
    CorruptionError,
    DiskFullError,
    IndexFullError,
    StoreFullError,
)
from lcache.forksafe import fork_safe_lock
from lcache.io import (
    MAX_QUEUE_DEPTH,
    BufferPool,
    SyncPolicy,
    close_file,
    default_engine,
    drop_page_cache,
    logical_block_size,
)
from lcache.store import record
from lcache.store.arguments import batch_length, value_view
from lcache.store.counters import Counters, RateLimitedWarning, add_to_totals
from lcache.store.deletes import DeleteJournal
from lcache.store.files import open_in_store
from lcache.store.hashindex import (
    FULL_LOAD,
    MAX_LOAD,
    HashIndex,
    initial_slots,
    largest_table,
    slots_for,
    table_bytes,
)
from lcache.store.index import IntIndex, pack_loc
from lcache.store.layout import (
    MetaPage,
    StoreConfig,
    config_stamp,
    format_size,
    load_config,
    merge_config,
    parse_size,
    prepare_dir,
    save_config,
)
from lcache.store.policy import EvictionPolicy, known_policies, make_policy
from lcache.store.reading import Reader
from lcache.store.segment import (
    SegmentWriter,
    StagedWrite,
    Summary,
    list_segments,
    log_path,
)
from lcache.store.space import Listing, Space

log = logging.getLogger("lcache")
Key = int | bytes
# Held while a forked child reopens an inherited store: its threads may all use the store
# first at once.
_REOPENING = fork_safe_lock()

BATCH_WRITE = 16 << 20  # bytes staged per append batch (two staging buffers of this size)



class _Inflight(NamedTuple):
    writer: SegmentWriter
    staged: StagedWrite
    entries: list[tuple[int, int, int]]


class Store(Space, Reader):
    """A crash-safe, capacity-bounded, multi-process key/value store of byte records.

    Use :meth:`Store.open`. Every record read is checked (header, key, length, checksum): a
    damaged or stale record is a miss, never wrong bytes. ``flush()`` is the durability point.
    """

    def __init__(
        self, root: str, config: StoreConfig, *, sync: SyncPolicy, direct_io: bool,
        direct_writes: bool, queue_depth: int,
    ) -> None:
        self.root = root
        self.config = config
        self.sync = sync
        self.direct_io = direct_io
        self.direct_writes = direct_writes
        self.policy: EvictionPolicy = make_policy(config.policy)
        self.engine = default_engine()  # the process's, shared with every other layer
        self.queue_depth = queue_depth
        self.counters = Counters()
        self._block = logical_block_size(root) if direct_io else 1
        self._closed = False
        self._tlock = threading.RLock()
        self._warn_verify = RateLimitedWarning()
        self._start_process()
        with self._meta_lock():
            self._open_indexes()
            self._recover_orphans()

    # ----------------------------------------------------------------- opening and closing
    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        capacity: int | str | None = None,
        segment_size: int | str | None = None,
        max_writers: int | None = None,
        policy: str | None = None,
        max_byte_keys: int | None = None,
        sync: str | SyncPolicy = SyncPolicy.FLUSH,
        direct_io: bool = False,
        direct_writes: bool = True,
        queue_depth: int = 16,
        create: bool = True,
    ) -> Store:
        """Open the store in ``path``, creating it (owner-only) if ``create`` and missing.

        Args:
            capacity: hard bound on bytes on disk (int or "50GB"); default 8 GiB when created.
            segment_size: bytes per segment (fixed at creation); default 64 MiB.
            max_writers: processes that may write at once; default 8.
            policy: eviction policy name, ``lru`` (default) or ``fifo``.
            max_byte_keys: most byte keys the byte-key index grows to hold, at least 16;
                default: as many as the capacity allows. May change on reopen (the index
                grows no further past a lowered bound; it never shrinks).
            sync: ``flush`` (default), ``always`` or ``never`` (see ``SyncPolicy``).
            direct_io: read segments with O_DIRECT (bypasses the page cache).
            direct_writes: append with O_DIRECT where the filesystem allows it (default; about
                3x faster than buffered writes here, and the page cache keeps room for reads).
                Each write call re-writes the partial block at the end, so many tiny ``put``
                calls write more than ``put_many`` batches do.
            queue_depth: reads kept in flight by ``get_many``, 1 to ``MAX_QUEUE_DEPTH``
                (1024); no more than the process I/O engine's depth
                (``LCACHE_IO_QUEUE_DEPTH``) are, whatever is asked.
            create: create the store if ``path`` holds none.

        Raises:
            ConfigError: a setting is invalid or conflicts with the existing store.
            StoreNotFoundError, StorePermissionError: see ``prepare_dir``; without ``create``
                nothing is created in a directory that holds no store.
            CorruptionError: a file of the store is damaged (the message names it and says to
                run ``lcache fsck --repair DIR``).
        """
        # settings that are not settings fail before anything is created: "" was the
        # current directory, and direct_io="no" (truthy) turned O_DIRECT on
        root = os.path.abspath(path_argument(path, "path"))
        sync_policy = SyncPolicy.named(sync, "sync")
        direct_io = flag(direct_io, "direct_io")
        direct_writes = flag(direct_writes, "direct_writes")
        create = flag(create, "create")
        queue_depth = whole_number(queue_depth, "queue_depth", 1, MAX_QUEUE_DEPTH)
        capacity = None if capacity is None else parse_size(capacity, "capacity")
        segment_size = None if segment_size is None else parse_size(segment_size, "segment_size")
        prepare_dir(root, create)
        lock = MetaPage(os.path.join(root, "lock"))
        try:
            fcntl.flock(lock.fd, fcntl.LOCK_EX)
            stored = load_config(root)
            if stored is None and not create:
                raise CorruptionError(
                    f"{os.path.join(root, 'store.json')} is missing from a store that holds "
                    f"segments; run `lcache fsck --repair {root}` to rewrite it")
            config = merge_config(
                stored,
                {"capacity": capacity, "segment_size": segment_size, "max_writers": max_writers,
                 "policy": policy, "max_byte_keys": max_byte_keys},
            )
            if policy is None and stored is not None:
                _stored_policy(root, stored.policy)
            make_policy(config.policy)  # unknown names fail before anything is written
            if config != stored:
                save_config(root, config)
            stamp = config_stamp(root)
        finally:
            lock.close()
        store = cls(root, config, sync=sync_policy, direct_io=direct_io,
                    direct_writes=direct_writes, queue_depth=queue_depth)
        store._config_stamp = stamp  # what it holds is ``config``: not read again at the fit
        if stored is not None:
            try:
                store._fit_capacity()
            except BaseException:
                store.close()
                raise
        return store

    def _fit_capacity(self) -> None:
        """Evict, in the policy's order, what the capacity no longer holds (lowered on this
        reopen, or on one killed while it evicted, or by a handle while another with the old
        capacity wrote on). Why at the open: the bound was enforced only when a segment was
        made, and a cache that writes nothing (a warm fixed set) stayed at 2.8 times its new
        capacity for good. Active segments of other writers that leave no room are left to
        their next segment."""
        with self._tlock, self._meta_lock():
            sealed, used, actives = self._survey()
            with suppress(StoreFullError):
                self._evict_to_fit(sealed, used, actives, None)

    def _start_process(self) -> None:
        """Per-process state: opened at start and again in a forked child (the pid is set
        last: another thread that sees it finds this process's state)."""
        self._meta = MetaPage(os.path.join(self.root, "lock"))
        self._lock_depth = 0
        self._token = int.from_bytes(os.urandom(8), "little") | 1  # this handle, this process
        self._listing: Listing | None = None
        self._config_stamp: tuple[int, int, int] | None = None  # of store.json, last read
        self._int_index: IntIndex | None = None
        self._hash_index: HashIndex | None = None
        self._deletes: DeleteJournal | None = None
        self._journal_checked = 0  # journal bytes when its size was last weighed
        self._byte_slots_cap = 1 << 62  # the largest byte-key table allowed, as last computed
        self._writer: SegmentWriter | None = None
        self._fds: dict[int, int] = {}
        self._gc_seen = self._meta.gc_generation
        self._sealed_bytes: dict[int, int] = {}
        self._summaries: dict[int, Summary] = {}
        self._persisted = Counters()
        self._buffers = BufferPool(2)  # the writers' staging buffers, kept across segments
        self._pid = os.getpid()

    def _check_process(self) -> None:
        if self._closed:
            # a ConfigError, as CachedDataset's after close (a ValueError, as before)
            raise ConfigError(f"the store at {self.root} is closed; open it again "
                              "(Store.open) to use it")
        if self._pid != os.getpid():
            with _REOPENING:
                if self._pid != os.getpid():
                    self._reopen_in_child()

    def _reopen_in_child(self) -> None:
        """Forked child (e.g. a DataLoader worker): the parent's descriptors and its active
        segment are the parent's; open our own, once, whichever thread comes first."""
        # Why close them: inherited descriptors share the parent's flocks (on its active
        # segment, the meta lock, the hash index); kept open here they would keep a dead
        # parent's segment looking alive, or a lock it held taken.
        inherited = [self._meta.fd, *self._fds.values()]
        if self._writer is not None:
            inherited += [self._writer.fd, self._writer._direct_fd]
        for held in (self._int_index, self._hash_index, self._deletes):
            if held is not None:
                inherited.append(held.fd)
        for fd in inherited:
            if fd >= 0:
                with suppress(OSError):
                    close_file(fd)
        self._tlock = threading.RLock()
        self.counters = Counters()
        self._start_process()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def opened_here(self) -> bool:
        """Whether this process has its own descriptors (it made or used the store, not
        only inherited it over ``fork``) and has not closed them."""
        return not self._closed and self._pid == os.getpid()

    def close(self) -> None:
        """Seal this process's segment, make everything durable and release all files."""
        if self._closed:
            return
        self._check_process()
        with self._tlock:
            try:
                if self._writer is not None:
                    with self._meta_lock():
                        self._seal_writer()
                self._flush_indexes()
                self._persist_counters()
            finally:
                self._release()

    def _release(self) -> None:
        for fd in self._fds.values():
            close_file(fd)
        self._fds.clear()
        for held in (self._int_index, self._hash_index, self._deletes):
            if held is not None:
                held.close()
        if self._writer is not None:
            self._writer.close()
        self._meta.close()
        self._closed = True

    def _abandon(self) -> None:
        """Drop every descriptor without sealing or flushing: what ``kill -9`` leaves (tests)."""
        self._release()

    # ----------------------------------------------------------------------- locking
    @contextmanager
    def _meta_lock(self) -> Iterator[None]:
        with self._tlock:
            if self._lock_depth == 0:
                fcntl.flock(self._meta.fd, fcntl.LOCK_EX)
                if not self._meta.take_over(self._token):
                    self._listing = None  # another handle may have changed the segments
            self._lock_depth += 1
            try:
                yield
            finally:
                self._lock_depth -= 1
                if self._lock_depth == 0:
                    fcntl.flock(self._meta.fd, fcntl.LOCK_UN)

    # ----------------------------------------------------------------------- indexes
    def _open_indexes(self) -> None:
        """Open (or create, in a store without segments yet) both indexes and the delete
        journal, so that a damaged one fails the open, not a later get."""
        fresh = not list_segments(self.root)[0]
        self._int_index = IntIndex(self.root, self._meta, create=fresh)
        self._hash_index = HashIndex(self.root, self._meta, initial_slots(self.config.capacity),
                                     create=fresh)
        self._deletes = DeleteJournal(self.root, self._meta)

    def _ints(self) -> IntIndex:
        if self._int_index is None:  # a forked child opens its own
            with self._meta_lock():
                self._int_index = IntIndex(self.root, self._meta)
        return self._int_index

    def _hashes(self) -> HashIndex:
        if self._hash_index is None:
            with self._meta_lock():
                self._hash_index = HashIndex(self.root, self._meta)
        return self._hash_index

    def _journal(self) -> DeleteJournal:
        if self._deletes is None:
            with self._meta_lock():
                self._deletes = DeleteJournal(self.root, self._meta)
        return self._deletes

    def _reserve_byte_slots(self, more: int) -> None:
        """Before ``more`` byte keys are written: grow the byte-key table while it is more
        than half full and the capacity allows, else evict keys (the policy's oldest segments
        first) to keep it under ``FULL_LOAD``."""
        hashes = self._hashes()
        at_cap = hashes.slots >= self._byte_slots_cap
        if not hashes.crowded(more, FULL_LOAD if at_cap else MAX_LOAD):
            return
        with self._meta_lock():
            # room beside a segment per writer and the compaction spare: writers always get
            # segments, and an empty store always takes a record that fits
            room = (self.config.capacity - self._ints().bytes_on_disk()
                    - self.config.segment_size * (self.config.max_writers + 1))
            self._byte_slots_cap = largest_table(hashes.slots, room, self.config.max_byte_keys)
            want = slots_for(hashes.recount() + more)
            if want > hashes.slots:
                new = min(want, self._byte_slots_cap)
                if new > hashes.slots:
                    sealed, used, actives = self._survey()
                    self._evict_to_fit(sealed, used + table_bytes(new), actives, self._writer)
                    hashes.grow(new)
            while hashes.recount() + more > hashes.slots * FULL_LOAD:
                sealed, _, _ = self._survey()
                if not sealed:
                    raise IndexFullError(
                        f"the byte-key index of {self.root} cannot hold {more} more keys: it "
                        f"has {hashes.slots} slots, as many as the capacity and max_byte_keys "
                        "allow, and no sealed segment is left to evict; raise them")
                self._clean_segment(self.policy.victim_order(sealed)[0], None)

    def _index(self, kind: int) -> IntIndex | HashIndex:
        return self._ints() if kind == record.KIND_INT else self._hashes()

    def _lookup(self, kind: int, key64: int) -> tuple[int, int] | None:
        return self._index(kind).lookup(key64)

    # ----------------------------------------------------------------------- writing
    def put(self, key: Key, value: Any) -> None:
        """Store ``value`` (any C-contiguous buffer of plain data) under ``key`` (an int
        >= 0, numpy integers included, or bytes).

        Raises:
            DiskFullError: the device is full; the store is unchanged and stays readable.
            StoreFullError: nothing can be evicted to make room.
            ArgumentTypeError: a key that is neither an int nor bytes, a value that is not a
                buffer, is strided, or holds Python objects (a ConfigError and a TypeError).
            ConfigError: a key out of range, a record larger than a segment, the store
                closed.
        """
        self.put_many([key], [value])

    def put_many(self, keys: Sequence[Key], values: Sequence[Any]) -> None:
        """Store many records with few large writes (the fast path for bulk loading).

        Batches are pipelined: while one is written (the GIL released), the next is checksummed
        and staged. A record is visible to other processes once its batch is on disk. Not all
        or nothing: a bad key or value raises before its own batch (up to 16 MiB of records)
        is written, and the batches before it stay stored.

        Raises:
            ConfigError: as ``put``; or ``keys`` and ``values`` differ in length (an
                ``ArgumentTypeError`` where one is not a sequence).
        """
        self._check_process()
        n = batch_length(keys, "keys")
        if n != batch_length(values, "values"):
            raise ConfigError(f"{n} keys but {len(values)} values")
        parts: list[Any] = []
        entries: list[tuple[int, int, int]] = []
        pending = 0
        room = -1  # the writer's room, read again only when the writer's end moves
        inflight: _Inflight | None = None
        with self._tlock:
            # (numpy integers were counted as byte keys, and an array of them reserved a
            # byte-key slot for each)
            byte_keys = sum(isinstance(k, (bytes, bytearray, memoryview)) for k in keys)
            if byte_keys:
                self._reserve_byte_slots(byte_keys)
            try:
                for key, value in zip(keys, values, strict=True):
                    if type(key) is int and 0 <= key <= record.MAX_INT_KEY:  # the common case
                        kind, key64, kb = record.KIND_INT, key, b""
                    else:
                        kind, key64, kb = record.key_parts(key)
                    payload = value_view(value)
                    size = record.HEADER_SIZE + len(kb) + len(payload)
                    if size > self.config.segment_size:
                        raise ConfigError(
                            f"a record of {format_size(size)} does not fit in a segment "
                            f"({format_size(self.config.segment_size)}); create the store "
                            "with a larger segment_size"
                        )
                    if pending + size > room or pending >= BATCH_WRITE:
                        if entries:
                            inflight = self._pipeline(inflight, parts, entries)
                            parts, entries, pending = [], [], 0
                        writer = self._writer
                        if writer is None or size > writer.room:
                            done, inflight = inflight, None
                            self._finish(done)
                            writer = self._writer_with_room(size)
                        room = writer.room
                    parts.append(record.pack_header(kind, key64, kb, payload))
                    if kb:
                        parts.append(kb)
                    parts.append(payload)
                    entries.append((kind, key64, size))
                    pending += size
                if entries:
                    inflight = self._pipeline(inflight, parts, entries)
            finally:
                done, inflight = inflight, None
                self._finish(done)

    def _pipeline(self, inflight: _Inflight | None, parts: list[Any],
                  entries: list[tuple[int, int, int]]) -> _Inflight:
        """Stage a batch, finish the one in flight, then start writing the new one."""
        writer = self._writer
        assert writer is not None
        staged = writer.stage(parts, entries)
        if staged.independent:  # shares no block with the batch in flight: write both at once
            writer.submit(staged)
            self._finish(inflight)
        else:
            self._finish(inflight)
            writer.submit(staged)
        return _Inflight(writer, staged, entries)

    def _finish(self, inflight: _Inflight | None) -> None:
        """Wait for a batch to reach the file, then publish its records in the index."""
        if inflight is None or inflight.staged.done:
            return
        writer, staged, entries = inflight
        try:
            writer.wait(staged)
        except DiskFullError as exc:
            raise DiskFullError(
                f"the disk holding the cache {self.root} is full ({exc}); the store is "
                "unchanged and readable: free space on the device or lower the capacity"
            ) from exc
        if self.sync is SyncPolicy.ALWAYS:
            writer.sync()
        seg = writer.segment
        offset = staged.start
        ints_k: list[int] = []
        ints_loc: list[int] = []
        ints_len: list[int] = []
        for kind, key64, size in entries:
            if kind == record.KIND_INT:
                ints_k.append(key64)
                ints_loc.append(pack_loc(seg, offset))
                ints_len.append(size)
            else:
                self._hashes().set(key64, pack_loc(seg, offset), size)
            offset += size
        if ints_k:
            index = self._ints()
            top = max(ints_k)
            if top >= index.capacity:
                with self._meta_lock():
                    index.grow(top)
            index.set_many(np.array(ints_k, np.uint64), np.array(ints_loc, np.uint64),
                           np.array(ints_len, np.uint32))
        self.counters.puts += len(entries)
        self.counters.bytes_written += offset - staged.start

    def _writer_with_room(self, size: int) -> SegmentWriter:
        writer = self._writer
        if writer is not None and writer.room >= size:
            return writer
        with self._meta_lock():
            if writer is not None:
                self._seal_writer()
            self._writer = self._allocate_writer(size)
        return self._writer

    def _seal_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        if writer.offset == 0:  # nothing written: leave no empty segment behind
            writer.close()
            os.unlink(writer.path)
            self._listed_gone(writer.segment)
            return
        try:
            summary = writer.seal(durable=self.sync is not SyncPolicy.NEVER)
        except OSError:
            writer.close()  # left unsealed: the next open recovers it by scanning
            raise
        self._summaries[summary.segment] = summary
        self._listed_sealed(summary.segment)

    # ----------------------------------------------------------------------- other ops
    def delete(self, key: Key) -> bool:
        """Remove ``key``; True if it was there. Its bytes are reclaimed by compaction.

        The delete is journaled (``deletes.py``), so an index rebuilt from the segments does
        not bring the key back; like a put, it is durable once ``flush()`` returns.
        """
        self._check_process()
        kind, key64, _ = record.key_parts(key)
        removed = self._index(kind).remove(key64)
        if removed:
            journal = self._journal()
            # Why read after the removal: a compaction that copies this key's record forward
            # took its segment's id before it saw the record live, so below this floor.
            journal.append([(kind, key64)], self._meta.next_segment)
            if self.sync is SyncPolicy.ALWAYS:
                journal.sync()
            self.counters.deletes += 1
            if self.counters.deletes % 256 == 0:
                self._weigh_journal()
        return removed

    def _weigh_journal(self) -> None:
        """Deletes without puts grow the journal between segment allocations, which is when
        the capacity is checked: check it once the journal grew by half a segment."""
        if self._journal().size() - self._journal_checked > self.config.segment_size // 2:
            with self._meta_lock():
                self._compact_journal()
                # A policy that wants every live record (the cache's plan deletes what it
                # does not) has cleaning copy them into this handle's segment, or leaves the
                # cleaning to the next new segment, whose writer gives the copies a home:
                # the journal is over the capacity until then. Why: with nowhere to copy,
                # cleaning evicted every live record it met, and a nearly full cache's reads
                # (its plan's deletes) lost samples it kept.
                writer = self._writer
                if self.policy.greedy and (writer is None or
                                           writer.room < self.config.segment_size // 2):
                    self._journal_checked = self._journal().size()
                    return
                sealed, used, actives = self._survey()
                try:
                    self._evict_to_fit(sealed, used, actives,
                                       writer if self.policy.greedy else None)
                except StoreFullError:  # the delete itself is done: do not fail it
                    log.warning("the delete journal of %s (%s) does not fit the capacity; "
                                "raise the capacity", self.root,
                                format_size(self._journal().size()))

    def flush(self) -> None:
        """The durability point: every put before it survives a crash or power loss."""
        self._check_process()
        with self._tlock:
            if self._writer is not None and self.sync is not SyncPolicy.NEVER:
                self._writer.sync()
            self._flush_indexes()
            self._persist_counters()

    def flush_deletes(self) -> None:
        """Make the deletes so far durable whatever the sync policy: for a caller about to
        publish something that relies on them (a cache's new listing, which says the old
        copies are gone, must not reach the disk before their deletes)."""
        self._check_process()
        with self._tlock:
            self._flush_indexes(force=True)

    def _flush_indexes(self, force: bool = False) -> None:
        if self.sync is SyncPolicy.NEVER and not force:
            return
        for index in (self._int_index, self._hash_index):
            if index is not None:
                index.flush()
        if self._deletes is not None:
            self._deletes.sync()

    def _persist_counters(self) -> None:
        delta = self.counters.minus(self._persisted)
        try:
            with self._meta_lock():
                add_to_totals(self.root, delta)
        except DiskFullError:
            # Why: stats.json is advisory; a full disk must not make flush()/close() fail
            # after the data itself was made durable. The delta is kept for the next try.
            log.warning("could not update %s/stats.json: the disk is full", self.root)
            return
        self._persisted = self.counters.copy()

    def drop_page_cache(self) -> None:
        """Evict this store's segments from the page cache (for honest read benchmarks)."""
        logs, _ = list_segments(self.root)
        for seg in logs:
            try:
                fd = open_in_store(log_path(self.root, seg), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                drop_page_cache(fd)
            finally:
                close_file(fd)

    def stats(self) -> dict[str, Any]:
        """Structure (segments, bytes on disk, keys) and this process's counters."""
        self._check_process()
        with self._meta_lock():
            sealed, used, actives = self._survey()
        index_bytes = sum(i.bytes_on_disk() for i in (self._ints(), self._hashes()))
        if self._writer is not None:
            used += self._writer.offset
        return {
            "path": self.root,
            "capacity": self.config.capacity,
            "segment_size": self.config.segment_size,
            "policy": self.config.policy,
            "bytes_on_disk": used,
            "segments": len(sealed) + actives,
            "active_segments": actives,
            "live_keys": self._ints().live_count() + self._hashes().live_count(),
            "index_bytes": index_bytes,
            **self.counters.as_dict(),
        }


def _stored_policy(root: str, name: str) -> None:
    """Refuse a policy named by store.json that this process does not know, saying where
    the name comes from (the message of a policy= typo read as if the caller chose it)."""
    try:
        make_policy(name)
    except ConfigError as exc:
        # Why not damage (fsck says nothing): a program's register_policy makes names
        # that no other process knows, the CLI's included
        raise ConfigError(f"{os.path.join(root, 'store.json')} names the eviction policy "
                          f"{name!r}, which this process does not know (it knows "
                          f"{', '.join(known_policies())}): register it first (register_policy), "
                          "open the store with policy= one it knows, or set \"policy\" in "
                          "store.json to one") from exc
