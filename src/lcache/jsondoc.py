"""The one JSON parser for documents lcache reads back (its own files, a source's indexes):
whatever is wrong with a document is a ValueError, deep nesting included; and the one writer
of what the CLI prints with ``--json``: strict JSON, which any parser reads."""

from __future__ import annotations

import json
import math
from typing import Any


def loads(raw: str | bytes) -> Any:
    """``json.loads``; text nested deeper than the parser recurses (a 1 MiB file of ``[``)
    is a ValueError like any other malformed document, not a RecursionError."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def dumps(doc: Any, **options: Any) -> str:
    """``json.dumps`` for printing: NaN and infinities, which JSON has no words for (Python
    writes ``NaN``, which strict parsers and JavaScript refuse), become null, as JavaScript's
    ``JSON.stringify`` makes them."""
    return json.dumps(_finite(doc), allow_nan=False, **options)


def _finite(doc: Any) -> Any:
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_finite(v) for v in doc]
    return doc
