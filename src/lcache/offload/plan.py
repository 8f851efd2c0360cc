"""How the optimizer state is cut into sub-groups and laid out in the swap file.

The parameters of each param group are seen as one flat run of elements, cut into sub-groups
of at most ``numel`` elements. A parameter may span several, cut only at multiples of ``CUT``
elements: torch's fused CPU kernels compute a tensor's last, partial vector in another way than
its full vectors, so each piece must start where a vector of the whole parameter starts for
the bits to be the same as on the whole (a cut anywhere else changed 62,769 of 301,000
elements in 20 steps of fused AdamW). A sub-group's *block* holds its arrays one after another, each
``numel`` fp32 elements: the master weights first, then each per-element state of the optimizer
(AdamW: ``exp_avg``, ``exp_avg_sq``). Blocks start at ``ALIGN`` boundaries, so a whole block is
one aligned read or write. The file holds two slots of blocks: a step reads a block from its
committed slot and writes it to the other, so a failed step leaves the committed state whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from lcache.errors import ConfigError
from lcache.io import align_up

ALIGN = 4096  # block alignment in the file and in host buffers (O_DIRECT)
F32 = 4
#: Below this a sub-group's I/O is too small to stream at device speed; a budget that cannot
#: hold ``buffers`` sub-groups of this many elements (or of the largest param group, if
#: smaller) is refused.
MIN_SUB_GROUP = 1 << 16
#: A parameter is cut into pieces at multiples of this many elements (a whole number of the
#: widest CPU vectors, 512 bits of fp32, four times over).
CUT = 64


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, stop)`` of parameter ``param``, at element ``at`` of its sub-group."""

    param: int
    start: int
    stop: int
    at: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class SubGroup:
    """One unit of the pipeline: pieces of one param group, read, updated and written whole.

    Attributes:
        index: position in the plan.
        group: the param group its pieces belong to.
        pieces: what it holds, in order.
        numel: elements in each of its arrays.
        offset: byte offset of its block inside a slot.
        nbytes: its block's bytes (``arrays * numel * 4``, padded to ``ALIGN``).
    """

    index: int
    group: int
    pieces: tuple[Piece, ...]
    numel: int
    offset: int
    nbytes: int


def buffer_bytes(numel: int, arrays: int, grads: bool = True) -> int:
    """Host bytes one pipeline buffer needs for a sub-group of ``numel`` elements: its block,
    plus room for its gradients in fp32 if ``grads`` (gradients that are not fp32 on the CPU
    are copied there; fp32 ones on the CPU are used where they are)."""
    return align_up(arrays * numel * F32, ALIGN) + (align_up(numel * F32, ALIGN) if grads
                                                    else 0)


def choose_numel(budget: int, buffers: int, arrays: int, largest_group: int,
                 requested: int | None, grads: bool = True) -> int:
    """Elements per sub-group: ``requested``, or the most ``budget`` allows for ``buffers``
    (with room for gradients if ``grads``, see ``buffer_bytes``).

    Raises:
        ConfigError: the budget cannot hold ``buffers`` sub-groups; says the minimum.
    """
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ConfigError(f"sub_group_size={requested!r} is not a number of elements >= 1")
        numel = min(max(requested, CUT), max(largest_group, 1))
    else:
        numel = min(max(largest_group, 1), MIN_SUB_GROUP)
    need = buffers * buffer_bytes(numel, arrays, grads)
    if budget < need:
        raise ConfigError(
            f"host_budget {budget:,} bytes is too small: the pipeline needs {buffers} buffers "
            f"of one sub-group ({numel:,} elements x {arrays} fp32 arrays"
            f"{' + gradients' if grads else ''}) = "
            f"at least {need:,} bytes; raise host_budget to {need:,} or more"
            + (" or lower sub_group_size" if requested is not None else ""))
    if requested is not None:
        return numel
    # the largest sub-group the budget holds, in whole pages per array
    per_elem = buffers * (arrays + grads) * F32
    numel = max(numel, (budget - 2 * buffers * ALIGN) // per_elem // 1024 * 1024)
    return min(numel, max(largest_group, 1))


def plan(groups: list[list[tuple[int, int]]], numel: int, arrays: int) -> list[SubGroup]:
    """Sub-groups for ``groups`` (per param group: (param index, element count) pairs)."""
    out: list[SubGroup] = []
    offset = 0
    for g, members in enumerate(groups):
        pieces: list[Piece] = []
        fill = 0
        for param, count in members:
            start = 0
            while start < count:
                take = min(count - start, numel - fill)
                if start + take < count:  # cut inside the parameter: at a multiple of CUT
                    take -= take % CUT
                if take == 0:  # under CUT elements of room left: the next sub-group
                    offset = _close(out, g, pieces, fill, offset, arrays)
                    pieces, fill = [], 0
                    continue
                pieces.append(Piece(param, start, start + take, fill))
                start += take
                fill += take
                if fill == numel:
                    offset = _close(out, g, pieces, fill, offset, arrays)
                    pieces, fill = [], 0
        if pieces:
            offset = _close(out, g, pieces, fill, offset, arrays)
    return out


def _close(out: list[SubGroup], group: int, pieces: list[Piece], numel: int, offset: int,
           arrays: int) -> int:
    nbytes = align_up(arrays * numel * F32, ALIGN)
    out.append(SubGroup(len(out), group, tuple(pieces), numel, offset, nbytes))
    return offset + nbytes
