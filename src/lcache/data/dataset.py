"""``CachedDataset``: a map-style dataset served through the node's sample cache."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lcache.data.cache import DEFAULT_STAGING, Access, SampleCache
from lcache.data.sources import as_source


class CachedDataset:
    """Items of ``source`` (a URL or directory with one object per sample, a ``RangeSource``,
    or a map-style dataset), read through a cache of ``capacity`` bytes in ``cache_dir``.

    Indexed by an int (read-through: admitted if there is room) or by the ``Access`` the
    ``SeedAwareSampler`` yields (follows the plan). ``staging_bytes`` of memory (/dev/shm)
    hold prefetched samples the plan does not keep until they are read. ``transform`` turns
    the raw item (bytes for files and ranges, the original structure for datasets) into what
    training needs; it runs on every read, so random augmentations belong there.

    The directory serves only the source it was made for: ``name`` and ``fingerprint`` (a
    dataset version, say) are part of that identity, on top of the URL or, for a dataset
    without a listing, the bytes of a probe of its items. ``check`` (on by default) compares
    the source's listing with the one cached and drops samples rewritten since; turn it off
    only for a source that never changes.
    """

    def __init__(self, source: Any, cache_dir: str | os.PathLike[str],
                 capacity: int | str, *, transform: Callable[[Any], Any] | None = None,
                 segment_size: int | str | None = None,
                 staging_bytes: int | str = DEFAULT_STAGING, name: str | None = None,
                 fingerprint: str | None = None, check: bool = True,
                 **source_options: Any) -> None:
        self.cache = SampleCache(as_source(source, **source_options), cache_dir, capacity,
                                 segment_size=segment_size, staging_bytes=staging_bytes,
                                 name=name, fingerprint=fingerprint, check=check)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.cache.source)

    def __getitem__(self, key: int | Access) -> Any:
        index, keep = (key.sample, key.keep) if isinstance(key, Access) else (int(key), None)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside 0..{len(self) - 1}")
        item = self.cache.get(index, keep)
        return self.transform(item) if self.transform is not None else item

    def stats(self) -> dict[str, Any]:
        return self.cache.stats()
