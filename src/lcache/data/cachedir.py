"""What a cache directory holds besides its samples, and the clean-up of what a killed run
left: the staging areas of prefetched samples (``DIR/staging-ID``, or ``/dev/shm/lcache-*``
when memory has room) and a store of unknown origin. Nothing another user, or the user
themselves, put there is ever removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat

from lcache import jsondoc
from lcache.data.identity import read_cache_json
from lcache.errors import ConfigError, LCacheError
from lcache.io import close_file, fsync_dir
from lcache.io.files import open_regular
from lcache.store.layout import foreign_entries, load_config
from lcache.store.record import HEADER_SIZE
from lcache.store.segment import list_segments

log = logging.getLogger("lcache")

SHM = "/dev/shm"


def remove_orphaned_staging() -> None:
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
            fd = open_regular(os.path.join(path, "origin"), os.O_RDONLY)
            try:
                # as written: a cache directory's name need not be UTF-8
                origin, _, cache_id = os.fsdecode(os.read(fd, 1 << 16)).partition("\n")
            finally:
                close_file(fd)
            if _cache_id(origin) == cache_id:
                continue  # its cache still exists
        except (OSError, UnicodeDecodeError):
            continue
        remove_if_unused(path)


def remove_stale_staging(cache_dir: str, keep: str) -> None:
    """Remove the staging dirs in the cache dir of other cache ids that no process uses."""
    for name in os.listdir(cache_dir):
        path = os.path.join(cache_dir, name)
        with contextlib.suppress(FileNotFoundError):
            if name.partition("-")[0] == "staging" and path != keep and \
                    stat.S_ISDIR(os.lstat(path).st_mode):
                remove_if_unused(path)


def remove_if_unused(path: str) -> None:
    """Remove staging dir ``path`` unless a process holds its users lock, or it holds what
    a staging area does not write (a user's ``staging-notes`` folder in the cache dir, or
    a ``/dev/shm/lcache-x`` of their own): never removed."""
    try:
        if foreign_entries(path):
            return
    except OSError:  # gone meanwhile, or not ours to read
        return
    try:
        fd = open_regular(os.path.join(path, "users"), os.O_RDWR)
    except FileNotFoundError:  # left by a killed process before it made the lock
        shutil.rmtree(path, ignore_errors=True)
        return
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass
    finally:
        close_file(fd)


def first_missing(path: str) -> str | None:
    """The topmost folder of absolute ``path`` that does not exist yet (what making ``path``
    with its parents creates), or None where ``path`` exists."""
    top = None
    while not os.path.lexists(path):
        top, path = path, os.path.dirname(path)
    return top


def remove_made_cache_dir(cache_dir: str, top: str) -> None:
    """Remove ``cache_dir`` and its parents up to ``top``, which this process made and then
    failed to use (a failed ``lcache warm`` left them): not if another process uses the
    cache meanwhile (holds its ``cache.lock`` or ``users.lock``), nor a parent that holds
    anything else."""
    try:
        st = os.lstat(cache_dir)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return
    fds: list[int] = []
    try:
        for name in ("cache.lock", "users.lock"):
            with contextlib.suppress(FileNotFoundError):
                fds.append(open_regular(os.path.join(cache_dir, name), os.O_RDWR))
                fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        shutil.rmtree(cache_dir)
    except OSError:  # in use (BlockingIOError), or not ours to remove
        return
    finally:
        for fd in fds:
            close_file(fd)
    path = cache_dir
    while path != top:
        path = os.path.dirname(path)
        if len(path) < len(top):  # top is not above cache_dir: never past it
            return
        try:
            os.rmdir(path)  # only an empty one
        except OSError:
            return


def shm_has_room(need: int) -> bool:
    """Whether /dev/shm can hold a staging area of ``need`` bytes (with room to spare)."""
    try:
        st = os.statvfs(SHM)
        return st.f_bavail * st.f_frsize >= 2 * need and os.access(SHM, os.W_OK)
    except OSError:
        return False


def _cache_id(cache_dir: str) -> str | None:
    try:
        raw = read_cache_json(cache_dir)
        return None if raw is None else str(jsondoc.loads(raw).get("id"))
    except (OSError, ValueError, AttributeError):  # ConfigError is a ValueError
        return None


def stored_segment_size(store_dir: str, largest: int) -> int | None:
    """The segment size of the store in ``store_dir``, if there is one that holds the
    largest sample."""
    try:
        config = None if os.path.islink(store_dir) else load_config(store_dir)
    except (OSError, LCacheError):
        return None  # damaged or unreadable: the store's own open says so
    if config is None or largest + HEADER_SIZE > config.segment_size:
        return None
    return config.segment_size


def drop_unknown_store(store_dir: str, described: bool) -> None:
    """Remove the store of a cache directory whose cache.json is damaged, of an older lcache
    or absent: its samples are of an unknown source. Never anything lcache did not write.

    Raises:
        ConfigError: ``store_dir`` holds files a store does not write, or (``described``
            false: no cache.json) segments of records, so it is not this cache's store.
    """
    foreign = foreign_entries(store_dir) if os.path.isdir(store_dir) else [store_dir]
    if foreign:
        raise ConfigError(
            f"{store_dir} holds what no lcache store writes ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}), and the cache would remove it as a store "
            "of unknown origin; move it elsewhere, or choose another cache directory")
    has_segments = os.path.isdir(os.path.join(store_dir, "segments")) and \
        any(list_segments(store_dir))  # (logs, sealed): either non-empty
    if not described and has_segments:
        # A cache writes cache.json before it caches a sample: this store is another's (a
        # Store.open or `lcache store-demo` there), or its cache.json was deleted.
        raise ConfigError(
            f"{store_dir} is a store that holds records, but {os.path.dirname(store_dir)} has "
            "no cache.json, so the store is not this cache's; choose another cache "
            "directory, or delete the store yourself if it is a cache whose cache.json was "
            "lost")
    log.warning("lcache: dropping the samples cached in %s: their source is unknown", store_dir)
    shutil.rmtree(store_dir)
    fsync_dir(os.path.dirname(store_dir))  # gone before the new cache.json says so
