"""A plain table of samples as byte ranges: one row per sample, ``path,offset,length``.

CSV with a header row (``path`` or ``url``, ``offset``, ``length``; other columns ignored), or
JSON: a list of ``{"path": ..., "offset": ..., "length": ...}`` objects, or one object of
three lists ``{"paths": [...], "offsets": [...], "lengths": [...]}``. Paths are relative to
the source's URL; a full URL or absolute path under it is accepted and made relative.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

from lcache.data.formats.shards import count, make_remote, read_json, under_url
from lcache.data.remote import SourceCorruptionError
from lcache.data.sources import RangeSource


class TableSource(RangeSource):
    """``TableSource(url, table="samples.csv")``: the samples ``table`` (a name under
    ``url``, ``.csv`` or ``.json``) lists as ranges of the files under ``url``."""

    def __init__(self, url: str, table: str, *,
                 storage_options: dict[str, Any] | None = None, **fetch_options: Any) -> None:
        remote = make_remote(url, storage_options, fetch_options)
        where = remote.full_url(remote.path(table))
        if table.lower().endswith(".json"):
            rows = _json_rows(read_json(remote, table), where)
        else:
            raw = remote.get_many([(remote.path(table), None, None)],
                                  lambda u: f"cannot read the table {u}")[0]
            rows = _csv_rows(raw, where)
        if not rows:
            raise SourceCorruptionError(f"{where}: the table lists no samples")
        prefixes = (url.rstrip("/") + "/", remote.path(""))
        names, offsets, lengths = [], [], []
        for line, (path, offset, length) in rows:
            for prefix in prefixes:
                if path.startswith(prefix):
                    path = path[len(prefix):]
                    break
            names.append(under_url(path, url, f"{where} row {line}"))
            offsets.append(offset)
            lengths.append(length)
        super().__init__(url, names, offsets, lengths, storage_options=storage_options,
                         **fetch_options)


Row = tuple[int, tuple[str, int, int]]


def _row(line: int, path: Any, offset: Any, length: Any, where: str) -> Row:
    try:
        off, n = count(offset), count(length)
        ok = isinstance(path, str) and bool(path) and off >= 0 and n > 0 and off + n < 1 << 62
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(Infinity)
        ok = False
    if not ok:
        raise SourceCorruptionError(f"{where} row {line}: ({path!r}, {offset!r}, {length!r}) "
                                    "is not a path, an offset >= 0 and a length > 0 (that "
                                    "end before 2**62)")
    return line, (path, off, n)


def _csv_rows(raw: bytes, where: str) -> list[Row]:
    try:
        reader = csv.DictReader(io.StringIO(raw.decode("utf-8-sig")))  # a BOM (Excel) too
        fields = reader.fieldnames or []
    except (UnicodeDecodeError, csv.Error) as exc:
        raise SourceCorruptionError(f"{where}: not a CSV table: {exc}") from None
    column = "path" if "path" in fields else "url"
    if column not in fields or "offset" not in fields or "length" not in fields:
        raise SourceCorruptionError(f"{where}: its header {fields} lacks path (or url), "
                                    "offset and length")
    try:
        return [_row(k + 2, r[column], r["offset"], r["length"], where)
                for k, r in enumerate(reader)]
    except csv.Error as exc:
        raise SourceCorruptionError(f"{where}: not a CSV table: {exc}") from None


def _json_rows(doc: Any, where: str) -> list[Row]:
    if isinstance(doc, dict) and all(isinstance(doc.get(k), list)
                                     for k in ("paths", "offsets", "lengths")):
        columns: Sequence[list[Any]] = (doc["paths"], doc["offsets"], doc["lengths"])
        if len({len(c) for c in columns}) != 1:
            raise SourceCorruptionError(f"{where}: paths, offsets and lengths differ in length")
        rows = zip(*columns, strict=True)
        return [_row(k + 1, p, o, n, where) for k, (p, o, n) in enumerate(rows)]
    if isinstance(doc, list) and all(isinstance(r, dict) for r in doc):
        return [_row(k + 1, r.get("path", r.get("url")), r.get("offset"), r.get("length"),
                     where) for k, r in enumerate(doc)]
    raise SourceCorruptionError(f"{where}: neither a list of rows nor paths/offsets/lengths")
