"""What the store's API takes from its caller: batches of keys, values and remove flags.

A bad argument is a ``ConfigError`` (so ``except LCacheError`` catches it, and ``except
ValueError`` as before); one of the wrong type is an ``ArgumentTypeError``, which is also the
``TypeError`` it was before. Keys themselves are checked by ``record.key_parts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lcache.errors import ArgumentTypeError, ConfigError

# What a batch is not, though len() takes it: one key (b"key" would be read as the int
# keys 107, 101, 121) or text.
_NOT_BATCHES = (str, bytes, bytearray, memoryview)


def batch_length(batch: Any, name: str) -> int:
    """How many items the batch argument ``name`` (``keys``, ``values``) holds: it is a
    sequence (a list, a range, a 1-d numpy array), or an ``ArgumentTypeError``."""
    if not isinstance(batch, _NOT_BATCHES) and \
            not (isinstance(batch, np.ndarray) and batch.ndim != 1):
        try:
            return len(batch)
        except TypeError:
            pass
    raise ArgumentTypeError(f"{name}={batch!r:.80}: give a sequence of {name}, one per "
                            "record (a list, or a 1-d numpy array)")


def remove_flags(remove: Any, count: int) -> Sequence[bool] | npt.NDArray[np.bool_]:
    """``get_many``'s ``remove``: one bool per key (a list, or a numpy bool array), or an
    lcache error (``remove=True`` was a bare TypeError from len(); "no" would be true)."""
    if isinstance(remove, np.ndarray):
        plain = remove.ndim == 1 and remove.dtype == np.bool_
    else:
        plain = not isinstance(remove, _NOT_BATCHES) and hasattr(remove, "__len__") and \
            all(isinstance(flag, (bool, np.bool_)) for flag in remove)
    if not plain:
        raise ArgumentTypeError(f"remove={remove!r:.80}: give one bool per key (a list of "
                                "True and False, or a numpy bool array), or None")
    if len(remove) != count:
        raise ConfigError(f"{count} keys but {len(remove)} remove flags")
    return remove  # type: ignore[no-any-return]  # checked above


def value_view(value: Any) -> bytes | memoryview:
    """The bytes of ``value`` to store: bytes, or a flat byte view of a C-contiguous buffer
    of plain data."""
    if type(value) is bytes:
        return value
    try:
        view = value if isinstance(value, memoryview) else memoryview(value)
    except TypeError:
        raise ArgumentTypeError(f"a value must be bytes or a buffer (bytearray, memoryview, "
                                f"numpy array), not {type(value).__name__}") from None
    if view.format != "B":
        objects = _objects_in(view)
        if objects is not None:
            # an object array's buffer is its PyObject pointers: stored, they were
            # meaningless bytes that gave away addresses (checkpoint.save refuses it too)
            raise ArgumentTypeError(f"a value must hold plain data, not Python objects "
                                    f"({objects}); encode them to bytes first, or use a "
                                    "numeric dtype")
    if not view.c_contiguous:  # a strided view: casting it was a raw BufferError
        raise ArgumentTypeError("a value must be a C-contiguous buffer, not a strided view; "
                                "pass a contiguous copy (bytes(view), "
                                "numpy.ascontiguousarray(a))")
    if view.nbytes == 0:  # an empty array of any shape (casting one with a 0 in it fails)
        return b""
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _objects_in(view: memoryview) -> str | None:
    """What says the buffer's items are (or hold) Python object pointers: a numpy dtype
    with objects, or the PEP 3118 code "O" in the format (field names, ``:name:``, left
    out); None for plain data."""
    owner = view.obj
    if isinstance(owner, np.ndarray):
        return f"numpy dtype {owner.dtype}" if owner.dtype.hasobject else None
    fmt = view.format
    while ":" in fmt:  # "T{i:Occupancy:O:x:}": the names between colons are not codes
        head, _, rest = fmt.partition(":")
        fmt = head + rest.partition(":")[2]
    return f"buffer format {view.format!r:.40}" if "O" in fmt else None
