"""``lcache warm``'s figures: what the run fetched and what the cache holds, with another warm
of the same cache running beside it and with a disk that fills; its ``-o`` storage options."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lcache.data.warm import warm_cache
from lcache.errors import ConfigError

from .conftest import bounded_memory, make_files, moto_s3, mounted_tmpfs, subprocess_env

KIB = 1024


def test_two_warms_of_one_cache_count_what_each_fetched(tmp_path: Path) -> None:
    """The finding (attack helper 69, finding 5): two warms of one cache at once each said
    fetched_samples = every sample (what it had planned, before the other fetched any), while
    their fetched_bytes added up to one copy; the samples each fetched add up to one copy."""
    n, size = 2000, 16 * KIB
    make_files(tmp_path / "src", n, size=size)
    env = subprocess_env()
    env.pop("LCACHE_TRACE", None)
    args = [sys.executable, "-m", "lcache", "warm", str(tmp_path / "src"), "--cache",
            str(tmp_path / "cache"), "--capacity", "100MB", "--threads", "1", "--json"]
    runs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=bounded_memory) for _ in range(2)]
    docs = []
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        docs.append(json.loads(out))
    assert sum(d["fetched_samples"] for d in docs) == n, docs
    assert sum(d["fetched_bytes"] for d in docs) == n * size, docs
    # what the cache holds when each run ends: all of it once both have
    assert max(d["cached_samples"] for d in docs) == n, docs
    assert all(d["cached_samples"] >= d["fetched_samples"] for d in docs), docs
    again = warm_cache(str(tmp_path / "src"), str(tmp_path / "cache"), "100MB",
                       show_progress=False)
    assert (again["fetched_samples"], again["fetched_bytes"], again["cached_samples"]) == \
        (0, 0, n)


@pytest.mark.root
def test_cached_samples_are_those_the_cache_holds_when_the_disk_fills(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The finding (attack helper 69, finding 5): cached_samples was what the capacity holds,
    so a disk that filled before the capacity was used still reported every sample cached."""
    caplog.set_level(logging.WARNING, logger="lcache")
    make_files(tmp_path / "src", 128, size=64 * KIB)  # 8 MiB: more than the 6 MiB device
    with mounted_tmpfs(tmp_path / "mnt", "6m") as mnt:
        doc = warm_cache(str(tmp_path / "src"), str(mnt / "cache"), "64MiB", threads=1,
                         show_progress=False)
    assert doc["admit_failures"] == 1, doc
    assert doc["fetched_samples"] == 128, doc  # all fetched, the refused ones staged
    assert 0 < doc["cached_samples"] < 96, doc  # 96 x 64 KiB = 6 MiB


def test_option_values_are_typed_so_anon_false_signs_its_requests(tmp_path: Path) -> None:
    """The finding (attack helper 87): every -o value was a string, and s3fs takes the
    string "false" as true: -o anon=false sent unsigned requests, refused as Forbidden."""
    import s3fs

    env = {**subprocess_env(), "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
           "AWS_DEFAULT_REGION": "us-east-1"}
    env.pop("LCACHE_TRACE", None)
    with moto_s3() as url:
        fs = s3fs.S3FileSystem(key="x", secret="x", endpoint_url=url, skip_instance_cache=True)
        fs.mkdir("bkt")
        for i in range(4):
            fs.pipe(f"bkt/tr/f{i}.bin", b"x" * 10_000)

        def warm(name: str, *options: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "lcache", "warm", "s3://bkt/tr/", "--cache",
                 str(tmp_path / name), "--capacity", "3MB", "--segment-size", "64KiB",
                 "-o", f"endpoint_url={url}", *options, "--json"],
                env=env, capture_output=True, text=True, timeout=120)

        for value in ("false", "False", "FALSE"):
            out = warm(value, "-o", f"anon={value}")
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["fetched_samples"] == 4
        out = warm("true", "-o", "anon=true")  # unsigned: moto refuses them
        assert out.returncode == 2 and "Forbidden" in out.stderr, out.stderr


@pytest.mark.parametrize("text, value", [
    ("false", False), ("TRUE", True), ("null", None), ("8", 8), ("-1.5", -1.5),
    # kept as typed (attack round 21: read as YAML they became 511, "abc", 750, a date, True)
    ("0777", "0777"), ("abc #def", "abc #def"), ("12:30", "12:30"), ("2024-01-01", "2024-01-01"),
    ("yes", "yes"), ("", ""), ("~", "~"), ("1e3", "1e3"), ("&a x", "&a x"),
    # JSON for a mapping, a list or a string of digits (attack round 22)
    ('{"Authorization": "Bearer x"}', {"Authorization": "Bearer x"}), ("[1, 2]", [1, 2]),
    ('"12345678"', "12345678")])
def test_option_values_are_typed_only_when_plain(text: str, value: object) -> None:
    from lcache.cli.main import _option_value

    got = _option_value(text)
    assert got == value and type(got) is type(value)


def _staging_of(cache: Path) -> list[str]:
    """The /dev/shm staging areas whose origin is the cache directory ``cache``."""
    found = []
    for entry in Path("/dev/shm").glob("lcache-*"):
        try:
            origin = (entry / "origin").read_text().partition("\n")[0]
        except OSError:
            continue
        if str(cache) in origin:
            found.append(entry.name)
    return found


def test_a_warm_stopped_by_sigterm_leaves_no_staging_and_stops_at_once(tmp_path: Path) -> None:
    """(attack helper 87) `timeout` stopping `lcache warm` left its staging area in /dev/shm
    until the cache was next opened; and its thread pool would have fetched every group it
    had queued before letting the process go."""
    from lcache.testing import ThrottledServer

    make_files(tmp_path / "data", 400)
    with ThrottledServer(str(tmp_path), latency=0.05) as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lcache", "warm", server.url + "/data/", "--cache",
             str(tmp_path / "cache"), "--capacity", "64MiB", "--threads", "1", "--json"],
            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            while server.paths["/data/s0010.bin"] == 0:  # it is fetching
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.05)
            assert _staging_of(tmp_path / "cache")
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGTERM
        assert sum(server.paths.values()) < 200  # not the 400 queued
    assert _staging_of(tmp_path / "cache") == []


@pytest.mark.parametrize("threads", [0, -1, 1.5, 10**9, True, "4"])
def test_threads_out_of_range_are_refused_as_the_cli_refuses_them(tmp_path: Path,
                                                                  threads: object) -> None:
    """The finding (attack helper 98): warm_cache(threads=0, -1, 1.5 or 10**9) was taken;
    `lcache warm --threads` takes 1 to 1024."""
    make_files(tmp_path / "data", 3)
    with pytest.raises(ConfigError, match=r"threads=.*: give a whole number from 1 to 1,024"):
        warm_cache(str(tmp_path / "data"), str(tmp_path / "cache"), "16MiB",
                   threads=threads, show_progress=False)  # type: ignore[arg-type]
    assert not (tmp_path / "cache").exists()
