"""I/O tracing: record every lcache I/O operation (and, with ``lcache trace``, any job's I/O)
as Chrome trace events, one JSON object per line. See docs/trace.md."""

from lcache.trace.recorder import disable, enable, enabled, flush, now_ns, record
from lcache.trace.schema import CLASSES, DATA_OPS, TraceFormatError

__all__ = [
    "CLASSES",
    "DATA_OPS",
    "TraceFormatError",
    "disable",
    "enable",
    "enabled",
    "flush",
    "now_ns",
    "record",
]
