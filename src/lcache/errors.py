"""The LCache exception hierarchy.

Every error derives from :class:`LCacheError`; most also derive from the builtin that a caller
would naturally catch (``OSError``, ``ValueError``...), so ``except OSError`` keeps working.
"""

from __future__ import annotations

import errno


class LCacheError(Exception):
    """Base class of every error raised by lcache."""


class ConfigError(LCacheError, ValueError):
    """A setting or argument is invalid; the message says what to change."""


class ArgumentTypeError(ConfigError, TypeError):
    """An argument is of the wrong type (the store's API: a key that is neither an int nor
    bytes, a value that is not a plain buffer, a batch that is not a sequence); also the
    ``TypeError`` such a call raised before."""


class StoreNotFoundError(LCacheError, FileNotFoundError):
    """The directory holds no store and creation was not requested."""


class StorePermissionError(LCacheError, PermissionError):
    """The store directory cannot be written, or belongs to another user."""


class DiskFullError(LCacheError, OSError):
    """The device ran out of space (ENOSPC) during a write; the store stays consistent."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.args[1])


class CorruptionError(LCacheError, ValueError):
    """On-disk data failed validation (bad magic, checksum or length)."""


class StoreFullError(LCacheError, RuntimeError):
    """Nothing more can be evicted to make room (e.g. every segment is held by a writer)."""


class IndexFullError(LCacheError, RuntimeError):
    """The byte-key hash index cannot grow: it reached ``max_byte_keys`` or the room the
    capacity leaves it; reopen with a larger ``max_byte_keys`` or capacity."""
