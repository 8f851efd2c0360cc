"""docs/advise.md's examples run as written (the Python block and the shell quick start)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env

DOC = Path(__file__).resolve().parent.parent / "docs" / "advise.md"
TEXT = DOC.read_text()
PYTHON = re.findall(r"```python\n(.*?)```", TEXT, flags=re.DOTALL)
BASH = re.findall(r"```bash\n(.*?)```", TEXT, flags=re.DOTALL)


def test_doc_has_examples() -> None:
    assert PYTHON and BASH


@pytest.mark.parametrize("code", PYTHON, ids=[f"python{i}" for i in range(len(PYTHON))])
def test_python_example(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("LCACHE_TRACE", raising=False)
    exec(compile(code, str(DOC), "exec"), {"__name__": "__doc__"})


@pytest.mark.parametrize("script", BASH, ids=[f"bash{i}" for i in range(len(BASH))])
def test_shell_example(script: str, tmp_path: Path) -> None:
    env = {k: v for k, v in subprocess_env().items() if k != "LCACHE_TRACE"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    advice = json.loads((tmp_path / "advice.json").read_text())
    assert advice["fit"]["steps"]["batch_samples"] == 2
    assert "<h2>Advice</h2>" in (tmp_path / "advice.html").read_text()
    rerun = json.loads((tmp_path / "rerun.json").read_text())
    assert rerun["metric"]["train_au_mean_percentage"] > 0
