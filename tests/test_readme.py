"""The README's Python examples run as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import CHECKS_ITSELF, doc_blocks, run_doc_python

BLOCKS = doc_blocks("README.md")


def test_readme_has_examples() -> None:
    assert BLOCKS, "README.md lost its Python examples"


#: what blocks print, as the README gives it (in a comment beside the line, or its tables)
PRINTS = {0: ["epoch 0: hit ratio 0.00", "epoch 1: hit ratio 0.59"],
          3: ["112.4 GB (104.7 GiB) per checkpoint"], 4: [": MET"]}


@pytest.mark.parametrize("i", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(i: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    printed = run_doc_python("README.md", BLOCKS[i], tmp_path, monkeypatch)
    assert i in PRINTS or CHECKS_ITSELF.search(BLOCKS[i]), "an example that checks nothing"
    assert all(line in printed for line in PRINTS.get(i, [])), (PRINTS[i], printed)
