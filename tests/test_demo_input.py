"""``lcache demo``'s input and where it writes, run as the real command.

Regressions: ``--samples 1 --sample-size 1`` was a ValueError traceback, ``--sample-size 1TB``
an 18 TiB MemoryError traceback, a dataset larger than the disk filled it; a capacity below the
minimum said "raise the capacity", which the demo has no option for.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .conftest import assert_one_line_error, mounted_tmpfs, run_lcache


@pytest.mark.parametrize(("args", "words"), [
    (["--samples", "1", "--sample-size", "1"], ["--sample-size 1 bytes", "16 B to 2 MiB"]),
    (["--sample-size", "1TB"], ["--sample-size 1,000,000,000,000 bytes", "16 B to 2 MiB"]),
    (["--samples", "10", "--sample-size", "32"], ["below the minimum", "--samples"]),
    (["--samples", "4000", "--sample-size", "64"], ["below the minimum", "--sample-size"]),
])
def test_a_sample_size_or_count_the_demo_cannot_use_is_one_line(tmp_path: Path,
                                                                args: list[str],
                                                                words: list[str]) -> None:
    out = run_lcache("demo", "--dir", str(tmp_path), *args, cwd=tmp_path)
    err = assert_one_line_error(out, *words)
    assert "raise the capacity" not in err  # the demo has no capacity option
    assert os.listdir(tmp_path) == []


def test_a_dataset_larger_than_the_free_space_is_refused_before_writing(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "fs", "3m") as fs:
        out = run_lcache("demo", "--dir", str(fs), "--samples", "4000", cwd=tmp_path)
        assert_one_line_error(out, "--samples 4000", "free", str(fs))
        assert os.listdir(fs) == []
