"""``TableSource``: samples listed as (path, offset, length) rows in CSV or JSON, fetched as
exact byte ranges, coalesced per file; bad rows named with their line."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from lcache.data import CachedDataset, FileSource, SourceError
from lcache.data.formats import TableSource
from lcache.errors import ConfigError, CorruptionError
from lcache.testing.remote import ThrottledServer


@pytest.fixture
def files(tmp_path: Path) -> dict[str, bytes]:
    out = {"a.bin": random.Random(1).randbytes(5000),
           "sub/b.bin": random.Random(2).randbytes(3000)}
    for name, data in out.items():
        (tmp_path / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / name).write_bytes(data)
    return out


ROWS = [("a.bin", 0, 100), ("sub/b.bin", 10, 990), ("a.bin", 100, 400), ("a.bin", 4000, 1000)]


def _want(files: dict[str, bytes]) -> list[bytes]:
    return [files[p][o:o + n] for p, o, n in ROWS]


@pytest.mark.parametrize("form", ["csv", "json-rows", "json-columns"])
def test_table_forms(tmp_path: Path, files: dict[str, bytes], form: str) -> None:
    data = tmp_path / "data"
    if form == "csv":
        lines = ["path,offset,length,comment"] + [f"{p},{o},{n},x" for p, o, n in ROWS]
        (data / "t.csv").write_text("\n".join(lines) + "\n")
        name = "t.csv"
    elif form == "json-rows":
        rows = [{"url": f"{data}/{p}", "offset": o, "length": n} for p, o, n in ROWS]
        (data / "t.json").write_text(json.dumps(rows))  # absolute paths under the URL
        name = "t.json"
    else:
        cols = {"paths": [r[0] for r in ROWS], "offsets": [r[1] for r in ROWS],
                "lengths": [r[2] for r in ROWS]}
        (data / "t.json").write_text(json.dumps(cols))
        name = "t.json"
    src = TableSource(str(data), name)
    assert src.fetch_many(range(4)) == _want(files)
    assert src.sizes().tolist() == [r[2] for r in ROWS]


def test_over_http_coalesced_and_cached(tmp_path: Path, files: dict[str, bytes]) -> None:
    lines = ["path,offset,length"] + [f"{p},{o},{n}" for p, o, n in ROWS]
    (tmp_path / "data" / "t.csv").write_text("\n".join(lines))
    with ThrottledServer(str(tmp_path)) as server:
        src = TableSource(server.url + "/data", "t.csv", coalesce_gap=1000)
        ds = CachedDataset(src, tmp_path / "c", "16MiB")
        assert ds.__getitems__([0, 1, 2, 3]) == _want(files)
        assert server.paths["/data/a.bin"] == 2  # bytes 0-500 in one request, 4000-5000
        assert server.paths["/data/sub/b.bin"] == 1
        assert [ds[i] for i in range(4)] == _want(files)


def test_percent_encoded_parents_do_not_leave_the_url(tmp_path: Path,
                                                      files: dict[str, bytes]) -> None:
    """HTTP clients decode "%2e%2e" and normalise it away: a table row or files= name
    "%2e%2e/secret.bin" under /data was fetched as /secret.bin, and cached as a sample."""
    (tmp_path / "secret.bin").write_bytes(b"outside the source")
    (tmp_path / "data" / "t.csv").write_text("path,offset,length\n%2e%2e/secret.bin,0,5\n")
    with ThrottledServer(str(tmp_path)) as server:
        with pytest.raises(CorruptionError, match=r"'%2e%2e/secret\.bin' is not under"):
            TableSource(server.url + "/data", "t.csv")
        with pytest.raises(ConfigError, match=r"'%2e%2e/secret\.bin' is not a name"):
            FileSource(server.url + "/data", files=["%2e%2e/secret.bin"])
        # the finding: "a?b.bin" was fetched as "a" (the rest is a URL's query)
        for name in ("a?b.bin", "c#d.bin"):
            with pytest.raises(ConfigError, match="'\\?' and '#' end a URL's path"):
                FileSource(server.url + "/data", files=[name])
        # a path parameter: Tomcat and Spring resolve "..;" as ".."
        with pytest.raises(ConfigError, match=r"'\.\.;/secret\.bin' is not a name"):
            FileSource(server.url + "/data", files=["..;/secret.bin"])
        assert server.paths["/secret.bin"] == 0
    # A local file system decodes nothing: a file named "%2e%2e" is a name like any other.
    (tmp_path / "data" / "%2e%2e").mkdir()
    (tmp_path / "data" / "%2e%2e" / "x.bin").write_bytes(b"local")
    assert FileSource(str(tmp_path / "data"), files=["%2e%2e/x.bin"]).fetch(0) == b"local"


@pytest.mark.parametrize("body,why", [
    ("path,offset\na.bin,0\n", r"header \['path', 'offset'\] lacks"),
    ("path,offset,length\na.bin,0,100\na.bin,-1,5\n", r"row 3: \('a.bin', '-1', '5'\)"),
    ("path,offset,length\na.bin,zero,5\n", r"row 2:"),
    ("path,offset,length\n../x.bin,0,5\n", r"row 2: '../x.bin' is not under"),
    ("path,offset,length\nsub/%2E%2e/%2e%2e/x.bin,0,5\n", r"row 2: 'sub/%2E%2e/%2e%2e/x"),
    ("path,offset,length\n", "lists no samples"),
    # Regression: an offset past 2**63 was a bare OverflowError, and one that overflowed
    # int64 with its length slipped past the end-of-file check.
    (f"path,offset,length\na.bin,{2**63},5\n", r"row 2: .*that end before 2\*\*62"),
    (f"path,offset,length\na.bin,{2**63 - 10},20\n", r"row 2: .*that end before 2\*\*62"),
    # Regression: int() read "1_0" as 10 and Arabic-Indic digits as numbers.
    ("path,offset,length\na.bin,1_0,5\n", r"row 2: \('a.bin', '1_0', '5'\)"),
    ("path,offset,length\na.bin,\u0661,5\n", r"row 2:"),
])
def test_bad_tables_are_named(tmp_path: Path, files: dict[str, bytes], body: str,
                              why: str) -> None:
    (tmp_path / "data" / "t.csv").write_text(body)
    with pytest.raises(CorruptionError, match=why) as info:
        TableSource(str(tmp_path / "data"), "t.csv")
    assert str(tmp_path / "data" / "t.csv") in str(info.value)


@pytest.mark.parametrize("row", [{"path": "a.bin", "offset": 1.9, "length": 2.9},
                                 {"path": "a.bin", "offset": True, "length": True}])
def test_json_numbers_that_are_not_whole_are_refused(tmp_path: Path, files: dict[str, bytes],
                                                     row: dict[str, Any]) -> None:
    """The finding: a JSON table's 1.9 was cut to 1 and true read as 1 (RangeSource given
    the same refuses them)."""
    (tmp_path / "data" / "t.json").write_text(json.dumps([row]))
    with pytest.raises(CorruptionError, match="row 1"):
        TableSource(str(tmp_path / "data"), "t.json")


def test_ranges_beyond_a_file_or_missing_files(tmp_path: Path, files: dict[str, bytes]) -> None:
    data = tmp_path / "data"
    (data / "t.csv").write_text("path,offset,length\na.bin,4900,200\n")
    with pytest.raises(ConfigError, match=r"sample 0: bytes 4900-5100 lie beyond the end of "
                                          r"a.bin \(5000 bytes\)"):
        TableSource(str(data), "t.csv")
    (data / "t.csv").write_text("path,offset,length\ngone.bin,0,10\n")
    with pytest.raises(SourceError, match=r"gone\.bin"):
        TableSource(str(data), "t.csv")
    with pytest.raises(SourceError, match="cannot read the table"):
        TableSource(str(data), "missing.csv")


def test_a_csv_table_saved_with_a_bom_is_read(tmp_path: Path, files: dict[str, bytes]) -> None:
    """Regression: a table saved by a spreadsheet (UTF-8 with a BOM) was refused, its header
    read as ['\\ufeffpath', ...]."""
    lines = ["path,offset,length"] + [f"{p},{o},{n}" for p, o, n in ROWS]
    (tmp_path / "data" / "t.csv").write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    assert TableSource(str(tmp_path / "data"), "t.csv").fetch_many(range(4)) == _want(files)


def test_a_row_naming_a_folder_or_a_block_of_zero_is_refused(tmp_path: Path,
                                                              files: dict[str, bytes]) -> None:
    """The findings: a table row naming a folder passed (a folder stats as 4,096 bytes) and
    failed only at the first fetch; WebDatasetSource(index_block=0) was taken."""
    from lcache.data.formats import WebDatasetSource

    (tmp_path / "data" / "t.csv").write_text("path,offset,length\nsub,0,100\n")
    with pytest.raises(ConfigError, match=r"'sub' under .* is a folder"):
        TableSource(str(tmp_path / "data"), "t.csv")
    for block in (0, -1, 1.5):
        with pytest.raises(ConfigError, match="index_block="):
            WebDatasetSource(str(tmp_path / "data"), index_block=block)
