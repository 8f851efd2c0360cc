"""The I/O engine: batched positional reads, full writes, ENOSPC, the tracer hook, fork."""

from __future__ import annotations

import errno
import os
import random
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lcache import ConfigError, DiskFullError
from lcache.io import (
    BufferPool,
    IOEngine,
    IOEvent,
    ReadRequest,
    align_down,
    align_up,
    aligned_buffer,
    get_tracer,
    pread_full,
    pwrite_full,
    set_tracer,
    sync_fd,
)
from lcache.io import engine as engine_module
from lcache.io import tracer as tracer_module
from lcache.testing import pattern_bytes

SIZE = 1 << 20


@pytest.fixture
def data_file(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    data = pattern_bytes(SIZE, 42) + bytes(range(256)) * 7  # not a multiple of anything
    path = tmp_path / "data"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd, data
    finally:
        os.close(fd)


@pytest.fixture
def tracer() -> Iterator[list[IOEvent]]:
    events: list[IOEvent] = []
    previous = set_tracer(events.append)
    try:
        yield events
    finally:
        set_tracer(previous)


@pytest.mark.parametrize("queue_depth", [1, 16])
def test_read_batch_returns_the_right_bytes(data_file: tuple[int, bytes],
                                            queue_depth: int) -> None:
    fd, data = data_file
    rng = random.Random(queue_depth)
    engine = IOEngine(queue_depth)
    try:
        for _ in range(20):
            spans = [(rng.randrange(len(data)), rng.randrange(1, 9000)) for _ in range(200)]
            bufs = [bytearray(length) for _, length in spans]
            requests = [ReadRequest(fd, off, memoryview(b)) for (off, _), b in zip(spans, bufs,
                                                                                  strict=True)]
            got = engine.read_batch(requests, "test")
            for (off, length), buf, n in zip(spans, bufs, got, strict=True):
                expected = data[off : off + length]
                assert n == len(expected)
                assert bytes(buf[:n]) == expected
        assert engine.read_batch([]) == []
    finally:
        engine.close()


def test_short_read_at_end_of_file(data_file: tuple[int, bytes]) -> None:
    fd, data = data_file
    buf = bytearray(1000)
    assert pread_full(fd, len(data) - 100, memoryview(buf)) == 100
    assert bytes(buf[:100]) == data[-100:]
    assert pread_full(fd, len(data) + 5000, memoryview(buf)) == 0
    engine = IOEngine(4)
    try:
        bufs = [bytearray(64) for _ in range(3)]
        got = engine.read_batch([ReadRequest(fd, len(data) - 10, memoryview(bufs[0])),
                                 ReadRequest(fd, 0, memoryview(bufs[1])),
                                 ReadRequest(fd, len(data), memoryview(bufs[2]))])
        assert got == [10, 64, 0]
        assert bytes(bufs[0][:10]) == data[-10:]
        assert bytes(bufs[1]) == data[:64]
    finally:
        engine.close()


def test_read_errors_are_raised(tmp_path: Path) -> None:
    engine = IOEngine(4)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        requests = [ReadRequest(fd, 0, memoryview(bytearray(10))) for _ in range(8)]
        with pytest.raises(IsADirectoryError):
            engine.read_batch(requests)
    finally:
        os.close(fd)
        engine.close()


def test_queue_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="queue_depth"):
        IOEngine(0)


@pytest.mark.parametrize("depth", [0, -1, "x", 2.0, True, 10**6])
def test_engine_refuses_a_queue_depth_that_is_not_one_to_1024(depth: Any) -> None:
    """"x" was a bare TypeError from a comparison, 10**6 started a million threads."""
    with pytest.raises(ConfigError, match=r"queue_depth=.*: give a whole number from 1 to 1,024"):
        IOEngine(depth)


@pytest.mark.parametrize("depth", [0, -1, "x", 1.5])
def test_read_batch_refuses_a_depth_below_one(data_file: tuple[int, bytes], depth: Any) -> None:
    """depth=-1 asked a negative number of workers and then waited for them for ever (a
    Store opened with queue_depth=-1 and direct_io hung in get_many). Run in a thread, so
    that the old hang fails the test instead of stopping the run."""
    import threading

    fd, _ = data_file
    engine = IOEngine(4)
    outcome: list[BaseException | list[int]] = []

    def read() -> None:
        try:
            outcome.append(engine.read_batch(
                [ReadRequest(fd, 0, memoryview(bytearray(10))) for _ in range(3)], depth=depth))
        except BaseException as exc:
            outcome.append(exc)

    try:
        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        thread.join(10)
        assert outcome, f"read_batch(depth={depth!r}) hung"
        assert isinstance(outcome[0], ConfigError), outcome[0]
        assert f"depth={depth!r}: give a whole number of at least 1" in str(outcome[0])
        # a depth of 1 (the caller alone) still reads the batch
        assert engine.read_batch([ReadRequest(fd, 0, memoryview(bytearray(10)))] * 3,
                                 depth=1) == [10, 10, 10]
    finally:
        engine.close()


def test_pwrite_full_writes_everything(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        parts = [b"head", bytearray(b"middle"), memoryview(b"-tail-")]
        assert pwrite_full(fd, 10, parts) == 16
        assert os.pread(fd, 100, 0) == b"\0" * 10 + b"headmiddle-tail-"
        sync_fd(fd)
        sync_fd(fd, data_only=False)
    finally:
        os.close(fd)


def test_pwrite_full_with_more_buffers_than_iov_max(tmp_path: Path) -> None:
    """Regression: put_many of many small records hands pwritev one buffer per record part;
    more than IOV_MAX (1024) buffers made pwritev fail with EINVAL."""
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        parts = [b"%05d" % i for i in range(5000)]
        assert pwrite_full(fd, 0, parts) == 25000
        assert os.pread(fd, 30000, 0) == b"".join(parts)
    finally:
        os.close(fd)


def test_pwrite_full_finishes_a_short_write(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev

    def short(fd: int, bufs: list[Any], offset: int) -> int:
        first = bytes(bufs[0])[:3]  # the kernel wrote only 3 bytes
        return real(fd, [first], offset)

    monkeypatch.setattr(os, "pwritev", short)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert pwrite_full(fd, 0, [b"abcdef", b"ghij"]) == 10
        assert os.pread(fd, 100, 0) == b"abcdefghij"
    finally:
        os.close(fd)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_pwrite_full_maps_no_space_to_disk_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                tracer: list[IOEvent], code: int) -> None:
    def full(*args: Any) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pwritev", full)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(DiskFullError) as info:
            pwrite_full(fd, 4096, [b"x" * 100], "cache-write")
        assert isinstance(info.value, OSError)
        assert info.value.errno == errno.ENOSPC
        assert "no space left" in str(info.value) and "100 bytes" in str(info.value)
        assert isinstance(info.value.__cause__, OSError)
    finally:
        os.close(fd)
    assert [(e.op, e.size, e.result, e.io_class) for e in tracer] == [
        ("write", 100, -code, "cache-write")]


def test_other_write_errors_pass_through(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as info:
            pwrite_full(fd, 0, [b"x"])
        assert not isinstance(info.value, DiskFullError)
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)


def test_tracer_receives_events(data_file: tuple[int, bytes], tmp_path: Path,
                                tracer: list[IOEvent]) -> None:
    fd, _ = data_file
    assert get_tracer() is not None
    engine = IOEngine(4)
    try:
        bufs = [bytearray(100) for _ in range(6)]
        engine.read_batch([ReadRequest(fd, i * 1000, memoryview(b)) for i, b in enumerate(bufs)],
                          "cache-read")
    finally:
        engine.close()
    out = os.open(tmp_path / "w", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        pwrite_full(out, 0, [b"12345"], "cache-write")
        sync_fd(out, io_class="cache-write")
    finally:
        os.close(out)
    reads = [e for e in tracer if e.op == "read"]
    assert sorted(e.offset for e in reads) == [i * 1000 for i in range(6)]
    assert all(e.size == 100 and e.result == 100 and e.fd == fd for e in reads)
    assert all(e.io_class == "cache-read" and e.duration_ns >= 0 for e in reads)
    assert [(e.op, e.size, e.result, e.offset) for e in tracer if e.op != "read"] == [
        ("write", 5, 5, 0), ("fdatasync", 0, 0, 0)]


def test_untraced_io_does_not_even_read_the_clock(data_file: tuple[int, bytes],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With no tracer installed an operation pays one ``is None`` test: no clock, no event."""
    fd, _ = data_file
    calls = []

    def clock() -> int:
        calls.append(1)
        return 0

    fake_time = types.SimpleNamespace(perf_counter_ns=clock)
    monkeypatch.setattr(engine_module, "time", fake_time)
    monkeypatch.setattr(tracer_module, "time", fake_time)
    previous = set_tracer(None)
    try:
        engine = IOEngine(4)
        bufs = [bytearray(10) for _ in range(8)]
        engine.read_batch([ReadRequest(fd, i, memoryview(b)) for i, b in enumerate(bufs)])
        engine.close()
        pread_full(fd, 0, memoryview(bytearray(10)))
        assert calls == []
        seen: list[IOEvent] = []
        set_tracer(seen.append)
        pread_full(fd, 0, memoryview(bytearray(10)))
        assert len(calls) == 2 and len(seen) == 1  # start and end of the traced read
    finally:
        set_tracer(previous)


def test_read_batch_after_fork(data_file: tuple[int, bytes]) -> None:
    fd, data = data_file
    engine = IOEngine(8)
    bufs = [bytearray(500) for _ in range(16)]
    engine.read_batch([ReadRequest(fd, i * 500, memoryview(b)) for i, b in enumerate(bufs)])
    assert engine._threads, "the parent's pool should be running before the fork"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the parent's threads do not exist here
        status = 1
        try:
            child_bufs = [bytearray(700) for _ in range(32)]
            got = engine.read_batch(
                [ReadRequest(fd, i * 700, memoryview(b)) for i, b in enumerate(child_bufs)])
            ok = got == [700] * 32 and all(
                bytes(b) == data[i * 700 : (i + 1) * 700] for i, b in enumerate(child_bufs))
            ok = ok and engine._pid == os.getpid() and len(engine._threads) == 8
            os.write(w, b"ok" if ok else b"bad")
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    try:
        _, status = os.waitpid(pid, 0)
        answer = os.read(r, 10)
    finally:
        os.close(r)
    assert os.waitstatus_to_exitcode(status) == 0
    assert answer == b"ok"
    # The parent's pool is untouched.
    assert engine.read_batch([ReadRequest(fd, 0, memoryview(bufs[0]))] * 2) == [500, 500]
    engine.close()


def test_aligned_buffers_and_pool() -> None:
    assert align_up(1, 4096) == 4096 and align_up(4096, 4096) == 4096
    assert align_down(4097, 4096) == 4096
    buf = aligned_buffer(5000)
    assert len(buf) == 8192 and len(buf) % 4096 == 0
    pool = BufferPool(max_cached=1)
    a = pool.take(10_000)
    assert len(a) >= 10_000
    pool.give(a)
    assert pool.take(100) is a  # reused
    b, c = pool.take(10), pool.take(10)
    pool.give(b)
    pool.give(c)  # beyond max_cached: released
    assert c.closed
    assert len(aligned_buffer(0)) == 4096  # an empty request still gets a page


@pytest.mark.parametrize("nbytes", [-1, -4096, 10**30, 1.5, "4096", None])
def test_aligned_buffer_refuses_sizes_that_are_not_sizes(nbytes: Any) -> None:
    """-1 was given a page as if 0, and 10**30 was a bare OverflowError."""
    with pytest.raises(ConfigError, match=r"nbytes=.*: give a whole number from 0 to"):
        aligned_buffer(nbytes)
    with pytest.raises(ConfigError, match="nbytes"):
        BufferPool().take(nbytes)


def _huge_kib_of(buf: Any) -> int:
    """AnonHugePages (KiB) of the mapping that holds ``buf``, from /proc/self/smaps."""
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    inside = False
    # paths as the kernel gives them: another test's file may be named in bytes not UTF-8
    for line in Path("/proc/self/smaps").read_bytes().decode("latin-1").splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError("the buffer's mapping is not in /proc/self/smaps")


def test_large_buffers_get_huge_pages_where_the_kernel_gives_them() -> None:
    """O_DIRECT pins every page of a buffer per transfer: 8 MiB reads ran 2-2.7x faster into
    huge pages here. A shared anonymous mapping (shmem) never gets them, so this fails if
    the buffer is mapped shared or not advised."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this kernel")
    buf = aligned_buffer(5 << 20)
    assert len(buf) == 6 << 20  # a whole number of huge pages
    buf[:] = b"\x01" * len(buf)  # fault every page in
    assert _huge_kib_of(buf) >= 2048
    small = aligned_buffer(100_000)
    assert len(small) == 102_400
