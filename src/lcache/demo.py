"""The training demo behind ``lcache demo``.

A synthetic dataset is served by a throttled loopback HTTP server (the "remote": fixed latency
per request, one bandwidth cap). A small model trains on CPU for 3 epochs twice, with the same
shuffled order and DataLoader settings: once reading every sample from the remote, once
through LCache with a cache half the size of the dataset. Figures are measured, per epoch:
seconds, samples/s, bytes the server sent, hit ratio, and Belady/OPT's hit ratio for the
same order and capacity (the most any cache could hit).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np

from lcache.data import CachedDataset, FileSource, SeedAwareSampler
from lcache.data.order import rank_order
from lcache.data.plan import belady
from lcache.data.sizing import MIN_SEGMENTS, choose_segment_size
from lcache.errors import ConfigError
from lcache.store import format_size
from lcache.store.record import HEADER_SIZE
from lcache.terminate import let_go
from lcache.testing.remote import ThrottledServer

CLASSES = 10
#: the sample sizes the demo writes: a label and at least three features, up to 2 MiB
SAMPLE_BYTES = (16, 2 << 20)


def check_demo_size(samples: int, sample_bytes: int, cache_fraction: float,
                    directory: str) -> None:
    """Refuse, before anything is written, a sample size the demo cannot use and a dataset
    whose files (the remote's copy and the cache) do not fit the free space of
    ``directory``."""
    low, high = SAMPLE_BYTES
    if not low <= sample_bytes <= high:
        raise ConfigError(f"--sample-size {sample_bytes:,} bytes: the demo writes samples "
                          f"of {low} B to {high >> 20} MiB")
    dataset = samples * sample_bytes
    capacity = int(dataset * cache_fraction)
    # the least the cache takes (its segments are sized from the capacity and the samples)
    least = MIN_SEGMENTS * choose_segment_size(capacity, 512, sample_bytes)
    if capacity < least:
        raise ConfigError(f"the demo's cache, --cache-fraction {cache_fraction:g} x the dataset "
                          f"(--samples {samples} x --sample-size {format_size(sample_bytes)}), "
                          f"is below the minimum cache capacity {format_size(least)}: raise "
                          "--samples, --sample-size or --cache-fraction")
    need = int(dataset * (1 + cache_fraction)) + (64 << 20)
    free = shutil.disk_usage(directory).free
    if need > free:
        raise ConfigError(f"--samples {samples} x --sample-size {format_size(sample_bytes)} "
                          f"is a {format_size(dataset)} dataset; with its cache the demo needs "
                          f"about {format_size(need)} in {directory}, which has "
                          f"{format_size(free)} free: lower --samples or --sample-size, or "
                          "choose another --dir")


def write_dataset(root: str, samples: int, sample_bytes: int, seed: int = 0) -> None:
    """One file per sample: an int32 label, then float32 features near the class centre."""
    dims = (sample_bytes - 4) // 4
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(CLASSES, dims)).astype(np.float32)
    os.makedirs(root, exist_ok=True)
    for i in range(samples):
        label = i % CLASSES
        x = centres[label] + rng.normal(scale=2.0, size=dims).astype(np.float32)
        with open(os.path.join(root, f"{i:07d}.bin"), "wb") as f:
            f.write(np.int32(label).tobytes() + x.tobytes())


def decode(data: bytes) -> tuple[Any, int]:
    import torch

    label = int(np.frombuffer(data, np.int32, 1)[0])
    return torch.from_numpy(np.frombuffer(data, np.float32, offset=4).copy()), label


class RemoteDataset:
    """The baseline: every item read from the remote, as a loader without a cache does."""

    def __init__(self, source: FileSource) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return decode(self.source.fetch(index))


class FixedOrder:
    """The seed-aware sampler's order without a cache, so both runs see the same order."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(rank_order(self.n, self.seed, self.epoch, 0, 1).tolist())


def _train(loader: Any, sampler: Any, epochs: int, server: ThrottledServer,
           hit_ratio: Callable[[], tuple[int, int]], label: str,
           progress: Callable[[str], None]) -> list[dict[str, Any]]:
    import torch

    torch.manual_seed(0)
    dims = None
    model: Any = None
    rows = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        sent0 = server.bytes_sent
        acc0, fetch0 = hit_ratio()
        start = time.perf_counter()
        seen = 0
        loss_sum = 0.0
        for x, y in loader:
            if model is None:
                dims = x.shape[1]
                model = torch.nn.Sequential(torch.nn.Linear(dims, 64), torch.nn.ReLU(),
                                            torch.nn.Linear(64, CLASSES))
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            seen += len(y)
            loss_sum += loss.item() * len(y)
        seconds = time.perf_counter() - start
        acc1, fetch1 = hit_ratio()
        accesses = acc1 - acc0
        rows.append({
            "system": label, "epoch": epoch + 1, "seconds": round(seconds, 3),
            "samples_per_s": round(seen / seconds, 1),
            "remote_bytes": server.bytes_sent - sent0,
            "hit_ratio": round(1 - (fetch1 - fetch0) / accesses, 4) if accesses else 0.0,
            "loss": round(loss_sum / max(1, seen), 4),
        })
        progress(f"{label}: epoch {epoch + 1} in {seconds:.1f} s")
    return rows


#: what the demo writes into its folder (``--dir``)
TRACE_NAME = "lcache-demo.trace.gz"
HTML_NAME = "lcache-demo-report.html"
SUMMARY_NAME = "lcache-demo-summary.json"


def _check_outputs(folder: str, traced: str | None) -> None:
    """Refuse, with a ConfigError, the demo's outputs in ``folder`` where one could not be
    written or would replace a file lcache did not write (``traced``: the trace already being
    recorded, which the demo reads, else the demo writes its own)."""
    from lcache.cli.checks import check_outputs, check_replaceable
    from lcache.report import is_html_report, is_json_summary
    from lcache.trace.writer import is_trace

    html, summary = os.path.join(folder, HTML_NAME), os.path.join(folder, SUMMARY_NAME)
    trace = None if traced else os.path.join(folder, TRACE_NAME)
    check_outputs([("--dir", html, "report", False), ("--dir", summary, "summary", False),
                   ("--dir", trace, "trace", False)], [traced] if traced else [])
    check_replaceable([("--dir", html, "report", is_html_report),
                       ("--dir", summary, "summary", is_json_summary),
                       ("--dir", trace, "trace", is_trace)])


def run_training_demo(directory: str | None = None, *, samples: int = 4000,
                      sample_bytes: int = 16 << 10, cache_fraction: float = 0.5,
                      epochs: int = 3, latency: float = 0.005, bandwidth: float = 25e6,
                      workers: int = 2, batch_size: int = 64, seed: int = 0,
                      progress: Callable[[str], None] = lambda s: None,
                      report_dir: str | None = None) -> dict[str, Any]:
    """Run the demo; it ends by writing the I/O report of its own run (docs/trace.md) to
    ``report_dir`` (default: ``directory``, else a new private folder in the system's
    temporary directory). A file already there under one of its names is replaced only where
    lcache wrote it (else :class:`ConfigError` before any training). A run that fails removes
    the trace it wrote."""
    import lcache.trace
    from lcache.trace import recorder

    try:
        import torch  # noqa: F401 (fail early with the install hint)
    except ImportError:
        raise SystemExit("lcache demo needs PyTorch: pip install 'lcache[torch]'") from None
    check_demo_size(samples, sample_bytes, cache_fraction, directory or tempfile.gettempdir())
    active = recorder._active
    own_trace = active is None
    if report_dir or directory:
        # before any training, by `lcache report -o`'s rule: a file there that lcache did not
        # write, a link or a directory is refused (they were replaced, or found after training)
        _check_outputs(cast(str, report_dir or directory), None if active is None else active.path)
    # Without a folder of its own, the run writes into a new private one (fixed names in the
    # shared temporary directory were overwritten by a concurrent demo).
    private = None if report_dir or directory else tempfile.mkdtemp(prefix="lcache-demo-")
    report_dir = report_dir or directory or cast(str, private)
    trace_path = os.path.join(report_dir, TRACE_NAME)
    if active is None:
        if os.path.exists(trace_path):  # checked: one lcache wrote
            os.unlink(trace_path)
        lcache.trace.enable(trace_path)
    else:  # already traced (LCACHE_TRACE or `lcache trace -- lcache demo`): report that trace
        trace_path = active.path

    def discard() -> None:
        if own_trace:  # a failed run leaves nothing behind
            lcache.trace.disable()
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)
            elif os.path.exists(trace_path):
                os.unlink(trace_path)

    try:
        figures = _run(directory, samples, sample_bytes, cache_fraction, epochs, latency,
                       bandwidth, workers, batch_size, seed, progress)
    except BaseException:
        discard()
        raise
    if own_trace:
        lcache.trace.disable()
    else:
        lcache.trace.flush()
    from lcache.report import write_report

    html_path = os.path.join(report_dir, HTML_NAME)
    json_path = os.path.join(report_dir, SUMMARY_NAME)
    progress("writing the I/O report of this run")
    try:
        summary = write_report([trace_path], html_path, json_path)
    except BaseException:
        discard()
        raise
    figures["report"] = {"trace": trace_path, "html": html_path, "summary": json_path,
                         "classes": {k: {f: v[f] for f in ("ops", "bytes", "seq_fraction")}
                                     for k, v in summary["classes"].items()}}
    progress(f"I/O report of this run: {html_path} (summary: {json_path})")
    return figures


def _run(directory: str | None, samples: int, sample_bytes: int, cache_fraction: float,
         epochs: int, latency: float, bandwidth: float, workers: int, batch_size: int,
         seed: int, progress: Callable[[str], None]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        remote_root = os.path.join(tmp, "remote")
        progress(f"writing {samples} samples of {sample_bytes} bytes")
        write_dataset(os.path.join(remote_root, "train"), samples, sample_bytes, seed)
        dataset_bytes = samples * sample_bytes
        capacity = int(dataset_bytes * cache_fraction)
        # with ETags, as object stores send them: versions that tell rewrites (no warning)
        with ThrottledServer(remote_root, latency=latency, bandwidth=bandwidth,
                             etags=True) as server:
            url = f"{server.url}/train/"
            source = FileSource(url)
            # made first, so a capacity below the minimum is said before the uncached run
            try:
                cached = CachedDataset(source, os.path.join(tmp, "cache"), capacity,
                                       transform=decode)
            except ConfigError as exc:  # the demo has no capacity option: name its own
                raise ConfigError(str(exc).replace(
                    "raise the capacity",
                    f"the demo's cache is --cache-fraction {cache_fraction:g} x the dataset "
                    f"({samples} x {format_size(sample_bytes)}): raise --samples, "
                    "--sample-size or --cache-fraction")) from None
            try:
                rows = _compare(cached, source, sample_bytes, capacity, epochs, workers,
                                batch_size, seed, server, progress)
            except BaseException as exc:
                # the DataLoader workers stop while the server they fetch from still runs:
                # else each waits out its fetch's retries and DataLoader's 5 s join, and a
                # signal's exit could leave them running and their folders behind
                let_go(exc.__traceback__)
                raise
            finally:
                # its staging area in /dev/shm (19 MB here) went only with the next cache
                cached.cache.close()
    return {
        "samples": samples, "sample_bytes": sample_bytes, "dataset_bytes": dataset_bytes,
        "cache_fraction": cache_fraction, "cache_capacity": capacity,
        "remote": {"latency_s": latency, "bandwidth_Bps": bandwidth},
        "workers": workers, "batch_size": batch_size, "epochs": rows,
    }


def _leave_signals_to_the_main_process(worker_id: int) -> None:
    """A DataLoader worker ignores SIGINT and SIGTERM: sent to the whole process group (a
    terminal's Ctrl-C, systemd stopping a service) they killed the workers under the main
    process, whose DataLoader then raised "worker (pid N) is killed by signal" with a
    traceback. The main process unwinds and stops its workers itself (they also exit when
    it dies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _compare(cached: CachedDataset, source: FileSource, sample_bytes: int, capacity: int,
             epochs: int, workers: int, batch_size: int, seed: int,
             server: ThrottledServer, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """The epochs without the cache, then through it."""
    from torch.utils.data import DataLoader

    plain = RemoteDataset(source)
    order = FixedOrder(len(plain), seed)
    loader = DataLoader(cast(Any, plain), batch_size=batch_size, sampler=order,
                        num_workers=workers, persistent_workers=workers > 0,
                        worker_init_fn=_leave_signals_to_the_main_process)
    rows = _train(loader, order, epochs, server, lambda: (1, 0), "no cache", progress)

    sampler = SeedAwareSampler(cached, seed=seed)
    loader = DataLoader(cast(Any, cached), batch_size=batch_size, sampler=sampler,
                        num_workers=workers, persistent_workers=workers > 0,
                        worker_init_fn=_leave_signals_to_the_main_process)

    def counts() -> tuple[int, int]:
        totals = cached.cache.counters.totals()
        return totals["accesses"], totals["fetches"]

    rows += _train(loader, sampler, epochs, server, counts, "lcache", progress)
    seq = np.concatenate([sampler.node_sequence(e) for e in range(epochs)])
    opt = belady(seq, sample_bytes + HEADER_SIZE, capacity).hits
    n = len(plain)
    for row in rows:
        if row["system"] == "lcache":
            e = row["epoch"] - 1
            row["opt_hit_ratio"] = round(float(opt[e * n : (e + 1) * n].mean()), 4)
    del loader  # its persistent workers exit now and flush their trace events
    return rows
