"""Loading into existing tensors and arrays (``load(path, like=state, into=True)``).

The data file streams through a reusable ring of 8 MiB buffers: several O_DIRECT reads stay
in flight while the chunk that arrived first is checksummed and copied into the destinations.
Nothing of the checkpoint's size is allocated, so a load costs no page faults (about 0.6 s per
GiB of fresh memory on a small VM) and no second copy of the model in memory, as with DCP's
in-place load. Structure, shapes and dtypes are checked against the manifest before any byte
of ``like`` is written.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from lcache.checkpoint.errors import CorruptionError, StateMismatchError
from lcache.checkpoint.format import MANIFEST, ArrayRef, decode_tree, numpy_dtype, torch_dtype
from lcache.checkpoint.persist import CHUNK, IO_CLASS, open_data_file
from lcache.io import Pending, aligned_buffer, close_file, default_engine, settle

# chunk buffers kept for the process's later loads: reused memory costs no page faults
_RING: list[mmap.mmap] = []
_RING_LOCK = threading.Lock()


class _Shape:
    """What the manifest says about one array: compared with ``like=`` before any read."""

    def __init__(self, ref: ArrayRef, index: int, where: str) -> None:
        self.index = index
        self.shape = tuple(ref.shape)
        self._lcache_kind = "torch" if ref.kind == "torch" else "numpy"
        self.dtype: Any = (torch_dtype(ref.dtype, where) if ref.kind == "torch"
                           else numpy_dtype(ref.dtype, where))


def _pair(skeleton: Any, like: Any, dests: list[Any]) -> None:
    """Record, for every array of the checkpoint, the object of ``like`` at its place."""
    if isinstance(skeleton, _Shape):
        dests[skeleton.index] = like
    elif isinstance(skeleton, dict):
        for k, v in skeleton.items():
            _pair(v, like[k], dests)
    elif isinstance(skeleton, (list, tuple)):
        for v, w in zip(skeleton, like, strict=True):
            _pair(v, w, dests)


def _unfit(ref: ArrayRef, dest: Any) -> str:
    """Why ``dest`` cannot take array ``ref`` in place ("" if it can)."""
    if ref.kind == "torch":
        import torch

        if not isinstance(dest, torch.Tensor):
            return f"{ref.key}: like= holds {type(dest).__name__}, not a tensor"
        strides = dest.stride()
    elif ref.kind == "numpy" and not isinstance(dest, np.ndarray):
        return f"{ref.key}: like= holds {type(dest).__name__}, not a numpy array"
    else:
        strides = tuple(st // max(1, dest.itemsize) for st in dest.strides)
    if _may_overlap(tuple(dest.shape), strides):
        return (f"{ref.key}: like= holds an array whose elements share memory (expanded, "
                "or strided over itself); give one of its own")
    return ""


def _may_overlap(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether two elements of a strided array may be one place in memory: taken from the
    smallest stride up, each dimension must step past all the elements of the ones below
    (a zero stride, as_strided((3, 3), (1, 1)), fails). Conservative: an interleaving
    that happens not to collide is refused too."""
    extent = 1
    for n, st in sorted(((n, abs(st)) for n, st in zip(shape, strides, strict=True)
                         if n > 1), key=lambda d: d[1]):
        if st < extent:
            return True
        extent += (n - 1) * st
    return False


def _span(dest: Any) -> tuple[str, int, int] | None:
    """(device, first byte, byte past the last) of the memory ``dest``'s elements lie in, or
    None for no memory to write (an empty array, a numpy scalar)."""
    if isinstance(dest, np.ndarray):
        if dest.size == 0:
            return None
        start = int(dest.ctypes.data)
        steps = [(n - 1) * st for n, st in zip(dest.shape, dest.strides, strict=True)]
        return ("cpu", start + sum(min(0, x) for x in steps),
                start + sum(max(0, x) for x in steps) + dest.itemsize)
    if not hasattr(dest, "data_ptr") or dest.numel() == 0:
        return None
    extent = sum((n - 1) * st for n, st in zip(dest.shape, dest.stride(), strict=True))
    start = int(dest.data_ptr())
    return str(dest.device), start, start + (extent + 1) * dest.element_size()


def _same_place(a: Any, b: Any) -> bool:
    """Whether two destinations are one array (tied weights: one tensor under two keys)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and
                a.__array_interface__ == b.__array_interface__)
    return bool(a.data_ptr() == b.data_ptr() and a.shape == b.shape
                and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device)


def _host_view(dest: Any) -> np.ndarray | None:
    """``dest``'s elements as a numpy array over the same memory (a CPU tensor's seen as
    integers of its element size), or None where there is none."""
    if isinstance(dest, np.ndarray):
        return dest
    try:
        if dest.device.type != "cpu":
            return None
        import torch

        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        view = dest.detach()
        if view.element_size() in ints and view.dtype not in ints.values():
            view = view.view(ints[view.element_size()])
        return np.asarray(view.numpy())
    except Exception:  # a dtype numpy has no view of (complex32, 16-byte ints)
        return None


def _collide(a: Any, b: Any) -> bool:
    """Whether some element of ``a`` is some element of ``b`` in memory: exactly where both
    are host arrays (views that interleave, as q, k and v split from one fused weight,
    never collide), else whenever their extents meet."""
    x, y = _host_view(a), _host_view(b)
    if x is None or y is None:
        return True
    try:
        return bool(np.shares_memory(x, y))
    except Exception:  # numpy's TooHardError (strides it cannot solve): say they do
        return True


def _sharing(refs: list[ArrayRef], dests: list[Any]) -> list[str]:
    """Why pairs of destinations cannot both be loaded: they share memory, unless they are
    one array and the checkpoint holds the same bytes for both (tied weights, saved twice).
    Loaded anyway, the last array written won where they overlap: another key's values."""
    spans = sorted(((span, j) for j, d in enumerate(dests) if (span := _span(d)) is not None),
                   key=lambda item: item[0])
    why: list[str] = []
    for i, ((device, _, end), j) in enumerate(spans):
        for (device2, start2, _), k in spans[i + 1:]:
            if device2 != device or start2 >= end:
                break
            if _same_place(dests[j], dests[k]) and refs[j].xxh3 == refs[k].xxh3:
                continue
            if _collide(dests[j], dests[k]):
                one, other = sorted((j, k))
                why.append(f"{refs[one].key} and {refs[other].key}: like= holds arrays that "
                           "share memory (one would be written over the other); give arrays "
                           "of their own")
    return why


def _read_only(refs: list[ArrayRef], dests: list[Any]) -> list[str]:
    """Why host tensors cannot be written: their memory is mapped read-only, as that of
    ``torch.from_numpy`` over ``np.memmap(mode="r")`` (a tensor has no writeable flag, and
    writing there kills the process with SIGSEGV)."""
    spans = [(ref, span) for ref, d in zip(refs, dests, strict=True)
             if ref.kind == "torch" and (span := _span(d)) is not None and span[0] == "cpu"]
    if not spans:
        return []
    writable = _writable_memory()
    if writable is None:  # no /proc/self/maps: nothing to tell by
        return []
    starts = [lo for lo, _ in writable]
    why = []
    for ref, (_, start, end) in spans:
        at = bisect.bisect_right(starts, start) - 1
        if at < 0 or writable[at][1] < end:
            why.append(f"{ref.key}: like= holds a tensor over read-only memory (torch."
                       "from_numpy of a read-only array, such as np.memmap(mode='r')); give "
                       "a writable one")
    return why


def _writable_memory() -> list[tuple[int, int]] | None:
    """The process's writable address ranges, adjacent ones merged, from /proc/self/maps."""
    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ranges: list[tuple[int, int]] = []
    for line in lines:
        fields = line.split(maxsplit=2)
        if len(fields) < 2 or fields[1][1:2] != b"w":
            continue
        lo, hi = (int(x, 16) for x in fields[0].split(b"-"))
        if ranges and ranges[-1][1] == lo:  # the kernel lists mappings in address order
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
    return ranges


class _Target:
    """Where one array's bytes go: straight into the destination's memory when it is one
    contiguous, writable host block; otherwise into a staging array copied over at the end."""

    def __init__(self, ref: ArrayRef, dest: Any) -> None:
        self.ref = ref
        self.dest = dest
        self.hash = xxhash.xxh3_64()
        self.stage: Any = None
        self.result: Any = dest
        if ref.kind == "torch":
            plain = type(dest).__name__ in ("Tensor", "Parameter")
            if (plain and dest.device.type == "cpu" and dest.is_contiguous()
                    and not dest.is_conj() and not dest.is_neg()):
                self.address = int(dest.data_ptr())
            else:
                import torch

                self.stage = torch.empty(ref.shape, dtype=dest.dtype)
                self.address = int(self.stage.data_ptr())
        elif ref.kind == "numpy" and dest.flags.c_contiguous and dest.flags.writeable:
            self.address = int(dest.ctypes.data)
        else:  # a numpy scalar is immutable; a strided or read-only array gets a copy
            self.stage = np.empty(ref.shape, dtype=numpy_dtype(ref.dtype, ref.key))
            self.address = int(self.stage.ctypes.data)

    def finish(self, data_path: str, verify: bool) -> None:
        ref = self.ref
        if verify and self.hash.hexdigest() != ref.xxh3:
            raise CorruptionError(f"checksum mismatch in {data_path} for array {ref.key!r} "
                                  f"({ref.nbytes} bytes at offset {ref.offset}): the "
                                  "checkpoint is damaged; load an earlier one (like= now "
                                  "holds part of it)")
        if self.stage is None:
            return
        if ref.kind == "torch":
            import torch

            with torch.no_grad():
                self.dest.copy_(self.stage)
        elif ref.kind == "npscalar":
            self.result = self.stage[()]
        elif not self.dest.flags.writeable:  # it cannot be written: the result is new
            self.result = self.stage
        else:
            np.copyto(self.dest, self.stage)


class _HashOnly:
    """A checksum of one array, for ``verify``: nothing is copied anywhere."""

    address = 0

    def __init__(self, ref: ArrayRef) -> None:
        self.ref = ref
        self.hash = xxhash.xxh3_64()
        self.digest = self.hash.hexdigest()  # what an empty array's checksum is

    def finish(self, data_path: str, verify: bool) -> None:
        self.digest = self.hash.hexdigest()


def stream_checksums(data_path: str, nbytes: int, refs: list[ArrayRef], *, direct: bool = True,
                     queue_depth: int = 8, progress: Callable[[int], None] | None = None
                     ) -> list[str]:
    """The xxh3-64 of every array of a data file, read once through the ring (memory use
    does not grow with the checkpoint). ``progress(nbytes)`` is called per chunk read."""
    hashers = [_HashOnly(r) for r in refs]
    _stream(data_path, nbytes, hashers, True, direct, queue_depth, progress)
    return [h.digest for h in hashers]


def load_into(path: str, body_shard: tuple[str, int, list[ArrayRef], Any], like: Any, *,
              verify: bool = True, direct: bool = True, queue_depth: int = 8) -> Any:
    """Copy the shard's arrays into the matching objects of ``like``; returns the state (the
    arrays are ``like``'s own objects, numpy scalars new ones)."""
    from lcache.checkpoint.restore import _compare

    data_path, nbytes, refs, tree = body_shard
    where = os.path.join(path, MANIFEST)
    skeleton = decode_tree(tree, [_Shape(r, i, where) for i, r in enumerate(refs)], where)
    diffs: list[str] = []
    _compare(skeleton, like, "", diffs)
    if diffs:
        shown = "\n  ".join(diffs[:20])
        raise StateMismatchError(f"the checkpoint does not match like= at {len(diffs)} "
                                 f"key(s):\n  {shown}")
    dests: list[Any] = [None] * len(refs)
    _pair(skeleton, like, dests)
    unfit = ([why for why in map(_unfit, refs, dests) if why] or _sharing(refs, dests)
             or _read_only(refs, dests))
    if unfit:  # before any byte of like= is written
        shown = "\n  ".join(unfit[:20])
        raise StateMismatchError(f"like= cannot take the checkpoint's arrays at {len(unfit)} "
                                 f"key(s):\n  {shown}")
    targets = [_Target(r, d) for r, d in zip(refs, dests, strict=True)]
    _stream(data_path, nbytes, targets, verify, direct, queue_depth)
    return decode_tree(tree, [t.result for t in targets], where)


def _stream(data_path: str, nbytes: int, targets: list[Any], verify: bool, direct: bool,
            queue_depth: int, progress: Callable[[int], None] | None = None) -> None:
    order = sorted((t for t in targets if t.ref.nbytes), key=lambda t: t.ref.offset)
    slots = queue_depth + 2  # reads in flight, plus the chunk being copied, plus one spare
    shared = _RING_LOCK.acquire(blocking=False)
    try:
        if not shared:  # another thread is loading: a ring of its own for this one
            _stream_with(aligned_buffer(slots * CHUNK), data_path, nbytes, order, verify,
                         direct, queue_depth, progress)
            return
        if not _RING or len(_RING[0]) < slots * CHUNK:  # grows only; reused otherwise
            _RING.clear()
            _RING.append(aligned_buffer(slots * CHUNK))
        _stream_with(_RING[0], data_path, nbytes, order, verify, direct, queue_depth, progress)
    finally:
        if shared:
            _RING_LOCK.release()


def _stream_with(ring: mmap.mmap, data_path: str, nbytes: int, order: list[Any],
                 verify: bool, direct: bool, queue_depth: int,
                 progress: Callable[[int], None] | None = None) -> None:
    """Read the file in order, ``queue_depth`` chunks in flight on the process's I/O engine,
    into a ring of chunk buffers; copy each chunk out as soon as it and every chunk before it
    are in."""
    slots = len(ring) // CHUNK
    view = memoryview(ring)
    base = int(np.frombuffer(ring, dtype=np.uint8).ctypes.data)
    fd, _ = open_data_file(data_path, nbytes, direct)  # checked before any byte is copied
    inflight: collections.deque[tuple[int, int, Pending]] = collections.deque()
    engine = default_engine()
    try:
        next_off, first = 0, 0

        def submit() -> None:
            nonlocal next_off
            slot = (next_off // CHUNK) % slots
            n = min(CHUNK, nbytes - next_off)
            buf = view[slot * CHUNK : slot * CHUNK + n]
            inflight.append((next_off, slot, engine.submit_read(fd, next_off, buf, IO_CLASS)))
            next_off += n

        while next_off < nbytes and len(inflight) < queue_depth:
            submit()
        while inflight:
            start, slot, pending = inflight.popleft()
            end = min(start + CHUNK, nbytes)
            if pending.wait() < end - start:
                raise CorruptionError(f"data file {data_path} ended before {end} bytes")
            while first < len(order) and \
                    order[first].ref.offset + order[first].ref.nbytes <= start:
                first += 1
            for t in order[first:]:
                ref = t.ref
                if ref.offset >= end:
                    break
                lo, hi = max(ref.offset, start), min(ref.offset + ref.nbytes, end)
                if lo >= hi:
                    continue
                src = slot * CHUNK + lo - start
                if verify:
                    t.hash.update(view[src : src + hi - lo])
                if t.address:
                    ctypes.memmove(t.address + lo - ref.offset, base + src, hi - lo)
                if hi == ref.offset + ref.nbytes:
                    t.finish(data_path, verify)
            if progress is not None:
                progress(end - start)
            if next_off < nbytes:  # this chunk's slot is free again
                submit()
    finally:
        # no read may outlive fd or land in the ring after it is handed to the next load
        settle(p for _, _, p in inflight)
        close_file(fd)
