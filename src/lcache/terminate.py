"""SIGTERM and SIGHUP that unwind: what a command holds (temporary folders, DataLoader
workers, a loopback server) is let go before the process dies of the signal.

By default those signals kill a Python process on the spot, running no ``finally``: `timeout`
or a batch scheduler stopping ``lcache demo`` left its temporary folders, and its DataLoader
workers ran on for a minute, waiting on the server that had died with it.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import threading
import traceback
from types import FrameType, TracebackType
from typing import Any


def let_go(tb: TracebackType | None) -> None:
    """Drop what the unwound frames of ``tb`` still hold, now rather than with the process:
    a DataLoader's workers stop only when its iterator is collected."""
    if tb is not None:
        traceback.clear_frames(tb)
        gc.collect()


class Terminated(BaseException):
    """A SIGTERM or SIGHUP taken inside ``UnwindOnTerminate`` (a BaseException, as
    KeyboardInterrupt is: nothing on the way out takes it for an error to handle)."""


class UnwindOnTerminate:
    """``with UnwindOnTerminate() as term:`` while the block runs, SIGTERM and SIGHUP raise
    ``Terminated`` where their handler is the default; at the block's end the handlers are
    restored and the process is killed by the signal, as it would have been (exit status
    143 for SIGTERM). ``term.hold()`` makes a signal from then on wait for the block's end
    (a clean-up that must not be cut short). Handlers the program set are left alone, and
    so is a block outside the main thread (where Python runs no handler). A child forked
    inside dies of the signal at once."""

    def __init__(self) -> None:
        self.taken: list[int] = []
        self._holding = False
        self._owner = os.getpid()
        self._old: dict[int, Any] = {}  # the handlers replaced

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        if os.getpid() != self._owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not self.taken:
            self.taken.append(signum)
            if not self._holding:
                raise Terminated(signum)

    def hold(self) -> None:
        self._holding = True

    def __enter__(self) -> UnwindOnTerminate:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(sig) is signal.SIG_DFL:
                    self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if self.taken:
            let_go(tb)
            # what a normal exit runs (multiprocessing's temporary folders, the trace's
            # last events), which dying of the signal would skip
            atexit._run_exitfuncs()
        for sig, previous in self._old.items():
            signal.signal(sig, previous)
        # also when the exception was swallowed on its way (raised in a finaliser) or
        # replaced by another: the process goes as the signal said
        if self.taken:
            os.kill(os.getpid(), self.taken[0])
            raise SystemExit(128 + self.taken[0])  # not reached: the default action kills
        return kind is Terminated
