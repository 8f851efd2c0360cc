"""The sampler's order and Belady's plan as functions: each rank's order is
DistributedSampler's, a node's interleaves its ranks, and the plan is OPT (against brute
force), the same epoch by epoch as over the whole sequence; LRU on known sequences.
(The sampler and the plan in training: test_data_training.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch.utils.data import DistributedSampler  # noqa: E402

from lcache.data.order import epoch_order, node_order, rank_order  # noqa: E402
from lcache.data.plan import NEVER, belady, next_uses, simulate_lru, simulate_opt  # noqa: E402
from lcache.errors import ConfigError  # noqa: E402


# --------------------------------------------------------------------------- 6. order
@pytest.mark.parametrize("n", [1, 2, 5, 7, 10, 11, 64, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_rank_order_follows_distributed_sampler(n: int, world: int, drop_last: bool) -> None:
    dataset = list(range(n))
    ref = [list(DistributedSampler(dataset, num_replicas=world, rank=r, shuffle=False,
                                   drop_last=drop_last)) for r in range(world)]
    ours = [rank_order(n, 0, 0, r, world, shuffle=False, drop_last=drop_last).tolist()
            for r in range(world)]
    assert ours == ref  # unshuffled, the padding/dropping rule gives the same lists
    for epoch in (0, 1):
        perm = epoch_order(n, 9, epoch)
        assert sorted(perm.tolist()) == dataset
        shuffled = [rank_order(n, 9, epoch, r, world, drop_last=drop_last) for r in
                    range(world)]
        assert [len(s) for s in shuffled] == [len(r) for r in ref]  # DistributedSampler's
        flat = np.stack(shuffled, axis=1).reshape(-1) if shuffled[0].size else \
            np.empty(0, np.int64)
        total = len(flat)
        if drop_last:  # the permutation's tail is dropped
            assert flat.tolist() == perm[:total].tolist()
        else:  # padded with the permutation's own head, repeated as needed
            assert flat.tolist() == np.resize(perm, total).tolist()
        ranks = range(world)
        assert node_order(n, 9, epoch, ranks, world, drop_last=drop_last).tolist() == \
            flat.tolist()
    assert epoch_order(n, 9, 0).tolist() == epoch_order(n, 9, 0).tolist()
    if n >= 5:
        assert epoch_order(n, 9, 0).tolist() != epoch_order(n, 9, 1).tolist()
        assert epoch_order(n, 9, 0).tolist() != epoch_order(n, 10, 0).tolist()


def test_node_order_interleaves_the_nodes_ranks() -> None:
    n, world = 50, 4
    for start in (0, 2):  # node 0 = ranks 0-1, node 1 = ranks 2-3
        ranks = range(start, start + 2)
        node = node_order(n, 1, 3, ranks, world)
        assert node[0::2].tolist() == rank_order(n, 1, 3, start, world).tolist()
        assert node[1::2].tolist() == rank_order(n, 1, 3, start + 1, world).tolist()


# --------------------------------------------------------------------------- 6. plan
def test_belady_on_a_hand_made_sequence() -> None:
    # Room for two samples. t2: 3 is needed later (t5) than 1 (t3) and 2 (t4): not admitted.
    result = belady(np.array([1, 2, 3, 1, 2, 3]), 1, 2)
    assert result.hits.tolist() == [False, False, False, True, True, False]
    assert result.keep.tolist() == [True, True, False, False, False, False]
    # 0 1 2 0 1 3 0 3 1 2, room for 2: 2 (next t9) and at t5 1 (next t8) are evicted.
    seq = np.array([0, 1, 2, 0, 1, 3, 0, 3, 1, 2])
    assert belady(seq, 1, 2).hits.nonzero()[0].tolist() == [3, 4, 6, 7]
    assert simulate_opt(seq, 1, 2) == pytest.approx(0.4)
    # A capacity is a size ("1GB" was a TypeError at the first miss; attack helper 47).
    assert simulate_lru(seq, 1, "2") == simulate_lru(seq, 1, 2)
    assert simulate_opt(seq, 1, "1KiB") == simulate_opt(seq, 1, 1024)
    for bad in (0, "x", None, 1.5):
        for simulate in (simulate_lru, simulate_opt):
            with pytest.raises(ConfigError, match=r"^capacity: "):
                simulate(seq, 1, bad)  # type: ignore[arg-type]
    # A sample larger than the cache is never kept; bytes, not counts, bound the cache.
    sizes = np.array([5, 1, 1])
    assert not belady(np.array([0, 1, 0, 1]), sizes, 4).keep[0]
    assert belady(np.array([0, 1, 2, 0, 1, 2]), sizes, 6).hits.sum() == 2  # 0 + one of 1, 2


def _brute_opt_hits(seq: list[int], capacity: int) -> int:
    """Most hits any offline policy (bypass allowed, unit sizes) can get, by search."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for x in seq:
        nxt: dict[frozenset[int], int] = {}
        for cached, hits in best.items():
            hit = x in cached
            options = [cached, cached | {x}] if not hit else [cached]
            for opt in options:
                for keep in _subsets_within(opt, capacity):
                    if nxt.get(keep, -1) < hits + hit:
                        nxt[keep] = hits + hit
        best = nxt
    return max(best.values())


def _subsets_within(items: frozenset[int], capacity: int) -> list[frozenset[int]]:
    out = [frozenset()]
    for x in items:
        out += [s | {x} for s in out]
    return [s for s in out if len(s) <= capacity]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=12), st.integers(1, 3))
def test_belady_is_optimal_for_equal_sizes(seq: list[int], capacity: int) -> None:
    result = belady(np.array(seq, dtype=np.int64), 1, capacity)
    assert int(result.hits.sum()) == _brute_opt_hits(seq, capacity)
    assert simulate_lru(np.array(seq), 1, capacity) <= result.hit_ratio + 1e-12


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=30),
       st.one_of(st.none(), st.lists(st.integers(0, 8), max_size=20)))
def test_next_uses_matches_brute_force(seq: list[int], horizon: list[int] | None) -> None:
    h = None if horizon is None else np.array(horizon, dtype=np.int64)
    got = next_uses(np.array(seq, dtype=np.int64), h).tolist()
    for t, x in enumerate(seq):
        later = [u for u in range(t + 1, len(seq)) if seq[u] == x]
        if later:
            want = later[0]
        elif horizon and seq and x in horizon:
            want = len(seq) + horizon.index(x)
        else:
            want = NEVER
        assert got[t] == want, (t, x)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 40), st.integers(1, 4), st.integers(0, 2**16), st.booleans(),
       st.floats(0.05, 1.2))
def test_plan_epoch_by_epoch_equals_whole_sequence(n: int, epochs: int, seed: int,
                                                   variable: bool, fraction: float) -> None:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 100, n).astype(np.int64) if variable else np.int64(10)
    capacity = int(fraction * (sizes.sum() if variable else 10 * n))
    orders = [rng.permutation(n).astype(np.int64) for _ in range(epochs)]
    whole = belady(np.concatenate(orders), sizes, capacity)
    carried: dict[int, int] = {}
    hits = []
    for e, order in enumerate(orders):
        horizon = orders[e + 1] if e + 1 < epochs else None
        part = belady(order, sizes, capacity, horizon=horizon, carried=carried)
        hits.append(part.hits)
        carried = part.carried
    assert np.concatenate(hits).tolist() == whole.hits.tolist()


def test_simulate_lru_on_known_sequences() -> None:
    # cache of 2: 0 1 2(evicts 0) 0(evicts 1) 3(evicts 2) 0(hit) 1(evicts 3) -> 1 hit of 7
    assert simulate_lru(np.array([0, 1, 2, 0, 3, 0, 1]), 1, 2) == pytest.approx(1 / 7)
    # 0 1 0(hit) 1(hit) 2(evicts 0, the least recent) 0(evicts 1) -> 2 hits of 6
    assert simulate_lru(np.array([0, 1, 0, 1, 2, 0]), 1, 2) == pytest.approx(2 / 6)
    # by bytes: sample 0 (size 3) is never admitted into 2 bytes; 1 and 2 (size 1) fit
    assert simulate_lru(np.array([0, 1, 2, 0, 1, 2]), np.array([3, 1, 1]), 2) == \
        pytest.approx(2 / 6)
    assert simulate_lru(np.array([], dtype=np.int64), 1, 2) == 0.0
