"""Dataset files in DLIO's layout and formats: generate them, list them, index their samples.

Layout (DLIO ``data_generator.py``): ``DATA/train/{prefix}_{i}_of_{n}.{format}`` with ``i``
zero-padded to the width of ``n``, so a folder DLIO generated is read here and vice versa.

Formats:
    npz / npy: one numpy array ``x`` of shape (samples, bytes) uint8 (npz adds labels ``y``).
        A reader loads the whole file, as DLIO's ``np.load`` does.
    indexed_binary / mmap_indexed_binary: raw sample bytes, plus ``FILE.off.idx`` and
        ``FILE.sz.idx`` holding uint64 offsets and sizes (DLIO ``indexed_binary_generator.py``).
    tfrecord: TFRecord framing (u64 length, u32 length CRC, data, u32 data CRC). The CRC fields
        are written as zero (CRC32C in pure Python would dominate generation time); the
        framing and bytes on disk are TFRecord's, TensorFlow itself would refuse the CRCs.

Sample sizes: ``record_length`` bytes, or with ``record_length_stdev`` one normal draw per file
(all samples of a file share it). DLIO draws a square image side ``d = sqrt(record_length)``,
so its samples hold ``int(d)**2`` bytes, a little under ``record_length``.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable

import numpy as np

from lcache.bench.config import Workload
from lcache.bench.resources import need_memory
from lcache.errors import ConfigError
from lcache.io import fsync_dir, open_file, pwrite_full, sync_fd

IO_CLASS = "data-source"
_CHUNK = 16 << 20
_CHECK_MEMORY_FROM = 64 << 20


def _count(w: Workload, split: str) -> int:
    return w.num_files_train if split == "train" else w.num_files_eval


def file_name(w: Workload, split: str, i: int) -> str:
    """The name DLIO gives file ``i`` of ``split`` (relative to ``DATA/train`` or ``valid``)."""
    n = _count(w, split)
    return f"{w.file_prefix}_{i:0{len(str(n))}d}_of_{n}.{w.format}"


def file_names(w: Workload, split: str = "train") -> list[str]:
    """The file names DLIO gives this workload (relative to ``DATA/train`` or ``DATA/valid``)."""
    return [file_name(w, split, i) for i in range(_count(w, split))]


def missing_bytes(w: Workload, data_dir: str) -> int:
    """About how many bytes :func:`generate` would still write into ``data_dir``."""
    per_file = w.num_samples_per_file * (w.record_length + 16) + 4096  # framing, idx, header
    total = 0
    for split in ["train"] + (["valid"] if w.do_eval else []):
        folder = os.path.join(data_dir, split)
        have = sum(1 for e in os.scandir(folder) if e.name.endswith(f".{w.format}")) \
            if os.path.isdir(folder) else 0
        total += max(0, _count(w, split) - have) * per_file
    return total


def sample_size_of_file(w: Workload, index: int) -> int:
    """Bytes per sample in file ``index`` (a deterministic draw when stdev > 0)."""
    if w.record_length_stdev <= 0:
        return w.record_length
    rng = np.random.default_rng([w.seed, index])
    return max(1, int(rng.normal(w.record_length, w.record_length_stdev)))


def _payload(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(nbytes), dtype=np.uint8)


def _encode(w: Workload, index: int) -> list[bytes | memoryview]:
    """The bytes of data file ``index`` (and, for indexed formats, its index files)."""
    size = sample_size_of_file(w, index)
    n = w.num_samples_per_file
    if size * n >= _CHECK_MEMORY_FROM:
        # A file is built in memory (about three copies of its bytes on the way to disk).
        need_memory(3 * size * n, f"generating a {w.format} file of {n} samples of {size} bytes",
                    "dataset.num_samples_per_file or record_length")
    rng = np.random.default_rng([w.seed, index, 1])
    x = _payload(rng, size * n).reshape(n, size)
    if w.format in ("npz", "npy"):
        buf = io.BytesIO()
        if w.format == "npz":
            np.savez(buf, x=x, y=np.zeros(n, dtype=np.uint8))
        else:
            np.save(buf, x)
        return [buf.getbuffer()]
    if w.format == "tfrecord":
        parts: list[bytes | memoryview] = []
        for row in x:
            parts += [np.uint64(size).tobytes(), b"\0\0\0\0", row.tobytes(), b"\0\0\0\0"]
        return [b"".join(parts)]
    offsets = np.arange(n, dtype="<u8") * size
    sizes = np.full(n, size, dtype="<u8")
    return [x.tobytes(), offsets.tobytes(), sizes.tobytes()]


def _publish(path: str, data: bytes | memoryview) -> None:
    """Write ``path`` atomically: temp file, fsync, rename (nothing half-written is visible)."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        view = memoryview(data)
        for off in range(0, len(view), _CHUNK):
            pwrite_full(fd, off, [view[off:off + _CHUNK]], io_class=IO_CLASS)
        sync_fd(fd, io_class=IO_CLASS)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)


def generate(w: Workload, data_dir: str, rank: int = 0, world: int = 1,
             progress: Callable[[int], None] | None = None) -> int:
    """Write this rank's share of the training (and evaluation) files.

    File ``i`` goes to rank ``i % world``. Files that already exist with the expected name are
    kept (DLIO regenerates them; keeping them makes a rerun cheap). Returns the bytes written
    by this rank.
    """
    written = 0
    splits = ["train"] + (["valid"] if w.do_eval and w.num_files_eval > 0 else [])
    for split in splits:
        written += _generate_split(w, data_dir, split, rank, world, progress)
    return written


def sweep_stale_temps(folder: str) -> int:
    """Remove ``NAME.tmpPID`` files whose writer process is gone (killed mid-write).

    A live writer's temp file is left alone. Returns how many were removed.
    """
    removed = 0
    for entry in os.scandir(folder):
        head, sep, pid = entry.name.rpartition(".tmp")
        if not sep or not head or not pid.isdigit() or not entry.is_file():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its writer still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed += 1
    return removed


def _generate_split(w: Workload, data_dir: str, split: str, rank: int, world: int,
                    progress: Callable[[int], None] | None) -> int:
    train = os.path.join(data_dir, split)
    os.makedirs(train, mode=0o700, exist_ok=True)
    sweep_stale_temps(train)
    written = 0
    first = 0 if split == "train" else w.num_files_train  # distinct contents for valid/
    for i in range(rank, _count(w, split), world):
        path = os.path.join(train, file_name(w, split, i))
        if not os.path.exists(path):
            parts = _encode(w, first + i)
            _publish(path, parts[0])
            if len(parts) == 3:
                _publish(path + ".off.idx", parts[1])
                _publish(path + ".sz.idx", parts[2])
            written += sum(len(p) for p in parts)
        if progress is not None:
            progress(1)
    fsync_dir(train)
    return written


def list_train_files(w: Workload, data_dir: str, split: str = "train") -> list[str]:
    """Sorted files of the workload's format (as DLIO lists them), the first n used.

    Args:
        split: ``train`` (``num_files_train``) or ``valid`` (``num_files_eval``).

    Raises:
        ConfigError: fewer files than the workload needs; the message says how to generate.
    """
    train = os.path.join(data_dir, split)
    want = w.num_files_train if split == "train" else w.num_files_eval
    suffix = f".{w.format}"
    names = sorted(e for e in os.listdir(train) if e.endswith(suffix)) \
        if os.path.isdir(train) else []
    if len(names) < want:
        raise ConfigError(
            f"{train} holds {len(names)} {w.format} files but the workload needs "
            f"{want}; generate them with workflow.generate_data: True "
            "(or `lcache bench run --generate`)")
    return [os.path.join(train, n) for n in names[:want]]

