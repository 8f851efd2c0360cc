"""Reusable test support for lcache stores (used by lcache's own tests and by backends').

* :mod:`lcache.testing.values`: deterministic, self-describing values (``make_value``,
  ``parse_version``) so a checker can tell "a value written for this key" from wrong bytes.
* :mod:`lcache.testing.faults`: bit flips, truncation, disk usage and record locations.
* :mod:`lcache.testing.crashwriter`: a writer program to ``kill -9``, and the parent-side model
  (``CrashModel``) that says what must and what may be in the store after the kill.
* :mod:`lcache.testing.remote`: ``ThrottledServer``, a loopback HTTP server with a latency per
  request and a bandwidth cap (the slow remote of tests, the demo and the benchmarks).
* :mod:`lcache.testing.strategies` and :mod:`lcache.testing.stateful` (need ``hypothesis``):
  key/value strategies and ``StoreMachine``, a state machine that checks a store against a dict
  through put/get/delete/gc/flush/reopen/crash.

This package imports hypothesis only in the two modules that need it.
"""

from lcache.testing.faults import (
    RecordLocation,
    disk_usage,
    flip_bit,
    largest_segment,
    locate,
    truncate,
    unsealed_segments,
)
from lcache.testing.remote import ThrottledServer
from lcache.testing.values import key_repr, make_value, parse_version, pattern_bytes, value_size

__all__ = [
    "RecordLocation",
    "ThrottledServer",
    "disk_usage",
    "flip_bit",
    "key_repr",
    "largest_segment",
    "locate",
    "make_value",
    "parse_version",
    "pattern_bytes",
    "truncate",
    "unsealed_segments",
    "value_size",
]
