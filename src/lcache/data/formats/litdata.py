"""LitData chunks (``litdata.optimize``) as a source, without conversion.

``index.json`` names the chunks, their item counts and sizes, and the items' leaf formats
and tree; each chunk starts with ``uint32 count, uint32 offsets[count + 1]``, read with one
ranged request per chunk (concurrently). An item is ``uint32`` sizes of its leaves, then
their bytes. ``decode`` rebuilds the item's tree (dicts, lists, tuples) with ``bytes``,
``str``, ``int``, ``float``, ``bool``, numpy arrays and torch tensors as litdata stores them;
images, audio, video, graphs and ``pickle`` leaves come as their raw bytes (never
unpickled). Refused: compressed or encrypted chunks, and loaders other than litdata's
default ``PyTreeLoader`` (token and temporal loaders, items kept only in an Arrow footer).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
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

# litdata's _NUMPY_DTYPES_MAPPING (index: dtype); object, bytes, str and void are not arrays
# of numbers (an object array would be unpickled) and come as raw bytes.
_NUMPY = dict(enumerate(["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                         "uint64", "float16", "float32", "float64", "complex64",
                         "complex128", "bool"]))
# litdata's _TORCH_DTYPES_MAPPING
_TORCH = dict(enumerate(["float32", "float32", "float64", "float64", "complex64", "complex64",
                         "complex128", "complex128", "float16", "float16", "bfloat16",
                         "uint8", "int8", "int16", "int16", "int32", "int32", "int64",
                         "int64", "bool", "uint16"]))


class LitDataSource(RangeSource):
    """The items of the LitData dataset whose ``index.json`` is at ``url``."""

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None,
                 **fetch_options: Any) -> None:
        remote = make_remote(url, storage_options, fetch_options)
        index_url = remote.full_url(remote.path("index.json"))
        chunks, config = _index(read_json(remote, "index.json"), index_url)
        names = [c["filename"] for c in chunks]
        sizes = [int(c["chunk_bytes"]) for c in chunks]
        counts = [int(c["chunk_size"]) for c in chunks]
        infos = checked_infos(remote, names, sizes, "chunk")
        file_of, offsets, lengths = table(read_offsets(remote, names, counts, sizes, "chunk"))
        if (lengths == 0).any():
            i = int(np.flatnonzero(lengths == 0)[0])
            raise ConfigError(f"{index_url}: item {i} has no bytes in its chunk (items kept "
                              "only in an Arrow footer); lcache reads PyTreeLoader items")
        self.formats: list[str] = list(config["data_format"])
        if not all(isinstance(f, str) for f in self.formats):
            raise SourceCorruptionError(f"{index_url}: config.data_format is not a list of "
                                        "format names")
        if "json" in self.formats:  # were handed out as opaque bytes for the lists they are
            raise ConfigError(f"{index_url}: its items hold list or dict values ('json' "
                              "leaves), which litdata stores in its own binary encoding; "
                              "lcache does not decode it: store them as str, bytes or arrays")
        self._spec = _spec(config.get("data_spec"), index_url, len(self.formats))
        self._setup(remote, names, infos, file_of, offsets, lengths)

    def _split(self, data: bytes | memoryview, where: str) -> list[memoryview]:
        return split_sized(data, [None] * len(self.formats), where, ("leaf", "leaves"))

    def check(self, index: int, data: bytes) -> None:
        self._split(data, f"item {index} ({self.path_of(index)})")

    def decode(self, data: bytes | memoryview) -> Any:
        leaves = [_leaf(f, part) for f, part in
                  zip(self.formats, self._split(data, "a cached LitData item"), strict=True)]
        if self._spec is None:
            return leaves
        return _unflatten(self._spec, iter(leaves))


def _index(index: Any, url: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    try:
        chunks, config = index["chunks"], index["config"]
        ok = (isinstance(chunks, list) and chunks and isinstance(config, dict)
              and isinstance(config.get("data_format"), list)
              and all(isinstance(c["filename"], str) and count(c["chunk_bytes"]) >= 0
                      and count(c["chunk_size"]) >= 0 for c in chunks))
    except (KeyError, TypeError, ValueError, OverflowError):  # int(Infinity): Overflow
        ok = False
    if not ok:
        raise SourceCorruptionError(f"{url}: not a LitData index (chunks, config.data_format)")
    for k, chunk in enumerate(chunks):
        under_url(chunk["filename"], url.rsplit("/", 1)[0], f"{url}: chunk {k}")
    for field, what in (("compression", "compressed"), ("encryption", "encrypted")):
        if config.get(field):
            raise ConfigError(f"{url}: the chunks are {what} ({config[field]}); such chunks "
                              "have no per-item byte ranges: optimize the dataset without "
                              f"{field} to cache it item by item")
    loader = config.get("item_loader", "PyTreeLoader")
    if loader != "PyTreeLoader":
        raise ConfigError(f"{url}: items written by litdata's {loader}; lcache reads "
                          "PyTreeLoader items (litdata.optimize's default)")
    return chunks, config


MAX_DEPTH = 64  # of an item's tree: litdata items are a few levels deep


def _spec(raw: Any, url: str, leaves: int) -> Any:
    """The item's tree from litdata's ``data_spec`` (torch pytree JSON), or None to give
    the leaves as a list (a tree of types other than dict, list and tuple). A plain tree
    must have one leaf per format, and dicts their keys."""
    if raw is None:
        return None
    try:
        version, node = jsondoc.loads(raw)
        plain = version == 1 and _plain(node, 0)
        if plain and _count_leaves(node) != leaves:
            raise ValueError(f"{_count_leaves(node)} leaves for {leaves} formats")
    except (TypeError, ValueError) as exc:
        raise SourceCorruptionError(f"{url}: config.data_spec is not a pytree spec of "
                                    f"its items ({exc})") from None
    return node if plain else None


def _plain(node: Any, depth: int) -> bool:
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    if not isinstance(node, dict):
        return False
    kind, children = node.get("type"), node.get("children_spec")
    if kind is None:
        return True
    if kind not in ("builtins.dict", "builtins.list", "builtins.tuple",
                    "collections.OrderedDict") or not isinstance(children, list):
        return False
    if kind in ("builtins.dict", "collections.OrderedDict"):
        keys = jsondoc.loads(str(node.get("context", "")))
        if not isinstance(keys, list) or len(keys) != len(children) or \
                not all(isinstance(k, (str, int)) for k in keys):
            raise ValueError("a dict without one key per child")
    return all(_plain(c, depth + 1) for c in children)


def _count_leaves(node: dict[str, Any]) -> int:
    if node["type"] is None:
        return 1
    return sum(_count_leaves(c) for c in node["children_spec"])


def _unflatten(node: dict[str, Any], leaves: Iterator[Any]) -> Any:
    kind = node["type"]
    if kind is None:
        return next(leaves)
    values = [_unflatten(c, leaves) for c in node["children_spec"]]
    if kind in ("builtins.dict", "collections.OrderedDict"):
        return dict(zip(jsondoc.loads(node["context"]), values, strict=True))
    return tuple(values) if kind == "builtins.tuple" else values


def _leaf(fmt: str, raw: memoryview) -> Any:
    """A leaf as litdata's serializer of that name stores it; raw bytes for the others."""
    kind, _, arg = fmt.partition(":")
    if kind == "bytes":
        return bytes(raw)
    if kind == "str":
        return bytes(raw).decode("utf-8")
    if kind == "int":
        return struct.unpack("<q", raw)[0]
    if kind == "float":
        return struct.unpack("<d", raw)[0]
    if kind == "bool":
        return raw[0] != 0
    if kind == "no_header_numpy" and int(arg) in _NUMPY:
        return np.frombuffer(raw, _NUMPY[int(arg)]).copy()
    if kind == "numpy":
        dtype, ndim = struct.unpack_from("<II", raw)
        if dtype in _NUMPY:
            shape = struct.unpack_from(f"<{ndim}I", raw, 8)
            return np.frombuffer(raw[8 + 4 * ndim:], _NUMPY[dtype]).reshape(shape).copy()
    if kind == "no_header_tensor" and int(arg) in _TORCH:
        return _tensor(raw, _TORCH[int(arg)], None)
    if kind == "tensor":
        dtype, ndim = struct.unpack_from(">II", raw)
        if dtype in _TORCH:
            shape = struct.unpack_from(f">{ndim}I", raw, 8)
            return _tensor(raw[8 + 4 * ndim:], _TORCH[dtype], shape)
    return bytes(raw)


def _tensor(raw: memoryview, dtype: str, shape: tuple[int, ...] | None) -> Any:
    import torch

    t = getattr(torch, dtype)
    tensor = (torch.frombuffer(bytearray(raw), dtype=t) if len(raw)
              else torch.empty((0,), dtype=t))
    return tensor.reshape(shape) if shape is not None else tensor
