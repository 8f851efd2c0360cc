"""`lcache report` flags processes whose ``recorder`` start marker has no end: killed before
their last flush, so their last events may be missing (docs/trace.md, "Recording")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

LCACHE = [sys.executable, "-m", "lcache"]

# The parent starts a child that reads through lcache.io, then ends it with SIGKILL (or lets
# it exit); the background flush is off, so a killed child's reads are never written.
JOB = """
import os, signal, subprocess, sys
CHILD = '''
import os, sys
import lcache  # honours LCACHE_TRACE
from lcache.io import open_file, pread_full
from lcache.io.files import close_file
fd = open_file(sys.argv[1], os.O_RDONLY)
buf = memoryview(bytearray(4096))
for i in range(16):
    pread_full(fd, i * 4096, buf, "data-source")
close_file(fd)
print(os.getpid(), flush=True)
if sys.argv[2] == "kill":
    sys.stdin.read()  # wait to be killed
'''
data = sys.argv[1] + "/data.bin"
with open(data, "wb") as f:
    f.write(bytes(1 << 16))
child = subprocess.Popen([sys.executable, "-c", CHILD, data, sys.argv[2]],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
pid = int(child.stdout.readline())
if sys.argv[2] == "kill":
    os.kill(pid, signal.SIGKILL)
child.wait()
with open(sys.argv[1] + "/child.pid", "w") as f:
    f.write(str(pid))
"""


def _traced(tmp_path: Path, how: str) -> tuple[Path, int]:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(JOB))
    trace = tmp_path / "t.trace"
    env = dict(os.environ, LCACHE_TRACE_FLUSH_S="3600")  # only the exit flushes
    env.pop("LCACHE_TRACE", None)
    out = subprocess.run([*LCACHE, "trace", "-o", str(trace), "--", sys.executable, str(job),
                          str(tmp_path), how], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return trace, int((tmp_path / "child.pid").read_text())


def _report(tmp_path: Path, trace: Path) -> tuple[subprocess.CompletedProcess[str], dict, str]:
    html, summary = tmp_path / "r.html", tmp_path / "s.json"
    out = subprocess.run([*LCACHE, "report", str(trace), "-o", str(html), "--json",
                          str(summary)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0, out.stderr
    return out, json.loads(summary.read_text()), html.read_text()


def test_a_child_killed_before_its_flush_is_flagged(tmp_path: Path) -> None:
    trace, pid = _traced(tmp_path, "kill")
    out, summary, html = _report(tmp_path, trace)
    assert summary["trace"]["unfinished_processes"] == [pid]
    note = f"events may be missing for 1 process(es) (pids {pid}): killed before they flushed"
    assert note in out.stdout
    assert note in html and 'class="warn"' in html


def test_processes_that_exit_and_traces_without_markers_are_not_flagged(
        tmp_path: Path) -> None:
    trace, _ = _traced(tmp_path, "exit")
    out, summary, html = _report(tmp_path, trace)
    assert summary["trace"]["unfinished_processes"] == []
    assert summary["total"]["read_bytes"] == 16 * 4096  # the child's reads arrived
    assert "may be missing" not in out.stdout + html
    # An older trace (no recorder lines) of a killed child loads as before, without a note.
    (tmp_path / "old").mkdir()
    killed, _ = _traced(tmp_path / "old", "kill")
    old = tmp_path / "old.trace"
    subprocess.run([*LCACHE, "report", str(killed), "-o", str(tmp_path / "x.html"),
                    "--jsonl", str(old)], check=True, capture_output=True, timeout=120)
    lines = old.read_text().splitlines()
    kept = [ln for ln in lines if json.loads(ln).get("name") != "recorder"]
    assert len(kept) < len(lines)
    old.write_text("\n".join(kept) + "\n")
    out, summary, html = _report(tmp_path, old)
    assert summary["trace"]["unfinished_processes"] == []
    assert "may be missing" not in out.stdout + html
