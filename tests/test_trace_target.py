"""Where tracing writes, and what it refuses: a trace path that is a FIFO, a device, a
directory or another file, a bad flush interval, arguments of the wrong kind; a refusal
makes nothing and leaves the traced program running untraced, with status 2 from the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import lcache.trace

from .conftest import subprocess_env
from .test_trace_recorder import _events, _io


@pytest.mark.parametrize("value", ["-1", "abc", "nan", "1e400", "0"])
def test_a_bad_flush_interval_is_refused_where_tracing_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    # (attack helper 47) it killed the flush thread with a traceback; the job ran untraced
    monkeypatch.setenv("LCACHE_TRACE_FLUSH_S", value)
    with pytest.raises(lcache.ConfigError, match="LCACHE_TRACE_FLUSH_S"):
        lcache.trace.enable(str(tmp_path / "t.trace"))
    assert not lcache.trace.enabled()
    env = dict(subprocess_env(), LCACHE_TRACE=str(tmp_path / "cli.trace"),
               LCACHE_TRACE_FLUSH_S=value)
    run = subprocess.run([sys.executable, "-m", "lcache", "stats", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1 and "LCACHE_TRACE_FLUSH_S" in run.stderr, run.stderr
    env.pop("LCACHE_TRACE")
    run = subprocess.run([sys.executable, "-m", "lcache", "trace", "-o",
                          str(tmp_path / "t2.trace"), "--", "true"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "LCACHE_TRACE_FLUSH_S" in run.stderr, run.stderr


def test_tracing_appends_only_to_a_trace(tmp_path: Path) -> None:
    # LCACHE_TRACE=t.py (or enable("t.py")) appended trace events to the user's script; a
    # file there is now appended to only when it is an lcache trace (plain or gzip) or empty.
    script = tmp_path / "t.py"
    script.write_text("print('hi')\n")
    with pytest.raises(lcache.ConfigError, match=r"t\.py is not an lcache trace"):
        lcache.trace.enable(str(script))
    assert not lcache.trace.enabled()
    assert script.read_text() == "print('hi')\n"
    env = dict(subprocess_env(), LCACHE_TRACE=str(script))
    run = subprocess.run([sys.executable, "-c", "import lcache"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stderr.count("\n") == 1, run.stderr
    assert "not an lcache trace" in run.stderr and "Traceback" not in run.stderr
    assert script.read_text() == "print('hi')\n"
    for name in ("t.trace", "t.trace.gz", "empty.trace"):
        trace = tmp_path / name
        if name != "empty.trace":
            lcache.trace.enable(str(trace))
            lcache.trace.disable()
        else:
            trace.touch()
        size = trace.stat().st_size
        lcache.trace.enable(str(trace))  # a trace (or an empty file) is appended to
        lcache.trace.disable()
        assert trace.stat().st_size > size
        starts = [e for e in _events(trace) if e.get("name") == "recorder"
                  and e["args"]["state"] == "start"]
        assert len(starts) == (1 if name == "empty.trace" else 2), name


def test_tracing_refuses_a_fifo_or_a_device(tmp_path: Path) -> None:
    """Attack helper 60: enable() or LCACHE_TRACE naming a FIFO was accepted, and the job
    hung once its events filled the pipe's buffer; a device or socket is no trace either."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/null"):
        with pytest.raises(lcache.ConfigError, match=f"{path} is a .*not a regular file"):
            lcache.trace.enable(path)
        assert not lcache.trace.enabled()
    env = dict(subprocess_env(), LCACHE_TRACE=str(fifo))
    run = subprocess.run([sys.executable, "-c", "import lcache"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stderr.count("\n") == 1, run.stderr
    assert f"{fifo} is a FIFO, not a regular file" in run.stderr


def test_lcache_trace_makes_no_folder_and_every_refusal_is_status_2(tmp_path: Path) -> None:
    """The finding (attack helper 69, finding 9): LCACHE_TRACE made the folders it named (a
    typo made nodir/; as root, /nonexist/), and a directory or a link went on with exit status
    0 and Python's errno text, while /dev/null exited 2. Each is refused as `lcache trace -o`
    refuses it: the CLI in one line with exit status 2; a program importing lcache is told in
    one line and goes on, untraced."""
    missing = tmp_path / "nodir" / "x.trace"
    with pytest.raises(lcache.ConfigError, match="nodir does not exist, and tracing makes none"):
        lcache.trace.enable(str(missing))
    assert not lcache.trace.enabled() and not (tmp_path / "nodir").exists()
    (tmp_path / "adir").mkdir()
    link = tmp_path / "link.trace"
    link.symlink_to(tmp_path / "elsewhere.trace")
    for path, words in ((missing, "nodir does not exist"), (tmp_path / "adir", "is a directory"),
                        (link, "too many levels of symbolic links")):
        env = dict(subprocess_env(), LCACHE_TRACE=str(path))
        cli = subprocess.run([sys.executable, "-m", "lcache", "model", "bert-large", "--json"],
                             env=env, capture_output=True, text=True, timeout=60)
        assert cli.returncode == 2 and cli.stdout == "", (path, cli.stderr)
        assert cli.stderr.count("\n") == 1 and words in cli.stderr, cli.stderr
        assert "Errno" not in cli.stderr and "Traceback" not in cli.stderr, cli.stderr
        lib = subprocess.run([sys.executable, "-c", "import lcache; print('went on')"],
                             env=env, capture_output=True, text=True, timeout=60)
        assert (lib.returncode, lib.stdout) == (0, "went on\n"), lib.stderr
        assert lib.stderr.count("\n") == 1 and words in lib.stderr, lib.stderr
    assert not (tmp_path / "nodir").exists() and not (tmp_path / "elsewhere.trace").exists()


def test_a_trace_path_ending_in_a_slash_is_refused_and_nothing_made(tmp_path: Path) -> None:
    """The finding (attack helper 73, finding 6): `lcache trace -o tdir/ -- true` exited 0
    and wrote a FILE tdir (os.path.abspath drops the slash), and LCACHE_TRACE=newdir/ did the
    same. A name ending in '/' names a directory: refused in one line, nothing made."""
    for name in ("tdir/", "tdir/.", "sub/tdir/"):
        run = subprocess.run([sys.executable, "-m", "lcache", "trace", "-o", name, "--",
                              "true"], cwd=tmp_path, env=subprocess_env(),
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and run.stderr.count("\n") == 1, (name, run.stderr)
        assert f"{name}: it ends in '/', '.' or '..', so it names a directory" in run.stderr
        assert "Traceback" not in run.stderr
        assert os.listdir(tmp_path) == [], name
    with pytest.raises(lcache.ConfigError, match="newdir/ names a directory"):
        lcache.trace.enable(str(tmp_path / "newdir") + "/")
    assert not lcache.trace.enabled()
    env = dict(subprocess_env(), LCACHE_TRACE="newdir/")
    lib = subprocess.run([sys.executable, "-c", "import lcache; print('went on')"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert (lib.returncode, lib.stdout) == (0, "went on\n"), lib.stderr
    assert lib.stderr.count("\n") == 1 and "newdir/ names a directory" in lib.stderr
    cli = subprocess.run([sys.executable, "-m", "lcache", "model", "bert-large", "--json"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2 and cli.stderr.count("\n") == 1, cli.stderr
    # report and advise outputs too, before any is written (--json j/ came after r.html)
    trace = tmp_path.parent / f"{tmp_path.name}.trace"
    lcache.trace.enable(str(trace))
    lcache.trace.record("read", "/x", 0, 10, "data-source", lcache.trace.now_ns(), 5, 10)
    lcache.trace.disable()
    run = subprocess.run([sys.executable, "-m", "lcache", "report", str(trace), "-o", "r.html",
                          "--json", "j/"], cwd=tmp_path, env=subprocess_env(),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "summary j/: it ends in '/'" in run.stderr, run.stderr
    assert os.listdir(tmp_path) == []


def test_a_trace_is_appended_to_in_its_own_format(tmp_path: Path) -> None:
    """Attack helper 60: the format came from the suffix alone, so a gzip trace renamed
    without .gz got plain lines appended (or the reverse), and no line of it could be read."""
    for first, second in (("a.trace.gz", "a.trace"), ("b.trace", "b.trace.gz")):
        lcache.trace.enable(str(tmp_path / first))
        lcache.trace.record("read", "/x", 0, 10, "data-source", lcache.trace.now_ns(), 5, 10)
        lcache.trace.disable()
        os.rename(tmp_path / first, tmp_path / second)
        lcache.trace.enable(str(tmp_path / second))
        lcache.trace.record("read", "/y", 0, 20, "data-source", lcache.trace.now_ns(), 5, 20)
        lcache.trace.disable()
        assert sorted(e["args"]["size"] for e in _io(_events(tmp_path / second))) == [10, 20]
    for compress in (True, False):  # nor does compress= mix formats in one file
        lcache.trace.enable(str(tmp_path / "b.trace.gz"), compress=compress)
        lcache.trace.disable()
        assert len(_io(_events(tmp_path / "b.trace.gz"))) == 2


@pytest.mark.parametrize("path, compress", [(None, None), (5, None), ("", None),
                                            ("t.trace", "no")])
def test_enable_names_an_argument_of_the_wrong_kind(tmp_path: Path, path: object,
                                                    compress: object) -> None:
    # (attack helper 87) enable(None) was a TypeError from os.path; "no" turned gzip on
    arg = str(tmp_path / path) if isinstance(path, str) and path else path
    with pytest.raises(lcache.ConfigError, match=r"path=|compress="):
        lcache.trace.enable(arg, compress=compress)  # type: ignore[arg-type]
    assert not lcache.trace.enabled() and os.listdir(tmp_path) == []
