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
import json
import logging
import os
import shutil
import stat
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import xxhash

from lcache.data.identity import DirectoryIdentity, identify
from lcache.data.shared import FetchClaims, SharedCounters
from lcache.data.sources import Source, as_source
from lcache.errors import ConfigError, DiskFullError, StoreFullError, StorePermissionError
from lcache.io import atomic_write, open_file, private_dir
from lcache.store import Store, format_size, parse_size
from lcache.store.record import HEADER_SIZE

log = logging.getLogger("lcache")

# Writers: main store = prefetchers and readers admitting on demand; staging = prefetchers.
MAX_WRITERS = 128  # at most: fewer when the capacity holds fewer segments
STAGING_WRITERS = 8
MIN_SEGMENTS = 40
DEFAULT_STAGING = 256 << 20
SHM = "/dev/shm"
_OPENING = threading.Lock()  # prefetch threads race to open the stores of a new process
_OPEN_CACHES: weakref.WeakSet[SampleCache] = weakref.WeakSet()


def _remove_orphaned_staging() -> None:
    """Remove staging dirs in /dev/shm that no process uses and whose cache is gone or was
    recreated (left by a killed job): they hold memory until deleted."""
    for name in os.listdir(SHM):
        path = os.path.join(SHM, name)
        if not name.startswith("lcache-"):
            continue
        try:
            st = os.lstat(path)
            if st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode):
                continue  # another user's (or a plant): never read, never removed
            fd = open_file(os.path.join(path, "origin"), os.O_RDONLY)
            try:
                origin, _, cache_id = os.read(fd, 1 << 16).decode().partition("\n")
            finally:
                os.close(fd)
            if _cache_id(origin) == cache_id:
                continue  # its cache still exists
            fd = open_file(os.path.join(path, "users"), os.O_RDWR)
        except (OSError, UnicodeDecodeError):
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
        finally:
            os.close(fd)


@atexit.register
def _close_open_caches() -> None:
    for cache in list(_OPEN_CACHES):
        with contextlib.suppress(Exception):
            cache.close()


def _shm_has_room(need: int) -> bool:
    """Whether /dev/shm can hold a staging area of ``need`` bytes (with room to spare)."""
    try:
        st = os.statvfs(SHM)
        return st.f_bavail * st.f_frsize >= 2 * need and os.access(SHM, os.W_OK)
    except OSError:
        return False


def _cache_id(cache_dir: str) -> str | None:
    try:
        fd = open_file(os.path.join(cache_dir, "cache.json"), os.O_RDONLY)
        try:
            return str(json.loads(os.read(fd, 1 << 20)).get("id"))
        finally:
            os.close(fd)
    except (OSError, ValueError, AttributeError):
        return None


class Access(NamedTuple):
    """What the seed-aware sampler yields: the sample, and whether the plan keeps it cached
    until its next use (``None``: no plan, admit if there is room)."""

    sample: int
    keep: bool | None = None


def choose_segment_size(space: int, count: int, largest: int) -> int:
    """About ``space / count`` rounded down to a power of two, within 64 KiB..64 MiB, and
    room for at least four of the largest records."""
    size = 1 << (max(space // count, 64 << 10).bit_length() - 1)
    size = min(size, 64 << 20)
    while size < 4 * (largest + HEADER_SIZE):
        size *= 2
    return size


class SampleCache:
    def __init__(self, source: Any, cache_dir: str | os.PathLike[str],
                 capacity: int | str, *, segment_size: int | str | None = None,
                 staging_bytes: int | str = DEFAULT_STAGING, name: str | None = None,
                 fingerprint: str | None = None, check: bool = True) -> None:
        self.source: Source = as_source(source)
        self.cache_dir = os.path.abspath(os.fspath(cache_dir))
        self.capacity = parse_size(capacity)
        sizes = self.source.sizes()
        self.dataset_bytes = int(sizes.sum())
        largest = int(sizes.max())
        self.segment_size = parse_size(segment_size) if segment_size else \
            choose_segment_size(self.capacity, 512, largest)
        if largest + HEADER_SIZE > self.segment_size:
            raise ConfigError(
                f"segment_size {format_size(self.segment_size)} cannot hold the largest sample "
                f"of {self.source.url} ({format_size(largest)} + a {HEADER_SIZE}-byte header); "
                "raise segment_size or leave it out to size segments from the samples")
        # Prefetched samples the plan does not keep are staged in memory (/dev/shm) when it
        # has room, so staging costs no cache capacity; else in a slice of the cache dir.
        self.staging_bytes = parse_size(staging_bytes)
        self.staging_segment_size = choose_segment_size(self.staging_bytes, 16, largest)
        self.staging_bytes = max(self.staging_bytes,
                                 (STAGING_WRITERS + 4) * self.staging_segment_size)
        on_ssd = not _shm_has_room(self.staging_bytes)
        if on_ssd:  # carved out of the capacity: keep it small
            self.staging_bytes = min(self.staging_bytes, self.capacity // 50)
            self.staging_segment_size = choose_segment_size(self.staging_bytes, 16, largest)
            self.staging_bytes = max(self.staging_bytes,
                                     (STAGING_WRITERS + 4) * self.staging_segment_size)
        self.main_capacity = self.capacity - (self.staging_bytes if on_ssd else 0)
        minimum = MIN_SEGMENTS * self.segment_size + (self.staging_bytes if on_ssd else 0)
        if self.capacity < minimum:
            raise ConfigError(
                f"cache capacity {format_size(self.capacity)} is below the minimum "
                f"{format_size(minimum)} ({MIN_SEGMENTS} segments of "
                f"{format_size(self.segment_size)}"
                + (" and the prefetch staging area" if on_ssd else "") + "); raise the "
                "capacity" + ("" if segment_size is None else " or lower segment_size"))
        identity = identify(self.source, name, fingerprint)
        self.cache_dir = private_dir(self.cache_dir, "cache directory")
        if not os.access(self.cache_dir, os.W_OK | os.X_OK):
            raise StorePermissionError(
                f"the cache directory {self.cache_dir} is not writable by this user; fix its "
                "permissions or choose another directory")
        store_dir = os.path.join(self.cache_dir, "store")
        if os.path.islink(store_dir):
            raise StorePermissionError(f"{store_dir} is a symbolic link; a cache directory "
                                       "never follows one: remove it")
        self.claims = FetchClaims(os.path.join(self.cache_dir, "claims"))
        self.counters = SharedCounters(os.path.join(self.cache_dir, "counters.bin"))
        self._store: Store | None = None
        self._staging: Store | None = None
        self._pid = -1
        self._admit = True
        self._warned_large = False
        self._on_ssd = on_ssd
        with DirectoryIdentity(self.cache_dir).check(identity, check) as opened:
            if opened.reset and os.path.lexists(store_dir):
                log.warning("lcache: dropping the samples cached in %s: their source is "
                            "unknown", store_dir)
                shutil.rmtree(store_dir)
            self.cache_id = opened.cache_id
            self.store()  # create it now, so configuration errors surface here
            self.invalidated = self._drop(opened.changed)

    def _drop(self, changed: np.ndarray) -> int:
        """Delete the cached copies of samples whose object changed at the source."""
        main = self.store()
        dropped = [int(i) for i in changed if int(i) in main and main.delete(int(i))]
        if dropped:
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
        if self._on_ssd:
            return os.path.join(self.cache_dir, "staging")
        key = xxhash.xxh3_64_hexdigest(f"{self.cache_dir}#{self.cache_id}".encode())
        return os.path.join(SHM, f"lcache-{key}")

    # ------------------------------------------------------------------- setting up
    def store(self) -> Store:
        """This process's handle on the store of kept samples (reopened after a fork)."""
        self._open()
        assert self._store is not None
        return self._store

    def staging(self) -> Store:
        """The store of prefetched samples the plan does not keep: each is read once, so
        they die in the order they were written and FIFO cleaning never copies. Keeping
        them apart from the kept samples (which die in random order) is what lets the
        main store run nearly full without write amplification."""
        self._open()
        assert self._staging is not None
        return self._staging

    def _open(self) -> None:
        # A forked child keeps the parent's Store objects: they reopen their own descriptors
        # (and close the inherited ones, which hold the parent's locks) on first use.
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._admit = True
        if self._store is not None:
            return
        with _OPENING:
            if self._store is not None:
                return
            if not self._on_ssd:
                _remove_orphaned_staging()
            private_dir(self.staging_dir, "staging directory")
            atomic_write(os.path.join(self.staging_dir, "origin"),
                         f"{self.cache_dir}\n{self.cache_id}".encode(), io_class="cache-meta",
                         durable=False)
            # Each process using the staging dir holds a shared flock, so the last one to
            # close removes it (memory in /dev/shm is not freed until its files are deleted).
            self._users = open_file(os.path.join(self.staging_dir, "users"),
                                    os.O_RDWR | os.O_CREAT)
            fcntl.flock(self._users, fcntl.LOCK_SH)
            _OPEN_CACHES.add(self)
            staging = Store.open(self.staging_dir, capacity=self.staging_bytes,
                                 segment_size=self.staging_segment_size, policy="fifo",
                                 max_writers=STAGING_WRITERS, sync="never",
                                 direct_writes=False)
            self._staging = staging
            self._store = Store.open(
                os.path.join(self.cache_dir, "store"), capacity=self.main_capacity,
                segment_size=self.segment_size, policy="planned",
                max_writers=min(MAX_WRITERS, self.main_capacity // self.segment_size - 2),
                sync="never", direct_writes=False)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_store"] = state["_staging"] = None  # each process opens its own
        return state

    def __del__(self) -> None:
        # Why: a cache dropped without close() would leave its /dev/shm staging (memory).
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        """Close the stores; remove the staging area if no other process uses it."""
        if self._store is None or self._staging is None or self._pid != os.getpid():
            return
        self._store.close()
        self._staging.close()
        self._store = self._staging = None
        _OPEN_CACHES.discard(self)
        try:
            fcntl.flock(self._users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(self.staging_dir, ignore_errors=True)
        except BlockingIOError:
            pass  # another process still stages samples there
        finally:
            os.close(self._users)

    def plan_capacity(self, writers: int, early: int = 0) -> int:
        """Sample bytes the plan may keep: the main store's capacity less one free segment,
        an active segment per writer, the index, and ``early`` bytes of kept samples that
        prefetchers bring in before their turn."""
        index = 16 * len(self.source) + (64 << 10)
        overhead = self.segment_size * (2 + writers) + index + early
        return max(0, self.main_capacity - overhead)

    def staging_window(self, ranks: int) -> int:
        """Bytes each of ``ranks`` prefetchers may stage without FIFO cleaning dropping a
        staged sample before it is read."""
        usable = self.staging_bytes - self.staging_segment_size * (2 + 2 * ranks)
        return max(0, usable // 2 // ranks)

    def record_sizes(self) -> np.ndarray:
        return self.source.sizes() + HEADER_SIZE

    # ------------------------------------------------------------------- serving
    def get(self, index: int, keep: bool | None = None) -> Any:
        """The item for sample ``index``: from the cache when there, else from the source
        (admitted when ``keep`` is not False). With ``keep=False`` a cached copy is deleted
        after it is read: the plan has no room for it until its next use."""
        main, staging = self.store(), self.staging()
        data, where = self._read(main, staging, index)
        fetched = data is None
        if data is None:
            with self.claims.hold(index):
                data, where = self._read(main, staging, index)  # fetched while we waited?
                if data is None:
                    data = self.source.fetch(index)
                    if keep is not False:
                        self._put(main, index, data)
                else:
                    fetched = False
        if where is staging:
            staging.delete(index)  # staged samples are read once
        deleted = keep is False and where is not staging and main.delete(index)
        if fetched:
            self.counters.add(accesses=1, fetches=1, remote_bytes=len(data),
                              served_bytes=len(data), deleted=int(deleted))
        else:
            self.counters.add(accesses=1, from_ssd=1, served_bytes=len(data),
                              deleted=int(deleted))
        return self.source.decode(data)

    def prefetch(self, index: int, keep: bool = True,
                 wanted: Callable[[], bool] = lambda: True) -> int:
        """Fetch sample ``index`` into the cache (the main store if ``keep``, else staging)
        unless it is there, being fetched, or no longer ``wanted()`` once claimed (a reader
        got to it first). Returns the bytes fetched from the source (0: nothing done)."""
        main, staging = self.store(), self.staging()
        if index in main or index in staging:
            return 0
        with self.claims.hold(index, blocking=False) as claimed:
            if not claimed or index in main or index in staging or not wanted():
                return 0
            data = self.source.fetch(index)
            self._put(main if keep else staging, index, data)
        self.counters.add(fetches=1, remote_bytes=len(data), prefetched=1)
        return len(data)

    def _read(self, main: Store, staging: Store, index: int
              ) -> tuple[bytes | memoryview | None, Store | None]:
        """The sample's bytes and the store that had them (main first, then staging)."""
        for store in (main, staging):
            view = store.get_many([index])[0]
            if view is None and index in store:
                # Why read twice: another process may have moved the record (compaction)
                # between our lookup and our read.
                view = store.get_many([index])[0]
                if view is None and index in store:
                    # Still unreadable: damaged on disk. Drop it; the source has it.
                    store.delete(index)
                    self.counters.add(corrupt_refetches=1)
            if view is not None:
                return view, store
        return None, None

    def _put(self, store: Store, index: int, data: bytes) -> None:
        if not self._admit:
            return
        if len(data) + HEADER_SIZE > store.config.segment_size:
            # A dataset's sizes are estimated from a probe: an item may be larger than any
            # segment. It is served from the source, uncached, rather than failing training.
            if not self._warned_large:
                self._warned_large = True
                log.warning("lcache: sample %d of %s (%s) is larger than a segment of %s and is "
                            "not cached; pass a larger segment_size", index, self.source.url,
                            format_size(len(data)), format_size(store.config.segment_size))
            return
        try:
            store.put(index, data)
        except (DiskFullError, StoreFullError) as exc:
            self._admit = False
            self.counters.add(admit_failures=1)
            log.warning("lcache: cannot add samples to %s (%s); training goes on reading "
                        "from %s, without caching in this process", self.cache_dir, exc,
                        self.source.url)

    # ------------------------------------------------------------------- figures
    def stats(self) -> dict[str, Any]:
        totals = self.counters.totals()
        accesses = totals["accesses"]
        fetched = totals["fetches"] - totals["prefetched"]  # misses the reader waited for
        return {
            "cache_dir": self.cache_dir,
            "source": self.source.url,
            "samples": len(self.source),
            "dataset_bytes": self.dataset_bytes,
            "capacity": self.capacity,
            "hit_ratio": 1 - totals["fetches"] / accesses if accesses else 0.0,
            "demand_misses": fetched,
            **totals,
        }
