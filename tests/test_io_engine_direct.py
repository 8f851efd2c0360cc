"""O_DIRECT through the engine: every byte of unaligned lengths, offsets and memory is written
and read back (DeepSpeed #1070: a 4,000-byte tensor became a 0-byte file), and a filesystem
without O_DIRECT falls back to buffered I/O."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lcache.io import IOEngine, IOEvent, aligned_empty, open_direct, set_tracer
from lcache.testing import pattern_bytes

SIZES = [0, 1, 511, 512, 4000, 4096, 4097, (1 << 20) + 3]


@pytest.fixture
def engine() -> Iterator[IOEngine]:
    e = IOEngine(4)
    yield e
    e.close()


def _direct(path: Path) -> int:
    fd, direct = open_direct(str(path), os.O_RDWR | os.O_CREAT)
    if not direct:
        os.close(fd)
        pytest.skip(f"the filesystem of {path} has no O_DIRECT")
    return fd


@pytest.mark.parametrize("size", SIZES)
def test_a_direct_write_of_any_length_writes_every_byte(tmp_path: Path, engine: IOEngine,
                                                         size: int) -> None:
    data = pattern_bytes(size, size)
    fd = _direct(tmp_path / "t")
    try:
        assert engine.submit_write(fd, 0, data).wait() == size
        assert os.fstat(fd).st_size == size
        assert (tmp_path / "t").read_bytes() == data
        back = bytearray(size)  # memory of no particular alignment
        assert engine.submit_read(fd, 0, memoryview(back)).wait() == size
        assert back == data
        whole = aligned_empty(size + 8192)  # aligned, longer than the file: ends at EOF
        assert engine.submit_read(fd, 0, whole).wait() == size
        assert bytes(whole[:size]) == data
    finally:
        os.close(fd)


def test_unaligned_writes_inside_a_file_touch_only_their_range(tmp_path: Path,
                                                                engine: IOEngine) -> None:
    model = bytearray(pattern_bytes(64 << 10, 1))
    (tmp_path / "f").write_bytes(model)
    fd = _direct(tmp_path / "f")
    try:
        for offset, length in [(1000, 10_000), (4096, 5), (8190, 4), (20_000, 40_000)]:
            piece = pattern_bytes(length, offset)
            assert engine.submit_write(fd, offset, piece).wait() == length
            model[offset : offset + length] = piece
        assert (tmp_path / "f").read_bytes() == model
        view = memoryview(bytes(12_001))[1:]  # aligned length, unaligned memory
        assert engine.submit_write(fd, 8192, view[:8192]).wait() == 8192
        model[8192 : 16384] = view[:8192]
        back = bytearray(3)
        assert engine.submit_read(fd, 8191, memoryview(back)).wait() == 3
        assert back == model[8191:8194]
        assert (tmp_path / "f").read_bytes() == model
    finally:
        os.close(fd)


def test_a_tensor_view_is_moved_by_bytes(tmp_path: Path, engine: IOEngine) -> None:
    values = np.arange(1000, dtype=np.float32)  # 4,000 bytes, as in DeepSpeed #1070
    fd = _direct(tmp_path / "t")
    try:
        assert engine.submit_write(fd, 0, memoryview(values)).wait() == 4000
        back = np.zeros(1000, dtype=np.float32)
        assert engine.submit_read(fd, 0, memoryview(back)).wait() == 4000
        assert np.array_equal(back, values)
    finally:
        os.close(fd)


def test_unaligned_direct_io_is_traced_under_the_callers_descriptor(tmp_path: Path,
                                                                   engine: IOEngine) -> None:
    events: list[IOEvent] = []
    previous = set_tracer(events.append)
    fd = _direct(tmp_path / "t")
    try:
        engine.submit_write(fd, 0, pattern_bytes(8192 + 100, 0), "ckpt").wait()
    finally:
        set_tracer(previous)
        os.close(fd)
    assert [(e.fd, e.offset, e.size, e.result, e.io_class) for e in events] == [
        (fd, 0, 8192, 8192, "ckpt"), (fd, 8192, 100, 100, "ckpt")]


def test_a_read_only_direct_file_stays_read_only(tmp_path: Path, engine: IOEngine) -> None:
    (tmp_path / "r").write_bytes(b"x" * 5000)
    fd, direct = open_direct(str(tmp_path / "r"), os.O_RDONLY)
    try:
        assert direct
        with pytest.raises(OSError):
            engine.submit_write(fd, 0, b"y" * 10).wait()
        assert (tmp_path / "r").read_bytes() == b"x" * 5000
    finally:
        os.close(fd)


@contextmanager
def mounted_ramfs(where: Path) -> Iterator[Path]:
    """A ramfs at ``where``: a real filesystem that refuses O_DIRECT (tmpfs takes it since
    Linux 6.6)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a ramfs needs root and mount")
    where.mkdir(mode=0o700)
    done = subprocess.run(["mount", "-t", "ramfs", "-o", "mode=0700", "ramfs", str(where)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_filesystem_without_o_direct_falls_back_to_buffered(tmp_path: Path,
                                                              engine: IOEngine) -> None:
    with mounted_ramfs(tmp_path / "ramfs") as where:
        fd, direct = open_direct(str(where / "f"), os.O_RDWR | os.O_CREAT)
        try:
            assert not direct
            data = pattern_bytes(4000, 9)
            assert engine.submit_write(fd, 0, data).wait() == 4000
            assert (where / "f").read_bytes() == data
        finally:
            os.close(fd)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 20_000), st.integers(0, 9000), st.booleans()),
                    min_size=1, max_size=12))
def test_direct_io_matches_a_model(tmp_path_factory: pytest.TempPathFactory,
                                   ops: list[tuple[int, int, bool]]) -> None:
    path = tmp_path_factory.mktemp("direct") / "f"
    model = bytearray()
    fd = _direct(path)
    engine = IOEngine(2)
    try:
        for i, (offset, length, write) in enumerate(ops):
            if write:
                piece = pattern_bytes(length, i)
                assert engine.submit_write(fd, offset, piece).wait() == length
                if length:
                    model.extend(bytes(max(0, offset + length - len(model))))
                    model[offset : offset + length] = piece
            else:
                buf = bytearray(length)
                n = engine.submit_read(fd, offset, memoryview(buf)).wait()
                assert bytes(buf[:n]) == bytes(model[offset : offset + length])
        assert path.read_bytes() == model
    finally:
        engine.close()
        os.close(fd)


@pytest.mark.parametrize("direct", [True, False])
def test_submit_writev_writes_the_parts_in_order(tmp_path: Path, engine: IOEngine,
                                                 direct: bool) -> None:
    parts = [b"%05d" % i for i in range(3000)]  # more parts than one pwritev takes
    path = tmp_path / "v"
    fd = _direct(path) if direct else os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert engine.submit_writev(fd, 100, parts).wait() == 15_000
        assert (tmp_path / "v").read_bytes() == bytes(100) + b"".join(parts)
    finally:
        os.close(fd)
