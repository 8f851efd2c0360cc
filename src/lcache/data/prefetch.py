"""Fetch upcoming misses ahead of the reader, with bounded concurrency and memory.

One prefetcher per rank walks that rank's order from the reader's position: at most
``window`` samples ahead (staged in the cache until read), at most ``threads`` requests in
flight and at most ``budget_bytes`` of them in memory. It skips the positions the plan says
are hits (their samples are cached), and hands consecutive misses to the cache in groups of
up to ``group`` samples (``SampleCache.prefetch_many``: one claim pass, one ``fetch_many``, so a
source can coalesce them). In a shard-local order (``shards`` given) a group is instead the
misses of one shard within ``reach`` positions, fetched when the first of them comes within
the window: nearly whole shards, in one or a few ranged requests. Fetched samples are
staged (the reader moves those the plan keeps into the main store as it reads them);
claims (``lcache.data.shared``) keep it from fetching what a reader or another rank is
already fetching. So the first epoch runs at the remote's bandwidth, not its latency.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from lcache.data.cache import SampleCache

log = logging.getLogger("lcache")
GROUP = 16  # samples per prefetch_many: with 2 threads, 32 requests in flight
IDLE_WAIT = 0.05  # seconds: the longest a missed wake-up can delay the prefetcher


_LIVE: weakref.WeakSet[Prefetcher] = weakref.WeakSet()


def _stop_all() -> None:
    """At interpreter exit, before ``concurrent.futures`` refuses new work: a prefetcher
    whose sampler was never closed stops, rather than failing its fetch in flight."""
    for prefetcher in list(_LIVE):
        prefetcher._stopped = True


# Private, but the hook concurrent.futures itself uses: atexit functions run only after
# threading has joined the executors' workers, too late to stop a fetch in flight.
getattr(threading, "_register_atexit", lambda f: None)(_stop_all)


def consecutive_groups(positions: list[int], group: int) -> list[list[int]]:
    """The misses in runs of ``group``, in order."""
    return [positions[i:i + group] for i in range(0, len(positions), group)]


def shard_groups(positions: list[int], samples: list[int], shards: npt.NDArray[np.int64],
                 sizes: npt.NDArray[np.int64], reach: int, max_bytes: int) -> list[list[int]]:
    """The misses of one shard within ``reach`` positions of the group's first (and up to
    ``max_bytes``), ordered by their first miss: in a shard-local order those are most of a
    shard's samples, which ``fetch_many`` reads in one or a few ranged requests."""
    groups: list[list[int]] = []
    nbytes: list[int] = []
    open_group: dict[int, int] = {}  # shard -> its group being filled
    for p in positions:
        sample = samples[p]
        shard, size = int(shards[sample]), int(sizes[sample])
        g = open_group.get(shard)
        if g is None or p - groups[g][0] >= reach or nbytes[g] + size > max_bytes:
            g = open_group[shard] = len(groups)
            groups.append([])
            nbytes.append(0)
        groups[g].append(p)
        nbytes[g] += size
    return groups


class Prefetcher:
    def __init__(self, cache: SampleCache, order: npt.NDArray[np.int64], start: int, *,
                 hits: npt.NDArray[np.bool_] | None = None, threads: int = 2,
                 window: int = 256, budget_bytes: int = 64 << 20, group: int = GROUP,
                 shards: npt.NDArray[np.int64] | None = None, reach: int = 0,
                 staged_budget: int | None = None) -> None:
        self.cache = cache
        self.threads = max(1, threads)
        self.window = max(1, window)
        self.budget_bytes = budget_bytes
        self.group = max(1, group)
        misses = np.ones(len(order), bool) if hits is None else ~hits
        misses[:start] = False
        positions: list[int] = np.flatnonzero(misses).tolist()
        self._samples: list[int] = order.tolist()
        self._sizes = cache.source.sizes()
        self._groups = consecutive_groups(positions, self.group) if shards is None else \
            shard_groups(positions, self._samples, shards, self._sizes, reach,
                         max(1, budget_bytes // 4))
        self._cv = threading.Condition()
        self._reader = start
        self._wake_at = -1  # the reader position the waiting prefetcher needs (-1: none)
        self._next = 0  # into _groups
        self._inflight = 0
        self._inflight_bytes = 0
        # Staged samples not read yet, oldest first, and their bytes: at most staged_budget,
        # as readers remove what they read. Why not the window alone: DataLoader workers read
        # prefetch_factor x workers x batch samples behind the sampler's position, and FIFO
        # cleaning dropped staged samples before their read (fetched again; a kept one also
        # lost its later hits).
        self.staged_budget = staged_budget
        self._staged: deque[tuple[int, int]] = deque()
        self._staged_bytes = 0
        self._stopped = False
        self._failures = 0
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="lcache-prefetch")
        self._thread = threading.Thread(target=self._run, name="lcache-prefetcher", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def advance(self, position: int) -> None:
        """The reader is at ``position`` of the order (called for every sample: cheap unless
        the prefetcher waits for the reader to move)."""
        self._reader = position
        if 0 <= self._wake_at <= position:
            with self._cv:
                self._wake_at = -1
                self._cv.notify_all()

    def _room(self) -> bool:
        return self._inflight < self.threads and \
            (self._inflight_bytes < self.budget_bytes or self._inflight == 0) and \
            (self.staged_budget is None or self._unread() < max(1, self.staged_budget))

    def _unread(self) -> int:
        """Bytes this prefetcher staged that no reader has taken yet: checked oldest first
        (readers take them in about the order they were staged), and all of them when that
        is over the budget (one never read must not hold back the rest)."""
        try:
            staging = self.cache.staging()
        except Exception:  # closed meanwhile: the prefetcher is about to stop anyway
            return 0
        while self._staged and self._staged[0][0] not in staging:
            self._staged_bytes -= self._staged.popleft()[1]
        if self.staged_budget is not None and self._staged_bytes >= self.staged_budget:
            self._staged = deque(entry for entry in self._staged if entry[0] in staging)
            self._staged_bytes = sum(nbytes for _, nbytes in self._staged)
        return self._staged_bytes

    def _run(self) -> None:
        groups = self._groups
        while True:
            with self._cv:
                while not self._stopped and self._next < len(groups):
                    reader = self._reader
                    while self._next < len(groups) and groups[self._next][-1] <= reader:
                        self._next += 1  # the reader has these: skip ahead
                    if self._next < len(groups):
                        ahead = groups[self._next][0] - self.window
                        if ahead < reader and self._room():
                            break
                        self._wake_at = ahead + 1 if ahead >= reader else -1
                    self._cv.wait(IDLE_WAIT)
                if self._stopped or self._next >= len(groups) or self.cache.closed:
                    return
                group = [p for p in groups[self._next] if p > self._reader]
                size = sum(int(self._sizes[self._samples[p]]) for p in group)
                self._next += 1
                self._inflight += 1
                self._inflight_bytes += size
            try:
                self._pool.submit(self._fetch, group, size)
            except RuntimeError:  # closed from one of our own threads (see close)
                return

    def _fetch(self, group: list[int], size: int) -> None:
        # Why the check after claiming: a reader that fetched a sample the plan does not
        # keep leaves nothing in the cache; fetching it again would double the traffic.
        try:
            if not self._stopped:
                # Staged, kept or not: the reader moves a kept one into the main store as it
                # reads it, when the plan has it enter (SampleCache._read). Put there now, it
                # would sit beside what the plan deletes before its turn; past its capacity
                # the store evicted samples the plan keeps (a slow training loop got 0.25 of
                # the plan's 0.45 hit ratio, and a loader reading 512 samples behind the
                # sampler lost 3-4% of an epoch's hits).
                at = {self._samples[p]: p for p in group}
                self.cache.prefetch_many(list(at), [False] * len(group),
                                         wanted=lambda sample: at[sample] > self._reader)
                with self._cv:
                    for sample in at:
                        nbytes = int(self._sizes[sample])
                        self._staged.append((sample, nbytes))
                        self._staged_bytes += nbytes
        except Exception as exc:  # the reader fetches them again and raises there
            if self._stopped or self.cache.closed:
                self._stopped = True  # closed under us (or exiting): stop without a word
                return
            self._failures += 1
            if self._failures == 1:
                samples = sorted(self._samples[p] for p in group)
                named = ", ".join(map(str, samples[:16])) + \
                    (f", ... ({len(samples)} in all)" if len(samples) > 16 else "")
                log.warning("lcache: prefetching samples %s failed (%r); readers will fetch "
                            "them on demand", named, exc)
        finally:
            with self._cv:
                self._inflight -= 1
                self._inflight_bytes -= size
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        # The sampler's generator may be finalised by the garbage collector in any thread,
        # one of ours included; a thread cannot join itself.
        ours = threading.current_thread() is self._thread or \
            threading.current_thread().name.startswith("lcache-prefetch")
        if not ours:
            self._thread.join()
        self._pool.shutdown(wait=not ours, cancel_futures=True)
