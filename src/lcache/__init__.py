"""LCache: the storage side of deep-learning training on a node's local NVMe SSD."""

from lcache.errors import (
    ConfigError,
    CorruptionError,
    DiskFullError,
    IndexFullError,
    LCacheError,
    StoreFullError,
    StoreNotFoundError,
    StorePermissionError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "CorruptionError",
    "DiskFullError",
    "IndexFullError",
    "LCacheError",
    "StoreFullError",
    "StoreNotFoundError",
    "StorePermissionError",
    "__version__",
]
