"""What lcache's own threads must not break in the processes they run in.

Module-level locks that a forked child finds released: a thread of the parent may hold such
a lock at ``fork()``; the child has no such thread, so its first wait on the lock would
never end. DataLoader workers are forked while lcache's threads (prefetchers, planners) run.

And signals left to the program's threads (``background_thread``).
"""

from __future__ import annotations

import os
import signal
import threading


def fork_safe_lock() -> threading.Lock:
    """A ``threading.Lock`` re-initialised (released) in every forked child."""
    lock = threading.Lock()
    os.register_at_fork(after_in_child=lock._at_fork_reinit)  # type: ignore[attr-defined]
    return lock


def background_thread() -> None:
    """Called first in lcache's threads that run none of the program's code (the trace's
    flush and /proc sampler): SIGTERM is blocked there, so the kernel gives it to a thread of
    the program's (the I/O engine's threads run ``on_done`` callbacks, and a process started
    from one would inherit the mask). A traced ``multiprocessing`` child handles
    SIGTERM in Python (``lcache.trace.recorder``), which runs handlers in the main thread
    only: one taken by our thread while the main thread waited in a C call (a Pool worker on
    its queue's lock) was never acted on, and ``Pool.terminate()`` waited for ever."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
