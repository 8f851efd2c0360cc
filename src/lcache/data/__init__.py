"""The seed-aware sample cache for PyTorch training (sources, dataset, sampler, plan)."""

from lcache.data.cache import Access, SampleCache
from lcache.data.dataset import CachedDataset
from lcache.data.formats import LitDataSource, MDSSource, TableSource, WebDatasetSource
from lcache.data.plan import belady, simulate_lru, simulate_opt
from lcache.data.sampler import SeedAwareSampler
from lcache.data.sources import (
    DatasetSource,
    FileSource,
    ImageFolderSource,
    RangeSource,
    SourceError,
)

__all__ = [
    "Access",
    "CachedDataset",
    "DatasetSource",
    "FileSource",
    "ImageFolderSource",
    "LitDataSource",
    "MDSSource",
    "RangeSource",
    "SampleCache",
    "SeedAwareSampler",
    "SourceError",
    "TableSource",
    "WebDatasetSource",
    "belady",
    "simulate_lru",
    "simulate_opt",
]
