"""The files of a checkpoint: a symbolic link or anything but a regular file is refused,
never followed or waited on, and the manifest can only name plain files inside the checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lcache import checkpoint as ck
from lcache.checkpoint.manifest import dump_manifest
from lcache.errors import CorruptionError

STATE = {"w": np.arange(5000, dtype=np.float32), "step": 3}


def saved(tmp_path: Path) -> Path:
    return Path(ck.save(STATE, tmp_path / "c" / "s"))


LOADS: dict[str, Callable[[Path], Any]] = {
    "load": ck.load,
    "load_into": lambda p: ck.load(p, like={"w": np.zeros(5000, np.float32), "step": 0},
                                   into=True),
    "upload": lambda p: ck.upload_checkpoint(str(p), f"file://{p.parent.parent}/remote"),
}


def link_to_a_copy_outside(member: Path) -> None:
    """Replace ``member`` by a symlink to a true copy of it outside the checkpoint."""
    outside = member.parent.parent.parent / f"outside-{member.name}"
    shutil.copy(member, outside)
    member.unlink()
    member.symlink_to(outside)


@pytest.mark.parametrize("how", sorted(LOADS))
def test_a_data_file_that_is_a_symlink_is_refused(tmp_path: Path, how: str) -> None:
    """rank00000.data -> a file outside the checkpoint (here a true copy, so only the link
    itself can be the reason for the refusal)."""
    path = saved(tmp_path)
    link_to_a_copy_outside(path / "rank00000.data")
    with pytest.raises(CorruptionError, match=r"rank00000\.data is a symbolic link"):
        LOADS[how](path)
    (problem,) = ck.verify(path).problems
    assert "rank00000.data is a symbolic link" in problem


def test_a_manifest_that_is_a_symlink_is_refused_and_listed_as_damaged(tmp_path: Path) -> None:
    path = saved(tmp_path)
    link_to_a_copy_outside(path / "manifest.json")
    with pytest.raises(CorruptionError, match=r"manifest\.json is a symbolic link"):
        ck.load(path)
    assert ck.list_checkpoints(path.parent) == ([], ["s"])
    assert ck.latest(path.parent) is None
    assert not ck.verify(path).ok


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_data_file_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    """A FIFO is never opened for a blocking read (the load would hang forever)."""
    path = saved(tmp_path)
    data = path / "rank00000.data"
    data.unlink()
    if kind == "fifo":
        os.mkfifo(data)
    else:
        data.mkdir()
    for how in sorted(LOADS):
        with pytest.raises(CorruptionError, match=r"rank00000\.data is not a regular file"):
            LOADS[how](path)
    (problem,) = ck.verify(path).problems
    assert "not a regular file" in problem


@pytest.mark.parametrize("name", ["../s2/rank00000.data", "/etc/passwd", "..", ".", "",
                                  "rank\x00.data", "a/b", "\n", "x" * 300, 7, None])
def test_manifest_file_names_must_be_plain(tmp_path: Path, name: Any) -> None:
    path = saved(tmp_path)
    body = ck.read_manifest(path)
    body["shards"][0]["file"] = name
    (path / "manifest.json").write_bytes(dump_manifest(json.loads(json.dumps(body))))
    with pytest.raises(CorruptionError, match="data file name"):
        ck.load(path)
    assert not ck.verify(path).ok


def test_upload_copies_only_what_the_manifest_names(tmp_path: Path) -> None:
    path = saved(tmp_path)
    (path / "stray").symlink_to("/etc/passwd")
    url = ck.upload_checkpoint(str(path), f"file://{tmp_path}/remote")
    assert sorted(os.listdir(url)) == ["manifest.json", "rank00000.data"]
    assert ck.load(url)["step"] == 3


def test_a_manifest_that_is_a_fifo_is_listed_as_damaged(tmp_path: Path) -> None:
    path = saved(tmp_path)
    (path / "manifest.json").unlink()
    os.mkfifo(path / "manifest.json")
    with pytest.raises(CorruptionError, match=r"manifest\.json is not a regular file"):
        ck.load(path)
    assert ck.list_checkpoints(path.parent) == ([], ["s"])
