"""Per-rank checkpoint files of DLIO's size and layout: write with fsync, read back.

Sizes follow DLIO's ``checkpointing/base_checkpointing.py`` (argonne-lcf/dlio_benchmark):

* parameters ``P = 2*V*h + L*(2h + h*(h + 2*kv_dim) + h*h + 3*h*ffn) + h`` (embedding and LM
  head, per layer two norms, QKV with grouped-query K/V of ``kv_dim = h * kv_heads / heads``,
  the attention output, a gated MLP of three ``h x ffn`` matrices; the final norm). With
  grouped-query attention this gives Llama 3 8B = 8.03e9 parameters, so 14 B/param makes the
  MLPerf Storage v2.0 sizes (105 GiB for 8B). Older DLIO used ``3*h*h`` for QKV.
* model weights in ``model_datatype`` (2 B for fp16): per pipeline stage, per tensor-parallel
  rank (``/tp``, the embedding and LM head included), and with ZeRO-3 sharded over
  data-parallel ranks; below ZeRO-3 only data-parallel rank 0 writes them, one file per layer;
* optimizer state: three fp32 tensors (master weights, Adam m and v) of ``P / ranks``
  parameters each with ZeRO >= 1 (``P / (tp*pp)`` without ZeRO), plus DLIO's ``5*h`` extra
  elements per tensor: 12 B/param in all;
* ``model.model_size`` bytes (CNN workloads such as unet3d) in one file per rank.

``checkpoint.type: rank_zero`` (DLIO 2.0.0's default) has rank 0 alone write; ``all_ranks``
(newer DLIO's behaviour, the default here) has every rank write its share.

Files are raw bytes, never pickles: a checkpoint's I/O is what is measured, not its encoding.
Each file is written to a temp name, fsynced (``checkpoint.fsync``) and renamed.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import numpy as np

from lcache.bench.config import DTYPE_BYTES, Workload
from lcache.bench.datagen import sweep_stale_temps
from lcache.errors import ConfigError
from lcache.io import drop_page_cache, fsync_dir, open_file, pread_full, pwrite_full, sync_fd

IO_CLASS = "checkpoint"
_CHUNK = 64 << 20


def num_parameters(w: Workload) -> int:
    """Parameters of the transformer described by the workload (formula in the module doc)."""
    h, n_layers, ffn, voc = w.hidden_size, w.num_layers, w.ffn_hidden_size, w.vocab_size
    kv_dim = h * w.num_kv_heads // w.num_attention_heads \
        if w.num_attention_heads and w.num_kv_heads else h
    per_layer = h + (h * h + 2 * h * kv_dim) + h * h + h + 3 * h * ffn
    return 2 * voc * h + n_layers * per_layer + h


@dataclass(frozen=True, slots=True)
class CheckpointFile:
    """One file a rank writes: name inside the checkpoint folder, and its size in bytes."""

    name: str
    nbytes: int


def _layer_bytes(w: Workload, layer: int, shard: int, dtype: int) -> int:
    h, n_layers, ffn, voc, tp = (w.hidden_size, w.num_layers, w.ffn_hidden_size,
                                 w.vocab_size, w.tensor_parallelism)
    if layer in (0, n_layers + 1):
        # Embedding, LM head: split by tp (vocabulary-parallel), which reproduces MLPerf's
        # published 912 GiB for 70B; DLIO's base_checkpointing.py writes them whole per tp rank.
        return h * voc // tp // shard * dtype
    if layer == n_layers + 2:
        return h // shard * dtype  # final norm
    kv_dim = h * w.num_kv_heads // w.num_attention_heads \
        if w.num_attention_heads and w.num_kv_heads else h
    parts = (h, (h * h + 2 * h * kv_dim) // tp, h * h // tp, h, 2 * h * ffn // tp,
             h * ffn // tp)
    return sum(p // shard * dtype for p in parts)


def _layer_range(w: Workload, pp_rank: int) -> tuple[int, int]:
    """DLIO ``get_layer_index``: layers 1..L over pipeline stages; 0 first, L+1, L+2 last."""
    pp = w.pipeline_parallelism
    nl, rem = divmod(w.num_layers, pp)
    if pp_rank < rem:
        start = pp_rank * (nl + 1) + 1
        end = start + nl + 1
    else:
        start = rem * (nl + 1) + (pp_rank - rem) * nl + 1
        end = start + nl
    if pp_rank == pp - 1:
        end = w.num_layers + 2
    if pp_rank == 0:
        start = 0
    return start, end


def rank_files(w: Workload, rank: int, world: int) -> list[CheckpointFile]:
    """The files ``rank`` of ``world`` writes per checkpoint (DLIO's names and sizes).

    Raises:
        ConfigError: fewer ranks than tensor x pipeline parallelism need.
    """
    files: list[CheckpointFile] = []
    if w.checkpoint_type == "rank_zero" and rank != 0:
        return files  # DLIO 2.0.0's default: only rank 0 writes (and reads) a checkpoint
    if w.model_size > 0:
        files.append(CheckpointFile(f"model_states-{rank}", w.model_size))
    if w.num_layers <= 0:
        return files
    tp, pp = w.tensor_parallelism, w.pipeline_parallelism
    mp = tp * pp
    if world % mp:
        raise ConfigError(
            f"{w.source}: {world} rank(s) cannot hold tensor x pipeline parallelism "
            f"{tp} x {pp}; run with a multiple of {mp} ranks (torchrun --nproc_per_node) or "
            f"lower it, e.g. --set model.parallelism.tensor=1")
    dp = world // mp
    pp_rank = (rank // tp) % pp
    dp_rank = rank // mp
    mp_rank = rank % mp
    wbytes = DTYPE_BYTES[w.model_datatype]
    obytes = DTYPE_BYTES[w.optimizer_datatype]
    p = num_parameters(w)
    share = p // world if w.zero_stage > 0 else p // mp
    h = w.hidden_size
    opt = 3 * (share + 5 * h) * obytes
    files.append(CheckpointFile(f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states",
                                opt))
    start, end = _layer_range(w, pp_rank)
    if w.zero_stage >= 3:
        if pp != 1:
            raise ConfigError(f"{w.source}: ZeRO-3 with pipeline parallelism {pp} is not "
                              "modelled (DLIO asserts pipeline == 1 too)")
        size = sum(_layer_bytes(w, i, dp, wbytes) for i in range(start, end + 1))
        files.append(CheckpointFile(
            f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states", size))
    elif dp_rank == 0:
        for i in range(start, end + 1):
            files.append(CheckpointFile(f"layer_{i:02d}-model_{mp_rank:02d}_model_states",
                                        _layer_bytes(w, i, 1, wbytes)))
    return files


def total_bytes(w: Workload, world: int) -> int:
    """Bytes of one whole checkpoint, all ranks together."""
    return sum(f.nbytes for r in range(world) for f in rank_files(w, r, world))


def count_saves(w: Workload, steps_per_epoch: int) -> int:
    """How many checkpoints a run writes (each kept under its own name).

    Args:
        steps_per_epoch: this rank's training steps per epoch (unused without training).
    """
    if not w.do_checkpoint:
        return 0
    if not w.do_train:
        return max(1, w.num_checkpoints_write)
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
        sweep_stale_temps(target)  # a rank killed mid-save left its temp files here
        buf = self._buffer()
        for f in self.files:
            path = os.path.join(target, f.name)
            tmp = f"{path}.tmp{os.getpid()}"
            fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                off = 0
                while off < f.nbytes:
                    n = min(len(buf), f.nbytes - off)
                    pwrite_full(fd, off, [buf[:n]], io_class=IO_CLASS)
                    off += n
                if self.fsync:
                    sync_fd(fd, data_only=False, io_class=IO_CLASS)
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
            os.close(fd)
            os.replace(tmp, path)
        if self.fsync:
            fsync_dir(target)
        return self.nbytes

    def load(self, name: str) -> int:
        """Read this rank's files of checkpoint ``name`` whole; returns the bytes read."""
        target = os.path.join(self.folder, name)
        buf = memoryview(bytearray(len(self._buffer())))
        total = 0
        for f in self.files:
            fd = open_file(os.path.join(target, f.name), os.O_RDONLY)
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
                os.close(fd)
        return total

    def remove(self, name: str) -> None:
        shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
