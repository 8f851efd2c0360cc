"""The on-disk format: a JSON manifest plus raw data files, and the state-tree encoding.

A checkpoint is a directory::

    manifest.json          written last, by rename: the checkpoint is complete or invisible
    rank00000.data ...     one per rank: every array's raw bytes, each at a 4 KiB boundary

The manifest holds, per rank, the *tree* (the nested dicts, lists, tuples and plain values of
the state, with arrays replaced by references) and the *arrays* table (dtype by name, shape,
offset, length and an xxh3-64 checksum each). Nothing is pickled: loading a crafted checkpoint
can raise, never run code.
"""

from __future__ import annotations

import collections
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from lcache.errors import CorruptionError

FORMAT = "lcache-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
ALIGN = 4096  # every array starts at a multiple of this in its data file (O_DIRECT reads)
_PLAIN = (type(None), bool, int, float, str)


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")


def data_file_name(rank: int) -> str:
    return f"rank{rank:05d}.data"


def is_plain_name(name: Any) -> bool:
    """Whether ``name`` can only name a file in the checkpoint's own directory (no ``/``,
    ``..``, hidden names or control characters)."""
    return isinstance(name, str) and _PLAIN_NAME.fullmatch(name) is not None


def checksum(buf: Any) -> str:
    """xxh3-64 of a buffer as 16 hex digits (several GB/s, so it runs on every load)."""
    return xxhash.xxh3_64_hexdigest(buf)


@dataclass(slots=True)
class ArrayRef:
    """One array of the state: where its bytes go in the data file and how to rebuild it.

    Attributes:
        key: the array's path in the state, e.g. ``"optimizer/state/0/exp_avg"`` (for errors).
        kind: ``"torch"`` or ``"numpy"`` (``"npscalar"`` for a numpy scalar).
        dtype: torch dtype name (``"bfloat16"``) or numpy dtype string (``"<f4"``).
        shape: the array's shape.
        offset: byte offset in the data file (a multiple of ``ALIGN``).
        nbytes: bytes of the array's data.
        xxh3: checksum of those bytes (filled in by the snapshot).
        source: the live array (snapshot only; never written).
    """

    key: str
    kind: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    xxh3: str = ""
    source: Any = None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "kind": self.kind, "dtype": self.dtype, "shape": self.shape,
                "offset": self.offset, "nbytes": self.nbytes, "xxh3": self.xxh3}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> ArrayRef:
        try:
            ref = cls(str(doc["key"]), str(doc["kind"]), str(doc["dtype"]),
                      [int(d) for d in doc["shape"]], int(doc["offset"]), int(doc["nbytes"]),
                      str(doc["xxh3"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptionError(f"{where}: malformed array entry {doc!r:.200}") from exc
        if ref.kind not in ("torch", "numpy", "npscalar") or ref.offset < 0 or ref.nbytes < 0 \
                or any(d < 0 for d in ref.shape):
            raise CorruptionError(f"{where}: invalid array entry for {ref.key!r}")
        return ref


# --- the state tree ------------------------------------------------------------------------
def _is_torch_tensor(value: Any) -> bool:
    # Why not isinstance: torch is optional and must not be imported for numpy-only states.
    mod = type(value).__module__
    return mod.startswith("torch") and hasattr(value, "untyped_storage")


def encode_tree(value: Any, arrays: list[ArrayRef], path: str = "") -> Any:
    """The JSON form of ``value``; arrays are appended to ``arrays`` (offsets set later).

    Raises:
        TypeError (ConfigError): a value that cannot be saved, naming its key.
    """
    from lcache.checkpoint.errors import UnsupportedValueError

    where = path or "<root>"
    if value is None or isinstance(value, (bool, str)):
        return {"t": "plain", "v": value}
    if isinstance(value, int) and type(value) is int:
        return {"t": "plain", "v": value}
    if isinstance(value, float) and type(value) is float:
        # hex keeps every bit (NaN, inf, -0.0 included), which JSON numbers cannot
        return {"t": "float", "v": value.hex()}
    if _is_torch_tensor(value):
        arrays.append(_torch_ref(value, where))
        return {"t": "array", "i": len(arrays) - 1}
    if isinstance(value, np.ndarray):
        arrays.append(_numpy_ref(value, where, "numpy"))
        return {"t": "array", "i": len(arrays) - 1}
    if isinstance(value, np.generic):
        arrays.append(_numpy_ref(np.asarray(value), where, "npscalar"))
        return {"t": "array", "i": len(arrays) - 1}
    if isinstance(value, dict):
        keys: list[Any] = []
        items: list[Any] = []
        for k, v in value.items():
            if isinstance(k, str):
                keys.append(k)
            elif type(k) is int:
                keys.append({"int": k})  # optimizer.state_dict() keys its state by param id
            else:
                raise UnsupportedValueError(
                    f"state key {k!r} ({type(k).__name__}) under {where} is not a str or int; "
                    "use str or int dict keys")
            items.append(encode_tree(v, arrays, f"{path}/{k}" if path else str(k)))
        doc: dict[str, Any] = {"t": "odict" if isinstance(value, collections.OrderedDict)
                               else "dict", "k": keys, "v": items}
        meta = getattr(value, "_metadata", None)  # nn.Module.state_dict()'s version table
        if isinstance(meta, dict):
            doc["meta"] = encode_tree(meta, arrays, f"{path}/<_metadata>")
        return doc
    if isinstance(value, (list, tuple)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {"t": kind, "v": [encode_tree(v, arrays, f"{path}/{i}" if path else str(i))
                                 for i, v in enumerate(value)]}
    raise UnsupportedValueError(
        f"cannot checkpoint {where}: a {type(value).__module__}.{type(value).__qualname__}; "
        "convert it to a tensor, a numpy array or plain values (int, float, str, bool, None, "
        "list, tuple, dict)")


def decode_tree(doc: Any, arrays: list[Any], where: str) -> Any:
    """Rebuild the state from its JSON form; ``arrays[i]`` are the loaded arrays."""
    try:
        t = doc["t"]
        if t == "plain":
            v = doc["v"]
            if not isinstance(v, _PLAIN):
                raise CorruptionError(f"{where}: plain value of type {type(v).__name__}")
            return v
        if t == "float":
            return float.fromhex(doc["v"])
        if t == "array":
            return arrays[int(doc["i"])]
        if t in ("dict", "odict"):
            out: dict[Any, Any] = collections.OrderedDict() if t == "odict" else {}
            if len(doc["k"]) != len(doc["v"]):
                raise CorruptionError(f"{where}: dict with unequal keys and values")
            for k, v in zip(doc["k"], doc["v"], strict=False):
                key = int(k["int"]) if isinstance(k, dict) else k
                if not isinstance(key, (str, int)):
                    raise CorruptionError(f"{where}: dict key {key!r}")
                out[key] = decode_tree(v, arrays, where)
            if "meta" in doc and isinstance(out, collections.OrderedDict):
                out._metadata = decode_tree(doc["meta"], arrays, where)  # type: ignore[attr-defined]
            return out
        if t == "list":
            return [decode_tree(v, arrays, where) for v in doc["v"]]
        if t == "tuple":
            return tuple(decode_tree(v, arrays, where) for v in doc["v"])
    except (KeyError, TypeError, IndexError, ValueError, OverflowError) as exc:
        if isinstance(exc, CorruptionError):
            raise
        raise CorruptionError(f"{where}: malformed state tree ({exc!r:.200})") from exc
    raise CorruptionError(f"{where}: unknown node type {t!r:.50}")


# --- dtypes --------------------------------------------------------------------------------
def torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str, where: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptionError(f"{where}: unknown torch dtype {name!r:.50}")
    return dtype


def numpy_dtype(name: str, where: str) -> np.dtype[Any]:
    try:
        dtype = np.dtype(name)
    except TypeError as exc:
        raise CorruptionError(f"{where}: unknown numpy dtype {name!r:.50}") from exc
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise CorruptionError(f"{where}: numpy dtype {name!r:.50} is not a plain dtype")
    return dtype


def _torch_ref(tensor: Any, where: str) -> ArrayRef:
    from lcache.checkpoint.errors import UnsupportedValueError

    if tensor.is_sparse or tensor.layout.__repr__() != "torch.strided":
        raise UnsupportedValueError(f"cannot checkpoint {where}: a {tensor.layout} tensor; "
                                    "convert it with .to_dense()")
    if tensor.is_quantized:
        raise UnsupportedValueError(f"cannot checkpoint {where}: a quantized tensor; "
                                    "dequantize it first")
    if tensor.device.type == "meta":
        raise UnsupportedValueError(f"cannot checkpoint {where}: a meta tensor holds no data")
    nbytes = tensor.numel() * tensor.element_size()
    return ArrayRef(where, "torch", torch_dtype_name(tensor.dtype), list(tensor.shape), 0,
                    nbytes, source=tensor)


def _numpy_ref(array: np.ndarray[Any, Any], where: str, kind: str) -> ArrayRef:
    from lcache.checkpoint.errors import UnsupportedValueError

    dtype = array.dtype
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise UnsupportedValueError(f"cannot checkpoint {where}: numpy dtype {dtype} holds "
                                    "Python objects or fields; use a plain numeric dtype")
    return ArrayRef(where, kind, dtype.str, list(array.shape), 0, array.nbytes, source=array)


def layout(arrays: list[ArrayRef]) -> int:
    """Give every array an ``ALIGN``-aligned offset; returns the data file's padded size."""
    offset = 0
    for ref in arrays:
        ref.offset = offset
        offset += -(-ref.nbytes // ALIGN) * ALIGN
    return offset


def expected_nbytes(ref: ArrayRef, where: str) -> int:
    """Bytes ``ref``'s dtype and shape imply (checked against ``nbytes`` on load)."""
    if ref.kind == "torch":
        itemsize = int(torch_dtype(ref.dtype, where).itemsize)
    else:
        itemsize = numpy_dtype(ref.dtype, where).itemsize
    return math.prod(ref.shape) * itemsize


# --- manifest ------------------------------------------------------------------------------
def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def dump_manifest(body: dict[str, Any]) -> bytes:
    """The manifest file's bytes: the body plus a checksum of it (a flipped bit is caught)."""
    doc = {"format": FORMAT, "version": VERSION, "xxh3": checksum(_canonical(body)),
           "body": body}
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """The manifest body, after checking format, version and checksum."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptionError(f"{where} is not valid JSON ({exc}); the checkpoint is damaged"
                              ) from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptionError(f"{where} is not an lcache checkpoint manifest")
    if doc.get("version") != VERSION:
        raise CorruptionError(f"{where} has format version {doc.get('version')!r:.20}; this "
                              f"lcache reads version {VERSION}")
    body = doc.get("body")
    if not isinstance(body, dict) or checksum(_canonical(body)) != doc.get("xxh3"):
        raise CorruptionError(f"{where}: manifest checksum mismatch; the file is damaged")
    return body
