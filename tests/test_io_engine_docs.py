"""docs/io.md's Python examples run as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import CHECKS_ITSELF, doc_blocks, run_doc_python

PYTHON = doc_blocks("docs/io.md")


def test_doc_has_examples() -> None:
    assert PYTHON


@pytest.mark.parametrize("code", PYTHON, ids=[f"python{i}" for i in range(len(PYTHON))])
def test_python_example(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_doc_python("docs/io.md", code, tmp_path, monkeypatch)
    assert CHECKS_ITSELF.search(code), "an example that checks nothing: add an assert"
