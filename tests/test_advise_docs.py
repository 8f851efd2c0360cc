"""docs/advise.md's examples run as written (the Python block and the shell quick start)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import CHECKS_ITSELF, doc_blocks, run_doc_python, run_doc_shell

PAGE = "docs/advise.md"
PYTHON = doc_blocks(PAGE)
BASH = doc_blocks(PAGE, "bash")


def test_doc_has_examples() -> None:
    assert PYTHON and BASH


@pytest.mark.parametrize("code", PYTHON, ids=[f"python{i}" for i in range(len(PYTHON))])
def test_python_example(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_doc_python(PAGE, code, tmp_path, monkeypatch)
    assert CHECKS_ITSELF.search(code), "an example that checks nothing: add an assert"


@pytest.mark.parametrize("script", BASH, ids=[f"bash{i}" for i in range(len(BASH))])
def test_shell_example(script: str, tmp_path: Path) -> None:
    run_doc_shell(script, tmp_path, timeout=300)
    advice = json.loads((tmp_path / "advice.json").read_text())
    assert advice["fit"]["steps"]["batch_samples"] == 2
    assert "<h2>Advice</h2>" in (tmp_path / "advice.html").read_text()
    rerun = json.loads((tmp_path / "rerun.json").read_text())
    assert rerun["metric"]["train_au_mean_percentage"] > 0
