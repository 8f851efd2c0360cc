"""A destination the command cannot write is one line naming the file and why.

Regression: ``report -o``, ``advise --emit``, ``demo --dir`` and ``store-demo --dir`` on a
read-only file system printed a bare strerror and the temp name of the atomic write
(``error: Read-only file system: /ro/x.html.tmp7380``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import assert_one_line_error, mounted_tmpfs, run_lcache, subprocess_env

#: a traced run of a few store reads and writes
TRACED = """
import sys, lcache.trace
from lcache.store import Store
lcache.trace.enable(sys.argv[1])
with Store.open(sys.argv[2], capacity="8MiB", segment_size="256KiB", max_writers=2) as store:
    store.put_many(range(50), [bytes(4000)] * 50)
    store.flush()
    store.drop_page_cache()
    store.get_many(range(50))
lcache.trace.disable()
"""


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A read-only tmpfs (root cannot be kept out of a folder by its mode)."""
    with mounted_tmpfs(tmp_path / "ro", "256m", ",ro") as where:
        yield where


@pytest.mark.parametrize(("args", "target"), [
    (["report", "{trace}", "-o", "{ro}/x.html"], "cannot write {ro}/x.html"),
    (["advise", "{trace}", "--emit", "{ro}/x.py"], "cannot write {ro}/x.py"),
    # a directory lcache makes is refused before any file (lcache.io.dirs.private_dir)
    (["store-demo", "--dir", "{ro}", "--samples", "10"],
     "cannot create the cache directory {ro}/store"),
    (["demo", "--dir", "{ro}", "--samples", "800"], "cannot write {ro}/"),
])
def test_a_read_only_destination_is_named_with_the_reason(tmp_path: Path, read_only: Path,
                                                          args: list[str], target: str) -> None:
    trace = tmp_path / "t.trace.gz"
    subprocess.run([sys.executable, "-c", TRACED, str(trace), str(tmp_path / "s")],
                   check=True, env=subprocess_env(), timeout=120)
    fill = {"trace": str(trace), "ro": str(read_only)}
    out = run_lcache(*[a.format(**fill) for a in args], cwd=tmp_path)
    err = assert_one_line_error(out, f"error: {target.format(**fill)}")
    assert ": read-only file system" in err.lower(), err
    assert ".tmp" not in err
