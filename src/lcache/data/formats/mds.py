"""MosaicML streaming MDS shards as a source, without conversion.

``index.json`` names the shards, their sample counts, sizes and columns; each shard starts
with ``uint32 count, uint32 offsets[count + 1]``, read with one ranged request per shard
(concurrently). Sample ``i`` is the bytes between two offsets: ``uint32`` sizes of its
variable-size columns, then each column's bytes. ``decode`` returns ``{column: value}``:
numbers, strings, JSON and ``ndarray`` columns as MDS decodes them; images (``jpeg``,
``png``, ``pil``), lists and ``pkl`` columns as their raw bytes. Nothing is ever unpickled.
Compressed shards (``compression=`` at write time) have no per-sample byte ranges and are
refused; so are shards of different columns in one dataset. MDS keeps hashes of whole
shards only, so a fetched sample is checked by its structure (the sizes it declares add up
to its length), not by a checksum.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import numpy as np

from lcache import jsondoc
from lcache.data.formats.shards import (
    checked_infos,
    count,
    make_remote,
    read_json,
    read_offsets,
    split_sized,
    table,
    under_url,
)
from lcache.data.remote import SourceCorruptionError
from lcache.data.sources import RangeSource
from lcache.errors import ConfigError

_SCALARS = {n: np.dtype(n) for n in ("uint8", "uint16", "uint32", "uint64", "int8", "int16",
                                      "int32", "int64", "float16", "float32", "float64")}
_NDARRAY_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16",
                   32: "uint32", 33: "int32", 34: "float32", 64: "uint64", 65: "int64",
                   66: "float64"}


class MDSSource(RangeSource):
    """The samples of the MDS dataset whose ``index.json`` is at ``url``."""

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None,
                 **fetch_options: Any) -> None:
        remote = make_remote(url, storage_options, fetch_options)
        index_url = remote.full_url(remote.path("index.json"))
        shards = _shards(read_json(remote, "index.json"), index_url)
        names = [s["raw_data"]["basename"] for s in shards]
        sizes = [int(s["raw_data"]["bytes"]) for s in shards]
        counts = [int(s["samples"]) for s in shards]
        infos = checked_infos(remote, names, sizes, "shard")
        file_of, offsets, lengths = table(read_offsets(remote, names, counts, sizes, "shard"))
        self.columns: list[str] = list(shards[0]["column_names"])
        self._encodings: list[str] = list(shards[0]["column_encodings"])
        self._fixed: list[int | None] = [None if n is None else int(n)
                                         for n in shards[0]["column_sizes"]]
        self._setup(remote, names, infos, file_of, offsets, lengths)

    def _split(self, data: bytes | memoryview, where: str) -> list[memoryview]:
        return split_sized(data, self._fixed, where, ("column", "columns"))

    def check(self, index: int, data: bytes) -> None:
        self._split(data, f"sample {index} ({self.path_of(index)})")

    def decode(self, data: bytes | memoryview) -> dict[str, Any]:
        parts = self._split(data, "a cached MDS sample")
        return {name: _value(enc, part) for name, enc, part in
                zip(self.columns, self._encodings, parts, strict=True)}


def _shards(index: Any, url: str) -> list[dict[str, Any]]:
    """The shards of an MDS ``index.json``, checked enough to be used."""
    shards = index.get("shards") if isinstance(index, dict) else None
    if not isinstance(shards, list) or not shards:
        raise SourceCorruptionError(f"{url}: no \"shards\" list: not an MDS index")
    first = None
    for k, shard in enumerate(shards):
        try:
            columns = (list(shard["column_names"]), list(shard["column_encodings"]),
                       list(shard["column_sizes"]))
            basename, size = shard["raw_data"]["basename"], count(shard["raw_data"]["bytes"])
            samples = count(shard["samples"])
            ok = (shard.get("format") == "mds" and isinstance(basename, str) and size >= 0
                  and samples >= 0 and len(set(map(len, columns))) == 1
                  and all(isinstance(e, str) for e in columns[1])
                  and all(n is None or count(n) >= 0 for n in columns[2]))
        except (KeyError, TypeError, ValueError, OverflowError):  # int(Infinity): Overflow
            ok = False
        if not ok:
            raise SourceCorruptionError(f"{url}: shard {k} is not an MDS shard entry")
        under_url(basename, url.rsplit("/", 1)[0], f"{url}: shard {k}")
        if shard.get("compression"):
            raise ConfigError(
                f"{url}: shard {basename} is compressed ({shard['compression']}); a compressed "
                "shard has no per-sample byte ranges: write the dataset with compression=None "
                "to cache it sample by sample")
        if first is None:
            first = columns
        elif columns != first:
            raise ConfigError(f"{url}: shard {basename} has other columns than the first "
                              "shard; lcache reads one set of columns per dataset")
    return shards


def _value(encoding: str, raw: memoryview) -> Any:
    """A column's value from its bytes, as MDS decodes it; raw bytes for images, lists and
    pickles (never unpickled)."""
    kind, _, spec = encoding.partition(":")
    if kind == "bytes":
        return bytes(raw)
    if kind == "str":
        return bytes(raw).decode("utf-8")
    if kind == "int":
        return int(np.frombuffer(raw, "<i8")[0])
    if kind in _SCALARS:
        return np.frombuffer(raw, _SCALARS[kind].newbyteorder("<"))[0]
    if kind == "str_int":
        return int(bytes(raw).decode())
    if kind == "str_float":
        return float(bytes(raw).decode())
    if kind == "str_decimal":
        return Decimal(bytes(raw).decode())
    if kind == "json":
        return jsondoc.loads(bytes(raw).decode("utf-8"))
    if kind == "ndarray":
        return _ndarray(spec, raw)
    return bytes(raw)


def _ndarray(spec: str, raw: memoryview) -> np.ndarray:
    """MDS's ``ndarray[:dtype[:shape]]``: what the encoding leaves out, the bytes say."""
    args = spec.split(":") if spec else []
    pos = 0
    if args and args[0]:
        dtype = args[0]
    else:
        dtype = _NDARRAY_DTYPES[raw[0]]
        pos = 1
    if len(args) > 1:
        shape = tuple(int(d) for d in args[1].split(","))
    else:
        ndim, width = raw[pos] >> 2, 1 << (raw[pos] & 3)
        shape = tuple(np.frombuffer(raw[pos + 1:pos + 1 + ndim * width],
                                    f"<u{width}").tolist())
        pos += 1 + ndim * width
    return np.frombuffer(raw[pos:], np.dtype(dtype).newbyteorder("<")).reshape(shape).copy()
