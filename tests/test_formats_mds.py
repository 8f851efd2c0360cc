"""``MDSSource`` against shards written by mosaicml-streaming's own ``MDSWriter``
(tests/data/mds, see its README): every column of every sample as the writer was given it,
the pickle column as raw bytes and never unpickled, one request per shard over HTTP, the
cache; compressed shards refused; corrupt index, truncated and unreachable shards named."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lcache.data import CachedDataset, SourceError
from lcache.data.formats import MDSSource
from lcache.errors import ConfigError, CorruptionError
from lcache.testing.remote import ThrottledServer

from .conftest import rewrite_unseen, served
from .data.make_fixtures import payload

FIXTURE = Path(__file__).parent / "data" / "mds"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())["samples"]


def _check(i: int, item: dict[str, Any]) -> None:
    want = EXPECTED[i]
    assert item["data"] == payload(i, "data")
    assert hashlib.sha256(item["data"]).hexdigest() == want["data"]
    assert item["label"] == want["label"] and type(item["label"]) is int
    assert item["name"] == want["name"]
    assert item["meta"] == want["meta"]
    assert item["small"] == want["small"] and item["small"].dtype == np.uint8
    assert item["vec"].dtype == np.float32 and item["vec"].tolist() == want["vec"]
    # The pkl column: the writer's pickle bytes, never loaded.
    assert item["blob"] == pickle.dumps({"never": "unpickled", "i": i})


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE / "shards", tmp_path / "remote" / "mds"))


def test_columns_are_what_the_writer_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("lcache unpickled something")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    src = MDSSource(str(FIXTURE / "shards"))
    assert len(src) == len(EXPECTED) == 9 and len(src._files) == 3
    assert src.columns == ["blob", "data", "label", "meta", "name", "small", "vec"]
    for i, data in enumerate(src.fetch_many(range(9))):
        _check(i, src.decode(data))


def test_over_http_and_through_the_cache(shards: Path, tmp_path: Path) -> None:
    with ThrottledServer(str(shards.parent)) as server:
        src = MDSSource(server.url + "/mds")
        ds = CachedDataset(src, tmp_path / "cache", "16MiB")
        before = sum(v for k, v in server.paths.items() if k.endswith(".mds"))
        for i, item in enumerate(ds.__getitems__(list(range(9)))):
            _check(i, item)
        assert sum(v for k, v in server.paths.items() if k.endswith(".mds")) - before == 3
        for i in range(9):
            _check(i, ds[i])
        assert ds.stats()["from_ssd"] == 9


def test_compressed_shards_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"shard.00000.mds is compressed \(zstd\).*"
                                          "compression=None"):
        MDSSource(str(FIXTURE.parent / "mds-zstd" / "shards"))


@pytest.mark.parametrize("damage,why", [
    (lambda d: d.update(shards="x"), r"no \"shards\" list"),
    (lambda d: d["shards"][1].pop("raw_data"), r"shard 1 is not an MDS shard entry"),
    (lambda d: d["shards"][1].update(samples=4), r"shard.00001.mds: holds 3 samples, its "
                                                  r"index says 4"),
    (lambda d: d["shards"][2]["raw_data"].update(bytes=99), r"shard.00002.mds: 2799 bytes, "
                                                             r"its index says 99"),
    # Regression: a name out of the dataset's folder was read (and cached) from there.
    (lambda d: d["shards"][0]["raw_data"].update(basename="../mds/shard.00000.mds"),
     r"index.json: shard 0: '\.\./mds/shard.00000.mds' is not under"),
    (lambda d: d["shards"][0]["raw_data"].update(basename="/etc/passwd"),
     r"shard 0: '/etc/passwd' is not under"),
    # Regression: Infinity was a bare OverflowError.
    (lambda d: d["shards"][0]["raw_data"].update(bytes=float("inf")),
     r"shard 0 is not an MDS shard entry"),
    (lambda d: d["shards"][0].update(column_sizes=[float("inf")] * 7),
     r"shard 0 is not an MDS shard entry"),
    # Regression: int() cut 8.7 to 8 and read True as 1.
    (lambda d: d["shards"][0].update(samples=3.5), r"shard 0 is not an MDS shard entry"),
    (lambda d: d["shards"][0].update(column_sizes=[True] * 7),
     r"shard 0 is not an MDS shard entry"),
], ids=["no-shards", "no-raw-data", "wrong-count", "wrong-size", "parent", "absolute",
        "infinite-size", "infinite-column", "float-count", "bool-size"])
def test_corrupt_index_is_named(shards: Path, damage: Any, why: str) -> None:
    index = json.loads((shards / "index.json").read_text())
    damage(index)
    (shards / "index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=why) as info:
        MDSSource(str(shards))
    assert str(shards) in str(info.value) and isinstance(info.value, CorruptionError)
    (shards / "index.json").write_text("{not json")
    with pytest.raises(SourceError, match="is not a JSON index"):
        MDSSource(str(shards))
    (shards / "index.json").write_text("[" * 100_000)  # a bare RecursionError before
    with pytest.raises(SourceError, match="is not a JSON index: nested too deeply"):
        MDSSource(str(shards))


def test_truncated_or_damaged_shard_is_named(shards: Path) -> None:
    src = MDSSource(str(shards))
    assert src._file_of.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 2]  # samples 5-7 in shard 1
    raw = (shards / "shard.00001.mds").read_bytes()
    (shards / "shard.00001.mds").write_bytes(raw[:3000])  # after the source was opened
    with pytest.raises(SourceError, match=r"^cannot read samples 5, 6, 7 .*shard.00001.mds\): "
                                          r".*now 3000 bytes, 7152 when it was listed"):
        src.fetch_many([7, 6, 5])
    with pytest.raises(SourceError, match=r"shard.00001.mds: 3000 bytes, its index says"):
        MDSSource(str(shards))
    # The sizes a sample declares must add up to its length.
    (shards / "shard.00001.mds").write_bytes(raw)
    damaged = bytearray(raw)
    start = int(src.offsets[6])
    damaged[start:start + 4] = (10**6).to_bytes(4, "little")  # its first column's size
    with served(shards) as url:
        src = MDSSource(url)
        rewrite_unseen(shards / "shard.00001.mds", bytes(damaged))
        with pytest.raises(SourceError, match=r"^sample 6 \(.*#bytes=.*\): its columns add "
                                              "up"):
            src.fetch(6)


def test_an_empty_sample_in_a_shard_header_is_named(shards: Path) -> None:
    """Regression: two equal offsets in a shard's header (a 0-byte sample, which MDSWriter
    never writes) were a ConfigError naming neither the shard nor the sample."""
    shard = shards / "shard.00001.mds"
    raw = bytearray(shard.read_bytes())
    raw[12:16] = raw[8:12]  # offsets 1 and 2 equal: its sample 1 is empty
    shard.write_bytes(bytes(raw))
    with pytest.raises(SourceError, match=r"shard.00001.mds: sample 1 of the shard is empty "
                                          r"\(bytes (\d+)-\1\): a corrupt shard") as info:
        MDSSource(str(shards))
    assert isinstance(info.value, CorruptionError)


def test_unreachable_shard_is_named(shards: Path) -> None:
    with ThrottledServer(str(shards.parent)) as server:
        src = MDSSource(server.url + "/mds", retries=0)
        (shards / "shard.00002.mds").unlink()
        with pytest.raises(SourceError) as info:
            src.fetch_many([0, 8])
        assert "sample 8" in str(info.value)
        assert f"{server.url}/mds/shard.00002.mds" in str(info.value)


def test_a_column_that_does_not_decode_is_named(shards: Path, tmp_path: Path) -> None:
    """Regression: MDS carries no checksum per sample; a byte of a str column damaged at the
    source came out of ``ds[i]`` as a bare UnicodeDecodeError naming nothing."""
    name = EXPECTED[0]["name"].encode()
    shard = shards / "shard.00000.mds"
    raw = shard.read_bytes()
    assert raw.count(name) == 1
    shard.write_bytes(raw.replace(name, b"\xff" + name[1:]))
    ds = CachedDataset(MDSSource(str(shards)), tmp_path / "cache", "16MiB")
    with pytest.raises(CorruptionError, match=r"^sample 0 \(.*shard.00000.mds#bytes=\d+-\d+\): "
                                              "its bytes do not decode .*UnicodeDecodeError"):
        ds[0]
    _check(1, ds[1])


def test_a_server_ignoring_ranges_on_shard_headers_is_named(shards: Path) -> None:
    why = (r"shard.00000.mds answered \d+ bytes for bytes 0-\d+ \(a server that ignores Range "
           "requests")
    with ThrottledServer(str(shards.parent), fault=lambda path, nth: "ignore-range") as server, \
            pytest.raises(SourceError, match=why):
        MDSSource(server.url + "/mds", retries=0)
