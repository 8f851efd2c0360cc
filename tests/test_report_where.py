"""Where the bytes went: cache I/O to files in memory (the /dev/shm staging area, any tmpfs)
is class cache-ram, not SSD traffic; bytes per filesystem; top files keep their prefix."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import lcache.trace
from lcache.data import CachedDataset
from lcache.report import plots as report_plots
from lcache.report import summarize, write_report
from lcache.report.load import json_lines, load
from lcache.store import Store

from .conftest import mounted_tmpfs

SIZE = 64 << 10


def test_staging_in_dev_shm_is_cache_ram_not_ssd(tmp_path: Path) -> None:
    trace = tmp_path / "t.trace"
    lcache.trace.enable(str(trace))
    ds = CachedDataset([bytes([i]) * SIZE for i in range(40)], tmp_path / "cache", "64MiB")
    try:
        if not ds.cache.staging_dir.startswith("/dev/shm/"):
            pytest.skip("/dev/shm has no room: staging is inside the cache directory here")
        ds.cache.prefetch_many(range(20), [False] * 20)  # staged in /dev/shm
        ds.cache.prefetch_many(range(20, 40), [True] * 20)  # kept in the SSD cache
        assert [item[0] for item in ds.__getitems__(list(range(40)))] == list(range(40))
    finally:
        ds.cache.close()
        lcache.trace.disable()
    s = summarize(trace)
    ram, ssd = s["classes"]["cache-ram"], s["classes"]["cache-write"]
    assert ram["write_bytes"] >= 20 * SIZE and ram["read_bytes"] >= 20 * SIZE
    assert 20 * SIZE <= ssd["write_bytes"] < 30 * SIZE  # staged samples are not in it
    assert s["classes"]["cache-read"]["read_bytes"] < 30 * SIZE
    shm = [f for f in s["filesystems"].values() if f["mount"] == "/dev/shm"]
    assert len(shm) == 1 and shm[0]["fs"] == "tmpfs" and shm[0]["memory"]
    assert shm[0]["classes"] == {"cache-ram": ram["bytes"]}
    disk = s["filesystems"][next(k for k, f in s["filesystems"].items()
                                 if str(tmp_path).startswith(f["mount"]) and not f["memory"])]
    assert disk["classes"]["cache-write"] == ssd["write_bytes"]
    assert "cache-ram" not in disk["classes"]
    assert all(f["fs"] for f in s["top_files"] if f["file"].startswith(("/dev/shm", "/tmp")))
    page = tmp_path / "r.html"
    write_report(trace, page)
    assert "Where the bytes went" in page.read_text() and "/dev/shm" in page.read_text()


def test_any_tmpfs_is_memory_and_named_by_its_mount(tmp_path: Path) -> None:
    trace = tmp_path / "t.trace"
    with mounted_tmpfs(tmp_path / "ram", "8m") as ram:
        lcache.trace.enable(str(trace))
        try:
            for root in (ram / "store", tmp_path / "disk"):
                with Store.open(str(root), capacity="4MiB", segment_size="256KiB",
                                max_writers=2) as store:
                    store.put(1, b"x" * SIZE)
                    assert store.get(1) == b"x" * SIZE
        finally:
            lcache.trace.disable()
        s = summarize(trace)
    ram_fs = [f for f in s["filesystems"].values() if f["mount"] == str(ram)]
    assert len(ram_fs) == 1 and ram_fs[0]["fs"] == "tmpfs" and ram_fs[0]["memory"]
    assert set(ram_fs[0]["classes"]) == {"cache-ram"}
    assert s["classes"]["cache-ram"]["write_bytes"] >= SIZE
    assert s["classes"]["cache-write"]["write_bytes"] >= SIZE  # the store on disk


def _event(fid: int, cat: str, op: str = "write") -> str:
    return json.dumps({"name": op, "cat": cat, "pid": 7, "tid": 7, "ts": 10.0 + fid,
                       "dur": 1.0, "ph": "X",
                       "args": {"fid": fid, "off": 0, "size": 4096, "ret": 4096}})


def test_a_trace_without_filesystems_still_loads(tmp_path: Path) -> None:
    """Traces written before the recorder noted filesystems: /dev/shm is told by its path."""
    names = {1: "/dev/shm/lcache-0123456789abcdef/segments/seg-000001",
             2: "/nvme/cache/store/segments/seg-000001"}
    lines = [json.dumps({"name": "process_name", "ph": "M", "pid": 7, "tid": 7,
                         "args": {"name": "train.py", "wall_minus_mono_us": 0.0}})]
    for fid, name in names.items():
        lines.append(json.dumps({"name": "file_name", "ph": "M", "pid": 7, "tid": 7,
                                 "args": {"fid": fid, "name": name}}))
        lines.append(_event(fid, "cache-write"))
    old = tmp_path / "old.trace"
    old.write_text("\n".join(lines) + "\n")
    s = summarize(old)
    assert s["classes"]["cache-ram"]["write_bytes"] == 4096
    assert s["classes"]["cache-write"]["write_bytes"] == 4096
    assert s["filesystems"]["/dev/shm"]["memory"] and s["filesystems"]["(unknown)"]["ops"] == 1


def test_top_files_keep_the_prefix_that_tells_dev_shm_apart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    long = "/dev/shm/lcache-" + "0123456789abcdef" * 3 + "/segments/seg-000000000001"
    disk = "/nvme/cache/" + "d" * 60 + "/segments/seg-000000000001"
    lines = [json.dumps({"name": "file_name", "ph": "M", "pid": 7, "tid": 7,
                         "args": {"fid": 1, "name": long}}),
             json.dumps({"name": "file_name", "ph": "M", "pid": 7, "tid": 7,
                         "args": {"fid": 2, "name": disk}}),
             _event(1, "cache-write"), _event(2, "cache-write")]
    t = tmp_path / "t.trace"
    t.write_text("\n".join(lines) + "\n")
    figs: list[Any] = []
    monkeypatch.setattr(report_plots, "_png", lambda fig: figs.append(fig) or "")
    trace = load(t)
    report_plots.top_files(summarize(t))
    labels = [x.get_text() for x in figs[0].axes[0].get_yticklabels()]
    assert any(label.startswith("[tmpfs] /dev/shm/") for label in labels), labels
    assert any("/nvme/cache/" in label for label in labels), labels
    assert len(trace.files) == 2


def test_recorded_files_carry_their_filesystem(tmp_path: Path) -> None:
    trace = tmp_path / "t.trace"
    lcache.trace.enable(str(trace))
    try:
        lcache.trace.record("read", str(trace), 0, 1, "other", 1000, 10, 1)
        lcache.trace.record("read", "s3://bucket/x", 0, 1, "data-source", 1000, 10, 1)
    finally:
        lcache.trace.disable()
    meta = {e["args"]["name"]: e["args"] for e in map(json.loads, json_lines(str(trace)))
            if e.get("name") == "file_name"}
    st = os.stat(trace)
    assert meta[str(trace)]["dev"] == f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    assert meta[str(trace)]["fs"] and str(trace).startswith(meta[str(trace)]["mnt"])
    assert "dev" not in meta["s3://bucket/x"]
