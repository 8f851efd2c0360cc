"""``CachedDataset``: a map-style dataset served through the node's sample cache."""

from __future__ import annotations

import inspect
import operator
import os
from collections.abc import Callable
from typing import Any

from lcache.data.cache import SKIPPED, Access, SampleCache, check_locations
from lcache.data.sizing import DEFAULT_STAGING, cache_capacity
from lcache.data.sources import SourceError, as_source
from lcache.errors import ConfigError


class CachedDataset:
    """Items of ``source`` (a URL or directory with one object per sample, a ``RangeSource``,
    or a map-style dataset), read through a cache of ``capacity`` bytes in ``cache_dir``.

    Indexed by an int (read-through: admitted if there is room) or by the ``Access`` the
    ``SeedAwareSampler`` yields (follows the plan); a DataLoader with a batch size calls
    ``__getitems__`` with a batch of them, which is served with one read per store, one
    ``fetch_many`` of the misses and one write. ``capacity`` is a size (``"500GB"``) or a
    fraction of the dataset's bytes (``0.4`` or ``"40%"``). ``staging_bytes`` of memory (/dev/shm)
    hold prefetched samples the plan does not keep until they are read. ``transform`` turns
    the raw item (bytes for files and ranges, the original structure for datasets) into what
    training needs; it runs on every read, so random augmentations belong there. A transform
    that takes an ``index`` or ``path`` keyword gets the sample's number and where it came
    from (``source.path_of(index)``: a URL or path, ``URL#bytes=A-B`` for ranges and shards).

    The directory serves only the source it was made for: ``name`` and ``fingerprint`` (a
    dataset version, say) are part of that identity, on top of the URL or, for a dataset
    without a listing, the bytes of a probe of its items. ``check`` (on by default) compares
    the source's listing with the one cached and drops samples rewritten since; turn it off
    only for a source that never changes.

    ``on_error="skip"``: a sample the source fails to deliver (after its retries) is counted
    in ``stats()["skipped"]`` and left out of its batch (``ds[i]`` returns ``None``), instead
    of raising ``SourceError``; a batch whose every sample failed still raises.
    """

    def __init__(self, source: Any, cache_dir: str | os.PathLike[str],
                 capacity: int | float | str, *,
                 transform: Callable[..., Any] | None = None,
                 segment_size: int | str | None = None,
                 staging_bytes: int | str = DEFAULT_STAGING, name: str | None = None,
                 fingerprint: str | None = None, check: bool = True,
                 on_error: str = "raise", **source_options: Any) -> None:
        if transform is not None and not callable(transform):
            raise ConfigError(f"transform={transform!r:.200}: give a function of a sample "
                              "(or None)")
        check_locations(source, cache_dir)
        cache_capacity(capacity, 1)  # a typo is refused before a listing of the source
        self.cache = SampleCache(as_source(source, cache_dir=cache_dir, **source_options),
                                 cache_dir, capacity,
                                 segment_size=segment_size, staging_bytes=staging_bytes,
                                 name=name, fingerprint=fingerprint, check=check,
                                 on_error=on_error)
        self.transform = transform
        # A transform may ask for the sample's index and path (e.g. to derive a label).
        self._transform_extras = tuple(name for name in ("index", "path")
                                       if transform is not None and _accepts(transform, name))

    def __len__(self) -> int:
        return len(self.cache.source)

    def __getitem__(self, key: int | Access) -> Any:
        item = self._serve([key])[0]
        return None if item is SKIPPED else item

    def __getitems__(self, keys: list[int | Access]) -> list[Any]:
        """The items of a batch (what a DataLoader with a batch size asks for), in order;
        samples skipped with ``on_error="skip"`` are left out."""
        items = [item for item in self._serve(keys) if item is not SKIPPED]
        if keys and not items:
            raise SourceError(f"every sample of a batch of {len(keys)} failed to come from "
                              f"{self.cache.source.url} (on_error=\"skip\" skips samples, "
                              "not a source that is unreachable or changed since it was "
                              "opened); see the warnings above")
        return items

    def _serve(self, keys: list[int | Access]) -> list[Any]:
        n = len(self)
        indices: list[int] = []
        keeps: list[bool | None] = []
        for key in keys:
            sample, keep = (key.sample, key.keep) if isinstance(key, Access) else (key, None)
            try:
                if isinstance(sample, bool):  # ds[True] was sample 1
                    raise TypeError
                index = operator.index(sample)  # numpy's integers too
            except TypeError:
                raise TypeError(f"sample {key!r:.100}: give a whole number (or the "
                                "Access items SeedAwareSampler yields)") from None
            if keep is not None:  # numpy's False is not False: it was taken as "keep"
                keep = bool(keep)
            if not 0 <= index < n:
                raise IndexError(f"sample {index} is outside 0..{n - 1}")
            indices.append(index)
            keeps.append(keep)
        items = self.cache.get_many(indices, keeps)
        if self.transform is None:
            return items
        if not self._transform_extras:
            return [item if item is SKIPPED else self.transform(item) for item in items]
        path_of = getattr(self.cache.source, "path_of", None)
        out = []
        for index, item in zip(indices, items, strict=True):
            extras: dict[str, Any] = {"index": index} if "index" in self._transform_extras \
                else {}
            if "path" in self._transform_extras:
                extras["path"] = path_of(index) if path_of is not None else None
            out.append(item if item is SKIPPED else self.transform(item, **extras))
        return out

    def stats(self, since: dict[str, Any] | None = None) -> dict[str, Any]:
        """The node's counts (see ``SampleCache.stats``): all time, or since an earlier
        ``stats()``."""
        return self.cache.stats(since)

    def close(self) -> None:
        """Close the cache (``self.cache.close()``): its stores are sealed, its directory's
        hold is released (another listing may open it) and its staging area is removed if
        no other process uses it. The dataset cannot be read again: make it again."""
        self.cache.close()

    def __enter__(self) -> CachedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (named, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    named = params.get(name)
    if named is not None and named.kind in (inspect.Parameter.KEYWORD_ONLY,
                                            inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
