"""State the processes of a node share through the cache directory, crash-safely:

* ``FetchClaims``: at most one process (and one thread) fetches a given sample at a time, so
  two ranks or a rank and its prefetcher never download the same sample twice. A claim is a
  ``lockf`` byte-range lock at the sample's offset of one file; the kernel drops it when the
  holder dies, so a crash leaves no stale claim.
* ``SharedCounters``: per-process slots of a memory-mapped counter file, summed by readers.
  Each process owns one slot (held by ``lockf``), so increments need no lock, and counts
  survive DataLoader workers that exit through ``os._exit``.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

COUNTER_NAMES = ("accesses", "from_ssd", "fetches", "remote_bytes", "prefetched",
                 "corrupt_refetches", "admit_failures", "deleted", "served_bytes")
_SETUP = threading.Lock()  # per-process set-up runs once even when threads race to it
SLOTS = 1024
SLOT_BYTES = 128  # 16 u64 counters


class FetchClaims:
    def __init__(self, path: str) -> None:
        self.path = path
        self._pid = -1

    def _setup(self) -> None:
        if self._pid == os.getpid():
            return
        with _SETUP:
            if self._pid == os.getpid():
                return
            # Why one descriptor per process: closing any descriptor of a file drops all of
            # the process's lockf locks on it.
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._mu = threading.Lock()
            self._locks: dict[int, list[object]] = {}
            self._pid = os.getpid()

    def __getstate__(self) -> dict[str, str]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    @contextmanager
    def hold(self, key: int, blocking: bool = True) -> Iterator[bool]:
        """Claim ``key``; yields False (without waiting) when ``blocking`` is off and another
        thread or process holds it."""
        self._setup()
        with self._mu:
            entry = self._locks.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1  # type: ignore[operator]
        lock: threading.Lock = entry[0]  # type: ignore[assignment]
        got = lock.acquire(blocking)
        try:
            if got:
                try:
                    flags = fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB)
                    fcntl.lockf(self._fd, flags, 1, key, os.SEEK_SET)
                except BlockingIOError:
                    lock.release()
                    got = False
            yield got
        finally:
            if got:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, key, os.SEEK_SET)
                lock.release()
            with self._mu:
                entry[1] -= 1  # type: ignore[operator]
                if entry[1] == 0:
                    del self._locks[key]


class SharedCounters:
    def __init__(self, path: str) -> None:
        self.path = path
        self._pid = -1
        self._slot: Any = None

    def __getstate__(self) -> dict[str, str]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def _map(self) -> Any:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(fd).st_size < SLOTS * SLOT_BYTES:
            os.ftruncate(fd, SLOTS * SLOT_BYTES)
        self._fd = fd
        self._mm = mmap.mmap(fd, SLOTS * SLOT_BYTES)
        return np.frombuffer(self._mm, dtype=np.uint64).reshape(SLOTS, SLOT_BYTES // 8)

    def _mine(self) -> Any:
        if self._pid == os.getpid():
            return self._slot
        with _SETUP:
            if self._pid != os.getpid():
                table = self._map()
                for slot in range(SLOTS):
                    try:
                        fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, SLOT_BYTES,
                                    slot * SLOT_BYTES, os.SEEK_SET)
                    except OSError:
                        continue
                    self._slot = table[slot]
                    break
                else:
                    raise RuntimeError(f"more than {SLOTS} processes use {self.path} at once")
                self._lock = threading.Lock()
                self._pid = os.getpid()
        return self._slot

    def add(self, **counts: int) -> None:
        slot = self._mine()
        with self._lock:  # threads of one process share its slot
            for name, n in counts.items():
                slot[COUNTER_NAMES.index(name)] += np.uint64(n)

    def totals(self) -> dict[str, int]:
        if not os.path.exists(self.path):
            return dict.fromkeys(COUNTER_NAMES, 0)
        with open(self.path, "rb") as f:
            raw = np.frombuffer(f.read(), dtype=np.uint64).reshape(-1, SLOT_BYTES // 8)
        sums = raw.sum(axis=0)
        return {name: int(sums[i]) for i, name in enumerate(COUNTER_NAMES)}
