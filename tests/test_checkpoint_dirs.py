"""Checkpoint directories: a mistyped one is an error, not an empty run."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from lcache import checkpoint as ck
from lcache.cli.main import cli


def test_a_missing_directory_is_an_error_an_empty_one_is_not(tmp_path: Path) -> None:
    ck.save({"a": 1}, tmp_path / "ckpts" / "step-1")
    typo = tmp_path / "ckpst"
    for call in (ck.latest, ck.list_checkpoints):
        with pytest.raises(ck.CheckpointNotFoundError, match=f"no checkpoint directory at {typo}"):
            call(typo)
    with pytest.raises(FileNotFoundError):
        ck.latest(str(typo))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ck.CheckpointNotFoundError, match="not a directory"):
        ck.latest(tmp_path / "a-file")
    (tmp_path / "empty").mkdir()
    assert ck.latest(tmp_path / "empty") is None
    assert ck.list_checkpoints(tmp_path / "empty") == ([], [])
    assert ck.latest(tmp_path / "ckpts") == str(tmp_path / "ckpts" / "step-1")


@pytest.mark.parametrize("command", [["ls"], ["ls", "--json"], ["verify"], ["verify", "--json"]])
def test_cli_on_a_missing_directory_exits_2_with_one_line(
        tmp_path: Path, command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a short path: the CLI's error console wraps at 80 columns
    (tmp_path / "ckpts").mkdir()
    out = CliRunner().invoke(cli, ["ckpt", command[0], "ckpst", *command[1:]])
    assert out.exit_code == 2, out.output
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and "no checkpoint directory at ckpst" in lines[0], out.output
