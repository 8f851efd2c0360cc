"""Loading and verifying checkpoints: raw bytes and JSON in, never an unpickle.

A load reads this rank's data file with large aligned reads into one new page-aligned buffer,
checks every array's xxh3 checksum, and returns arrays that are views of that buffer (no
further copy; the buffer is freed when the last of them is).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from lcache.checkpoint.dist import rank_and_world
from lcache.checkpoint.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptionError,
    StateMismatchError,
)
from lcache.checkpoint.format import (
    ALIGN,
    MANIFEST,
    ArrayRef,
    StoredArray,
    checksum,
    decode_tree,
    expected_nbytes,
    key_text,
    numpy_dtype,
    torch_dtype,
)
from lcache.checkpoint.manifest import MAX_MANIFEST_BYTES, parse_manifest
from lcache.checkpoint.persist import (
    CHUNK,
    IO_CLASS,
    open_data_file,
    read_data_file,
    read_small_file,
)
from lcache.checks import flag, path_argument, whole_number
from lcache.errors import LCacheError
from lcache.io import aligned_buffer, close_file, pread_full

_MAX_LISTED = 20


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest body of the complete checkpoint at ``path``.

    Raises:
        CheckpointNotFoundError: no complete checkpoint there.
        CorruptionError: the manifest is damaged.
    """
    path = path_argument(path, "path")
    where = os.path.join(path, MANIFEST)
    if not os.path.lexists(where):
        hint = ("a directory without manifest.json is an unfinished save"
                if os.path.isdir(path) else "no such directory")
        raise CheckpointNotFoundError(f"no complete checkpoint at {path} ({hint}); "
                                      "`lcache ckpt ls` lists the complete ones")
    return parse_manifest(read_small_file(where, MAX_MANIFEST_BYTES), where)


def _shard_refs(path: str, shard: dict[str, Any]) -> tuple[str, int, list[ArrayRef], Any]:
    """(data file path, padded size, arrays, tree) of one shard entry of a parsed manifest.

    The arrays must lie in the data file in table order without overlapping, as a save lays
    them out: so a load reads and checksums every byte once, whatever the manifest says.
    """
    where = os.path.join(path, MANIFEST)
    fname, nbytes = shard["file"], shard["data_bytes"]
    refs = [ArrayRef.from_json(a, where) for a in shard["arrays"]]
    end = 0
    for ref in refs:
        if ref.offset % ALIGN or ref.offset < end or ref.offset + ref.nbytes > nbytes:
            raise CorruptionError(f"{where}: array {ref.key!r:.200} lies outside {fname} or "
                                  "over the array before it")
        end = ref.offset + ref.nbytes
    return os.path.join(path, fname), nbytes, refs, shard["tree"]


def _materialize(buf: np.ndarray[Any, Any], ref: ArrayRef, data_path: str) -> Any:
    where = f"{data_path} array {ref.key!r:.200}"
    if expected_nbytes(ref, where) != ref.nbytes:
        raise CorruptionError(f"{where}: {ref.nbytes} bytes do not fit dtype {ref.dtype:.50} "
                              f"and shape {ref.shape}")
    try:
        return _as_array(buf, ref, where)
    except (ValueError, TypeError, RuntimeError, OverflowError) as exc:
        if isinstance(exc, LCacheError):
            raise
        # e.g. an empty array of a shape whose other sizes overflow numpy's or torch's limits
        raise CorruptionError(f"{where}: shape {ref.shape} cannot be built ({exc})") from exc


def _as_array(buf: np.ndarray[Any, Any], ref: ArrayRef, where: str) -> Any:
    raw = buf[ref.offset : ref.offset + ref.nbytes]
    if ref.kind == "torch":
        import torch

        if ref.nbytes == 0:  # a byte view of nothing cannot be reinterpreted
            return torch.empty(ref.shape, dtype=torch_dtype(ref.dtype, where))
        return torch.from_numpy(raw).view(torch_dtype(ref.dtype, where)).reshape(ref.shape)
    if ref.nbytes == 0:
        return np.empty(ref.shape, dtype=numpy_dtype(ref.dtype, where))
    arr = raw.view(numpy_dtype(ref.dtype, where)).reshape(ref.shape)
    return arr[()] if ref.kind == "npscalar" else arr


def _pick_shard(body: dict[str, Any], path: str, rank: int | None) -> dict[str, Any]:
    world = body["world_size"]
    if rank is None:
        rank, my_world = rank_and_world()
        if my_world != world and not (my_world == 1 and world == 1):
            if my_world == 1:
                raise ConfigError(f"{path} was saved by {world} ranks; load it under torchrun "
                                  f"with {world} ranks, or pass rank= to read one shard")
            raise ConfigError(f"{path} was saved by {world} ranks, this run has {my_world}; "
                              "resharding is not supported: load with the same world size")
    rank = whole_number(rank, "rank", 0)
    if not rank < world:
        raise ConfigError(f"rank {rank} is not in [0, {world}) for {path}")
    for shard in body["shards"]:
        if shard["rank"] == rank:
            return shard  # type: ignore[no-any-return]
    raise CorruptionError(f"{os.path.join(path, MANIFEST)} has no shard for rank {rank}")


def load(path: str | os.PathLike[str], like: Any = None, *, rank: int | None = None,
         verify: bool = True, direct: bool = True, into: bool = False) -> Any:
    """Load the checkpoint at ``path`` (this rank's shard in a multi-rank run).

    Args:
        path: a checkpoint directory (``lcache.checkpoint.latest(root)`` finds the newest).
        like: a state of the expected structure (e.g. a fresh ``model.state_dict()``): keys,
            shapes and dtypes must match, and tensors are moved to ``like``'s devices.
        rank: which shard to read (default: this process's rank).
        verify: check every array's checksum (xxh3, several GB/s).
        direct: read with O_DIRECT where the filesystem allows it.
        into: copy the arrays into ``like``'s own tensors and arrays (e.g. a model's
            ``state_dict()``, whose tensors are its parameters) instead of new ones: no
            memory of the checkpoint's size is allocated. Shapes and dtypes are checked
            before anything is written; a checksum mismatch found on the way leaves ``like``
            partly overwritten (the error says so).

    An object in ``like`` with ``__lcache_restore__`` (an ``lcache.offload``
    ``OffloadedOptimizer``) is handed its part of the checkpoint as ``StoredArray``s that
    stream a chunk at a time, never read whole; it takes its place in the returned state.

    Raises:
        CheckpointNotFoundError: no complete checkpoint at ``path``.
        CorruptionError: a damaged manifest or data file; names the file and array.
        StateMismatchError: the state differs from ``like``; lists the keys.
    """
    path = path_argument(path, "path")
    # as a Checkpointer's direct=: taken by truthiness, verify="no" and direct="no" meant yes
    verify, direct, into = flag(verify, "verify"), flag(direct, "direct"), flag(into, "into")
    if into and like is None:
        raise ConfigError("load(into=True) copies into like=: pass the state to fill")
    body = read_manifest(path)
    data_path, nbytes, refs, tree = _shard_refs(path, _pick_shard(body, path, rank))
    targets: list[tuple[tuple[Any, ...], Any, Any]] = []
    if like is not None:
        _find_targets(tree, like, (), targets)
        lost = set(_restorers(like)) - {key for key, _, _ in targets}
        if lost:  # it would keep its state and report nothing
            raise StateMismatchError(
                "like= holds an object that restores itself (an offloaded optimizer) at "
                + ", ".join("/" + "/".join(map(str, k)) for k in sorted(lost, key=str))
                + ", where the checkpoint holds none")
    if into:
        if targets:
            raise ConfigError("load(into=True) cannot fill an offloaded optimizer in like=; "
                              "use into=False (its state streams into its swap file anyway)")
        from lcache.checkpoint.inplace import load_into

        for ref in refs:
            if expected_nbytes(ref, data_path) != ref.nbytes:
                raise CorruptionError(f"{data_path} array {ref.key!r:.200}: {ref.nbytes} bytes "
                                      f"do not fit dtype {ref.dtype:.50} and shape {ref.shape}")
        return load_into(path, (data_path, nbytes, refs, tree), like, verify=verify,
                         direct=direct)
    streamed: set[int] = set()
    for _, _, subtree in targets:
        _array_indices(subtree, streamed)
    kept = [i for i in range(len(refs)) if i not in streamed]
    held = [refs[i] for i in kept]
    hasher = _ChunkHasher(held) if verify else None
    # streamed arrays lie after the others (format.streamed_last): read up to them only
    end = max((ref.offset + ref.nbytes for ref in held), default=0) if streamed else nbytes
    buf = _read_checked(data_path, min(nbytes, -(-end // ALIGN) * ALIGN), hasher)
    arrays: list[Any] = [None] * len(refs)
    for j, i in enumerate(kept):
        ref = refs[i]
        if hasher is not None and hasher.sum_of(buf, j) != ref.xxh3:
            raise CorruptionError(f"checksum mismatch in {data_path} for array {ref.key!r} "
                                  f"({ref.nbytes} bytes at offset {ref.offset}): the "
                                  "checkpoint is damaged; load an earlier one")
        arrays[i] = _materialize(buf, ref, data_path)
    for i in streamed:
        arrays[i] = _stored(data_path, nbytes, refs[i], verify)
    state = decode_tree(tree, arrays, os.path.join(path, MANIFEST))
    if like is not None:
        state = match_like(state, like)
    for key, target, _ in targets:
        state = _restore_at(state, key, target)
    return state


# --- objects that restore themselves (an offloaded optimizer) -------------------------------
def _restores(value: Any) -> bool:
    return hasattr(type(value), "__lcache_restore__")


def _find_targets(node: Any, like: Any, key: tuple[Any, ...],
                  out: list[tuple[tuple[Any, ...], Any, Any]]) -> None:
    """Where ``like`` holds an object with ``__lcache_restore__``: (key path, object, its
    subtree of the manifest's tree). A malformed tree is left to ``decode_tree``."""
    if _restores(like):
        out.append((key, like, node))
        return
    if not isinstance(node, dict) or not isinstance(node.get("v"), list):
        return
    if isinstance(like, dict) and node.get("t") in ("dict", "odict") \
            and isinstance(node.get("k"), list):
        for k, v in zip(node["k"], node["v"], strict=False):
            name = k.get("int") if isinstance(k, dict) else k
            if isinstance(name, (str, int)) and name in like:
                _find_targets(v, like[name], (*key, name), out)
    elif isinstance(like, (list, tuple)) and node.get("t") in ("list", "tuple"):
        for i, (v, w) in enumerate(zip(node["v"], like, strict=False)):
            _find_targets(v, w, (*key, i), out)


def _array_indices(node: Any, out: set[int]) -> None:
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("t") == "array" and type(item.get("i")) is int:
                out.add(item["i"])
            stack.extend(v for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend(item)


def _stored(data_path: str, file_bytes: int, ref: ArrayRef, verify: bool) -> StoredArray:
    """A streamed array of the checkpoint, read a chunk at a time when its owner asks."""
    where = f"{data_path} array {ref.key!r:.200}"
    if expected_nbytes(ref, where) != ref.nbytes:
        raise CorruptionError(f"{where}: {ref.nbytes} bytes do not fit dtype {ref.dtype:.50} "
                              f"and shape {ref.shape}")

    def chunks(size: int) -> Iterator[memoryview]:
        fd, _ = open_data_file(data_path, file_bytes, False)
        try:
            digest = xxhash.xxh3_64()
            # an anonymous mapping, unmapped with its last view: heap buffers of this size
            # left the process's peak RSS megabytes higher from one run to the next
            view = memoryview(aligned_buffer(min(size, max(ref.nbytes, 1)), huge=False))
            for off in range(0, ref.nbytes, size):
                part = view[: min(size, ref.nbytes - off)]
                if pread_full(fd, ref.offset + off, part, IO_CLASS) < len(part):
                    raise CorruptionError(f"{where}: the data file ended early")
                digest.update(part)
                if verify and off + size >= ref.nbytes and digest.hexdigest() != ref.xxh3:
                    raise CorruptionError(f"checksum mismatch in {where} ({ref.nbytes} bytes "
                                          f"at offset {ref.offset}): the checkpoint is "
                                          "damaged; load an earlier one")
                yield part
        finally:
            close_file(fd)

    return StoredArray(ref.dtype, list(ref.shape), ref.nbytes, chunks)


def _restore_at(state: Any, key: tuple[Any, ...], target: Any) -> Any:
    """Hand the loaded subtree at ``key`` to ``target``; it takes that place in the state
    (a tuple on the way is rebuilt)."""
    if not key:
        return target.__lcache_restore__(state)
    child = _restore_at(state[key[0]], key[1:], target)
    if isinstance(state, tuple):
        return type(state)((*state[:key[0]], child, *state[key[0] + 1:]))
    state[key[0]] = child
    return state


def _restorers(like: Any, key: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The key paths of the objects in ``like`` that restore themselves."""
    if _restores(like):
        yield key
    elif isinstance(like, dict):
        for k, v in like.items():
            yield from _restorers(v, (*key, k))
    elif isinstance(like, (list, tuple)):
        for i, v in enumerate(like):
            yield from _restorers(v, (*key, i))


class _ChunkHasher:
    """Checksums each array as soon as every read chunk it spans is in (in the I/O threads),
    so verifying costs little beyond the reads."""

    def __init__(self, refs: list[ArrayRef]) -> None:
        self.refs = refs
        self.sums: list[str | None] = [None] * len(refs)
        self.waiting: dict[int, list[int]] = {}  # chunk -> arrays that still need it
        self.missing = [0] * len(refs)
        self.seen: set[int] = set()
        self.lock = threading.Lock()
        for i, ref in enumerate(refs):
            if ref.nbytes == 0:
                continue
            chunks = range(ref.offset // CHUNK, (ref.offset + ref.nbytes - 1) // CHUNK + 1)
            self.missing[i] = len(chunks)
            for k in chunks:
                self.waiting.setdefault(k, []).append(i)

    def chunk_done(self, buf: np.ndarray[Any, Any], k: int) -> None:
        ready = []
        with self.lock:
            if k in self.seen:  # read again after a fallback from O_DIRECT
                return
            self.seen.add(k)
            for i in self.waiting.get(k, ()):
                self.missing[i] -= 1
                if self.missing[i] == 0:
                    ready.append(i)
        for i in ready:
            ref = self.refs[i]
            self.sums[i] = checksum(buf[ref.offset : ref.offset + ref.nbytes])

    def sum_of(self, buf: np.ndarray[Any, Any], i: int) -> str:
        done = self.sums[i]
        if done is not None:
            return done
        ref = self.refs[i]
        return checksum(buf[ref.offset : ref.offset + ref.nbytes])


def _read_checked(data_path: str, nbytes: int, hasher: _ChunkHasher | None = None
                  ) -> np.ndarray[Any, Any]:
    buf, got = read_data_file(data_path, nbytes,
                              on_chunk=None if hasher is None else hasher.chunk_done)
    if got < nbytes:
        raise CorruptionError(f"data file {data_path} ended after {got} of {nbytes} bytes")
    return buf


# --- like= ---------------------------------------------------------------------------------
def _kind(value: Any) -> str:
    """"torch" or "numpy" (or another module) for an array-like value."""
    return getattr(value, "_lcache_kind", None) or type(value).__module__.split(".")[0]


def _describe(value: Any) -> str:
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        kind = "tensor" if _kind(value) == "torch" else "array"
        return f"{kind} {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return type(value).__name__


def _compare(got: Any, want: Any, key: str, diffs: list[str]) -> None:
    if _restores(want):  # it checks what it is handed itself
        return
    where = key or "<root>"  # the whole state: "" printed as ": checkpoint has..."
    if isinstance(want, dict):
        if not isinstance(got, dict):
            diffs.append(f"{where}: checkpoint has {_describe(got)}, like= a dict")
            return
        for k in want:
            if k not in got:
                diffs.append(f"{key}/{key_text(k)}: missing from the checkpoint")
        for k in got:
            if k not in want:
                diffs.append(f"{key}/{key_text(k)}: in the checkpoint, not in like=")
            else:
                _compare(got[k], want[k], f"{key}/{key_text(k)}", diffs)
    elif isinstance(want, (list, tuple)):
        like = f"like= a {type(want).__name__} of {len(want)} items"
        if not isinstance(got, (list, tuple)):
            diffs.append(f"{where}: checkpoint has {_describe(got)}, {like}")
            return
        if len(got) != len(want):
            diffs.append(f"{where}: checkpoint has a {_describe(got)} of {len(got)} items, "
                         f"{like}")
            return
        for i, (g, w) in enumerate(zip(got, want, strict=False)):
            _compare(g, w, f"{key}/{i}", diffs)
    elif hasattr(want, "dtype") and hasattr(want, "shape"):
        same_kind = _kind(got) == _kind(want)
        if not (hasattr(got, "dtype") and same_kind and got.dtype == want.dtype
                and tuple(got.shape) == tuple(want.shape)):
            diffs.append(f"{where}: checkpoint has {_describe(got)}, like= {_describe(want)}")
    elif isinstance(got, (dict, list, tuple)) or hasattr(got, "shape"):
        # like= a plain value where the checkpoint holds structure (like="junk" was ignored)
        diffs.append(f"{where}: checkpoint has {_describe(got)}, like= {_describe(want)}")


def _to_devices(got: Any, want: Any) -> Any:
    if _restores(want):
        return got
    if isinstance(want, dict):
        for k in want:
            got[k] = _to_devices(got[k], want[k])
        return got
    if isinstance(want, (list, tuple)):
        items = [_to_devices(g, w) for g, w in zip(got, want, strict=False)]
        return type(got)(items) if isinstance(got, tuple) else items
    device = getattr(want, "device", None)
    if device is not None and not isinstance(device, str) and getattr(device, "type", "cpu") \
            != "cpu":
        return got.to(device)
    return got


def match_like(state: Any, like: Any) -> Any:
    """Check ``state`` against ``like`` and move tensors to its devices.

    Raises:
        StateMismatchError: listing every key whose presence, shape or dtype differs.
    """
    diffs: list[str] = []
    _compare(state, like, "", diffs)
    if diffs:
        shown = "\n  ".join(diffs[:_MAX_LISTED])
        more = f"\n  ... and {len(diffs) - _MAX_LISTED} more" if len(diffs) > _MAX_LISTED else ""
        raise StateMismatchError(f"the checkpoint does not match like= at {len(diffs)} "
                                 f"key(s):\n  {shown}{more}")
    return _to_devices(state, like)


# --- verify --------------------------------------------------------------------------------
@dataclass(slots=True)
class VerifyReport:
    """What ``verify`` found in one checkpoint."""

    path: str
    arrays: int = 0
    data_bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "arrays": self.arrays,
                "data_bytes": self.data_bytes, "problems": self.problems}


def verify(path: str | os.PathLike[str], progress: Callable[[int], None] | None = None
           ) -> VerifyReport:
    """Read every shard of the checkpoint at ``path`` and check every checksum.

    Reads stream through a fixed set of buffers, so a checkpoint of any size can be checked.
    Never raises for damage: every problem found is listed in the report.

    Args:
        path: the checkpoint directory.
        progress: called with the bytes of each chunk read (e.g. a progress bar's advance).
    """
    from lcache.checkpoint.inplace import stream_checksums

    path = path_argument(path, "path")  # a non-path is a mistake, not damage to report
    report = VerifyReport(path)
    try:
        body = read_manifest(path)
    except (LCacheError, OSError) as exc:
        report.problems.append(str(exc))
        return report
    for shard in body["shards"]:
        try:
            data_path, nbytes, refs, tree = _shard_refs(path, shard)
            report.arrays += len(refs)
            report.data_bytes += nbytes
            sums = stream_checksums(data_path, nbytes, refs, progress=progress)
            for ref, got in zip(refs, sums, strict=True):
                if got != ref.xxh3:
                    report.problems.append(f"checksum mismatch in {data_path} for array "
                                           f"{ref.key!r} ({ref.nbytes} bytes at {ref.offset})")
                    continue
                try:
                    if expected_nbytes(ref, data_path) != ref.nbytes:
                        report.problems.append(f"{data_path} array {ref.key!r}: {ref.nbytes} "
                                               f"bytes do not fit {ref.dtype}{ref.shape}")
                except ImportError:
                    pass  # torch arrays without torch installed: the bytes are still checked
            decode_tree(tree, [None] * len(refs), os.path.join(path, MANIFEST))
        except (LCacheError, OSError) as exc:
            report.problems.append(str(exc))
    return report
