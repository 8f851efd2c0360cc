"""Two ranks under torchrun (gloo): each writes its shard, rank 0 publishes after both have
persisted, a failure on one rank fails the checkpoint on both, and loads need the same world
size (or an explicit rank)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lcache import checkpoint as ck
from lcache.errors import ConfigError

from .conftest import run_torchrun

torch = pytest.importorskip("torch")
SCRIPT = str(Path(__file__).with_name("_ckpt_torchrun.py"))
TIMEOUT_S = 120


@pytest.mark.slow
def test_two_ranks_save_and_load(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    run_torchrun([SCRIPT, str(root)], TIMEOUT_S)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rep in reports:
        assert rep["world"] == 2
        assert rep["first_done"] and rep["load1"] and rep["load2"] and rep["load4"], rep
        assert rep["listed_after_third"] == ["step-1", "step-2"], rep
        assert rep["leftovers_after_third"] == [], rep
        assert rep["listed_after_fourth"] == ["step-2", "step-4"], rep  # keep_last=2
    assert reports[1]["third"].startswith("UnsupportedValueError"), reports[1]
    assert reports[0]["third"].startswith("CheckpointFailedError"), reports[0]
    assert "rank 1" in reports[0]["third"] and "extra" in reports[0]["third"]

    body = ck.read_manifest(root / "step-4")
    assert body["world_size"] == 2 and [s["rank"] for s in body["shards"]] == [0, 1]
    assert sorted(os.listdir(root / "step-4")) == ["manifest.json", "rank00000.data",
                                                   "rank00001.data"]
    assert ck.verify(root / "step-4").ok
    with pytest.raises(ConfigError, match="saved by 2 ranks"):
        ck.load(root / "step-4")
    one = ck.load(root / "step-4", rank=1)
    assert one["rank"] == 1 and one["model"]["w"].shape == (1001,)
    assert torch.equal(one["model"]["w"], torch.full((1001,), 41.0))
