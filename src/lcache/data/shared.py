"""State the processes of a node share through the cache directory, crash-safely:

* ``FetchClaims``: at most one process (and one thread) fetches a given sample at a time, so
  two ranks or a rank and its prefetcher never download the same sample twice. A claim is a
  ``lockf`` byte-range lock at the sample's offset of one file; the kernel drops it when the
  holder dies, so a crash leaves no stale claim.
* ``SharedCounters``: per-process slots of a memory-mapped counter file, summed by readers.
  Each process owns one slot (its pid in the slot; a slot of a dead pid is taken over, its
  counts kept), so increments need no lock, and counts survive DataLoader workers that exit
  through ``os._exit``. (Not lockf: closing any descriptor of the file, as mmap does when
  collected, would drop the process's locks.)
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from lcache.forksafe import fork_safe_lock
from lcache.io import close_file
from lcache.io.files import open_owned

# Appended only: a counter's index is its place in every slot of existing files.
COUNTER_NAMES = ("accesses", "from_ssd", "fetches", "remote_bytes", "prefetched",
                 "corrupt_refetches", "admit_failures", "deleted", "served_bytes", "from_ram",
                 "skipped")
log = logging.getLogger("lcache")
_SETUP = fork_safe_lock()  # per-process set-up runs once even when threads race to it
SLOTS = 1024
SLOT_BYTES = 128  # 16 u64: the counters, then the owner's pid in the last one
WIDTH = SLOT_BYTES // 8
OWNER = WIDTH - 1
# (path, inode) -> mapped counter table, per process (inherited by fork)
_TABLES: dict[tuple[str, int], Any] = {}
_SLOT_LOCKS: dict[tuple[int, int], threading.Lock] = {}  # (id of its table, slot)


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
            self._fd = open_owned(self.path, os.O_RDWR | os.O_CREAT)
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
        with self.hold_many([key], blocking) as held:
            yield bool(held)

    @contextmanager
    def hold_many(self, keys: Sequence[int], blocking: bool = True) -> Iterator[list[int]]:
        """Claim each of ``keys`` (distinct); yields those claimed: all of them when
        ``blocking``, else those no other thread or process held. Blocking claims are taken
        in the order given: give it sorted, and two holders can never wait on each other."""
        self._setup()
        held: list[int] = []
        try:
            for key in keys:
                if self._acquire(key, blocking):
                    held.append(key)
            yield held
        finally:
            for key in reversed(held):
                self._release(key)

    def _acquire(self, key: int, blocking: bool) -> bool:
        with self._mu:
            entry = self._locks.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1  # type: ignore[operator]
        lock: threading.Lock = entry[0]  # type: ignore[assignment]
        got = False
        try:
            if lock.acquire(blocking):
                try:
                    self._lock_byte(key, blocking)
                    got = True
                except BlockingIOError:
                    pass
                finally:
                    if not got:
                        lock.release()
        finally:
            if not got:
                self._unref(key, entry)
        return got

    def _lock_byte(self, key: int, blocking: bool) -> None:
        """The process-wide lock on byte ``key``. The kernel owns lockf locks by process:
        one thread waiting on a key another process holds, while another of our threads
        holds a key that process's waiter wants, looks like a deadlock to it (EDEADLK),
        though neither holder waits. It is not one: wait and ask again."""
        flags = fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB)
        while True:
            try:
                fcntl.lockf(self._fd, flags, 1, key, os.SEEK_SET)
                return
            except OSError as exc:
                if exc.errno != errno.EDEADLK:
                    raise
            time.sleep(0.005)

    def _release(self, key: int) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, key, os.SEEK_SET)
        with self._mu:
            entry = self._locks[key]
        entry[0].release()  # type: ignore[attr-defined]
        self._unref(key, entry)

    def _unref(self, key: int, entry: list[object]) -> None:
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

    def _table(self) -> Any:
        """The counter file, mapped once per path and kept for the process's life; a forked
        child keeps using the (shared) mapping it inherited."""
        fd = open_owned(self.path, os.O_RDWR | os.O_CREAT)
        key = (self.path, os.fstat(fd).st_ino)  # a recreated file is another table
        table = _TABLES.get(key)
        if table is not None:
            close_file(fd)
        else:
            try:
                _start_afresh_if_damaged(fd, self.path)
                # Why allocate: touching a page of a sparse mapping on a full filesystem
                # kills the process with SIGBUS.
                os.posix_fallocate(fd, 0, SLOTS * SLOT_BYTES)
                mm: Any = mmap.mmap(fd, SLOTS * SLOT_BYTES)
            except OSError as exc:
                log.warning("lcache: cannot map %s (%s); this process counts on its own",
                            self.path, exc)
                mm = bytearray(SLOTS * SLOT_BYTES)
            finally:
                close_file(fd)
            table = _TABLES[key] = np.frombuffer(mm, np.uint64).reshape(SLOTS, WIDTH)
        return table

    def _mine(self) -> Any:
        if self._pid == os.getpid():
            return self._slot
        with _SETUP:
            if self._pid != os.getpid():
                table = self._table()
                index = self._claim(table)
                self._slot = table[index]
                # one lock per slot: handles of one process share its slot
                self._lock = _SLOT_LOCKS.setdefault((id(table), index), threading.Lock())
                self._pid = os.getpid()
        return self._slot

    def _claim(self, table: Any) -> int:
        """This process's slot (a handle made again takes the one it had: each took a new
        one, and a process that made its dataset 1,024 times ran out), else one whose owner
        (pid in its last word) is gone, taken under a brief flock."""
        fd = open_owned(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            owners = table[:, OWNER]
            mine = np.flatnonzero(owners == os.getpid())
            if len(mine):
                return int(mine[0])
            for index, owner in enumerate(owners.tolist()):
                if owner == 0 or not _alive(owner):
                    table[index, OWNER] = os.getpid()
                    return index
        finally:
            close_file(fd)  # also releases the flock
        raise RuntimeError(f"more than {SLOTS} live processes use {self.path}")

    def add(self, **counts: int) -> None:
        slot = self._mine()
        with self._lock:  # threads of one process share its slot
            for name, n in counts.items():
                slot[COUNTER_NAMES.index(name)] += np.uint64(n)

    def totals(self) -> dict[str, int]:
        if not os.path.exists(self.path):
            return dict.fromkeys(COUNTER_NAMES, 0)
        sums = self._table()[:, : len(COUNTER_NAMES)].sum(axis=0)
        return {name: int(sums[i]) for i, name in enumerate(COUNTER_NAMES)}


def _start_afresh_if_damaged(fd: int, path: str) -> None:
    """Empty a counter file of another size than the table's (damaged, or not lcache's):
    its bytes were read as counts (~1e19) and owners' pids. Under the flock that slot claims
    take; a table in use always has the full size (it is allocated before it is mapped), so
    only a file no process counts in is emptied."""
    if os.fstat(fd).st_size in (0, SLOTS * SLOT_BYTES):
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        size = os.fstat(fd).st_size
        if size not in (0, SLOTS * SLOT_BYTES):
            log.warning("lcache: %s is %d bytes, not a table of counters (%d bytes); its counts "
                        "start again from zero", path, size, SLOTS * SLOT_BYTES)
            os.ftruncate(fd, 0)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
