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

``state_dict()`` is the same form with its arrays read into tensors (the whole state in
memory, as torch's optimizers give it), and ``load_state_dict()`` takes either form.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from lcache.checkpoint.errors import StateMismatchError
from lcache.checkpoint.format import StoredArray, StreamedArray, torch_dtype, torch_dtype_name
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


def _reader(opt: OffloadedOptimizer, ranges: list[tuple[int, int, int]]) -> Any:
    """``read_into`` of a parameter's array. It holds ``opt``: a save streaming it keeps the
    optimizer, and so its swap file, from being collected before the save is done."""
    def read_into(offset: int, buf: memoryview) -> None:
        opt._check_open()
        end = offset + len(buf)
        for start, at, n in ranges:
            lo, hi = max(start, offset), min(start + n, end)
            if lo < hi and pread_full(opt._swap.plain_fd, at + lo - start,
                                      buf[lo - offset : hi - offset], IO_READ) != hi - lo:
                raise CorruptionError(f"the optimizer's swap file was cut short: no bytes "
                                      f"at offset {at + hi - start}")

    return read_into


def _master_differs(opt: OffloadedOptimizer, param: int) -> bool:
    """Whether parameter ``param`` is no longer its committed master weights' rounding (read
    ``CHUNK`` at a time: a parameter may be larger than the host budget)."""
    flat = opt._flat(opt._params[param])
    if not flat.numel():
        return False
    read_into = _reader(opt, _ranges(opt, param, 0, opt._slot_of))
    master = torch.empty(min(flat.numel(), CHUNK // F32), dtype=torch.float32)
    for at in range(0, flat.numel(), master.numel()):
        part = master[: flat.numel() - at]
        read_into(at * F32, part.numpy().data.cast("B"))
        current = flat[at : at + part.numel()]
        if not torch.equal(current, part.to(current.device, current.dtype)):
            return True
    return False


def checkpoint_state(opt: OffloadedOptimizer) -> dict[str, Any]:
    """The optimizer's state for ``lcache.checkpoint``, its arrays streamed from the swap."""
    opt._check_open()
    # weights loaded since the last step are what is saved, even written behind torch's
    # back (``p.data.copy_(w)``)
    opt._adopt_changed_params({i for i in range(len(opt._params)) if _master_differs(opt, i)})
    slots = list(opt._slot_of)
    release = opt._pins.pin(slots)
    arrays = [MASTER, *opt.state_names]
    state: dict[str, Any] = {}
    for i, name in enumerate(opt.names):
        param = opt._params[i]
        scalars = opt._scalars[i]
        entry: dict[str, Any] = {}
        for a, array in enumerate(arrays):
            if a and scalars is None:
                break  # never updated: its states do not exist yet
            entry[array] = StreamedArray("float32", list(param.shape), param.numel() * F32,
                                         _reader(opt, _ranges(opt, i, a, slots)),
                                         release)
        for key, value in (scalars or {}).items():
            entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
        state[name] = entry
    groups = [{**opt._options(g), "params": [opt.names[p] for p in members]}
              for g, members in enumerate(opt._members)]
    return {"format": FORMAT, "optimizer": opt.optimizer_class.__name__,
            "param_groups": groups, "state": state}


def memory_state(opt: OffloadedOptimizer) -> dict[str, Any]:
    """``checkpoint_state`` with every array read into a tensor of its own."""
    saved = checkpoint_state(opt)
    streamed = [(entry, key, value) for entry in saved["state"].values()
                for key, value in entry.items() if isinstance(value, StreamedArray)]
    try:
        for entry, key, value in streamed:
            tensor = torch.empty(value.shape, dtype=torch.float32)
            value.read_into(0, tensor.numpy().data.cast("B"))
            entry[key] = tensor
    finally:
        for _, _, value in streamed[:1]:
            value.release()  # one pin for all of them
    return saved


def _check(opt: OffloadedOptimizer, saved: Any) -> dict[str, Any]:
    """The saved state's entries by name, after checking they fit this optimizer."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ConfigError("this is not an OffloadedOptimizer's state (a state_dict() of one, "
                          "or what lcache.checkpoint saved of one was expected)")
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
            if got is None and isinstance(entry, dict) and array != MASTER:
                raise StateMismatchError(
                    f"checkpoint state {name!r} has no {array}: it was saved by an optimizer "
                    "with other options (amsgrad?); make this one as it was")
            if isinstance(got, torch.Tensor):
                f32, saved = got.dtype == torch.float32, got.numel()
            elif isinstance(got, StoredArray):
                f32, saved = got.dtype == "float32", got.nbytes // F32
            else:
                f32, saved = False, 0
            if not f32:
                raise CorruptionError(f"checkpoint state {name!r}/{array}: a float32 array of "
                                      f"{numel} elements was expected")
            if saved != numel:  # a sound checkpoint of another model
                raise StateMismatchError(
                    f"checkpoint state {name!r}/{array} holds {saved} elements; this "
                    f"optimizer's {name!r} has {numel} (another model shape?)")
        for key, like in opt._scalar_kinds.items() if has_states else ():
            if key not in entry or not _same_kind(entry[key], like):
                got = f"not {_kind(entry[key])}" if key in entry else "it is missing"
                raise CorruptionError(f"checkpoint state {name!r}/{key}: {_kind(like)} was "
                                      f"expected; {got}")
    for g, (group, saved_group) in enumerate(zip(opt.param_groups, groups, strict=True)):
        if not isinstance(saved_group, dict):
            raise CorruptionError("a param group of the checkpoint is not a dict")
        mine = [opt.names[p] for p in opt._members[g]]
        if saved_group.get("params") != mine:  # options are restored group by group
            raise ConfigError(f"param group {g} of the checkpoint holds other parameters than "
                              "this optimizer's (groups in another order?); make the groups "
                              "as when it was saved")
        for key, value in saved_group.items():
            if key in group and key not in ("params", "param_names") \
                    and not _same_kind(value, group[key]):
                raise CorruptionError(f"checkpoint param group option {key!r}: "
                                      f"{_kind(group[key])} was expected, not {_kind(value)}")
    return state


def _same_kind(got: Any, like: Any) -> bool:
    """Whether a loaded scalar state or option ``got`` can stand where ``like`` stands: a
    tampered ``step`` or ``betas`` is refused at load, not found in the middle of a step."""
    if isinstance(like, torch.Tensor):
        if isinstance(got, StoredArray):
            return got.dtype == torch_dtype_name(like.dtype) and list(got.shape) == \
                list(like.shape)
        if isinstance(got, torch.Tensor):
            return got.dtype == like.dtype and got.shape == like.shape
        return like.numel() == 1 and _is_number(got)  # a tensor lr set back to a float
    if isinstance(like, bool) or like is None:
        return got is None or isinstance(got, bool)
    if _is_number(like):
        return _is_number(got) or (isinstance(got, (torch.Tensor, StoredArray))
                                   and math.prod(got.shape) == 1)
    if isinstance(like, (tuple, list)):
        return isinstance(got, (tuple, list)) and len(got) == len(like) and \
            all(_same_kind(g, v) for g, v in zip(got, like, strict=True))
    return type(got) is type(like)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {torch_dtype_name(value.dtype)} tensor of shape {list(value.shape)}"
    if isinstance(value, StoredArray):
        return f"a {value.dtype:.20} tensor of shape {list(value.shape)[:8]}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"{type(value).__name__} {value!r:.40}" if value is not None else "None"


def restore_state(opt: OffloadedOptimizer, saved: Any) -> OffloadedOptimizer:
    """Stream a saved state into the swap, then make it the optimizer's (see module doc)."""
    opt._check_open()
    state = _check(opt, saved)
    target = [1 - s for s in opt._slot_of]
    for sg in opt.sub_groups:
        opt._pins.wait_free(sg.index, target[sg.index])
    arrays = [MASTER, *opt.state_names]
    scalars: list[dict[str, Any] | None] = []
    for i, name in enumerate(opt.names):
        entry = state[name]
        for a, array in enumerate(arrays):
            if array not in entry:
                continue
            ranges = _ranges(opt, i, a, target)
            offset = 0
            for chunk in _chunks(entry[array]):
                _write_ranges(opt._swap.plain_fd, ranges, offset, chunk)
                offset += len(chunk)
        scalars.append({k: _small(v) for k, v in entry.items() if k not in arrays}
                       if any(k in entry for k in arrays[1:]) else None)
    options = [{k: _small(v) for k, v in saved_group.items()
                if k not in ("params", "param_names")} for saved_group in saved["param_groups"]]
    opt._slot_of = target  # every checksum matched (the options' too): commit
    opt._scalars = scalars
    for group, loaded in zip(opt.param_groups, options, strict=True):
        group.update(loaded)
    opt._params_from_slots(opt.sub_groups)
    return opt


def _chunks(array: Any) -> Iterator[memoryview]:
    """A saved array's bytes, ``CHUNK`` at a time (a ``StoredArray`` reads them as it goes)."""
    if isinstance(array, StoredArray):
        yield from array.chunks(CHUNK)
        return
    raw = array.detach().cpu().contiguous().numpy().data.cast("B")
    for at in range(0, len(raw), CHUNK):
        yield raw[at : at + CHUNK]


def _small(value: Any) -> Any:
    """A scalar state or option as a value of its own (a load streams every array of the
    optimizer's part, these small ones included)."""
    if isinstance(value, tuple):
        return tuple(_small(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()  # the caller's state dict stays theirs
    if not isinstance(value, StoredArray):
        return value
    if value.nbytes > _SMALL:
        raise CorruptionError(f"a scalar optimizer state of {value.nbytes} bytes; the "
                              "checkpoint is damaged")
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
