"""Per-rank checkpoint files of DLIO's sizes, layout and names: write with fsync, read back.

Everything follows DLIO's ``checkpointing/base_checkpointing.py`` (argonne-lcf/dlio_benchmark at
commit e1919d7b); ranks are laid out ``rank = dp * (tp*pp) + pp_rank * tp + tp_rank``:

* **who writes**: with ZeRO 0 only the ranks below ``tp * pp`` (data-parallel rank 0); with
  ZeRO >= 1 every rank. ``checkpoint.type: rank_zero`` (DLIO 2.0.0's meaning; newer DLIO
  ignores the key) has rank 0 alone write;
* **parameters** ``P = 2*V*h + L*(2h + h*(h + 2*kv_dim) + h*h + 3*h*ffn) + h`` with
  ``kv_dim = (h // heads) * kv_heads`` (Llama 3 8B: 8,030,261,248);
* **model weights** in ``model_datatype`` (fp16: 2 B), layers ``0..L+2`` (embedding, the
  transformer layers, LM head, final norm) split over pipeline stages, each tensor over tensor-
  parallel ranks:

  - ZeRO 1 and 2: data-parallel rank 0 writes them, one file per layer
    ``layer_{i}-model_{mp}_model_states`` with pipeline parallelism, else one
    ``model_{mp}_model_states`` holding its layers;
  - ZeRO 0 and 3: ``zero_pp_rank_{dp}_mp_rank_{mp}_model_states``, sharded over the
    data-parallel ranks with ZeRO 3;

* **optimizer state**: ``zero_pp_rank_{dp}_mp_rank_{mp}_optim_states``, three
  ``optimizer_datatype`` tensors of ``P / (dp * tp * pp)`` parameters (ZeRO >= 1) or
  ``P / (tp * pp)`` (ZeRO 0), each plus ``5h`` elements: 12 B/param with fp32;
* **model state** ``model_states-{rank}`` of ``model.model_size_bytes`` (default 10,240) for
  models whose ``model.type`` is not ``transformer`` (the CNN workloads);
* DLIO's legacy lists: ``model.layer_parameters`` (elements per tensor of every layer, split
  by tp, 1 byte each; pipeline stages hold layers ``1..L`` only) and
  ``model.optimization_groups`` (two tensors per group plus one of their sum, 1 byte each).

Names end in ``.pt`` (``framework: pytorch``) or ``.pb`` (tensorflow), inside
``CKPT/global_epoch{e}_step{s}/``. In ``checkpoint.mode: subset`` (MLPerf Storage's mode for a
job larger than the machine) the data-parallel width is ``model.parallelism.data`` and the
run's ranks are the first ranks of that job: each writes its share of the whole job.

Files are raw bytes, never pickles: a checkpoint's I/O is what is measured, not its encoding.
Each file is written to a temp name, fsynced (``checkpoint.fsync``) and renamed.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import numpy as np

from lcache.bench.config import DTYPE_BYTES, Workload
from lcache.bench.datagen import sweep_stale_temps
from lcache.errors import ConfigError
from lcache.io import (
    close_file,
    drop_page_cache,
    fsync_dir,
    open_file,
    pread_full,
    pwrite_full,
    sync_fd,
)

IO_CLASS = "checkpoint"
_CHUNK = 64 << 20


def num_parameters(w: Workload) -> int:
    """Parameters of the transformer described by the workload (DLIO's count)."""
    if w.num_layers <= 0:
        return 0
    h, n_layers, ffn, voc = w.hidden_size, w.num_layers, w.ffn_hidden_size, w.vocab_size
    kv_dim = h // w.num_attention_heads * w.num_kv_heads
    per_layer = h + h * (h + 2 * kv_dim) + h * h + h + 2 * h * ffn + h * ffn
    return 2 * voc * h + n_layers * per_layer + h


@dataclass(frozen=True, slots=True)
class CheckpointFile:
    """One file a rank writes: name inside the checkpoint folder, and its size in bytes."""

    name: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Place:
    """A rank's coordinates in the (possibly larger, subset-mode) job."""

    dp: int  # data-parallel width of the job
    dp_rank: int
    pp_rank: int
    mp_rank: int


def _place(w: Workload, rank: int, world: int) -> _Place:
    tp, pp = w.tensor_parallelism, w.pipeline_parallelism
    mp = tp * pp
    if w.checkpoint_mode == "subset":
        if w.data_parallelism * mp < world:
            raise ConfigError(f"{w.source}: {world} ranks are more than the whole job "
                              f"(data x tensor x pipeline = {w.data_parallelism} x {tp} x "
                              f"{pp}); lower --nproc_per_node or raise model.parallelism.data")
        dp = w.data_parallelism
    else:
        if world % mp:
            raise ConfigError(
                f"{w.source}: {world} rank(s) cannot hold tensor x pipeline parallelism "
                f"{tp} x {pp}; run with a multiple of {mp} ranks (torchrun --nproc_per_node), "
                "or run a subset of the job: --set checkpoint.mode=subset --set "
                "model.parallelism.data=N")
        dp = world // mp
    return _Place(dp, rank // mp, (rank // tp) % pp, rank % mp)


def _layer_elements(w: Workload, layer: int, shard: int) -> list[int]:
    """Elements of each tensor of ``layer`` on one rank (DLIO ``get_layer_parameters``)."""
    h, n_layers, ffn, voc, tp = (w.hidden_size, w.num_layers, w.ffn_hidden_size,
                                 w.vocab_size, w.tensor_parallelism)
    if layer in (0, n_layers + 1):
        return [h * voc // tp // shard]  # embedding, LM head (vocabulary-parallel)
    if layer == n_layers + 2:
        return [h // shard]  # final norm
    kv_dim = h // w.num_attention_heads * w.num_kv_heads
    return [h // shard, h * (h + 2 * kv_dim) // tp // shard, h * h // tp // shard, h // shard,
            h * 2 * ffn // tp // shard, h * ffn // tp // shard]


def _layer_range(w: Workload, pp_rank: int) -> tuple[int, int]:
    """DLIO ``get_layer_index``: layers 1..L over pipeline stages; 0 first, L+1, L+2 last
    (not with the legacy ``layer_parameters``)."""
    pp = w.pipeline_parallelism
    nl, rem = divmod(w.num_layers, pp)
    if pp_rank < rem:
        start = pp_rank * (nl + 1) + 1
        end = start + nl
    else:
        start = rem * (nl + 1) + (pp_rank - rem) * nl + 1
        end = start + nl - 1
    if not w.layer_parameters:
        if pp_rank == pp - 1:
            end = w.num_layers + 2
        if pp_rank == 0:
            start = 0
    return start, end


def _layer_bytes(w: Workload, layer: int, shard: int) -> int:
    if w.layer_parameters:  # DLIO's get_tensor(state // tp): int8 elements
        return sum(p // w.tensor_parallelism for p in w.layer_parameters if p > 0)
    return sum(_layer_elements(w, layer, shard)) * DTYPE_BYTES[w.model_datatype]


def _optimizer_bytes(w: Workload, place: _Place) -> int:
    if w.optimization_groups:  # a, b per group and one tensor of their sum, int8
        return 3 * sum(g for g in w.optimization_groups if g > 0)
    if w.num_layers <= 0:
        return 0
    mp = w.tensor_parallelism * w.pipeline_parallelism
    share = num_parameters(w) // (place.dp * mp if w.zero_stage > 0 else mp)
    if share <= 0:
        return 0
    return 3 * (share + 5 * w.hidden_size) * DTYPE_BYTES[w.optimizer_datatype]


def rank_files(w: Workload, rank: int, world: int) -> list[CheckpointFile]:
    """The files ``rank`` of ``world`` writes per checkpoint (DLIO's names and sizes).

    Raises:
        ConfigError: a rank count that the parallelism (or the subset) cannot hold.
    """
    place = _place(w, rank, world)
    mp = w.tensor_parallelism * w.pipeline_parallelism
    # DLIO's rank_to_checkpoint; rank_zero is DLIO 2.0.0's meaning of checkpoint.type
    writes = rank == 0 if w.checkpoint_type == "rank_zero" else w.zero_stage != 0 or rank < mp
    if not writes:
        return []
    ext = "pt" if w.framework == "pytorch" else "pb"
    files: list[CheckpointFile] = []
    if w.model_size > 0 and w.model_type != "transformer":
        files.append(CheckpointFile(f"model_states-{rank}.{ext}", w.model_size))
    if w.num_layers > 0 or w.layer_parameters:
        start, end = _layer_range(w, place.pp_rank)
        layers = range(start, end + 1)
        if w.zero_stage in (1, 2):
            if place.dp_rank == 0:
                if w.pipeline_parallelism > 1:
                    files += [CheckpointFile(f"layer_{i}-model_{place.mp_rank}_model_states."
                                             f"{ext}", _layer_bytes(w, i, 1)) for i in layers]
                else:
                    files.append(CheckpointFile(
                        f"model_{place.mp_rank}_model_states.{ext}",
                        sum(_layer_bytes(w, i, 1) for i in layers)))
        else:
            if w.zero_stage == 3 and w.pipeline_parallelism > 1:
                raise ConfigError(f"{w.source}: ZeRO-3 with pipeline parallelism "
                                  f"{w.pipeline_parallelism} is not modelled (DLIO refuses it "
                                  "too)")
            shard = place.dp if w.zero_stage == 3 else 1
            files.append(CheckpointFile(
                f"zero_pp_rank_{place.dp_rank}_mp_rank_{place.mp_rank}_model_states.{ext}",
                sum(_layer_bytes(w, i, shard) for i in layers)))
    opt = _optimizer_bytes(w, place)
    if opt:
        files.append(CheckpointFile(
            f"zero_pp_rank_{place.dp_rank}_mp_rank_{place.mp_rank}_optim_states.{ext}", opt))
    return files


def total_bytes(w: Workload, world: int) -> int:
    """Bytes of one checkpoint, all of this run's ranks together (in subset mode: the
    subset's share, not the whole job's)."""
    return sum(f.nbytes for r in range(world) for f in rank_files(w, r, world))


def job_bytes(w: Workload, world: int) -> int:
    """Bytes of one checkpoint of the whole job (subset mode: all ``data x tp x pp`` ranks)."""
    if w.checkpoint_mode != "subset":
        return total_bytes(w, world)
    job = w.data_parallelism * w.tensor_parallelism * w.pipeline_parallelism
    return total_bytes(w, job)


def count_saves(w: Workload, steps_per_epoch: int) -> int:
    """How many checkpoints a run writes (each kept under its own name).

    Args:
        steps_per_epoch: this rank's training steps per epoch (unused without training).
    """
    if not w.do_checkpoint:
        return 0
    if not w.do_train:
        return max(0, w.num_checkpoints_write)
    if w.steps_between_checkpoints > 0:
        return w.epochs * (steps_per_epoch // w.steps_between_checkpoints)
    every = max(1, w.epochs_between_checkpoints)
    first = w.checkpoint_after_epoch  # then every `every` epochs, from epoch 1 on
    if first < 1:
        first += -(-(1 - first) // every) * every
    return 0 if first > w.epochs else (w.epochs - first) // every + 1


class CheckpointIO:
    """Writes and reads one rank's checkpoint files under ``folder/NAME/``.

    Args:
        folder: the checkpoint folder (one sub-folder per checkpoint, as DLIO names them).
        files: this rank's files (:func:`rank_files`).
        fsync: fsync each file before it is renamed into place (``checkpoint.fsync``).
        drop_cache: evict a checkpoint's pages before reading it, so the read hits storage.
    """

    def __init__(self, folder: str, files: list[CheckpointFile], fsync: bool = True,
                 drop_cache: bool = False) -> None:
        self.folder = folder
        self.files = files
        self.fsync = fsync
        self.drop_cache = drop_cache
        self._buf: memoryview | None = None

    def _buffer(self) -> memoryview:
        if self._buf is None:
            biggest = max((f.nbytes for f in self.files), default=0)
            n = max(1, min(_CHUNK, biggest))
            # Random bytes: a storage that compresses or deduplicates must not get an easy ride.
            self._buf = memoryview(np.random.default_rng().bytes(n))
        return self._buf

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def save(self, name: str) -> int:
        """Write this rank's files of checkpoint ``name``; returns the bytes written."""
        target = os.path.join(self.folder, name)
        os.makedirs(target, mode=0o700, exist_ok=True)
        # this rank killed mid-save left its temp files here (only its own names: the
        # folder may hold a user's files)
        sweep_stale_temps(target, (f.name for f in self.files))
        buf = self._buffer()
        for f in self.files:
            path = os.path.join(target, f.name)
            tmp = f"{path}.tmp{os.getpid()}"
            # Everything from the file's creation to its rename is undone on the way out: a
            # SIGTERM (raised as Terminated) between the close and the rename left a
            # checkpoint-sized temp file behind.
            try:
                fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                try:
                    off = 0
                    while off < f.nbytes:
                        n = min(len(buf), f.nbytes - off)
                        pwrite_full(fd, off, [buf[:n]], io_class=IO_CLASS)
                        off += n
                    if self.fsync:
                        sync_fd(fd, data_only=False, io_class=IO_CLASS)
                finally:
                    close_file(fd)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
        if self.fsync:
            fsync_dir(target)
        return self.nbytes

    def load(self, name: str) -> int:
        """Read this rank's files of checkpoint ``name`` whole; returns the bytes read.

        Raises:
            ConfigError: the checkpoint or one of this rank's files is missing or short.
        """
        target = os.path.join(self.folder, name)
        buf = memoryview(bytearray(len(self._buffer())))
        total = 0
        for f in self.files:
            try:
                fd = open_file(os.path.join(target, f.name), os.O_RDONLY)
            except FileNotFoundError:
                raise ConfigError(f"checkpoint file {f.name} is missing from {target}: write "
                                  "the checkpoints first (checkpoint.num_checkpoints_write) "
                                  "with the same model, parallelism and rank count") from None
            try:
                if self.drop_cache:
                    drop_page_cache(fd)
                off = 0
                while off < f.nbytes:
                    n = pread_full(fd, off, buf[:min(len(buf), f.nbytes - off)],
                                   io_class=IO_CLASS)
                    if n == 0:
                        raise ConfigError(f"checkpoint file {f.name} in {target} is shorter "
                                          f"than {f.nbytes} bytes; it was not written whole")
                    off += n
                total += off
            finally:
                close_file(fd)
        return total
