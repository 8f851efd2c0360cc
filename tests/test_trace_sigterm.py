"""Traced processes ended by SIGTERM (``with Pool(...)`` leaving: terminate()) flush their
events; the ``recorder`` start and end markers show which processes may have lost some."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from lcache.report.load import json_lines, load


def _run(tmp_path: Path, code: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    trace = tmp_path / "t.trace"
    env = dict(os.environ, LCACHE_TRACE=str(trace),
               LCACHE_TRACE_FLUSH_S="3600")  # no background flush: only the end flushes
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(code))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "data.bin")], env=env,
                         capture_output=True, text=True, timeout=120)
    return out, [json.loads(line) for line in json_lines(str(trace))]


def _reads(events: list[dict]) -> list[dict]:
    return [e for e in events if e["ph"] == "X" and e["cat"] == "cache-read"]


def _markers(events: list[dict]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for e in events:
        if e.get("name") == "recorder":
            out.setdefault(e["pid"], []).append(
                e["args"]["state"] + ("/" + e["args"]["how"] if "how" in e["args"] else ""))
    return out


READS = """
import os, sys
import lcache  # honours LCACHE_TRACE
from lcache.io import open_file, pread_full
from lcache.io.files import close_file

def reads(n):
    fd = open_file(sys.argv[1], os.O_RDONLY)
    buf = memoryview(bytearray(4096))
    for i in range(n):
        pread_full(fd, i * 4096, buf, "cache-read")
    close_file(fd)
    return n

with open(sys.argv[1], "wb") as f:
    f.write(bytes(1 << 20))
"""


def test_pool_workers_ended_by_terminate_flush_their_events(tmp_path: Path) -> None:
    # Leaving the `with` block calls terminate(): SIGTERM to the workers. Each one sleeps
    # after its reads, so none can leave through its clean exit path first (a race otherwise).
    out, events = _run(tmp_path, READS + """
import multiprocessing as mp, time
ctx = mp.get_context("fork")
both = ctx.Barrier(2)  # one task per worker
done = ctx.Semaphore(0)

def work(n):
    both.wait(60)
    reads(n)
    done.release()
    time.sleep(60)

if __name__ == "__main__":
    with ctx.Pool(2) as pool:
        pool.map_async(work, [100, 100], chunksize=1)
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
""")
    assert out.returncode == 0, out.stderr
    reads_ = _reads(events)
    assert len(reads_) == 200 and sum(e["args"]["ret"] for e in reads_) == 819_200
    # every process that recorded wrote its end marker: nothing may be missing
    markers = _markers(events)
    assert len(markers) == 3
    assert all(m[0] == "start" and m[-1].startswith("end/") for m in markers.values())


def test_spawn_pool_workers_ended_by_terminate_flush_their_events(tmp_path: Path) -> None:
    """Attack helper 60: a spawn child imports lcache while it loads its main module, and
    its bootstrap runs no after-fork hook, so it had neither the Finalize nor the SIGTERM
    handler: 800 reads of ``with spawn Pool`` were lost, and report refused the trace."""
    out, events = _run(tmp_path, READS + """
import multiprocessing as mp, time

def init(b, d):
    global both, done
    both, done = b, d

def work(n):
    both.wait(60)  # one task per worker
    reads(n)
    done.release()
    time.sleep(60)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    b, d = ctx.Barrier(2), ctx.Semaphore(0)
    with ctx.Pool(2, initializer=init, initargs=(b, d)) as pool:
        pool.map_async(work, [100, 100], chunksize=1)
        assert d.acquire(timeout=60) and d.acquire(timeout=60)
""")
    assert out.returncode == 0, out.stderr
    reads_ = _reads(events)
    assert len(reads_) == 200 and len({e["pid"] for e in reads_}) == 2
    markers = _markers(events)
    assert len(markers) == 3
    assert all(m[0] == "start" and m[-1].startswith("end/") for m in markers.values())


CHILD = """
import multiprocessing as mp, signal, time
ctx = mp.get_context("fork")

def child(handler):
    if handler == "after":  # the program's own, set in the worker: ours does not override it
        signal.signal(signal.SIGTERM, lambda *_: (print("later", flush=True), sys.exit(4)))
    reads(10)
    os.kill(os.getpid(), signal.SIGTERM)
    if handler == "before":  # its handler returned: the worker goes on, unflagged so far
        reads(5)
        sys.exit(5)
    raise SystemExit("survived SIGTERM")

if __name__ == "__main__":
    if sys.argv[2] == "before":
        signal.signal(signal.SIGTERM, lambda *_: print("mine", flush=True))
    p = ctx.Process(target=child, args=(sys.argv[2],))
    p.start()
    p.join(60)
    print(p.exitcode)
"""


def _run_child(tmp_path: Path, handler: str) -> tuple[str, list[dict]]:
    trace = tmp_path / f"{handler}.trace"
    env = dict(os.environ, LCACHE_TRACE=str(trace), LCACHE_TRACE_FLUSH_S="3600")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(READS + CHILD))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "data.bin"), handler],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout, [json.loads(line) for line in json_lines(str(trace))]


def test_a_multiprocessing_child_flushes_on_sigterm_and_a_programs_handler_still_runs(
        tmp_path: Path) -> None:
    # default action: the flush, then death by SIGTERM, as untraced
    stdout, events = _run_child(tmp_path, "none")
    assert stdout == f"{-signal.SIGTERM}\n" and len(_reads(events)) == 10
    assert sorted(_markers(events).values()) == [["start", "end/exit"],
                                                 ["start", "end/sigterm"]]
    # a handler the parent installed before: called after the flush; the worker goes on, and
    # its later events are written by its own exit, with no early end marker
    stdout, events = _run_child(tmp_path, "before")
    assert stdout == "mine\n5\n" and len(_reads(events)) == 15
    assert sorted(_markers(events).values()) == [["start", "end/exit"]] * 2
    # one the worker installs itself is not overridden; its sys.exit flushes
    stdout, events = _run_child(tmp_path, "after")
    assert stdout == "later\n4\n" and len(_reads(events)) == 10


def test_sigterm_of_a_main_process_keeps_its_default_action(tmp_path: Path) -> None:
    """The finding: with a Python handler in every traced process, a job ended by SIGTERM
    while it waited in a C call (os.system, a collective) died only when that call returned
    (8 s instead of 0.4 s). The main process keeps SIGTERM's default action; its last
    events may be lost, and its start marker without an end says so."""
    out, events = _run(tmp_path, READS + """
import signal, time
reads(10)
signal.setitimer(signal.ITIMER_REAL, 0.3)
signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
os.system("sleep 8")
raise SystemExit("survived SIGTERM")
""")
    assert out.returncode == -signal.SIGTERM
    assert list(_markers(events).values()) == [["start"]]


def test_a_process_killed_outright_has_a_start_and_no_end(tmp_path: Path) -> None:
    out, events = _run(tmp_path, READS + """
reads(10)
os.kill(os.getpid(), __import__("signal").SIGKILL)
""")
    assert out.returncode == -signal.SIGKILL
    assert _reads(events) == []  # lost, and the markers say so
    assert list(_markers(events).values()) == [["start"]]
    # a trace of nothing but that start marker is read, with the note, not refused
    trace = load(str(tmp_path / "t.trace"))
    assert len(trace) == 0 and [pid for _, pid in trace.unfinished] == list(_markers(events))


def test_sigterm_during_a_childs_own_flush_waits_for_it(tmp_path: Path) -> None:
    """The finding (helper 61): a Pool worker ended while its main thread was flushing (its
    exit flush) lost those events: the handler could not take the flush's lock, so it wrote
    nothing and the process died. Here all 300,000 were lost; the flush now finishes, then
    the process ends by SIGTERM with its end marker."""
    code = """
import os, sys, threading, time, signal, multiprocessing as mp
from lcache import trace

def child(n):
    t0 = time.perf_counter_ns()
    for i in range(n):
        trace.record("read", "/x/data.bin", i * 4096, 4096, "cache-read", t0, 1000, 4096)
    started = threading.Event()

    def killer():
        started.wait()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=killer, daemon=True).start()
    started.set()
    trace.flush()  # the handler runs while this flush holds its lock
    time.sleep(30)

if __name__ == "__main__":
    p = mp.get_context("fork").Process(target=child, args=(300_000,))
    p.start()
    p.join(60)
    print(p.exitcode)
"""
    out, events = _run(tmp_path, code)
    assert out.stdout == f"{-signal.SIGTERM}\n", out.stderr
    assert len(_reads(events)) == 300_000
    assert sorted(_markers(events).values()) == [["start", "end/exit"],
                                                 ["start", "end/sigterm"]]


def test_persistent_dataloader_workers_alive_at_exit_flush_their_events(
        tmp_path: Path) -> None:
    """The finding (helpers 57 and 63): a loader with persistent workers still alive when the
    program ended lost its workers' events. multiprocessing's exit sends them SIGTERM, and
    torch's worker handler (installed in C after ours) ends a worker with _exit(0) when its
    parent sends it: no flush. lcache's dataset now puts the flush back in the worker."""
    out, events = _run(tmp_path, PERSISTENT + """
train(os.path.dirname(sys.argv[1]))
print("done")
""")
    assert out.returncode == 0 and out.stdout == "done\n", out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    markers = _markers(events)
    assert len(markers) == 3 and all(m == ["start", "end/exit"] or m == ["start", "end/sigterm"]
                                     for m in markers.values()), markers
    main = next(p for p, m in markers.items() if m == ["start", "end/exit"])
    workers = {e["pid"] for e in events if e.get("ph") == "X" and e["pid"] != main}
    assert len(workers) == 2  # both workers' reads are there


def test_a_multiprocessing_child_ends_its_persistent_loader_as_torch_does(
        tmp_path: Path) -> None:
    """The finding (attack helper 66) on d787066: the exit mark was an atexit hook, which a
    multiprocessing child never runs: a child whose loader was alive at its end had its
    workers die of its exit SIGTERM, its loader raised, it exited 1 and lost its events.
    (And lcache imported before multiprocessing made the main process's hook run too late:
    PERSISTENT imports lcache first.)"""
    out, events = _run(tmp_path, PERSISTENT + """
import multiprocessing as mp

def child(root):
    train(root)
    print("child done", flush=True)

if __name__ == "__main__":
    p = mp.get_context("fork").Process(target=child, args=(os.path.dirname(sys.argv[1]),))
    p.start()
    p.join()
    print("child exit", p.exitcode)
""")
    assert out.stdout == "child done\nchild exit 0\n", out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    markers = _markers(events)  # the main process, the child, its two workers
    assert len(markers) == 4 and all(m[-1].startswith("end/") for m in markers.values()), \
        markers


PERSISTENT = """
import lcache  # first: before torch and multiprocessing, as a program may import it
import os, sys
from torch.utils.data import DataLoader
from lcache.data import CachedDataset

LOADERS = []

def train(folder):
    root = os.path.join(folder, "src")
    os.makedirs(root, exist_ok=True)
    for i in range(40):
        with open(os.path.join(root, f"{i:03d}.bin"), "wb") as f:
            f.write(bytes([i]) * 4096)
    ds = CachedDataset(root, os.path.join(folder, f"cache{os.getpid()}"), "16MiB")
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True,
                        collate_fn=list)
    for epoch in range(2):
        assert sorted(b[0] for batch in loader for b in batch) == list(range(40))
    LOADERS.append(loader)  # alive when the process ends
"""


def test_lcaches_threads_leave_sigterm_to_the_programs(tmp_path: Path) -> None:
    """The finding (attack helper 64): a traced Pool worker sometimes outlived
    Pool.terminate(), which then waited for ever (3 of 41 runs): the SIGTERM went to the
    trace's flush thread, while the Python handler runs only in the main thread, blocked in
    a C wait on the queue's lock. lcache's own threads block SIGTERM, so the kernel gives it
    to the program's."""
    out, _ = _run(tmp_path, READS + """
import threading
from lcache.io import default_engine
from lcache.trace import recorder

recorder.flush()
fd = os.open(sys.argv[1], os.O_RDONLY)
default_engine().submit_read(fd, 0, memoryview(bytearray(4096))).wait()
ours = [t for t in threading.enumerate() if t.name.startswith("lcache-trace-flush")]
io = [t for t in threading.enumerate() if t.name.startswith("lcache-io-")]

def blocks_sigterm(tid):
    with open(f"/proc/self/task/{tid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk"))
    return bool(mask >> (15 - 1) & 1)

# the I/O engine's threads run on_done callbacks: a process started there keeps SIGTERM
print(len(ours) == 1 and len(io) > 0, all(blocks_sigterm(t.native_id) for t in ours),
      any(blocks_sigterm(t.native_id) for t in [*io, threading.main_thread()]))
""")
    assert out.stdout == "True True False\n", out.stderr


def test_a_dataloader_worker_keeps_torchs_answers_to_sigterm(tmp_path: Path) -> None:
    """The findings (attack helper 65) on 3969515: with tracing on, a SIGTERM handler that
    the program's worker_init_fn installed was replaced, and a worker killed by someone other
    than its parent exited 0: the loader said only "exited unexpectedly", 6 s later. Torch's
    own answers are kept: the program's handler runs (here: exit code 3), and a foreign
    SIGTERM kills the worker (the loader says so at once)."""
    code = """
import os, signal, sys, time
from torch.utils.data import DataLoader
from lcache.data import CachedDataset

def own(_):
    signal.signal(signal.SIGTERM, lambda *a: os._exit(3))

root = os.path.join(os.path.dirname(sys.argv[1]), "src")
os.makedirs(root, exist_ok=True)
for i in range(64):
    with open(os.path.join(root, f"{i:03d}.bin"), "wb") as f:
        f.write(bytes([i]) * 4096)
for init in (own, None):
    ds = CachedDataset(root, os.path.join(os.path.dirname(sys.argv[1]), f"c{init is None}"),
                       "16MiB")
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True,
                        collate_fn=list, worker_init_fn=init)
    it = iter(loader)
    next(it)
    os.kill(it._workers[0].pid, signal.SIGTERM)  # not its parent's: another process's
    try:  # torch's SIGCHLD handler raises in the main thread, while it sleeps or reads
        time.sleep(1)
        for _ in it:
            pass
    except RuntimeError as exc:
        print(str(exc).split(".")[0])
    del it, loader
"""
    out, _ = _run(tmp_path, code)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stderr
    assert "exited unexpectedly with exit code 3" in lines[0], lines
    assert "is killed by signal: Terminated" in lines[1], lines
