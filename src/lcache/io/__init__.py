"""Positional, batched file I/O: the engine every lcache byte goes through."""

from lcache.io.buffers import BufferPool, align_down, align_up, aligned_buffer, aligned_empty
from lcache.io.dirs import check_private_dir, make_private_dirs, private_dir
from lcache.io.engine import (
    MAX_QUEUE_DEPTH,
    Completions,
    EngineError,
    IOEngine,
    Pending,
    ReadRequest,
    SyncPolicy,
    default_engine,
    open_direct,
    pread_full,
    pwrite_full,
    settle,
    sync_fd,
)
from lcache.io.files import (
    close_file,
    drop_page_cache,
    fsync_dir,
    logical_block_size,
    open_file,
    read_and_close,
)
from lcache.io.publish import atomic_write
from lcache.io.tracer import IOEvent, Tracer, get_tracer, set_tracer

__all__ = [
    "MAX_QUEUE_DEPTH",
    "BufferPool",
    "Completions",
    "EngineError",
    "IOEngine",
    "IOEvent",
    "Pending",
    "ReadRequest",
    "SyncPolicy",
    "Tracer",
    "align_down",
    "align_up",
    "aligned_buffer",
    "aligned_empty",
    "atomic_write",
    "check_private_dir",
    "close_file",
    "default_engine",
    "drop_page_cache",
    "fsync_dir",
    "get_tracer",
    "logical_block_size",
    "make_private_dirs",
    "open_direct",
    "open_file",
    "pread_full",
    "private_dir",
    "pwrite_full",
    "read_and_close",
    "set_tracer",
    "settle",
    "sync_fd",
]
