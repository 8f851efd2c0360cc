"""Module-level locks that a forked child finds released.

A thread of the parent may hold such a lock at ``fork()``; the child has no such thread, so
its first wait on the lock would never end. DataLoader workers are forked while lcache's
threads (prefetchers, planners) run.
"""

from __future__ import annotations

import os
import threading


def fork_safe_lock() -> threading.Lock:
    """A ``threading.Lock`` re-initialised (released) in every forked child."""
    lock = threading.Lock()
    os.register_at_fork(after_in_child=lock._at_fork_reinit)  # type: ignore[attr-defined]
    return lock
