"""Helpers of the sample-cache training tests: sample files that encode their index, and
datasets closed at the end of each test (import ``_close_datasets`` into a test module: it is
an autouse fixture)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lcache.data import CachedDataset

from ._torchrun_cache import sample_bytes

HEADER = 32  # record header bytes the cache adds to every sample


def write_samples(root: Path, n: int, size: int, seed: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"{i:06d}.bin").write_bytes(sample_bytes(i, size, seed))
    return root


_OPENED: list[CachedDataset] = []


def open_dataset(*args: Any, **kwargs: Any) -> CachedDataset:
    """A ``CachedDataset`` closed at the end of the test: one dropped unclosed keeps its
    /dev/shm staging area (``test_dropped_cache_frees_its_staging_memory``)."""
    ds = CachedDataset(*args, **kwargs)
    _OPENED.append(ds)
    return ds


@pytest.fixture(autouse=True)
def _close_datasets() -> Iterator[None]:
    yield
    while _OPENED:
        _OPENED.pop().cache.close()
