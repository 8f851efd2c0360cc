"""Run a DLIO workload on real storage: generate, read, sleep in place of compute, checkpoint.

The workflows are DLIO's (``main.py`` at commit e1919d7b):

* ``generate_data``: the dataset is generated first, whatever else the file asks; with
  neither ``train`` nor ``checkpoint`` that is all (MLPerf's ``*_datagen`` files), and the
  summary says what was written;
* ``train``: epochs of reads and compute; checkpoints after epochs
  (``checkpoint_after_epoch``, ``epochs_between_checkpoints``) or every
  ``steps_between_checkpoints`` steps; ``num_checkpoints_write/read`` have no effect;
* ``checkpoint`` without ``train`` (checkpoint-only, MLPerf's llama3): ``num_checkpoints_write``
  checkpoints ``global_epoch1_step{1..n}``, then ``num_checkpoints_read`` loads of
  ``global_epoch1_step{1..n}``, each after ``time_between_checkpoints`` of emulated compute.
  With no writes the loads read what an earlier run wrote (MLPerf's separate read phase).

One process per emulated accelerator. Under ``torchrun`` (``WORLD_SIZE`` > 1) the ranks join a
gloo process group; they split the samples, meet at a barrier after every step (DLIO does the
same, standing in for the gradient all-reduce) and around every checkpoint. Each rank writes
``{rank}_output.json``; rank 0 merges them into ``summary.json`` and ``per_epoch_stats.json``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
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
from lcache.bench import datagen, storage
from lcache.bench.comm import Comm
from lcache.bench.config import Workload, check_run_length
from lcache.bench.metrics import RankRecorder, aggregate, verdict, write_json_atomic
from lcache.bench.order import ORDERS, epoch_order, eval_steps, max_steps, steps_per_epoch
from lcache.bench.reader import SampleReader, batches_ahead, iterate_batches
from lcache.bench.resources import bytes_under, meminfo, need_memory, need_space
from lcache.bench.traffic import StepIO, StepTraffic
from lcache.errors import ConfigError
from lcache.io import private_dir
from lcache.trace import record as trace_record


@dataclass
class BenchOptions:
    """Where and how to run; ``None`` means the workload file's own setting.

    ``order`` is ``dlio`` (DLIO's access order) or ``shuffle`` (a global permutation per
    epoch, an lcache option); ``read_back`` loads the first N checkpoints a training run saved
    (``bench from-model --restart``; DLIO reads none after training).
    """

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
    order: str = "dlio"
    read_back: int = 0


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


def _owned_dirs(dirs: list[tuple[str, str]]) -> None:
    """:func:`_owned_dir` for each ``(path, what)``; on a refusal, removes the folders this
    call created (when still empty), so a refused run leaves nothing behind."""
    made = []
    try:
        for path, what in dirs:
            top = os.path.abspath(path)  # the highest folder of path that is missing
            while not os.path.lexists(os.path.dirname(top)):
                top = os.path.dirname(top)
            if not os.path.lexists(top):
                made.append((os.path.abspath(path), top))
            _owned_dir(path, what)
    except BaseException:
        for leaf, top in reversed(made):
            while True:
                try:
                    os.rmdir(leaf)
                except OSError:
                    break  # not empty, or never made: leave it
                if leaf == top:
                    break
                leaf = os.path.dirname(leaf)
        raise


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
    if generate and not w.on_s3:
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


def _enable_trace(output: str, rank: int) -> tuple[Any, str]:
    try:
        import lcache.trace as trace_mod  # the tracing issue's module, imported lazily
    except ImportError as exc:
        raise ConfigError("--trace needs lcache.trace, which this installation lacks") from exc
    path = os.path.join(output, f"trace-rank{rank}.pfw")
    trace_mod.enable(path)
    return trace_mod, path


def _check_batches(w: Workload, world: int, num_files: int) -> None:
    """Training files (and evaluation, when on) that make at least one full batch per rank.

    Raises:
        ConfigError: they make none.
    """
    if steps_per_epoch(w, world, num_files) < 1:
        raise ConfigError(f"{w.source}: {num_files} files x {w.num_samples_per_file} "
                          f"samples make no full batch of {w.batch_size} per rank for "
                          f"{world} rank(s); add files or lower reader.batch_size")
    if w.do_eval and eval_steps(w, world) < 1:
        raise ConfigError(f"{w.source}: {w.num_files_eval} evaluation files make no full "
                          f"batch of {w.batch_size_eval} per rank for {world} rank(s); add "
                          "files or lower reader.batch_size_eval")


def run_workload(w: Workload, opts: BenchOptions | None = None) -> dict[str, Any]:
    """Execute ``w`` on real storage and return the summary (rank 0's; others get theirs).

    Raises:
        ConfigError: missing dataset files, impossible parallelism, bad options.
    """
    if not isinstance(w, Workload):  # a dict was an AttributeError deep in the run
        raise ConfigError(f"workload {w!r:.200}: give a Workload (lcache.bench.load_workload or "
                          "parse_workload)")
    if opts is not None and not isinstance(opts, BenchOptions):
        raise ConfigError(f"opts={opts!r:.200}: give a BenchOptions (or None)")
    opts = opts or BenchOptions()
    if opts.order not in ORDERS:
        raise ConfigError(f"order {opts.order!r}: use one of {', '.join(ORDERS)}")
    comm = Comm()
    try:
        return _Run(w, opts, comm).run()
    finally:
        comm.close()


class _Run:
    """One rank's run of a workload; ``run()`` returns the summary."""

    def __init__(self, w: Workload, opts: BenchOptions, comm: Comm) -> None:
        self.w, self.opts, self.comm = w, opts, comm
        self.notes = list(w.notes)
        self.output = os.path.abspath(opts.output or w.output_folder)  # made by run()
        data_dir = opts.data_dir or w.data_folder
        if w.on_s3 != data_dir.startswith("s3://"):
            raise ConfigError(f"data folder {data_dir}: storage.storage_type {w.storage_type} "
                              f"needs {'an s3:// URL' if w.on_s3 else 'a local path'}")
        self.data_dir = data_dir.rstrip("/") if w.on_s3 else os.path.abspath(data_dir)
        self.ck_dir = os.path.abspath(opts.checkpoint_dir or w.checkpoint_folder)
        self.direct = w.odirect if opts.direct is None else opts.direct
        self.generate = w.generate_data if opts.generate is None else opts.generate
        # bars on a terminal only: in a log they are lines before the summary or an error
        self.progress = _Progress(opts.show_progress and comm.rank == 0 and sys.stderr.isatty(),
                                  opts.progress_label)
        self.rec = RankRecorder(comm.rank, w.batch_size, w.exclude_start_steps,
                                w.exclude_end_steps, w.batch_size_eval)
        self.ck_io: ckpt.CheckpointIO | None = None
        self.saved: list[str] = []
        self.dataset_bytes = 0
        self.files: dict[str, list[str]] = {}  # listed before the run: split -> files
        if w.on_s3 and (opts.drop_cache or self.direct):
            self.notes.append("--drop-cache and O_DIRECT do not apply to S3 reads")

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        w, comm, opts = self.w, self.comm, self.opts
        dirs = [(self.output, "output")]
        if w.do_checkpoint or opts.step_io:
            dirs.append((self.ck_dir, "checkpoint"))
        if self.generate and not w.on_s3:
            dirs.append((self.data_dir, "data"))
        # Every refusal comes before a folder is made (a refused run left empty ones): the
        # folders that exist are checked first, then the room (and the files the run reads),
        # then the others are made.
        _owned_dirs([d for d in dirs if os.path.lexists(d[0])])
        _check_room(w, comm.world, self.data_dir, self.ck_dir, self.generate)
        if w.do_train:  # before minutes of generating, and before a folder is made
            if not self.generate:  # the files are there (a refused run left empty folders)
                self.files = {split: datagen.list_files(w, self.data_dir, split) for split in
                              ("train", "valid") if split == "train" or w.do_eval}
            _check_batches(w, comm.world, w.num_files_train)
        elif w.do_checkpoint:  # a run that only reads needs them there
            self._require(self._reads())
        _owned_dirs([d for d in dirs if not os.path.lexists(d[0])])
        start = _now()
        trace_mod, trace_path = _enable_trace(self.output, comm.rank) if opts.trace \
            else (None, "")
        if w.do_checkpoint:
            self.ck_io = ckpt.CheckpointIO(self.ck_dir, ckpt.rank_files(w, comm.rank, comm.world),
                                           w.checkpoint_fsync, drop_cache=opts.drop_cache)
        if self.generate:
            with self.progress.phase("generate data", w.num_files_train + w.num_files_eval) \
                    as advance:
                files, nbytes = datagen.generate(w, self.data_dir, comm.rank, comm.world,
                                                 progress=advance)
            self.rec.generated = {"files": files, "bytes": nbytes}
            comm.barrier()
        if w.do_train:
            self._train()
        elif w.do_checkpoint:
            self._checkpoint_only()
        if trace_mod is not None:
            trace_mod.disable()
        write_json_atomic(os.path.join(self.output, f"{comm.rank}_output.json"),
                          self.rec.to_dict())
        comm.barrier()
        if comm.rank != 0:
            return {"rank": comm.rank, "output": self.output}
        summary = self._summary(start)
        if opts.trace:
            summary["trace"] = _report(self.output, comm.world, trace_path)
        write_json_atomic(os.path.join(self.output, "summary.json"), summary)
        return summary

    def _checkpoint(self, kind: str, name: str) -> None:
        if self.ck_io is None:
            raise ConfigError("no checkpoint is configured (workflow.checkpoint is off)")
        self.comm.barrier()
        t0 = time.perf_counter()
        n = self.ck_io.save(name) if kind == "save" else self.ck_io.load(name)
        own = time.perf_counter() - t0
        self.comm.barrier()
        self.rec.checkpoint(kind, name, time.perf_counter() - t0, own, n)
        if kind == "save":
            self.saved.append(name)

    def _checkpoint_only(self) -> None:
        """DLIO's ``_checkpoint``: writes, then reads, each after the compute between them."""
        w = self.w
        names = [f"global_epoch1_step{i + 1}" for i in range(max(w.num_checkpoints_write,
                                                                 w.num_checkpoints_read))]
        reads = names[:max(0, w.num_checkpoints_read)]
        for kind, todo in (("save", names[:max(0, w.num_checkpoints_write)]), ("load", reads)):
            if not todo:
                continue
            with self.progress.phase(f"checkpoint {'write' if kind == 'save' else 'read'}",
                                     len(todo)) as advance:
                for name in todo:
                    if w.time_between_checkpoints > 0:
                        time.sleep(w.time_between_checkpoints)  # the training in between
                    self._checkpoint(kind, name)
                    advance(1)

    def _reads(self) -> list[str]:
        """The checkpoints a checkpoint-only run reads that no write of it makes (earlier
        runs wrote them)."""
        w = self.w
        if w.num_checkpoints_write > 0:
            return []
        return [f"global_epoch1_step{i + 1}" for i in range(max(0, w.num_checkpoints_read))]

    def _require(self, names: list[str]) -> None:
        """Every rank's files of ``names`` exist (checked on all ranks, before a folder is
        made)."""
        if not names:
            return
        files = ckpt.rank_files(self.w, self.comm.rank, self.comm.world)
        missing = [f"{n}/{f.name}" for n in names for f in files
                   if not os.path.isfile(os.path.join(self.ck_dir, n, f.name))]
        if not self.comm.all_ok(not missing):
            where = f": {missing[0]}" if missing else " on another rank"
            raise ConfigError(f"checkpoint.num_checkpoints_read = {len(names)} with no writes "
                              f"reads checkpoints an earlier run wrote into {self.ck_dir}, and "
                              f"one is missing{where}; write them first with the same model, "
                              "parallelism and rank count")

    # ------------------------------------------------------------------ training
    def _train(self) -> None:
        w, comm, opts = self.w, self.comm, self.opts
        files = self.files.get("train") or datagen.list_files(w, self.data_dir)
        steps = steps_per_epoch(w, comm.world, len(files))
        _check_batches(w, comm.world, len(files))
        if w.total_training_steps > max_steps(w, comm.world, len(files)):
            self.notes.append(f"train.total_training_steps = {w.total_training_steps} is more "
                              f"than the {steps} steps the dataset holds per epoch: ran "
                              f"{steps} (DLIO stops with an error)")
        reader = self._reader(files)
        eval_reader = None
        if w.do_eval:
            eval_files = self.files.get("valid") or datagen.list_files(w, self.data_dir,
                                                                        "valid")
            eval_reader = self._reader(eval_files)
        traffic = StepTraffic(self.ck_dir, comm.rank, opts.step_io) if opts.step_io else None
        rng = np.random.default_rng([w.seed, comm.rank])
        try:
            with self.progress.phase("train", w.epochs * steps) as advance:
                for epoch in range(1, w.epochs + 1):
                    self._epoch(epoch, reader, steps, rng, traffic, advance)
                    if (w.do_checkpoint and w.steps_between_checkpoints <= 0
                            and epoch >= w.checkpoint_after_epoch
                            and (epoch - w.checkpoint_after_epoch)
                            % max(1, w.epochs_between_checkpoints) == 0):
                        self._checkpoint("save", f"global_epoch{epoch}_step{steps}")
                    if (eval_reader is not None and epoch >= w.eval_after_epoch
                            and (epoch - w.eval_after_epoch)
                            % max(1, w.epochs_between_evals) == 0):
                        self._evaluate(epoch, eval_reader, rng)
        finally:
            reader.close()
            if eval_reader is not None:
                eval_reader.close()
            if traffic is not None:
                traffic.close()
        for name in self.saved[:opts.read_back]:
            self._checkpoint("load", name)

    def _reader(self, files: list[str]) -> SampleReader:
        if self.w.on_s3:
            remote = storage.source(self.w, files)
            self.dataset_bytes += int(remote.sizes().sum())
            return SampleReader(self.w, files, remote=remote)
        self.dataset_bytes += sum(os.path.getsize(f) for f in files)
        return SampleReader(self.w, files, direct=self.direct)

    def _batches(self, reader: SampleReader, order: np.ndarray, batch: int) -> Iterator[int]:
        threads = self.w.read_threads
        if self.w.data_loader == "tensorflow":
            threads = max(1, threads)  # tf.data reads with one thread at least
        return iterate_batches(reader, order, batch, threads, batches_ahead(self.w))

    def _epoch(self, epoch: int, reader: SampleReader, steps: int, rng: np.random.Generator,
               traffic: StepTraffic | None, advance: Callable[[int], None]) -> None:
        w, comm, rec = self.w, self.comm, self.rec
        if self.opts.drop_cache:
            reader.drop_cache()
        order = epoch_order(w, epoch, comm.rank, comm.world, len(reader.files),
                            order=self.opts.order)
        comm.barrier()
        rec.start_epoch(epoch)
        t0 = time.time()
        for step, nbytes in enumerate(self._batches(reader, order, w.batch_size), start=1):
            loaded = time.time()
            ct = w.computation_time
            if w.computation_time_stdev > 0:
                ct = max(0.0, float(rng.normal(w.computation_time, w.computation_time_stdev)))
            worker = None
            if traffic is not None:
                worker = threading.Thread(target=traffic.run_step, name="lcache-bench-offload")
                worker.start()
            compute_ns = time.perf_counter_ns()
            if ct > 0:
                time.sleep(ct)
            computed = time.time()
            # A step marker (a no-op untraced): lcache advise reads the compute from it,
            # which the reads alone do not show when readers run ahead.
            trace_record("step", "bench", step, 0, "step", compute_ns,
                         time.perf_counter_ns() - compute_ns, 0)
            if worker is not None:
                worker.join()  # the accelerator waits for its offload traffic
            done = time.time()
            rec.step(epoch, loaded - t0, computed - loaded, done - t0, nbytes)
            comm.barrier()
            advance(1)
            if (self.ck_io is not None and w.steps_between_checkpoints > 0
                    and step % w.steps_between_checkpoints == 0):
                rec.end_block(epoch)
                self._checkpoint("save", f"global_epoch{epoch}_step{step}")
                rec.start_block(epoch)
            if step >= steps:
                break
            t0 = time.time()
        rec.end_epoch(epoch)
        reader.close()  # this epoch's reader threads are gone: their files go too

    def _evaluate(self, epoch: int, reader: SampleReader, rng: np.random.Generator) -> None:
        """DLIO's evaluation: read the valid/ files, sleep ``eval_time`` per batch."""
        w, comm, rec = self.w, self.comm, self.rec
        if self.opts.drop_cache:
            reader.drop_cache()
        order = epoch_order(w, epoch, comm.rank, comm.world, len(reader.files),
                            evaluation=True, order=self.opts.order)
        comm.barrier()
        rec.start_eval(epoch)
        t0 = time.time()
        for nbytes in self._batches(reader, order, w.batch_size_eval):
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

    # ------------------------------------------------------------------ the summary
    def _summary(self, start: str) -> dict[str, Any]:
        w, world = self.w, self.comm.world
        ranks = []
        for r in range(world):
            with open(os.path.join(self.output, f"{r}_output.json")) as f:
                ranks.append(json.load(f))
        checkpoint_bytes = ckpt.total_bytes(w, world) if w.do_checkpoint else 0
        agg = aggregate(ranks, w.record_length, w.au, checkpoint_bytes)
        mem = meminfo("MemTotal")
        summary: dict[str, Any] = {
            "start": start, "end": _now(), "num_accelerators": world, "num_hosts": 1,
            "hostname": socket.gethostname(), "workload": w.source, "model": w.model_name,
            "epochs": agg["epochs"], "num_files_train": w.num_files_train,
            "num_samples_per_file": w.num_samples_per_file, "record_length": w.record_length,
            "batch_size": w.batch_size, "computation_time": w.computation_time,
            "host_memory_GB": [mem / 2**30],
            "data_size_per_host_GB": self.dataset_bytes / 2**30,
            "potential_caching": bool(w.do_train and not w.on_s3 and self.dataset_bytes <= mem
                                      and not (self.opts.drop_cache or self.direct)),
            "drop_cache": self.opts.drop_cache, "odirect": bool(self.direct),
            "order": self.opts.order, "data_loader": w.data_loader,
            "prefetch_batches": batches_ahead(w),
            "exclude_steps": [w.exclude_start_steps, w.exclude_end_steps],
            "generated": agg["generated"], "generate_only": self.generate and not (
                w.do_train or w.do_checkpoint),
            "metric": agg["metric"], "per_epoch": agg["per_epoch"], "per_eval": agg["per_eval"],
            "checkpoints": agg["checkpoints"], "per_rank": agg["per_rank"],
            "data_folder": self.data_dir,
            "checkpoint_folder": self.ck_dir if w.do_checkpoint else None,
            "output_folder": self.output, "notes": self.notes,
        }
        if w.do_checkpoint and w.checkpoint_mode == "subset":
            summary["checkpoint_job_size_GB"] = ckpt.job_bytes(w, world) / 2**30
        summary["verdict"] = verdict(summary, w.au)
        write_json_atomic(os.path.join(self.output, "per_epoch_stats.json"),
                          {str(p["epoch"]): p for p in agg["per_epoch"]} | {
                              "checkpoints": agg["checkpoints"]})
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
