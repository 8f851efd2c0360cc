"""``LitDataSource`` against chunks written by litdata's own ``optimize`` (tests/data/litdata,
see its README): every item's tree and leaves as the writer was given them, one request per
chunk over HTTP, the cache; compressed, encrypted and other-loader datasets refused; a
corrupt index, a truncated or unreachable chunk named."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lcache.data import CachedDataset, SourceError
from lcache.data.formats import LitDataSource
from lcache.data.formats.litdata import _leaf
from lcache.errors import ConfigError, CorruptionError
from lcache.testing.remote import ThrottledServer

from .conftest import rewrite_unseen, served
from .data.make_fixtures import payload

FIXTURE = Path(__file__).parent / "data" / "litdata"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())["samples"]


def _check(i: int, item: Any) -> None:
    want = EXPECTED[i]
    assert isinstance(item, dict) and list(item) == ["data", "label", "name", "arr"]
    assert item["data"] == payload(i, "data")
    assert hashlib.sha256(item["data"]).hexdigest() == want["data"]
    assert item["label"] == want["label"] and item["name"] == want["name"]
    assert item["arr"].dtype == np.float32 and item["arr"].tolist() == want["arr"]


@pytest.fixture
def chunks(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE / "shards", tmp_path / "remote" / "lit"))


def test_items_are_what_the_writer_was_given() -> None:
    src = LitDataSource(str(FIXTURE / "shards"))
    assert len(src) == len(EXPECTED) == 10 and len(src._files) == 4
    assert src.formats == ["bytes", "int", "str", "no_header_numpy:9"]
    for i, data in enumerate(src.fetch_many(range(10))):
        _check(i, src.decode(data))


def test_leaves_as_litdata_stores_them() -> None:
    import struct

    import torch

    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    numpy_leaf = struct.pack("<II", 1, 2) + struct.pack("<II", 2, 3) + arr.tobytes()
    assert np.array_equal(_leaf("numpy", memoryview(numpy_leaf)), arr)
    t = torch.arange(4, dtype=torch.bfloat16)
    bits = t.view(torch.int16).numpy().tobytes()
    tensor_leaf = struct.pack(">II", 10, 1) + struct.pack(">I", 4) + bits
    assert torch.equal(_leaf("tensor", memoryview(tensor_leaf)), t)
    assert _leaf("float", memoryview(struct.pack("<d", 2.5))) == 2.5
    assert _leaf("bool", memoryview(b"\x01")) is True
    assert _leaf("pickle", memoryview(b"\x80\x04K\x01.")) == b"\x80\x04K\x01."  # raw, unloaded
    assert _leaf("no_header_numpy:14", memoryview(b"12345678")) == b"12345678"  # object dtype


def test_over_http_and_through_the_cache(chunks: Path, tmp_path: Path) -> None:
    with ThrottledServer(str(chunks.parent)) as server:
        src = LitDataSource(server.url + "/lit/")
        ds = CachedDataset(src, tmp_path / "cache", "16MiB")
        before = sum(v for k, v in server.paths.items() if k.endswith(".bin"))
        for i, item in enumerate(ds.__getitems__(list(range(10)))):
            _check(i, item)
        assert sum(v for k, v in server.paths.items() if k.endswith(".bin")) - before == 4
        for i in range(10):
            _check(i, ds[i])


@pytest.mark.parametrize("change,refused", [
    ({"compression": "zstd"}, "compressed"), ({"encryption": {"level": "chunk"}}, "encrypted"),
    ({"item_loader": "TokensLoader"}, "TokensLoader"),
    ("json", "'json' leaves"),
])
def test_unreadable_kinds_are_refused(chunks: Path, change: dict[str, Any],
                                      refused: str) -> None:
    index = json.loads((chunks / "index.json").read_text())
    if change == "json":  # the finding: lists in rows came out as litdata's own bytes
        index["config"]["data_format"][0] = "json"
        change = {}
    index["config"].update(change)
    (chunks / "index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=refused):
        LitDataSource(str(chunks))


def test_corrupt_index_truncated_and_unreachable_chunks(chunks: Path) -> None:
    index = json.loads((chunks / "index.json").read_text())
    index["chunks"][2]["chunk_size"] = 3
    (chunks / "index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=r"chunk-0-2.bin: holds 2 samples, its index says 3"):
        LitDataSource(str(chunks))
    (chunks / "index.json").write_text(json.dumps({"chunks": []}))
    with pytest.raises(CorruptionError, match="not a LitData index"):
        LitDataSource(str(chunks))
    index["chunks"][2]["chunk_size"] = float("inf")  # a bare OverflowError before
    (chunks / "index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptionError, match="not a LitData index"):
        LitDataSource(str(chunks))
    index["chunks"][2]["chunk_size"] = 2
    index["chunks"][0]["filename"] = "../lit/chunk-0-0.bin"  # read from outside, before
    (chunks / "index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptionError, match=r"chunk 0: '\.\./lit/chunk-0-0.bin' is not under"):
        LitDataSource(str(chunks))
    shutil.copy(FIXTURE / "shards" / "index.json", chunks / "index.json")
    src = LitDataSource(str(chunks))
    raw = (chunks / "chunk-0-3.bin").read_bytes()
    (chunks / "chunk-0-3.bin").write_bytes(raw[:-100])
    with pytest.raises(SourceError, match=r"^cannot read samples 8, 9 .*chunk-0-3.bin\): .*"
                                          r"now 4586 bytes, 4686 when it was listed"):
        src.fetch_many([8, 9])
    with ThrottledServer(str(chunks.parent)) as server:
        (chunks / "chunk-0-3.bin").write_bytes(raw)
        remote = LitDataSource(server.url + "/lit", retries=0)
        (chunks / "chunk-0-0.bin").unlink()
        with pytest.raises(SourceError, match=rf"sample 1 .*{server.url}/lit/chunk-0-0.bin"):
            remote.fetch(1)


@pytest.mark.parametrize("spec,why", [
    ([1, {"type": "builtins.list", "context": "null", "children_spec": [{"type": None}]}],
     "1 leaves for 4 formats"),
    ([1, json.loads('{"type": "builtins.list", "context": "null", "children_spec": ['
                    * 400 + '{"type": null}' + "]}" * 400)], "nested too deeply"),
    ([1, {"type": "builtins.dict", "context": "[\"a\"]",
          "children_spec": [{"type": None}] * 4}], "a dict without one key per child"),
])
def test_a_data_spec_that_cannot_be_its_items_is_refused(chunks: Path, spec: Any,
                                                          why: str) -> None:
    """The findings: a spec nested 400 deep was a bare RecursionError; one with fewer leaves
    than formats dropped leaves, and one with a dict without keys failed only when decoding."""
    index = json.loads((chunks / "index.json").read_text())
    index["config"]["data_spec"] = json.dumps(spec)
    (chunks / "index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptionError, match=why):
        LitDataSource(str(chunks))


def test_an_item_whose_sizes_do_not_add_up_is_refused(chunks: Path) -> None:
    with served(chunks) as url:
        src = LitDataSource(url)
        raw = bytearray((chunks / "chunk-0-1.bin").read_bytes())
        start = int(src.offsets[4])  # item 4: the second of chunk 1
        assert src._file_of[4] == 1
        raw[start:start + 4] = (7).to_bytes(4, "little")  # its first leaf's size
        rewrite_unseen(chunks / "chunk-0-1.bin", bytes(raw))
        with pytest.raises(SourceError, match=r"^item 4 \(.*chunk-0-1.bin#bytes=.*\): its "
                                              "leaves add up to"):
            src.fetch_many([3, 4, 5])
