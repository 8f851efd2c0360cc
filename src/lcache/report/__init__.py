"""The characterization report: summary statistics, plots, one self-contained HTML page."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from lcache.io import atomic_write
from lcache.report.load import Trace, load
from lcache.report.stats import summarize_trace, traffic_sentence, unfinished_note

PathLike = str | os.PathLike[str]

__all__ = ["Trace", "is_html_report", "is_json_lines", "is_json_summary", "is_perfetto",
           "json_lines_text", "load", "perfetto_text", "print_summary", "summarize",
           "write_perfetto", "write_report"]


def summarize(paths: PathLike | Sequence[PathLike]) -> dict[str, Any]:
    """The summary.json content of one or more trace files.

    Returns a dict whose ``classes`` maps each I/O class to ``ops, bytes, read_bytes,
    write_bytes, size_p50, size_p99, seq_fraction, MBps_mean, MBps_peak, lat_p50_us,
    lat_p99_us`` (and a few more counts), plus ``total``, ``top_files``, ``filesystems``,
    ``processes``, ``devices`` and ``trace``. Definitions: docs/trace.md.

    Raises:
        lcache.trace.TraceFormatError: a file is missing, truncated or not a trace.
    """
    return summarize_trace(load(paths))


def is_html_report(head: bytes) -> bool:
    """Whether ``head`` (a file's first 4 KiB) starts a page :func:`write_report` wrote:
    what ``lcache report`` may replace."""
    return head.startswith(b"<!DOCTYPE html>") and b"<title>lcache I/O report</title>" in head


def is_json_summary(head: bytes) -> bool:
    """Whether ``head`` (a file's first 4 KiB) starts a summary :func:`write_report` wrote
    (``json.dumps(summary, indent=2)``: its ``trace`` and that one's ``files`` come first)."""
    return head.startswith(b'{\n  "trace": {\n    "files": [')


def _mark(kind: str) -> str:
    # A metadata event of a name no reader acts on (lcache's loader counts it as ignored;
    # Perfetto and chrome://tracing act on the metadata names they know), first in the file:
    # it tells a later run that lcache wrote the file and may replace it. Nothing else there
    # is lcache's at a fixed place: the events are the traces', whatever those start with.
    return ('{"name":"lcache_export","ph":"M","pid":0,"tid":0,"args":{"written_by":'
            f'"lcache report {kind}"}}}}')


_PERFETTO_MARK = _mark("--perfetto")
_JSONL_MARK = _mark("--jsonl")


def is_perfetto(head: bytes) -> bool:
    """Whether ``head`` (a file's first 4 KiB) starts an array :func:`write_perfetto` wrote."""
    return head.startswith(f"[\n{_PERFETTO_MARK}".encode())


def is_json_lines(head: bytes) -> bool:
    """Whether ``head`` (a file's first 4 KiB) starts the JSON lines :func:`json_lines_text`
    wrote (``lcache report --jsonl``)."""
    return head.startswith(f"{_JSONL_MARK}\n".encode())


def _atomic_write(path: str, text: str) -> None:
    # 0o644: a report is made to be shared and opened by a browser. A path that is not UTF-8
    # (its bytes kept as surrogates by os.fsdecode) is shown escaped: "dm\udcff".
    atomic_write(path, text.encode("utf-8", "backslashreplace"), mode=0o644)


def write_report(paths: PathLike | Sequence[PathLike], html_path: PathLike,
                 json_path: PathLike | None = None) -> dict[str, Any]:
    """Write the HTML report (and summary.json) of the traces; returns the summary.

    Raises:
        lcache.trace.TraceFormatError: a file is missing, truncated or not a trace.
    """
    from lcache.report.html import render
    from lcache.report.plots import all_plots

    trace = load(paths)
    summary = summarize_trace(trace)
    _atomic_write(os.fspath(html_path), render(summary, all_plots(trace, summary)))
    if json_path is not None:
        _atomic_write(os.fspath(json_path), json.dumps(summary, indent=2) + "\n")
    return summary


def perfetto_text(paths: PathLike | Sequence[PathLike]) -> str:
    """All events of the traces as one JSON array (what Perfetto and chrome://tracing open),
    after a metadata event that says lcache wrote it (:func:`is_perfetto`)."""
    from lcache.report.load import _lines

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    lines = [_PERFETTO_MARK]
    for p in paths:
        for _, line in _lines(os.fspath(p)):
            text = line.strip().rstrip(",")
            if text and text not in ("[", "]"):
                lines.append(text)
    return "[\n" + ",\n".join(lines) + "\n]\n"


def write_perfetto(paths: PathLike | Sequence[PathLike], out: PathLike) -> None:
    """Write :func:`perfetto_text` of the traces to ``out``."""
    _atomic_write(os.fspath(out), perfetto_text(paths))


def json_lines_text(paths: PathLike | Sequence[PathLike]) -> str:
    """All events of the traces as Chrome trace events, one JSON object per line (the
    recorder's binary blocks decoded), after a metadata line that says lcache wrote them
    (:func:`is_json_lines`)."""
    from lcache.report.load import json_lines

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    return _JSONL_MARK + "\n" + "".join(line for p in paths for line in json_lines(os.fspath(p)))


def print_summary(summary: dict[str, Any]) -> None:
    """A rich table of the per-class figures on the terminal."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"I/O by class ({summary['trace']['io_events']:,} events, "
                        f"{summary['trace']['span_s']:.2f} s)")
    table.add_column("class", no_wrap=True)
    for c in ("ops", "read MiB", "write MiB", "size p50/p99", "seq", "MB/s mean/peak",
              "lat p50/p99 us"):
        table.add_column(c, justify="right")

    def size(n: int | None) -> str:
        if n is None:  # a p99 of fewer than 100 ops
            return "-"
        for unit in ("B", "K", "M", "G"):
            if n < 1024:
                return f"{n:g}{unit}"
            n //= 1024
        return f"{n}T"

    def rate(r: float | None, digits: int = 0) -> str:
        return "-" if r is None else f"{r:,.{digits}f}"  # None: over no time, undefined

    for name, c in [*summary["classes"].items(), ("total", summary["total"])]:
        table.add_row(name, f"{c['ops']:,}", f"{c['read_bytes'] / 2**20:,.1f}",
                      f"{c['write_bytes'] / 2**20:,.1f}",
                      f"{size(c['size_p50'])}/{size(c['size_p99'])}", f"{c['seq_fraction']:.2f}",
                      f"{rate(c['MBps_mean'])}/{rate(c['MBps_peak'])}",
                      f"{c['lat_p50_us']:,.0f}/"
                      + ("-" if c["lat_p99_us"] is None else f"{c['lat_p99_us']:,.0f}"))
    Console().print(table)
    if not summary["trace"]["io_events"] and summary["processes"]:
        Console().print("no I/O events: the table counts lcache.io operations (and system "
                        "calls under `lcache trace --syscalls`), not the processes' other "
                        "file I/O", markup=False, highlight=False, soft_wrap=True)
    note = unfinished_note(summary)
    if note is not None:
        Console().print(f"warning: {note}", style="yellow", markup=False, highlight=False,
                        soft_wrap=True)
    for f in summary["filesystems"].values():
        Console().print(f"filesystem {f['mount']} ({f['fs'] or 'type unknown'}"
                        f"{', in memory' if f['memory'] else ''}): read "
                        f"{f['read_bytes'] / 2**20:,.1f} MiB, wrote "
                        f"{f['write_bytes'] / 2**20:,.1f} MiB", markup=False, highlight=False)
    for dev, d in summary["devices"].items():
        if d["read_bytes"] or d["write_bytes"]:
            Console().print(f"device {dev}: read {d['read_bytes'] / 2**20:,.1f} MiB, "
                            f"wrote {d['write_bytes'] / 2**20:,.1f} MiB, peak "
                            f"{rate(d['MBps_peak'], 1)} MB/s, {rate(d['IOPS_peak'])} IOPS "
                            "while the trace ran", markup=False, highlight=False)
    sentence = traffic_sentence(summary["traced_vs_devices"]) if summary["devices"] else None
    if sentence is not None:
        Console().print(sentence, markup=False, highlight=False, soft_wrap=True)
