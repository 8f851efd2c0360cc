"""Opening a source: listing (concurrent, with timeouts), ``files=`` with or without sizes,
suffixes that ignore case, a progress line, and a listing kept in the cache directory that
is reused only when it cannot be staler than a fresh one (same launch) or the user allows
it (``listing_ttl``)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lcache.data import CachedDataset, FileSource, ImageFolderSource, SourceError
from lcache.data import listing as listing_mod
from lcache.errors import ConfigError
from lcache.testing.remote import ThrottledServer

from .conftest import run_lcache
from .test_fetch_remote import InFlight


def _blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _tree(root: Path, names: list[str]) -> dict[str, bytes]:
    out = {}
    for i, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        out[name] = _blob(i, 200 + 31 * i)
        (root / name).write_bytes(out[name])
    return out


# ------------------------------------------------------------------------ suffixes
def test_suffixes_ignore_case_and_an_empty_result_names_the_filter(tmp_path: Path) -> None:
    _tree(tmp_path, ["a.JPEG", "b.jpg", "c.Png", "sub/d.txt"])
    src = FileSource(str(tmp_path), suffixes=(".jpeg", ".jpg"))
    assert [os.path.basename(p) for p in src.paths] == ["a.JPEG", "b.jpg"]
    assert [os.path.basename(p) for p in FileSource(str(tmp_path), suffixes=".PNG").paths] == [
        "c.Png"]
    with pytest.raises(SourceError) as info:
        FileSource(str(tmp_path), suffixes=(".gif",))
    assert str(info.value) == (f"no samples found under {tmp_path} with suffixes ('.gif',) "
                               "(case ignored); it holds 4 other files, e.g. a.JPEG, b.jpg, c.Png")


# ------------------------------------------------------------------------ files=
def test_files_with_sizes_ask_the_server_nothing(tmp_path: Path) -> None:
    written = _tree(tmp_path / "d", [f"{i:02d}.bin" for i in range(6)])
    with ThrottledServer(str(tmp_path)) as server:
        url = server.url + "/d/"
        for files in ({n: len(v) for n, v in written.items()},
                      [(n, len(v)) for n, v in written.items()]):
            src = FileSource(url, files=files)
            assert server.requests == 0 and not server.heads
            assert src.sizes().tolist() == [len(v) for v in written.values()]
            assert src.paths == [url + n for n in written]
        assert src.fetch_many(range(6)) == list(written.values())
        for bad in ([("a.bin", -1)], [("a.bin", "12")], [("a.bin", True)], [1, 2],
                    [("a.bin", 1, 2)]):
            with pytest.raises(ConfigError, match="files="):
                FileSource(url, files=bad)


def test_files_without_sizes_are_asked_concurrently(tmp_path: Path) -> None:
    written = _tree(tmp_path / "d", [f"{i:02d}.bin" for i in range(30)])
    with ThrottledServer(str(tmp_path), latency=0.05) as server:
        src = FileSource(server.url + "/d/", files=list(written), concurrency=8)
        assert src.sizes().tolist() == [len(v) for v in written.values()]
        assert server.heads == {f"/d/{n}": 1 for n in written}
        assert 4 < server.most_in_flight <= 8  # one HEAD each, several at once


def test_http_listing_walks_directories_concurrently(tmp_path: Path) -> None:
    names = [f"s{k:02d}/{i}.bin" for k in range(12) for i in range(3)] + ["top.bin"]
    written = _tree(tmp_path / "d", names)
    hook = InFlight(only=lambda path: path.endswith("/"))  # listings only
    with ThrottledServer(str(tmp_path), fault=hook) as server:
        url = server.url + "/d/"
        src = FileSource(url, concurrency=16)
        assert src.paths == sorted(url + n for n in names)
        assert src.fetch_many(range(len(names))) == [written[n] for n in sorted(names)]
        assert all(server.paths[f"/d/s{k:02d}/"] == 1 for k in range(12))  # each listed once
        assert hook.most > 4  # the 12 subdirectories were listed side by side


def test_an_http_listing_s_sort_links_are_not_samples(tmp_path: Path) -> None:
    """The finding: Apache and nginx pages link their sort orders ("?C=N;O=D"); they were
    listed as files, sorted first, and the listing page was cached as samples 0 and 1
    (every real sample's number shifted by two)."""
    written = _tree(tmp_path / "d", ["a.bin", "sub/b.bin"])
    with ThrottledServer(str(tmp_path), fault=lambda path, nth: "sort-links") as server:
        src = FileSource(server.url + "/d/")
        assert src.paths == [server.url + "/d/a.bin", server.url + "/d/sub/b.bin"]
        assert src.fetch_many([0, 1]) == [written["a.bin"], written["sub/b.bin"]]


def test_listing_times_out(tmp_path: Path) -> None:
    _tree(tmp_path / "d", ["a.bin"])
    stall = {"/d/": "stall", "/d": "stall"}
    with ThrottledServer(str(tmp_path), fault=lambda path, nth: stall.get(path)) as server:
        server.stall_seconds = 1.0
        url = server.url + "/d/"
        with pytest.raises(SourceError, match=r"^cannot list .*/d/?: no answer within 0.3 s"):
            FileSource(url, timeout=0.3, retries=0)


# ------------------------------------------------------------------------ progress
def test_progress_line_while_listing(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path / "d", ["a.bin", "b.bin"])
    monkeypatch.setattr(listing_mod, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setenv("COLUMNS", "500")  # the line is cut to the terminal's width
    FileSource(str(tmp_path / "d"), progress=False)
    assert capfd.readouterr().err == ""
    FileSource(str(tmp_path / "d"), progress=True)
    assert f"listing {tmp_path / 'd'}: 2 files" in capfd.readouterr().err


# ------------------------------------------------------------------------ a kept listing
def _listed(server: ThrottledServer) -> int:
    return server.requests + sum(server.heads.values())


@pytest.mark.parametrize("over_http", [False, True])
def test_a_kept_listing_of_an_object_that_changed_is_dropped(tmp_path: Path,
                                                              over_http: bool) -> None:
    """Attack round 20: a file touched after its listing was kept had every fetch refused as
    changed ("open it again"), and every open within the TTL took the same listing again;
    round 21: the source that made the listing kept it too."""
    _tree(tmp_path / "d", [f"{i}.bin" for i in range(3)])
    cache = tmp_path / "cache"
    with ThrottledServer(str(tmp_path), etags=True) as server:
        url = server.url + "/d/" if over_http else str(tmp_path / "d")
        first = FileSource(url, cache_dir=cache, listing_ttl=3600, retries=0)
        os.utime(tmp_path / "d" / "1.bin", ns=(1, 10**18))  # touched: the same bytes
        with pytest.raises(SourceError, match="rewritten since the source was opened"):
            first.fetch(1)
        again = FileSource(url, cache_dir=cache, listing_ttl=3600)  # listed anew
        assert again.fetch_many([0, 1, 2]) == [(tmp_path / "d" / f"{i}.bin").read_bytes()
                                               for i in range(3)]


def test_listing_reused_within_its_ttl_only(tmp_path: Path) -> None:
    _tree(tmp_path / "d", [f"{i}.bin" for i in range(5)])
    cache = tmp_path / "cache"
    with ThrottledServer(str(tmp_path)) as server:
        url = server.url + "/d/"
        first = FileSource(url, cache_dir=cache, listing_ttl=3600)
        kept = cache / listing_mod.LISTING_FILE
        assert kept.stat().st_mode & 0o077 == 0  # private, like the rest of the directory
        asked = _listed(server)
        again = FileSource(url, cache_dir=cache, listing_ttl=3600)
        assert _listed(server) == asked  # nothing asked
        assert (again.paths, again.sizes().tolist(), again.fingerprints().tolist()) == (
            first.paths, first.sizes().tolist(), first.fingerprints().tolist())

        (tmp_path / "d" / "5.bin").write_bytes(b"new")
        stale = FileSource(url, cache_dir=cache, listing_ttl=3600)  # allowed to be stale
        assert len(stale) == 5 and _listed(server) == asked
        fresh = FileSource(url, cache_dir=cache)  # listing_ttl=0: always listed
        assert len(fresh) == 6 and _listed(server) > asked
        asked = _listed(server)
        other = FileSource(url, cache_dir=cache, listing_ttl=3600, suffixes=(".BIN",))
        assert len(other) == 6 and _listed(server) > asked  # another listing: not reused

        kept.write_bytes(b"{not json")
        assert len(FileSource(url, cache_dir=cache, listing_ttl=3600)) == 6  # listed again
        doc = json.loads(kept.read_text())
        (key, entry), = doc["listings"].items()
        for damage in ({"sizes": ["12"] * len(entry["sizes"])}, {"made": "yesterday"},
                       {"at_boot": None}):  # the last two were bare Value and TypeErrors
            kept.write_text(json.dumps({**doc, "listings": {key: {**entry, **damage}}}))
            asked = _listed(server)
            assert FileSource(url, cache_dir=cache, listing_ttl=3600).sizes().tolist() == \
                entry["sizes"]  # a damaged listing is listed again, not trusted
            assert _listed(server) > asked
        entry["made"] -= 7200  # older than the TTL
        kept.write_text(json.dumps(doc))
        asked = _listed(server)
        FileSource(url, cache_dir=cache, listing_ttl=3600)
        assert _listed(server) > asked


def test_a_kept_listing_keeps_the_order_of_a_files_mapping(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    for name in "ab":
        (tmp_path / "d" / f"{name}.bin").write_bytes(name.encode() * 10)
    cache = tmp_path / "cache"
    first = FileSource(str(tmp_path / "d"), files={"a.bin": 10, "b.bin": 10}, cache_dir=cache,
                       listing_ttl=3600)
    other = FileSource(str(tmp_path / "d"), files={"b.bin": 10, "a.bin": 10}, cache_dir=cache,
                       listing_ttl=3600)
    assert [os.path.basename(p) for p in first.paths] == ["a.bin", "b.bin"]
    assert [os.path.basename(p) for p in other.paths] == ["b.bin", "a.bin"]


def test_ranks_of_one_launch_list_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path / "d", [f"{i}.bin" for i in range(4)])
    cache = tmp_path / "cache"
    with ThrottledServer(str(tmp_path)) as server:
        url = server.url + "/d/"
        FileSource(url, cache_dir=cache)  # outside a launcher: its listing is not shared
        monkeypatch.setenv("LOCAL_RANK", "0")
        asked = _listed(server)
        FileSource(url, cache_dir=cache)  # rank 0 of a launch lists...
        assert _listed(server) > asked
        asked = _listed(server)
        FileSource(url, cache_dir=cache)  # and again when it makes the source again (the
        assert _listed(server) > asked  # finding: such a rank never saw files change again)
        asked = _listed(server)
        kept = cache / listing_mod.LISTING_FILE
        doc = json.loads(kept.read_text())
        (key, entry), = doc["listings"].items()
        kept.write_text(json.dumps({**doc, "listings": {key: {**entry, "pid": 1}}}))
        rank1 = FileSource(url, cache_dir=cache)  # ...and rank 1 (another pid) reuses it
        assert _listed(server) == asked and len(rank1) == 4

        doc = json.loads(kept.read_text())
        doc["listings"][key].update(launch="another boot:1:2", pid=1)  # a later launch
        kept.write_text(json.dumps(doc))
        FileSource(url, cache_dir=cache)  # (another torchrun) lists again
        assert _listed(server) > asked


_READ_FIRST = """
import sys
from lcache.data import CachedDataset
print(CachedDataset(sys.argv[1], sys.argv[2], "16MiB")[0].decode())
"""


def test_a_later_run_from_the_same_parent_lists_again(tmp_path: Path) -> None:
    # Two runs from one shell with LOCAL_RANK exported share a "launch" (the parent process):
    # the second, started after the listing was made, must not reuse it.
    (tmp_path / "d").mkdir()
    sample = tmp_path / "d" / "0.txt"
    sample.write_text("before")
    env = {**os.environ, "LOCAL_RANK": "0"}
    cmd = [sys.executable, "-c", _READ_FIRST, str(tmp_path / "d"), str(tmp_path / "cache")]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    assert first.stdout.strip() == "before"
    sample.write_text("after!")  # same size
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    assert second.stdout.strip() == "after!"
    assert listing_mod.started_at() is not None


_RANK = """
import sys, time
from lcache.data import CachedDataset
data, cache, ttl, go = sys.argv[1:5]
print("started", flush=True)
if go != "now":
    while not __import__("os").path.exists(go):
        time.sleep(0.01)
print(len(CachedDataset(data, cache, "16MiB", listing_ttl=float(ttl))), flush=True)
"""


def _ranks(tmp_path: Path, ttl: float) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    """Two ranks of one launch (children of this process, LOCAL_RANK set): the first lists
    at once, the second when the file ``go`` appears."""
    env = {**os.environ, "LOCAL_RANK": "0"}
    data, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    procs = tuple(subprocess.Popen([sys.executable, "-c", _RANK, data, cache, str(ttl), go],
                                   env=env, stdout=subprocess.PIPE, text=True)
                  for go in ("now", str(tmp_path / "go")))
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "started\n"
    return procs  # type: ignore[return-value]


def test_ranks_of_one_launch_share_a_listing_made_at_once(tmp_path: Path) -> None:
    """The finding: a listing made in the first second or two of a rank's life was not
    taken by its siblings (its start, in wall-clock time, was known to the second), so a file
    added before a sibling opened gave the two ranks different sample counts: an epoch read
    84 samples twice and 84 never."""
    _tree(tmp_path / "d", [f"{i}.bin" for i in range(10)])
    first, second = _ranks(tmp_path, 0.0)
    try:
        assert first.stdout is not None and first.stdout.readline() == "10\n"
        (tmp_path / "d" / "99.bin").write_bytes(b"late")
        (tmp_path / "go").touch()
        assert second.communicate(timeout=60)[0] == "10\n"
    finally:
        _end(first, second)


def test_ranks_of_one_launch_share_a_listing_taken_by_its_age(tmp_path: Path) -> None:
    """The finding: one rank took a kept listing by its age (listing_ttl); a sibling that
    opened once the TTL had run out listed again, and saw a file added in between."""
    _tree(tmp_path / "d", [f"{i}.bin" for i in range(10)])
    assert len(CachedDataset(str(tmp_path / "d"), tmp_path / "cache", "16MiB",
                             listing_ttl=60)) == 10  # an earlier run keeps the listing
    (tmp_path / "d" / "99.bin").write_bytes(b"late")
    first, second = _ranks(tmp_path, 2.0)
    try:
        assert first.stdout is not None and first.stdout.readline() == "10\n"  # by its age
        time.sleep(2.5)  # the TTL runs out
        (tmp_path / "go").touch()
        assert second.communicate(timeout=60)[0] == "10\n"
    finally:
        _end(first, second)


def _end(*procs: subprocess.Popen[str]) -> None:
    """A failed check leaves no rank waiting for "go"."""
    for p in procs:
        p.kill()
        p.wait()


def test_cached_dataset_with_sizes_given(tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    written = _tree(tmp_path / "d", ["a.bin", "b.bin"])
    sizes = {"b.bin": len(written["b.bin"]), "a.bin": len(written["a.bin"])}
    with caplog.at_level("WARNING", logger="lcache"):
        ds = CachedDataset(str(tmp_path / "d"), tmp_path / "cache", "16MiB", files=sizes,
                           fingerprint="v1")
    assert [ds[0], ds[1]] == [written["b.bin"], written["a.bin"]]
    assert not caplog.records  # the fingerprint names the version: nothing to warn about
    with caplog.at_level("WARNING", logger="lcache"):
        CachedDataset(str(tmp_path / "d"), tmp_path / "cache2", "16MiB", files=sizes)
    assert "files= with sizes" in caplog.text and "pass fingerprint=" in caplog.text


def test_a_wrong_size_in_files_is_an_error_not_cached_bytes(tmp_path: Path) -> None:
    written = _tree(tmp_path / "d", ["a.bin", "b.bin"])
    sizes = {"a.bin": len(written["a.bin"]), "b.bin": len(written["b.bin"]) - 1}
    ds = CachedDataset(str(tmp_path / "d"), tmp_path / "cache", "16MiB", files=sizes,
                       fingerprint="v1")
    assert ds[0] == written["a.bin"]
    with pytest.raises(SourceError, match="files= gave a wrong size") as info:
        ds[1]
    assert "sample 1" in str(info.value) and "b.bin" in str(info.value)
    assert 1 not in ds.cache.store()


# ------------------------------------------------------------------------ not regular files
def _special_tree(root: Path) -> dict[str, bytes]:
    """Two real samples ("a", and "b", a link to "a"), and what is not a sample: a FIFO, a
    link to /dev/zero, a dangling link, and a link to a folder above it (a loop); a link to
    an empty folder is followed, and holds nothing."""
    data = _tree(root, ["a"])
    os.symlink(root / "a", root / "b")
    os.mkfifo(root / "p")
    os.symlink("/dev/zero", root / "z")
    os.symlink(root / "missing", root / "dangling")
    (root / "sub").mkdir()
    os.symlink(root / "sub", root / "to-dir")
    os.symlink(root, root / "sub" / "loop")
    return data


def test_a_local_listing_holds_only_regular_files(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    src_dir = tmp_path / "s"
    src_dir.mkdir()
    data = _special_tree(src_dir)
    with caplog.at_level("WARNING", logger="lcache"):
        src = FileSource(str(src_dir))
    assert [os.path.basename(p) for p in src.paths] == ["a", "b"]
    assert src.sizes().tolist() == [len(data["a"])] * 2
    assert src.fetch_many([0, 1]) == [data["a"]] * 2
    warnings = [r.getMessage() for r in caplog.records if "not regular files" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    # p, z, dangling, and loop in sub and in to-dir (sub again: a top-level folder is walked
    # on its own, as torchvision walks each class)
    assert "5 entries" in warnings[0] and str(src_dir / "dangling") in warnings[0]


def test_a_link_to_a_folder_is_followed_and_a_linked_sample_is_versioned_by_its_target(
        tmp_path: Path) -> None:
    """The findings: a linked folder held no samples (torchvision's ImageFolder follows
    links, so its classes shifted against ours); a linked sample's target rewritten with the
    same size was not seen, since the listing gave the link's own modification time."""
    real, root, cache = tmp_path / "real", tmp_path / "root", tmp_path / "cache"
    (real / "cat").mkdir(parents=True)
    (real / "cat" / "1.jpg").write_bytes(b"c" * 100)
    (root / "bird").mkdir(parents=True)
    (root / "bird" / "1.jpg").write_bytes(b"b" * 100)
    os.symlink(real / "cat", root / "cat")
    os.symlink(real / "cat" / "1.jpg", root / "bird" / "2.jpg")
    ds = CachedDataset(ImageFolderSource(str(root)), cache, "16MiB")
    assert ds.cache.source.classes == ["bird", "cat"]
    assert [ds[i] for i in range(3)] == [(b"b" * 100, 0), (b"c" * 100, 0), (b"c" * 100, 1)]
    ds.cache.close()
    target = real / "cat" / "1.jpg"
    st = target.stat()
    target.write_bytes(b"d" * 100)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = CachedDataset(ImageFolderSource(str(root)), cache, "16MiB")
    assert [again[i] for i in range(3)] == [(b"b" * 100, 0), (b"d" * 100, 0), (b"d" * 100, 1)]
    assert again.cache.invalidated == 2


def test_a_fifo_swapped_in_after_the_listing_or_as_an_index_is_an_error_not_a_hang(
        tmp_path: Path) -> None:
    """The findings: a sample replaced by a FIFO after the listing, an MDS index.json or a
    table that is a FIFO, blocked the read forever (and /dev/zero read without end). In a
    child, so a hang fails the test."""
    src_dir = tmp_path / "s"
    src_dir.mkdir()
    _tree(src_dir, ["a", "b"])
    for name in ("mds", "table"):
        (tmp_path / name).mkdir()
    os.mkfifo(tmp_path / "mds" / "index.json")
    os.mkfifo(tmp_path / "table" / "t.csv")
    os.symlink("/dev/zero", tmp_path / "table" / "z.csv")
    code = ("import os, sys; from lcache.data import CachedDataset, FileSource, MDSSource, "
            "TableSource, SourceError\n"
            f"root = {str(tmp_path)!r}\n"
            "ds = CachedDataset(FileSource(root + '/s'), root + '/c', '16MB')\n"
            "os.unlink(root + '/s/b'); os.mkfifo(root + '/s/b')\n"
            "attempts = [lambda: ds[1], lambda: MDSSource(root + '/mds'),\n"
            "            lambda: TableSource(root + '/table', 't.csv'),\n"
            "            lambda: TableSource(root + '/table', 'z.csv')]\n"
            "for attempt in attempts:\n"
            "    try:\n"
            "        attempt()\n"
            "    except SourceError as exc:\n"
            "        print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4, done.stdout
    assert "is a FIFO, not a regular file" in lines[0] and "s/b" in lines[0]
    assert "index.json is a FIFO" in lines[1] and "t.csv is a FIFO" in lines[2]
    assert "z.csv is a character device" in lines[3]


def test_files_naming_a_fifo_are_refused(tmp_path: Path) -> None:
    src_dir = tmp_path / "s"
    src_dir.mkdir()
    _special_tree(src_dir)
    for name in ("p", "z", "sub"):
        with pytest.raises(SourceError, match=f"{src_dir / name} is not a regular file"):
            FileSource(str(src_dir), files=["a", name])


def test_a_fifo_in_the_source_does_not_hang_warm_or_a_dataset(tmp_path: Path) -> None:
    """The finding: a FIFO (or a link to /dev/zero) listed as a sample blocked the read
    forever (or read until memory ran out). In a child, so a hang fails the test."""
    import subprocess
    import sys

    src_dir = tmp_path / "s"
    src_dir.mkdir()
    data = _tree(src_dir, ["a", "b"])
    data["b"] = data["a"]
    (src_dir / "b").write_bytes(data["a"])
    os.mkfifo(src_dir / "p")
    os.symlink("/dev/zero", src_dir / "z")
    code = ("import sys; from lcache.data import CachedDataset\n"
            "from lcache.data.warm import warm_cache\n"
            f"src, c1, c2 = {str(src_dir)!r}, {str(tmp_path / 'c1')!r}, {str(tmp_path / 'c2')!r}\n"
            "assert warm_cache(src, c1, '20MB', show_progress=False)['samples'] == 2\n"
            "ds = CachedDataset(src, c2, capacity='40MB')\n"
            "assert len(ds) == 2, len(ds)\n"
            "sys.stdout.buffer.write(ds[1])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == data["a"]
    assert b"not regular files" in done.stderr


def test_file_names_that_are_not_utf8_are_samples(tmp_path: Path) -> None:
    """The finding: a file named in Latin-1 (b"caf\\xe9.bin") was a UnicodeEncodeError when
    its fingerprint was made, from a dataset and as a traceback from `lcache warm`."""
    root = tmp_path / "d"
    root.mkdir()
    with open(os.path.join(os.fsencode(root), b"caf\xe9.bin"), "wb") as f:
        f.write(b"x" * 100)
    (root / "ok.bin").write_bytes(b"y" * 100)
    ds = CachedDataset(str(root), tmp_path / "c", "16MiB")
    assert [ds[0], ds[1]] == [b"x" * 100, b"y" * 100]
    ds.cache.close()
    again = CachedDataset(str(root), tmp_path / "c", "16MiB")
    assert again[0] == b"x" * 100 and again.cache.invalidated == 0
    done = run_lcache("warm", str(root), "--cache", str(tmp_path / "w"), "--capacity", "16MiB",
                      "--json", cwd=tmp_path)
    assert done.returncode == 0 and json.loads(done.stdout)["samples"] == 2, done.stderr


def test_links_that_branch_and_meet_are_walked_once(tmp_path: Path) -> None:
    """The finding: folders whose two links both lead to the next folder (no loop) made the
    walk exponential: one file was 65,535 samples at depth 15; at 40, a walk without end.
    Depth 18 here: a full run saw listdir fail with ELOOP on a path through 30 links, under
    Linux's limit of 40, though stat of it had just passed (not understood; it did not come
    back in 3 runs alone), so no path goes through more than 18."""
    depth = 18
    root = tmp_path / "d"
    for k in range(depth + 1):
        (root / f"d{k:02d}").mkdir(parents=True)
    for k in range(depth):
        for name in ("a", "b"):
            os.symlink(root / f"d{k + 1:02d}", root / f"d{k:02d}" / name)
    (root / f"d{depth}" / "x.bin").write_bytes(b"x" * 10)
    src = FileSource(str(root))
    # once in each top-level folder's walk (each is walked on its own, as torchvision walks
    # each class): 19, not 2**18
    assert sorted(src.paths, key=len) == [
        str(root / f"d{k:02d}" / ("a/" * (depth - k)) / "x.bin").replace("//", "/")
        for k in range(depth, -1, -1)]


def test_a_link_into_the_cache_directory_is_not_walked(tmp_path: Path) -> None:
    """The finding: a link in the source to the cache directory (or a folder in it) made
    the cache's own files samples."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    _tree(data, ["a", "b"])
    ds = CachedDataset(str(data), cache, "16MiB")
    assert ds[0] and len(ds) == 2
    ds.cache.close()
    os.symlink(cache, data / "zz-cache")
    os.symlink(cache / "store", data / "zz-store")
    below = [p for p in (cache / "store").iterdir() if p.is_dir()]
    assert below  # the store's own folders: the finding linked to one of them
    os.symlink(below[0], data / "zz-below")
    again = CachedDataset(str(data), cache, "16MiB")
    assert [os.path.basename(p) for p in again.cache.source.paths] == ["a", "b"]


def test_a_train_and_a_val_source_keep_their_listings_side_by_side(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finding: one kept listing per directory: a val source's listing replaced the
    train source's, so the other ranks listed train themselves (and, with a shard added in
    between, read an epoch of another length)."""
    _tree(tmp_path / "train", [f"{i}.bin" for i in range(4)])
    _tree(tmp_path / "val", ["0.bin"])
    cache = tmp_path / "cache"
    monkeypatch.setenv("LOCAL_RANK", "0")
    FileSource(str(tmp_path / "train"), cache_dir=cache)
    FileSource(str(tmp_path / "val"), cache_dir=cache)
    kept = cache / listing_mod.LISTING_FILE
    doc = json.loads(kept.read_text())
    assert len(doc["listings"]) == 2
    for entry in doc["listings"].values():
        entry["pid"] = 1  # as made by another rank of this launch
    kept.write_text(json.dumps(doc))
    (tmp_path / "train" / "9.bin").write_bytes(b"late")
    assert len(FileSource(str(tmp_path / "train"), cache_dir=cache)) == 4  # the sibling's
