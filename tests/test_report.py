"""`lcache report`: bad input names file and line; the HTML opens in headless Chromium."""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lcache.trace
from lcache.report import summarize, write_perfetto, write_report
from lcache.report.load import json_lines
from lcache.trace import TraceFormatError

HERE = Path(__file__).parent


def _small_trace(path: Path) -> None:
    lcache.trace.enable(str(path))
    try:
        for i in range(20):
            lcache.trace.record("write", "/data/a<b>&'\".bin", i * 10, 10, "checkpoint",
                                1000 * i, 500, 10)
    finally:
        lcache.trace.disable()
    # as JSON lines (the recorder writes binary blocks): these tests damage lines
    path.write_text("".join(json_lines(str(path))))


def test_missing_truncated_and_foreign_files(tmp_path: Path) -> None:
    good = tmp_path / "good.trace"
    _small_trace(good)
    with pytest.raises(TraceFormatError, match=r"nope\.trace: no such trace file"):
        summarize(tmp_path / "nope.trace")
    lines = good.read_bytes()
    cut = tmp_path / "cut.trace"
    cut.write_bytes(lines[: len(lines) - 30])  # the last line loses its end
    n = lines.count(b"\n")
    with pytest.raises(TraceFormatError, match=rf"cut\.trace: line {n}: the last line is cut "
                                               "short"):
        summarize(cut)
    gz = tmp_path / "cut.trace.gz"
    gz.write_bytes(gzip.compress(lines)[:-20])
    with pytest.raises(TraceFormatError, match=r"cut\.trace\.gz: line \d+: compressed data"):
        summarize(gz)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"ph": "X", "pid": 1, "ts": 1}\n{"hello": "world"}\n')
    with pytest.raises(TraceFormatError, match=r"foreign\.jsonl: line 2: not a Chrome trace"):
        summarize(foreign)
    odd_args = tmp_path / "odd-args.trace"
    odd_args.write_text('{"name": "r", "ph": "X", "pid": 1, "ts": 1, "args": [1]}\n')
    with pytest.raises(TraceFormatError, match=r"odd-args\.trace: line 1: .*'args' is not"):
        summarize(odd_args)
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n1,2\n")
    with pytest.raises(TraceFormatError, match=r"data\.csv: line 1: not a JSON object"):
        summarize(csv)
    empty = tmp_path / "empty.trace"
    empty.write_text("")
    with pytest.raises(TraceFormatError, match=r"empty\.trace: line 1: .*no trace events"):
        summarize(empty)
    other_tool = tmp_path / "other.json"  # a valid Chrome trace without lcache events
    other_tool.write_text('{"name": "f", "ph": "X", "pid": 1, "ts": 1, "dur": 2}\n')
    with pytest.raises(TraceFormatError, match=r"other\.json: line 1: no lcache I/O events"):
        summarize(other_tool)
    # The CLI says the same on one line and exits 2 (COLUMNS: rich must not wrap the line).
    run = subprocess.run([sys.executable, "-m", "lcache", "report", str(cut), "-o",
                          str(tmp_path / "r.html")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "1000"})
    assert run.returncode == 2 and f"cut.trace: line {n}" in run.stderr


def test_perfetto_wrapping_round_trips(tmp_path: Path) -> None:
    t = tmp_path / "t.trace"
    _small_trace(t)
    wrapped = tmp_path / "t.json"
    write_perfetto(t, wrapped)
    events = json.loads(wrapped.read_text())  # one JSON array, as Perfetto wants
    assert sum(e["ph"] == "X" for e in events) == 20
    assert summarize(wrapped)["classes"] == summarize(t)["classes"]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        exe = shutil.which(name)
        if exe:
            return exe
    pytest.fail("headless Chromium is needed for the report test and is not installed: run "
                ".ci/run, or apt-get install chromium (Debian)")


def test_report_opens_in_headless_chromium(tmp_path: Path) -> None:
    chromium = _chromium()
    t = tmp_path / "run.trace"
    env = {k: v for k, v in os.environ.items() if k != "LCACHE_TRACE"}
    run = subprocess.run([sys.executable, "-m", "lcache", "trace", "-o", str(t), "--interval",
                          "0.02", "--", sys.executable, str(HERE / "_trace_known.py"),
                          str(tmp_path / "d.bin"), "1"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    _small_trace(t)  # appends a class whose file name needs escaping
    html_path, json_path = tmp_path / "report.html", tmp_path / "summary.json"
    summary = write_report([t], html_path, json_path)
    assert json.loads(json_path.read_text()) == summary
    page = html_path.read_text()
    assert "http://" not in page and "https://" not in page  # nothing loaded at view time
    assert "a&lt;b&gt;&amp;&#x27;&quot;.bin" in page and "a<b>" not in page
    images = re.findall(r'<img class="plot" id="plot-(\d+)"[^>]*src="data:image/png;base64,'
                        r'([^"]+)"', page)
    assert len(images) == 9
    for _, b64 in images:
        assert base64.b64decode(b64).startswith(b"\x89PNG\r\n\x1a\n")

    base = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "shot.png"
    res = subprocess.run([*base, "--enable-logging=stderr", "--v=0", f"--screenshot={shot}",
                          "--window-size=1200,2400", html_path.as_uri()],
                         capture_output=True, text=True, timeout=120)
    console = [line for line in res.stderr.splitlines() if ":CONSOLE" in line]
    assert any("lcache-report: 9/9 plots loaded" in line for line in console), res.stderr[-2000:]
    assert [c for c in console if "lcache-report:" not in c] == []  # no errors, nothing else
    assert shot.exists(), res.stderr[-2000:]
    from matplotlib.image import imread

    pixels = imread(str(shot))[..., :3]
    assert pixels.std() > 0.05 and (pixels.mean(axis=2) < 0.9).mean() > 0.02  # not blank
    dom = subprocess.run([*base, "--dump-dom", html_path.as_uri()], capture_output=True,
                         text=True, timeout=120).stdout
    assert 'data-plots-loaded="9/9"' in dom
