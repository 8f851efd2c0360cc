"""Errors of the checkpoint package (all are ``LCacheError`` and the matching builtin)."""

from __future__ import annotations

from lcache.errors import ConfigError, CorruptionError, DiskFullError, LCacheError

__all__ = [
    "CheckpointExistsError",
    "CheckpointFailedError",
    "CheckpointNotFoundError",
    "ConfigError",
    "CorruptionError",
    "DiskFullError",
    "StateMismatchError",
    "UnsupportedValueError",
]


class UnsupportedValueError(LCacheError, TypeError):
    """The state holds a value a checkpoint cannot store; the message names its key."""


class StateMismatchError(LCacheError, ValueError):
    """A loaded state differs from ``like=`` in keys, shapes or dtypes; the message lists them."""


class CheckpointNotFoundError(LCacheError, FileNotFoundError):
    """No complete checkpoint at the path (a partial one is never loaded)."""


class CheckpointExistsError(LCacheError, FileExistsError):
    """A complete checkpoint already has that name; checkpoints are never overwritten."""


class CheckpointFailedError(LCacheError, RuntimeError):
    """Another rank's part of a multi-rank checkpoint failed; the message says which and why."""
