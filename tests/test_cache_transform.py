"""A transform may ask for the sample's index and path; a URL source keeps its listing in the
cache directory for the other ranks of the launch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from lcache.data import CachedDataset, SeedAwareSampler


def _folder(root: Path) -> None:
    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True)
        for i in range(3):
            (root / label / f"{i}.bin").write_bytes(f"{label}-{i}".encode())


def _with_label(item: bytes, *, path: str) -> tuple[bytes, str]:
    return item, Path(path).parent.name  # what a user derives from the folder


def test_transform_gets_index_and_path(tmp_path: Path) -> None:
    _folder(tmp_path / "data")
    seen: list[tuple[int, str]] = []

    def record(item: bytes, index: int, path: str) -> bytes:
        seen.append((index, path))
        return item

    ds = CachedDataset(str(tmp_path / "data"), tmp_path / "cache", "16MiB", transform=record)
    assert ds[4] == b"dog-1"
    assert seen == [(4, str(tmp_path / "data" / "dog" / "1.bin"))]
    plain = CachedDataset(str(tmp_path / "data"), tmp_path / "cache", "16MiB",
                          transform=lambda b: b.upper())  # one argument: unchanged
    assert plain[0] == b"CAT-0"


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


def test_labels_from_paths_through_dataloader_workers(tmp_path: Path) -> None:
    _folder(tmp_path / "data")
    ds = CachedDataset(str(tmp_path / "data"), tmp_path / "cache", "16MiB",
                       transform=_with_label)
    sampler = SeedAwareSampler(ds, seed=0, num_replicas=1, rank=0)
    loader = DataLoader(ds, batch_size=2, sampler=sampler, num_workers=2, collate_fn=_as_list)
    got = sorted(item for batch in loader for item in batch)
    assert got == sorted((f"{label}-{i}".encode(), label) for label in ("cat", "dog")
                         for i in range(3))
