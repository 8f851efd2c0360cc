"""Room on this machine: memory and free space, checked before a run allocates or writes.

A workload too big for the machine (a dataset larger than the disk, an epoch order larger than
memory) then fails at once with a message saying what to lower, not with an out-of-memory kill
or ``ENOSPC`` hours into the run.
"""

from __future__ import annotations

import contextlib
import os

from lcache.errors import ConfigError
from lcache.store.layout import format_size


def meminfo(key: str) -> int:
    """``MemTotal``, ``MemAvailable``... of ``/proc/meminfo`` in bytes (0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == key:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _statvfs(path: str) -> os.statvfs_result:
    """``statvfs`` of the filesystem holding ``path``, which may not exist yet (its nearest
    existing parent's: checked before anything is created)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return os.statvfs(path)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still put on the filesystem holding ``path``, which
    may not exist yet."""
    st = _statvfs(path)
    return st.f_bavail * st.f_frsize


def bytes_under(path: str) -> int:
    """Bytes of the files under ``path`` (a run that rewrites them reuses their space)."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def need_space(path: str, nbytes: int, what: str, lower: str, reusable: int = 0) -> None:
    """Refuse to start writing ``nbytes`` under ``path`` when its filesystem lacks them.

    Args:
        what: what would be written, for the message.
        lower: the settings that shrink it, for the message.
        reusable: bytes of files there that the run rewrites in place.
    """
    st = _statvfs(path)
    free = st.f_bavail * st.f_frsize + reusable
    if nbytes > free and st.f_blocks == 0:  # /proc, /sys: no space to free, none to hold files
        raise ConfigError(f"{what} cannot go in {path}: its filesystem has no room for files "
                          "at all (a virtual one, such as /proc or /sys); choose a folder on a "
                          "disk")
    if nbytes > free:
        raise ConfigError(f"{what} needs about {format_size(nbytes)} in {path}, which has "
                          f"{format_size(free)} free; lower {lower} or free some space")


def need_memory(nbytes: int, what: str, lower: str) -> None:
    """Refuse an allocation of ``nbytes`` that this machine's available memory cannot hold."""
    available = meminfo("MemAvailable")
    if available and nbytes > available:
        raise ConfigError(f"{what} needs about {format_size(nbytes)} of memory, and this "
                          f"machine has {format_size(available)} available; lower {lower}")
