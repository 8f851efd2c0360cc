"""A cache directory serves only the source it was made for: never another dataset's bytes,
never an object's bytes from before it was rewritten (issue 10, item 1)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lcache.data import CachedDataset, ImageFolderSource, RangeSource
from lcache.data.identity import PROBES, probe_indices
from lcache.data.remote import tells_rewrites
from lcache.data.warm import warm_cache
from lcache.errors import ConfigError, StorePermissionError
from lcache.testing.remote import ThrottledServer

from .conftest import subprocess_env

CAPACITY = "16MiB"


class Split:
    """A map-style dataset of ``n`` items of ``size`` bytes; ``seed`` picks the contents."""

    def __init__(self, seed: int, n: int = 400, size: int = 512, odd: int = -1) -> None:
        self.seed, self.n, self.size, self.odd = seed, n, size, odd

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bytes:
        seed = self.seed + 1000 if i == self.odd else self.seed
        return random.Random(seed * 1_000_003 + i).randbytes(self.size)


class Augmented(Split):
    def __getitem__(self, i: int) -> bytes:
        return random.randbytes(self.size)  # a fresh draw each read


def _files(root: Path, n: int, size: int = 1000, seed: int = 0) -> list[bytes]:
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        data = random.Random(seed * 7919 + i).randbytes(size)
        (root / f"s{i:04d}.bin").write_bytes(data)
        out.append(data)
    return out


def _rewrite_keeping_mtime(path: Path, data: bytes) -> None:
    """Same size, same modification time: only the inode change time tells."""
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _fetches(ds: CachedDataset) -> int:
    return int(ds.stats()["fetches"])


# ----------------------------------------------------------------------- datasets
def test_two_splits_of_one_class_and_size_never_share_a_directory(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    train, val = Split(0), Split(1)
    ds = CachedDataset(train, cache, CAPACITY)
    assert [ds[i] for i in range(400)] == [train[i] for i in range(400)]
    ds.cache.close()
    with pytest.raises(ConfigError) as info:
        CachedDataset(val, cache, CAPACITY)
    message = str(info.value)
    assert "the contents of its items differ" in message and "one per dataset" in message
    again = CachedDataset(Split(0), cache, CAPACITY)  # the same data is welcome back
    assert again[7] == train[7] and _fetches(again) == 400


def test_a_change_outside_the_probe_needs_a_fingerprint(tmp_path: Path) -> None:
    unprobed = next(i for i in range(400) if i not in probe_indices(400))
    cache = tmp_path / "cache"
    CachedDataset(Split(0), cache, CAPACITY, fingerprint="v1").cache.close()
    with pytest.raises(ConfigError, match="its fingerprint differ"):
        CachedDataset(Split(0, odd=unprobed), cache, CAPACITY, fingerprint="v2")
    with pytest.raises(ConfigError, match="its name differ"):
        CachedDataset(Split(0), cache, CAPACITY, fingerprint="v1", name="val")


def test_a_warmed_cache_opened_as_an_image_folder_names_both_kinds(tmp_path: Path) -> None:
    for label in ("cat", "dog"):
        _files(tmp_path / "imgs" / label, 3, seed=len(label))
        for f in (tmp_path / "imgs" / label).iterdir():
            f.rename(f.with_suffix(".jpg"))
    cache = tmp_path / "cache"
    warm_cache(str(tmp_path / "imgs"), str(cache), CAPACITY, show_progress=False)  # files
    with pytest.raises(ConfigError) as info:
        CachedDataset(ImageFolderSource(str(tmp_path / "imgs")), cache, CAPACITY)
    message = str(info.value)
    assert "caches FileSource " in message and "not ImageFolderSource " in message
    assert "its kind differs" in message and "warm_cache" in message
    # warmed through the library as the dataset will open it: every read is a hit
    shutil.rmtree(cache)
    source = ImageFolderSource(str(tmp_path / "imgs"))
    figures = warm_cache(source, str(cache), CAPACITY, show_progress=False)
    assert figures["fetched_samples"] == 6
    ds = CachedDataset(ImageFolderSource(str(tmp_path / "imgs")), cache, CAPACITY)
    before = _fetches(ds)  # the warm's
    assert [ds[i][1] for i in range(6)] == [0, 0, 0, 1, 1, 1] and _fetches(ds) == before
    ds.cache.close()


def test_probe_reads_tens_of_items_spread_over_the_dataset() -> None:
    picks = probe_indices(10_000)
    assert len(picks) == PROBES >= 16 and picks == sorted(set(picks))
    assert picks[0] < 10_000 // PROBES and picks[-1] >= 10_000 - 10_000 // PROBES
    assert probe_indices(10_000) == picks and probe_indices(10_001) != picks
    assert probe_indices(5) == [0, 1, 2, 3, 4]


def test_a_dataset_with_random_items_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"differs between two reads.*transform="):
        CachedDataset(Augmented(0), tmp_path / "cache", CAPACITY)
    assert not (tmp_path / "cache").exists()


# ----------------------------------------------------------------------- listings
def test_object_rewritten_with_same_size_and_mtime_is_fetched_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 20)
    ds = CachedDataset(str(data), cache, CAPACITY)
    assert [ds[i] for i in range(20)] == files
    ds.cache.close()
    new = random.Random(99).randbytes(1000)
    _rewrite_keeping_mtime(data / "s0003.bin", new)
    with caplog.at_level(logging.WARNING, logger="lcache"):
        again = CachedDataset(str(data), cache, CAPACITY)
    assert again.cache.invalidated == 1
    assert "1 cached samples" in caplog.text and "s0003.bin" in caplog.text
    assert [again[i] for i in range(20)] == [*files[:3], new, *files[4:]]
    assert _fetches(again) == 21  # 20 in the first open, then only the rewritten one


def test_files_added_before_the_others_shift_every_index(tmp_path: Path) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 10)
    ds = CachedDataset(str(data), cache, CAPACITY)
    assert [ds[i] for i in range(10)] == files
    ds.cache.close()
    (data / "a-first.bin").write_bytes(b"first")
    (data / "s0009.bin").unlink()
    again = CachedDataset(str(data), cache, CAPACITY)
    assert [again[i] for i in range(10)] == [b"first", *files[:9]]


def _halves(data: Path, files: list[bytes]) -> tuple[list[str], list[str]]:
    names = sorted(p.name for p in data.iterdir())
    half = len(names) // 2
    return names[:half], names[half:]


def test_closing_the_dataset_releases_the_directory_to_another_split(tmp_path: Path) -> None:
    """The finding (newcomer helper 55): CachedDataset had no close(), only ds.cache.close()."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 20)
    train, val = _halves(data, files)
    with CachedDataset(str(data), cache, CAPACITY, files=train) as a:
        assert a[0] == files[0]
        staging = a.cache.staging_dir
        assert os.path.isdir(staging)
    assert not os.path.exists(staging)  # its /dev/shm staging area went with it
    with pytest.raises(ConfigError, match="was closed"):
        a[1]
    b = CachedDataset(str(data), cache, CAPACITY, files=val)  # the other split is welcome
    assert b[0] == files[10]
    b.close()
    b.close()  # twice: nothing more to do


def test_two_splits_open_at_once_are_refused_while_the_other_is_open(tmp_path: Path) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 20)
    train, val = _halves(data, files)
    a = CachedDataset(str(data), cache, CAPACITY, files=train)
    assert [a[i] for i in range(10)] == files[:10]
    with pytest.raises(ConfigError, match=r"is open for .* close that first"):
        CachedDataset(str(data), cache, CAPACITY, files=val)
    assert [a[i] for i in range(10)] == files[:10]  # the open handle is unharmed
    a.cache.close()
    b = CachedDataset(str(data), cache, CAPACITY, files=val)
    assert [b[i] for i in range(10)] == files[10:]
    b.cache.close()
    same = CachedDataset(str(data), cache, CAPACITY, files=val)
    other = CachedDataset(str(data), cache, CAPACITY, files=val)  # one listing: both welcome
    assert other[3] == same[3] == files[13]


def test_a_split_open_in_another_process_is_refused(tmp_path: Path) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 20)
    train, val = _halves(data, files)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom lcache.data import CachedDataset\n"
         f"ds = CachedDataset({str(data)!r}, {str(cache)!r}, {CAPACITY!r}, files={train!r})\n"
         "print(len(ds[0]), flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "1000\n"
        with pytest.raises(ConfigError, match="is open for"):
            CachedDataset(str(data), cache, CAPACITY, files=val)
    finally:
        holder.kill()  # as kill -9 would: its hold ends with it
        holder.wait()
    b = CachedDataset(str(data), cache, CAPACITY, files=val)
    assert [b[i] for i in range(10)] == files[10:]


def test_check_off_still_drops_samples_of_another_split(tmp_path: Path) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 20)
    train, val = _halves(data, files)
    a = CachedDataset(str(data), cache, CAPACITY, files=train, check=False)
    assert [a[i] for i in range(10)] == files[:10]
    a.cache.close()
    b = CachedDataset(str(data), cache, CAPACITY, files=val, check=False)
    assert [b[i] for i in range(10)] == files[10:] and b.cache.invalidated == 10


def test_check_off_still_drops_ranges_that_moved(tmp_path: Path) -> None:
    big = tmp_path / "tokens.bin"
    data = random.Random(2).randbytes(4000)
    big.write_bytes(data)
    cache = tmp_path / "cache"
    first = CachedDataset(RangeSource(str(tmp_path), "tokens.bin", [0, 100], [100, 100]),
                          cache, CAPACITY, check=False)
    assert first[1] == data[100:200]
    first.cache.close()
    moved = CachedDataset(RangeSource(str(tmp_path), "tokens.bin", [0, 300], [100, 100]),
                          cache, CAPACITY, check=False)
    assert moved[1] == data[300:400]


def test_staging_on_disk_left_by_a_killed_run_is_not_served_after_a_change(
        tmp_path: Path) -> None:
    """staging_bytes beyond /dev/shm puts staging in the cache dir; a run killed there
    leaves staged samples, which must not answer for the samples a new listing numbers so."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 10)
    killed = subprocess.Popen(
        [sys.executable, "-c", "import os, sys\nfrom lcache.data import CachedDataset\n"
         f"ds = CachedDataset({str(data)!r}, {str(cache)!r}, {CAPACITY!r}, "
         "staging_bytes='100TB')\n"
         "assert ds.cache._on_ssd\n"
         "ds.cache.staging().put_many(list(range(10)), [ds.cache.source.fetch(i) "
         "for i in range(10)])\n"
         "ds.cache.staging().flush()\nprint('staged', flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=subprocess_env())
    assert killed.stdout is not None and killed.stdout.readline() == "staged\n"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    (data / "a-first.bin").write_bytes(b"first")  # every index now names another file
    again = CachedDataset(str(data), cache, CAPACITY, staging_bytes="100TB")
    assert [again[i] for i in range(11)] == [b"first", *files]
    assert [p.name for p in cache.iterdir() if p.name.startswith("staging")] == \
        [os.path.basename(again.cache.staging_dir)]  # the killed run's is gone


def test_check_off_trusts_the_cached_listing(tmp_path: Path) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 5)
    ds = CachedDataset(str(data), cache, CAPACITY, check=False)
    assert ds[2] == files[2]
    ds.cache.close()
    _rewrite_keeping_mtime(data / "s0002.bin", bytes(1000))
    trusting = CachedDataset(str(data), cache, CAPACITY, check=False)
    assert trusting.cache.invalidated == 0 and trusting[2] == files[2]  # as documented
    trusting.cache.close()
    checking = CachedDataset(str(data), cache, CAPACITY)
    assert checking.cache.invalidated == 1 and checking[2] == bytes(1000)


def test_range_source_file_rewritten(tmp_path: Path) -> None:
    big = tmp_path / "tokens.bin"
    old = random.Random(1).randbytes(4000)
    big.write_bytes(old)
    cache = tmp_path / "cache"

    def source() -> RangeSource:
        return RangeSource(str(tmp_path), "tokens.bin", range(0, 4000, 1000), [1000] * 4)

    ds = CachedDataset(source(), cache, CAPACITY)
    assert [ds[i] for i in range(4)] == [old[i:i + 1000] for i in range(0, 4000, 1000)]
    ds.cache.close()
    new = random.Random(2).randbytes(4000)
    _rewrite_keeping_mtime(big, new)
    again = CachedDataset(source(), cache, CAPACITY)
    assert again.cache.invalidated == 4
    assert [again[i] for i in range(4)] == [new[i:i + 1000] for i in range(0, 4000, 1000)]


def test_http_object_rewritten_with_same_size(tmp_path: Path) -> None:
    root, cache = tmp_path / "srv", tmp_path / "cache"
    files = _files(root / "d", 6)
    with ThrottledServer(str(root)) as server:
        url = server.url + "/d/"
        ds = CachedDataset(url, cache, CAPACITY)
        assert [ds[i] for i in range(6)] == files
        ds.cache.close()
        path = root / "d" / "s0001.bin"
        st = path.stat()
        path.write_bytes(bytes(1000))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))  # Last-Modified: 1 s
        again = CachedDataset(url, cache, CAPACITY)
        assert again.cache.invalidated == 1 and again[1] == bytes(1000) and again[0] == files[0]


def test_a_listing_versioned_to_the_second_only_is_named(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # An HTTP server without ETags (python -m http.server) gives Last-Modified alone: a
    # same-size rewrite in the second an object was cached keeps it, and the old bytes
    # were served with no word of the risk.
    root = tmp_path / "srv"
    _files(root / "d", 3)
    for etags, warned in ((False, True), (True, False)):
        caplog.clear()
        with ThrottledServer(str(root), etags=etags) as server, \
                caplog.at_level(logging.WARNING, logger="lcache"):
            ds = CachedDataset(server.url + "/d/", tmp_path / f"cache-{etags}", CAPACITY)
            ds.cache.close()
        assert ("no version finer than a whole second, or none" in caplog.text) is warned, \
            caplog.text


def test_nginx_etags_count_whole_seconds() -> None:
    """The finding (attack helper 54): nginx's default ETag is the modification time in
    whole seconds and the size, in hex: a same-second same-size rewrite keeps it, and such
    a server was taken as versioned, without the warning."""
    modified = "Mon, 07 Dec 2026 02:00:39 GMT"  # 0x6b161347 seconds
    assert not tells_rewrites(f'ETag="6b161347-b"|Last-Modified={modified}')
    assert not tells_rewrites(f'ETag=W/"6b161347-b"|Last-Modified={modified}')
    assert tells_rewrites(f'ETag="6b161348-b"|Last-Modified={modified}')  # not its stamp
    assert tells_rewrites(f'ETag="d41d8cd98f00b204e9800998ecf8427e"|Last-Modified={modified}')
    assert tells_rewrites('ETag="6b161347-b"')  # no time to compare: taken as it is
    assert not tells_rewrites(f"Last-Modified={modified}")


def test_directory_of_an_older_lcache_is_dropped(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "cache"
    ds = CachedDataset(Split(0, n=50), cache, CAPACITY)
    assert ds[0] == Split(0, n=50)[0]
    ds.cache.close()
    # What lcache 0.1 wrote: a class name, a length and a size estimate.
    (cache / "cache.json").write_text(json.dumps(
        {"source": "dataset:Split", "samples": 50, "sizes_xxh3": "0", "id": "00"}))
    with caplog.at_level(logging.WARNING, logger="lcache"):
        other = CachedDataset(Split(1, n=50), cache, CAPACITY)
    assert "older lcache" in caplog.text
    assert other[0] == Split(1, n=50)[0] and other.cache.store().stats()["live_keys"] == 1


# ----------------------------------------------------------------------- the directory
def test_store_symlink_inside_the_cache_is_refused(tmp_path: Path) -> None:
    other = CachedDataset([b"a", b"b"], tmp_path / "other", CAPACITY)
    other.cache.close()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (cache / "store").symlink_to(tmp_path / "other" / "store")
    with pytest.raises(StorePermissionError, match="symbolic link"):
        CachedDataset([b"x", b"y"], cache, CAPACITY)


@pytest.mark.parametrize("name", ["counters.bin", "claims", "cache.json", "listing.bin"])
def test_no_file_of_the_cache_follows_a_symlink(tmp_path: Path, name: str) -> None:
    cache, target = tmp_path / "cache", tmp_path / "target"
    first = CachedDataset(str(_make_dir(tmp_path / "data")), cache, CAPACITY)
    assert first[0] and first[1]
    first.cache.close()
    target.write_bytes(b"precious")
    (cache / name).unlink()
    (cache / name).symlink_to(target)
    # cache.json: a ConfigError that names it; the others: the kernel's ELOOP
    with pytest.raises((OSError, ConfigError), match="symbolic link"):
        ds = CachedDataset(str(tmp_path / "data"), cache, CAPACITY)
        ds[2]  # a miss: claimed, fetched, counted
    assert target.read_bytes() == b"precious"


def _make_dir(root: Path) -> Path:
    _files(root, 3)
    return root


def test_segment_smaller_than_a_sample_is_refused_up_front(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _files(data, 3, size=300 << 10)
    with pytest.raises(ConfigError, match="cannot hold the largest sample"):
        CachedDataset(str(data), tmp_path / "cache", "64MiB", segment_size="256KiB")


def test_dataset_item_larger_than_a_segment_is_served_uncached(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    large = next(i for i in range(400) if i not in probe_indices(400))
    items = [b"s" * 1000] * 400  # the probe sees small items only
    items[large] = b"L" * (3 << 20)
    ds = CachedDataset(items, tmp_path / "cache", "64MiB")
    with caplog.at_level(logging.WARNING, logger="lcache"):
        assert ds[large] == items[large] and ds[large] == items[large]
    assert caplog.text.count("larger than a segment") == 1
    small = probe_indices(400)[0]
    assert large not in ds.cache.store()
    assert ds[small] == items[small] and small in ds.cache.store()


# ----------------------------------------------------------------------- round 6
def _identity(item: bytes) -> bytes:
    return item


def test_a_closed_handle_cannot_be_used_again(tmp_path: Path) -> None:
    """The finding: a closed handle reopened its stores on the next read, without the
    directory's lock and without checking the listing: opened after it for another listing,
    a dataset then served the closed one's samples."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 20)
    train, val = _halves(data, files)
    a = CachedDataset(str(data), cache, CAPACITY, files=train)
    assert a[0] == files[0]
    a.cache.close()
    b = CachedDataset(str(data), cache, CAPACITY, files=val)
    with pytest.raises(ConfigError, match="was closed"):
        a[1]
    assert [b[i] for i in range(10)] == files[10:]


def test_a_spawned_worker_holds_the_directory_as_its_parent(tmp_path: Path) -> None:
    """The finding: a DataLoader worker started with spawn (the dataset pickled) held no
    lock, so once its parent closed the handle another listing was accepted while the
    worker went on caching the old one's samples under the same numbers."""
    from torch.utils.data import DataLoader

    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 20)
    train, val = _halves(data, files)
    a = CachedDataset(str(data), cache, CAPACITY, files=train)
    loader = DataLoader(a, batch_size=5, num_workers=1, multiprocessing_context="spawn",
                        persistent_workers=True, collate_fn=_identity)
    assert [x for batch in loader for x in batch] == files[:10]
    a.cache.close()
    with pytest.raises(ConfigError, match="is open for"):
        CachedDataset(str(data), cache, CAPACITY, files=val)
    del loader  # the worker exits, and its hold with it
    b = CachedDataset(str(data), cache, CAPACITY, files=val)
    assert [b[i] for i in range(10)] == files[10:]


def test_a_listing_file_left_by_a_killed_publish_is_not_trusted(tmp_path: Path) -> None:
    """The finding: a run killed between writing listing.bin and cache.json left the new
    listing beside the old identity; a check=False open then cached the old listing's
    samples, and the next open of the new listing compared with listing.bin, found nothing
    changed, and served them."""
    from lcache.data import FileSource

    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 8)
    names = sorted(p.name for p in data.iterdir())
    first = CachedDataset(str(data), cache, CAPACITY, files=names)
    assert [first[i] for i in range(8)] == files
    first.cache.close()
    # What the killed run left: listing.bin of the reversed listing, cache.json as it was.
    flipped = FileSource(str(data), files=names[::-1]).fingerprints()
    (cache / "listing.bin").write_bytes(flipped.astype("<u8").tobytes())
    trusting = CachedDataset(str(data), cache, CAPACITY, files=names, check=False)
    assert [trusting[i] for i in range(8)] == files
    trusting.cache.close()
    checking = CachedDataset(str(data), cache, CAPACITY, files=names[::-1])
    assert [checking[i] for i in range(8)] == files[::-1]


def test_a_source_whose_fingerprints_take_no_versions(tmp_path: Path) -> None:
    """The finding: a source of one's own with ``fingerprints()`` (as the protocol said)
    was a TypeError once versions= was asked for."""
    class Mine:
        url = "mine:"

        def __len__(self) -> int:
            return 3

        def sizes(self) -> Any:
            return np.full(3, 4, np.int64)

        def fetch(self, index: int) -> bytes:
            return bytes([index]) * 4

        def decode(self, data: Any) -> bytes:
            return bytes(data)

        def fingerprints(self) -> Any:
            return np.arange(3, dtype=np.uint64)

    ds = CachedDataset(Mine(), tmp_path / "c", CAPACITY)
    assert ds[2] == b"\x02" * 4


@pytest.mark.parametrize("victim", ["cache.json", "source-listing.json"])
def test_json_nested_too_deeply_reads_as_damaged(tmp_path: Path, victim: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The finding: 100,000 nested objects (under 1 MiB) were a RecursionError traceback."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 4)
    CachedDataset(str(data), cache, CAPACITY).cache.close()
    (cache / victim).write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    again = CachedDataset(str(data), cache, CAPACITY)
    assert again[3] == files[3]


def test_samples_appended_while_open_keep_the_id_and_say_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The findings: a file appended by another open gave the directory a new id, and a
    job's spawned workers, started after it, were refused ('opened for another listing');
    and ranks that listed before and after the append used different sample counts (an
    epoch read some samples twice and others never), without a word."""
    from torch.utils.data import DataLoader

    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 10)
    job = CachedDataset(str(data), cache, CAPACITY)
    (data / "s9999.bin").write_bytes(b"late")
    with caplog.at_level(logging.WARNING, logger="lcache"):
        later = CachedDataset(str(data), cache, CAPACITY)
    assert later.cache.cache_id == job.cache.cache_id and len(later) == 11
    assert any("1 samples were appended to the listing" in r.getMessage() and
               "open elsewhere with 10" in r.getMessage() for r in caplog.records)
    loader = DataLoader(job, batch_size=5, num_workers=1, multiprocessing_context="spawn",
                        collate_fn=_identity)
    assert [x for batch in loader for x in batch] == files
    assert later[10] == b"late"


def test_a_relative_source_path_names_the_folder_it_means(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The findings: "data" in two project folders was one source to a shared cache: with
    listing_ttl the second project was served the first one's listing and bytes, and with
    check=False a RangeSource or WebDatasetSource of the same-size file served its bytes."""
    cache = tmp_path / "cache"
    for project, fill in (("a", b"A"), ("b", b"B")):
        (tmp_path / project / "data").mkdir(parents=True)
        for i in range(4):
            (tmp_path / project / "data" / f"{i}.bin").write_bytes(fill * 100)
    monkeypatch.chdir(tmp_path / "a")
    for url in ("data", "file://data"):  # fsspec reads file://data as relative too
        first = CachedDataset(url, cache / url[:4], CAPACITY, listing_ttl=float("inf"))
        assert first[0] == b"A" * 100
        first.cache.close()
    ranges = CachedDataset(RangeSource("data", "0.bin", [0], [50]), tmp_path / "r", CAPACITY,
                           check=False)
    assert ranges[0] == b"A" * 50
    ranges.cache.close()
    monkeypatch.chdir(tmp_path / "b")
    for url in ("data", "file://data"):
        with pytest.raises(ConfigError, match="use another cache directory"):
            CachedDataset(url, cache / url[:4], CAPACITY, listing_ttl=float("inf"))
    with pytest.raises(ConfigError, match="use another cache directory"):
        CachedDataset(RangeSource("data", "0.bin", [0], [50]), tmp_path / "r", CAPACITY,
                      check=False)


# ------------------------------------------------------------ a store of unknown origin
def test_store_folder_with_other_files_is_refused_not_removed(tmp_path: Path) -> None:
    """The finding (attack helper 47): a cache directory without cache.json (or with a
    damaged one) removed DIR/store whole, whatever it held: here a folder of code."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    _files(data, 3)
    # and (attack helper 54) a folder under a segment's name
    for folder in ("mycode", "segments/0000000001.log"):
        shutil.rmtree(cache, ignore_errors=True)
        mine = cache / "store" / folder / "main.py"
        mine.parent.mkdir(parents=True)
        mine.write_text("precious")
        for identity in (None, b"damaged"):
            if identity is not None:
                (cache / "cache.json").write_bytes(identity)
            with pytest.raises(ConfigError, match=r"store holds what no lcache store writes "
                                                  rf"\(.*{folder}\)"):
                CachedDataset(str(data), cache, CAPACITY)
            assert mine.read_text() == "precious"


def test_a_users_folder_named_like_a_staging_area_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finding (attack helper 54): the clean-up of staging areas left by killed jobs
    removed any folder named staging-* in the cache directory (staging on the SSD, where
    /dev/shm has no room) or lcache-* in /dev/shm holding a file named origin."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    _files(data, 3)
    cache.mkdir(mode=0o700)
    mine = cache / "staging-notes" / "precious.txt"
    mine.parent.mkdir()
    mine.write_text("precious")
    ds = CachedDataset(str(data), cache, CAPACITY, staging_bytes="100GiB")  # on the SSD
    assert ds.cache.staging_dir.startswith(str(cache)) and ds[0]
    ds.cache.close()
    assert mine.read_text() == "precious"
    shm = Path("/dev/shm") / f"lcache-mine-{os.getpid()}"
    try:
        shm.mkdir(mode=0o700)
        (shm / "origin").write_text(f"{tmp_path / 'gone'}\nabc")
        (shm / "precious.txt").write_text("precious")
        again = CachedDataset(str(data), tmp_path / "cache2", CAPACITY)  # staging in /dev/shm
        assert again[0] and not again.cache.staging_dir.startswith(str(tmp_path))
        again.cache.close()
        assert (shm / "precious.txt").read_text() == "precious"
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_store_with_records_in_a_directory_without_cache_json_is_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A store with records where no cache.json is (a cache writes it before its first
    sample) is another's, such as `lcache store-demo --dir DIR`'s: it was removed. An empty
    one (a first open killed before cache.json) is dropped, as is a cache's under a damaged
    cache.json."""
    from lcache.store import Store

    data, cache = tmp_path / "data", tmp_path / "cache"
    files = _files(data, 3)
    cache.mkdir(mode=0o700)
    with Store.open(cache / "store", capacity="8MiB", segment_size="256KiB",
                    max_writers=2) as store:
        store.put(b"theirs", b"value")
    with pytest.raises(ConfigError, match=r"store that holds records, but .*cache has no "
                                          "cache.json"):
        CachedDataset(str(data), cache, CAPACITY)
    with Store.open(cache / "store", create=False) as store:
        assert store.get(b"theirs") == b"value"
    (cache / "cache.json").write_bytes(b"damaged")
    with caplog.at_level(logging.WARNING, logger="lcache"):
        ds = CachedDataset(str(data), cache, CAPACITY)
    assert "dropping the samples cached in" in caplog.text and ds[1] == files[1]
    ds.cache.close()
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    Store.open(empty / "store", capacity="8MiB", segment_size="256KiB", max_writers=2).close()
    assert CachedDataset(str(data), empty, CAPACITY)[2] == files[2]
