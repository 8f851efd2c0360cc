"""The node's sample cache: a store on local SSD in front of a source.

``DIR/cache.json`` and ``DIR/listing.bin`` say what the directory caches (``identity.py``: a
second dataset never reads the first one's samples, and samples rewritten at the source are
dropped); ``DIR/store`` is the log-structured store of kept samples (int key =
sample index); ``DIR/claims`` and ``DIR/counters.bin`` hold the shared state of
``lcache.data.shared``. A small FIFO store in /dev/shm (or ``DIR/staging``) holds prefetched
samples that are read once.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import multiprocessing.util
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import xxhash

from lcache.checks import flag, lies_within, path_argument, text_argument
from lcache.data.cachedir import (
    SHM,
    drop_unknown_store,
    remove_if_unused,
    remove_orphaned_staging,
    remove_stale_staging,
    shm_has_room,
    stored_segment_size,
)
from lcache.data.identity import DirectoryIdentity, identify
from lcache.data.plan import fixed_set
from lcache.data.remote import SourceCorruptionError
from lcache.data.shared import COUNTER_NAMES, FetchClaims, SharedCounters
from lcache.data.sizing import (
    DEFAULT_STAGING,
    MIN_SEGMENTS,
    STAGING_WRITERS,
    cache_capacity,
    choose_segment_size,
    plan_overhead,
    staging_area,
)
from lcache.data.sources import (
    FileSource,
    RangeSource,
    Source,
    SourceError,
    as_source,
    fetch_many,
    known_sizes,
)
from lcache.errors import (
    ConfigError,
    DiskFullError,
    LCacheError,
    StoreFullError,
    StorePermissionError,
)
from lcache.forksafe import fork_safe_lock
from lcache.io import atomic_write, close_file, private_dir
from lcache.io.files import open_owned
from lcache.store import Store, format_size, parse_size
from lcache.store.counters import RateLimitedWarning
from lcache.store.layout import index_floor
from lcache.store.record import HEADER_SIZE
from lcache.trace import recorder as _recorder

log = logging.getLogger("lcache")

# Writers: main store = prefetchers and readers admitting on demand; staging = prefetchers.
MAX_WRITERS = 128  # at most: fewer when the capacity holds fewer segments
ON_ERROR = ("raise", "skip")
# Where an access's bytes came from.
NOWHERE, SSD, RAM, FETCHED = range(4)
_COUNTER_OF = {SSD: "from_ssd", RAM: "from_ram"}  # a fetched access counts as a fetch
# Sources whose ``decode`` copies what it is given: they may be handed the store's memory.
_DECODE_COPIES = (FileSource, RangeSource)
_OPENING = fork_safe_lock()  # prefetch threads race to open the stores of a new process
_REFUSING = fork_safe_lock()
_OPEN_CACHES: weakref.WeakSet[SampleCache] = weakref.WeakSet()


@atexit.register
def _close_open_caches() -> None:
    for cache in list(_OPEN_CACHES):
        with contextlib.suppress(Exception):
            cache.close()


def _seal_in_forked_child() -> None:
    for cache in list(_OPEN_CACHES):
        with contextlib.suppress(Exception):
            cache.close_stores_in_child()


class _ForkedChild:
    """Why: a multiprocessing child (a DataLoader worker) ends with os._exit, so atexit does
    not close its caches; its segments were left open each epoch, for the next process to
    recover as a crashed writer's (and stats counted those recoveries). multiprocessing runs
    its own finalizers at that exit, but clears those inherited over fork: each child
    registers one when it starts."""

    @staticmethod
    def started(_: object) -> None:
        multiprocessing.util.Finalize(None, _seal_in_forked_child, exitpriority=0)


_FORKED_CHILD = _ForkedChild()
multiprocessing.util.register_after_fork(_FORKED_CHILD, _ForkedChild.started)


class _Skipped:
    def __repr__(self) -> str:
        return "SKIPPED"


#: What ``SampleCache.get_many`` returns for a sample skipped with ``on_error="skip"``.
SKIPPED: Any = _Skipped()


def check_locations(source: Any, cache_dir: Any) -> None:
    """Refuse an empty source or cache directory (either would mean the current directory)
    and a cache directory in (or equal to) a local source's directory, whose files would be
    listed as samples the next time the source is listed."""
    url = source if isinstance(source, str) else getattr(source, "url", None)
    if isinstance(url, str) and not url.strip():
        raise ConfigError("the source is an empty string; give a URL or a directory")
    if isinstance(url, str) and "\0" in url:
        raise ConfigError(f"source {url!r:.200}: give a path or URL without a NUL character")
    path_argument(cache_dir, "cache_dir")
    listed = isinstance(source, (str, FileSource))  # a table of ranges lists nothing
    if not listed or not isinstance(url, str) or ("://" in url and
                                                  not url.startswith("file://")):
        return
    if lies_within(os.fspath(cache_dir), url.removeprefix("file://")):
        raise ConfigError(f"the cache directory {cache_dir} is inside the source {url}: its "
                          "files would be listed as samples; put the cache elsewhere")


class Access(NamedTuple):
    """What the seed-aware sampler yields: the sample, and whether the plan keeps it cached
    until its next use (``None``: no plan, admit if there is room)."""

    sample: int
    keep: bool | None = None


class SampleCache:
    def __init__(self, source: Any, cache_dir: str | os.PathLike[str],
                 capacity: int | float | str, *, segment_size: int | str | None = None,
                 staging_bytes: int | str = DEFAULT_STAGING, name: str | None = None,
                 fingerprint: str | None = None, check: bool = True,
                 on_error: str = "raise") -> None:
        if on_error not in ON_ERROR:
            raise ConfigError(f"on_error={on_error!r}: use \"raise\" or \"skip\"")
        check = flag(check, "check")  # check="no" would check
        name, fingerprint = text_argument(name, "name"), text_argument(fingerprint, "fingerprint")
        self.on_error = on_error
        check_locations(source, cache_dir)
        cache_capacity(capacity, 1)  # a typo is refused before a listing of the source
        self.source: Source = as_source(source)
        self.cache_dir = os.path.abspath(os.fspath(cache_dir))
        sizes = self.source.sizes()
        self.dataset_bytes = int(sizes.sum())
        if self.dataset_bytes == 0 and cache_capacity(capacity, 1 << 40) != cache_capacity(
                capacity, 1):  # a fraction of nothing ("capacity 1 B is below the minimum")
            raise ConfigError(f"capacity {capacity!r} is a fraction of the dataset, whose "
                              f"{len(sizes)} samples are listed as 0 bytes (a server that "
                              "sends no Content-Length?); give the capacity in bytes")
        self.capacity = cache_capacity(capacity, self.dataset_bytes)
        largest = self._largest = int(sizes.max())
        # Left out, the segment size of an existing cache is kept: sized from the capacity
        # afresh, a new capacity was refused as a new segment size. Only None leaves it out
        # (0 and "" were taken as left out).
        self.segment_size = parse_size(segment_size, "segment_size") \
            if segment_size is not None else \
            stored_segment_size(os.path.join(self.cache_dir, "store"), largest) or \
            choose_segment_size(self.capacity, 512, largest)
        if largest + HEADER_SIZE > self.segment_size:
            raise ConfigError(
                f"segment_size {format_size(self.segment_size)} cannot hold the largest sample "
                f"of {self.source.url} ({format_size(largest)} + a {HEADER_SIZE}-byte header); "
                "raise segment_size or leave it out to size segments from the samples")
        # Prefetched samples are staged in memory (/dev/shm) when it has room, so staging
        # costs no cache capacity; else in a slice of the cache dir.
        requested = parse_size(staging_bytes, "staging_bytes")
        on_ssd = not shm_has_room(staging_area(requested, self.capacity, largest, False)[0])
        self.staging_bytes, self.staging_segment_size = staging_area(
            requested, self.capacity, largest, on_ssd)
        self.main_capacity = self.capacity - (self.staging_bytes if on_ssd else 0)
        minimum = MIN_SEGMENTS * self.segment_size + (self.staging_bytes if on_ssd else 0)
        if self.capacity < minimum:
            have, need = format_size(self.capacity), format_size(minimum)
            if have == need:  # "2.5 MiB is below the minimum 2.5 MiB": say the bytes
                have, need = f"{self.capacity:,} bytes", f"{minimum:,} bytes"
            # Segments are sized to hold 4 of the largest sample, rounded up to a power of
            # two: with large samples the minimum is a large share of a small dataset. A
            # segment_size of 4 samples lowers it; fewer leave compaction no room to copy
            # what it cleans, and it drops samples the plan keeps.
            smallest = format_size(4 * (largest + HEADER_SIZE))
            raise ConfigError(
                f"cache capacity {have} is below the minimum {need} ({MIN_SEGMENTS} segments of "
                f"{format_size(self.segment_size)}"
                + (" and the prefetch staging area" if on_ssd else "") + "); raise the "
                f"capacity, or lower the segment size with CachedDataset(segment_size=...) "
                f"or `lcache warm --segment-size` (down to {smallest}, 4 of the largest "
                "sample)")
        identity = identify(self.source, name, fingerprint)
        self.cache_dir = private_dir(self.cache_dir, "cache directory")
        store_dir = os.path.join(self.cache_dir, "store")
        if os.path.islink(store_dir):
            raise StorePermissionError(f"{store_dir} is a symbolic link; a cache directory "
                                       "never follows one: remove it")
        self.claims = FetchClaims(os.path.join(self.cache_dir, "claims"))
        self.counters = SharedCounters(os.path.join(self.cache_dir, "counters.bin"))
        self._store: Store | None = None
        self._staging: Store | None = None
        self._pid = -1
        self._refused: set[Store] = set()  # stores that were full, in this process
        self._closed = False
        self._warned_large = False
        self._warn_skip = RateLimitedWarning()
        self._decode_copies = isinstance(self.source, _DECODE_COPIES)
        self._known_sizes = known_sizes(self.source)
        self._on_ssd = on_ssd
        with DirectoryIdentity(self.cache_dir).check(identity, check) as opened:
            if opened.reset and os.path.lexists(store_dir):
                drop_unknown_store(store_dir, opened.described)
            self.cache_id = opened.cache_id
            self._open_lock = opened.users  # closed by check() if this block fails
            try:
                self.store()  # create it now, so configuration errors surface here
            except DiskFullError as exc:  # its message names no file
                raise DiskFullError(f"cannot open the cache in {self.cache_dir}: {exc}; free "
                                    "space there or choose another directory") from exc
            self.invalidated = self._drop(opened.changed, opened.rescheme)

    def _drop(self, changed: np.ndarray, rescheme: bool = False) -> int:
        """Delete the cached copies of samples whose object changed at the source (or whose
        fingerprints an older lcache made: ``rescheme``)."""
        main = self.store()
        dropped = [int(i) for i in changed if int(i) in main and main.delete(int(i))]
        if dropped:
            # the store writes with sync="never": without this, a power loss after the new
            # listing is published could bring the old copies back under it
            main.flush_deletes()
            if rescheme:
                log.warning("lcache: the %d samples cached of %s were fingerprinted by an "
                            "older lcache, whose fingerprints could not tell every edit of a "
                            "table; they are fetched again, once", len(dropped),
                            self.source.url)
                return len(dropped)
            names = getattr(self.source, "paths", None)
            shown = [names[i] if names is not None and i < len(names) else str(i)
                     for i in dropped[:5]]
            log.warning("lcache: %d cached samples of %s changed at the source since they "
                        "were cached and were dropped (%s%s); they are fetched again",
                        len(dropped), self.source.url, ", ".join(shown),
                        ", ..." if len(dropped) > 5 else "")
        return len(dropped)

    @property
    def staging_dir(self) -> str:
        """Named by the cache id, which changes whenever cached samples may have changed:
        a staging area left by a killed run then holds old bytes under the same keys."""
        if self._on_ssd:
            return os.path.join(self.cache_dir, f"staging-{self.cache_id}")
        # fsencode: a directory named in bytes that are not UTF-8 (lone surrogates in str)
        # raised UnicodeEncodeError with .encode(); UTF-8 names hash as they did
        key = xxhash.xxh3_64_hexdigest(os.fsencode(f"{self.cache_dir}#{self.cache_id}"))
        return os.path.join(SHM, f"lcache-{key}")

    # ------------------------------------------------------------------- setting up
    def store(self) -> Store:
        """This process's handle on the store of kept samples (reopened after a fork)."""
        self._open()
        assert self._store is not None
        return self._store

    def staging(self) -> Store:
        """The store of prefetched samples: each is read once (a kept one then moves to the
        main store), so they die in the order they were written and FIFO cleaning never
        copies. Keeping them apart from the kept samples (which die in random order) is
        what lets the main store run nearly full without write amplification."""
        self._open()
        assert self._staging is not None
        return self._staging

    def _open(self) -> None:
        # A forked child keeps the parent's Store objects: they reopen their own descriptors
        # (and close the inherited ones, which hold the parent's locks) on first use.
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._refused = set()
            _recorder.flush_on_sigterm_in_dataloader_worker()
        if self._store is not None:
            return
        if self._closed:
            raise ConfigError(f"the cache in {self.cache_dir} was closed; make the dataset "
                              "again to use it (the directory may cache another listing now)")
        with _OPENING:
            if self._store is not None:
                return
            if self._open_lock < 0:  # unpickled in a spawned process: hold it as the parent
                self._open_lock = DirectoryIdentity(self.cache_dir).join(self.cache_id)
            if self._on_ssd:
                remove_stale_staging(self.cache_dir, self.staging_dir)
            else:
                remove_orphaned_staging()
            if os.path.islink(self.staging_dir):
                raise StorePermissionError(f"{self.staging_dir} is a symbolic link; a staging "
                                           "directory never follows one: remove it")
            self._staging_as_stored()
            self._users = self._hold_staging()
            atomic_write(os.path.join(self.staging_dir, "origin"),
                         os.fsencode(f"{self.cache_dir}\n{self.cache_id}"), io_class="cache-meta",
                         durable=False)
            _OPEN_CACHES.add(self)
            try:
                staging = Store.open(self.staging_dir, capacity=self.staging_bytes,
                                     segment_size=self.staging_segment_size, policy="fifo",
                                     max_writers=STAGING_WRITERS, sync="never",
                                     direct_writes=False)
                try:
                    store = Store.open(
                        os.path.join(self.cache_dir, "store"), capacity=self.main_capacity,
                        segment_size=self.segment_size, policy="planned",
                        # two segments short of what the capacity holds beside the indexes'
                        # room (a count from the whole capacity left an 8 KiB-segment store
                        # under its minimum)
                        max_writers=min(MAX_WRITERS, (self.main_capacity - index_floor(
                            self.main_capacity)) // self.segment_size - 2),
                        sync="never", direct_writes=False)
                except BaseException:
                    staging.close()
                    raise
            except BaseException:
                # a store that refuses to open (another segment size): the staging area goes,
                # as close() would remove it (one in /dev/shm was left holding memory)
                _OPEN_CACHES.discard(self)
                close_file(self._users)
                remove_if_unused(self.staging_dir)
                raise
            self._staging, self._store = staging, store

    def _hold_staging(self) -> int:
        """Make the staging dir if need be and hold its users lock shared: each process using
        it holds one, so the last one to close removes it (memory in /dev/shm is not freed
        until its files are deleted). A closing process may remove the dir between its
        making and the hold: then it is made again (that race was a FileNotFoundError)."""
        users_path = os.path.join(self.staging_dir, "users")
        for _ in range(10):
            try:
                private_dir(self.staging_dir, "staging directory")
                users = open_owned(users_path, os.O_RDWR | os.O_CREAT, "staging directory")
            except FileNotFoundError:
                continue
            fcntl.flock(users, fcntl.LOCK_SH)
            try:
                if os.path.samestat(os.fstat(users), os.stat(users_path)):
                    return users
            except FileNotFoundError:
                pass
            close_file(users)
        raise ConfigError(f"cannot hold the staging directory {self.staging_dir}: something "
                          "keeps removing it")

    def _staging_as_stored(self) -> None:
        """A staging area left with other segments (by a killed run, or a process with
        other settings): removed if unused (it is throw-away), else shared as it is."""
        stored = stored_segment_size(self.staging_dir, self._largest)
        if stored in (None, self.staging_segment_size):
            return
        remove_if_unused(self.staging_dir)
        if os.path.isdir(self.staging_dir):
            self.staging_segment_size = stored
            self.staging_bytes = max(self.staging_bytes, (STAGING_WRITERS + 4) * stored)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_store"] = state["_staging"] = None  # each process opens its own
        state["_refused"] = set()
        state["_open_lock"] = -1  # a descriptor number means nothing in another process
        return state

    def __del__(self) -> None:
        # Why: a cache dropped without close() would leave its /dev/shm staging (memory).
        with contextlib.suppress(Exception):
            self.close()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (a closed cache cannot be used again)."""
        return self._closed

    def close(self) -> None:
        """Close the stores; remove the staging area if no other process uses it. A closed
        cache cannot be used again (its directory may be opened for another listing)."""
        self._closed = True
        if self._store is None or self._staging is None or self._pid != os.getpid():
            return
        self._store.close()
        self._staging.close()
        self._store = self._staging = None
        _OPEN_CACHES.discard(self)
        if self._open_lock >= 0:
            close_file(self._open_lock)
            self._open_lock = -1
        # Forked workers share our descriptor of the users lock, and with it our hold: only
        # a descriptor of our own, once ours is closed, tells whether any of them still uses
        # the staging area.
        close_file(self._users)
        remove_if_unused(self.staging_dir)

    def close_stores_in_child(self) -> None:
        """At a forked child's exit: close the stores it used (sealing the segments it
        wrote), and remove the staging area if it was the last process using it (its
        parent closed the cache first, while persistent workers still ran)."""
        for store in (self._store, self._staging):
            if store is not None and store.opened_here:
                store.close()
        if self._store is not None and self._pid == os.getpid():
            close_file(self._users)
            remove_if_unused(self.staging_dir)

    def plan_capacity(self, writers: int) -> int:
        """Sample bytes the plan may keep: the main store's capacity less one free segment,
        an active segment per writer, and the index."""
        overhead = plan_overhead(self.segment_size, len(self.source), writers,
                                 self.main_capacity)
        return max(0, self.main_capacity - overhead)

    def staging_window(self, ranks: int) -> int:
        """Bytes each of ``ranks`` prefetchers may stage without FIFO cleaning dropping a
        staged sample before it is read."""
        usable = self.staging_bytes - self.staging_segment_size * (2 + 2 * ranks)
        return max(0, usable // 2 // ranks)

    def record_sizes(self) -> np.ndarray:
        return self.source.sizes() + HEADER_SIZE

    def fixed_set(self, room: int) -> npt.NDArray[np.bool_]:
        """The samples a plan of ``room`` bytes holds for good (``plan.fixed_set``), what
        the sampler keeps where its node reads every sample and what ``lcache warm`` fills:
        whole shards first for a source of shards."""
        return fixed_set(self.record_sizes(), room,
                         whole_shards=hasattr(self.source, "shards"))

    # ------------------------------------------------------------------- serving
    def get(self, index: int, keep: bool | None = None) -> Any:
        """The item for sample ``index`` (see ``get_many``)."""
        return self.get_many([index], [keep])[0]

    def get_many(self, indices: Sequence[int], keeps: Sequence[bool | None]) -> list[Any]:
        """The items of ``indices``, in order: from the cache where there, else from the
        source, with one store read per store, one claim pass and one ``fetch_many`` of the
        misses, and one ``put_many`` of those admitted (``keep`` not False).

        With ``keep=False`` a cached copy is deleted as it is read: the plan has no room for
        it until its next use. A sample the source fails to deliver raises ``SourceError``,
        or with ``on_error="skip"`` is counted in ``skipped`` and comes back as ``SKIPPED``.
        (A sample twice in one call is fetched once, and admitted as its last access says.)
        """
        if len(indices) != len(keeps):
            raise ValueError(f"{len(indices)} samples but {len(keeps)} keep flags")
        n = len(indices)
        tally = dict.fromkeys(COUNTER_NAMES, 0)
        data, where = self._read(list(indices), list(keeps), tally)
        missing = [i for i in range(n) if data[i] is None]
        if missing:
            wanted = {indices[i]: keeps[i] for i in missing}  # the last access's keep wins
            got = self._fill(wanted, tally)
            first: set[int] = set()
            for i in missing:
                data[i], where[i] = got[indices[i]]
                if where[i] == FETCHED:
                    if indices[i] in first:  # the bytes fetched for its first access
                        where[i] = RAM
                    first.add(indices[i])
        out: list[Any] = [SKIPPED] * n
        for i in range(n):
            item: Any = data[i]
            at = where[i]
            if item is None:
                tally["skipped"] += 1
                continue
            if at != FETCHED:
                tally[_COUNTER_OF[at]] += 1
            tally["served_bytes"] += len(item)
            if type(item) is not bytes and not self._decode_copies:
                item = bytearray(item)  # a private, writable copy of the store's memory
            try:
                out[i] = self.source.decode(item)
            except Exception as exc:  # a format's decoder on bytes its index misdescribes
                if isinstance(exc, LCacheError):
                    raise
                path_of = getattr(self.source, "path_of", None)  # optional in a Source
                where_ = path_of(indices[i]) if path_of is not None else self.source.url
                raise SourceCorruptionError(
                    f"sample {indices[i]} ({where_}): its bytes do not decode as the source "
                    f"describes them: {type(exc).__name__}: {exc}") from exc
        tally["accesses"] += n
        self.counters.add(**{k: v for k, v in tally.items() if v})
        return out

    def _read(self, keys: list[int], keeps: list[bool | None], tally: dict[str, int]
              ) -> tuple[list[bytes | memoryview | None], list[int]]:
        """The cached bytes of ``keys`` (main store first, then staging) and where each was
        found. Hits with keep False, and every staged hit, are removed as they are read;
        staged hits the plan keeps move into the main store."""
        main, staging = self.store(), self.staging()
        data: list[bytes | memoryview | None] = [None] * len(keys)
        where = [NOWHERE] * len(keys)
        todo = list(range(len(keys)))
        for store, at in ((main, SSD), (staging, RAM if not self._on_ssd else SSD)):
            if not todo:
                break
            wanted = [keys[i] for i in todo]
            # staged samples are read once; kept ones live until the plan says otherwise
            remove = [True] * len(todo) if store is staging else \
                [keeps[i] is False for i in todo]
            views = store.get_many(wanted, remove=remove)
            unread = [j for j, v in enumerate(views) if v is None and wanted[j] in store]
            if unread:
                # Why read twice: another process may have moved the record (compaction)
                # between our lookup and our read.
                again = store.get_many([wanted[j] for j in unread],
                                       remove=[remove[j] for j in unread])
                for j, view in zip(unread, again, strict=True):
                    if view is None and wanted[j] in store:
                        # Still unreadable: damaged on disk. Drop it; the source has it.
                        store.delete(wanted[j])
                        tally["corrupt_refetches"] += 1
                    views[j] = view
            if self._known_sizes is not None:
                self._refuse_other_lengths(store, wanted, views, tally)
            for j, i in enumerate(todo):
                if views[j] is not None:
                    data[i], where[i] = views[j], at
                    if store is main and remove[j]:
                        tally["deleted"] += 1
            if store is staging:
                # Staged ahead of its turn, kept from now on by the plan: it enters the main
                # store as the plan has it enter, at this access (see Prefetcher).
                kept = [(keys[i], item) for i in todo if (item := data[i]) is not None
                        and keeps[i]]
                if kept:
                    self._put_many(main, [k for k, _ in kept], [b for _, b in kept])
            todo = [i for i in todo if data[i] is None]
        return data, where

    def _refuse_other_lengths(self, store: Store, keys: list[int],
                              views: list[memoryview | None],
                              tally: dict[str, int]) -> None:
        """Drop cached copies whose length is not the one the listing gives their sample:
        a copy of another version (or another range) that its fingerprint did not tell
        apart. Each is counted as a corrupt copy and fetched again."""
        sizes = self._known_sizes
        assert sizes is not None
        for j, view in enumerate(views):
            if view is not None and len(view) != sizes[keys[j]] >= 0:
                store.delete(keys[j])
                views[j] = None
                tally["corrupt_refetches"] += 1

    def _fill(self, wanted: dict[int, bool | None], tally: dict[str, int]
              ) -> dict[int, tuple[bytes | memoryview | None, int]]:
        """Bytes (and where from) for samples the cache missed, each fetched by one process:
        those nobody else is fetching first (claimed without waiting), then, holding no
        claim, the others, waiting for their fetchers (in key order: no two readers can
        wait on each other), which usually leaves them cached."""
        keys = sorted(wanted)
        got: dict[int, tuple[bytes | memoryview | None, int]] = {}
        with self.claims.hold_many(keys, blocking=False) as mine:
            got.update(self._fetch_claimed(mine, wanted, tally))
        rest = [k for k in keys if k not in got]
        if rest:
            with self.claims.hold_many(rest) as claimed:
                got.update(self._fetch_claimed(claimed, wanted, tally))
        return got

    def _fetch_claimed(self, keys: list[int], wanted: dict[int, bool | None],
                       tally: dict[str, int]) -> dict[int, tuple[bytes | memoryview | None, int]]:
        """Under the claims of ``keys``: read them again (fetched while we waited?), fetch
        the rest and admit those the plan keeps."""
        if not keys:
            return {}
        data, where = self._read(keys, [wanted[k] for k in keys], tally)
        got = {k: (data[j], where[j]) for j, k in enumerate(keys) if data[j] is not None}
        missing = [k for k in keys if k not in got]
        if not missing:
            return got
        fetched = self._fetch(missing)
        admit = [(k, b) for k, b in fetched.items() if b is not None and wanted[k] is not False]
        if admit:
            self._put_many(self.store(), [k for k, _ in admit], [b for _, b in admit])
        for k in missing:
            payload = fetched[k]
            got[k] = (payload, FETCHED)
            if payload is not None:
                tally["fetches"] += 1
                tally["remote_bytes"] += len(payload)
        return got

    def _fetch(self, keys: list[int]) -> dict[int, bytes | None]:
        """The source's bytes of ``keys``; with ``on_error="skip"`` a sample that fails (after
        the source's retries) is ``None``, and a warning names the first few."""
        try:
            return dict(zip(keys, fetch_many(self.source, keys), strict=True))
        except SourceError:
            if self.on_error == "raise":
                raise
        out: dict[int, bytes | None] = {}
        for k in keys:  # one by one, to tell the failing samples from the others
            try:
                out[k] = fetch_many(self.source, [k])[0]
            except SourceError as exc:
                out[k] = None
                # (its own words: a sample that changed since the listing is not retried)
                self._warn_skip("lcache: skipped sample %d of %s: %s", k, self.source.url, exc)
        return out

    def prefetch(self, index: int, keep: bool = True) -> int:
        """Fetch sample ``index`` into the cache (see ``prefetch_many``)."""
        return self.prefetch_many([index], [keep])

    def prefetch_many(self, indices: Sequence[int], keeps: Sequence[bool],
                      wanted: Callable[[int], bool] = lambda sample: True,
                      done: list[int] | None = None) -> int:
        """Fetch samples into the cache (the main store where ``keep``, else staging) unless
        they are there, being fetched, or no longer ``wanted(sample)`` once claimed (a reader
        got to it first). One ``fetch_many``. Returns the bytes fetched (0: nothing done);
        the samples fetched are appended to ``done`` where given (this caller's own count:
        the counters add up every process using the directory)."""
        main, staging = self.store(), self.staging()
        if staging in self._refused:  # nothing fetched ahead could be kept until read
            return 0
        # Kept samples the main store refuses (disk full) are staged: read once, not lost.
        plan = {k: keep and main not in self._refused for k, keep in
                zip(indices, keeps, strict=True) if k not in main and k not in staging}
        if not plan:
            return 0
        with self.claims.hold_many(sorted(plan), blocking=False) as claimed:
            todo = [k for k in claimed if k not in main and k not in staging and wanted(k)]
            if not todo:
                return 0
            fetched = dict(zip(todo, fetch_many(self.source, todo), strict=True))
            kept = [k for k in todo if plan[k]]
            refused = self._put_many(main, kept, [fetched[k] for k in kept]) if kept else []
            staged = [k for k in todo if not plan[k]] + refused
            if staged:
                self._put_many(staging, staged, [fetched[k] for k in staged])
        total = sum(len(b) for b in fetched.values())
        self.counters.add(fetches=len(todo), remote_bytes=total, prefetched=len(todo))
        if done is not None:
            done.extend(todo)
        return total

    def _put_many(self, store: Store, keys: list[int], values: Sequence[bytes | memoryview]
                  ) -> list[int]:
        """Admit ``values`` under ``keys``; returns the keys a full store refused (none
        once it has refused: this process stops admitting there, and warns once)."""
        if store in self._refused:
            return []
        room = store.config.segment_size - HEADER_SIZE
        fits = [j for j, v in enumerate(values) if len(v) <= room]
        if len(fits) < len(values) and not self._warned_large:
            # A dataset's sizes are estimated from a probe: an item may be larger than any
            # segment. It is served from the source, uncached, rather than failing training.
            self._warned_large = True
            j = next(j for j in range(len(values)) if j not in fits)
            log.warning("lcache: sample %d of %s (%s) is larger than a segment of %s and is "
                        "not cached; pass a larger segment_size", keys[j], self.source.url,
                        format_size(len(values[j])), format_size(store.config.segment_size))
        try:
            store.put_many([keys[j] for j in fits], [values[j] for j in fits])
        except (DiskFullError, StoreFullError) as exc:
            with _REFUSING:  # threads that meet the full disk together warn once
                first = store not in self._refused
                self._refused.add(store)
            if first:
                self.counters.add(admit_failures=1)
                where = self.cache_dir if store is self._store else \
                    f"the prefetch staging area {self.staging_dir}"
                log.warning("lcache: cannot add samples to %s (%s); training goes on reading "
                            "from %s, without caching there in this process", where, exc,
                            self.source.url)
            return [keys[j] for j in fits if keys[j] not in store]
        return []

    # ------------------------------------------------------------------- figures
    def stats(self, since: dict[str, Any] | None = None) -> dict[str, Any]:
        """Counts of every process using the directory, since it was made, or since
        ``since``: an earlier ``stats()``, for the figures of what happened in between
        (``mark = ds.stats()`` at the start of an epoch, ``ds.stats(since=mark)`` at its end).
        """
        totals = self.counters.totals()
        if since is not None:
            if not isinstance(since, dict) or since.get("interval") is not False or any(
                    type(since.get(k, 0)) is not int for k in totals):
                raise ConfigError("since= takes what an earlier stats() (without since=) "
                                  "returned")
            totals = {k: v - since.get(k, 0) for k, v in totals.items()}
        accesses = totals["accesses"]
        fetched = totals["fetches"] - totals["prefetched"]  # misses the reader waited for
        return {
            "cache_dir": self.cache_dir,
            "source": self.source.url,
            "samples": len(self.source),
            "dataset_bytes": self.dataset_bytes,
            "capacity": self.capacity,
            "interval": since is not None,
            # Fetches beyond the accesses (a prefetched sample evicted before its read and
            # fetched again) cost more than misses: the ratio stops at 0.
            "hit_ratio": max(0.0, 1 - totals["fetches"] / accesses) if accesses else 0.0,
            "demand_misses": fetched,
            **totals,
        }
