"""The on-disk format: a JSON manifest plus raw data files, and the state-tree encoding
(the manifest file itself: ``manifest.py``).

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
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from lcache.errors import CorruptionError

MANIFEST = "manifest.json"
ALIGN = 4096  # every array starts at a multiple of this in its data file (O_DIRECT reads)
MAX_STATE_DEPTH = 100  # levels of nested containers in a state (optimizer states use ~5)
MAX_DIMS = 64  # numpy's limit; torch's is lower
_PLAIN = (type(None), bool, int, float, str)
# Ints of more bits are stored as hex text: JSON readers (CPython's past 4300 decimal digits)
# cannot take every int, and hex converts both ways in linear time.
_WIDE = 64
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
        """The entry ``doc`` of a manifest's array table, every field checked.

        Raises:
            CorruptionError: a missing field, a value of the wrong type or out of range.
        """
        fields = ("key", "kind", "dtype", "shape", "offset", "nbytes", "xxh3")
        if not isinstance(doc, dict) or any(f not in doc for f in fields):
            raise CorruptionError(f"{where}: malformed array entry {_short(doc)}")
        ref = cls(*(doc[f] for f in fields))
        text = all(isinstance(v, str) for v in (ref.key, ref.kind, ref.dtype, ref.xxh3))
        if not text or ref.kind not in ("torch", "numpy", "npscalar"):
            raise CorruptionError(f"{where}: malformed array entry {_short(doc)}")
        if not isinstance(ref.shape, list) or len(ref.shape) > MAX_DIMS or not all(
                _is_size(d) for d in ref.shape):
            raise CorruptionError(f"{where}: invalid shape for array {ref.key!r:.200}: a list "
                                  f"of at most {MAX_DIMS} sizes was expected")
        if not (_is_size(ref.offset) and _is_size(ref.nbytes)):
            raise CorruptionError(f"{where}: invalid offset or size for array {ref.key!r:.200}")
        return ref


@dataclass(slots=True)
class StreamedArray:
    """A torch array that a save copies from a file in chunks, never whole in memory: the
    state of an offloaded optimizer (``lcache.offload``), handed to a save by an object's
    ``__lcache_checkpoint__()``.

    Attributes:
        dtype: torch dtype name.
        shape: the array's shape.
        nbytes: its bytes.
        read_into: ``read_into(offset, buf)`` fills ``buf`` with the bytes from ``offset``.
        release: called once the save is done with it (written, failed or abandoned).
    """

    dtype: str
    shape: list[int]
    nbytes: int
    read_into: Callable[[int, memoryview], None]
    release: Callable[[], None]


@dataclass(slots=True)
class StoredArray:
    """An array of a checkpoint that a load hands over in chunks instead of reading it whole:
    what ``__lcache_restore__(state)`` of an object in ``load(like=...)`` receives.

    Attributes:
        dtype, shape, nbytes: as saved (checked against each other on load).
        chunks: ``chunks(size)`` yields the bytes in order, ``size`` at a time; the last
            step checks the checksum and raises ``CorruptionError`` on a mismatch.
    """

    dtype: str
    shape: list[int]
    nbytes: int
    chunks: Callable[[int], Iterator[memoryview]]


def streamed_last(tree: Any, arrays: list[ArrayRef]) -> tuple[Any, list[ArrayRef]]:
    """The tree and array table with streamed arrays moved to the end, so a data file
    holds the in-memory arrays first (one host buffer) and the streamed ones after them."""
    order = sorted(range(len(arrays)), key=lambda i: isinstance(arrays[i].source,
                                                                StreamedArray))
    if order == list(range(len(arrays))):
        return tree, arrays
    new_index = {old: new for new, old in enumerate(order)}
    return _renumber(tree, new_index), [arrays[i] for i in order]


def _renumber(node: Any, new_index: dict[int, int]) -> Any:
    if not isinstance(node, dict):
        return node
    if node.get("t") == "array":
        return {**node, "i": new_index[node["i"]]}
    out = dict(node)
    if isinstance(node.get("v"), list):
        out["v"] = [_renumber(v, new_index) for v in node["v"]]
    if "meta" in node:
        out["meta"] = _renumber(node["meta"], new_index)
    return out


def _is_size(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 63


def _short(value: Any) -> str:
    """``repr`` of a manifest value for an error message, cut short (and safe for any int)."""
    try:
        return f"{value!r:.200}"
    except ValueError:  # an int of more than sys.get_int_max_str_digits() digits
        return f"<{type(value).__name__}>"


def key_text(key: Any) -> str:
    """A state key as it appears in paths and messages (hex for ints beyond 64 bits, whose
    decimal form CPython may refuse to build)."""
    return hex(key) if type(key) is int and key.bit_length() > _WIDE else str(key)


# --- the state tree ------------------------------------------------------------------------
def _is_torch_tensor(value: Any) -> bool:
    # Why not isinstance: torch is optional and must not be imported for numpy-only states.
    mod = type(value).__module__
    return mod.startswith("torch") and hasattr(value, "untyped_storage")


def _release_streamed_in(tree: Any) -> None:
    """Release every ``StreamedArray`` in ``tree`` (releasing twice is harmless)."""
    if isinstance(tree, StreamedArray):
        tree.release()
    elif isinstance(tree, dict):
        for v in tree.values():
            _release_streamed_in(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _release_streamed_in(v)


def encode_tree(value: Any, arrays: list[ArrayRef], path: str = "", depth: int = 0) -> Any:
    """The JSON form of ``value``; arrays are appended to ``arrays`` (offsets set later).

    Raises:
        UnsupportedValueError (a TypeError): a value that cannot be saved, naming its key;
            or a state nested more than ``MAX_STATE_DEPTH`` levels (or holding itself).
    """
    from lcache.checkpoint.errors import UnsupportedValueError

    where = path or "<root>"
    if depth > MAX_STATE_DEPTH:
        raise UnsupportedValueError(
            f"cannot checkpoint {where[:200]}: the state is nested more than {MAX_STATE_DEPTH} "
            "levels deep (or a list or dict holds itself); flatten it")
    if value is None or isinstance(value, (bool, str)):
        return {"t": "plain", "v": value}
    if type(value) is int:
        if value.bit_length() > _WIDE:
            return {"t": "int", "v": hex(value)}
        return {"t": "plain", "v": value}
    if isinstance(value, float) and type(value) is float:
        # hex keeps every bit (NaN, inf, -0.0 included), which JSON numbers cannot
        return {"t": "float", "v": value.hex()}
    if _is_torch_tensor(value):
        arrays.append(_torch_ref(value, where))
        return {"t": "array", "i": len(arrays) - 1}
    if isinstance(value, np.ndarray):
        if type(value) is not np.ndarray and not isinstance(value, np.memmap):
            # a masked array would lose its mask, np.matrix its operators
            raise UnsupportedValueError(
                f"{where}: a {type(value).__name__} would come back as a plain ndarray; save "
                "np.asarray(x) (and, for a masked array, np.ma.getmaskarray(x))")
        arrays.append(_numpy_ref(value, where, "numpy"))
        return {"t": "array", "i": len(arrays) - 1}
    if isinstance(value, np.generic):
        arrays.append(_numpy_ref(np.asarray(value), where, "npscalar"))
        return {"t": "array", "i": len(arrays) - 1}
    if isinstance(value, StreamedArray):
        arrays.append(ArrayRef(where, "torch", value.dtype, list(value.shape), 0, value.nbytes,
                               source=value))
        return {"t": "array", "i": len(arrays) - 1}
    checkpoint_state = getattr(type(value), "__lcache_checkpoint__", None)
    if checkpoint_state is not None:  # e.g. an OffloadedOptimizer: its state, streamed
        saved = checkpoint_state(value)
        try:
            return encode_tree(saved, arrays, path, depth)
        except BaseException:
            _release_streamed_in(saved)  # its owner must not wait for a save that failed
            raise
    if isinstance(value, dict):
        keys: list[Any] = []
        items: list[Any] = []
        for k, v in value.items():
            if isinstance(k, str):
                keys.append(k)
            elif type(k) is int:  # optimizer.state_dict() keys its state by param id
                keys.append({"int": hex(k) if k.bit_length() > _WIDE else k})
            else:
                raise UnsupportedValueError(
                    f"state key {_short(k)} ({type(k).__name__}) under {where} is not a str "
                    "or int; use str or int dict keys")
            name = key_text(k)
            items.append(encode_tree(v, arrays, f"{path}/{name}" if path else name, depth + 1))
        doc: dict[str, Any] = {"t": "odict" if isinstance(value, collections.OrderedDict)
                               else "dict", "k": keys, "v": items}
        meta = getattr(value, "_metadata", None)  # nn.Module.state_dict()'s version table
        if isinstance(meta, dict):
            doc["meta"] = encode_tree(meta, arrays, f"{path}/<_metadata>", depth + 1)
        return doc
    if isinstance(value, (list, tuple)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {"t": kind, "v": [encode_tree(v, arrays, f"{path}/{i}" if path else str(i),
                                             depth + 1) for i, v in enumerate(value)]}
    raise UnsupportedValueError(
        f"cannot checkpoint {where}: a {type(value).__module__}.{type(value).__qualname__}; "
        "convert it to a tensor, a numpy array or plain values (int, float, str, bool, None, "
        "list, tuple, dict)")


def _int(value: Any, where: str) -> int:
    """An int as stored: a JSON number, or hex text for one beyond 64 bits."""
    if type(value) is int:
        return value
    if isinstance(value, str) and value.lstrip("-").startswith("0x"):
        return int(value, 16)  # linear time and no digit limit, unlike decimal
    raise CorruptionError(f"{where}: int expected, found {_short(value)}")


def decode_tree(doc: Any, arrays: list[Any], where: str) -> Any:
    """Rebuild the state from its JSON form; ``arrays[i]`` are the loaded arrays.

    Raises:
        CorruptionError: a malformed tree (its depth was bounded when the manifest was read).
    """
    try:
        t = doc["t"]
        if t == "plain":
            v = doc["v"]
            if not isinstance(v, _PLAIN):
                raise CorruptionError(f"{where}: plain value of type {type(v).__name__}")
            return v
        if t == "int":
            return _int(doc["v"], where)
        if t == "float":
            return float.fromhex(doc["v"])
        if t == "array":
            i = doc["i"]
            if type(i) is not int or not 0 <= i < len(arrays):
                raise CorruptionError(f"{where}: array index {_short(i)} is not in the table")
            return arrays[i]
        if t in ("dict", "odict"):
            out: dict[Any, Any] = collections.OrderedDict() if t == "odict" else {}
            keys, values = doc["k"], doc["v"]
            if not isinstance(keys, list) or not isinstance(values, list) \
                    or len(keys) != len(values):
                raise CorruptionError(f"{where}: dict with unequal keys and values")
            for k, v in zip(keys, values, strict=True):
                key = _int(k["int"], where) if isinstance(k, dict) else k
                if not isinstance(key, str) and type(key) is not int:
                    raise CorruptionError(f"{where}: dict key {_short(key)}")
                out[key] = decode_tree(v, arrays, where)
            if "meta" in doc and isinstance(out, collections.OrderedDict):
                out._metadata = decode_tree(doc["meta"], arrays, where)  # type: ignore[attr-defined]
            return out
        if t in ("list", "tuple"):
            items = doc["v"]
            if not isinstance(items, list):
                raise CorruptionError(f"{where}: a {t} node without a list of items")
            got = [decode_tree(v, arrays, where) for v in items]
            return tuple(got) if t == "tuple" else got
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, CorruptionError):
            raise
        raise CorruptionError(f"{where}: malformed state tree ({_short(exc)})") from exc
    raise CorruptionError(f"{where}: unknown node type {_short(t)}")


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
    except (TypeError, ValueError) as exc:
        raise CorruptionError(f"{where}: unknown numpy dtype {name!r:.50}") from exc
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None \
            or dtype.itemsize == 0:
        raise CorruptionError(f"{where}: numpy dtype {name!r:.50} is not a plain dtype")
    return dtype


# torch's sub-byte integers (uint1..7, int1..7): it has no copy kernel for them, so only a
# contiguous one can be saved (by memmove).
_SUB_BYTE = frozenset(f"{sign}int{bits}" for sign in ("", "u") for bits in range(1, 8))


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
    if tensor.is_nested:  # strided layout, but no single shape
        raise UnsupportedValueError(f"cannot checkpoint {where}: a nested tensor; save its "
                                    "components (.unbind()) instead")
    name = torch_dtype_name(tensor.dtype)
    if name in _SUB_BYTE and tensor.numel() > 1 and not tensor.is_contiguous():
        raise UnsupportedValueError(f"cannot checkpoint {where}: torch cannot copy a "
                                    f"non-contiguous {name} tensor; save a contiguous one")
    nbytes = tensor.numel() * tensor.element_size()
    return ArrayRef(where, "torch", name, list(tensor.shape), 0,
                    nbytes, source=tensor)


def _numpy_ref(array: np.ndarray[Any, Any], where: str, kind: str) -> ArrayRef:
    from lcache.checkpoint.errors import UnsupportedValueError

    dtype = array.dtype
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None \
            or dtype.itemsize == 0:
        raise UnsupportedValueError(f"cannot checkpoint {where}: numpy dtype {dtype} holds "
                                    "Python objects, fields or no bytes; use a plain numeric "
                                    "dtype")
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
