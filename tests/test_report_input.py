"""`lcache report` on bad input: exit status 2 and one line on stderr naming the file (and the
line), in bounded time and memory: devices, FIFOs, lines longer than any event, gzip bombs,
deep nesting, numbers out of range, an output directory that does not exist."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import tracemalloc
from pathlib import Path

import pytest

import lcache.trace
from lcache.errors import CorruptionError, LCacheError
from lcache.report import summarize
from lcache.report.load import MAX_LINE, json_lines

from .conftest import assert_one_line_error, run_lcache


def _good(path: Path) -> Path:
    lcache.trace.enable(str(path))
    try:
        for i in range(5):
            lcache.trace.record("write", "/data/x.bin", i * 10, 10, "checkpoint", 1000 * i,
                                500, 10)
    finally:
        lcache.trace.disable()
    # as JSON lines (the recorder writes binary blocks): these tests damage lines
    path.write_text("".join(json_lines(str(path))))
    return path


def _event(**fields: object) -> str:
    ev = {"name": "read", "cat": "cache-read", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0,
          "ph": "X", "args": {"file": "/f", "off": 0, "size": 1, "ret": 1}}
    ev.update(fields)
    return json.dumps(ev)


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A folder of bad traces; each appends its bad line after a good trace of n - 1 lines."""
    tmp = tmp_path_factory.mktemp("bad")
    good = _good(tmp / "good.trace").read_text()
    (tmp / "long.trace").write_text(good + "x" * (MAX_LINE + 10) + "\n" + good)
    (tmp / "zeros.bin").write_bytes(bytes(3 << 20))
    (tmp / "bomb.trace.gz").write_bytes(gzip.compress(good.encode() + bytes(64 << 20), 9))
    (tmp / "deep.trace").write_text(good + "[" * 100_000 + "]" * 100_000 + "\n")
    (tmp / "digits.trace").write_text(good + _event(pid=0).replace('"pid": 0', '"pid": '
                                                                   + "9" * 5000) + "\n")
    (tmp / "huge.trace").write_text(good + _event(pid=2**70) + "\n")
    (tmp / "nan.trace").write_text(good + _event(ts=float("nan")) + "\n")
    (tmp / "inf.trace").write_text(good + _event(dur=1e309) + "\n")
    (tmp / "negative.trace").write_text(good + _event(dur=-5) + "\n")
    (tmp / "span.trace").write_text(good + _event(ts=1e300) + "\n")
    # three of them summed wrapped round the int64 totals; a negative size was taken
    big = {"file": "/f", "off": 0, "size": 2**63 - 1, "ret": 1}
    (tmp / "wrap.trace").write_text(good + _event(args=big) + "\n")
    minus = {"file": "/f", "off": 0, "size": -5, "ret": 1}
    (tmp / "minus.trace").write_text(good + _event(args=minus) + "\n")
    # damage int() and float() took for numbers: "1000" and true as 1000 and 1, 1.5 as 1
    (tmp / "tstext.trace").write_text(good + _event(ts="1000") + "\n")
    (tmp / "sizetrue.trace").write_text(good + _event(args={"file": "/f", "off": 0,
                                                            "size": True, "ret": 1}) + "\n")
    (tmp / "sizehalf.trace").write_text(good + _event(args={"file": "/f", "off": 0,
                                                            "size": 1.5, "ret": 1}) + "\n")
    (tmp / "retbig.trace").write_text(good + _event(args={"file": "/f", "off": 0,
                                                          "size": 4096, "ret": 1 << 40}) + "\n")
    counters = {"rchar": 0, "wchar": 0, "syscr": 0, "syscw": 0, "read_bytes": -5,
                "write_bytes": 0}
    (tmp / "counter.trace").write_text(good + json.dumps({
        "name": "io", "cat": "proc-io", "ph": "C", "pid": 1, "tid": 1, "ts": 1.0,
        "args": counters}) + "\n")
    os.mkfifo(tmp / "fifo.trace")  # reading it would wait for a writer forever
    return tmp, good.count("\n") + 1


def report(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_lcache("report", *args, cwd=cwd)


@pytest.mark.parametrize(("name", "words"), [
    ("/dev/zero", ["/dev/zero: not a regular file"]),
    ("fifo.trace", ["fifo.trace: not a regular file"]),
    ("long.trace", ["long.trace: line {n}: longer than 1048576 characters"]),
    # a NUL byte starts a binary block, so these are refused at their first NUL
    ("zeros.bin", ["zeros.bin: byte 0: neither a JSON line nor an lcache binary block"]),
    ("bomb.trace.gz", ["bomb.trace.gz: byte", "neither a JSON line nor an lcache binary"]),
    ("deep.trace", ["deep.trace: line {n}: not a trace event (nested too deeply"]),
    ("digits.trace", ["digits.trace: line {n}: not a trace event"]),
    ("huge.trace", ["huge.trace: line {n}: a 'X' event", "does not fit in 64 bits"]),
    ("nan.trace", ["nan.trace: line {n}: a 'X' event", "is not a time"]),
    ("inf.trace", ["inf.trace: line {n}: a 'X' event", "is not a time"]),
    ("negative.trace", ["negative.trace: line {n}: a 'X' event", "negative duration"]),
    ("span.trace", ["span.trace: line {n}: a 'X' event", "is not a time"]),
    ("wrap.trace", ["wrap.trace: line {n}: a 'X' event", "size 9.22e+18 is not a byte count"]),
    ("minus.trace", ["minus.trace: line {n}: a 'X' event", "size -5 is not a byte count"]),
    ("tstext.trace", ["tstext.trace: line {n}: a 'X' event", "'1000' is not a number"]),
    ("sizetrue.trace", ["sizetrue.trace: line {n}: a 'X' event", "'True' is not a number"]),
    ("sizehalf.trace", ["sizehalf.trace: line {n}: a 'X' event", "1.5 is not a whole number"]),
    ("retbig.trace", ["retbig.trace: line {n}: a 'X' event",
                      "a read of 4096 bytes that moved 1099511627776"]),
    ("counter.trace", ["counter.trace: line {n}: a 'C' event",
                       "counter read_bytes -5 is not a count"]),
])
def test_bad_trace_is_one_line_with_file_and_line(bad: tuple[Path, int], name: str,
                                                  words: list[str]) -> None:
    folder, n = bad
    words = [w.format(n=n) for w in words]
    assert_one_line_error(report(name, "-o", str(folder / "r.html"), cwd=folder), *words)
    if name in ("/dev/zero", "fifo.trace"):
        return
    tracemalloc.start()  # the library raises the same error, in bounded memory
    try:
        with pytest.raises(CorruptionError) as info:
            summarize(folder / name)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(info.value, LCacheError) and words[0] in str(info.value)
    assert peak < 32 << 20, peak  # a line is at most 1 MiB of text


def test_output_directory_that_does_not_exist(tmp_path: Path) -> None:
    good = _good(tmp_path / "good.trace")
    for option in ("-o", "--json", "--perfetto"):
        run = report(str(good), option, "/missing/dir/x.out", cwd=tmp_path)
        assert_one_line_error(run, "cannot write the", "/missing/dir/x.out: the directory "
                              "/missing/dir does not exist")


def test_a_long_command_line_stays_under_the_line_limit(tmp_path: Path) -> None:
    """A process name is cut to 4 KiB, so a traced command line of megabytes still loads."""
    from lcache.trace.writer import process_metadata

    (line,) = process_metadata(1, "python train.py " + "--flag " * 500_000)
    assert len(line) < 5000
    trace = tmp_path / "t.trace"
    trace.write_text(line + "\n" + _good(tmp_path / "g.trace").read_text())
    assert summarize(trace)["total"]["ops"] == 5


@pytest.mark.parametrize("option", ["-o", "--json", "--perfetto", "--jsonl"])
def test_an_output_that_is_the_input_or_not_a_regular_file_is_refused(
        tmp_path: Path, option: str) -> None:
    """Writing replaces the file: the input trace would be destroyed, and a FIFO or a device
    (as root, -o /dev/null) replaced by a regular file for everyone."""
    good = _good(tmp_path / "good.trace")
    before = good.read_bytes()
    run = report(str(good), option, str(good), cwd=tmp_path)
    assert_one_line_error(run, "good.trace", "is the input")
    assert good.read_bytes() == before
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert_one_line_error(report(str(good), option, str(fifo), cwd=tmp_path), "is a FIFO")
    assert fifo.is_fifo()


def test_report_replaces_only_a_report_or_summary_it_wrote(tmp_path: Path) -> None:
    """The finding (attack helper 69, finding 4): `lcache report TRACE` with no -o replaced a
    ./report.html it did not write without a word, and `--json notes.txt` replaced any
    file. Each may replace only the report (summary) lcache wrote there before."""
    good = _good(tmp_path / "good.trace")
    (tmp_path / "report.html").write_text("my precious notes\n")
    assert_one_line_error(report(str(good), cwd=tmp_path), "cannot write the report "
                          "report.html", "not a report lcache wrote", "give -o another path")
    assert (tmp_path / "report.html").read_text() == "my precious notes\n"
    (tmp_path / "notes.txt").write_text("mine\n")
    assert_one_line_error(report(str(good), "-o", "r.html", "--json", "notes.txt",
                                 cwd=tmp_path), "notes.txt", "not a summary lcache wrote",
                          "give --json another path")
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    assert not (tmp_path / "r.html").exists()
    (tmp_path / "link.html").symlink_to(tmp_path / "report.html")
    assert_one_line_error(report(str(good), "-o", "link.html", cwd=tmp_path),
                          "link.html: it is a symbolic link")
    assert (tmp_path / "link.html").is_symlink()

    # what lcache wrote is replaced, as before (a second run writes the same names)
    for _ in range(2):
        run = report(str(good), "-o", "r.html", "--json", "r.json", cwd=tmp_path)
        assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "r.json").read_text())["total"]["ops"] == 5
    assert "<title>lcache I/O report</title>" in (tmp_path / "r.html").read_text()


def test_perfetto_and_jsonl_replace_only_what_report_wrote(tmp_path: Path) -> None:
    """The finding (attack helper 73, finding 2): only -o and --json were checked, and
    `--perfetto notes.txt` or `--jsonl notes2.txt` replaced the user's file. Each output
    now replaces only a file of its own kind that lcache wrote, and nothing is written when
    one is refused."""
    good = _good(tmp_path / "good.trace")
    for option, what in (("--perfetto", "Perfetto file"), ("--jsonl", "JSON lines file")):
        (tmp_path / "notes.txt").write_text("my notes\n")
        assert_one_line_error(report(str(good), "-o", "r.html", option, "notes.txt",
                                     cwd=tmp_path), "cannot write the " + what + " notes.txt",
                              f"not a {what} lcache wrote", f"give {option} another path")
        assert (tmp_path / "notes.txt").read_text() == "my notes\n"
        assert not (tmp_path / "r.html").exists()
    # another kind lcache wrote is not replaced either: a JSON lines file is no Perfetto file
    run = report(str(good), "-o", "r.html", "--jsonl", "lines.jsonl", "--perfetto", "p.json",
                 cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    lines = (tmp_path / "lines.jsonl").read_bytes()
    assert_one_line_error(report(str(good), "-o", "r.html", "--perfetto", "lines.jsonl",
                                 cwd=tmp_path), "not a Perfetto file lcache wrote")
    assert_one_line_error(report(str(good), "-o", "r.html", "--jsonl", "p.json",
                                 cwd=tmp_path), "not a JSON lines file lcache wrote")
    assert (tmp_path / "lines.jsonl").read_bytes() == lines
    # what lcache wrote is replaced, and stays what its readers take
    run = report(str(good), "-o", "r.html", "--jsonl", "lines.jsonl", "--perfetto", "p.json",
                 cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    events = json.loads((tmp_path / "p.json").read_text())  # one JSON array
    assert sum(e["ph"] == "X" for e in events) == 5
    assert summarize(tmp_path / "lines.jsonl")["total"]["ops"] == 5
    assert summarize(tmp_path / "p.json")["total"]["ops"] == 5
    # printed, the outputs carry the same first line
    run = report(str(good), "--perfetto", "-", cwd=tmp_path)
    assert run.returncode == 0 and run.stdout == (tmp_path / "p.json").read_text()


def test_trace_and_advise_refuse_the_same_outputs(tmp_path: Path) -> None:
    good = _good(tmp_path / "good.trace")
    before = good.read_bytes()
    for option in ("--emit", "-o"):
        run = run_lcache("advise", str(good), option, str(good), cwd=tmp_path)
        assert_one_line_error(run, "is the input")
    assert good.read_bytes() == before
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    run = run_lcache("trace", "-o", str(fifo), "--", "true", cwd=tmp_path)
    assert run.returncode == 2 and "is a FIFO" in run.stderr and "Traceback" not in run.stderr
    assert fifo.is_fifo()


@pytest.mark.parametrize("interval", ["nan", "inf", "1e300", "0", "-1", "x"])
def test_trace_interval_is_a_finite_number_of_seconds(tmp_path: Path, interval: str) -> None:
    run = run_lcache("trace", "--interval", interval, "-o", "t.trace", "--", "true",
                     cwd=tmp_path)
    assert_one_line_error(run, "--interval", "0.01..3600")


def test_a_gzip_of_newlines_is_refused_early(tmp_path: Path) -> None:
    """100 KB of gzip held 10^8 newlines, which took minutes to read one by one; a run of
    blank lines longer than any trace has is refused, a few are still skipped."""
    bomb = tmp_path / "blank.trace.gz"
    bomb.write_bytes(gzip.compress(b"\n" * 10**6, 9))
    assert_one_line_error(report(str(bomb), cwd=tmp_path), "blank.trace.gz: line 10001",
                          "blank lines in a row")
    good = _good(tmp_path / "good.trace")
    good.write_text("\n\n" + good.read_text().replace("\n", "\n\n"))
    assert summarize(good)["total"]["ops"] == 5


def test_trace_refuses_an_output_directory_that_does_not_exist(tmp_path: Path) -> None:
    """As report and advise do: it used to create the folders."""
    run = run_lcache("trace", "-o", str(tmp_path / "no" / "such" / "t.trace"), "--", "true",
                     cwd=tmp_path)
    assert run.returncode == 2 and "does not exist" in run.stderr, run.stderr
    assert not (tmp_path / "no").exists()


def test_names_that_are_not_utf8_are_drawn_as_their_bytes(tmp_path: Path) -> None:
    """The finding: a traced file named in Latin-1 comes through JSON as a lone surrogate
    ("caf\\udce9.bin"), and matplotlib's text drawing was a traceback from `lcache report`.
    A lone surrogate that no file name decodes to is shown escaped too."""
    good = _good(tmp_path / "good.trace").read_text()
    odd = {"file": "/data/caf\udce9.bin", "off": 0, "size": 1, "ret": 1}
    worse = {"file": "/data/\ud800.bin", "off": 0, "size": 1, "ret": 1}
    (tmp_path / "odd.trace").write_text(good + _event(args=odd) + "\n" + _event(args=worse)
                                        + "\n")
    done = report(str(tmp_path / "odd.trace"), "-o", str(tmp_path / "r.html"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "r.html").read_text()
    assert "caf\\xe9.bin" in page and "\\ud800.bin" in page


def test_classes_past_the_first_two_dozen_are_one(tmp_path: Path) -> None:
    """The finding: every plot drew a line and a legend entry per class, and a 170 KB trace
    of 1,000 class names took 35 s to report (3,000: past a minute)."""
    good = _good(tmp_path / "good.trace").read_text()
    many = [_event(cat=f"c{i:03d}", args={"file": "/f", "off": 0, "size": 1 + i, "ret": 1})
            for i in range(200)]
    (tmp_path / "many.trace").write_text(good + "\n".join(many) + "\n")
    classes = summarize(tmp_path / "many.trace")["classes"]
    assert len(classes) == 24 and "other (178 classes)" in classes, sorted(classes)
    assert "c199" in classes and "c000" not in classes  # the most bytes are kept apart
    assert sum(c["ops"] for c in classes.values()) == 205


def test_a_recorded_size_past_2_62_is_refused_by_a_report(tmp_path: Path) -> None:
    """Binary blocks too: a size of int64's max would wrap the totals. record() refuses it
    (attack helper 87), so the recorded size is changed in the file, as another writer or a
    damaged file could have it."""
    import struct

    marked = 0x1234_5678_9ABC
    lcache.trace.enable(str(tmp_path / "t.trace"))
    try:
        lcache.trace.record("read", "/f", 0, marked, "data-source", 1000, 500, 1)
    finally:
        lcache.trace.disable()
    data = (tmp_path / "t.trace").read_bytes()
    assert data.count(struct.pack("<q", marked)) == 1
    (tmp_path / "t.trace").write_bytes(
        data.replace(struct.pack("<q", marked), struct.pack("<q", 2**63 - 1)))
    with pytest.raises(CorruptionError, match="not a byte count below 2"):
        summarize(tmp_path / "t.trace")


def test_a_recorded_read_that_moved_more_than_it_asked_is_refused(tmp_path: Path) -> None:
    """Binary blocks too: a read of 4 KiB that moved 1 TiB counted the TiB."""
    lcache.trace.enable(str(tmp_path / "t.trace"))
    try:
        lcache.trace.record("read", "/f", 0, 4096, "data-source", 1000, 500, 1 << 40)
    finally:
        lcache.trace.disable()
    with pytest.raises(CorruptionError, match="moved more bytes than it asked for"):
        summarize(tmp_path / "t.trace")


def test_two_outputs_on_one_file_are_refused_naming_both(tmp_path: Path) -> None:
    # (attack helper 47) the second output replaced the first and the command said it wrote both
    good = _good(tmp_path / "good.trace")
    (tmp_path / "link.json").symlink_to(tmp_path / "x.out")
    for command, words in (
            (["report", str(good), "-o", "x.out", "--json", "x.out"], ("-o", "--json")),
            (["report", str(good), "-o", "r.html", "--perfetto", "x.out", "--jsonl", "./x.out"],
             ("--perfetto", "--jsonl")),
            (["report", str(good), "-o", "x.out", "--json", "link.json"], ("-o", "--json")),
            (["advise", str(good), "--emit", "x.out", "-o", "x.out"], ("--emit", "-o"))):
        assert_one_line_error(run_lcache(*command, cwd=tmp_path), *words, "both write")
    assert not (tmp_path / "x.out").exists() and not (tmp_path / "r.html").exists()


def test_a_dash_prints_json_and_yaml_outputs_and_is_refused_for_files(tmp_path: Path) -> None:
    # (attack helper 47) only `report --json -` printed; the others wrote a file named '-'
    good = _good(tmp_path / "good.trace")
    run = report(str(good), "-o", "r.html", "--perfetto", "-", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout)) > 5
    run = report(str(good), "-o", "r.html", "--jsonl", "-", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert [json.loads(line) for line in run.stdout.splitlines()]
    run = run_lcache("advise", str(good), "--emit", "-", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("# DLIO workload") and "workload:" not in run.stdout
    for command in (["report", str(good), "-o", "-"], ["advise", str(good), "-o", "-"]):
        assert_one_line_error(run_lcache(*command, cwd=tmp_path), "-o -", "give a file name")
    run = run_lcache("trace", "-o", "-", "--", "true", cwd=tmp_path)
    assert run.returncode == 2 and "-o -" in run.stderr, run.stderr
    assert_one_line_error(report(str(good), "--json", "-", "--jsonl", "-", cwd=tmp_path),
                          "--json and --jsonl both print on stdout")
    assert_one_line_error(run_lcache("advise", str(good), "--json", "--emit", "-",
                                     cwd=tmp_path), "--json and --emit both print on stdout")
    assert not (tmp_path / "-").exists()


def test_trace_refuses_an_empty_output_and_one_given_twice(tmp_path: Path) -> None:
    # (attack helper 47) -o '' said "cannot write the trace : Is a directory"; -o A -o B
    # wrote B and said nothing of A
    run = run_lcache("trace", "-o", "", "--", "true", cwd=tmp_path)
    assert run.returncode == 2 and "an empty path" in run.stderr, run.stderr
    run = run_lcache("trace", "-o", "a.trace", "-o", "b.trace", "--", "true", cwd=tmp_path)
    assert run.returncode == 2 and "-o given 2 times" in run.stderr, run.stderr
    assert not (tmp_path / "a.trace").exists() and not (tmp_path / "b.trace").exists()
    assert_one_line_error(report(str(_good(tmp_path / "good.trace")), "--json", "",
                                 cwd=tmp_path), "--json ''", "an empty path")


@pytest.mark.parametrize(("command", "option", "what"), [
    ("report", "-o", "report"), ("report", "--json", "summary file"),
    ("report", "--perfetto", "Perfetto file"), ("report", "--jsonl", "JSON lines file"),
    ("advise", "--emit", "workload file"), ("advise", "-o", "page")])
def test_report_and_advise_refuse_an_output_given_twice(
        tmp_path: Path, command: str, option: str, what: str) -> None:
    # `-o A -o B` wrote B and said nothing of A (click keeps the last), as trace -o did
    good = _good(tmp_path / "good.trace")
    run = run_lcache(command, str(good), option, "a.out", option, "b.out", cwd=tmp_path)
    assert_one_line_error(run, f"{option} given 2 times (a.out, b.out); give one {what}")
    assert not (tmp_path / "a.out").exists() and not (tmp_path / "b.out").exists()
    assert not (tmp_path / "report.html").exists()
