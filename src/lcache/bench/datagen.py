"""Dataset files in DLIO's layout and formats: generate them, list them, index their samples.

Layout (DLIO ``data_generator/data_generator.py`` at commit e1919d7b):
``DATA/train/{prefix}_{i}_of_{n}.{format}`` with ``i`` zero-padded to the width of ``n``; with
``num_subfolders_train`` > 1, file ``i`` goes to ``DATA/train/{i % subfolders}/`` (the folder
number padded likewise) and readers sort the files by name across folders; ``valid/`` alike.
So a folder DLIO generated is read here and the other way round. Evaluation files are
generated whenever ``num_files_eval`` > 0, as DLIO does. On S3 the same names are object keys
under the data folder's URL.

Formats:
    npz / npy: one numpy array ``x`` of shape (samples, bytes) uint8 (npz adds labels ``y``).
        A reader loads the whole file, as DLIO's ``np.load`` does.
    indexed_binary / mmap_indexed_binary: raw sample bytes, plus ``FILE.off.idx`` and
        ``FILE.sz.idx`` holding uint64 offsets and sizes (DLIO ``indexed_binary_generator.py``).
    tfrecord: TFRecord framing (u64 length, u32 length CRC, data, u32 data CRC). The CRC fields
        are written as zero (CRC32C in pure Python would dominate generation time); the
        framing and bytes on disk are TFRecord's, TensorFlow itself would refuse the CRCs.

Sample sizes (``sample_sizes``): without ``record_length_stdev`` every sample holds
``record_length`` bytes exactly (DLIO writes a square of side ``int(sqrt(record_length))``, a
little less). With it, DLIO's draw exactly: after ``np.random.seed(10)``, two sides per file
from ``N(sqrt(L), stdev / (2 sqrt(L)))``, each at least 1, and the file's samples hold
``side1 * side2`` bytes (``DataGenerator.get_dimension``; every generator seeds 10).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
from collections.abc import Callable, Iterable

import numpy as np

from lcache.bench import storage
from lcache.bench.config import Workload
from lcache.bench.resources import need_memory
from lcache.errors import ConfigError
from lcache.io import close_file, fsync_dir, open_file, pwrite_full, sync_fd

log = logging.getLogger("lcache")
IO_CLASS = "data-source"
_CHUNK = 16 << 20
_CHECK_MEMORY_FROM = 64 << 20
_SIZE_CHUNK = 1 << 20  # files whose sides are drawn at a time
_PID_MAX = 1 << 22  # Linux's highest pid_max: a larger number is no process's


def _count(w: Workload, split: str) -> int:
    return w.num_files_train if split == "train" else w.num_files_eval


def _subfolders(w: Workload, split: str) -> int:
    n = w.num_subfolders_train if split == "train" else w.num_subfolders_eval
    return n if n > 1 else 0  # DLIO: one sub-folder is no sub-folder


def file_name(w: Workload, split: str, i: int) -> str:
    """The path DLIO gives file ``i`` of ``split``, relative to ``DATA/train`` or ``valid``."""
    n = _count(w, split)
    name = f"{w.file_prefix}_{i:0{len(str(n))}d}_of_{n}.{w.format}"
    sub = _subfolders(w, split)
    return f"{i % sub:0{len(str(sub))}d}/{name}" if sub else name


def file_names(w: Workload, split: str = "train") -> list[str]:
    """The file names DLIO gives this workload (relative to ``DATA/train`` or ``DATA/valid``)."""
    return [file_name(w, split, i) for i in range(_count(w, split))]


def _splits(w: Workload) -> list[str]:
    return ["train"] + (["valid"] if w.num_files_eval > 0 else [])


def sample_sizes(w: Workload) -> np.ndarray:
    """Bytes per sample of each file, training files then evaluation files (DLIO's draw)."""
    total = w.num_files_train + w.num_files_eval
    if w.record_length_stdev <= 0:
        return np.full(total, w.record_length, dtype=np.int64)
    side = int(math.sqrt(w.record_length))
    spread = w.record_length_stdev / 2.0 / math.sqrt(w.record_length)
    rs = np.random.RandomState(10)  # DLIO: np.random.seed(10), then np.random.normal
    out = np.empty(total, dtype=np.int64)
    for start in range(0, total, _SIZE_CHUNK):
        n = min(_SIZE_CHUNK, total - start)
        sides = np.maximum(rs.normal(side, spread, 2 * n).astype(np.int64), 1)
        out[start:start + n] = sides[0::2] * sides[1::2]
    return out


def missing_bytes(w: Workload, data_dir: str) -> int:
    """About how many bytes :func:`generate` would still write into ``data_dir``."""
    sizes = sample_sizes(w)
    per_file = float(sizes.mean()) * w.num_samples_per_file + 16 * w.num_samples_per_file \
        + 4096  # framing, index, header
    total = 0
    for split in _splits(w):
        have = len(_existing(w, data_dir, split))
        total += max(0, _count(w, split) - have) * int(per_file)
    return total


def _payload(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(nbytes), dtype=np.uint8)


def _check_memory(w: Workload, size: int) -> None:
    """Refuse a file of samples of ``size`` bytes that memory cannot hold as it is made."""
    n = w.num_samples_per_file
    if size * n >= _CHECK_MEMORY_FROM:
        # A file is built in memory (about three copies of its bytes on the way to disk).
        need_memory(3 * size * n, f"generating a {w.format} file of {n} samples of {size} bytes",
                    "dataset.num_samples_per_file or record_length")


def _encode(w: Workload, index: int, size: int) -> list[bytes | memoryview]:
    """The bytes of data file ``index`` (and, for indexed formats, its index files)."""
    _check_memory(w, size)
    n = w.num_samples_per_file
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
    try:  # undone from creation to rename: a SIGTERM between the close and the rename
        fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            view = memoryview(data)
            for off in range(0, len(view), _CHUNK):
                pwrite_full(fd, off, [view[off:off + _CHUNK]], io_class=IO_CLASS)
            sync_fd(fd, io_class=IO_CLASS)
        finally:
            close_file(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def generate(w: Workload, data_dir: str, rank: int = 0, world: int = 1,
             progress: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Write this rank's share of the training (and evaluation) files.

    File ``i`` goes to rank ``i % world``. Files that already exist with the expected name are
    kept when the first of them fits the workload (DLIO regenerates them; keeping them makes
    a rerun cheap); a folder made for another workload is written again. Returns the files
    and bytes this rank wrote.
    """
    if w.on_s3 and rank == 0:
        storage.make_bucket(w)
    sizes = sample_sizes(w)
    if len(sizes):  # before anything is said or done about the files already there
        _check_memory(w, int(sizes.max()))
    files = written = 0
    for split in _splits(w):
        n, b = _generate_split(w, data_dir, split, rank, world, sizes, progress)
        files += n
        written += b
    return files, written


def sweep_stale_temps(folder: str, names: Iterable[str]) -> int:
    """Remove the ``NAME.tmpPID`` files in ``folder`` whose writer process is gone (killed
    mid-write), for the ``names`` bench itself publishes there only: any other file (a
    user's ``notes.tmp434343``) is not bench's to delete.

    A live writer's temp file is left alone. Returns how many were removed.
    """
    own = set(names)
    removed = 0
    for entry in os.scandir(folder):
        head, sep, pid = entry.name.rpartition(".tmp")
        if not sep or head not in own or not (pid.isascii() and pid.isdigit()):
            continue
        if not entry.is_file(follow_symlinks=False) or not _writer_gone(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed += 1
    return removed


def _writer_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs (a number no pid can be, 0 or past the highest pid,
    counts as gone: os.kill would signal a group, or raise OverflowError)."""
    if not 0 < pid <= _PID_MAX:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's live process
    return False


def _existing(w: Workload, data_dir: str, split: str) -> set[str]:
    """Names (relative to the split's folder) of the split's files that exist."""
    root = f"{data_dir.rstrip('/')}/{split}"
    suffix = f".{w.format}"
    if w.on_s3:
        return {url[len(root) + 1:] for url in storage.listing(w, root, suffix)}
    if not os.path.isdir(root):
        return set()
    if _subfolders(w, split):
        return {f"{sub.name}/{e.name}" for sub in os.scandir(root) if sub.is_dir()
                for e in os.scandir(sub.path) if e.name.endswith(suffix)}
    return {e.name for e in os.scandir(root) if e.name.endswith(suffix)}


def _bytes_of_file(w: Workload, size: int) -> tuple[int, int]:
    """The least and most bytes a data file of samples of ``size`` bytes holds, as written
    here or by DLIO: its samples without ``record_length_stdev`` are squares of side
    ``int(sqrt(size))``, a little less; npy and npz add a header (and DLIO's npz 8-byte
    labels), DLIO's TFRecords wrap each sample in a small protobuf."""
    n = w.num_samples_per_file
    side = int(math.sqrt(size))
    low = min(size, side * side) if w.record_length_stdev <= 0 else size
    if w.format == "tfrecord":
        return n * (low + 16), n * (size + 16 + 64)
    if w.format in ("npy", "npz"):
        return n * low, n * (size + 8) + (64 << 10)
    return n * low, n * size


def _made_for_another(w: Workload, root: str, split: str, have: set[str], sizes: np.ndarray,
                      rank: int, world: int) -> str | None:
    """Why the kept files this rank writes do not fit this workload (another sample count or
    size), judged by the first of them (only its own: another rank may be rewriting its
    files); None when they fit."""
    first = 0 if split == "train" else w.num_files_train
    for i in range(rank, _count(w, split), world):
        name = file_name(w, split, i)
        if name in have:
            low, high = _bytes_of_file(w, int(sizes[first + i]))
            got = os.path.getsize(f"{root}/{name}")
            if low <= got <= high:
                return None
            want = f"{low:,}" if low == high else f"{low:,}-{high:,}"
            return f"{root}/{name} holds {got:,} bytes, not the {want} this workload writes"
    return None


def _published_names(w: Workload, root: str, split: str) -> dict[str, set[str]]:
    """The names :func:`_publish` gives the split's files (and their index files), by
    folder: the only temp files (``NAME.tmpPID``) a dead writer of this workload leaves."""
    out: dict[str, set[str]] = {}
    index = w.format not in ("npz", "npy", "tfrecord")
    for i in range(_count(w, split)):
        folder, name = os.path.split(f"{root}/{file_name(w, split, i)}")
        names = out.setdefault(folder, set())
        names.add(name)
        if index:
            names.update((name + ".off.idx", name + ".sz.idx"))
    return out


def _generate_split(w: Workload, data_dir: str, split: str, rank: int, world: int,
                    sizes: np.ndarray, progress: Callable[[int], None] | None
                    ) -> tuple[int, int]:
    root = f"{data_dir.rstrip('/')}/{split}"
    have = _existing(w, data_dir, split)
    if have and not w.on_s3:
        # Kept files of another workload would be read with their own sample count and
        # sizes, and every figure of the run would be about them: write them again.
        why = _made_for_another(w, root, split, have, sizes, rank, world)
        if why is not None:
            log.warning("%s: generating the %s files again", why, split)
            have = set()
    folders = {root} | {os.path.dirname(f"{root}/{file_name(w, split, i)}")
                        for i in range(min(_count(w, split), _subfolders(w, split)))}
    if not w.on_s3:
        own = _published_names(w, root, split)
        for folder in sorted(folders):
            os.makedirs(folder, mode=0o700, exist_ok=True)
            sweep_stale_temps(folder, own.get(folder, ()))
    files = written = 0
    first = 0 if split == "train" else w.num_files_train  # distinct contents for valid/

    def publish(path: str, data: bytes | memoryview) -> None:
        if w.on_s3:
            storage.put(w, path, data)
        else:
            _publish(path, data)

    for i in range(rank, _count(w, split), world):
        name = file_name(w, split, i)
        if name not in have:
            parts = _encode(w, first + i, int(sizes[first + i]))
            path = f"{root}/{name}"
            publish(path, parts[0])
            if len(parts) == 3:
                publish(path + ".off.idx", parts[1])
                publish(path + ".sz.idx", parts[2])
            files += 1
            written += sum(len(p) for p in parts)
        if progress is not None:
            progress(1)
    if not w.on_s3:
        for folder in folders:
            fsync_dir(folder)
    return files, written


def list_files(w: Workload, data_dir: str, split: str = "train") -> list[str]:
    """The workload's files of ``split``, sorted by name as DLIO lists them, the first n used.

    Paths, or ``s3://`` URLs on S3.

    Args:
        split: ``train`` (``num_files_train``) or ``valid`` (``num_files_eval``).

    Raises:
        ConfigError: fewer files than the workload needs; the message says how to generate.
    """
    root = f"{data_dir.rstrip('/')}/{split}"
    want = _count(w, split)
    names = sorted(_existing(w, data_dir, split), key=os.path.basename)
    if len(names) < want:
        raise ConfigError(
            f"{root} holds {len(names)} {w.format} files but the workload needs "
            f"{want}; generate them with workflow.generate_data: True "
            "(or `lcache bench run --generate`)")
    return [f"{root}/{n}" for n in names[:want]]
