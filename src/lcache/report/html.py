"""One self-contained HTML page: inline CSS, plots as data: URIs, no network at view time.

Every string from the trace (file names, process names) goes through ``html.escape``.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
from typing import Any

from lcache.report.plots import Plot
from lcache.report.stats import traffic_sentence, unfinished_note

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#222;
background:#fff;max-width:1100px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f2f2f2}td.l,th.l{text-align:left}
figure{margin:16px 0}figcaption{font-size:12px;color:#555}
img.plot{max-width:100%;border:1px solid #eee}
.small{font-size:12px;color:#555}
.warn{background:#fff3cd;border:1px solid #e0b400;padding:6px 10px}
"""

# Tells a headless browser (and the report test) that every plot decoded.
_SCRIPT = """
window.addEventListener('load', function () {
  var imgs = document.querySelectorAll('img.plot'), ok = 0;
  for (var i = 0; i < imgs.length; i++) {
    if (imgs[i].complete && imgs[i].naturalWidth > 0) { ok++; }
  }
  document.body.setAttribute('data-plots-loaded', ok + '/' + imgs.length);
  console.log('lcache-report: ' + ok + '/' + imgs.length + ' plots loaded');
});
"""

# Only this script may run (its hash, not 'unsafe-inline'): were a name from the trace ever
# to slip past escaping as a <script>, the browser would not run it.
_SCRIPT_HASH = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()

_CLASS_COLS = ("ops", "bytes", "read_bytes", "write_bytes", "size_p50", "size_p99",
               "seq_fraction", "MBps_mean", "MBps_peak", "lat_p50_us", "lat_p99_us")


def escape(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(key: str, value: Any) -> str:
    if value is None:  # a p99 of fewer than 100 ops, a rate over no time
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f}" if key == "seq_fraction" else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return escape(value)


def table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    head = "".join(f'<th class="l">{escape(h)}</th>' if i < left else f"<th>{escape(h)}</th>"
                   for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="l">{c}</td>' if i < left else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render(summary: dict[str, Any], plots: list[Plot], title: str = "lcache I/O report") -> str:
    t = summary["trace"]
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        f"img-src data:; style-src 'unsafe-inline'; script-src 'sha256-{_SCRIPT_HASH}'\">",
        f"<title>{escape(title)}</title>", f"<style>{_CSS}</style></head><body>",
        "<h1>lcache I/O characterization</h1>",
        f'<p class="small">Trace: {", ".join(escape(p) for p in t["files"])} &middot; '
        f'{t["io_events"]:,} I/O events, {t["processes"]} processes, '
        f'{t["span_s"]:.2f} s of I/O'
        + (f'; {t["repeated_events"]:,} exact repeats of an event dropped'
           if t.get("repeated_events") else "") + ".</p>",
    ]
    note = unfinished_note(summary)
    if note is not None:
        parts.append(f'<p class="warn" id="unfinished">Warning: {escape(note)}.</p>')
    parts.append("<h2>Per class</h2>")
    rows = [[escape(name)] + [_fmt(k, v.get(k, 0)) for k in _CLASS_COLS]
            for name, v in summary["classes"].items()]
    rows.append(["<b>total</b> (without syscall)"] +
                [_fmt(k, summary["total"].get(k, 0)) for k in _CLASS_COLS])
    parts.append(table(["class", *_CLASS_COLS], rows))
    parts.append('<p class="small">Bytes are bytes transferred; MB = 10<sup>6</sup> bytes; '
                 "percentiles are nearest-rank, and a p99 is n/a for a class of fewer than "
                 "100 ops (no op would lie above it); definitions in docs/trace.md.</p>")
    for i, (title, caption, png) in enumerate(plots):
        parts.append(f'<figure><h2>{escape(title)}</h2><img class="plot" id="plot-{i}" '
                     f'alt="{escape(title)}" src="data:image/png;base64,{png}">'
                     f"<figcaption>{escape(caption)}</figcaption></figure>")
    if summary["filesystems"]:
        parts.append("<h2>Where the bytes went (filesystems)</h2>")
        parts.append('<p class="small">The filesystem each file lives on (device number, '
                     "mount point, type). A file in memory (tmpfs, ramfs) never reaches a "
                     "storage device; cache I/O there is class cache-ram.</p>")
        parts.append(table(["mount", "fs", "device", "in memory", "ops", "read_bytes",
                             "write_bytes", "bytes per class"], [
            [escape(f["mount"]), escape(f["fs"]), escape(f["dev"]), "yes" if f["memory"] else "no",
             f"{f['ops']:,}", f"{f['read_bytes']:,}", f"{f['write_bytes']:,}",
             escape(", ".join(f"{c} {b:,}" for c, b in f["classes"].items()))]
            for f in summary["filesystems"].values()], left=4))
    if summary["top_files"]:
        parts.append("<h2>Top files</h2>")
        parts.append(table(["file", "filesystem", "bytes", "ops", "classes"], [
            [escape(f["file"]), escape(f"{f['fs']} {f['mount']}".strip()), f"{f['bytes']:,}",
             f"{f['ops']:,}", escape(", ".join(f["classes"]))]
            for f in summary["top_files"]], left=2))
    if summary["processes"]:
        parts.append("<h2>Processes (/proc/&lt;pid&gt;/io)</h2>")
        parts.append(table(["pid", "command", "read_bytes", "write_bytes", "rchar", "wchar",
                             "seconds"], [
            [escape(pid), escape(p["name"][:120]), f"{p['read_bytes']:,}", f"{p['write_bytes']:,}",
             f"{p['rchar']:,}", f"{p['wchar']:,}", f"{p['seconds']:.2f}"]
            for pid, p in summary["processes"].items()], left=2))
    if summary["devices"]:
        parts.append("<h2>Devices (/proc/diskstats)</h2>")
        tv = summary["traced_vs_devices"]
        sentence = traffic_sentence(tv)
        if sentence is not None:
            parts.append(f'<p class="small">{escape(sentence)}</p>')
        cols = ["read_bytes", "write_bytes", "reads", "writes", "MBps_mean", "MBps_peak",
                "IOPS_mean", "IOPS_peak", "busy_fraction"]
        parts.append(table(["device", *cols], [
            [escape(dev)] + [_fmt(k, d[k]) for k in cols]
            for dev, d in summary["devices"].items()]))
    parts.append("<h2>summary.json</h2><details><summary>show</summary><pre>"
                 f"{escape(json.dumps(summary, indent=1))}</pre></details>")
    parts.append(f"<script>{_SCRIPT}</script></body></html>")
    return "\n".join(parts)
