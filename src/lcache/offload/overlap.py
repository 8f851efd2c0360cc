"""``step_with_backward``'s machinery: a step whose sub-groups are updated on a thread of
their own as backward finishes their gradients (``OffloadedOptimizer._run_step`` takes them
from a ``Feed``), stopped and undone when backward fails or the caller is interrupted."""

from __future__ import annotations

import functools
import queue
import threading
from typing import TYPE_CHECKING, Any

import torch

from lcache.errors import ConfigError
from lcache.offload.plan import SubGroup

if TYPE_CHECKING:
    from lcache.offload.optimizer import OffloadedOptimizer

LATER = object()  # Feed.get: no sub-group is ready yet, but more will come


class Feed:
    """The sub-groups a step updates, in the order they are ready: all at once for
    ``step()``; for ``step_with_backward``, each as backward finishes its gradients. Then
    None (the end). ``cancel`` stops the step wherever it is, its updates undone."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.cancelled: BaseException | None = None

    def put(self, item: SubGroup | None) -> None:
        self._queue.put(item)

    def cancel(self, why: BaseException) -> None:
        """Stop the step and undo it, even once its last sub-group was given."""
        self.cancelled = why
        self._queue.put(None)  # wakes a get() that waits

    def check(self) -> None:
        if self.cancelled is not None:
            raise self.cancelled

    def get(self, block: bool) -> Any:
        self.check()
        try:
            item = self._queue.get(block)
        except queue.Empty:
            return LATER
        self.check()
        return item


class BackwardFailed(Exception):
    """Stops a step that ran under a backward pass which failed (or was interrupted)."""


class Overlap:
    """A step run while backward computes: a hook on each parameter counts the gradients
    each sub-group still waits for, and hands it to a thread that updates it once none is
    left; ``finish()`` adds those whose parameters got no hook call (a gradient set by hand,
    a parameter unused this pass) and waits for the step to end."""

    def __init__(self, opt: OffloadedOptimizer) -> None:
        self.opt = opt
        self.feed = Feed()
        self.updated = 0  # sub-groups updated so far, by the thread
        self.sent: set[int] = set()
        self.fired: set[int] = set()
        self.waiting = [{pc.param for pc in sg.pieces if opt._params[pc.param].requires_grad}
                        for sg in opt.sub_groups]
        self.error: list[BaseException] = []
        # waited on, not the thread: on Python 3.11 a join cut by Ctrl-C marks a thread that
        # still runs as stopped (its later joins return at once)
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._ready, i))
                      for i, p in enumerate(opt._params) if p.requires_grad]
        self.thread = threading.Thread(target=self._run, name="lcache-offload-step",
                                       daemon=True)
        self.thread.start()

    def _ready(self, param: int, _tensor: Any) -> None:
        self.opt._check_grads([param])  # raised in backward, which then fails
        with self.lock:
            if param in self.fired:  # updated already, from part of its gradient
                raise ConfigError(
                    f"parameter {self.opt.names[param]!r} got its gradient twice in one "
                    "backward pass (reentrant activation checkpointing?), after it was "
                    "updated: step_with_backward cannot run this model; use backward() "
                    "and step() (this step was undone)")
            self.fired.add(param)
            for sg, _ in self.opt._pieces_of[param]:
                left = self.waiting[sg.index]
                left.discard(param)
                if not left and sg.index not in self.sent:
                    self.sent.add(sg.index)
                    self.feed.put(sg)

    def _run(self) -> None:
        try:
            with torch.no_grad():
                self.opt._run_step(self.feed, self)
        except BaseException as exc:
            self.error.append(exc)
        finally:
            self.done.set()

    def remove_hooks(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def abort(self, why: BaseException) -> int:
        """Backward failed, or the caller was interrupted: stop the step, its updates undone,
        before ``why`` is raised; returns how many sub-groups had been updated."""
        self.remove_hooks()
        self.feed.cancel(BackwardFailed(str(why)))
        wait_through_interrupts(self.done)
        return self.updated

    def finish(self) -> None:
        """After backward: hand over the sub-groups left and wait for the step to end. A
        Ctrl-C while it runs undoes it: the thread would have committed it after the call
        raised."""
        opt = self.opt
        self.remove_hooks()
        try:
            opt._check_grads()
            with self.lock:
                for sg in opt.sub_groups:
                    if sg.index not in self.sent and any(
                            opt._params[pc.param].grad is not None for pc in sg.pieces):
                        self.sent.add(sg.index)
                        self.feed.put(sg)
            self.feed.put(None)
            self.done.wait()
        except BaseException as exc:
            self.abort(exc)
            raise
        if self.error:
            raise self.error[0]


def wait_through_interrupts(done: threading.Event) -> None:
    """Wait for ``done``, a Ctrl-C meanwhile raised after: the step's thread is undoing the
    step, which must not go on behind the caller's back."""
    interrupted: BaseException | None = None
    while not done.is_set():
        try:
            done.wait()
        except KeyboardInterrupt as exc:
            interrupted = exc
    if interrupted is not None:
        raise interrupted
