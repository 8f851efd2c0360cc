"""advice.html: the characterization report's page (``lcache report``) with an "Advice" section
at its top. One self-contained page: the report's CSS, plots as data: URIs, every string
escaped."""

from __future__ import annotations

import json
from typing import Any

from lcache.report.html import escape, render, table
from lcache.report.load import Trace
from lcache.report.plots import all_plots
from lcache.report.stats import summarize_trace

_ANCHOR = "<h2>Per class</h2>"
#: the page's title, which tells it from the report's page (``lcache report -o``): each
#: command replaces only a page of its own
TITLE = "lcache advice"


def is_advice_page(head: bytes) -> bool:
    """Whether ``head`` (a file's first 4 KiB) starts a page :func:`render_page` wrote: what
    ``lcache advise -o`` may replace."""
    return head.startswith(b"<!DOCTYPE html>") and f"<title>{TITLE}</title>".encode() in head


def _advice_rows(items: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for a in items:
        if "missing" in a:
            rows.append([escape(a["topic"]), "not fitted", escape(a["missing"])])
        else:
            rows.append([escape(a["topic"]), escape(f"{a['figure']} = {a['value']}"),
                         escape(a["arithmetic"])])
    return rows


def section(doc: dict[str, Any]) -> str:
    """The Advice section: advice with its arithmetic, what was not fitted, the emitted
    workload, the scaled figures and the storage check."""
    parts = ["<h2>Advice</h2>",
             table(["topic", "advice", "arithmetic"], _advice_rows(doc["advice"]), left=3)]
    if doc["unfitted"]:
        parts.append("<h2>Not fitted</h2><ul>" + "".join(
            f"<li><b>{escape(u['what'])}</b>: {escape(u['why'])}</li>" for u in doc["unfitted"])
            + "</ul>")
    fit = doc["fit"]
    cols = ("ops", "read_bytes_per_step", "write_bytes_per_step", "read_fraction", "size_p50",
            "size_p90", "seq_fraction", "concurrency_mean", "threads")
    parts.append("<h2>Fitted per class group</h2>")
    parts.append(table(["group", *cols], [
        [escape(name)] + [escape("n/a" if g[c] is None else g[c]) for c in cols]
        for name, g in fit["groups"].items()]))
    parts.append(f'<p class="small">steps: {escape(json.dumps(fit["steps"]))}<br>dataset: '
                 f'{escape(json.dumps(fit["dataset"]))}<br>checkpoint: '
                 f'{escape(json.dumps(fit["checkpoint"]))}</p>')
    if doc.get("check"):
        c = doc["check"]
        parts.append(f"<h2>Check on {escape(c['storage'])}</h2>")
        parts.append(table(["class", "keeps up", "margin", "arithmetic"], [
            [escape(k), "yes" if v["keeps_up"] else "NO", escape(v["margin"]),
             escape(v["arithmetic"])]
            for k, v in c["classes"].items()], left=1))
        parts.append(f'<p class="small">{escape(c["verdict"])}</p>')
    if doc.get("scale"):
        parts.append("<h2>Scaled to the target cluster</h2><pre>"
                     f"{escape(json.dumps(_scale_view(doc['scale']), indent=1))}</pre>")
    parts.append("<h2>Emitted DLIO workload</h2><pre>"
                 f"{escape(doc['workload']['yaml'])}</pre>")
    return "\n".join(parts)


def _scale_view(scale: dict[str, Any]) -> dict[str, Any]:
    """The scale figures without the model's full prediction (it is in --json)."""
    out = {k: v for k, v in scale.items() if k != "model"}
    if "model" in scale:
        out["model_ssd_verdict"] = scale["model"]["ssd"]["verdict"]
    return out


def render_page(trace: Trace, doc: dict[str, Any]) -> str:
    """The report's page for ``trace`` with the Advice section first."""
    summary = summarize_trace(trace)
    page = render(summary, all_plots(trace, summary), title=TITLE)
    at = page.find(_ANCHOR)
    if at < 0:  # the report's layout changed: the advice still goes before its body
        at = page.find("<h1>")
    return page[:at] + section(doc) + "\n" + page[at:]
