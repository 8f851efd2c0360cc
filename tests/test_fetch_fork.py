"""A process forked from one that fetched (a DataLoader worker) must leave the parent's
pooled connections alone: collecting the inherited filesystem in the child closed them
through the parent's event loop, whose epoll set fork shares, and the parent's next request
on such a connection then waited for an answer it was never woken for."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from lcache.data import FileSource
from lcache.testing.remote import ThrottledServer


@pytest.mark.parametrize("cached", [True, False], ids=["fsspec-cached", "uncached"])
def test_forked_child_leaves_parent_connections_alone(tmp_path: Path, cached: bool) -> None:
    (tmp_path / "d").mkdir()
    blobs = [os.urandom(1000 + i) for i in range(8)]
    for i, blob in enumerate(blobs):
        (tmp_path / "d" / f"{i}.bin").write_bytes(blob)
    with ThrottledServer(str(tmp_path)) as server:
        src = FileSource(server.url + "/d/", timeout=3, retries=0,
                         storage_options={"skip_instance_cache": not cached})
        assert src.fetch_many(range(8)) == blobs  # the parent's pool now holds connections
        pid = os.fork()
        if pid == 0:  # the worker: its first fetch makes its own filesystem
            try:
                ok = src.fetch_many([1, 2]) == blobs[1:3]
                gc.collect()
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # Without the fix: "cannot read samples ...: no answer within 3 s (timeout=)".
        assert src.fetch_many(range(8)) == blobs


def test_forked_child_leaves_fsspec_cached_filesystems_alone(tmp_path: Path) -> None:
    """The same for a filesystem only fsspec's instance cache holds (a child's first fsspec
    call clears that cache): lcache keeps what a child inherits (an at-fork hook)."""
    import fsspec

    (tmp_path / "a.bin").write_bytes(b"a" * 5000)
    with ThrottledServer(str(tmp_path)) as server:
        url = server.url + "/a.bin"
        http = {"protocol": "http", "client_kwargs": {"timeout": _aiohttp_timeout(3)}}
        assert fsspec.filesystem(**http).cat_file(url) == b"a" * 5000  # cached, pooled
        FileSource(server.url + "/", files=[("a.bin", 5000)])  # lcache.data.remote imported
        pid = os.fork()
        if pid == 0:
            try:
                fsspec.filesystem(**http)  # a new process: fsspec drops its cached instances
                gc.collect()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert fsspec.filesystem(**http).cat_file(url) == b"a" * 5000


def _aiohttp_timeout(seconds: float) -> object:
    import aiohttp

    return aiohttp.ClientTimeout(total=seconds)


def test_threads_of_a_forked_child_never_use_the_parents_filesystem(tmp_path: Path) -> None:
    """Threads that fetch for the first time in a forked child (a prefetcher's pool, a
    transform's threads) all get the child's filesystem: a thread that saw the child's pid
    before the filesystem was replaced used the parent's, which fsspec refuses ("This class
    is not fork-safe"). The filesystem is made slowly here so that the threads overlap."""
    import threading
    import time

    import fsspec.core

    from lcache.data.remote import Remote

    remote = Remote("http://127.0.0.1:9/d/", None)
    remote.fs()  # the parent's
    pid = os.fork()
    if pid == 0:
        failed = True
        try:
            made = fsspec.core.url_to_fs

            def slowly(*args: object, **kwargs: object) -> object:
                time.sleep(0.05)
                return made(*args, **kwargs)

            fsspec.core.url_to_fs = slowly  # type: ignore[assignment]
            errors: list[BaseException] = []

            def first_use() -> None:
                try:
                    _ = remote.fs()[0].loop  # raises for a filesystem of another process
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=first_use) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            failed = bool(errors)
        finally:
            os._exit(1 if failed else 0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
