"""Reader threads: read an epoch's samples (``order.py``) batch by batch, as DLIO's loaders do.

``read_threads`` threads each build whole batches (as DataLoader workers do) and hand them over
in order. How many batches are read ahead follows DLIO's loaders (``batches_ahead``): the
PyTorch DataLoader keeps ``prefetch_factor = ceil(prefetch_size / read_threads)`` batches per
worker (``data_loader/torch_data_loader.py``, DLIO commit e1919d7b; 2 when prefetch_size is
0), so about ``prefetch_size`` in all; tf.data reads ``read_threads`` files at once and keeps
``prefetch_size`` batches. ``os.preadv`` releases the GIL, so threads overlap their I/O like
worker processes would, without a fork.

Whole-file formats (npz, npy) are read whole, once per access, as ``np.load`` does (on S3:
one GET of the object, as DLIO's ``npz_reader_s3.py``); a thread keeps the file it read last,
so a file of many samples read in a row is read once. The indexed formats and TFRecord read
exactly the sample's bytes through their index.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from lcache.bench.config import Workload
from lcache.errors import ConfigError, CorruptionError
from lcache.io import aligned_buffer, close_file, drop_page_cache, pread_full
from lcache.io.buffers import align_down, align_up
from lcache.io.files import NotRegularFile, logical_block_size, open_regular

IO_CLASS = "data-source"
INDEX_CLASS = "data-index"  # a file's index (its .idx files, TFRecord headers): not samples
_CHUNK = 16 << 20
_MAX_OPEN = 64  # open files kept per reader thread


def _open_data(path: str, direct: bool = False) -> int:
    """A data file of the workload, opened for reading; a directory or a FIFO in its place
    is named (reading a directory failed later as a bare "Is a directory")."""
    try:
        return open_regular(path, os.O_RDONLY, direct)
    except NotRegularFile as exc:
        raise ConfigError(f"{path} is {exc.kind}, not a data file of this workload; remove it "
                          "(lcache bench run --generate writes the files again)") from exc


def batches_ahead(w: Workload) -> int:
    """Batches DLIO's loader reads ahead of the training loop (0: read in the loop)."""
    threads = w.read_threads
    if w.data_loader == "tensorflow":
        return max(1, threads, w.prefetch_size)
    if threads <= 0:
        return 0
    per_worker = math.ceil(w.prefetch_size / threads) if w.prefetch_size > 0 else 2
    return threads * per_worker


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        self.index: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.buf: memoryview | None = None
        self.last_file: str | None = None


class SampleReader:
    """Reads samples of a file list the way the workload's format needs.

    Args:
        w: the workload.
        files: the training files (``datagen.list_files``): paths, or URLs with ``remote``.
        direct: open with O_DIRECT and read block-aligned ranges (``reader.odirect``).
        remote: a source whose ``fetch(i)`` returns file ``i`` whole (S3's
            ``storage.source``), for npz and npy on object storage.
    """

    def __init__(self, w: Workload, files: list[str], direct: bool = False,
                 remote: Any = None) -> None:
        self.w = w
        self.files = files
        self.direct = direct
        self.remote = remote
        self.block = 4096 if remote is not None or not files else \
            logical_block_size(os.path.dirname(files[0]))
        self._local = _ThreadState()
        self._all_fds: list[int] = []
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _fd(self, path: str) -> int:
        """An fd for ``path``: kept per thread for indexed formats (few, large files)."""
        st = self._local
        fd = st.fds.get(path)
        if fd is None:
            if len(st.fds) >= _MAX_OPEN:  # many indexed files: close the oldest, not EMFILE
                self._release(next(iter(st.fds)))
            fd = _open_data(path, self.direct)
            st.fds[path] = fd
            with self._lock:
                self._all_fds.append(fd)
        return fd

    def _release(self, path: str) -> None:
        """Close a whole-file format's fd after its read (np.load opens per call too)."""
        fd = self._local.fds.pop(path, None)
        if fd is not None:
            with self._lock:
                self._all_fds.remove(fd)
            close_file(fd)

    def _buffer(self, nbytes: int) -> memoryview:
        st = self._local
        if st.buf is None or len(st.buf) < nbytes:
            st.buf = memoryview(aligned_buffer(max(nbytes, 1 << 20)))
        return st.buf

    def _read(self, path: str, offset: int, size: int) -> int:
        """Read ``size`` bytes at ``offset`` (aligned out to blocks under O_DIRECT)."""
        fd = self._fd(path)
        if self.direct:
            start = align_down(offset, self.block)
            end = align_up(offset + size, self.block)
        else:
            start, end = offset, offset + size
        chunk = self.w.transfer_size or _CHUNK
        buf = self._buffer(min(end - start, chunk) if self.direct else min(size, chunk))
        got = 0
        pos = start
        while pos < end:
            n = min(len(buf), end - pos)
            if self.direct:
                n = align_up(n, self.block)
            r = pread_full(fd, pos, buf[:n], io_class=IO_CLASS)
            got += r
            pos += n
            if r < n:
                break
        return min(got, size)

    def _index(self, path: str) -> tuple[np.ndarray, np.ndarray]:
        st = self._local
        found = st.index.get(path)
        if found is not None:
            return found
        if self.w.format == "tfrecord":
            found = self._scan_tfrecord(path)
        else:
            arrays = []
            for suffix in (".off.idx", ".sz.idx"):
                fd = _open_data(path + suffix)
                try:
                    raw = bytearray(os.fstat(fd).st_size)
                    pread_full(fd, 0, memoryview(raw), io_class=INDEX_CLASS)
                finally:
                    close_file(fd)
                arrays.append(np.frombuffer(raw, dtype="<u8"))
            found = (arrays[0], arrays[1])
        if len(found[0]) < self.w.num_samples_per_file:
            raise CorruptionError(f"{path} indexes {len(found[0])} samples; the workload "
                                  f"needs {self.w.num_samples_per_file} per file")
        st.index[path] = found
        return found

    def _scan_tfrecord(self, path: str) -> tuple[np.ndarray, np.ndarray]:
        """Record offsets from the 12-byte headers (tf.data reads the same headers)."""
        fd = _open_data(path)
        try:
            end = os.fstat(fd).st_size
            offs, sizes = [], []
            pos = 0
            head = memoryview(bytearray(12))
            while pos + 12 <= end:
                pread_full(fd, pos, head, io_class=INDEX_CLASS)
                length = int(np.frombuffer(head[:8], dtype="<u8")[0])
                offs.append(pos + 12)
                sizes.append(length)
                pos += 12 + length + 4
        finally:
            close_file(fd)
        return np.array(offs, dtype=np.uint64), np.array(sizes, dtype=np.uint64)

    def read_sample(self, sample: int) -> int:
        """Read global sample ``sample``; returns the bytes it moved from storage."""
        w = self.w
        path = self.files[sample // w.num_samples_per_file]
        if w.format in ("npz", "npy"):
            st = self._local
            if st.last_file == path:
                return 0
            st.last_file = path
            if self.remote is not None:
                index = sample // w.num_samples_per_file
                return self._preprocessed(len(self.remote.fetch(index)))
            try:
                n = self._read(path, 0, os.fstat(self._fd(path)).st_size)
            finally:
                self._release(path)
        else:
            offsets, sizes = self._index(path)
            i = sample % w.num_samples_per_file
            n = self._read(path, int(offsets[i]), int(sizes[i]))
            if w.format == "tfrecord":
                self._release(path)
        return self._preprocessed(n)

    def _preprocessed(self, nbytes: int) -> int:
        if self.w.preprocess_time > 0:
            time.sleep(self.w.preprocess_time)
        return nbytes

    def read_batch(self, samples: np.ndarray) -> int:
        total = sum(self.read_sample(int(s)) for s in samples)
        with self._lock:
            self.bytes_read += total
        return total

    def drop_cache(self) -> None:
        """Evict the dataset's pages so the next epoch reads the storage, not memory."""
        if self.remote is not None:
            return  # nothing of an object store is in this host's page cache
        for path in self.files:
            fd = _open_data(path)
            try:
                drop_page_cache(fd)
            finally:
                close_file(fd)

    def close(self) -> None:
        with self._lock:
            fds, self._all_fds = self._all_fds, []
        for fd in fds:
            close_file(fd)
        self._local = _ThreadState()


def iterate_batches(reader: SampleReader, order: np.ndarray, batch_size: int, threads: int,
                    ahead: int) -> Iterator[int]:
    """Yield the bytes read for each batch of ``order``, in order.

    Args:
        threads: reader threads building batches (at least one when ``ahead`` > 0).
        ahead: batches in flight (``batches_ahead``); 0 reads in the caller's thread
            (DataLoader's ``num_workers=0``).
    """
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if ahead <= 0:
        for b in batches:
            yield reader.read_batch(b)
        return
    pool = ThreadPoolExecutor(max_workers=max(1, threads),
                              thread_name_prefix="lcache-bench-read")
    pending: deque[Future[int]] = deque()
    it = iter(batches)
    try:
        for b in it:
            pending.append(pool.submit(reader.read_batch, b))
            if len(pending) >= ahead:
                break
        while pending:
            got = pending.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(reader.read_batch, nxt))
            yield got
    finally:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=True)
