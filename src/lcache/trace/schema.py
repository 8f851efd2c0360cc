"""The trace file format: Chrome trace events, one JSON object per line (docs/trace.md).

An I/O operation is a complete event (``"ph": "X"``)::

    {"name": "read", "cat": "cache-read", "pid": 12, "tid": 12, "ts": 1234.5, "dur": 8.2,
     "ph": "X", "args": {"fid": 3, "off": 4096, "size": 4096, "ret": 4096}}

``ts``/``dur`` are microseconds on the machine's monotonic clock (``CLOCK_MONOTONIC``, the clock
of ``time.perf_counter_ns`` on Linux), so events of all processes of one machine line up.
``args.fid`` refers to a ``file_name`` metadata event of the same pid; ``ret`` is the bytes
transferred or ``-errno``. Samples of ``/proc`` are counter events (``"ph": "C"``).
"""

from __future__ import annotations

from lcache.errors import CorruptionError

FORMAT_VERSION = 1

#: I/O classes. ``cache-recovery``, ``cache-fsck`` and ``cache-meta`` are what lcache.store
#: uses for reopen-after-crash scans, ``lcache fsck`` and index/metadata files; they are kept
#: as classes of their own. ``syscall`` holds the events that ``lcache trace --syscalls``
#: recovers from strace (all file I/O of the traced processes, whatever it was for).
#: ``cache-ram`` is given by the report, not by lcache.store: cache I/O to files in memory.
#: ``offload-read``/``offload-write`` are optimizer-state offload (lcache.offload) and
#: ``offload-act-read``/``offload-act-write`` activation offload, split by direction so the
#: report shows each stream; ``offload`` stays for traces and callers that name it.
#: ``data-index`` is a dataset's own index read before its samples (``lcache bench``'s
#: indexed-binary ``.idx`` files, TFRecord headers), kept apart from the samples.
CLASSES = (
    "data-source",
    "data-index",
    "cache-read",
    "cache-write",
    "cache-ram",
    "cache-gc",
    "cache-recovery",
    "cache-fsck",
    "cache-meta",
    "checkpoint",
    "offload",
    "offload-read",
    "offload-write",
    "offload-act-read",
    "offload-act-write",
    "other",
    "syscall",
)

#: Cache I/O to a file on a memory filesystem (tmpfs, ramfs), such as lcache's prefetch
#: staging area in /dev/shm: it never reaches a storage device, so the report counts it apart
#: from ``cache-read``/``cache-write``, whatever class the store gave it.
RAM_CLASS = "cache-ram"

#: Operations that move bytes; the others (fsync, fdatasync, open, unlink, lseek...) are
#: counted apart.
DATA_OPS = frozenset({"read", "write"})

#: Category names of the counter events the /proc sampler writes.
PROC_IO = "proc-io"
DISKSTATS = "diskstats"
#: Name of the metadata line that lists the whole disks (``/sys/block``) the sampler saw.
DISKS = "disks"


class TraceFormatError(CorruptionError):
    """A trace file is missing, truncated or not an lcache/Chrome trace; names file and line.

    A :class:`~lcache.errors.CorruptionError` (so an ``LCacheError`` and a ``ValueError``)."""
