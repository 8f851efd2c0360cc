"""Check candidate storage: run the emitted workload there (``lcache bench``) and say per class
whether it keeps up, with the margin (what the storage gave / what the job needs)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from lcache.bench import BenchOptions, parse_workload, run_workload
from lcache.errors import ConfigError, LCacheError
from lcache.store.layout import format_decimal_size
from lcache.terminate import UnwindOnTerminate


def check_storage(storage: str) -> None:
    """Refuse a storage path that is not an existing directory, before anything runs: the
    check makes its folder in it, so a mistyped path was created
    (``--storage /nonexistent`` made /nonexistent/data) and a file was taken silently.

    Raises:
        ConfigError: ``storage`` does not exist or is not a directory.
    """
    if not os.path.isdir(storage):
        what = "not a directory" if os.path.lexists(storage) else "no such directory"
        raise ConfigError(f"storage {storage}: {what}; give an existing directory on the "
                          "storage to check (it is never created)")


@contextlib.contextmanager
def _check_folder(storage: str) -> Iterator[str]:
    """A new folder ``storage/lcache-check-XXXXXXXX``, removed when the block ends, however it
    ends: SIGTERM and SIGHUP unwind the block first (``UnwindOnTerminate``; they left 100 MiB
    of generated data in storage), and a signal or a Ctrl-C during the removal waits for it.

    Raises:
        ConfigError: the folder cannot be made in ``storage``.
    """
    work = ""
    with UnwindOnTerminate() as term:
        try:
            try:
                work = tempfile.mkdtemp(prefix="lcache-check-", dir=storage)
            except OSError as exc:
                raise ConfigError(f"storage {storage} cannot hold files ({exc.strerror}); "
                                  "give a directory on the storage to check") from None
            yield work
        finally:
            term.hold()  # the removal itself is never cut short
            # a second Ctrl-C cut the removal short and left the folder (and the handlers):
            # while it runs, Ctrl-C is only noted, and raised once it is done
            interrupted: list[int] = []
            main = threading.current_thread() is threading.main_thread()
            previous_int = signal.signal(signal.SIGINT, lambda s, f: interrupted.append(s)) \
                if main else None
            try:
                if work:
                    shutil.rmtree(work, ignore_errors=True)
            finally:
                if previous_int is not None:
                    signal.signal(signal.SIGINT, previous_int)
            if interrupted and not term.taken:
                raise KeyboardInterrupt


def run_check(doc: dict[str, Any], storage: str, fitted: dict[str, Any], max_stall: float,
              epochs: int = 1, show_progress: bool = True) -> dict[str, Any]:
    """Run ``doc`` (the emitted workload) with its data, checkpoints and output in a new
    folder ``storage/lcache-check-XXXXXXXX``, for at most ``epochs`` epochs; the verdict per
    class. The folder is removed afterwards, whatever happened: nothing else in ``storage``
    is touched (its ``data/train/img_*`` and ``output/summary.json``, DLIO's default layout,
    were replaced by the check's and 32 generated files were left there).

    Raises:
        ConfigError: the storage directory cannot be used (not yours, cannot hold files).
    """
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in doc.items()}
    if "train" in doc:
        doc["train"]["epochs"] = min(doc["train"]["epochs"], epochs)
    w = parse_workload(doc, "<lcache advise>")
    with _check_folder(storage) as work:
        opts = BenchOptions(data_dir=os.path.join(work, "data"),
                            output=os.path.join(work, "output"),
                            checkpoint_dir=os.path.join(work, "checkpoints"), generate=True,
                            show_progress=show_progress, progress_label="advise check: ")
        try:
            summary = run_workload(w, opts)
        except (LCacheError, OSError) as exc:
            _name_outside_error(exc, work, storage)
            raise
        # the bench's summary names folders in the check's folder, gone when it is read
        summary = _name_outside(summary, work, storage)
    m = summary["metric"]
    classes: dict[str, Any] = {}
    steps = fitted["steps"]
    data = fitted["groups"].get("data")
    if w.do_train and data is not None and steps["count"] and w.computation_time > 0:
        # the workload is a rank's (one rank runs here): a rank's step reads all ranks'
        # bytes over the ranks
        per_step = data["read_bytes"] / (steps["count"] * steps.get("ranks", 1))
        need = per_step / w.computation_time
        have = m.get("train_io_measured_mean_MB_per_second", 0.0) * 2**20
        au = m.get("train_au_mean_percentage", 0.0) / 100
        classes["data"] = {
            "needed_MBps": round(need / 1e6, 3),
            "measured_MBps": round(have / 1e6, 3), "au": round(au, 4),
            "keeps_up": au >= w.au,
            "margin": _margin(au, w.au),
            "arithmetic": (f"a step reads {per_step / 1e6:,.3f} MB "
                           f"in {w.computation_time:.4f} s of compute: "
                           f"{need / 1e6:,.1f} MB/s needed; AU {au:.1%} against "
                           f"{w.au:.0%} (margin = AU / target)")}
    ck = fitted["checkpoint"]
    saved = [c for c in summary.get("checkpoints", []) if c.get("kind") == "save"]
    if ck is not None and saved and steps["step_s"] and ck["interval_steps"]:
        window = max_stall / (1 - max_stall) * ck["interval_steps"] * steps["step_s"]
        need = ck["bytes_p50"] / window
        have = m.get("save_checkpoint_io_mean_GB_per_second", 0.0) * 2**30
        classes["checkpoint"] = {
            "needed_MBps": round(need / 1e6, 3), "measured_MBps": round(have / 1e6, 3),
            "keeps_up": have >= need, "margin": _margin(have, need),
            "arithmetic": (f"a {format_decimal_size(ck['bytes_p50'])} save every "
                           f"{ck['interval_steps']} steps of {steps['step_s']:.4f} s may stall "
                           f"{max_stall:g} of the time: {window:.3f} s, so "
                           f"{need / 1e6:,.1f} MB/s needed")}
    # the bench's summary itself: the folder its summary.json was written in is gone
    return {"storage": storage,
            "ran_in": f"{os.path.basename(work)}, a folder the check made in {storage} and "
                      "removed when it ended; the summary's folders are relative to it",
            "summary": summary, "verdict": summary["verdict"], "classes": classes}


def _forms(work: str) -> list[str]:
    """The names ``work`` goes by (as made, absolute, links resolved: the bench makes its
    folders absolute), longest first, so that one is not matched inside another."""
    return sorted({work, os.path.abspath(work), os.path.realpath(work)}, key=len, reverse=True)


def _gone(work: str) -> re.Pattern[str]:
    # ``work`` or a path under it, up to a space or punctuation that ends a path in a sentence
    return re.compile("(?:" + "|".join(map(re.escape, _forms(work)))
                      + r")(?:/[^\s,;:'\"]*[^\s,;:'\".])?")


def _said_outside(text: str, work: str, storage: str) -> str:
    """``text`` with each path in ``work`` (the check's folder, removed when it is read)
    said as the folder the user gave."""
    return _gone(work).sub(
        f"the check's temporary folder in {storage} (removed when the check ended)", text)


def _name_outside(value: Any, work: str, storage: str) -> Any:
    """``value`` (the bench's summary) with each path in ``work`` made relative to it
    ("data", "output"...), and each sentence naming one said by :func:`_said_outside`."""
    if isinstance(value, dict):
        return {k: _name_outside(v, work, storage) for k, v in value.items()}
    if isinstance(value, list):
        return [_name_outside(v, work, storage) for v in value]
    if isinstance(value, str) and _gone(work).search(value):
        if _gone(work).fullmatch(value):
            for form in _forms(work):
                if value == form or value.startswith(form + os.sep):
                    return os.path.relpath(value, form)
        return _said_outside(value, work, storage)
    return value


def _name_outside_error(exc: BaseException, work: str, storage: str) -> None:
    """Say the paths in ``exc`` (raised by the check, and read after its folder is gone) by
    :func:`_said_outside`, in place: the error keeps its class. ("generating the dataset
    needs about 101.5 MiB in DIR/lcache-check-levjefcr/data" named a folder that was gone.)"""
    exc.args = tuple(_said_outside(a, work, storage) if isinstance(a, str) else a
                     for a in exc.args)
    if isinstance(exc, OSError):
        for attr in ("filename", "filename2"):
            name = getattr(exc, attr)
            if isinstance(name, str) and _gone(work).search(name):
                setattr(exc, attr, _said_outside(name, work, storage))


def _margin(have: float, need: float) -> float:
    """``have / need`` to 3 decimals, rounded down: 0.9996 printed as 1.0 beside "does not
    keep up" (a rounding, not a contradiction, but it read as one)."""
    return math.floor(have / need * 1000) / 1000
