"""Optimizer-state offload side by side: lcache, AdamW in memory, a naive torch.save/torch.load
swap every step, and DeepSpeed ZeRO-3 NVMe offload on CPU (issue 12, "Benchmark").
``lcache-overlapped`` is lcache through ``step_with_backward``: its updates run under backward.

    python benchmarks/offload_bench.py --json [--params 50M] [--steps 5] [--dir /var/tmp/x]

Every system trains the same fp32 model (a stack of square Linear layers) for the same steps,
each in its own process, and prints a row ``{system, params, step_s, io_floor_s, read_bytes,
write_bytes, peak_rss_bytes}``: step_s is the median full step (forward, backward, optimizer)
after one warm-up step; io_floor_s is the row's bytes moved per step over fio's sequential read
and write bandwidth, measured in the same run on the same directory; peak_rss_bytes is the
process's VmHWM. DeepSpeed runs in a benchmark environment outside the repo, made by this
script (``--ds-venv``, default /var/tmp/lcache-offload-venv: torch==2.13.0 CPU and
deepspeed==0.19.8, with Debian's libaio-dev for its aio op); if it cannot be made the script
stops with exit status 2. Figures are noisy on a shared machine: re-run before quoting them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]
DS_VENV = "/var/tmp/lcache-offload-venv"
DS_PINS = ["torch==2.13.0", "deepspeed==0.19.8"]
SYSTEMS = ["lcache", "lcache-overlapped", "in-memory", "naive-swap", "deepspeed"]
WIDTH = 2048  # a layer holds WIDTH**2 + WIDTH parameters


def parse_count(text: str) -> int:
    """50M -> 50_000_000 (K, M, G: powers of 1000)."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


# --- the children: one system each, one JSON row on stdout ---------------------------------
def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def make_model(params: int) -> Any:
    import torch

    torch.manual_seed(0)
    layers = max(1, round(params / (WIDTH * WIDTH + WIDTH)))
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def timed_steps(model: Any, step: Any, args: argparse.Namespace) -> list[float]:
    """Each full step's time: forward, then ``step(loss)`` (backward and the optimizer)."""
    import torch

    x = torch.randn(args.batch, WIDTH)
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        step(model(x).square().mean())
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first step makes the state


def child_lcache(model: Any, args: argparse.Namespace, overlapped: bool = False
                 ) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(REPO / "src"))
    from lcache.offload import OffloadedOptimizer

    opt = OffloadedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3,
                             dir=os.path.join(args.dir, "lcache"), host_budget=args.budget)

    def step(loss: Any) -> None:
        if overlapped:
            opt.step_with_backward(loss)
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    r0, w0 = opt.read_bytes, opt.write_bytes
    times = timed_steps(model, step, args)
    moved = (opt.read_bytes - r0) / (args.steps + 1), (opt.write_bytes - w0) / (args.steps + 1)
    opt.close()
    return {"step_times": times, "read_bytes": int(moved[0]), "write_bytes": int(moved[1])}


def child_in_memory(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step(loss: Any) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"step_times": timed_steps(model, step, args), "read_bytes": 0,
            "write_bytes": 0}


def child_naive(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    path = os.path.join(args.dir, "naive-state.pt")
    sizes = [0]

    def step(loss: Any) -> None:
        loss.backward()
        if os.path.exists(path):
            opt.load_state_dict(torch.load(path))
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.save(opt.state_dict(), path)
        opt.state.clear()  # the state lives on disk between steps
        fd = os.open(path, os.O_RDONLY)
        try:  # on the disk, not in the page cache: a swap, not a copy in RAM
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            sizes[0] = os.fstat(fd).st_size
        finally:
            os.close(fd)

    times = timed_steps(model, step, args)
    return {"step_times": times, "read_bytes": sizes[0], "write_bytes": sizes[0]}


def child_deepspeed(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    import deepspeed
    import torch

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.port), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    deepspeed.init_distributed(dist_backend="gloo")
    swap = os.path.join(args.dir, "deepspeed")
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3, "sub_group_size": 100_000_000,
            # buffer_count 8: the default 4 crashed with pipelining here (issue 12)
            "offload_optimizer": {"device": "nvme", "nvme_path": swap, "pipeline_read": True,
                                  "pipeline_write": True, "buffer_count": 8}},
        "aio": {"block_size": 1 << 20, "queue_depth": 16, "thread_count": 2,
                "single_submit": False, "overlap_events": True},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    x = torch.randn(args.batch, WIDTH)
    times = []
    engine.backward(engine(x).square().mean())
    engine.step()  # the warm-up step, outside the byte counts
    r0, w0 = _proc_io()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.backward(engine(x).square().mean())
        engine.step()
        times.append(time.perf_counter() - t0)
    r1, w1 = _proc_io()
    return {"step_times": times, "read_bytes": (r1 - r0) // args.steps,
            "write_bytes": (w1 - w0) // args.steps}


def _proc_io() -> tuple[int, int]:
    """This process's storage-layer (read, write) bytes: DeepSpeed keeps no counters of its
    swap I/O, and its aio is O_DIRECT, so these are its swap bytes."""
    got = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(got["read_bytes"]), int(got["write_bytes"])


CHILDREN = {"lcache": child_lcache,
            "lcache-overlapped": lambda m, a: child_lcache(m, a, overlapped=True),
            "in-memory": child_in_memory, "naive-swap": child_naive,
            "deepspeed": child_deepspeed}


def run_child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    model = make_model(args.params)
    row = CHILDREN[args.child](model, args)
    # ZeRO-3 partitions the parameters in place: ds_numel is a parameter's full size
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    print(json.dumps({"system": args.child, "params": n, **row, "peak_rss_bytes": peak_rss()}))


# --- the parent ----------------------------------------------------------------------------
def ensure_ds_venv(venv: str) -> str:
    """The benchmark environment's python, made if missing; exits 2 if it cannot be."""
    python = os.path.join(venv, "bin", "python")
    check = [python, "-c", "import deepspeed, torch; from deepspeed.ops.op_builder import "
             "AsyncIOBuilder as B; assert B().is_compatible()"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    if os.path.exists(python) and subprocess.run(check, env=env, capture_output=True,
                                                 check=False).returncode == 0:
        return python
    steps = [["apt-get", "install", "-y", "libaio-dev"],
             [sys.executable, "-m", "venv", venv],
             [os.path.join(venv, "bin", "pip"), "install", *DS_PINS],
             check]
    for cmd in steps:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"offload_bench: cannot set up DeepSpeed in {venv}: {' '.join(cmd)} "
                     f"failed: {done.stderr.strip()[-300:]}")
    return python


def fio_floor(directory: str, nbytes: int) -> tuple[float, float]:
    """fio's sequential (read, write) MB/s on ``directory``, O_DIRECT, 4 MiB, depth 16: the
    faster of its default buffers and buffers in huge pages (root)."""
    import _sysbench as sb

    sb.ensure_fio("offload_bench")
    path = os.path.join(directory, "fio-floor.dat")
    common = [f"--filename={path}", f"--size={nbytes}", "--ioengine=libaio", "--direct=1",
              "--bs=4M", "--iodepth=16"]
    write_args = [*common, "--name=seqwrite", "--rw=write", "--end_fsync=1"]
    read_args = [*common, "--name=seqread", "--rw=read"]
    buffers = (4 << 20) * 16
    try:  # the faster of fio's default buffers and buffers in huge pages, as lcache's are
        write = max(sb._job_bw(sb._run_fio(write_args, 300), "write"),
                    sb._job_bw(sb.fio_huge(write_args, 300, buffers), "write"))
        read = max(sb._job_bw(sb._run_fio(read_args, 300), "read"),
                   sb._job_bw(sb.fio_huge(read_args, 300, buffers), "read"))
    finally:
        Path(path).unlink(missing_ok=True)
    return read, write


def run_system(system: str, args: argparse.Namespace, ds_python: str | None) -> dict[str, Any]:
    python = ds_python if system == "deepspeed" else sys.executable
    cmd = [python or sys.executable, __file__, "--child", system, "--params", str(args.params),
           "--steps", str(args.steps), "--dir", args.dir, "--budget", args.budget,
           "--batch", str(args.batch),
           "--port", str(args.port)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO / "src")}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"system": system, "error": f"timed out after {args.timeout} s"}
    finally:
        for leftover in ("lcache", "deepspeed", "naive-state.pt"):
            target = os.path.join(args.dir, leftover)
            shutil.rmtree(target, ignore_errors=True) if os.path.isdir(target) else \
                Path(target).unlink(missing_ok=True)
    if done.returncode != 0:
        return {"system": system, "error": done.stderr.strip()[-500:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=parse_count, default=parse_count("50M"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8,
                    help="rows a step computes: more make forward and backward longer")
    # 50M parameters hold 604 MB of optimizer state: about 4.7x this budget, so the state
    # streams (the memory test asks for at least 3x)
    ap.add_argument("--budget", default="128MB", help="lcache's host_budget")
    ap.add_argument("--dir", default=None, help="where swap files go (default: a temp dir)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--ds-venv", default=DS_VENV)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_child(args)
        return
    systems = args.systems.split(",")
    ds_python = ensure_ds_venv(args.ds_venv) if "deepspeed" in systems else None
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="lcache-offload-bench-", dir="/var/tmp")
    try:
        try:
            read_mbps, write_mbps = fio_floor(args.dir, 1 << 30)
        except RuntimeError as exc:  # fio failed, or no hugetlb pages (not root)
            sys.exit(f"offload_bench: {exc}")
        rows = []
        for system in systems:
            row = run_system(system, args, ds_python)
            times = row.pop("step_times", None)
            if times:
                row["step_s"] = statistics.median(times)
                row["io_floor_s"] = (row["read_bytes"] / (read_mbps * 1e6)
                                     + row["write_bytes"] / (write_mbps * 1e6))
            row.update(fio_read_mbps=read_mbps, fio_write_mbps=write_mbps)
            rows.append(row)
            print(json.dumps(row) if args.json else row, flush=True)
    finally:
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
