"""The seed-aware sampler: ``DistributedSampler``'s order, plus the cache's plan.

It yields ``Access(index, keep)``: ``keep`` is Belady's decision for that access, computed
for the whole node (every local rank's accesses, interleaved) by every rank alike, so ranks
and DataLoader workers follow one plan without exchanging a message. While the DataLoader
iterates, a prefetcher in this process fetches the rank's upcoming misses.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from lcache.checks import env_number, flag, launch_rank_world, whole_number
from lcache.data.cache import Access, SampleCache
from lcache.data.order import ShardWindow, node_order, rank_order, samples_per_rank
from lcache.data.plan import FOR_GOOD, PlanResult, belady
from lcache.data.prefetch import Prefetcher
from lcache.errors import ConfigError
from lcache.store import format_size

log = logging.getLogger("lcache")

#: The largest epoch: a larger one is a step number given as the epoch.
MAX_EPOCH = 100_000
#: Epochs planned before the one asked for when no plan of the epochs just before it is at
#: hand (a resumed job, an epoch skipped to), starting from an empty cache. Why not from
#: epoch 0: at 3-5 us per access, a million samples resumed at epoch 100 planned for minutes.
#: Every sample is read once per epoch, so what an epoch leaves cached hardly depends on what
#: it started with; the plans came out identical to those made from epoch 0 (tests).
PLAN_FROM = 2
#: The most ranks: far above any launch (num_replicas=10**40 overflowed a C ssize_t in the
#: rank arithmetic, a bare OverflowError).
MAX_WORLD = 1 << 24
#: The largest seed: the 128 bits of entropy numpy's SeedSequence draws (a seed taken from
#: ``SeedSequence().entropy`` fits), which seeds the order's generator with ``[seed, epoch]``.
MAX_SEED = (1 << 128) - 1


def _distributed() -> tuple[int, int]:
    """(rank, world size) from torch.distributed when initialised, else torchrun's env."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return launch_rank_world()


class SeedAwareSampler:
    """Sampler for ``DataLoader(dataset, sampler=...)`` over a ``CachedDataset``.

    Args:
        dataset: the ``CachedDataset`` (or its ``SampleCache``).
        shuffle, seed, drop_last, num_replicas, rank: as ``DistributedSampler``; rank and
            world size default to torch.distributed's (or ``RANK``/``WORLD_SIZE``). The
            seed is 0 to ``MAX_SEED``, the flags real bools (``shuffle="no"`` is refused).
        local_world_size: ranks on this node, which share the cache (default
            ``LOCAL_WORLD_SIZE`` from torchrun, else all ranks).
        prefetch: fetch upcoming misses in the background.
        prefetch_threads: groups of misses fetched and admitted at once (each group's
            requests run concurrently: ``threads x 16`` requests in flight). Why 2: with a
            DataLoader's workers on the same cores, 16 threads taking turns at the GIL
            tripled the prefetcher's CPU and slowed a latency-bound epoch 1.5x.
        prefetch_window: how far ahead of the reader, in samples.
        prefetch_bytes: memory the fetches in flight may hold.
        loader_workers: DataLoader workers per rank. Each worker that admits a sample holds a
            store segment of its own; the plan leaves room for that many per rank.
        shard_window: with a source of shards (WebDataset, MDS, LitData, a table), shuffle
            the shards, then the samples within runs of this many shards, instead of all
            samples at once (0). Nearby misses then share shards, and the prefetcher fetches
            them in coalesced ranged requests.
    """

    def __init__(self, dataset: Any, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, num_replicas: int | None = None,
                 rank: int | None = None, local_world_size: int | None = None,
                 prefetch: bool = True, prefetch_threads: int = 2,
                 prefetch_window: int = 256, prefetch_bytes: int = 64 << 20,
                 loader_workers: int = 4, shard_window: int = 0) -> None:
        cache = dataset if isinstance(dataset, SampleCache) else getattr(dataset, "cache", None)
        if not isinstance(cache, SampleCache):
            raise ConfigError(f"SeedAwareSampler({type(dataset).__name__}): give the "
                              "CachedDataset it samples (or its .cache)")
        self.cache: SampleCache = cache
        d_rank, d_world = _distributed()
        self.world = d_world if num_replicas is None else \
            whole_number(num_replicas, "num_replicas", 1, MAX_WORLD)
        self.rank = d_rank if rank is None else whole_number(rank, "rank", 0, MAX_WORLD - 1)
        if not 0 <= self.rank < self.world:
            raise ConfigError(f"rank {self.rank} is not in [0, {self.world})")
        seed = whole_number(seed, "seed", 0, MAX_SEED)
        shuffle, drop_last = flag(shuffle, "shuffle"), flag(drop_last, "drop_last")
        prefetch = flag(prefetch, "prefetch")
        shard_window = whole_number(shard_window, "shard_window", 0)
        for value, name, low in ((prefetch_threads, "prefetch_threads", 1),
                                 (prefetch_window, "prefetch_window", 1),
                                 (prefetch_bytes, "prefetch_bytes", 1),
                                 (loader_workers, "loader_workers", 0)):
            whole_number(value, name, low)
        local = env_number("LOCAL_WORLD_SIZE", self.world, 1) if local_world_size is None \
            else whole_number(local_world_size, "local_world_size", 1, MAX_WORLD)
        node = self.rank // local
        self.node_ranks = range(node * local, min((node + 1) * local, self.world))
        self.n = len(self.cache.source)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.num_samples = samples_per_rank(self.n, self.world, drop_last)
        if self.num_samples == 0:
            raise ConfigError(f"{self.n} samples cannot be split over {self.world} ranks "
                              "with drop_last")
        self.shard_window = shard_window
        self.local = self._shard_window(shard_window) if shard_window else None
        self.prefetch = prefetch
        self.prefetch_threads = prefetch_threads
        mean = max(1, self.cache.dataset_bytes // self.n)
        ahead = self.cache.staging_window(len(self.node_ranks)) // mean
        # A shard-local order prefetches a shard's misses of a whole run at once: they are
        # staged up to a run ahead, on top of the window.
        self.prefetch_reach = 0 if self.local is None else \
            min(self.local.run_samples(), ahead // 2)
        self.prefetch_window = max(1, min(prefetch_window, ahead - self.prefetch_reach))
        self.prefetch_bytes = prefetch_bytes
        writers = len(self.node_ranks) * (1 + max(0, loader_workers))
        self.plan_capacity = self.cache.plan_capacity(writers=writers)
        if self.rank == self.node_ranks.start:
            self._say_what_the_plan_holds(writers)
        self.epoch = 0
        self._start = 0
        self._yielded = 0
        self._asked: int | None = None  # the last set_epoch's, until an iteration or a load
        self._keep_finished = False
        self._resumed_asked: int | None = None  # see load_state_dict
        self._plans: dict[int, PlanResult] = {}
        self._plan_lock = threading.Lock()
        self._ahead: threading.Thread | None = None

    def _say_what_the_plan_holds(self, writers: int) -> None:
        """Warn when the plan can keep a fifth or more less of the dataset than the capacity
        would hold: the store's own room (an active segment per writer, a spare one, the
        index and any staging on the SSD) weighs on a small cache, and its hit ratio falls
        below the capacity's share of the dataset with no other sign."""
        cache = self.cache
        data = int(cache.record_sizes().sum())
        asked, planned = min(cache.capacity, data), min(self.plan_capacity, data)
        if data and planned < 0.8 * asked:
            log.warning(
                "lcache: the plan can keep %s of the cache's %s (%.0f%% of the dataset, where "
                "the capacity is %.0f%%): the rest is the store's own room (a segment of %s "
                "for each of %d writers, the node's ranks x (1 + loader_workers), one spare, the "
                "index%s). A larger capacity, a smaller segment_size or fewer "
                "loader_workers leave the plan more", format_size(planned),
                format_size(cache.capacity), 100 * planned / data, 100 * asked / data,
                format_size(cache.segment_size), writers,
                ", staging" if cache.main_capacity < cache.capacity else "")

    def _shard_window(self, window: int) -> ShardWindow:
        shards = getattr(self.cache.source, "shards", None)
        if shards is None:
            raise ConfigError(f"shard_window needs a source of shards (WebDataset, MDS, "
                              f"LitData, a table); {type(self.cache.source).__name__} has "
                              "one object per sample")
        return ShardWindow(np.asarray(shards(), np.int64), window)

    # ------------------------------------------------------------------- order and plan
    def __len__(self) -> int:
        return self.num_samples - self._start

    def set_epoch(self, epoch: int) -> None:
        """The epoch to iterate next (0, 1, 2..., at most ``MAX_EPOCH``; not the step)."""
        try:
            epoch = whole_number(epoch, "epoch", 0, MAX_EPOCH)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (the epoch, not the step)") from None
        if epoch != self.epoch:  # a state_dict taken now is at the new epoch's start
            self._start = self._yielded = 0
        # asked for by name, a finished epoch stays finished (see __iter__)
        self._keep_finished = self._start == self.num_samples
        self.epoch = epoch
        self._asked = epoch

    def node_sequence(self, epoch: int) -> npt.NDArray[np.int64]:
        """The node's accesses of ``epoch`` in order (every local rank's, interleaved)."""
        return node_order(self.n, self.seed, epoch, self.node_ranks, self.world,
                          shuffle=self.shuffle, drop_last=self.drop_last, local=self.local)

    def plan(self, epoch: int) -> PlanResult:
        """Belady's plan for the node's accesses of ``epoch``. Each epoch starts with what
        the previous one left cached, so the epochs before it are planned first: from the
        last one planned, or ``PLAN_FROM`` epochs back from an empty cache."""
        with self._plan_lock:  # the next epoch's may be under way in the background
            done = max((e for e in self._plans if e <= epoch), default=-1)
            if done < epoch - PLAN_FROM - 1:
                done = epoch - PLAN_FROM - 1
            if done == epoch:  # made ahead: nothing to size (an argsort of every sample)
                return self._plans[epoch]
            sizes = self.cache.record_sizes()
            # A node with every rank reads every sample each epoch, and gets every hit there
            # is from a fixed set, with no writes once it is cached (see plan.py); a node of
            # several reads a part, and Belady caches the part it reads next.
            held = self.cache.fixed_set(self.plan_capacity) \
                if len(self.node_ranks) == self.world else None
            while done < epoch:
                done += 1
                before = self._plans.get(done - 1)
                carried = before.carried if before is not None else \
                    self._held_before(done, held)
                self._plans[done] = belady(self.node_sequence(done), sizes, self.plan_capacity,
                                           horizon=self.node_sequence(done + 1),
                                           carried=carried, admit=held)
                self._plans.pop(done - 2, None)
            return self._plans[epoch]

    def _held_before(self, epoch: int, held: npt.NDArray[np.bool_] | None) -> dict[int, int]:
        """What a fixed set (``held``; None: Belady's plan, which starts from an empty
        cache) holds at the start of ``epoch``: its samples read in an earlier epoch, kept
        for good. Why: planned from an empty cache, a resumed job's plan missed the samples
        ``drop_last`` had left out of the epochs it replans, which the cache held (after a
        restart, 31 of 383 samples planned as misses were hits; attack helper 103). Without
        ``drop_last`` the epoch before reads them all: one epoch's order."""
        if held is None or epoch == 0:
            return {}
        unread = held.copy()
        for before in range(epoch - 1, -1, -1):
            unread[self.node_sequence(before)] = False
            if not unread.any():
                break
        return dict.fromkeys(np.flatnonzero(held & ~unread).tolist(), FOR_GOOD)

    def _plan_ahead(self, epoch: int) -> None:
        """Start computing ``epoch``'s plan in the background. Why: Belady's rule costs 3-5 us
        per access, so over a million samples every rank would wait seconds at the start of
        each epoch; made during the previous epoch, it is ready when asked for."""
        if self._ahead is not None and self._ahead.is_alive():
            return

        def plan() -> None:
            with contextlib.suppress(Exception):  # asked again in the foreground, raised there
                self.plan(epoch)

        self._ahead = threading.Thread(target=plan, name="lcache-plan", daemon=True)
        self._ahead.start()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_plan_lock"], state["_ahead"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _plan_lock=threading.Lock(), _ahead=None)

    def order(self, epoch: int | None = None) -> npt.NDArray[np.int64]:
        """This rank's sample indices for ``epoch`` (default: the current one)."""
        return rank_order(self.n, self.seed, self.epoch if epoch is None else epoch,
                          self.rank, self.world, shuffle=self.shuffle, drop_last=self.drop_last,
                          local=self.local)

    def __iter__(self) -> Iterator[Access]:
        order = self.order()
        local, ranks = self.rank - self.node_ranks.start, len(self.node_ranks)
        plan = self.plan(self.epoch)
        self._plan_ahead(self.epoch + 1)
        keep, hits = plan.keep[local::ranks], plan.hits[local::ranks]
        start = self._start
        self._asked = None
        resumed, self._resumed_asked = self._resumed_asked, None
        # A resumed epoch that had ended gives nothing once, then starts again as any epoch
        # does without set_epoch; asked for by set_epoch, it gives nothing until set_epoch
        # moves on (StatefulDataLoader makes a second iterator after restoring an ended
        # one, which then replayed the epoch the loop had resumed).
        if start < len(order) or not self._keep_finished:
            self._start = 0
        self._yielded = start
        prefetcher = Prefetcher(self.cache, order, start, hits=hits,
                                threads=self.prefetch_threads, window=self.prefetch_window,
                                budget_bytes=self.prefetch_bytes, reach=self.prefetch_reach,
                                staged_budget=self.cache.staging_window(len(self.node_ranks)),
                                shards=None if self.local is None else self.local.shards) \
            if self.prefetch else None
        samples, keeps = order.tolist(), keep.tolist()
        try:
            for i in range(start, len(samples)):
                if prefetcher is not None:
                    prefetcher.advance(i)
                self._yielded = i + 1
                yield Access(samples[i], keeps[i])
        finally:
            if prefetcher is not None:
                prefetcher.close()
        if resumed is not None:
            self._end_resumed(resumed)

    def _end_resumed(self, asked: int) -> None:
        """A loaded epoch iterated to its end: what loading its ended state after
        ``set_epoch(asked)`` would have given (see ``load_state_dict``)."""
        if asked > self.epoch:
            self.epoch, self._start, self._yielded = asked, 0, 0
            self._keep_finished = False
        elif asked == self.epoch:
            self._start = self._yielded = self.num_samples
            self._keep_finished = True

    # ------------------------------------------------------------------- resuming
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this rank is: the epoch and how many of its samples were consumed.

        By default, the samples this sampler has yielded. That is what the training loop has
        received with ``num_workers=0``, and with torchdata's ``StatefulDataLoader``, which
        calls this as it sends each batch and saves the call that matches the last batch the
        loop received (or of its last snapshot, with the batches since counted: resume with
        the same batch size). A plain DataLoader with workers pulls indices ahead of the loop: there
        pass ``consumed`` (samples the loop received this epoch), or use StatefulDataLoader.
        """
        if consumed is not None:  # refused now, not when the checkpoint holding it is loaded
            whole_number(consumed, "consumed", 0)
            if consumed > self.num_samples:
                raise ConfigError(f"consumed={consumed}: this rank's epoch has "
                                  f"{self.num_samples} samples")
        return {"epoch": self.epoch, "consumed": self._yielded if consumed is None else consumed,
                "seed": self.seed, "samples": self.n, "world": self.world,
                "shuffle": self.shuffle, "drop_last": self.drop_last,
                "shard_window": self.shard_window}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state_dict`` was taken: the rest of that epoch (nothing, when it
        was taken at the epoch's end), then the next epochs as ``set_epoch`` says."""
        if not isinstance(state, dict) or not {"epoch", "consumed"} <= state.keys():
            raise ConfigError(f"not a sampler state (a dict from state_dict() with 'epoch' and "
                              f"'consumed'): {type(state).__name__}")
        for key, mine in (("seed", self.seed), ("samples", self.n), ("world", self.world),
                          ("shuffle", self.shuffle), ("drop_last", self.drop_last),
                          ("shard_window", self.shard_window)):
            given = state.get(key, 0 if key == "shard_window" else None)
            try:
                same = bool(given == mine)
            except (ValueError, TypeError):  # an array or a tensor: no one truth value
                same = False
            if not same:
                raise ConfigError(f"sampler state has {key}={state.get(key)!r}, this sampler "
                                  f"{mine!r}; resume with the same settings")
        consumed = whole_number(state["consumed"], "the sampler state's consumed", 0)
        if not 0 <= consumed <= self.num_samples:
            raise ConfigError(f"sampler state consumed={consumed} is outside this epoch "
                              f"(0..{self.num_samples})")
        epoch = whole_number(state["epoch"], "the sampler state's epoch", 0, MAX_EPOCH)
        asked, self._asked = self._asked, None
        self._resumed_asked = None
        self._keep_finished = consumed == self.num_samples and asked == epoch
        if consumed == self.num_samples and asked is not None and asked > epoch:
            # The state of a finished epoch, loaded after set_epoch moved past it, as
            # StatefulDataLoader loads it (at iter()): the epoch asked for, from its start.
            # Taken as the state says, it replayed the finished epoch (or, with no workers,
            # gave nothing) in place of the next.
            self.epoch, self._start, self._yielded = asked, 0, 0
            return
        self.epoch = epoch
        self._start = consumed
        self._yielded = consumed
        if consumed < self.num_samples:
            # Once its rest has been iterated, the epoch has ended as if its ended state had
            # been loaded. Why: a StatefulDataLoader state taken at an epoch's end holds the
            # sampler's state of its last snapshot (with snapshot_every_n_steps > 1, or with
            # drop_last, a few samples short of the end); restored, the loader runs that rest
            # off, sees its iterator ended and makes a second, which replayed the whole epoch.
            self._resumed_asked = asked
