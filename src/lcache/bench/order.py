"""Which samples each rank reads in an epoch, and in what order: DLIO's, or a true shuffle.

DLIO's order, as its loaders produce it (argonne-lcf/dlio_benchmark at commit e1919d7b):

* **PyTorch loader** (``data_loader/torch_data_loader.py``, ``dlio_sampler``): rank ``r`` of
  ``W`` reads the contiguous block ``r*ceil(N/W) ..`` of the ``N`` samples in ascending order,
  every epoch. ``sample_shuffle`` and ``file_shuffle`` do not change it: DLIO shuffles the
  keys of its index map, but each key still maps to its own file
  (``utils/config.py``, ``get_global_map_index``).
* **TensorFlow loader, TFRecord** (``reader/tf_reader.py``): the sorted file list, shuffled
  with numpy's ``seed(seed + 1)`` when ``file_shuffle`` is on (``reconfigure(1)`` runs before
  the pipeline is built, once, and repeated each epoch); rank ``r`` takes files ``r, r+W, ..``
  (``shard``; by sample when there are fewer files than ranks); ``num_parallel_reads =
  read_threads`` interleaves the records of ``read_threads`` files at a time; with
  ``sample_shuffle`` the records pass a shuffle buffer of ``shuffle_size``.
* **TensorFlow loader, other formats** (``build_sample_map_iter``): rank ``r``'s contiguous
  block, shuffled with numpy's ``seed(seed + epoch)`` when ``sample_shuffle`` is on.

``order="shuffle"`` (``lcache bench run --order shuffle``, an lcache option): one permutation
of all samples per epoch (files with ``file_shuffle``, then samples with ``sample_shuffle``;
``seed``: a pure function of (seed, epoch), ``random``: new each run), split every ``W``-th
like ``torch.utils.data.DistributedSampler``.

Every rank runs DLIO's ``floor(files * samples_per_file / batch / W)`` steps (``main.py``
``_train``), capped by ``total_training_steps``.
"""

from __future__ import annotations

import numpy as np

from lcache.bench.config import Workload

ORDERS = ("dlio", "shuffle")


def eval_steps(w: Workload, world: int) -> int:
    """DLIO's ``floor(eval files * samples_per_file / batch_size_eval / ranks)``."""
    return w.num_files_eval * w.num_samples_per_file // w.batch_size_eval // world


def max_steps(w: Workload, world: int, num_files: int | None = None) -> int:
    """The steps the dataset holds per epoch: ``floor(files * samples / batch / ranks)``."""
    files = w.num_files_train if num_files is None else num_files
    return files * w.num_samples_per_file // w.batch_size // world


def steps_per_epoch(w: Workload, world: int, num_files: int | None = None) -> int:
    """DLIO's steps per epoch, capped by ``total_training_steps``."""
    steps = max_steps(w, world, num_files)
    if w.total_training_steps > 0:
        steps = min(steps, w.total_training_steps)
    return steps


def epoch_order(w: Workload, epoch: int, rank: int, world: int, num_files: int,
                evaluation: bool = False, order: str = "dlio") -> np.ndarray:
    """Global sample indices (``file * samples_per_file + i``) this rank reads in ``epoch``,
    ``steps * batch`` of them, in reading order.

    With ``evaluation`` the order is over the evaluation files, in ``batch_size_eval`` steps.
    """
    if evaluation:
        want = eval_steps(w, world) * w.batch_size_eval
    else:
        want = steps_per_epoch(w, world, num_files) * w.batch_size
    if order == "shuffle":
        return _global_shuffle(w, epoch, rank, world, num_files)[:want]
    if w.data_loader == "tensorflow" and w.format == "tfrecord":
        return _tf_records(w, epoch, rank, world, num_files, evaluation, want)
    spf = w.num_samples_per_file
    total = num_files * spf
    per_rank = -(-total // world)  # DLIO: ceil(total / comm_size)
    start = rank * per_rank
    block = np.arange(start, min(start + per_rank, total), dtype=np.int64)
    if w.data_loader == "tensorflow" and w.sample_shuffle != "off":
        seed = w.seed + epoch if w.seed_change_epoch else w.seed
        np.random.RandomState(seed % 2**32).shuffle(block)  # DLIO: np.random.seed; shuffle
    return block[:want]


def _global_shuffle(w: Workload, epoch: int, rank: int, world: int,
                    num_files: int) -> np.ndarray:
    spf = w.num_samples_per_file
    seed = w.seed + (epoch if w.seed_change_epoch else 0)
    files = np.arange(num_files, dtype=np.int64)
    if w.file_shuffle != "off":
        rng = np.random.default_rng(seed if w.file_shuffle == "seed" else None)
        files = rng.permutation(files)
    samples = (files[:, None] * spf + np.arange(spf)[None, :]).reshape(-1)
    if w.sample_shuffle != "off":
        rng = np.random.default_rng(seed + 1 if w.sample_shuffle == "seed" else None)
        samples = rng.permutation(samples)
    return samples[rank::world]


def _tf_records(w: Workload, epoch: int, rank: int, world: int, num_files: int,
                evaluation: bool, want: int) -> np.ndarray:
    """The records tf.data hands this rank: file shard, interleave, shuffle buffer."""
    spf = w.num_samples_per_file
    files = np.arange(num_files, dtype=np.int64)
    if w.file_shuffle != "off":
        seed = w.seed + 1 if w.seed_change_epoch else w.seed
        rs = np.random.RandomState(seed % 2**32)
        if evaluation:  # DLIO shuffles the train list, then the eval list, from one seed
            rs.shuffle(np.arange(w.num_files_train))
        rs.shuffle(files)
    by_sample = num_files < world
    if not by_sample:
        files = files[rank::world]
    buffer = w.shuffle_size if w.sample_shuffle != "off" else 0
    need = (want * (world if by_sample else 1)) + buffer + 1
    records = _interleave(files, spf, max(1, w.read_threads), need)
    if buffer:
        rng = np.random.default_rng(None if w.sample_shuffle == "random" else (w.seed, epoch))
        records = _buffer_shuffle(records, buffer, rng,
                                  want * (world if by_sample else 1))
    if by_sample:
        records = records[rank::world]
    return records[:want]


def _interleave(files: np.ndarray, spf: int, cycle: int, need: int) -> np.ndarray:
    """The first ``need`` (or more) records of ``files`` read ``cycle`` at a time, record by
    record (tf.data's interleave; every file holds ``spf`` records)."""
    groups = min(-(-len(files) // cycle), -(-need // (cycle * spf)))
    full = min(groups, len(files) // cycle)
    head = files[:full * cycle].reshape(full, 1, cycle) * spf
    out = (head + np.arange(spf).reshape(1, spf, 1)).reshape(-1)
    if groups > full:  # the last, smaller group
        rest = files[full * cycle:]
        out = np.concatenate([out, (rest[None, :] * spf + np.arange(spf)[:, None]).reshape(-1)])
    return out


def _buffer_shuffle(items: np.ndarray, size: int, rng: np.random.Generator,
                    count: int) -> np.ndarray:
    """The first ``count`` items out of a shuffle buffer of ``size`` (tf.data's shuffle)."""
    count = min(count, len(items))
    if size >= len(items):
        return rng.permutation(items)[:count]
    buf = list(items[:size])
    nxt = size
    picks = rng.random(count)
    out = np.empty(count, dtype=np.int64)
    for i in range(count):
        j = int(picks[i] * len(buf))
        out[i] = buf[j]
        if nxt < len(items):
            buf[j] = items[nxt]
            nxt += 1
        else:
            buf[j] = buf[-1]
            buf.pop()
    return out
