"""Which filesystem a traced file lives on: device number, mount point and type.

The recorder writes them into each file's ``file_name`` line, so the report can tell bytes
that reached a storage device from bytes that stayed in memory (tmpfs, ramfs: lcache's
prefetch staging area in /dev/shm) and give bytes per device.
"""

from __future__ import annotations

import os
import re

#: Filesystems whose files live in memory: their I/O never reaches a storage device.
MEMORY_FS = frozenset({"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"})

_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as \040, \011, \012, \134
    return _OCTAL.sub(lambda m: chr(int(m[1], 8)), field)


def read_mountinfo(path: str = "/proc/self/mountinfo") -> list[tuple[str, str, str]]:
    """(``"major:minor"``, mount point, fs type) of every mount; empty if unreadable."""
    out: list[tuple[str, str, str]] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if sep and len(fields) >= 5 and tail:
            out.append((fields[2], _unescape(fields[4]), tail[0]))
    return out


def _under(path: str, mount: str) -> bool:
    return mount == "/" or path == mount or path.startswith(mount.rstrip("/") + "/")


def find_mount(mounts: list[tuple[str, str, str]], dev: str,
               path: str) -> tuple[str, str, str] | None:
    """The mount of ``path`` on device ``dev``: among the mounts of that device (bind or
    stacked mounts share one), the deepest that holds the path; where no mount has that
    device number (btrfs subvolumes report their own), the deepest mount that holds the path."""
    best: tuple[str, str, str] | None = None
    for cand in (m for m in mounts if m[0] == dev), iter(mounts):
        for m in cand:
            if _under(path, m[1]) and (best is None or len(m[1]) >= len(best[1])):
                best = m
        if best is not None:
            return (dev or best[0], best[1], best[2])
    return None


class MountTable:
    """``/proc/self/mountinfo``, read once and again when a device is not in it."""

    def __init__(self) -> None:
        self._mounts = read_mountinfo()
        self._reread: set[str] = set()

    def lookup(self, st_dev: int, path: str) -> dict[str, str]:
        """``{"dev", "fs", "mnt"}`` of a file, or ``{}`` when it is not a local path."""
        if not path.startswith("/"):
            return {}
        if st_dev == 0:  # recorded by name (lcache.trace.record): look the path up
            try:
                st_dev = os.stat(path).st_dev
            except OSError:
                return {}
        dev = f"{os.major(st_dev)}:{os.minor(st_dev)}"
        if dev not in self._reread and not any(m[0] == dev for m in self._mounts):
            self._reread.add(dev)
            self._mounts = read_mountinfo()  # mounted since we read it
        found = find_mount(self._mounts, dev, path)
        if found is None:
            return {"dev": dev}
        return {"dev": found[0], "fs": found[2], "mnt": found[1]}
