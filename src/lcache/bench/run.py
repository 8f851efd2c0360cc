"""Run a DLIO workload on real storage: generate, read, sleep in place of compute, checkpoint.

One process per emulated accelerator. Under ``torchrun`` (``WORLD_SIZE`` > 1) the ranks join a
gloo process group; they split the samples, meet at a barrier after every step (DLIO does the
same, standing in for the gradient all-reduce) and around every checkpoint. Each rank writes
``{rank}_output.json``; rank 0 merges them into ``summary.json`` and ``per_epoch_stats.json``.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np

from lcache.bench import checkpoint as ckpt
from lcache.bench import datagen
from lcache.bench.config import Workload, check_run_length
from lcache.bench.metrics import RankRecorder, aggregate, verdict, write_json_atomic
from lcache.bench.reader import (
    SampleReader,
    epoch_order,
    eval_steps,
    iterate_batches,
    steps_per_epoch,
)
from lcache.bench.resources import bytes_under, meminfo, need_memory, need_space
from lcache.errors import ConfigError
from lcache.io import drop_page_cache, open_file, pread_full, private_dir, pwrite_full, sync_fd


class Comm:
    """This process's rank and a barrier; gloo under torchrun, a no-op alone."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self._dist: Any = None
        if self.world > 1:
            try:
                import torch.distributed as dist  # only multi-rank runs need torch
            except ImportError as exc:
                raise ConfigError("WORLD_SIZE > 1 (torchrun) needs torch for its gloo "
                                  "barrier: pip install 'lcache[torch]'") from exc

            if not dist.is_initialized():
                dist.init_process_group("gloo")
            self._dist = dist

    def barrier(self) -> None:
        if self._dist is not None:
            self._dist.barrier()

    def close(self) -> None:
        if self._dist is not None and self._dist.is_initialized():
            self._dist.destroy_process_group()


@dataclass
class StepIO:
    """Extra traffic per training step (offload emulation, from ``lcache model``).

    ``write_bytes`` then ``read_bytes`` go to a per-rank file with ``io_class`` while the step's
    compute sleeps; a step whose I/O outlasts the sleep waits for it, lowering AU.
    """

    io_class: str
    write_bytes: int = 0
    read_bytes: int = 0


@dataclass
class BenchOptions:
    """Where and how to run; ``None`` means the workload file's own setting."""

    data_dir: str | None = None
    output: str | None = None
    checkpoint_dir: str | None = None
    generate: bool | None = None
    drop_cache: bool = False
    direct: bool | None = None
    trace: bool = False
    show_progress: bool = True
    step_io: list[StepIO] = field(default_factory=list)
    progress_label: str = ""


def _owned_dir(path: str, what: str) -> str:
    """Create ``path`` owner-only if missing; refuse one that is not private to you, or that
    cannot hold files (``/proc/self``), before any long work starts."""
    full = private_dir(path, f"bench {what} directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lcache-probe-", dir=full))
    except OSError as exc:
        raise ConfigError(f"the {what} directory {full} cannot hold files ({exc.strerror}); "
                          "give a directory on the storage to measure") from None
    return full


def _check_room(w: Workload, world: int, data_dir: str, ck_dir: str, generate: bool) -> None:
    """Refuse a run this machine cannot hold or finish, before anything is generated."""
    steps = steps_per_epoch(w, world) if w.do_train else 0
    check_run_length(w, steps, eval_steps(w, world) if w.do_train and w.do_eval else 0)
    if w.do_train:
        # The epoch's sample order (and its shuffled copy); indexed formats also keep every
        # file's offsets and sizes per reader thread.
        samples = w.num_files_train * w.num_samples_per_file
        per_sample = 24 + (16 * max(1, w.read_threads) if w.format not in ("npz", "npy")
                           else 0)
        need_memory(samples * per_sample, f"an epoch of {samples} samples",
                    "dataset.num_files_train or num_samples_per_file")
        if generate:
            need_space(data_dir, datagen.missing_bytes(w, data_dir), "generating the dataset",
                       "dataset.num_files_train, num_samples_per_file or record_length")
    if w.do_checkpoint:
        saves = ckpt.count_saves(w, steps)
        need_space(ck_dir, saves * ckpt.total_bytes(w, world),
                   f"{saves} checkpoint(s) of {world} rank(s)",
                   "the model size or checkpoint.num_checkpoints_write",
                   reusable=bytes_under(ck_dir))


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")


class _Progress:
    """A rich progress bar on rank 0 (stderr), nothing elsewhere."""

    def __init__(self, enabled: bool, label: str) -> None:
        self.enabled = enabled
        self.label = label
        self._bar: Any = None
        self._task: Any = None

    @contextmanager
    def phase(self, text: str, total: int) -> Iterator[Callable[[int], None]]:
        if not self.enabled:
            yield lambda n: None
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=False) as bar:
            task = bar.add_task(f"{self.label}{text}", total=total)
            yield lambda n: bar.advance(task, n)


class _StepTraffic:
    """Per-rank offload file: the extra per-step I/O of :class:`StepIO` entries."""

    def __init__(self, folder: str, rank: int, items: list[StepIO]) -> None:
        self.items = [i for i in items if i.write_bytes or i.read_bytes]
        self.fds: list[int] = []
        self.bufs: list[memoryview] = []
        for n, item in enumerate(self.items):
            path = os.path.join(folder, f"offload-{item.io_class}-{n}-rank{rank}.bin")
            fd = open_file(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            self.fds.append(fd)
            size = max(item.write_bytes, item.read_bytes)
            self.bufs.append(memoryview(np.random.default_rng().bytes(min(size, 64 << 20))))
            # The reads need bytes to read: lay the file out once, outside any step.
            self._write(fd, self.bufs[-1], item.read_bytes, item.io_class)

    @staticmethod
    def _write(fd: int, buf: memoryview, nbytes: int, io_class: str) -> None:
        off = 0
        while off < nbytes:
            n = min(len(buf), nbytes - off)
            pwrite_full(fd, off, [buf[:n]], io_class=io_class)
            off += n
        if nbytes:
            sync_fd(fd, io_class=io_class)
            drop_page_cache(fd)  # the read-back must come from storage, not memory

    def run_step(self) -> None:
        for fd, buf, item in zip(self.fds, self.bufs, self.items, strict=True):
            self._write(fd, buf, item.write_bytes, item.io_class)
            rbuf = memoryview(bytearray(len(buf)))
            off = 0
            while off < item.read_bytes:
                n = pread_full(fd, off, rbuf[:min(len(rbuf), item.read_bytes - off)],
                               io_class=item.io_class)
                if n == 0:
                    break
                off += n

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def _enable_trace(output: str, rank: int) -> tuple[Any, str]:
    try:
        import lcache.trace as trace_mod  # the tracing issue's module, imported lazily
    except ImportError as exc:
        raise ConfigError("--trace needs lcache.trace, which this installation lacks") from exc
    path = os.path.join(output, f"trace-rank{rank}.pfw")
    trace_mod.enable(path)
    return trace_mod, path


def run_workload(w: Workload, opts: BenchOptions | None = None) -> dict[str, Any]:
    """Execute ``w`` on real storage and return the summary (rank 0's; others get theirs).

    Raises:
        ConfigError: missing dataset files, impossible parallelism, bad options.
    """
    opts = opts or BenchOptions()
    comm = Comm()
    try:
        return _run(w, opts, comm)
    finally:
        comm.close()


def _run(w: Workload, opts: BenchOptions, comm: Comm) -> dict[str, Any]:
    rank, world = comm.rank, comm.world
    output = _owned_dir(opts.output or w.output_folder, "output")
    data_dir = os.path.abspath(opts.data_dir or w.data_folder)
    ck_dir = os.path.abspath(opts.checkpoint_dir or w.checkpoint_folder)
    direct = w.odirect if opts.direct is None else opts.direct
    if w.do_checkpoint or opts.step_io:
        _owned_dir(ck_dir, "checkpoint")
    generate = (w.generate_data if opts.generate is None else opts.generate) and w.do_train
    if generate:
        _owned_dir(data_dir, "data")
    _check_room(w, world, data_dir, ck_dir, generate)
    progress = _Progress(opts.show_progress and rank == 0, opts.progress_label)
    start = _now()
    trace_mod, trace_path = _enable_trace(output, rank) if opts.trace else (None, "")
    rec = RankRecorder(rank, w.batch_size, w.exclude_start_steps, w.exclude_end_steps,
                       w.batch_size_eval)
    ck_io = None
    if w.do_checkpoint:
        ck_io = ckpt.CheckpointIO(ck_dir, ckpt.rank_files(w, rank, world), w.checkpoint_fsync,
                                  drop_cache=opts.drop_cache)
    checkpoint_bytes = ckpt.total_bytes(w, world) if w.do_checkpoint else 0
    saved: list[str] = []

    def do_checkpoint(kind: str, name: str) -> None:
        if ck_io is None:
            raise ConfigError("no checkpoint is configured (workflow.checkpoint is off)")
        comm.barrier()
        t0 = time.perf_counter()
        n = ck_io.save(name) if kind == "save" else ck_io.load(name)
        own = time.perf_counter() - t0
        comm.barrier()
        rec.checkpoint(kind, name, time.perf_counter() - t0, own, n)

    if generate:
        with progress.phase("generate data", w.num_files_train) as advance:
            datagen.generate(w, data_dir, rank, world, progress=advance)
        comm.barrier()
    dataset_bytes = 0
    if w.do_train:
        files = datagen.list_train_files(w, data_dir)
        dataset_bytes = sum(os.path.getsize(f) for f in files)
        steps = steps_per_epoch(w, world, len(files))
        if steps < 1:
            raise ConfigError(f"{w.source}: {len(files)} files x {w.num_samples_per_file} "
                              f"samples make no full batch of {w.batch_size} per rank for "
                              f"{world} rank(s); add files or lower reader.batch_size")
        reader = SampleReader(w, files, direct=direct)
        eval_reader = None
        if w.do_eval:
            eval_files = datagen.list_train_files(w, data_dir, "valid")
            dataset_bytes += sum(os.path.getsize(f) for f in eval_files)
            if eval_steps(w, world) < 1:
                raise ConfigError(f"{w.source}: {len(eval_files)} evaluation files make no "
                                  f"full batch of {w.batch_size_eval} per rank for {world} "
                                  "rank(s); add files or lower reader.batch_size_eval")
            eval_reader = SampleReader(w, eval_files, direct=direct)
        traffic = _StepTraffic(ck_dir, rank, opts.step_io) if opts.step_io else None
        rng = np.random.default_rng([w.seed, rank])
        try:
            with progress.phase("train", w.epochs * steps) as advance:
                for epoch in range(1, w.epochs + 1):
                    _train_epoch(w, epoch, reader, rec, comm, steps, len(files), rng, traffic,
                                 ck_io, saved, do_checkpoint, advance, opts.drop_cache)
                    if (w.do_checkpoint and w.steps_between_checkpoints <= 0
                            and epoch >= w.checkpoint_after_epoch
                            and (epoch - w.checkpoint_after_epoch)
                            % max(1, w.epochs_between_checkpoints) == 0):
                        name = f"global_epoch{epoch}_step{steps}"
                        do_checkpoint("save", name)
                        saved.append(name)
                    if (eval_reader is not None and epoch >= w.eval_after_epoch
                            and (epoch - w.eval_after_epoch)
                            % max(1, w.epochs_between_evals) == 0):
                        _evaluate(w, epoch, eval_reader, rec, comm, rng, opts.drop_cache)
        finally:
            reader.close()
            if eval_reader is not None:
                eval_reader.close()
            if traffic is not None:
                traffic.close()
    elif w.do_checkpoint:
        n_write = max(1, w.num_checkpoints_write)
        with progress.phase("checkpoint write", n_write) as advance:
            for i in range(n_write):
                if w.time_between_checkpoints > 0 and i > 0:
                    time.sleep(w.time_between_checkpoints)  # the training between checkpoints
                name = f"global_epoch1_step{i + 1}"
                do_checkpoint("save", name)
                saved.append(name)
                advance(1)
    if w.do_checkpoint and w.num_checkpoints_read > 0 and saved:
        with progress.phase("checkpoint read", w.num_checkpoints_read) as advance:
            for i in range(w.num_checkpoints_read):
                do_checkpoint("load", saved[i % len(saved)])
                advance(1)
    if trace_mod is not None:
        trace_mod.disable()
    write_json_atomic(os.path.join(output, f"{rank}_output.json"), rec.to_dict())
    comm.barrier()
    if rank != 0:
        return {"rank": rank, "output": output}
    import json

    ranks = []
    for r in range(world):
        with open(os.path.join(output, f"{r}_output.json")) as f:
            ranks.append(json.load(f))
    agg = aggregate(ranks, w.record_length, w.au, checkpoint_bytes)
    mem = meminfo("MemTotal")
    summary: dict[str, Any] = {
        "start": start, "end": _now(), "num_accelerators": world, "num_hosts": 1,
        "hostname": socket.gethostname(), "workload": w.source, "model": w.model_name,
        "epochs": agg["epochs"], "num_files_train": w.num_files_train,
        "num_samples_per_file": w.num_samples_per_file, "record_length": w.record_length,
        "batch_size": w.batch_size, "computation_time": w.computation_time,
        "host_memory_GB": [mem / 2**30], "data_size_per_host_GB": dataset_bytes / 2**30,
        "potential_caching": bool(w.do_train and dataset_bytes <= mem
                                  and not (opts.drop_cache or direct)),
        "drop_cache": opts.drop_cache, "odirect": bool(direct),
        "prefetch_batches": max(1, w.read_threads) * max(1, w.prefetch_size),
        "metric": agg["metric"], "per_epoch": agg["per_epoch"], "per_eval": agg["per_eval"],
        "checkpoints": agg["checkpoints"], "per_rank": agg["per_rank"],
        "data_folder": data_dir, "checkpoint_folder": ck_dir if w.do_checkpoint else None,
        "output_folder": output, "notes": w.notes,
    }
    summary["verdict"] = verdict(summary, w.au)
    write_json_atomic(os.path.join(output, "per_epoch_stats.json"),
                      {str(p["epoch"]): p for p in agg["per_epoch"]} | {
                          "checkpoints": agg["checkpoints"]})
    if opts.trace:
        summary["trace"] = _report(output, world, trace_path)
    write_json_atomic(os.path.join(output, "summary.json"), summary)
    return summary


def _report(output: str, world: int, trace_path: str) -> dict[str, Any]:
    paths = [os.path.join(output, f"trace-rank{r}.pfw") for r in range(world)]
    html = os.path.join(output, "report.html")
    js = os.path.join(output, "report.json")
    try:
        from lcache.report import write_report
    except ImportError:
        return {"traces": paths, "report": None,
                "note": "lcache.report is not installed; the traces are written"}
    write_report(paths, html, js)
    return {"traces": paths, "report": html, "report_json": js}


def _evaluate(w: Workload, epoch: int, reader: SampleReader, rec: RankRecorder, comm: Comm,
              rng: np.random.Generator, drop_cache: bool) -> None:
    """DLIO's evaluation: read the valid/ files, sleep ``eval_time`` per batch."""
    if drop_cache:
        reader.drop_cache()
    order = epoch_order(w, epoch, comm.rank, comm.world, len(reader.files), evaluation=True)
    comm.barrier()
    rec.start_eval(epoch)
    t0 = time.time()
    batches = iterate_batches(reader, order, w.batch_size_eval, w.read_threads,
                              w.prefetch_size)
    for nbytes in batches:
        loaded = time.time()
        et = w.eval_time
        if w.eval_time_stdev > 0:
            et = max(0.0, float(rng.normal(w.eval_time, w.eval_time_stdev)))
        if et > 0:
            time.sleep(et)
        done = time.time()
        rec.eval_step(epoch, loaded - t0, done - loaded, done - t0, nbytes)
        t0 = time.time()
    rec.end_eval(epoch)
    reader.close()  # this epoch's reader threads are gone: their files go too
    comm.barrier()


def _train_epoch(w: Workload, epoch: int, reader: SampleReader, rec: RankRecorder, comm: Comm,
                 steps: int, num_files: int, rng: np.random.Generator,
                 traffic: _StepTraffic | None, ck_io: Any, saved: list[str],
                 do_checkpoint: Callable[[str, str], None], advance: Callable[[int], None],
                 drop_cache: bool) -> None:
    if drop_cache:
        reader.drop_cache()
    order = epoch_order(w, epoch, comm.rank, comm.world, num_files)
    comm.barrier()
    rec.start_epoch(epoch)
    t0 = time.time()
    batches = iterate_batches(reader, order, w.batch_size, w.read_threads, w.prefetch_size)
    for step, nbytes in enumerate(batches, start=1):
        loaded = time.time()
        ct = w.computation_time
        if w.computation_time_stdev > 0:
            ct = max(0.0, float(rng.normal(w.computation_time, w.computation_time_stdev)))
        worker = None
        if traffic is not None:
            worker = threading.Thread(target=traffic.run_step, name="lcache-bench-offload")
            worker.start()
        if ct > 0:
            time.sleep(ct)
        computed = time.time()
        if worker is not None:
            worker.join()  # the accelerator waits for its offload traffic
        done = time.time()
        rec.step(epoch, loaded - t0, computed - loaded, done - t0, nbytes)
        comm.barrier()
        advance(1)
        if (ck_io is not None and w.steps_between_checkpoints > 0
                and step % w.steps_between_checkpoints == 0):
            rec.end_block(epoch)
            name = f"global_epoch{epoch}_step{step}"
            do_checkpoint("save", name)
            saved.append(name)
            rec.start_block(epoch)
        if step >= steps:
            break
        t0 = time.time()
    rec.end_epoch(epoch)
    reader.close()  # this epoch's reader threads are gone: their files go too
