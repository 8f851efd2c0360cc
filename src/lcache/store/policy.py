"""Eviction policies, by name.

The store cleans whole segments (that is what frees space in a log-structured store); a policy
says which sealed segment to clean next and which of its live records deserve to be copied
forward instead of evicted.

* ``fifo``: oldest segment first; nothing is copied (write amplification 1).
* ``lru``: LRU approximated by CLOCK / second chance, as the Linux page cache does: a get sets
  the record's reference bit, and a referenced record in the segment being cleaned is copied
  forward once (its bit cleared) rather than evicted.

* ``planned``: every live record is copied forward; its owner deletes what it no longer
  wants (the sample cache follows its Belady plan this way), so cleaning reclaims dead space,
  deadest segment first, and evicts live records only when no segment it compares has the
  dead space the writer needs.

Other policies can be added with ``register_policy``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from lcache.errors import ConfigError


class EvictionPolicy(Protocol):
    name: str
    #: Whether gets should set reference bits (costs one byte store per hit).
    tracks_references: bool
    #: Clean the segments with the fewest live bytes first (instead of victim_order's).
    greedy: bool

    def victim_order(self, sealed: Sequence[int]) -> list[int]:
        """Sealed segment ids (ascending = oldest first) in the order to clean them."""
        ...

    def keep(
        self, keys: npt.NDArray[np.uint64], kinds: npt.NDArray[np.uint8],
        referenced: npt.NDArray[np.bool_],
    ) -> npt.NDArray[np.bool_]:
        """For the live records of a segment being cleaned: True = copy forward."""
        ...


class FifoPolicy:
    name = "fifo"
    tracks_references = False
    greedy = False

    def victim_order(self, sealed: Sequence[int]) -> list[int]:
        return sorted(sealed)

    def keep(
        self, keys: npt.NDArray[np.uint64], kinds: npt.NDArray[np.uint8],
        referenced: npt.NDArray[np.bool_],
    ) -> npt.NDArray[np.bool_]:
        return np.zeros(len(keys), dtype=bool)


class LruPolicy(FifoPolicy):
    name = "lru"
    tracks_references = True

    def keep(
        self, keys: npt.NDArray[np.uint64], kinds: npt.NDArray[np.uint8],
        referenced: npt.NDArray[np.bool_],
    ) -> npt.NDArray[np.bool_]:
        return referenced.copy()


class PlannedPolicy(FifoPolicy):
    name = "planned"
    greedy = True  # live records are wanted: reclaim the deadest segments first

    def keep(
        self, keys: npt.NDArray[np.uint64], kinds: npt.NDArray[np.uint8],
        referenced: npt.NDArray[np.bool_],
    ) -> npt.NDArray[np.bool_]:
        return np.ones(len(keys), dtype=bool)


_REGISTRY: dict[str, Callable[[], EvictionPolicy]] = {
    "fifo": FifoPolicy, "lru": LruPolicy, "planned": PlannedPolicy}


def register_policy(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    _REGISTRY[name] = factory


def known_policies() -> list[str]:
    """The policy names this process knows, sorted."""
    return sorted(_REGISTRY)


def make_policy(name: str) -> EvictionPolicy:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(known_policies())}"
        ) from None
