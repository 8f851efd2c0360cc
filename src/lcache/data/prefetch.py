"""Fetch upcoming misses ahead of the reader, with bounded concurrency and memory.

One prefetcher per rank walks that rank's order from the reader's position: at most
``window`` samples ahead (staged in the cache until read), at most ``threads``
fetches at once and at most ``budget_bytes`` of them in memory. Fetched samples go into the
store; claims (``lcache.data.shared``) keep it from fetching what a reader or another rank is
already fetching. So the first epoch runs at the remote's bandwidth, not its latency.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from lcache.data.cache import SampleCache

log = logging.getLogger("lcache")


class Prefetcher:
    def __init__(self, cache: SampleCache, order: npt.NDArray[np.int64],
                 keep: npt.NDArray[np.bool_], start: int, *,
                 threads: int = 16, window: int = 256, budget_bytes: int = 64 << 20) -> None:
        self.cache = cache
        self.order = order
        self.keep = keep
        self.threads = max(1, threads)
        self.window = max(1, window)
        self.budget_bytes = budget_bytes
        self._sizes = cache.source.sizes()
        self._cv = threading.Condition()
        self._reader = start
        self._next = start
        self._inflight = 0
        self._inflight_bytes = 0
        self._stopped = False
        self._failures = 0
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="lcache-prefetch")
        self._thread = threading.Thread(target=self._run, name="lcache-prefetcher", daemon=True)
        self._thread.start()

    def advance(self, position: int) -> None:
        """The reader is at ``position`` of the order."""
        with self._cv:
            self._reader = position
            self._cv.notify_all()

    def _may_start(self) -> bool:
        return (self._next < self._reader + self.window and self._inflight < self.threads
                and (self._inflight_bytes < self.budget_bytes or self._inflight == 0))

    def _run(self) -> None:
        n = len(self.order)
        while True:
            with self._cv:
                while not self._stopped and self._next < n and not self._may_start():
                    self._cv.wait()
                if self._stopped or self._next >= n:
                    return
                if self._next <= self._reader:  # the reader has this one: skip ahead
                    self._next = self._reader + 1
                    continue
                position = self._next
                index = int(self.order[position])
                size = int(self._sizes[index])
                self._next += 1
                self._inflight += 1
                self._inflight_bytes += size
            try:
                self._pool.submit(self._fetch, position, index, size)
            except RuntimeError:  # closed from one of our own threads (see close)
                return

    def _fetch(self, position: int, index: int, size: int) -> None:
        # Why the check after claiming: a reader that fetched a sample the plan does not
        # keep leaves nothing in the cache; fetching it again would double the traffic.
        try:
            if not self._stopped:
                self.cache.prefetch(index, bool(self.keep[position]),
                                    wanted=lambda: position > self._reader)
        except Exception as exc:  # the reader fetches it again and raises there
            self._failures += 1
            if self._failures == 1:
                log.warning("lcache: prefetching sample %d failed (%r); readers will fetch "
                            "on demand", index, exc)
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
