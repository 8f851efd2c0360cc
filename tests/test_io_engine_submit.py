"""The engine's asynchronous contract: submit_read/submit_write, Pending, the in-flight bound,
errors re-raised by wait(), default_engine() and fork."""

from __future__ import annotations

import errno
import os
import queue
import random
import threading
from pathlib import Path

import pytest

from lcache import DiskFullError
from lcache.errors import ConfigError
from lcache.io import (
    Completions,
    EngineError,
    IOEngine,
    Pending,
    default_engine,
    set_tracer,
)
from lcache.io import engine as engine_module
from lcache.testing import pattern_bytes

from .conftest import mounted_tmpfs


def test_many_concurrent_reads_and_writes_move_the_right_bytes(tmp_path: Path) -> None:
    rng = random.Random(7)
    engine = IOEngine(8)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        chunks = [pattern_bytes(rng.randrange(1, 70_000), i) for i in range(200)]
        offsets = [sum(len(c) for c in chunks[:i]) for i in range(len(chunks))]
        order = list(range(len(chunks)))
        rng.shuffle(order)
        writes = [(i, engine.submit_write(fd, offsets[i], chunks[i], "test")) for i in order]
        for i, p in writes:
            assert p.wait() == len(chunks[i]) and p.done()
        assert os.pread(fd, offsets[-1] + len(chunks[-1]) + 1, 0) == b"".join(chunks)
        rng.shuffle(order)
        bufs = {i: bytearray(len(chunks[i])) for i in order}
        reads = [(i, engine.submit_read(fd, offsets[i], memoryview(bufs[i]))) for i in order]
        for i, p in reads:
            assert p.wait() == len(chunks[i])
            assert bufs[i] == chunks[i]
        end = offsets[-1] + len(chunks[-1])
        tail = bytearray(100)
        assert engine.submit_read(fd, end - 10, memoryview(tail)).wait() == 10  # end of file
    finally:
        os.close(fd)
        engine.close()


def test_wait_reraises_the_worker_error(tmp_path: Path) -> None:
    engine = IOEngine(2)
    ro = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT, 0o600)
    d = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        p = engine.submit_write(ro, 0, b"x")
        with pytest.raises(OSError) as info:
            p.wait()
        assert info.value.errno == errno.EBADF and not isinstance(info.value, DiskFullError)
        with pytest.raises(IsADirectoryError):
            engine.submit_read(d, 0, memoryview(bytearray(8))).wait()
        # The failed operations gave their slots back: the engine still runs at full depth.
        good = [engine.submit_read(ro, 0, memoryview(bytearray(1))) for _ in range(10)]
        assert [p.wait() for p in good] == [0] * 10
    finally:
        os.close(ro)
        os.close(d)
        engine.close()


def test_writev_now_is_done_on_return_and_raises_at_wait(tmp_path: Path) -> None:
    engine = IOEngine(2)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    ro = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        p = engine.writev_now(fd, 3, [b"ab", bytearray(b"cd"), memoryview(b"ef")], "test")
        assert p.done() and os.pread(fd, 9, 0) == b"\0\0\0abcdef"  # written when it returned
        assert p.wait() == 6
        failed = engine.writev_now(ro, 0, [b"x"])  # the error waits for wait(), as submit's
        with pytest.raises(OSError) as info:
            failed.wait()
        assert info.value.errno == errno.EBADF
        with mounted_tmpfs(tmp_path / "small", "1m") as where:
            full = os.open(where / "g", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                with pytest.raises(DiskFullError):
                    engine.writev_now(full, 0, [b"z" * (2 << 20)]).wait()
            finally:
                os.close(full)
    finally:
        os.close(fd)
        os.close(ro)
        engine.close()


def test_a_full_device_is_disk_full_error(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "small", "1m") as where:
        engine = IOEngine(4)
        fd = os.open(where / "f", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            pending = [engine.submit_write(fd, i << 18, b"z" * (1 << 18)) for i in range(8)]
            errors = []
            for p in pending:
                try:
                    p.wait()
                except DiskFullError as exc:
                    errors.append(exc)
            assert errors and all(e.errno == errno.ENOSPC for e in errors)
        finally:
            os.close(fd)
            engine.close()


def test_submit_blocks_while_queue_depth_operations_are_in_flight(tmp_path: Path) -> None:
    """A tracer that holds its worker keeps that operation in flight (its slot is freed after
    the tracer returns): with depth 3 the fourth submit must wait until one finishes."""
    path = tmp_path / "f"
    path.write_bytes(b"abcdef")
    fd = os.open(path, os.O_RDONLY)
    gate = threading.Event()
    engine = IOEngine(3)
    submitted: list[Pending] = []

    def submit_four() -> None:
        for i in range(4):
            submitted.append(engine.submit_read(fd, i, memoryview(bytearray(1))))

    previous = set_tracer(lambda event: gate.wait())
    try:
        t = threading.Thread(target=submit_four)
        t.start()
        t.join(0.5)
        assert t.is_alive() and len(submitted) == 3
        assert not any(p.done() for p in submitted)
        with pytest.raises(TimeoutError):
            submitted[0].wait(timeout=0.05)
        gate.set()
        t.join(10)
        assert not t.is_alive()
        assert [p.wait() for p in submitted] == [1, 1, 1, 1]
    finally:
        gate.set()
        set_tracer(previous)
        os.close(fd)
        engine.close()


def test_default_engine_is_one_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_engine() is default_engine()
    assert default_engine().queue_depth == engine_module.DEFAULT_QUEUE_DEPTH
    monkeypatch.setattr(engine_module, "_default", None)
    monkeypatch.setenv("LCACHE_IO_QUEUE_DEPTH", "5")
    assert default_engine().queue_depth == 5
    for bad in ("0", "-1", "many", "2000"):
        monkeypatch.setattr(engine_module, "_default", None)
        monkeypatch.setenv("LCACHE_IO_QUEUE_DEPTH", bad)
        with pytest.raises(ConfigError, match="LCACHE_IO_QUEUE_DEPTH"):
            default_engine()


def test_a_forked_child_uses_the_engine(tmp_path: Path) -> None:
    """The child gets a pool of its own; a handle of the parent's is refused there, not hung."""
    engine = default_engine()
    path = tmp_path / "f"
    data = pattern_bytes(1 << 20, 3)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    gate = threading.Event()
    previous = set_tracer(lambda event: gate.wait())
    held = engine.submit_read(fd, 0, memoryview(bytearray(10)))  # in flight across the fork
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            set_tracer(None)
            try:
                held.wait()
                answer = b"waited"
            except EngineError:
                bufs = [bytearray(4096) for _ in range(64)]
                ps = [engine.submit_read(fd, i * 4096, memoryview(b)) for i, b in enumerate(bufs)]
                ok = [p.wait() for p in ps] == [4096] * 64 and b"".join(bufs) == data[:1 << 18]
                ok = ok and engine.submit_write(fd, 0, b"child").wait() == 5
                answer = b"ok" if ok else b"bad"
            os.write(w, answer)
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    try:
        _, status = os.waitpid(pid, 0)
        answer = os.read(r, 10)
    finally:
        os.close(r)
        gate.set()
        set_tracer(previous)
    try:
        assert os.waitstatus_to_exitcode(status) == 0
        assert answer == b"ok"
        assert held.wait() == 10
        assert os.pread(fd, 5, 0) == b"child"
    finally:
        os.close(fd)



def test_completions_arrive_in_the_order_operations_finish(tmp_path: Path) -> None:
    """The first read is held (by its tracer call) while the two after it finish: they are
    reaped first, not stuck behind it."""
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    fd = os.open(path, os.O_RDONLY)
    gate = threading.Event()
    engine = IOEngine(4)
    done: Completions = queue.SimpleQueue()
    previous = set_tracer(lambda event: event.offset == 0 and gate.wait())
    try:
        bufs = [bytearray(1) for _ in range(3)]
        handles = [engine.submit_read(fd, i, memoryview(bufs[i]), notify=done) for i in range(3)]
        first_two = {done.get(timeout=10), done.get(timeout=10)}
        assert first_two == {handles[1], handles[2]} and not handles[0].done()
        gate.set()
        assert done.get(timeout=10) is handles[0]
        assert [p.wait() for p in handles] == [1, 1, 1] and b"".join(bufs) == b"abc"
    finally:
        gate.set()
        set_tracer(previous)
        os.close(fd)
        engine.close()
