"""What the store's mixins (``space.Space``, ``reading.Reader``) use of ``Store``, declared once
for both and provided by ``Store``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lcache.io import SyncPolicy
    from lcache.store.counters import Counters
    from lcache.store.deletes import DeleteJournal
    from lcache.store.hashindex import HashIndex
    from lcache.store.index import IntIndex
    from lcache.store.layout import MetaPage
    from lcache.store.policy import EvictionPolicy


class StoreParts:
    root: str
    sync: SyncPolicy
    policy: EvictionPolicy
    counters: Counters
    _meta: MetaPage
    _fds: dict[int, int]

    def _check_process(self) -> None:
        raise NotImplementedError

    def _ints(self) -> IntIndex:
        raise NotImplementedError

    def _hashes(self) -> HashIndex:
        raise NotImplementedError

    def _journal(self) -> DeleteJournal:
        raise NotImplementedError
