"""`lcache trace`: exit codes, the known-answer trace, /proc sampling, --syscalls."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lcache.report import summarize
from lcache.report.load import Trace, json_lines, load

from .conftest import assert_one_line_error

HERE = Path(__file__).parent
LCACHE = [sys.executable, "-m", "lcache"]


def _trace(out: Path, *cmd: str, opts: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LCACHE_TRACE"}
    return subprocess.run([*LCACHE, "trace", "-o", str(out), *opts, "--", *cmd], env=env,
                          capture_output=True, text=True, timeout=120)


def test_exit_codes_like_a_shell(tmp_path: Path) -> None:
    t = tmp_path / "t.trace"
    assert _trace(t, "sh", "-c", "exit 3").returncode == 3
    assert _trace(t, "sh", "-c", "kill -9 $$").returncode == 128 + 9
    missing = _trace(t, "no-such-command-lcache")
    assert missing.returncode == 127
    assert "no-such-command-lcache: command not found" in missing.stderr
    script = tmp_path / "not-executable.sh"
    script.write_text("echo hi\n")
    assert _trace(t, str(script)).returncode == 126
    bad = _trace(Path("/proc/no-such-dir/t.trace"), "true")
    # said as every lcache command says bad input (it began "lcache trace: "; helper 98)
    assert_one_line_error(bad, "cannot write the trace")


def test_known_answer(tmp_path: Path) -> None:
    """100 x 1 MiB sequential writes then 4 KiB reads at 1,000 random offsets: exact figures."""
    t = tmp_path / "known.trace"
    run = _trace(t, sys.executable, str(HERE / "_trace_known.py"), str(tmp_path / "data.bin"),
                 "7", opts=("--interval", "0.05"))
    assert run.returncode == 0, run.stderr
    offsets = json.loads(run.stdout)
    # a read is sequential when it starts at the end of one of the 32 most recent streams
    seq_reads, ends = 0, []
    for off in offsets:
        if off in ends:
            seq_reads += 1
            ends.remove(off)
        ends = [*ends, off + 4096][-32:]
    s = summarize(t)
    mib = 1 << 20
    w, r, total = s["classes"]["checkpoint"], s["classes"]["cache-read"], s["total"]
    assert set(s["classes"]) == {"checkpoint", "cache-read"}
    assert (w["ops"], w["write_ops"], w["read_ops"]) == (100, 100, 0)
    assert (w["bytes"], w["write_bytes"], w["read_bytes"]) == (100 * mib, 100 * mib, 0)
    assert (w["size_p50"], w["size_p99"], w["seq_fraction"]) == (mib, mib, 0.99)
    assert (r["ops"], r["read_ops"], r["bytes"], r["read_bytes"]) == (1000, 1000, 4096000,
                                                                       4096000)
    assert (r["size_p50"], r["size_p99"]) == (4096, 4096)
    assert r["seq_fraction"] == seq_reads / 1000
    assert (total["ops"], total["bytes"]) == (1100, 100 * mib + 4096000)
    assert (total["size_p50"], total["size_p99"]) == (4096, mib)
    assert total["seq_fraction"] == (99 + seq_reads) / 1100
    for c in (w, r):
        assert c["MBps_peak"] >= c["MBps_mean"] > 0 and c["lat_p99_us"] >= c["lat_p50_us"] > 0
    assert s["top_files"][0]["file"] == str(tmp_path / "data.bin")
    # The sampler saw the Python process write the 100 MiB (wchar counts write() bytes).
    assert any(p["wchar"] >= 100 * mib for p in s["processes"].values())
    # The recorder wrote binary blocks; --jsonl turns them into Chrome trace events, one per
    # line, and that form (what traces were before) gives the same figures.
    assert b"\0LCB" in t.read_bytes()
    lines = tmp_path / "known.jsonl"
    out = subprocess.run([*LCACHE, "report", str(t), "-o", str(tmp_path / "r.html"),
                          "--jsonl", str(lines)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in lines.read_text().splitlines()]
    io = [e for e in events if e["ph"] == "X"]
    assert len(io) == 1100 and [e["args"]["off"] for e in io[100:]] == offsets
    again = summarize(lines)
    assert again["classes"] == s["classes"] and again["total"] == s["total"]


def test_sampling_a_non_python_process_tree(tmp_path: Path) -> None:
    t = tmp_path / "sh.trace"
    data = tmp_path / "x"
    # A shell whose child writes 8 MiB in 1 MiB pieces with pauses, so samples see it grow.
    cmd = (f"for i in 1 2 3 4 5 6 7 8; do head -c 1048576 /dev/zero >> {data}; sleep 0.1; "
           "done; sleep 0.2")
    run = _trace(t, "sh", "-c", cmd, opts=("--interval", "0.02"))
    assert run.returncode == 0, run.stderr
    s = summarize(t)
    assert s["classes"] == {}  # no lcache inside: only samples
    shells = [p for p in s["processes"].values() if p["name"].startswith("sh -c")]
    assert shells and shells[0]["samples"] >= 5
    assert sum(p["wchar"] for p in s["processes"].values()) >= 4 << 20  # some heads are seen
    assert s["devices"], "no block device in /proc/diskstats"


def test_sampler_opens_each_proc_file_once_and_writes_what_it_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A sample is one pread per process of a /proc/<pid>/io kept open (and one of
    # /proc/diskstats), written as read: no open, parse or JSON per sample; the loader and
    # --jsonl parse them into the same counters.
    from lcache.trace.sampler import ProcSampler
    from lcache.trace.writer import TraceWriter

    t = tmp_path / "s.trace"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a: opened.append(str(p)) or real_open(p, *a))
    try:
        writer = TraceWriter(str(t))
        sampler = ProcSampler(child.pid, writer, 60)
        for _ in range(5):
            sampler.sample()
        sampler.stop()  # one more sample
        writer.close()
    finally:
        child.kill()
        child.wait()
    assert sorted(opened) == sorted([str(t), f"/proc/{child.pid}/io", "/proc/diskstats"])
    trace = load(t)
    ts, counters = trace.proc[child.pid]
    assert len(ts) == 6 and (counters >= 0).all() and (counters[-1] >= counters[0]).all()
    assert trace.disks and all(len(v[0]) == 6 for v in trace.disks.values())
    events = [json.loads(line) for line in json_lines(str(t))]
    io = [e for e in events if e.get("cat") == "proc-io"]
    assert [e["args"]["rchar"] for e in io] == counters[:, 0].tolist()
    assert {e["name"] for e in events if e.get("cat") == "diskstats"} == set(trace.disks)


def _syscalls(t: Path, code: str) -> Trace:
    """The loaded trace of ``python -c code`` under ``lcache trace --syscalls``."""
    if shutil.which("strace") is None:
        pytest.fail("strace is missing: run .ci/run (apt-get install strace)")
    run = _trace(t, sys.executable, "-c", code, opts=("--syscalls",))
    assert run.returncode == 0, run.stderr
    return load(t)


@pytest.mark.skipif(shutil.which("strace") is None and os.geteuid() != 0,
                    reason="strace is not installed and cannot be (not root)")
def test_syscalls_with_offsets(tmp_path: Path) -> None:
    t = tmp_path / "sys.trace"
    data = tmp_path / "f.bin"
    code = (f"import os\nfd = os.open({str(data)!r}, os.O_RDWR | os.O_CREAT)\n"
            "os.write(fd, b'a' * 1000)\nos.write(fd, b'b' * 24)\n"
            "os.pwrite(fd, b'c' * 10, 5000)\nos.lseek(fd, 100, 0)\nos.read(fd, 50)\n"
            "os.pread(fd, 7, 3)\nos.writev(fd, [b'x' * 4, b'y' * 6])\n"
            "os.pwritev(fd, [b'z' * 3], 7000)\nos.preadv(fd, [bytearray(2)], 6000)\n"
            "os.close(fd)\n")
    tr = _syscalls(t, code)
    rows = [(tr.ops[tr.op[i]], int(tr.offset[i]), int(tr.size[i]), int(tr.result[i]))
            for i in range(len(tr)) if tr.files[tr.file[i]] == str(data)]
    assert rows == [("write", 0, 1000, 1000), ("write", 1000, 24, 24),
                    ("write", 5000, 10, 10), ("read", 100, 50, 50), ("read", 3, 7, 7),
                    ("write", 150, 10, 10), ("write", 7000, 3, 3), ("read", 6000, 2, 2)]
    assert summarize(t)["classes"]["syscall"]["ops"] >= 8


def test_syscalls_see_sendfile_copy_file_range_and_mmap(tmp_path: Path) -> None:
    """The finding: bytes copied by sendfile (shutil.copyfile) and copy_file_range were in no
    event of the syscall class, which claims every file I/O; mmap left no trace at all."""
    t, src = tmp_path / "sys.trace", tmp_path / "src.bin"
    src.write_bytes(b"x" * 65536)
    code = (f"import os, mmap\nsrc = os.open({str(src)!r}, os.O_RDONLY)\n"
            f"out = os.open({str(tmp_path / 'a.out')!r}, os.O_WRONLY | os.O_CREAT)\n"
            "assert os.sendfile(out, src, 0, 65536) == 65536\n"
            "assert os.copy_file_range(src, out, 1000, 0) == 1000\n"
            "m = mmap.mmap(src, 0, prot=mmap.PROT_READ)\nm.close()\n")
    tr = _syscalls(t, code)
    rows = [(tr.ops[tr.op[i]], tr.files[tr.file[i]], int(tr.offset[i]), int(tr.result[i]))
            for i in range(len(tr)) if tr.files[tr.file[i]].startswith(str(tmp_path))]
    out = str(tmp_path / "a.out")
    assert rows == [("read", str(src), 0, 65536), ("write", out, 0, 65536),
                    ("read", str(src), 0, 1000), ("write", out, 65536, 1000),
                    ("mmap", str(src), 0, 0)]


@pytest.mark.skipif(shutil.which("strace") is None and os.geteuid() != 0,
                    reason="strace is not installed and cannot be (not root)")
def test_syscall_offsets_a_shared_description_or_o_append_hides_are_unknown(
        tmp_path: Path) -> None:
    """The finding: a write after a forked child wrote through the same descriptor, and
    writes with O_APPEND, were given confident offsets (1 MiB for 2 MiB; 0 for 3 MiB): the
    parser kept a position per thread that others moved. They are -1 (unknown) now."""
    t, data = tmp_path / "sys.trace", tmp_path / "f.bin"
    code = (f"import os\nfd = os.open({str(data)!r}, os.O_WRONLY | os.O_CREAT)\n"
            "os.write(fd, b'a' * 100)\nif os.fork() == 0:\n"
            "    os.write(fd, b'b' * 100)\n    os._exit(0)\nos.wait()\n"
            "os.write(fd, b'c' * 100)\nos.close(fd)\n"
            f"fd = os.open({str(data)!r}, os.O_WRONLY | os.O_APPEND)\n"
            "os.write(fd, b'd' * 100)\nos.close(fd)\n")
    tr = _syscalls(t, code)
    offsets = [int(tr.offset[i]) for i in range(len(tr)) if tr.files[tr.file[i]] == str(data)
               and tr.ops[tr.op[i]] == "write"]
    assert offsets == [0, -1, -1, -1]


@pytest.mark.skipif(shutil.which("strace") is None and os.geteuid() != 0,
                    reason="strace is not installed and cannot be (not root)")
def test_syscalls_name_odd_files_and_keep_unlinked_ones(tmp_path: Path) -> None:
    """The finding (attack helper 87): names were strace's escapes (``donn\\303\\251es.bin``,
    ``a\\74b\\76.bin``), a file named ``x:[1].bin`` lost its reads as a "socket", and writes to
    unlinked files (every TemporaryFile) were dropped."""
    t = tmp_path / "sys.trace"
    names = [b"donn\xc3\xa9es.bin", b"bad\xff.bin", b"a<b>.bin", b"x:[1].bin",
             b'q"u\\v\n.bin', b"a) = 7 b[,c.bin", b"z>(deleted)"]
    for n in names:
        (tmp_path / os.fsdecode(n)).write_bytes(b"x" * 100)
    code = (f"import os, tempfile\nos.chdir({str(tmp_path)!r})\n"
            f"for n in {names!r}:\n    fd = os.open(n, os.O_RDONLY)\n    os.read(fd, 100)\n"
            "    os.close(fd)\n"
            "f = open('gone.bin', 'wb')\nos.unlink('gone.bin')\nf.write(b'x' * 5000)\nf.close()\n"
            "with tempfile.TemporaryFile(dir='.') as f:\n    f.write(b'y' * 7000)\n")
    tr = _syscalls(t, code)
    moved: dict[str, int] = {}
    for e in map(json.loads, json_lines(str(t))):
        name = e.get("args", {}).get("file", "")
        if e.get("cat") == "syscall" and name.startswith(str(tmp_path)):
            moved[name] = moved.get(name, 0) + e["args"]["ret"]
    temp = [n for n in moved if n.endswith(" (deleted)") and "/#" in n]
    # named as lcache's own events name files (os.fsdecode): b"\xff" is "\udcff"
    assert moved == {**{f"{tmp_path}/{os.fsdecode(n)}": 100 for n in names},
                     f"{tmp_path}/gone.bin (deleted)": 5000, **dict.fromkeys(temp, 7000)}
    assert len(temp) == 1  # O_TMPFILE: the kernel names it "#<inode> (deleted)"
    assert f"{tmp_path}/bad\\xff.bin" in tr.files  # the report shows its bytes


def test_signals_reach_the_command_and_the_trace_is_written(tmp_path: Path) -> None:
    import signal
    import time

    t = tmp_path / "sig.trace"
    env = {k: v for k, v in os.environ.items() if k != "LCACHE_TRACE"}
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
            "print('ready', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([*LCACHE, "trace", "-o", str(t), "--interval", "0.05", "--",
                             sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # lcache trace passes it on and keeps the exit code
    assert proc.wait(timeout=60) == 42
    assert summarize(t)["processes"]


def test_sighup_is_passed_on_and_the_trace_finished(tmp_path: Path) -> None:
    """The finding (attack helper 87): SIGHUP (a closed terminal, a dropped ssh) killed
    `lcache trace` on the spot, exit 129: the command and `strace -D` ran on, strace's log
    stayed in the temp folder, the trace lost its last events and no summary was printed."""
    import signal
    import time

    if shutil.which("strace") is None:
        pytest.fail("strace is missing: run .ci/run (apt-get install strace)")
    t = tmp_path / "hup.trace"
    env = {k: v for k, v in os.environ.items() if k != "LCACHE_TRACE"}
    env["TMPDIR"] = str(tmp_path)  # strace's log goes here
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGHUP, lambda *a: sys.exit(43))\n"
            "print('ready', flush=True)\ntime.sleep(60)\n")
    log = tmp_path / "stderr"
    with log.open("w") as stderr:
        proc = subprocess.Popen([*LCACHE, "trace", "--syscalls", "-o", str(t), "--interval",
                                 "0.05", "--", sys.executable, "-c", code], env=env,
                                stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    time.sleep(0.2)
    proc.send_signal(signal.SIGHUP)
    code = proc.wait(timeout=60)
    err = log.read_text()
    assert code == 43, err  # the command's own exit, not lcache trace's death
    assert "lcache trace: " in err and "syscall events" in err
    assert not list(tmp_path.glob("lcache-strace-*"))
    assert summarize(t)["processes"]


def test_syscalls_sample_the_command_not_strace(tmp_path: Path) -> None:
    """The finding: under --syscalls the sampler's root was strace, which reaped the command
    and so held all its bytes under strace's name; the command had one sample of zeros."""
    if shutil.which("strace") is None:
        pytest.fail("strace is missing: run .ci/run (apt-get install strace)")
    t, data = tmp_path / "sys.trace", tmp_path / "f.bin"
    code = f"open({str(data)!r}, 'wb').write(b'x' * (4 << 20))\n"
    run = _trace(t, sys.executable, "-c", code, opts=("--syscalls",))
    assert run.returncode == 0, run.stderr
    procs = summarize(t)["processes"]
    assert not [p for p in procs.values() if "strace" in p["name"]]
    mine = [p for p in procs.values() if p["name"].endswith(code.strip())]
    assert len(mine) == 1 and mine[0]["wchar"] >= 4 << 20
    # strace's log was complete when it was read
    assert summarize(t)["classes"]["syscall"]["write_bytes"] == 4 << 20


def test_trace_replaces_only_a_trace(tmp_path: Path) -> None:
    # `lcache trace -o t.py -- true` unlinked t.py to start a fresh trace: a file at -o is now
    # replaced only when it is an lcache trace (or empty), and otherwise refused in one line.
    script = tmp_path / "t.py"
    script.write_text("print('hi')\n")
    run = _trace(script, "true")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1 and "t.py is not an lcache trace" in run.stderr
    assert script.read_text() == "print('hi')\n"
    for name in ("t.trace", "t.trace.gz"):
        t = tmp_path / name
        assert _trace(t, "true").returncode == 0
        first = t.read_bytes()
        assert _trace(t, "sh", "-c", "echo again").returncode == 0
        assert t.read_bytes() != first
        names = [p for p in load(str(t)).process_names.values() if "lcache trace" in p]
        assert names == ["lcache trace sh -c echo again"], names  # this run only
    empty = tmp_path / "empty.trace"
    empty.touch()
    assert _trace(empty, "true").returncode == 0 and empty.stat().st_size > 0
    link = tmp_path / "link.trace"
    link.symlink_to(script)  # neither followed nor replaced
    run = _trace(link, "true")
    assert run.returncode == 2 and "link.trace: it is a symbolic link" in run.stderr
    assert link.is_symlink() and script.read_text() == "print('hi')\n"
