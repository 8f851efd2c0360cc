"""The one JSON parser for documents lcache reads back (its own files, a source's indexes):
whatever is wrong with a document is a ValueError, deep nesting included."""

from __future__ import annotations

import json
from typing import Any


def loads(raw: str | bytes) -> Any:
    """``json.loads``; text nested deeper than the parser recurses (a 1 MiB file of ``[``)
    is a ValueError like any other malformed document, not a RecursionError."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None
