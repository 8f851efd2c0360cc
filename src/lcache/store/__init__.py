"""The log-structured segment store (knows nothing of PyTorch)."""

from lcache.errors import ArgumentTypeError
from lcache.store.counters import Counters
from lcache.store.fsck import FsckReport, fsck
from lcache.store.layout import StoreConfig, format_size, parse_size
from lcache.store.policy import EvictionPolicy, make_policy, register_policy
from lcache.store.segment import SegmentState
from lcache.store.store import Store

__all__ = [
    "ArgumentTypeError",
    "Counters",
    "EvictionPolicy",
    "FsckReport",
    "SegmentState",
    "Store",
    "StoreConfig",
    "format_size",
    "fsck",
    "make_policy",
    "parse_size",
    "register_policy",
]
