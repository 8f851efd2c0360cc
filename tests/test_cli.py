"""The lcache command line, run as a real subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lcache.store import Store

from .conftest import assert_one_line_error, mounted_tmpfs, run_lcache, signal_when

LCACHE = [sys.executable, "-m", "lcache"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LCACHE, *args], capture_output=True, text=True, timeout=300)


def make_store(root: Path) -> None:
    with Store.open(root, capacity="8MiB", segment_size="256KiB", max_writers=2) as store:
        store.put_many(range(100), [os.urandom(3000) for _ in range(100)])
        store.put(b"name", b"value")
        store.get_many(range(50))


def test_stats_json(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    out = run("stats", str(tmp_path / "s"), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["live_keys"] == 101
    assert doc["capacity"] == 8 << 20
    assert doc["totals"]["puts"] == 101
    assert doc["totals"]["hits"] == 50
    assert 0 < doc["bytes_on_disk"] <= doc["capacity"]


def test_stats_table(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    out = run("stats", str(tmp_path / "s"))
    assert out.returncode == 0, out.stderr
    assert "live_keys" in out.stdout and "101" in out.stdout


@pytest.mark.parametrize("name", ["no[bold]such", "no[/]such", "a[red]b[/red]"])
def test_a_path_that_looks_like_markup_is_printed_as_given(tmp_path: Path, name: str) -> None:
    """Regression: rich read error lines and table titles as markup: "no[bold]such" was
    printed as "nosuch", and "no[/]such" was a MarkupError traceback."""
    missing = str(tmp_path / name)
    assert_one_line_error(run("report", missing), f"{missing}: no such trace file")
    make_store(tmp_path / name)
    out = subprocess.run([*LCACHE, "stats", str(tmp_path / name)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "COLUMNS": "1000"})
    assert out.returncode == 0 and f"lcache store {tmp_path / name}" in out.stdout, out


def test_ctrl_c_ends_a_command_with_130(tmp_path: Path) -> None:
    """Regression: Ctrl-C ended with status 1, which a script reads as a failure; a shell
    reports 128 + SIGINT."""
    proc = subprocess.Popen([*LCACHE, "store-demo", "--samples", "200000", "--dir",
                             str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    segments = tmp_path / "store" / "segments"
    err = signal_when(proc, lambda: segments.is_dir() and len(os.listdir(segments)) > 2,
                      signal.SIGINT)  # writing samples
    assert proc.returncode == 130 and err.strip().endswith("Aborted!"), (proc.returncode, err)


def test_stats_of_a_warmed_cache_counts_demand_misses_and_says_no_reads_yet(
        tmp_path: Path) -> None:
    """The finding (newcomer helper 55): lcache stats lacked demand_misses, which ds.stats()
    has, and a cache filled only by lcache warm printed hit_ratio None."""
    (tmp_path / "d").mkdir()
    for i in range(4):
        (tmp_path / "d" / f"{i}.bin").write_bytes(os.urandom(3000))
    cache = str(tmp_path / "c")
    assert run("warm", str(tmp_path / "d"), "--cache", cache, "--capacity", "8MB",
               "--json").returncode == 0
    table = run("stats", cache)
    assert table.returncode == 0, table.stderr
    assert "None" not in table.stdout and "no reads yet" in table.stdout
    assert "demand_misses" in table.stdout
    # the ratio counts every epoch and warm's fetches: said so (newcomer helper 84)
    assert "hit_ratio (all time)" in table.stdout
    doc = json.loads(run("stats", cache, "--json").stdout)
    assert doc["hit_ratio"] is None and doc["counters"]["demand_misses"] == 0
    assert doc["counters"]["fetches"] == 4


def test_stats_of_missing_store_is_a_clear_error(tmp_path: Path) -> None:
    out = run("stats", str(tmp_path / "nothing"))
    assert out.returncode == 2
    assert "no lcache store" in out.stderr
    assert "Traceback" not in out.stderr


def listing(root: Path) -> list[tuple[str, int, int]]:
    return [(str(p.relative_to(root)), p.lstat().st_mode, p.lstat().st_mtime_ns)
            for p in [root, *sorted(root.rglob("*"))]]


@pytest.mark.parametrize("args", [("stats",), ("stats", "--json"), ("fsck",),
                                  ("fsck", "--repair"), ("fsck", "--repair", "--json")])
def test_an_ordinary_directory_is_refused_and_left_alone(tmp_path: Path,
                                                         args: tuple[str, ...]) -> None:
    """Regression: `lcache stats DIR` and `lcache fsck [--repair] DIR` exited 0 on an ordinary
    directory and made it a store (store.json, lock, index files, segments/)."""
    plain = tmp_path / ("a-directory-with-a-long-name-so-the-message-passes-80-columns" * 2)
    plain.mkdir(mode=0o700)
    (plain / "notes.txt").write_text("mine")
    before = listing(plain)
    out = run(*args, str(plain))
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.splitlines() == [f"error: no lcache store in {plain}"], out.stderr
    assert out.stdout == ""
    assert listing(plain) == before


@pytest.mark.parametrize("args", [("stats",), ("stats", "--json")])
def test_a_folder_with_a_store_json_lcache_did_not_write_is_left_alone(
        tmp_path: Path, args: tuple[str, ...]) -> None:
    """The finding (attack helper 69, finding 2): `lcache stats DIR` on a folder whose
    store.json is not lcache's made `lock` (4096 B) and `segments/` there, zero-padded a
    user's `lock`, and said to run `lcache fsck --repair`, which cannot help."""
    folder = tmp_path / "h3"
    folder.mkdir(mode=0o700)
    (folder / "store.json").write_text('{"app": "x"}\n')
    (folder / "lock").write_text("my lock notes\n")
    before = listing(folder)
    out = run(*args, str(folder))
    err = assert_one_line_error(out, f"{folder / 'store.json'} is not an lcache store "
                                "configuration", "not an lcache store")
    assert "fsck" not in err and out.stdout == ""
    assert listing(folder) == before
    assert (folder / "lock").read_text() == "my lock notes\n"


@pytest.mark.parametrize("log", [None, "build.log"])
def test_store_demo_leaves_a_lock_it_did_not_write_alone(tmp_path: Path,
                                                         log: str | None) -> None:
    """The finding (attack helper 69, finding 2): `lcache store-demo --dir DIR` zero-padded
    a user's DIR/store/lock to 4096 bytes and used it ("p2" became "r2"); and (attack helper
    73, finding 1) still did when DIR/store/segments/ held a user's build.log."""
    (tmp_path / "store").mkdir(mode=0o700)
    (tmp_path / "store" / "lock").write_bytes(b"p2\n")
    if log is not None:
        (tmp_path / "store" / "segments").mkdir(mode=0o700)
        (tmp_path / "store" / "segments" / log).write_text("x\n")
    before = listing(tmp_path / "store")
    out = run("store-demo", "--dir", str(tmp_path), "--samples", "10")
    assert_one_line_error(out, f"{tmp_path / 'store' / 'lock'} is not the lock file of an "
                          "lcache store", "move it")
    assert listing(tmp_path / "store") == before
    assert (tmp_path / "store" / "lock").read_bytes() == b"p2\n"


def test_stats_of_a_folder_with_a_log_is_no_store(tmp_path: Path) -> None:
    """The finding (attack helper 73, finding 1): `lcache stats DIR` with a user's
    DIR/segments/app.log and DIR/lock zero-padded the lock and said DIR holds segments."""
    (tmp_path / "proj" / "segments").mkdir(mode=0o700, parents=True)
    (tmp_path / "proj" / "segments" / "app.log").write_text("x\n")
    (tmp_path / "proj" / "lock").write_bytes(b"p2\n")
    before = listing(tmp_path / "proj")
    out = run("stats", str(tmp_path / "proj"))
    assert_one_line_error(out, f"no lcache store in {tmp_path / 'proj'}")
    assert listing(tmp_path / "proj") == before


def test_fsck_clean_then_damaged_then_repaired(tmp_path: Path) -> None:
    root = tmp_path / "s"
    make_store(root)
    out = run("fsck", str(root), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["clean"] is True

    seg = sorted((root / "segments").glob("*.log"))[0]
    data = bytearray(seg.read_bytes())
    data[40] ^= 0xFF  # inside the payload of the first record
    seg.write_bytes(bytes(data))
    out = run("fsck", str(root), "--json")
    assert out.returncode == 2
    report = json.loads(out.stdout)
    assert not report["clean"]
    assert any("damaged record" in p for p in report["problems"])

    out = run("fsck", str(root), "--repair")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "repaired" in out.stdout and "clean" in out.stdout
    with Store.open(root) as store:
        assert store.get(0) is None  # the damaged record is now a miss
        assert store.get(99) is not None


def test_bad_capacity_is_refused_with_what_to_change(tmp_path: Path) -> None:
    code = ("from lcache.store import Store; "
            f"Store.open({str(tmp_path / 's')!r}, capacity='1MiB', segment_size='1MiB')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "raise capacity" in out.stderr


def test_store_demo_larger_than_the_free_space_is_refused_up_front(tmp_path: Path) -> None:
    """The finding (attack helper 98): --samples 10000000 --sample-size 2MiB, a 19 TiB
    dataset, was taken: every sample was made in memory first (5.5 GB after 10 s)."""
    out = run("store-demo", "--dir", str(tmp_path / "d"), "--samples", "10000000",
              "--sample-size", "2MiB")
    assert_one_line_error(out, "a 19.1 TiB dataset", f"in {tmp_path / 'd'}, which has",
                          "lower --samples or --sample-size")
    assert list(tmp_path.iterdir()) == []


def test_store_demo_run_again_in_its_dir_counts_the_store_it_reuses(tmp_path: Path) -> None:
    """The finding (attack helper 99): the free-space check did not count the store an
    earlier run left in --dir, which the run reuses: the second run was refused."""
    with mounted_tmpfs(tmp_path / "small", "48m") as mnt:
        for _ in range(2):  # a 36 MiB store (3/4 of 48 MiB of samples) fits only once
            out = run("store-demo", "--dir", str(mnt / "d"), "--samples", "3000",
                      "--sample-size", "16KiB", "--json")
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["fsck_clean"] is True


def test_demo_json(tmp_path: Path) -> None:
    out = run("store-demo", "--dir", str(tmp_path), "--samples", "3000", "--sample-size", "16KiB",
              "--json")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert figures["wrong_bytes_served"] == 0
    assert figures["crash_flushed_records"] > 0
    assert figures["crash_flushed_records_lost"] == 0
    assert figures["crash_segments_recovered"] >= 1
    assert figures["fsck_clean"] is True
    # the dataset is larger than the cache: some samples were evicted, the rest hit
    assert figures["evictions"] > 0
    assert 0.3 < figures["hit_ratio"] < 1.0
    assert os.listdir(tmp_path) == ["store"]  # the crashed writer's progress file is gone


def test_demo_of_a_dataset_smaller_than_the_minimum_capacity(tmp_path: Path) -> None:
    """Regression: the demo sized the store at segment x (writers + 1), which the minimum
    capacity (it counts the indexes now) refuses."""
    out = run("store-demo", "--dir", str(tmp_path), "--samples", "100", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["wrong_bytes_served"] == 0


def test_demo_says_a_capacity_below_the_minimum_before_running(tmp_path: Path) -> None:
    """The finding: the whole uncached run went first (about 10 s) before the error."""
    out = run("demo", "--dir", str(tmp_path), "--samples", "400", "--sample-size", "4KiB",
              "--epochs", "2", "--latency", "0.001")
    assert out.returncode == 2 and "is below the minimum" in out.stderr, out.stderr
    assert "no cache: epoch" not in out.stderr


@pytest.mark.parametrize("args", [
    ["stats"], ["stats", "/etc/hostname"], ["warm", "-o", "x"], ["report"], ["no-such-command"],
    ["model", "--no-such-option"], ["trace", "--interval", "x", "-o", "t", "--", "true"],
    ["demo", "--epochs", "0"], ["demo", "--cache-fraction", "nan"], ["demo", "--latency", "inf"],
    ["demo", "--workers", "-1"], ["store-demo", "--samples", "0"],
    ["store-demo", "--samples", "1", "--sample-size", "5GB"],
    ["warm", "src", "--cache", "c", "--capacity", "1MB", "--threads", "0"],
])
def test_usage_errors_are_one_line(tmp_path: Path, args: list[str]) -> None:
    """What click refuses (a missing argument, a value out of range) is one line naming the
    command's --help, like every other error, not click's four lines of usage."""
    out = subprocess.run([*LCACHE, *args], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert "Traceback" not in out.stderr + out.stdout


@pytest.mark.parametrize(("options", "words"), [
    (["-o", "=x"], "is not KEY=VALUE"),
    (["-o", "a=1", "-o", "a=2"], "given twice"),
    # fsspec's local filesystem took it and ignored it
    (["-o", "endpoint_url=http://127.0.0.1:9"], "mean nothing to the local path")])
def test_warm_options_without_a_key_or_twice_are_refused(
        tmp_path: Path, options: list[str], words: str) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"x" * 100)
    out = run("warm", str(tmp_path / "src"), "--cache", str(tmp_path / "c"), "--capacity",
              "64MB", *options)
    assert out.returncode == 2 and words in out.stderr, out.stderr


@pytest.mark.parametrize("content", [b"\xff\xfe garbage", b'{"format":2,', b"[1]", b"{}"])
def test_stats_of_a_cache_with_a_damaged_identity_is_one_line(tmp_path: Path,
                                                              content: bytes) -> None:
    (tmp_path / "cache.json").write_bytes(content)
    out = run("stats", str(tmp_path))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "cache.json is damaged" in out.stderr


def test_stats_of_a_cache_whose_identity_is_a_fifo_does_not_hang(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "cache.json")
    out = subprocess.run([*LCACHE, "stats", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "is a FIFO" in out.stderr, out.stderr


@pytest.mark.parametrize("args", [("stats", ""), ("fsck", " "), ("ckpt", "ls", ""),
                                  ("warm", "src", "--cache", ""),
                                  ("bench", "run", "w.yaml", "--output", "")])
def test_an_empty_directory_argument_is_refused(tmp_path: Path, args: tuple[str, ...]) -> None:
    """Regression: ``lcache stats ''`` looked at the current directory."""
    assert_one_line_error(run_lcache(*args, cwd=tmp_path), "an empty path; give a directory")


def test_warm_of_an_unreachable_url_names_it(tmp_path: Path) -> None:
    """Regression: ``lcache warm ftp://x`` printed "error: Name or service not known"."""
    out = run_lcache("warm", "ftp://x", "--cache", str(tmp_path / "c"), cwd=tmp_path)
    assert_one_line_error(out, "ftp://x")


def test_warm_checks_capacity_before_listing_the_source(tmp_path: Path) -> None:
    """Regression: ``--capacity 10XB`` was parsed after the whole source was listed (here the
    listing's warning about a FIFO came first; on S3 a typo cost a full listing)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"x" * 100)
    os.mkfifo(tmp_path / "src" / "fifo")
    out = run_lcache("warm", str(tmp_path / "src"), "--cache", str(tmp_path / "c"),
                     "--capacity", "10XB", cwd=tmp_path)
    assert_one_line_error(out, "--capacity", "'10XB'")
    assert not (tmp_path / "c").exists()


def test_warm_into_a_cache_of_another_source_says_which_field_differs(tmp_path: Path) -> None:
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        for i in range(3):
            (tmp_path / name / f"{i}.bin").write_bytes(os.urandom(3000))
    cache = str(tmp_path / "c")
    first = run_lcache("warm", str(tmp_path / "one"), "--cache", cache, "--capacity", "64MB",
                       "--json", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    out = run_lcache("warm", str(tmp_path / "two"), "--cache", cache, "--capacity", "64MB",
                     cwd=tmp_path)
    assert_one_line_error(out, "(its source differs)")


def test_warm_into_a_folder_with_a_store_folder_of_other_files_keeps_them(
        tmp_path: Path) -> None:
    """The finding (attack helper 47): `lcache warm SRC --cache proj` removed an existing
    proj/store/mycode/main.py, with exit 0."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"x" * 100)
    mine = tmp_path / "proj" / "store" / "mycode" / "main.py"
    mine.parent.mkdir(parents=True)
    mine.write_text("precious")
    out = run_lcache("warm", str(tmp_path / "src"), "--cache", str(tmp_path / "proj"),
                     "--capacity", "64MB", cwd=tmp_path)
    assert_one_line_error(out, "what no lcache store writes", "mycode")
    assert mine.read_text() == "precious"


def test_warm_warnings_name_lcache_once(tmp_path: Path) -> None:
    """The finding (attack helper 47): "WARNING lcache: lcache: ... is damaged": the log
    format names the logger, and the message named it again."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"x" * 100)
    (tmp_path / "c").mkdir(mode=0o700)
    (tmp_path / "c" / "cache.json").write_bytes(b"damaged")
    out = run_lcache("warm", str(tmp_path / "src"), "--cache", str(tmp_path / "c"),
                     "--capacity", "64MB", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "is damaged" in out.stderr and "lcache: lcache:" not in out.stderr, out.stderr


def test_warm_of_a_small_cache_takes_a_segment_size(tmp_path: Path) -> None:
    """The findings: warm was told to "lower segment_size", which it could not set (attack
    helper 47); a small dataset at 40% could then be warmed by no route, and a cache warmed
    with the default size refused training's smaller one (newcomer helper 84)."""
    (tmp_path / "src").mkdir()
    for i in range(200):
        (tmp_path / "src" / f"{i:03d}.bin").write_bytes(bytes([i]) * 10_000)
    args = ["warm", str(tmp_path / "src"), "--cache", str(tmp_path / "c"), "--capacity", "40%"]
    out = run_lcache(*args, cwd=tmp_path)
    assert_one_line_error(out, "is below the minimum", "CachedDataset(segment_size=...)",
                          "`lcache warm --segment-size`")
    assert_one_line_error(run_lcache(*args, "--segment-size", "16 parsecs", cwd=tmp_path),
                          "--segment-size")
    out = run_lcache(*args, "--segment-size", "16KiB", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["cached_samples"] > 0
    from lcache.data import CachedDataset

    ds = CachedDataset(str(tmp_path / "src"), tmp_path / "c", "40%", segment_size="16KiB")
    try:
        mark = ds.stats()
        assert ds[0] == b"\0" * 10_000 and ds.stats(since=mark)["fetches"] == 0  # warmed
    finally:
        ds.cache.close()


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_ckpt_ls_of_a_checkpoint_says_it_lists_a_folder(tmp_path: Path,
                                                        json_flag: list[str]) -> None:
    """Regression: ``lcache ckpt ls CKPT/step-3`` (a checkpoint, not its folder) printed an
    empty table and exited 0, while ``ckpt verify`` took the same path."""
    import numpy as np

    from lcache import checkpoint

    checkpoint.save({"w": np.ones(10)}, tmp_path / "ckpts" / "step-3")
    step = str(tmp_path / "ckpts" / "step-3")
    out = run_lcache("ckpt", "ls", step, *json_flag, cwd=tmp_path)
    assert_one_line_error(out, f"{step} is a checkpoint", f"give {tmp_path / 'ckpts'}")
    assert run_lcache("ckpt", "verify", step, cwd=tmp_path).returncode == 0
    listed = run_lcache("ckpt", "ls", str(tmp_path / "ckpts"), "--json", cwd=tmp_path)
    assert [c["name"] for c in json.loads(listed.stdout)["checkpoints"]] == ["step-3"]


def test_fsck_of_a_sample_cache_checks_its_store(tmp_path: Path) -> None:
    # (attack helper 47) it said "no lcache store" of the directory `lcache stats` reads
    (tmp_path / "src").mkdir()
    for i in range(3):
        (tmp_path / "src" / f"{i}.bin").write_bytes(os.urandom(1000))
    warm = run_lcache("warm", "src", "--cache", "c", cwd=tmp_path)
    assert warm.returncode == 0, warm.stderr
    out = run_lcache("fsck", "c", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["clean"] is True
    out = run_lcache("fsck", "c", cwd=tmp_path)
    assert out.returncode == 0 and "c/store" in out.stdout, out.stdout + out.stderr
