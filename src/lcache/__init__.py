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

if __import__("os").environ.get("LCACHE_TRACE"):  # tracing asked for from outside (docs/trace.md)
    from lcache.trace.recorder import enable_from_environment

    enable_from_environment()

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
