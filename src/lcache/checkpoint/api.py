"""``save`` and ``async_save``: snapshot on the caller's thread, persist in the background.

Lifecycle of one checkpoint (``CheckpointHandle.state``)::

    SNAPSHOT --> PERSISTING --> PERSISTED --> PUBLISHED
         \\            \\            \\
          +------------+------------+--> FAILED

The background thread writes this rank's shard and publishes. ``PERSISTED`` is visible only in
multi-rank runs: the shard is durable and the thread waits for every rank's vote (``dist``);
rank 0 then publishes and tells the others. ``done()`` is True once the checkpoint is published
(or failed), on every rank, with no call needed on the training thread.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import logging
import os
import shutil
import threading
import time
from typing import Any

import xxhash

from lcache.checkpoint import dirs
from lcache.checkpoint.dist import all_gather, broadcast, rank_and_world, turns, vote_group
from lcache.checkpoint.errors import CheckpointFailedError, ConfigError
from lcache.checkpoint.format import data_file_name
from lcache.checkpoint.manifest import check_manifest_room, check_meta, dump_manifest
from lcache.checkpoint.persist import CHUNK, IO_CLASS, write_data_file
from lcache.checkpoint.snapshot import HostBuffer, Snapshot, take_snapshot
from lcache.checkpoint.upload import check_upload_target, upload_checkpoint
from lcache.checks import flag, path_argument, seconds, whole_number
from lcache.errors import LCacheError
from lcache.forksafe import fork_safe_lock
from lcache.io import aligned_buffer, close_file, open_file, pwrite_full, sync_fd

log = logging.getLogger("lcache.checkpoint")


# Set in a save's background thread: a save from there (a handler of its failure's log
# record) waited for its own thread.
_persisting = threading.local()


class CkptState(enum.Enum):
    """Where a checkpoint is in its life (transitions in the module docstring)."""

    SNAPSHOT = "snapshot"
    PERSISTING = "persisting"
    PERSISTED = "persisted"
    PUBLISHED = "published"
    FAILED = "failed"


class CheckpointHandle:
    """An asynchronous save in progress, returned by ``async_save``.

    Attributes:
        path: where the checkpoint appears when published.
        state: a ``CkptState``.
        stall_s: seconds the caller waited (previous save + snapshot).
        persist_s: seconds the background write took (set when it ends).
        data_bytes: bytes of this rank's data file.
        direct: whether the data file was written with O_DIRECT.
        uploaded_to: the remote URL, when an upload was asked for and finished.
    """

    def __init__(self, path: str, root: str, name: str, rank: int, world: int,
                 options: dict[str, Any], vote: tuple[Any, int] | None = None) -> None:
        self.path, self.root, self.name = path, root, name
        self.rank, self.world = rank, world
        self.state = CkptState.SNAPSHOT
        self.stall_s = 0.0
        self.persist_s = 0.0
        self.data_bytes = 0
        self.direct = False
        self.uploaded_to: str | None = None
        self._options = options
        self._vote_on = vote  # multi-rank: (vote group, turn ticket)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stage: str | None = None
        self._lock_fd: int | None = None
        self._shard: dict[str, Any] | None = None
        self._meta: dict[str, Any] = {}

    # --- public -------------------------------------------------------------------------
    def done(self) -> bool:
        """Whether it is over: published (in multi-rank runs, on every rank) or failed."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the checkpoint is published; returns its path.

        An upload error is raised here too; the local checkpoint is then still published
        (``state`` is ``PUBLISHED``).

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            DiskFullError, OSError, LCacheError: what failed this checkpoint (on this rank,
                or ``CheckpointFailedError`` naming the rank that failed).
        """
        if timeout is not None:
            timeout = seconds(timeout, "timeout")
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint {self.path} still persisting after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.path

    def exception(self) -> BaseException | None:
        """The error that failed this checkpoint, if it is over and failed."""
        return self._error if self.done() else None

    # --- internals ----------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        if self.state is not CkptState.PUBLISHED:  # a failed upload leaves it published
            self.state = CkptState.FAILED

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            # unlocked, not only closed: a child forked during the save shares the open file
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            close_file(self._lock_fd)
            self._lock_fd = None

    def _discard_stage(self) -> None:
        if self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)
        self._release_lock()

    def _persist(self, snap: Snapshot | None) -> None:
        """Background thread: write this rank's shard (``snap`` None: this rank failed
        before, and still votes), publish, then retention and upload on rank 0."""
        _persisting.active = True
        if snap is not None:
            try:
                self._write(snap)
            except BaseException as exc:
                self._fail(exc)
            finally:
                snap.release()
        try:
            if self._vote_on is not None:
                self._vote(*self._vote_on)  # a failed rank votes too: the others learn of it
            elif self._error is None:
                self._publish([self._shard])  # type: ignore[list-item]
            if self.state is CkptState.PUBLISHED and self.rank == 0:
                self._after_publish()
        except BaseException as exc:
            self._fail(exc)
        if self.state is not CkptState.PUBLISHED and self._vote_on is None:
            self._discard_stage()  # multi-rank: rank 0 does it once every rank has voted
        self._release_lock()
        if self._error is not None:
            log.warning("checkpoint %s failed: %s", self.path, self._error)

    def _write(self, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        if snap.cuda_event is not None:
            snap.cuda_event.synchronize()
        fname = data_file_name(self.rank)
        shard = {"rank": self.rank, "file": fname, "data_bytes": snap.nbytes,
                 "tree": snap.tree, "arrays": [r.to_json() for r in snap.arrays]}
        for entry in shard["arrays"]:
            entry["xxh3"] = "0" * 16  # a checksum's length: the size check is exact
        check_manifest_room(shard, self.world, self._meta)  # before any byte is written
        data_path = os.path.join(dirs.staging_dir(self.root, self.name), fname)
        self.direct = write_data_file(
            data_path, snap.data, snap.arrays[: len(snap.arrays) - len(snap.streamed)],
            direct=self._options["direct"], queue_depth=self._options["queue_depth"])
        if snap.streamed:
            _append_streamed(data_path, snap)
        shard["arrays"] = [r.to_json() for r in snap.arrays]  # with their checksums now
        self._shard = shard
        self.data_bytes = snap.nbytes
        self.state = CkptState.PERSISTED
        self.persist_s = time.perf_counter() - t0

    def _publish(self, shards: list[dict[str, Any]]) -> None:
        stage = dirs.staging_dir(self.root, self.name)
        keep = self._options.get("keep_last")
        with dirs.publishing(self.root):
            good, _ = dirs.list_checkpoints(self.root)  # read once for both below
            if keep is not None:  # a saver killed between publishing and its retention left
                # one too many: prune before adding one, so at most keep_last + 1 ever exist
                # (errors are logged by the retention after publishing; they never fail it)
                with contextlib.suppress(LCacheError, OSError):
                    dirs.retain(self.root, keep, good=good)
            body = {"name": self.name, "created_unix": time.time(), "world_size": self.world,
                    "order": dirs.next_order(self.root, good), "meta": self._meta,
                    "shards": shards}
            self.path = dirs.publish(stage, self.root, self.name, dump_manifest(body),
                                     {s["file"] for s in shards})
        self._stage = None
        self.state = CkptState.PUBLISHED

    def _vote(self, group: Any, ticket: int) -> None:
        """Multi-rank: every rank says whether its shard is durable; rank 0 publishes if all
        are (or discards the staging directory) and tells the others."""
        mine = {"ok": self._error is None, "shard": self._shard,
                "error": None if self._error is None else
                f"{type(self._error).__name__}: {self._error}",
                "path": os.path.join(os.path.realpath(self.root), self.name)}
        try:
            with turns.turn(ticket):
                everyone = all_gather(mine, group, self.world)
                failed = [f"rank {r}: {v['error']}" for r, v in enumerate(everyone) if not v["ok"]]
                if not failed:
                    failed = _other_paths(everyone)
                outcome: dict[str, Any] = {"ok": not failed, "error": "; ".join(failed)}
                if self.rank == 0:
                    outcome = self._publish_for_all(everyone, outcome)
                outcome = broadcast(outcome, group, self.rank)
        except Exception as exc:  # a rank died or timed out mid-vote
            # rank 0 may have published before the others could hear it (the telling failed)
            said = "it is published, but not every rank could hear it" \
                if self.state is CkptState.PUBLISHED else \
                "it is published only if rank 0 published it before the vote failed " \
                "(lcache ckpt ls tells)" if self.rank else "nothing was published"
            raise CheckpointFailedError(f"checkpoint {self.path}: the ranks could not vote "
                                        f"on it ({type(exc).__name__}: {exc}); {said}") from exc
        if not outcome["ok"]:
            raise CheckpointFailedError(f"checkpoint {self.path} was not published: "
                                        f"{outcome['error']}")
        self.state = CkptState.PUBLISHED

    def _publish_for_all(self, everyone: list[dict[str, Any]], outcome: dict[str, Any]
                         ) -> dict[str, Any]:
        """Rank 0, once every rank has voted (so none still writes into the stage)."""
        if outcome["ok"]:
            try:
                self._publish([v["shard"] for v in everyone])
                return outcome
            except Exception as exc:
                self._fail(exc)
                outcome = {"ok": False, "error": f"rank 0 publish: {exc}"}
        self._stage = dirs.staging_dir(self.root, self.name)
        self._discard_stage()
        return outcome

    def _after_publish(self) -> None:
        """Rank 0, after publishing: retention, then the optional upload."""
        keep = self._options.get("keep_last")
        if keep is not None:
            try:  # the checkpoint is published: what retention cannot do must not fail it
                with dirs.publishing(self.root):
                    dirs.retain(self.root, keep, spare=self.path)
            except (LCacheError, OSError) as exc:
                log.warning("retention after checkpoint %s did not run: %s", self.path, exc)
        url = self._options.get("upload_to")
        if url:
            self.uploaded_to = upload_checkpoint(self.path, url,
                                                 self._options.get("storage_options"))


def _other_paths(everyone: list[dict[str, Any]]) -> list[str]:
    """Why the ranks' shards are not one checkpoint: each rank saved to its own path (a rank
    that skipped a save votes on its next one beside the others' previous: published, the
    checkpoint mixed two steps, or missed a rank's shard)."""
    paths = [v["path"] for v in everyone]
    if len(set(paths)) == 1:
        return []
    shown = ", ".join(f"rank {r} {p}" for r, p in enumerate(paths) if p != paths[0])
    return [f"the ranks saved to different checkpoints (rank 0 {paths[0]}, {shown}): every "
            "rank must save the same path, in the same order"]


def _append_streamed(path: str, snap: Snapshot) -> None:
    """Copy the streamed arrays (an offloaded optimizer's state) into the data file after the
    host buffer's bytes, one chunk at a time, checksummed on the way: a state of any size
    costs one ``CHUNK`` of memory."""
    buf = aligned_buffer(CHUNK)
    view = memoryview(buf)
    fd = open_file(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, snap.nbytes)
        for ref in snap.streamed:
            digest = xxhash.xxh3_64()
            for off in range(0, ref.nbytes, CHUNK):
                part = view[: min(CHUNK, ref.nbytes - off)]
                ref.source.read_into(off, part)
                digest.update(part)
                pwrite_full(fd, ref.offset + off, [part], IO_CLASS)
            ref.xxh3 = digest.hexdigest()
        sync_fd(fd, data_only=False, io_class=IO_CLASS)
    finally:
        close_file(fd)  # the chunk buffer goes with its last view


class Checkpointer:
    """Saves checkpoints through one reusable host buffer.

    Args:
        keep_last: after each save, keep only this many newest complete checkpoints in the
            checkpoint's parent directory (None keeps all; the newest is never removed).
        upload_to: an fsspec URL; each published checkpoint is copied to ``URL/<name>``,
            never over a checkpoint already there (``wait()`` raises CheckpointExistsError).
        storage_options: fsspec options for ``upload_to``.
        direct: write and read data files with O_DIRECT where the filesystem allows it.
        queue_depth: data-file writes in flight.
    """

    def __init__(self, *, keep_last: int | None = None, upload_to: str | None = None,
                 storage_options: dict[str, Any] | None = None, direct: bool = True,
                 queue_depth: int = 8) -> None:
        self._defaults = _checked({"keep_last": keep_last, "upload_to": upload_to,
                                   "storage_options": storage_options, "direct": direct,
                                   "queue_depth": queue_depth})
        self._buffer = HostBuffer()
        self._pending: CheckpointHandle | None = None
        # Held from waiting for the previous save until this one's thread has started: two
        # threads saving through one checkpointer (the module's save() does) snapshotted into
        # the one host buffer while it was being written, and published each other's bytes.
        self._turn = threading.RLock()
        self._pid = os.getpid()

    def async_save(self, state: Any, path: str | os.PathLike[str], *,
                   meta: dict[str, Any] | None = None, **overrides: Any) -> CheckpointHandle:
        """Snapshot ``state`` now and persist it in the background.

        Waits first for this checkpointer's previous save (its host buffer is reused). The
        state may be changed as soon as this returns.

        Args:
            state: nested dicts/lists/tuples of tensors, numpy arrays and plain values.
            path: the checkpoint directory to create, e.g. ``ckpts/step-000100``.
            meta: a small dict of JSON values stored in the manifest (shown by
                ``lcache ckpt ls``).
            **overrides: any constructor option for this save only.

        Raises:
            UnsupportedValueError: a value in ``state`` cannot be saved, or the state is
                nested too deep. A state whose manifest would be too large fails in
                ``wait()``, before its data is written.
            ConfigError: ``meta`` is not a small dict of JSON values.
            CheckpointExistsError: ``path`` holds a complete checkpoint already.

        In multi-rank runs these are not raised here: the save fails on every rank, and
        ``wait()`` raises the error (``CheckpointFailedError`` on the other ranks).
        """
        t0 = time.perf_counter()
        rank, world = rank_and_world()
        if getattr(_persisting, "active", False):
            raise ConfigError("a checkpoint cannot be saved from a save's own background "
                              "thread (a handler of its log record?): it would wait for "
                              "itself; save from another thread")
        refused: ConfigError | None = None
        try:
            unknown = set(overrides) - set(self._defaults)
            if unknown:
                raise ConfigError(f"unknown checkpoint option(s) {sorted(unknown)}; "
                                  f"known: {sorted(self._defaults)}")
            options = _checked({**self._defaults, **overrides})
            root, name = dirs.split_path(path)
            if options["upload_to"] is not None:  # before anything is written
                check_upload_target(os.path.join(root, name), options["upload_to"],
                                    options["storage_options"])
        except ConfigError as exc:
            if world == 1:
                raise
            # Multi-rank: the other ranks wait for this rank's vote (they waited 30 minutes
            # for a rank that raised here): it votes, failing, and every rank learns why.
            refused, options, root, name = exc, dict(self._defaults), "", f"{path!r:.200}"
        with self._lock():
            return self._start(state, root, name, rank, world, options, meta, t0, refused)

    def _lock(self) -> threading.RLock:
        """The turn lock, made anew in a forked child: another thread of the parent may
        have held it at the fork, and the child's first save waited for ever."""
        if self._pid != os.getpid():
            self._turn, self._pending, self._pid = threading.RLock(), None, os.getpid()
        return self._turn

    def _start(self, state: Any, root: str, name: str, rank: int, world: int,
               options: dict[str, Any], meta: dict[str, Any] | None, t0: float,
               refused: ConfigError | None = None) -> CheckpointHandle:
        self.wait_pending()
        # every rank reaches this point in the same order: the place for the one collective
        # that makes the vote group, and for the ticket that orders the votes
        vote = (vote_group(), turns.ticket()) if world > 1 else None
        handle = CheckpointHandle(os.path.join(root, name), root, name, rank, world, options,
                                  vote)
        self._pending = handle
        snap: Snapshot | None = None
        try:
            if refused is not None:  # a rank of a multi-rank save that cannot take part
                raise refused
            handle._meta = check_meta(meta)  # in the try: a rank with bad meta fails the vote
            dirs.ensure_root(root)
            if rank == 0:
                dirs.clean_leftovers(root, keep=dirs.staging_dir(root, name))
            handle._stage, handle._lock_fd = dirs.open_staging(root, name, alone=world == 1)
            snap = take_snapshot(state, self._buffer)
            handle.state = CkptState.PERSISTING
        except BaseException as exc:
            handle._fail(exc)
            if world == 1:
                handle._discard_stage()
                raise
            # multi-rank: the thread still votes, so the other ranks learn of it
        handle.stall_s = time.perf_counter() - t0
        # not a daemon: a script that ends right after a save still finishes writing it
        handle._thread = threading.Thread(target=handle._persist, args=(snap,),
                                          name=f"lcache-ckpt-{name}")
        handle._thread.start()
        return handle

    def save(self, state: Any, path: str | os.PathLike[str], *,
             meta: dict[str, Any] | None = None, **overrides: Any) -> str:
        """Save ``state`` and return once it is published; returns its path."""
        return self.async_save(state, path, meta=meta, **overrides).wait()

    def wait_pending(self) -> None:
        """Finish the previous save (its errors stay with its handle, and are logged)."""
        with self._lock():
            pending, self._pending = self._pending, None
            if pending is not None and pending._thread is not None:
                pending._thread.join()

    def close(self) -> None:
        """Finish the pending save and free the host buffer."""
        with self._lock():
            self.wait_pending()
            self._buffer.release()


def _checked(options: dict[str, Any]) -> dict[str, Any]:
    """A Checkpointer's options, the numbers checked (a bad one fails here, not in the
    background thread at save time)."""
    if options["keep_last"] is not None:
        options["keep_last"] = whole_number(options["keep_last"],
                                            "keep_last", 1)
    options["direct"] = flag(options["direct"], "direct")  # direct="no" was O_DIRECT
    options["queue_depth"] = whole_number(options["queue_depth"], "queue_depth", 1, 1024)
    # the upload runs after the local checkpoint is published: a bad one must fail now
    if options["upload_to"] is not None:
        options["upload_to"] = path_argument(options["upload_to"], "upload_to")
    if not isinstance(options["storage_options"], (dict, type(None))):
        raise ConfigError(f"storage_options={options['storage_options']!r:.200}: give a dict "
                          "of fsspec options (or None)")
    return options


_default: tuple[int, Checkpointer] | None = None
_default_lock = fork_safe_lock()


def default_checkpointer() -> Checkpointer:
    """The process's checkpointer behind ``save``/``async_save`` (a new one after fork)."""
    global _default
    with _default_lock:
        if _default is None or _default[0] != os.getpid():
            _default = (os.getpid(), Checkpointer())
        return _default[1]


def async_save(state: Any, path: str | os.PathLike[str], *,
               meta: dict[str, Any] | None = None, **options: Any) -> CheckpointHandle:
    """``Checkpointer.async_save`` on the process's default checkpointer."""
    return default_checkpointer().async_save(state, path, meta=meta, **options)


def save(state: Any, path: str | os.PathLike[str], *, meta: dict[str, Any] | None = None,
         **options: Any) -> str:
    """Save ``state`` to the checkpoint directory ``path`` and wait until it is published.

    Options are ``Checkpointer``'s (``keep_last``, ``upload_to``, ``direct``...).
    """
    return default_checkpointer().save(state, path, meta=meta, **options)
