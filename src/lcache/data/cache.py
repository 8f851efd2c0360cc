"""The node's sample cache: a store on local SSD in front of a source.

``DIR/cache.json`` names the source the directory caches (a second dataset never reads the
first one's samples); ``DIR/store`` is the log-structured store of kept samples (int key =
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
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import xxhash

from lcache.data.shared import FetchClaims, SharedCounters
from lcache.data.sources import Source, as_source
from lcache.errors import ConfigError, DiskFullError, StoreFullError, StorePermissionError
from lcache.io.publish import atomic_write
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
            with open(os.path.join(path, "origin")) as f:
                origin, _, cache_id = f.read().partition("\n")
            if _cache_id(origin) == cache_id:
                continue  # its cache still exists
            fd = os.open(os.path.join(path, "users"), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
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
        with open(os.path.join(cache_dir, "cache.json")) as f:
            return str(json.load(f).get("id"))
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
                 staging_bytes: int | str = DEFAULT_STAGING) -> None:
        self.source: Source = as_source(source)
        self.cache_dir = os.path.abspath(os.fspath(cache_dir))
        self.capacity = parse_size(capacity)
        sizes = self.source.sizes()
        self.dataset_bytes = int(sizes.sum())
        largest = int(sizes.max())
        self.segment_size = parse_size(segment_size) if segment_size else \
            choose_segment_size(self.capacity, 512, largest)
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
        self._prepare_dir()
        key = xxhash.xxh3_64_hexdigest(f"{self.cache_dir}#{self.cache_id}".encode())
        self.staging_dir = os.path.join(self.cache_dir, "staging") if on_ssd else \
            os.path.join(SHM, f"lcache-{key}")
        self.claims = FetchClaims(os.path.join(self.cache_dir, "claims"))
        self.counters = SharedCounters(os.path.join(self.cache_dir, "counters.bin"))
        self._store: Store | None = None
        self._staging: Store | None = None
        self._pid = -1
        self._admit = True
        self.store()  # create it now, so configuration errors surface here

    # ------------------------------------------------------------------- setting up
    def _prepare_dir(self) -> None:
        try:
            os.makedirs(self.cache_dir, mode=0o700, exist_ok=True)
        except PermissionError:
            raise StorePermissionError(
                f"cannot create the cache directory {self.cache_dir}: permission denied; "
                "choose a directory you can write (e.g. on the local NVMe SSD)") from None
        if not os.access(self.cache_dir, os.W_OK | os.X_OK):
            raise StorePermissionError(
                f"the cache directory {self.cache_dir} is not writable by this user; fix its "
                "permissions or choose another directory")
        identity = {"source": self.source.url, "samples": len(self.source),
                    "sizes_xxh3": xxhash.xxh3_64_hexdigest(self.source.sizes().tobytes())}
        path = os.path.join(self.cache_dir, "cache.json")
        try:
            with open(path) as f:
                stored = json.load(f)
        except FileNotFoundError:
            # A fresh id per cache, so a recreated directory never meets the staging area
            # (in /dev/shm) of the one it replaced.
            stored = {**identity, "id": os.urandom(8).hex()}
            atomic_write(path, json.dumps(stored, indent=1).encode(), io_class="cache-meta")
        except ValueError:
            stored = {}
        self.cache_id = str(stored.get("id", ""))
        if {k: v for k, v in stored.items() if k != "id"} != identity:
            raise ConfigError(
                f"{self.cache_dir} caches {stored.get('source')!r} "
                f"({stored.get('samples')} samples), not {self.source.url!r} "
                f"({len(self.source)} samples); use another cache directory or delete it")

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
            if self.staging_dir.startswith(SHM):
                _remove_orphaned_staging()
            os.makedirs(self.staging_dir, mode=0o700, exist_ok=True)
            with open(os.path.join(self.staging_dir, "origin"), "w") as f:
                f.write(f"{self.cache_dir}\n{self.cache_id}")
            # Each process using the staging dir holds a shared flock, so the last one to
            # close removes it (memory in /dev/shm is not freed until its files are deleted).
            self._users = os.open(os.path.join(self.staging_dir, "users"),
                                  os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
