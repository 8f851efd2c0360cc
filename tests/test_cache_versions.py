"""A cached copy of another version of a sample is never served: a table row moved to other
bytes, a copy of another length, a file rewritten in place while the run reads it."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from lcache.data import CachedDataset, RangeSource
from lcache.data.remote import SourceError

CAPACITY = "16MiB"


def test_a_table_row_moved_to_another_range_is_fetched_again(tmp_path: Path) -> None:
    """The finding: fingerprints mixed offset and length linearly, and this row edit (found
    by solving for it) kept the row's fingerprint: 2,048 old bytes were served for a row of
    114,449 new ones. The file is sparse, 12.6 GiB long, as token files are."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    moved_to, moved_length = 13564371203, 114449
    with open(data / "tokens.bin", "wb") as f:
        f.write(b"OLD!" * 512)
        f.seek(moved_to)
        f.write(b"NEW!" * (moved_length // 4) + b"N")
    first = CachedDataset(RangeSource(str(data), "tokens.bin", [0], [2048]), cache, "64MiB")
    assert first[0] == b"OLD!" * 512
    first.cache.close()

    source = RangeSource(str(data), "tokens.bin", [moved_to], [moved_length])
    again = CachedDataset(source, cache, "64MiB")
    assert again.cache.invalidated == 1
    assert again[0] == b"NEW!" * (moved_length // 4) + b"N"
    again.cache.close()


def test_row_fingerprints_differ_for_every_moved_offset_and_length(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "f.bin").write_bytes(bytes(1 << 16))
    rng = np.random.default_rng(0)
    offsets = rng.integers(0, 1 << 15, 20000)
    lengths = rng.integers(1, 1 << 15, 20000)
    rows = set(zip(offsets.tolist(), lengths.tolist(), strict=True))
    source = RangeSource(str(data), "f.bin", [o for o, _ in rows], [n for _, n in rows])
    fps = source.fingerprints()
    assert len(set(fps.tolist())) == len(rows)
    # and the same row in another file, or in the same file at another version, differs
    (data / "g.bin").write_bytes(bytes(1 << 16))
    other = RangeSource(str(data), "g.bin", [100], [50])
    same = RangeSource(str(data), "f.bin", [100], [50])
    assert other.fingerprints()[0] != same.fingerprints()[0]


def test_a_cached_copy_of_another_length_is_refused_and_fetched_again(tmp_path: Path) -> None:
    """A copy whose length is not its row's (a version the fingerprint did not tell apart,
    written here straight into the store) is dropped, counted and fetched again."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    payload = random.Random(1).randbytes(3000)
    (data / "f.bin").write_bytes(payload)
    ds = CachedDataset(RangeSource(str(data), "f.bin", [0, 1000], [1000, 2000]), cache,
                       CAPACITY)
    ds.cache.store().put(1, b"x" * 1500)
    assert ds[1] == payload[1000:]
    assert ds.stats()["corrupt_refetches"] == 1
    assert ds[1] == payload[1000:]  # the fetched copy is the one kept
    assert ds.stats()["corrupt_refetches"] == 1
    ds.cache.close()


def test_a_file_of_a_known_size_is_checked_the_same_way(tmp_path: Path) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    for i in range(3):
        (data / f"s{i}.bin").write_bytes(bytes([i]) * 100)
    ds = CachedDataset(str(data), cache, CAPACITY)
    ds.cache.store().put(2, b"\x07" * 99)
    assert ds[2] == b"\x02" * 100
    assert ds.stats()["corrupt_refetches"] == 1
    ds.cache.close()


@pytest.mark.parametrize("change", ["chmod", "link", "atime"])
def test_a_change_of_metadata_alone_does_not_fail_the_read(tmp_path: Path,
                                                          change: str) -> None:
    """The inode change time moves with a chmod, a hard link or a backup tool that sets
    the access time back; compared with the listing's, it failed reads of unchanged files
    mid-run (attack helper 99). An in-place rewrite with the mtime set back is dropped at
    the next open (test_cache_identity)."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    for i in range(2):
        (data / f"s{i}.bin").write_bytes(bytes([i]) * 100)
    ds = CachedDataset(str(data), cache, CAPACITY)
    victim = data / "s1.bin"
    st = victim.stat()
    if change == "chmod":
        victim.chmod(0o600)
    elif change == "link":
        os.link(victim, tmp_path / "backup.bin")
    else:
        os.utime(victim, ns=(st.st_atime_ns - 10**9, st.st_mtime_ns))
    assert victim.stat().st_ctime_ns != st.st_ctime_ns
    assert ds[1] == b"\x01" * 100
    ds.close()


def test_a_file_rewritten_during_its_read_is_refused(tmp_path: Path) -> None:
    """The fields are checked again after the read: a rewrite while it ran mixed two
    versions (12 MiB of one and 20 MiB of the other passed). Here the rewrite is made
    between the read and the check, from inside the read (os.pread is wrapped)."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    (data / "big.bin").write_bytes(b"A" * (64 << 10))
    ds = CachedDataset(str(data), cache, "64MiB")
    real_pread = os.pread

    def pread_then_rewrite(fd: int, n: int, offset: int) -> bytes:
        piece = real_pread(fd, n, offset)
        with open(data / "big.bin", "r+b") as f:
            f.write(b"B" * 100)
        return piece

    os.pread = pread_then_rewrite  # type: ignore[assignment]
    try:
        with pytest.raises(SourceError, match="rewritten since the source"):
            ds[0]
    finally:
        os.pread = real_pread
    assert 0 not in ds.cache.store()
    ds.close()


def test_a_source_whose_fetch_changes_the_bytes_still_hits(tmp_path: Path) -> None:
    """A subclass may alter what it fetches (here: decompress); its listed sizes are not
    its samples' lengths. The finding (attack helper 99): every hit was dropped as being of
    another length and fetched again (24 fetches in 3 epochs of 8, none before)."""
    import gzip

    from lcache.data import FileSource

    class GzSource(FileSource):
        def fetch(self, index: int) -> bytes:
            return gzip.decompress(super().fetch(index))

    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    for i in range(8):
        (data / f"s{i}.gz").write_bytes(gzip.compress(bytes([i]) * 5000))
    ds = CachedDataset(GzSource(str(data)), cache, CAPACITY)
    for _ in range(3):
        assert [ds[i] for i in range(8)] == [bytes([i]) * 5000 for i in range(8)]
    assert ds.stats()["fetches"] == 8 and ds.stats()["corrupt_refetches"] == 0
    ds.close()


def test_a_table_cache_of_the_older_fingerprints_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cache made before the fingerprints of rows changed (its cache.json has no
    "fingerprints"): its samples are fetched again once, said as such, not as samples
    "changed at the source" (attack helper 99)."""
    import json
    import logging

    import xxhash

    from lcache.data.sources import fingerprint

    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    (data / "f.bin").write_bytes(random.Random(3).randbytes(4000))
    rows = ([0, 1000, 2000], [1000, 1000, 2000])
    first = CachedDataset(RangeSource(str(data), "f.bin", *rows), cache, CAPACITY)
    assert [len(first[i]) for i in range(3)] == [1000, 1000, 2000]
    first.close()
    # what an older lcache wrote: the linear mix, no "fingerprints" in cache.json
    src = RangeSource(str(data), "f.bin", *rows)
    offsets, lengths = (np.array(c, np.uint64) for c in rows)

    def old(files: np.ndarray) -> np.ndarray:
        return files[src._file_of] ^ (offsets * np.uint64(0x9E3779B97F4A7C15)
                                      ^ lengths * np.uint64(0xC2B2AE3D27D4EB4F))

    raw = old(src._file_fps).astype("<u8").tobytes()
    (cache / "listing.bin").write_bytes(raw)
    doc = json.loads((cache / "cache.json").read_text())
    unversioned = np.array([fingerprint("f.bin", 4000, "")], np.uint64)
    doc["layout"] = xxhash.xxh3_128_hexdigest(old(unversioned).astype("<u8").tobytes())
    doc["listing"] = xxhash.xxh3_128_hexdigest(raw)
    del doc["fingerprints"]
    (cache / "cache.json").write_text(json.dumps(doc))

    with caplog.at_level(logging.WARNING, logger="lcache"):
        again = CachedDataset(src, cache, CAPACITY)
    assert again.cache.invalidated == 3
    assert "fingerprinted by an older lcache" in caplog.text
    assert "changed at the source" not in caplog.text
    assert [len(again[i]) for i in range(3)] == [1000, 1000, 2000]
    again.close()
