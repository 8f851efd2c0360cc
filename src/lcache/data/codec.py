"""A safe codec for dataset items: bytes, numpy arrays, tensors (and torch.Size), numbers,
strings, and lists / tuples / dicts of them. Never pickle, so a cache file cannot run code
when read.

Layout: ``b"LCS1"``, u32 header length, a JSON header describing the structure, then the raw
buffers. Arrays decode as zero-copy views of the record (``np.frombuffer``), read-only.
"""

from __future__ import annotations

import json
import struct
import sys
from typing import Any

import numpy as np

from lcache.errors import LCacheError

MAGIC = b"LCS1"
_LEN = struct.Struct("<I")


class CodecError(LCacheError, ValueError):
    """An item cannot be encoded safely, or bytes are not an encoded item (a ValueError, so
    ``except ValueError`` keeps working)."""


def encode(item: Any) -> bytes:
    buffers: list[bytes | memoryview] = []
    offset = 0

    def add(buf: memoryview) -> list[int]:
        nonlocal offset
        buffers.append(buf)
        start, offset = offset, offset + buf.nbytes
        return [start, buf.nbytes]

    def walk(x: Any) -> Any:
        kind = type(x)
        if x is None or kind in (bool, int, float, str):
            return {"v": x}
        if isinstance(x, np.generic):  # np.float32(1.5) comes back a np.float32, not a float
            return {**_array(np.asarray(x), add), "scalar": True}
        if isinstance(x, (bytes, bytearray, memoryview)):
            return {"b": add(memoryview(x).cast("B"))}
        if isinstance(x, np.ndarray):
            return _array(x, add)
        if kind.__module__ == "torch":
            return _torch_leaf(x, add)
        if kind in (list, tuple):
            return {"t" if kind is tuple else "l": [walk(v) for v in x]}
        if kind is dict:
            if not all(type(k) is str for k in x):
                raise CodecError("dict keys must be str to be cached")
            return {"d": {k: walk(v) for k, v in x.items()}}
        _refuse_plain_subclass(x)
        raise CodecError(f"cannot cache an item of type {kind.__name__} without pickle; "
                         "return bytes, numpy arrays, tensors or numbers")

    try:
        header = json.dumps(walk(item), separators=(",", ":")).encode()
    except CodecError:
        raise
    except (ValueError, TypeError, RecursionError) as exc:  # an int of 4,300 digits, a cycle
        raise CodecError(f"cannot cache this item: {exc}") from exc
    return b"".join([MAGIC, _LEN.pack(len(header)), header, *buffers])


def _array(x: Any, add: Any) -> dict[str, Any]:
    is_tensor = not isinstance(x, np.ndarray)
    torch_dtype = None
    if is_tensor:
        torch_dtype = str(x.dtype).removeprefix("torch.")
        x = _tensor_array(x)
    elif type(x) is not np.ndarray:
        _refuse_subclass(x)
        x = np.asarray(x)  # np.memmap and the like: the values are the array's
    if x.dtype.hasobject or x.dtype.fields is not None:
        kind = "object" if x.dtype.hasobject else "structured"
        raise CodecError(f"{kind} arrays (dtype {x.dtype}) cannot be cached without pickle")
    shape = list(x.shape)
    # Why reshape(-1) first: ascontiguousarray turns 0-d into 1-d, and memoryview casts fail
    # on shapes with zeros; a flat uint8 view has neither problem.
    flat: Any = np.ascontiguousarray(x.reshape(-1)).view(np.uint8)
    out = {"a": add(memoryview(flat)), "dtype": x.dtype.str, "shape": shape}
    if is_tensor:
        out["torch"] = torch_dtype
    return out


def _torch_leaf(x: Any, add: Any) -> dict[str, Any]:
    """A tensor, or a torch.Size (an item's ``t.shape``): a tuple subclass that must come
    back a torch.Size. Other torch objects are refused, not taken for tensors."""
    import torch

    if type(x) is torch.Tensor:
        return _array(x, add)
    if type(x) is torch.Size:
        return {"size": list(x)}
    raise CodecError(f"cannot cache a {type(x).__module__}.{type(x).__name__} ({x!r:.60}); "
                     "return tensors, or str(x) for a dtype or a device")


def _refuse_plain_subclass(x: Any) -> None:
    """A subclass of a plain type (a namedtuple, an OrderedDict, an IntEnum) would come
    back as the plain type, its class lost: rebuilding a class by name is what pickle does."""
    for base in (bool, int, float, str, tuple, list, dict):
        if isinstance(x, base):
            raise CodecError(f"a {type(x).__name__} would come back as a plain "
                             f"{base.__name__} (rebuilding its class needs pickle); return "
                             f"{base.__name__}(x)" + (" or x._asdict()" if hasattr(x, "_asdict")
                                                      else ""))


def _refuse_subclass(x: Any) -> None:
    ma = sys.modules.get("numpy.ma")  # not imported: no masked array can exist
    if ma is not None and isinstance(x, ma.MaskedArray):
        raise CodecError("a masked array would lose its mask; return its data and its mask "
                         "(np.ma.getdata(x), np.ma.getmaskarray(x)) or x.filled(...)")
    if isinstance(x, np.matrix):
        raise CodecError("np.matrix cannot be cached as it is (its operators differ from an "
                         "array's); return np.asarray(x)")


def _tensor_array(x: Any) -> np.ndarray:
    """A tensor's values as a numpy array; a dtype numpy lacks (bfloat16, float8...) as the
    same bits in an integer type of its size, for decode to view back."""
    import torch

    try:
        x = x.detach().cpu().resolve_conj().resolve_neg()
        if x.layout != torch.strided:
            raise CodecError(f"a {x.layout} tensor cannot be cached; return x.to_dense()")
        try:
            return x.numpy()  # type: ignore[no-any-return]
        except TypeError:
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            return x.view(bits[x.element_size()]).numpy()  # type: ignore[no-any-return]
    except (RuntimeError, TypeError, KeyError) as exc:
        raise CodecError(f"cannot cache a tensor of dtype {x.dtype}: {exc}") from exc


def decode(data: bytes | memoryview) -> Any:
    view = memoryview(data)
    if view[:4] != MAGIC:
        raise CodecError("not an lcache-encoded item")
    try:
        return _decode(view)
    except (ValueError, TypeError, KeyError, IndexError, struct.error) as exc:
        raise CodecError(f"malformed lcache-encoded item: {exc!r}") from exc


def _decode(view: memoryview) -> Any:
    (hlen,) = _LEN.unpack_from(view, 4)
    if 8 + hlen > len(view):
        raise ValueError("the header runs past the end")
    header = json.loads(bytes(view[8 : 8 + hlen]))
    body = view[8 + hlen :]

    def walk(node: dict[str, Any]) -> Any:
        if "v" in node:
            return node["v"]
        if "b" in node:
            start, n = node["b"]
            return bytes(body[start : start + n])
        if "a" in node:
            start, n = node["a"]
            dtype = np.dtype(node["dtype"])
            if dtype.hasobject or start + n > len(body):
                raise ValueError("bad array entry")
            arr = np.frombuffer(body[start : start + n], dtype=dtype)
            arr = arr.reshape(node["shape"])
            if node.get("scalar"):
                return arr[()]
            return _tensor(arr, node["torch"]) if "torch" in node else arr
        if "l" in node:
            return [walk(v) for v in node["l"]]
        if "t" in node:
            return tuple(walk(v) for v in node["t"])
        if "size" in node:
            return _size(node["size"])
        return {k: walk(v) for k, v in node["d"].items()}

    return walk(header)


def _size(dims: list[Any]) -> Any:
    import torch

    if not all(type(d) is int for d in dims):
        raise ValueError("bad torch.Size entry")
    return torch.Size(dims)


def _tensor(arr: np.ndarray, dtype: str) -> Any:
    import torch

    t = torch.from_numpy(arr.copy())  # a writable copy: torch warns on read-only buffers
    target = getattr(torch, dtype, None)
    if not isinstance(target, torch.dtype):
        raise ValueError(f"unknown tensor dtype {dtype!r}")
    return t if t.dtype == target else t.view(target)  # the bits of a dtype numpy lacks
