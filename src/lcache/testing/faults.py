"""Fault injection on a store directory: flip bits, cut files, measure what is on disk.

These work on the files themselves, as a failing disk or a crash would, never through the store.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from lcache.io import close_file
from lcache.store import record
from lcache.store.files import STEMS, existing_generations, generation_path
from lcache.store.index import unpack_loc
from lcache.store.segment import list_segments, log_path, sum_path
from lcache.store.store import Store


@dataclass(frozen=True, slots=True)
class RecordLocation:
    """Where the index says a key's record lies."""

    segment: int
    path: str
    offset: int
    length: int

    @property
    def payload_offset(self) -> int:
        """First payload byte (for int keys; byte keys add their key length)."""
        return self.offset + record.HEADER_SIZE


def locate(store: Store, key: int | bytes) -> RecordLocation | None:
    """The record the store's index points at for ``key`` (``None`` if not indexed)."""
    kind, key64, _ = record.key_parts(key)
    entry = store._lookup(kind, key64)
    if entry is None:
        return None
    loc, length = entry
    seg, off = unpack_loc(loc)
    return RecordLocation(seg, log_path(store.root, seg), off, length)


def flip_bit(path: str | os.PathLike[str], offset: int, bit: int = 0) -> None:
    """Invert one bit of the byte at ``offset`` of the file, in place, and sync it."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        old = os.pread(fd, 1, offset)
        if len(old) != 1:
            raise ValueError(f"{path} has no byte at offset {offset}")
        os.pwrite(fd, bytes([old[0] ^ (1 << bit)]), offset)
        os.fsync(fd)
    finally:
        close_file(fd)


def truncate(path: str | os.PathLike[str], size: int) -> None:
    """Cut the file to ``size`` bytes (a torn write, a lost tail)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        close_file(fd)


def segment_ids(root: str | os.PathLike[str]) -> tuple[list[int], set[int]]:
    """(every segment id with a ``.log``, sorted; the ids that are sealed)."""
    return list_segments(os.fspath(root))


def unsealed_segments(root: str | os.PathLike[str]) -> list[int]:
    logs, sums = segment_ids(root)
    return [seg for seg in logs if seg not in sums]


def segment_log(root: str | os.PathLike[str], seg: int) -> str:
    return log_path(os.fspath(root), seg)


def segment_sum(root: str | os.PathLike[str], seg: int) -> str:
    return sum_path(os.fspath(root), seg)


def index_path(root: str | os.PathLike[str], kind: str = "int") -> str:
    """Path of the ``int`` or ``bytes`` index file (its newest generation), or of the delete
    journal (``kind="deletes"``)."""
    stem = {"int": "index-int", "bytes": "index-bytes", "deletes": "deletes"}[kind]
    gens = existing_generations(os.fspath(root), stem)
    if not gens:
        raise FileNotFoundError(f"no {stem} file in {root}")
    return generation_path(os.fspath(root), stem, gens[-1])


def disk_usage(root: str | os.PathLike[str]) -> int:
    """Bytes the store's capacity bounds: segment files (apparent size) plus the index files
    and the delete journal.

    Index files are memory-mapped arrays (the int one sparse), so they count by allocated
    blocks, as the store itself counts them; segment files count by their length.
    """
    root = os.fspath(root)
    total = 0
    seg_dir = os.path.join(root, "segments")
    for name in os.listdir(seg_dir):
        with contextlib.suppress(FileNotFoundError):  # removed by a concurrent clean-up
            total += os.stat(os.path.join(seg_dir, name)).st_size
    for stem in STEMS:
        for gen in existing_generations(root, stem):
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(generation_path(root, stem, gen)).st_blocks * 512
    return total


def largest_segment(root: str | os.PathLike[str]) -> int:
    """Length of the longest ``.log`` (0 if none)."""
    seg_dir = os.path.join(os.fspath(root), "segments")
    sizes = [0]
    for name in os.listdir(seg_dir):
        if name.endswith(".log"):
            with contextlib.suppress(FileNotFoundError):
                sizes.append(os.stat(os.path.join(seg_dir, name)).st_size)
    return max(sizes)
