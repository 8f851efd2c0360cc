"""lcache advise: known-answer traces (written by lcache's recorder) give the steps, dataset,
checkpoints and advice they were made with; what cannot be fitted is said, the rest fitted."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lcache.advise import Targets, advise
from lcache.bench import parse_workload
from lcache.errors import ConfigError
from lcache.report import summarize
from lcache.store.record import HEADER_SIZE
from tests.conftest import subprocess_env
from tests.test_advise_traces import SAMPLE, loop, record_trace


def _advise(tmp_path: Path, body, in_thread: bool = True, **kw):  # type: ignore[no-untyped-def]
    path = tmp_path / "run.trace"
    record_trace(path, body, in_thread)
    return advise(path, **kw)


def test_rhythm_of_reader_threads(tmp_path: Path) -> None:
    """Reads that run ahead (a reader thread): one burst per step, the period is the step."""
    doc = _advise(tmp_path, loop(30, 4, period_ms=10, read_ms=1, samples=40))
    s = doc["fit"]["steps"]
    assert s["source"] == "rhythm" and s["batch_samples"] == 4 and s["count"] == 30
    assert s["step_s"] == pytest.approx(0.010, rel=1e-3)
    assert s["compute_s"] == s["step_s"] and not s["reads_in_training_thread"]
    ds = doc["fit"]["dataset"]
    assert ds["samples"] == 40 and ds["bytes"] == 40 * SAMPLE and ds["epochs_seen"] == 3.0
    data = doc["fit"]["groups"]["data"]
    assert data["read_bytes_per_step"] == 4 * SAMPLE and data["read_fraction"] == 1.0
    assert data["size_p50"] == SAMPLE and doc["unfitted"] == []
    assert data["size_histogram"] == {str(SAMPLE): 120}


def test_rhythm_in_the_training_thread(tmp_path: Path) -> None:
    """Reads in the main thread are not overlapped: the idle gap is the compute."""
    doc = _advise(tmp_path, loop(20, 4, period_ms=10, read_ms=4), in_thread=False)
    s = doc["fit"]["steps"]
    assert s["reads_in_training_thread"] and s["batch_samples"] == 4
    assert s["compute_s"] == pytest.approx(0.006, rel=1e-3)
    assert s["au_estimate"] == pytest.approx(0.6, rel=1e-3)
    reader = doc["workload"]["doc"]["reader"]
    assert reader["read_threads"] == 0 and reader["batch_size"] == 4
    # Advice: one thread reads a batch in 4 ms, compute is 6 ms: one thread keeps up.
    (threads,) = [a for a in doc["advice"] if a["topic"].startswith("reader")]
    assert threads["value"] == 1 and threads["prefetch_batches"] == 2


def test_markers_give_steps_and_compute(tmp_path: Path) -> None:
    doc = _advise(tmp_path, loop(12, 2, period_ms=5, read_ms=0.5, markers=True))
    s = doc["fit"]["steps"]
    assert s["source"] == "markers" and s["count"] == 12 and s["batch_samples"] == 2
    assert s["compute_s"] == pytest.approx(0.0045, rel=1e-3)
    assert s["step_s"] == pytest.approx(0.005, rel=1e-3)


_RANKS = """
import os, sys
import lcache.trace
MS = 1_000_000
lcache.trace.enable(sys.argv[1])
ranks = int(sys.argv[2])
t0 = lcache.trace.now_ns()
def loop(rank):
    t = t0 + rank * 1000  # the ranks step together, 1 us apart
    for step in range(30):
        for k in range(4):
            i = (step * 4 * ranks + rank * 4 + k) % 400
            lcache.trace.record("read", f"/data/{i:05d}.bin", 0, 65536, "data-source",
                                t + k * MS // 4, MS // 4, 65536)
        lcache.trace.record("step", "train", step, 0, "step", t, 9 * MS, 0)
        t += 10 * MS
children = []
for rank in range(1, ranks):
    pid = os.fork()
    if pid == 0:
        loop(rank)
        lcache.trace.flush()
        os._exit(0)
    children.append(pid)
loop(0)
for pid in children:
    os.waitpid(pid, 0)
lcache.trace.disable()
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_ranks_stepping_together_are_fitted_per_rank(tmp_path: Path, ranks: int) -> None:
    """The finding (attack helper 60): step markers of 2 processes (ranks) in one trace were
    pooled, 60 steps 1 us apart (the ranks' interleaved markers) with 2 read threads. Each
    process's markers are its own steps: 30 of 10 ms, a batch of 4 read in the training
    thread, as one rank gives; the ranks are said, and the workload is a rank's."""
    trace = tmp_path / "ranks.trace"
    subprocess.run([sys.executable, "-c", _RANKS, str(trace), str(ranks)], check=True,
                   env=subprocess_env(), timeout=60)
    doc = advise(trace)
    s = doc["fit"]["steps"]
    assert s["source"] == "markers" and s["count"] == 30, s
    assert s["step_s"] == pytest.approx(0.010) and s["compute_s"] == pytest.approx(0.009)
    assert s["batch_samples"] == 4 and s["reads_in_training_thread"], s
    assert s.get("ranks", 1) == ranks
    reader = doc["workload"]["doc"]["reader"]
    assert reader["batch_size"] == 4 and reader["read_threads"] == 0
    assert any(f"{ranks} ranks stepping together" in n
               for n in doc["workload"]["notes"]) == (ranks > 1)
    (readers,) = [a for a in doc["advice"] if a["topic"].startswith("reader")]
    assert f"a step reads {4 * 65536 / 1e6:,.3f} MB" in readers["arithmetic"]


def test_reads_that_never_pause_fit_the_rest(tmp_path: Path) -> None:
    """A read-bound loop shows no step: said, and the dataset and capacity still fitted."""
    doc = _advise(tmp_path, loop(40, 4, period_ms=2, read_ms=2, samples=80))
    assert doc["fit"]["steps"]["source"] is None
    (why,) = [u["why"] for u in doc["unfitted"] if u["what"] == "steps"]
    assert "never pause" in why and "step marker" in why
    cap = doc["advice"][0]
    assert cap["topic"] == "cache capacity" and cap["value"] > 0
    assert "missing" in doc["advice"][1]  # no compute time to size readers against
    parse_workload(yaml.safe_load(doc["workload"]["yaml"]))  # still a workload that runs


def test_too_short_says_how_long(tmp_path: Path) -> None:
    doc = _advise(tmp_path, loop(4, 4, period_ms=10, read_ms=1))
    (why,) = [u["why"] for u in doc["unfitted"] if u["what"] == "steps"]
    assert "at least 9" in why and "s of training" in why, why


def test_capacity_for_a_hit_ratio(tmp_path: Path) -> None:
    """hit ratio = C/N: 0.75 of 40 samples is 30 records of sample + header for the plan;
    the cache is the store's minimum, 40 segments of 512 KiB (4 records of 64 KiB each)."""
    doc = _advise(tmp_path, loop(30, 4, period_ms=10, read_ms=1, samples=40),
                  targets=Targets(hit_ratio=0.75))
    cap = doc["advice"][0]
    assert cap["plan_bytes"] == 30 * (SAMPLE + HEADER_SIZE)
    assert cap["value"] == 40 * (512 << 10)
    assert cap["fraction_of_dataset"] == pytest.approx(40 * (512 << 10) / (40 * SAMPLE),
                                                       abs=1e-4)
    # in units that show a small dataset (it said "0.003 GB" and "0.000 GB per epoch";
    # newcomer helper 84)
    assert f"= 21.0 MB ({cap['fraction_of_dataset']:.3f} x the 2.62 MB dataset)" in \
        cap["arithmetic"] and "= 655.4 kB per epoch" in cap["arithmetic"], cap["arithmetic"]


def test_checkpoints_and_interval(tmp_path: Path) -> None:
    """8 MiB saves every 10 steps taking 40 ms: 209.7 MB/s; 5% stall at 10 ms steps."""
    doc = _advise(tmp_path, loop(40, 4, period_ms=10, read_ms=1, ckpt_every=10,
                                 ckpt_bytes=8 << 20, ckpt_ms=40))
    ck = doc["fit"]["checkpoint"]
    assert ck["saves"] == 4 and ck["bytes_p50"] == 8 << 20 and ck["fsync"]
    assert ck["interval_steps"] == 10
    assert ck["persist_MBps"] == pytest.approx((8 << 20) / 0.040 / 1e6, rel=1e-3)
    (adv,) = [a for a in doc["advice"] if a["topic"] == "checkpoint interval"]
    stall = ck["bytes_p50"] / (ck["persist_MBps"] * 1e6)  # 0.040 s, as measured
    step = doc["fit"]["steps"]["step_s"]  # 0.010 s
    assert adv["value"] == math.ceil(stall * 0.95 / (0.05 * step) - 1e-9)
    assert adv["value"] in (76, 77)
    assert "stalls 28.6%" in adv["arithmetic"]  # 40 ms every 10 x 10 ms
    w = doc["workload"]["doc"]
    assert w["checkpoint"]["steps_between_checkpoints"] == 10
    assert w["model"]["model_size_bytes"] == 8 << 20


def test_no_data_class_fits_the_checkpoints(tmp_path: Path) -> None:
    def body(t0: int) -> None:
        loop(30, 1, period_ms=10, read_ms=1, ckpt_every=5, ckpt_bytes=4 << 20,
             ckpt_ms=20, sample_cls="other")(t0)

    doc = _advise(tmp_path, body)
    whats = [u["what"] for u in doc["unfitted"]]
    assert "data" in whats and "steps" in whats
    assert doc["fit"]["checkpoint"]["saves"] == 6
    w = doc["workload"]["doc"]
    assert not w["workflow"]["train"] and w["checkpoint"]["num_checkpoints_write"] == 6
    parse_workload(w)


def test_offload_bandwidth_and_endurance(tmp_path: Path) -> None:
    """64 MiB written per 10 ms step: 6.7 GB/s, 580 TB a day against one 3.84 TB drive."""
    doc = _advise(tmp_path, loop(20, 2, period_ms=10, read_ms=1, offload_bytes=64 << 20),
                  targets=Targets(ssds=1))
    (off,) = [a for a in doc["advice"] if a["topic"] == "optimizer offload"]
    need = (64 << 20) / 0.010
    assert off["bandwidth_margin"] == pytest.approx(3.8e9 / need, rel=1e-2)
    assert off["dwpd"] == pytest.approx(need * 86_400 / 3.84e12, rel=1e-2)
    assert off["value"] is False and "wears the drives out early" in off["arithmetic"]


_CHILD = """
import sys
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from tests.test_advise_traces import loop, record_trace
cls = sys.argv[2]
record_trace(Path(sys.argv[1]), loop(20, 4, 10, 1, samples=40, sample_cls=cls,
             prefix='/data/' + cls), True)
"""


def test_mixed_runs_fit_one_and_name_the_others(tmp_path: Path) -> None:
    """Two processes' traces that read differently (source vs cache) are two runs."""
    root = str(Path(__file__).resolve().parents[1])
    paths = []
    for k, cls in enumerate(("data-source", "cache-read")):
        p = tmp_path / f"r{k}.trace"
        subprocess.run([sys.executable, "-c", _CHILD, str(p), cls, root], check=True,
                       env=subprocess_env(), timeout=60)
        paths.append(p)
        # The child's events span 200 ms from its start, past its exit on a fast machine:
        # the next child starts after them, as a second run would.
        time.sleep(0.3)
    doc = advise(paths)
    runs = doc["fit"]["runs"]
    assert runs["count"] == 2 and runs["fitted"] == 2
    (why,) = [u["why"] for u in doc["unfitted"] if u["what"] == "one run"]
    assert "2 runs" in why and "fitted run 2" in why
    assert doc["fit"]["steps"]["batch_samples"] == 4  # the fitted run's own steps


def test_irregular_pauses_are_not_steps(tmp_path: Path) -> None:
    """Bursts of 1 and 8 reads in turn are not one batch per step: said, not fitted."""

    def body(t0: int) -> None:
        for k in range(30):
            loop(1, 1 if k % 2 else 8, period_ms=10, read_ms=1, prefix=f"/d/{k}-")(
                t0 + k * 10_000_000)

    doc = _advise(tmp_path, body)
    (why,) = [u["why"] for u in doc["unfitted"] if u["what"] == "steps"]
    assert "irregularly" in why and "1-8 reads" in why, why


def test_scale_per_gpu_node_and_day(tmp_path: Path) -> None:
    """4 x 64 KiB a 10 ms step over 2 traced GPUs: 13.1 MB/s per GPU, x 8 a node."""
    starts: list[int] = []  # the first rank's start: the second runs over the same steps

    def rank(prefix: str, at: int | None = None):  # type: ignore[no-untyped-def]
        body = loop(30, 4, period_ms=10, read_ms=1, samples=40, ckpt_every=10,
                    ckpt_bytes=8 << 20, ckpt_ms=40, prefix=prefix)

        def run(now: int) -> None:
            starts.append(now)
            body(now if at is None else at)
        return run

    doc = _advise(tmp_path, rank("/data/s"), scale_gpus=32, traced_gpus=2)
    s = doc["scale"]
    assert (s["gpus"], s["nodes"]) == (32, 4)
    step = doc["fit"]["steps"]["step_s"]
    per_gpu = 4 * SAMPLE / step / 2 / 1e6
    assert s["from_trace"]["per_gpu_MBps"]["data"] == pytest.approx(per_gpu, rel=1e-3)
    assert s["from_trace"]["per_node_MBps"]["data"] == pytest.approx(8 * per_gpu, rel=1e-3)
    writes_a_day = 3 * (8 << 20) / 30 / step / 2 * 86_400 * 8  # 3 saves over 30 steps
    assert s["from_trace"]["write_bytes_per_day_per_node"] == pytest.approx(writes_a_day,
                                                                            rel=1e-3)
    assert s["from_trace"]["dwpd"] == pytest.approx(writes_a_day / (8 * 3.84e12), rel=1e-3)
    # Two trace files are two traced GPUs by default: a second rank over the same steps, with
    # its own files (the same file twice is refused: it would count every figure twice).
    record_trace(tmp_path / "rank1.trace", rank("/data/r", starts[0]), True)
    two = advise([tmp_path / "run.trace", tmp_path / "rank1.trace"], scale_gpus=32)["scale"]
    assert two["traced_gpus"] == 2
    assert two["from_trace"]["per_gpu_MBps"]["data"] == pytest.approx(2 * per_gpu, rel=1e-3)
    preset = advise(tmp_path / "run.trace", model="llama3-8b")["scale"]
    assert preset["gpus"] == preset["model"]["gpus"] and preset["model_per_node_MBps"]


def test_traces_recorded_apart_are_not_spread_over_the_gap(tmp_path: Path) -> None:
    """Two runs traced 10 minutes apart: the rate and span are each file's, as the report
    counts them, not bytes over the 10 minutes between the files."""
    body = loop(30, 4, period_ms=10, read_ms=1, samples=40)
    record_trace(tmp_path / "a.trace", body, True)
    record_trace(tmp_path / "b.trace", lambda t0: body(t0 + 600 * 10**9), True)
    one = advise(tmp_path / "a.trace")["fit"]
    two = advise([tmp_path / "a.trace", tmp_path / "b.trace"])["fit"]
    assert two["groups"]["data"]["MBps_mean"] == pytest.approx(
        one["groups"]["data"]["MBps_mean"], rel=0.05)
    assert two["trace"]["span_s"] == pytest.approx(2 * one["trace"]["span_s"], rel=0.05)
    report = summarize([tmp_path / "a.trace", tmp_path / "b.trace"])
    assert two["trace"]["span_s"] == pytest.approx(report["trace"]["span_s"], abs=1e-6)


_TRAIN = """
import sys, time
import torch
from torch.utils.data import DataLoader
import lcache.trace
from lcache.data import CachedDataset, FileSource, SeedAwareSampler
ds = CachedDataset(FileSource(sys.argv[1]), sys.argv[2], capacity="4MiB")
sampler = SeedAwareSampler(ds, seed=0)
loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=0, collate_fn=list)
step = 0
for epoch in range(2):
    sampler.set_epoch(epoch)
    for batch in loader:
        t0 = lcache.trace.now_ns()
        time.sleep(0.005)  # the step's compute
        lcache.trace.record("step", "train", step, 0, "step", t0, lcache.trace.now_ns() - t0, 0)
        step += 1
ds.cache.close()
"""


def test_markers_with_reads_ahead_give_the_batch_and_compute(tmp_path: Path) -> None:
    """The finding (newcomer helper 55): a real CachedDataset loop (its prefetch thread reads
    the epoch ahead, outside the marked steps) had markers, yet the batch was the median
    reads between two markers, 0, so no batch: the workload said batch_size 1, a
    computation_time from the read bandwidth and "no steps in the trace" beside a fit of
    20 marked steps. The batch is the samples the run's reads (source reads, cache hits,
    some of two neighbouring records) handed its steps: 2 epochs of 40 in 20 steps of 4."""
    doc = _traced_run(tmp_path, _TRAIN, 40, 3000)
    s = doc["fit"]["steps"]
    assert s["source"] == "markers" and s["count"] == 20, s
    assert s["batch_samples"] == 4 and s["compute_s"] >= 0.005, s
    w = doc["workload"]
    assert w["doc"]["reader"]["batch_size"] == 4
    assert w["doc"]["train"]["computation_time"] == s["compute_s"]
    assert not any("no steps" in n for n in w["notes"]), w["notes"]
    assert doc["fit"]["unfitted"] == []
    # The readers' arithmetic names the bytes a step takes from the source, not "a batch"
    # (epoch 2 hit the cache: a batch of 4 samples is more than that)
    (readers,) = [a for a in doc["advice"] if a["topic"].startswith("reader")]
    per_step = doc["fit"]["groups"]["data"]["read_bytes"] / 20 / 1e6
    assert f"a step reads {per_step:,.3f} MB from the data source" in readers["arithmetic"]
    # epoch 2 hit the cache: train.epochs (source reads) is 1, and the YAML says why
    # (attack helper 60: it said epochs: 1 of a 2-epoch run, silently)
    assert doc["fit"]["dataset"]["epochs_read"] == 2.0
    assert w["doc"]["train"]["epochs"] == 1
    assert ("# note: train.epochs 1 counts the source reads only: cache hits were left out "
            "of the epochs, and the traced run read 2 epochs") in w["yaml"]


_WORKERS = """
import sys, time
from torch.utils.data import DataLoader
import lcache.trace
from lcache.data import CachedDataset, FileSource, SeedAwareSampler
from lcache.demo import FixedOrder, RemoteDataset
data, cache, persistent, uncached_first = sys.argv[1:5]
source = FileSource(data)
step = 0
def train(dataset, sampler):
    global step
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=2,
                        persistent_workers=persistent == "1", collate_fn=list)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for batch in loader:
            t0 = lcache.trace.now_ns()
            time.sleep(0.002)  # the step's compute
            lcache.trace.record("step", "train", step, 0, "step", t0,
                                lcache.trace.now_ns() - t0, 0)
            step += 1
    del loader  # persistent workers end here, and flush their trace events
ds = CachedDataset(source, cache, capacity="100MiB")
if uncached_first == "1":  # as lcache demo: the same samples without a cache, then through it
    train(RemoteDataset(source), FixedOrder(len(ds), 0))
train(ds, SeedAwareSampler(ds, seed=0))
ds.cache.close()
"""


def _traced_run(tmp_path: Path, script: str, samples: int, size: int,
                *args: str) -> dict:  # type: ignore[type-arg]
    """advise's document of ``script`` (args: data dir, cache dir, ``args``) run traced over
    ``samples`` files of ``size`` bytes."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(samples):
        (data / f"{i:03d}.bin").write_bytes(bytes([i]) * size)
    trace = tmp_path / "train.trace"
    env = {**subprocess_env(), "LCACHE_TRACE": str(trace)}
    subprocess.run([sys.executable, "-c", script, str(data), str(tmp_path / "cache"), *args],
                   check=True, env=env, timeout=120)
    return advise(trace)


def _train_with_workers(tmp_path: Path, persistent: bool, uncached_first: bool = False,
                        ) -> dict:  # type: ignore[type-arg]
    return _traced_run(tmp_path, _WORKERS, 128, 4096, str(int(persistent)),
                       str(int(uncached_first)))


@pytest.mark.parametrize("persistent", [False, True])
def test_cached_dataloader_job_is_one_run(tmp_path: Path, persistent: bool) -> None:
    """The finding (attack helper 60, item D): a cached DataLoader job was split into runs:
    its main process's prefetcher reads the epoch ahead before the workers start (a run with
    no markers, fitted with no batch), and its later epochs read the cache, not the source
    (3 runs that read differently; the last fitted, a workload that read nothing). The
    workers are the main process's children (their ppid): one job, one run, which reads the
    dataset once from the source and hits the cache after: 128 samples, 48 steps of 8 over 3
    epochs."""
    doc = _train_with_workers(tmp_path, persistent)
    assert doc["fit"]["runs"]["count"] == 1, doc["fit"]["runs"]
    assert not any(u["what"] == "one run" for u in doc["unfitted"]), doc["unfitted"]
    s = doc["fit"]["steps"]
    assert s["source"] == "markers" and s["count"] == 48 and s["batch_samples"] == 8, s
    ds = doc["fit"]["dataset"]
    assert ds["samples"] == 128 and ds["source_reads"] == 128, ds
    assert ds["epochs_read"] == 3.0, ds
    assert doc["workload"]["doc"]["reader"]["batch_size"] == 8


def test_one_process_uncached_then_cached_is_two_runs(tmp_path: Path) -> None:
    """A job that starts over (as ``lcache demo``: the samples without a cache, then the same
    samples through lcache, from one process) is two runs, though one job's."""
    doc = _train_with_workers(tmp_path, True, uncached_first=True)
    runs = doc["fit"]["runs"]
    assert runs["count"] == 2 and runs["fitted"] == 2, runs
    assert doc["fit"]["steps"]["count"] == 48 and doc["fit"]["steps"]["batch_samples"] == 8


def _driver(tmp_path: Path, script: str, trainings: list[list[str]]
            ) -> dict:  # type: ignore[type-arg]
    """advise's document of a traced driver that runs ``script`` with each argument list of
    ``trainings``, one after the other (lcache imported: their common ancestor)."""
    driver = ("import subprocess, sys\n"
              "import lcache\n"
              f"for args in {trainings!r}:\n"
              f"    subprocess.run([sys.executable, '-c', {script!r}, *args], check=True)\n")
    trace = tmp_path / "drv.trace"
    env = {**subprocess_env(), "LCACHE_TRACE": str(trace)}
    subprocess.run([sys.executable, "-c", driver], check=True, env=env, timeout=180)
    return advise(trace)


def test_two_trainings_of_one_traced_driver_are_two_runs(tmp_path: Path) -> None:
    """The finding (attack helper 65): a traced Python driver that ran two trainings one
    after the other (other data, other caches) made them one job, and so one run: 44 steps
    of batch 5 over 96 samples of mixed sizes. One job's groups are one run only when the
    later one goes on with files the run used."""
    for name, n in (("data", 128), ("data2", 64)):
        (tmp_path / name).mkdir()
        for i in range(n):
            (tmp_path / name / f"{i:03d}.bin").write_bytes(bytes([i]) * 4096)
    doc = _driver(tmp_path, _WORKERS, [[str(tmp_path / data), str(tmp_path / cache), "1", "0"]
                                       for data, cache in (("data", "cA"), ("data2", "cB"))])
    runs = doc["fit"]["runs"]
    assert runs["count"] == 2 and runs["fitted"] == 1, runs
    s, ds = doc["fit"]["steps"], doc["fit"]["dataset"]
    assert (s["count"], s["batch_samples"], ds["samples"]) == (48, 8, 128), (s, ds)


_SUBSET = """
import sys, time
from torch.utils.data import DataLoader, Subset
import lcache.trace
from lcache.data import CachedDataset, FileSource
data, cache, lo, hi = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ds = CachedDataset(FileSource(data), cache, capacity="100MiB")
loader = DataLoader(Subset(ds, range(lo, hi)), batch_size=8, num_workers=0, collate_fn=list)
step = 0
for epoch in range(3):
    for batch in loader:
        t0 = lcache.trace.now_ns(); time.sleep(0.002)
        lcache.trace.record("step", "train", step, 0, "step", t0, lcache.trace.now_ns() - t0, 0)
        step += 1
ds.close()
"""


def test_two_trainings_over_one_folder_are_two_runs(tmp_path: Path) -> None:
    """Attack round 22: a driver's two trainings over other samples of one folder, with other
    caches, became one run once groups were joined by any folder they shared (552fc2b)."""
    (tmp_path / "data").mkdir()
    for i in range(128):
        (tmp_path / "data" / f"{i:03d}.bin").write_bytes(bytes([i]) * 4096)
    runs = _driver(tmp_path, _SUBSET, [[str(tmp_path / "data"), str(tmp_path / cache), lo, hi]
                                       for cache, lo, hi in (("cA", "0", "64"),
                                                             ("cB", "64", "128"))])["fit"]["runs"]
    assert runs["count"] == 2, runs


_MISSING = "no-such.trace"  # arguments are checked before the trace is read


@pytest.mark.parametrize(("call", "named"), [
    (lambda: advise(5), "paths=5"),  # type: ignore[arg-type]
    (lambda: advise([_MISSING, None]), "paths="),  # type: ignore[list-item]
    (lambda: advise(_MISSING, {"hit_ratio": 0.5}), "targets="),  # type: ignore[arg-type]
    (lambda: Targets(hit_ratio="x"), "hit_ratio='x'"),  # type: ignore[arg-type]
    (lambda: Targets(hit_ratio=math.nan), "hit_ratio=nan"),
    (lambda: Targets(max_stall=1.5), "max_stall=1.5"),
    (lambda: Targets(ssd_capacity_bytes=0), "ssd_capacity_bytes=0"),
    (lambda: Targets(ssds=2.5), "ssds=2.5"),  # type: ignore[arg-type]
    (lambda: advise(_MISSING, scale_gpus="8"), "scale_gpus='8'"),  # type: ignore[arg-type]
    (lambda: advise(_MISSING, gpus_per_node=0), "gpus_per_node=0"),
    (lambda: advise(_MISSING, traced_gpus=True), "traced_gpus=True"),
    (lambda: advise(_MISSING, model=5), "model=5"),  # type: ignore[arg-type]
    (lambda: advise(_MISSING, check_epochs="1"), "check_epochs='1'"),  # type: ignore[arg-type]
    (lambda: advise(_MISSING, html_path=""), "html_path=''"),
    (lambda: advise(_MISSING, show_progress="no"), "show_progress='no'"),  # type: ignore[arg-type]
])
def test_api_arguments_of_the_wrong_kind_are_named(call, named: str) -> None:  # type: ignore[no-untyped-def]
    """The finding (attack helper 87): advise(5) raised "'int' object is not iterable",
    advise(tr, {"hit_ratio": .5}) an AttributeError, Targets(hit_ratio="x") and
    scale_gpus="8" a TypeError deep in the arithmetic. Each is a ConfigError naming it."""
    with pytest.raises(ConfigError, match="^" + re.escape(named)):
        call()
