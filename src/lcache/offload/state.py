"""Checkpointing an ``OffloadedOptimizer``: its state streams between the swap file and the
checkpoint's data file a chunk at a time, never whole in memory.

The saved form is keyed by parameter name, not by sub-group, so a run may resume with another
``host_budget`` or ``sub_group_size``::

    {"format": "lcache-offload", "optimizer": "AdamW",
     "param_groups": [{"lr": ..., "betas": ..., "params": [names]}, ...],
     "state": {name: {"master": fp32 array, "exp_avg": ..., "exp_avg_sq": ..., "step": ...}}}

A save pins the slots it reads: a step that would overwrite one of them waits until the save
has copied it, so an ``async_save`` holds the state of the step it was called after. A restore
writes into the slots a step would write and commits them only once every array's checksum
matched: a damaged checkpoint leaves the optimizer as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lcache.checkpoint.format import StoredArray, StreamedArray, torch_dtype
from lcache.errors import ConfigError, CorruptionError
from lcache.io import pread_full, pwrite_full
from lcache.offload.plan import F32
from lcache.offload.swap import CHUNK, IO_READ, IO_WRITE

if TYPE_CHECKING:
    from lcache.offload.optimizer import OffloadedOptimizer

FORMAT = "lcache-offload"
_SMALL = 1 << 16  # bytes a scalar state (AdamW's step) or option may have
MASTER = "master"


def _ranges(opt: OffloadedOptimizer, param: int, array: int, slots: list[int]
            ) -> list[tuple[int, int, int]]:
    """(byte offset in the parameter's array, file offset, bytes) of each of its pieces."""
    out = []
    for sg, piece in opt._pieces_of[param]:
        at = slots[sg.index] * opt.slot_bytes + sg.offset + (array * sg.numel + piece.at) * F32
        out.append((piece.start * F32, at, piece.numel * F32))
    return out


def _reader(fd: int, ranges: list[tuple[int, int, int]]) -> Any:
    def read_into(offset: int, buf: memoryview) -> None:
        end = offset + len(buf)
        for start, at, n in ranges:
            lo, hi = max(start, offset), min(start + n, end)
            if lo < hi:
                pread_full(fd, at + lo - start, buf[lo - offset : hi - offset], IO_READ)

    return read_into


def checkpoint_state(opt: OffloadedOptimizer) -> dict[str, Any]:
    """The optimizer's state for ``lcache.checkpoint``, its arrays streamed from the swap."""
    torch = opt._torch
    slots = list(opt._slot_of)
    release = opt._pins.pin(slots)
    arrays = [MASTER, *opt.state_names]
    state: dict[str, Any] = {}
    for i, name in enumerate(opt.names):
        param = opt._params[i]
        scalars = opt._scalars[i]
        entry: dict[str, Any] = {}
        for a, array in enumerate(arrays):
            if a and not scalars:
                break  # never updated: its states do not exist yet
            entry[array] = StreamedArray("float32", list(param.shape), param.numel() * F32,
                                         _reader(opt._swap.plain_fd, _ranges(opt, i, a, slots)),
                                         release)
        for key, value in scalars.items():
            entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
        state[name] = entry
    groups = [{**opt._options(g), "params": [opt.names[p] for p in group["params"]]}
              for g, group in enumerate(opt.param_groups)]
    return {"format": FORMAT, "optimizer": opt.optimizer_class.__name__,
            "param_groups": groups, "state": state}


def _check(opt: OffloadedOptimizer, saved: Any) -> dict[str, Any]:
    """The saved state's entries by name, after checking they fit this optimizer."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ConfigError("the checkpoint holds no OffloadedOptimizer state at this key")
    if saved.get("optimizer") != opt.optimizer_class.__name__:
        raise ConfigError(f"the checkpoint holds {saved.get('optimizer')!r} state; this "
                          f"optimizer runs {opt.optimizer_class.__name__}")
    state = saved.get("state")
    groups = saved.get("param_groups")
    if not isinstance(state, dict) or set(state) != set(opt.names) or \
            not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        raise ConfigError("the checkpoint's optimizer state is for other parameters (names or "
                          "param groups differ); load it into the same model")
    arrays = [MASTER, *opt.state_names]
    for i, name in enumerate(opt.names):
        entry = state[name]
        numel = opt._params[i].numel()
        has_states = isinstance(entry, dict) and any(k in entry for k in arrays[1:])
        for array in arrays if has_states else arrays[:1]:
            got = entry.get(array) if isinstance(entry, dict) else None
            if not isinstance(got, StoredArray) or got.nbytes != numel * F32 \
                    or got.dtype != "float32":
                raise CorruptionError(f"checkpoint state {name!r}/{array}: a float32 array of "
                                      f"{numel} elements was expected")
    return state


def restore_state(opt: OffloadedOptimizer, saved: Any) -> OffloadedOptimizer:
    """Stream a saved state into the swap, then make it the optimizer's (see module doc)."""
    state = _check(opt, saved)
    target = [1 - s for s in opt._slot_of]
    for sg in opt.sub_groups:
        opt._pins.wait_free(sg.index, target[sg.index])
    arrays = [MASTER, *opt.state_names]
    scalars: list[dict[str, Any]] = []
    for i, name in enumerate(opt.names):
        entry = state[name]
        for a, array in enumerate(arrays):
            if array not in entry:
                continue
            ranges = _ranges(opt, i, a, target)
            offset = 0
            for chunk in entry[array].chunks(CHUNK):
                _write_ranges(opt._swap.plain_fd, ranges, offset, chunk)
                offset += len(chunk)
        scalars.append({k: _small(opt, v) for k, v in entry.items() if k not in arrays}
                       if any(k in entry for k in arrays[1:]) else {})
    opt._slot_of = target  # every checksum matched: commit
    opt._scalars = scalars
    for group, saved_group in zip(opt.param_groups, saved["param_groups"], strict=True):
        if isinstance(saved_group, dict):
            group.update({k: _small(opt, v) for k, v in saved_group.items() if k != "params"})
    opt._params_from_slots(opt.sub_groups)
    return opt


def _small(opt: OffloadedOptimizer, value: Any) -> Any:
    """A scalar state or option as a value of its own (a load streams every array of the
    optimizer's part, these small ones included)."""
    if isinstance(value, tuple):
        return tuple(_small(opt, v) for v in value)
    if not isinstance(value, StoredArray):
        return value
    if value.nbytes > _SMALL:
        raise CorruptionError(f"a scalar optimizer state of {value.nbytes} bytes; the "
                              "checkpoint is damaged")
    torch = opt._torch
    raw = bytearray()
    for chunk in value.chunks(_SMALL):
        raw += chunk
    dtype = torch_dtype(value.dtype, "optimizer state")
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(value.shape).clone() \
        if raw else torch.empty(value.shape, dtype=dtype)


def _write_ranges(fd: int, ranges: list[tuple[int, int, int]], offset: int,
                  chunk: memoryview) -> None:
    end = offset + len(chunk)
    for start, at, n in ranges:
        lo, hi = max(start, offset), min(start + n, end)
        if lo < hi:
            pwrite_full(fd, at + lo - start, [chunk[lo - offset : hi - offset]], IO_WRITE)
