"""Resuming from the loader's state alone: torchdata's ``StatefulDataLoader`` with workers
saves ``SeedAwareSampler.state_dict()`` as of the last batch the loop received (not as far as
the workers ran ahead), and ``load_state_dict`` is all a resumed job calls."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
stateful = pytest.importorskip("torchdata.stateful_dataloader")

from lcache.data import CachedDataset, SeedAwareSampler  # noqa: E402

from ._torchrun_cache import sample_bytes, sample_index  # noqa: E402
from .conftest import KIB, MIB  # noqa: E402

N, SIZE, BATCH = 600, 4 * KIB, 16


@pytest.fixture
def data(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    for i in range(N):
        (root / f"{i:06d}.bin").write_bytes(sample_bytes(i, SIZE))
    return root


def build(data: Path, cache: Path, workers: int = 2, **loader_options: Any
          ) -> tuple[CachedDataset, SeedAwareSampler, Any]:
    ds = CachedDataset(str(data), cache, 2 * MIB + N * SIZE // 2)
    sampler = SeedAwareSampler(ds, seed=5)
    loader = stateful.StatefulDataLoader(ds, sampler=sampler, num_workers=workers,
                                         collate_fn=list,
                                         **{"batch_size": BATCH, **loader_options})
    return ds, sampler, loader


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("stop_after", [7, N // BATCH + 1])  # mid-epoch; the epoch's end
def test_resume_from_the_loader_state_alone(data: Path, tmp_path: Path,
                                            stop_after: int) -> None:
    ds, sampler, loader = build(data, tmp_path / "cache")
    sampler.set_epoch(0)
    assert sorted(sample_index(x, SIZE) for b in loader for x in b) == list(range(N))
    sampler.set_epoch(1)
    before: list[int] = []
    for b, batch in enumerate(loader):
        before += [sample_index(x, SIZE) for x in batch]
        if b + 1 == stop_after:
            break
    state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint stores it
    ds.cache.close()  # what the job's exit does
    del ds, sampler, loader
    gc.collect()

    ds, sampler, loader = build(data, tmp_path / "cache")
    loader.load_state_dict(state)
    try:
        sampler.set_epoch(1)  # the loop's call for the resumed epoch keeps the position
        after = [sample_index(x, SIZE) for b in loader for x in b]
        assert before + after == sampler.order(1).tolist()
        sampler.set_epoch(2)
        mark = ds.stats()
        got = [sample_index(x, SIZE) for b in loader for x in b]
        assert got == sampler.order(2).tolist()
        planned = N - int(sampler.plan(2).hits.sum())
        assert ds.stats(since=mark)["fetches"] <= planned + N // 100  # the cache survived
    finally:
        ds.cache.close()


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize(("workers", "options"), [
    (0, {}), (2, {}),
    # the sampler's state saved is then a few samples short of the end (attack helper 88)
    (2, {"snapshot_every_n_steps": 4}), (2, {"batch_size": 7, "drop_last": True})])
def test_resume_from_a_state_taken_after_an_epoch_ran_out(
        data: Path, tmp_path: Path, workers: int, options: dict[str, Any]) -> None:
    """Regression (attack helper 82): a state taken once the loop had run through epoch 1
    (the loader marks it finished) is applied at iter(), after the loop's set_epoch(2). It
    replayed epoch 1 in place of epoch 2 with workers, and gave nothing with none. With
    snapshots every 4 batches (38 in an epoch) or drop_last, whole epochs were replayed
    still: in place of epoch 2, and after set_epoch(1) in place of nothing."""
    ds, sampler, loader = build(data, tmp_path / "cache", workers, **options)
    seen = N // 7 * 7 if options.get("drop_last") else N
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        assert len([x for b in loader for x in b]) == seen
    state = json.loads(json.dumps(loader.state_dict()))
    ds.cache.close()
    del ds, sampler, loader
    gc.collect()

    for resumed in (1, 2):  # epoch 1 again: nothing left of it; then epoch 2, whole
        ds, sampler, loader = build(data, tmp_path / "cache", workers, **options)
        loader.load_state_dict(state)
        try:
            sampler.set_epoch(resumed)
            got = [sample_index(x, SIZE) for b in loader for x in b]
            assert got == ([] if resumed == 1 else sampler.order(2).tolist()[:seen])
            assert [sample_index(x, SIZE) for b in loader for x in b] == got  # asked again
            sampler.set_epoch(resumed + 1)
            got = [sample_index(x, SIZE) for b in loader for x in b]
            assert got == sampler.order(resumed + 1).tolist()[:seen]
        finally:
            ds.cache.close()
            del ds, sampler, loader
            gc.collect()


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_an_ended_state_without_set_epoch_gives_nothing_once(data: Path, tmp_path: Path) -> None:
    """The finding (attack helper 85): once an ended epoch's state was loaded, a loader whose
    loop never calls set_epoch (an evaluation pass) got nothing on every later pass; the
    first pass after it is empty, and the next ones are the epoch, as before."""
    ds, sampler, loader = build(data, tmp_path / "cache", 0)
    try:
        assert len([x for b in loader for x in b]) == N
        state = sampler.state_dict()
        sampler.load_state_dict(state)
        passes = [[sample_index(x, SIZE) for b in loader for x in b] for _ in range(3)]
        assert passes == [[], sampler.order(0).tolist(), sampler.order(0).tolist()]
    finally:
        ds.cache.close()
