"""What the shard formats share: naming the shards (a listing, a list, or a brace pattern as
WebDataset writes them), reading an index file and the heads of shards, and turning
per-shard offset tables into the sample table of a ``RangeSource``."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lcache import jsondoc
from lcache.checks import path_argument
from lcache.data.listing import Listing, kept_listing, list_objects, suffix_filter
from lcache.data.remote import (
    FetchOptions,
    Remote,
    SourceCorruptionError,
    SourceError,
    climbs,
)
from lcache.errors import ConfigError

_BRACES = re.compile(r"\{([0-9]+)\.\.([0-9]+)\}")
MAX_SHARDS = 1_000_000  # names a pattern may expand to


def expand_braces(pattern: str) -> list[str]:
    """``"shard-{000..002}.tar"`` -> the three names, zero-padded as written (WebDataset's
    shard notation); several ranges multiply; a name without braces is itself. The ranges
    are those of the pattern as written (a name made by one range is not expanded again).

    Raises:
        ConfigError: a range counts down, or the pattern names more than ``MAX_SHARDS``.
    """
    literals, ranges = [], []
    at = 0
    for match in _BRACES.finditer(pattern):
        lo, hi = match.group(1), match.group(2)
        if int(hi) < int(lo):
            raise ConfigError(f"shard pattern {pattern!r}: {{{lo}..{hi}}} counts down")
        width = len(lo) if lo.startswith("0") else 0
        literals.append(pattern[at:match.start()])
        ranges.append([f"{i:0{width}d}" for i in range(int(lo), int(hi) + 1)]
                      if int(hi) - int(lo) < MAX_SHARDS else [])
        count = math.prod(len(r) for r in ranges)
        if count > MAX_SHARDS or not ranges[-1]:
            raise ConfigError(f"shard pattern {pattern!r} names more than {MAX_SHARDS:,} "
                              "shards; name them with a listing (leave shards= out) or a list")
        at = match.end()
    tail = pattern[at:]
    return ["".join(part for pair in zip(literals, picks, strict=True) for part in pair) + tail
            for picks in itertools.product(*ranges)]


def make_remote(url: str, storage_options: dict[str, Any] | None,
                fetch_options: dict[str, Any]) -> Remote:
    try:
        options = FetchOptions(**fetch_options)
    except TypeError:
        known = ", ".join(FetchOptions.__dataclass_fields__)
        raise ConfigError(f"unknown source options {sorted(fetch_options)}; a source takes "
                          f"storage_options= and {known}") from None
    # url=None was an AttributeError from rstrip
    return Remote(path_argument(url, "url").rstrip("/"), storage_options, options)


def shard_names(remote: Remote, shards: str | Sequence[str] | None, suffix: str,
                progress: bool | None, cache_dir: str | None = None) -> list[str]:
    """The shards under the URL: as given (names or brace patterns, relative to the URL), or
    every object ending in ``suffix`` (case ignored), sorted; a listing is kept in
    ``cache_dir`` for the other ranks of the launch, as a file source's is (ranks that
    listed apart saw shards added in between, and read an epoch of different lengths)."""
    if shards is not None:
        patterns = [shards] if isinstance(shards, str) else list(shards)
        names = [n for p in patterns for n in expand_braces(p)]
        if not names:
            raise ConfigError(f"shards= names no shards under {remote.url}")
        return names
    key = {"kind": "shards", "url": remote.url, "location": remote.location(),
           "suffix": suffix, "storage_options": remote.storage_options}
    with kept_listing(cache_dir, key, 0.0) as (kept, keep):
        if kept is not None:
            return kept.paths
        infos, others = list_objects(remote, suffix_filter((suffix,)), progress, cache_dir)
        root = remote.path("")
        names = sorted(p[len(root):] if p.startswith(root) else p for p in infos)
        if not names:
            seen = ", ".join(sorted(o.rsplit("/", 1)[-1] for o in others)[:3])
            raise SourceError(f"no {suffix} shards found under {remote.url}"
                              + (f"; it holds {len(others)} other files, e.g. {seen}"
                                 if others else ""))
        keep(Listing(names, np.zeros(len(names), np.int64), [""] * len(names)))
    return names


def read_json(remote: Remote, name: str) -> Any:
    """The JSON document ``name`` under the URL (an index)."""
    data = remote.get_many([(remote.path(name), None, None)],
                           lambda url: f"cannot read the index {url}")[0]
    try:
        return jsondoc.loads(data)
    except ValueError as exc:
        raise SourceCorruptionError(f"{remote.full_url(remote.path(name))} is not a JSON "
                                    f"index: {exc}") from None


def count(value: Any) -> int:
    """A count, size or offset an index gives: an integer >= 0, as JSON writes one, or a
    string of ASCII digits, as a CSV cell holds one (int() would cut 8.7 to 8, take True as
    1 and read "1_0" or Arabic-Indic digits). Raises ValueError."""
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        return int(value)
    if type(value) is not int or value < 0:
        raise ValueError(f"{value!r:.40} is not a whole number >= 0")
    return value


def under_url(name: Any, url: str, where: str) -> str:
    """``name`` (a shard or file an index names) if it lies under the source's URL: a
    relative path without ``..``; an index that names ``../x`` or ``/etc/x`` would have lcache
    read and cache files outside the dataset."""
    if (not isinstance(name, str) or not name or "\0" in name or "://" in name
            or name.startswith("/") or climbs(name)):
        raise SourceCorruptionError(f"{where}: {name!r} is not under {url}")
    return name


def read_offsets(remote: Remote, names: Sequence[str], counts: Sequence[int],
                 sizes: Sequence[int], what: str) -> list[npt.NDArray[np.int64]]:
    """Per shard, the ``count + 1`` sample offsets of the header MDS shards and litdata chunks
    share (``uint32 count, uint32 offsets[count + 1]``, little-endian), read concurrently and
    checked: the count the index gave, offsets that grow, the last within the shard."""
    parts = [(remote.path(n), 0, 4 * (c + 2)) for n, c in zip(names, counts, strict=True)]
    heads = remote.get_many(parts, lambda url: f"cannot read the header of {what} {url}")
    tables = []
    for name, count, size, head in zip(names, counts, sizes, heads, strict=True):
        url = remote.full_url(remote.path(name))
        if len(head) > 4 * (count + 2):
            raise SourceError(f"{url}: {len(head)} bytes came for the {4 * (count + 2)} asked "
                              f"of its {what} header: a server that ignores Range requests?")
        if len(head) != 4 * (count + 2):
            raise SourceCorruptionError(
                f"{url}: {what} header is {len(head)} bytes, not {4 * (count + 2)} for its "
                f"{count} samples: a truncated {what}")
        words = np.frombuffer(head, "<u4").astype(np.int64)
        offsets = words[1:]
        if words[0] != count:
            raise SourceCorruptionError(f"{url}: holds {words[0]} samples, its index says "
                                        f"{count}: the index does not match the {what}")
        if count and offsets[0] < 4 * (count + 2):
            raise SourceCorruptionError(f"{url}: sample 0 starts at byte {offsets[0]}, "
                                        f"inside the {what} header")
        backwards = np.flatnonzero(np.diff(offsets) < 0)
        if len(backwards) or offsets[-1] > size:
            i = int(backwards[0]) if len(backwards) else count - 1
            raise SourceCorruptionError(
                f"{url}: sample {i} of the {what} lies at bytes {offsets[i]}-{offsets[i + 1]}"
                f", before its start or beyond its {size} bytes: a corrupt or truncated {what}")
        # Neither format writes an empty sample (each has a column or a size in it).
        empty = np.flatnonzero(np.diff(offsets) == 0)
        if len(empty):
            i = int(empty[0])
            raise SourceCorruptionError(f"{url}: sample {i} of the {what} is empty (bytes "
                                        f"{offsets[i]}-{offsets[i]}): a corrupt {what}")
        tables.append(offsets)
    return tables


def table(offsets: Sequence[npt.NDArray[np.int64]]) -> tuple[npt.NDArray[np.int32],
                                                             npt.NDArray[np.int64],
                                                             npt.NDArray[np.int64]]:
    """``(file_of, offsets, lengths)`` of every sample, shard after shard."""
    file_of = np.concatenate([np.full(len(o) - 1, i, np.int32) for i, o in enumerate(offsets)])
    starts = np.concatenate([o[:-1] for o in offsets]).astype(np.int64)
    lengths = np.concatenate([np.diff(o) for o in offsets]).astype(np.int64)
    return file_of, starts, lengths


def checked_infos(remote: Remote, names: Sequence[str], expected: Sequence[int] | None,
                  what: str) -> list[dict[str, Any]]:
    """fsspec infos of the shards (concurrent), each the size its index says if it says one."""
    infos = remote.infos([remote.path(n) for n in names])
    if expected is not None:
        for name, info, size in zip(names, infos, expected, strict=True):
            if int(info.get("size") or 0) != size:
                raise SourceCorruptionError(
                    f"{remote.full_url(remote.path(name))}: {info.get('size')} bytes, its "
                    f"index says {size}: a truncated or rewritten {what}")
    return infos



def split_sized(data: bytes | memoryview, fixed: Sequence[int | None], where: str,
                part: tuple[str, str]) -> list[memoryview]:
    """The parts of a record as MDS samples and LitData items lay them out: a little-endian
    u32 size per part whose ``fixed`` size is None, then the parts in order. ``part`` names
    them (singular, plural) in the error a record that does not add up gets."""
    view = memoryview(data)
    nvar = sum(1 for n in fixed if n is None)
    if len(view) < 4 * nvar:
        raise SourceCorruptionError(f"{where}: {len(view)} bytes, shorter than its {nvar} "
                                    f"{part[0]} sizes")
    var = iter(np.frombuffer(view[:4 * nvar], "<u4").tolist())
    pos, parts = 4 * nvar, []
    for size in fixed:
        size = next(var) if size is None else size
        parts.append(view[pos:pos + size])
        pos += size
    if pos != len(view):
        raise SourceCorruptionError(f"{where}: its {part[1]} add up to {pos} bytes, not its "
                                    f"{len(view)}: corrupt bytes")
    return parts
