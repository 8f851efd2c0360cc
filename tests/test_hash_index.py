"""The byte-key hash index against a dict: inserts, overwrites and backward-shift deletes."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from lcache import IndexFullError
from lcache.store.hashindex import EMPTY, HashIndex
from lcache.store.layout import MetaPage


def new_index(tmp_path: Path, slots: int) -> HashIndex:
    return HashIndex(str(tmp_path), MetaPage(str(tmp_path / "lock")), slots)


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_match_a_dict(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    index = new_index(tmp_path, 64)
    model: dict[int, tuple[int, int]] = {}
    # few distinct home slots, so probe runs are long and wrap around the table's end
    keys = [rng.randrange(1 << 64) | 0x3F for _ in range(30)] + [rng.randrange(1 << 64)
                                                                for _ in range(20)]
    for step in range(3000):
        h = rng.choice(keys)
        if rng.random() < 0.55 and (h in model or len(model) < 50):
            loc, length = (step + 1) << 32, step + 7
            index.set(h, loc, length)
            model[h] = (loc, length)
        else:
            assert index.remove(h) == (h in model)
            model.pop(h, None)
        if step % 50 == 0:
            for k in keys:
                assert index.lookup(k) == model.get(k)
    assert index.live_count() == len(model)
    for h in list(model):
        assert index.remove(h)
    assert (index._t.state == EMPTY).all()  # nothing left behind: no tombstones
    index.close()


def test_a_duplicate_left_by_a_crash_mid_shift_is_removed_too(tmp_path: Path) -> None:
    index = new_index(tmp_path, 16)
    h = 5
    index.set(h, 1 << 32, 40)
    # what a crash between copying an entry back and clearing its old slot leaves behind
    t = index._t
    i = t.find(h)
    j = (i + 1) & t.mask
    for column in (t.hash, t.loc, t.length, t.state):
        column[j] = column[i]
    assert index.remove(h)
    assert index.lookup(h) is None
    assert np.count_nonzero(t.state) == 0
    index.close()


def test_full_table_is_a_clear_error(tmp_path: Path) -> None:
    index = new_index(tmp_path, 16)
    for h in range(16):
        index.set(h, (h + 1) << 32, 40)
    with pytest.raises(IndexFullError, match="max_byte_keys"):
        index.set(99, 1 << 32, 40)
    assert index.remove(3)
    index.set(99, 1 << 32, 40)  # a freed slot is usable again
    assert index.lookup(99) == (1 << 32, 40)
    index.close()
