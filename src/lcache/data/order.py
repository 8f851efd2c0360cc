"""The sampler's order as a pure function of (seed, epoch, rank, world size).

Every process of a node can compute every rank's order for any epoch, which is what lets the
cache plan admissions and prefetches for the whole node without talking to the other ranks.
Rank splitting, padding and ``drop_last`` follow ``torch.utils.data.DistributedSampler``.

A source of shards may be read in a shard-local order instead of a global shuffle: the shards
in a random order, and the samples of each run of ``window`` consecutive shards shuffled
together (what streaming loaders do, e.g. LitData's chunk shuffle). Accesses that are near
in time then lie in few shards, so the fetches of nearby misses coalesce into ranged requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Indices = npt.NDArray[np.int64]


@dataclass(frozen=True)
class ShardWindow:
    """A shard-local shuffle: ``shards[i]`` is sample ``i``'s shard (any integer labels);
    samples are shuffled within runs of ``window`` shards of a random shard order."""

    shards: Indices
    window: int

    def run_samples(self) -> int:
        """The most samples a run of ``window`` shards may hold."""
        counts = np.sort(np.unique(self.shards, return_counts=True)[1])
        return int(counts[-self.window:].sum())


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True,
                local: ShardWindow | None = None) -> Indices:
    """The epoch's permutation of ``range(n)`` (identity when not shuffling)."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    if local is None:
        return rng.permutation(n).astype(np.int64)
    labels, shard = np.unique(local.shards, return_inverse=True)
    place = np.empty(len(labels), np.int64)
    place[rng.permutation(len(labels))] = np.arange(len(labels))
    run = place[shard] // local.window
    return np.lexsort((rng.random(n), run)).astype(np.int64)


def samples_per_rank(n: int, world: int, drop_last: bool) -> int:
    return n // world if drop_last else -(-n // world)


def rank_order(n: int, seed: int, epoch: int, rank: int, world: int, *,
               shuffle: bool = True, drop_last: bool = False,
               local: ShardWindow | None = None) -> Indices:
    """The indices ``rank`` reads in ``epoch``: every ``world``-th of the padded permutation.

    Without ``drop_last`` the permutation is padded with its own head so each rank gets the
    same count (a few samples are then read twice per epoch); with it, the tail is dropped.
    """
    order = epoch_order(n, seed, epoch, shuffle, local)
    total = samples_per_rank(n, world, drop_last) * world
    if total > n:
        order = np.concatenate([order, np.resize(order, total - n)])
    return order[rank:total:world]


def node_order(n: int, seed: int, epoch: int, ranks: range, world: int, *,
               shuffle: bool = True, drop_last: bool = False,
               local: ShardWindow | None = None) -> Indices:
    """The node's accesses of ``epoch`` in the order they happen: ranks step together, so
    access ``i`` of local rank ``j`` comes at position ``i * len(ranks) + j``."""
    per_rank = [rank_order(n, seed, epoch, r, world, shuffle=shuffle, drop_last=drop_last,
                           local=local) for r in ranks]
    return np.stack(per_rank, axis=1).reshape(-1) if per_rank else np.empty(0, np.int64)
