"""The README's Python examples run as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import doc_blocks, run_doc_python

BLOCKS = doc_blocks("README.md")


def test_readme_has_examples() -> None:
    assert BLOCKS, "README.md lost its Python examples"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_doc_python("README.md", code, tmp_path, monkeypatch)
