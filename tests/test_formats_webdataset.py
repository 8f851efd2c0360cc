"""``WebDatasetSource`` against tar shards written by webdataset's own ``ShardWriter``
(tests/data/webdataset, see its README): every sample's members and bytes as the writer was
given them, locally, over HTTP with one request per shard, and through the cache; truncated,
corrupt and unreachable shards named with the sample; the kept index."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lcache.data import CachedDataset, SourceError
from lcache.data.formats import WebDatasetSource, tar
from lcache.data.formats.webdataset import split_name
from lcache.errors import ConfigError, CorruptionError
from lcache.testing.remote import ThrottledServer

from .conftest import rewrite_unseen, served
from .data.make_fixtures import LONG_KEY, payload

FIXTURE = Path(__file__).parent / "data" / "webdataset"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())["samples"]
SHARDS = ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _written(i: int) -> dict[str, bytes]:
    """What the writer was given for sample ``i``, as it stores it (make_fixtures.py)."""
    fields = {"bin": payload(i, "bin"), "cls": str(i % 4).encode(),
              "json": json.dumps({"i": i, "name": f"n{i}"}).encode()}
    if i % 2:
        fields["seg.png"] = payload(i, "seg")
    return fields


def _check_sample(i: int, item: dict[str, Any]) -> None:
    want = EXPECTED[i]
    assert item["__key__"] == want["key"]
    fields = {k: v for k, v in item.items() if k != "__key__"}
    assert fields == _written(i)
    assert {k: _sha(v) for k, v in fields.items()} == want["fields"]


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    """A writable copy of the fixture shards under ``tmp_path/remote/wds``."""
    return Path(shutil.copytree(FIXTURE / "shards", tmp_path / "remote" / "wds"))


def test_samples_are_what_the_writer_was_given() -> None:
    src = WebDatasetSource(str(FIXTURE / "shards"))
    assert len(src) == len(EXPECTED) == 12
    assert src.keys == [s["key"] for s in EXPECTED]
    assert LONG_KEY in src.keys  # a name only a pax header holds
    items = [src.decode(d) for d in src.fetch_many(range(len(src)))]
    for i, item in enumerate(items):
        _check_sample(i, item)
    assert src.path_of(7) == f"{FIXTURE / 'shards' / 'shard-000001.tar'}#{LONG_KEY}"
    # A sample is the tar bytes from its first header to its last member's end.
    assert src.sizes().tolist() == src.lengths.tolist()
    assert all(n % 512 == 0 for n in src.lengths)


def test_names_as_webdataset_groups_them() -> None:
    assert split_name("a/b.c.JPG") == ("a/b", "c.jpg")
    assert split_name("x.cls") == ("x", "cls")
    assert split_name("noext") is None
    assert split_name("__meta__") is None and split_name("__meta__/x.txt") is None
    assert split_name("d.1/x.jpg") == ("d.1/x", "jpg")


def test_over_http_one_request_per_shard_and_through_the_cache(shards: Path,
                                                               tmp_path: Path) -> None:
    with ThrottledServer(str(shards.parent)) as server:
        src = WebDatasetSource(server.url + "/wds/", shards="shard-{000000..000002}.tar")
        assert len(src) == 12
        before = dict(server.paths)
        ds = CachedDataset(src, tmp_path / "cache", "16MiB")
        items = ds.__getitems__(list(range(12)))  # the batched path: one fetch_many
        for i, item in enumerate(items):
            _check_sample(i, item)
        for name in SHARDS:  # the samples of one shard came in one ranged GET
            assert server.paths[f"/wds/{name}"] - before.get(f"/wds/{name}", 0) == 1
        again = [ds[i] for i in range(12)]  # hits
        for i, item in enumerate(again):
            _check_sample(i, item)
        assert ds.stats()["from_ssd"] == 12


def test_kept_index_spares_reading_the_shards(shards: Path, tmp_path: Path) -> None:
    with ThrottledServer(str(shards.parent)) as server:
        url = server.url + "/wds/"
        WebDatasetSource(url, cache_dir=tmp_path / "cache")
        read = sum(server.paths[f"/wds/{n}"] for n in SHARDS)
        assert read >= 3  # each shard read once to index it
        again = WebDatasetSource(url, cache_dir=tmp_path / "cache")
        assert sum(server.paths[f"/wds/{n}"] for n in SHARDS) == read  # nothing read
        assert again.keys == [s["key"] for s in EXPECTED]
        # A shard rewritten (new Last-Modified) is indexed again; the others are not.
        (shards / SHARDS[2]).write_bytes((shards / SHARDS[2]).read_bytes())
        WebDatasetSource(url, cache_dir=tmp_path / "cache")
        assert server.paths[f"/wds/{SHARDS[2]}"] == 2
        assert server.paths[f"/wds/{SHARDS[0]}"] == 1


def test_truncated_shard_is_named(shards: Path) -> None:
    data = (shards / SHARDS[1]).read_bytes()
    (shards / SHARDS[1]).write_bytes(data[:12_000])  # cut inside a member
    with pytest.raises(SourceError) as info:
        WebDatasetSource(str(shards))
    message = str(info.value)
    assert str(shards / SHARDS[1]) in message and "truncated shard" in message, message
    assert isinstance(info.value, CorruptionError)


def test_corrupt_header_of_a_fetched_sample_is_refused(shards: Path) -> None:
    with served(shards) as url:
        src = WebDatasetSource(url)
        start = int(src.offsets[3])
        raw = bytearray((shards / SHARDS[0]).read_bytes())
        raw[start + 88] ^= 0x01  # in the first header of sample 3 (its first member's pax)
        rewrite_unseen(shards / SHARDS[0], bytes(raw))
        with pytest.raises(SourceError) as info:
            src.fetch_many([2, 3, 4])
        message = str(info.value)
        assert f"sample 3 ({url}{SHARDS[0]} at byte" in message and "checksum" in message, \
            message
        assert src.fetch_many([0, 1]) == [src.fetch(0), src.fetch(1)]  # the others serve


def test_shard_rewritten_under_a_sample_is_refused(shards: Path) -> None:
    src = WebDatasetSource(str(shards))
    other = WebDatasetSource(str(shards))
    # Swap two shards of the same size: each sample's range now holds another key.
    a, b = (shards / SHARDS[0]).read_bytes(), (shards / SHARDS[1]).read_bytes()
    assert len(a) == len(b)
    (shards / SHARDS[0]).write_bytes(b)
    (shards / SHARDS[1]).write_bytes(a)
    for i in range(5):  # the shard's version tells
        with pytest.raises(SourceError, match=rf"^cannot read sample {i} .*rewritten since "):
            src.fetch(i)
    assert other.keys == src.keys
    # and where it cannot (over HTTP, its modification time set back), each sample's tar
    # key does
    (shards / SHARDS[0]).write_bytes(a)
    (shards / SHARDS[1]).write_bytes(b)
    with served(shards) as url:
        src = WebDatasetSource(url)
        rewrite_unseen(shards / SHARDS[0], b)
        for i in range(5):
            with pytest.raises(SourceError, match=rf"^sample {i} .*shard changed since it "
                                                  "was indexed"):
                src.fetch(i)


def test_unreachable_or_missing_shard_is_named(shards: Path, tmp_path: Path) -> None:
    with ThrottledServer(str(shards.parent)) as server:
        src = WebDatasetSource(server.url + "/wds/", retries=0)
        (shards / SHARDS[2]).unlink()
        with pytest.raises(SourceError) as info:
            src.fetch_many([11])
        assert f"sample 11 (bytes {src.offsets[11]}-" in str(info.value)
        assert f"{server.url}/wds/{SHARDS[2]}" in str(info.value)
        with pytest.raises(SourceError, match=f"{SHARDS[2]}"):
            WebDatasetSource(server.url + "/wds/", shards=SHARDS)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_bytes(b"x")
    with pytest.raises(SourceError, match=r"no \.tar shards found under .* e\.g\. a\.txt"):
        WebDatasetSource(str(tmp_path / "empty"))


def test_a_short_coalesced_answer_names_the_first_sample_cut(shards: Path) -> None:
    with ThrottledServer(str(shards.parent), fault=lambda path, nth: "short"
                         if path.endswith(SHARDS[0]) and nth > 1 else None) as server:
        src = WebDatasetSource(server.url + "/wds/", shards=[SHARDS[0]])
        with pytest.raises(SourceError, match=r"^sample [0-4]: .* ended after"):
            src.fetch_many(range(5))


def test_a_sample_under_another_key_is_refused(shards: Path) -> None:
    """The same layout with other names (checksums right): only the key check tells."""
    import io
    import tarfile

    out = io.BytesIO()
    with tarfile.open(shards / SHARDS[0]) as old, tarfile.open(fileobj=out, mode="w") as new:
        for info in old.getmembers():
            data = old.extractfile(info).read()  # type: ignore[union-attr]
            info.name = info.name.replace("s0001", "x0001")
            info.pax_headers = {k: v for k, v in info.pax_headers.items() if k != "path"}
            new.addfile(info, io.BytesIO(data))
    assert len(out.getvalue()) == (shards / SHARDS[0]).stat().st_size  # the same layout
    with served(shards) as url:
        src = WebDatasetSource(url)
        rewrite_unseen(shards / SHARDS[0], out.getvalue())
        assert src.fetch_many([0, 2]) == [src.fetch(0), src.fetch(2)]  # unchanged ones serve
        with pytest.raises(SourceError, match=r"^sample 1 .* holds key 'x0001', not 's0001'"):
            src.fetch(1)


def test_progress_while_indexing(capfd: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from lcache.data import listing

    monkeypatch.setattr(listing, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setenv("COLUMNS", "500")
    WebDatasetSource(str(FIXTURE / "shards"), progress=True)
    err = capfd.readouterr().err
    assert f"indexing {FIXTURE / 'shards'}: " in err and "12 samples" in err, err


def _header(name: str, size: int, kind: bytes) -> bytes:
    """A ustar header block, its checksum right."""
    block = bytearray(512)
    block[0 : len(name)] = name.encode()
    block[100:108], block[108:116], block[116:124] = b"0000644\0", b"0000000\0", b"0000000\0"
    block[124:136], block[136:148] = f"{size:011o}\0".encode(), b"00000000000\0"
    block[156:157], block[257:263], block[263:265] = kind, b"ustar\0", b"00"
    block[148:156] = b" " * 8
    block[148:156] = f"{sum(block):06o}\0 ".encode()
    return bytes(block)


def _pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    n = len(body) + 1  # the record's length in bytes, its own digits included
    while len(str(n)) + len(body) != n:
        n += 1
    return str(n).encode() + body


def _shard_with_pax_size(size: str) -> bytes:
    record = _pax_record("size", size)
    return (_header("a.txt", 5, b"0") + b"hello".ljust(512, b"\0")
            + _header("././@PaxHeader", len(record), b"x") + record.ljust(512, b"\0")
            + _header("././@LongLink", 0, b"L") + _header("b.txt", 0, b"0") + bytes(1024))


def _scan_in_time(shard: bytes) -> list[tar.Member]:
    """Every member of ``shard`` (named "s-0.tar"), scanned here in the main thread, where an
    alarm can end a scan that loops."""
    import signal

    def hung(*_: object) -> None:
        raise TimeoutError("the scan did not end")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        return list(tar.scan(lambda at, n: shard[at : at + n], 0, len(shard),
                             lambda at: f"s-0.tar at byte {at}", archive=True))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("size", ["-512", "abc", "1_0", "\u0661\u0660"])
def test_a_pax_size_that_is_not_a_byte_count_is_named_not_looped_on(size: str) -> None:
    """Regression: a pax size of -512 before a GNU long-name header pointed the scan back at
    that header, forever; "abc" was a bare ValueError."""
    with pytest.raises(CorruptionError, match=r"^s-0\.tar at byte 1024: a pax size of"):
        _scan_in_time(_shard_with_pax_size(size))


def test_sparse_members_and_dangling_pax_headers_are_refused() -> None:
    """The findings: a GNU sparse member ('S', which tarfile and so WebDataset read) was
    skipped, dropping its sample; a pax header before the end-of-archive block was
    ignored."""
    sparse = _header("a.txt", 5, b"S") + b"hello".ljust(512, b"\0") + bytes(1024)
    with pytest.raises(CorruptionError, match=r"'a\.txt' is a GNU sparse file"):
        _scan_in_time(sparse)
    record = _pax_record("path", "b.txt")
    dangling = (_header("a.txt", 5, b"0") + b"hello".ljust(512, b"\0")
                + _header("././@PaxHeader", len(record), b"x") + record.ljust(512, b"\0")
                + bytes(1024))
    with pytest.raises(CorruptionError, match="byte 1024: extended headers of no member"):
        _scan_in_time(dangling)


def test_a_gzip_compressed_shard_says_so(shards: Path) -> None:
    """The finding: a gzipped tar named .tar was 'a truncated shard' or a bad checksum."""
    import gzip

    (shards / SHARDS[1]).write_bytes(gzip.compress((shards / SHARDS[1]).read_bytes()))
    with pytest.raises(CorruptionError, match="a gzip-compressed tar"):
        WebDatasetSource(str(shards))


def test_a_shard_with_a_bad_pax_size_is_named(tmp_path: Path) -> None:
    (tmp_path / "wds").mkdir()
    (tmp_path / "wds" / "s-0.tar").write_bytes(_shard_with_pax_size("abc"))
    with pytest.raises(CorruptionError, match=r"s-0\.tar at byte 1024: a pax size of 'abc'"):
        WebDatasetSource(str(tmp_path / "wds"))


def test_a_negative_member_size_is_named_not_looped_on() -> None:
    """Regression: int(text, 8) read a size field of "-1000" as -512, which pointed the scan
    back at the same header, forever."""
    shard = bytearray(_header("a.txt", 5, b"0") + b"hello".ljust(512, b"\0")
                      + _header("noext", 0, b"0") + bytes(1024))
    at = 1024  # the second header
    shard[at + 124 : at + 136] = b"-1000".ljust(12, b"\0")
    shard[at + 148 : at + 156] = b" " * 8
    shard[at + 148 : at + 156] = f"{sum(shard[at : at + 512]):06o}\0 ".encode()
    with pytest.raises(CorruptionError, match=r"^s-0\.tar at byte 1024: not a tar header"):
        _scan_in_time(bytes(shard))


@pytest.mark.parametrize("pattern", ["s-{0..9999999999}.tar", "{0..2000}{0..2000}.tar",
                                     "{" * 1200 + "0..1" + "}" * 1200])
def test_shard_patterns_are_bounded(tmp_path: Path, pattern: str) -> None:
    """The findings: a range of ten billion names ran out of memory, and 1,200 nested
    braces were a RecursionError. Ranges are read once from the pattern as written, and a
    pattern naming more than a million shards is refused before any is made."""
    if pattern.startswith("{{"):
        with pytest.raises(SourceError, match="cannot stat"):  # 2 odd names, not found
            WebDatasetSource(str(tmp_path), shards=pattern)
        return
    with pytest.raises(ConfigError, match="names more than 1,000,000 shards"):
        WebDatasetSource(str(tmp_path), shards=pattern)


_RANK = """
import os, sys, time
from lcache.data.formats import WebDatasetSource
shards, cache, go = sys.argv[1:4]
print("started", flush=True)
while go != "now" and not os.path.exists(go):
    time.sleep(0.01)
print(len(WebDatasetSource(shards, cache_dir=cache)), flush=True)
"""


def test_ranks_of_one_launch_share_the_shard_listing(tmp_path: Path) -> None:
    """The finding: each rank listed the shards itself, so a shard added between two ranks'
    opens gave them 150 and 200 samples: an epoch read some twice and others never."""
    shards = Path(shutil.copytree(FIXTURE / "shards", tmp_path / "wds"))
    env = {**os.environ, "LOCAL_RANK": "0"}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(shards), str(tmp_path / "c"),
                               go], env=env, stdout=subprocess.PIPE, text=True)
             for go in ("now", str(tmp_path / "go"))]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "started\n"
        first = procs[0].communicate(timeout=60)[0]
        shutil.copy(shards / SHARDS[0], shards / "shard-000009.tar")  # a shard appears
        (tmp_path / "go").touch()
        assert procs[1].communicate(timeout=60)[0] == first
    finally:
        for p in procs:  # a failed check leaves none waiting for "go"
            p.kill()
            p.wait()


def test_a_shard_rewritten_while_indexed_is_refused_and_its_index_not_kept(
        tmp_path: Path) -> None:
    """Attack round 22: a shard rewritten between its listing and its index scan was indexed
    from the new bytes, kept under the listed version; once the shard was put back (an S3
    ETag is the content's) every open took that index, and sample s0 came without its txt."""
    import io
    import tarfile

    def shard(names: list[str]) -> bytes:
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as t:
            for name in names:
                info = tarfile.TarInfo(name)
                info.size = 4
                t.addfile(info, io.BytesIO(name[-4:].encode()))
        return out.getvalue()

    v1 = shard(["s0.cls", "s0.jpg", "s0.txt", "s1.cls", "s1.jpg"])
    v2 = shard(["s0.cls", "s0.jpg", "zz.txt", "s1.cls", "s1.jpg"])
    assert len(v1) == len(v2)
    path = tmp_path / "d" / "shard-000.tar"
    path.parent.mkdir()
    path.write_bytes(v1)
    listed = path.stat()

    def rewrite(url_path: str, nth: int) -> None:
        if url_path.endswith(".tar") and nth == 1:  # after the listing, as it is indexed
            path.write_bytes(v2)

    with ThrottledServer(str(tmp_path), etags=True, fault=rewrite) as server:
        with pytest.raises(SourceError, match="rewritten since the source was opened"):
            WebDatasetSource(server.url + "/d/", cache_dir=tmp_path / "idx")
        rewrite_unseen(path, v1, listed)  # put back: its listed version again
        src = WebDatasetSource(server.url + "/d/", cache_dir=tmp_path / "idx")
        assert src.keys == ["s0", "s1"]
        assert sorted(src.decode(src.fetch(0))) == ["__key__", "cls", "jpg", "txt"]
