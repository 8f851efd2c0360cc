"""Uploading a finished checkpoint to an fsspec URL (``upload_to``): manifest last, never
over the checkpoint itself or a remote checkpoint, and what cannot be written is named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lcache import checkpoint as ck
from lcache.errors import ConfigError

from .conftest import moto_s3, subprocess_env

torch = pytest.importorskip("torch")


def test_upload_to_fsspec_url(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    handle = ck.async_save({"w": torch.arange(1000)}, tmp_path / "c" / "s",
                           upload_to=f"file://{remote}")
    handle.wait()
    assert handle.uploaded_to == str(remote / "s")
    assert sorted(os.listdir(remote / "s")) == ["manifest.json", "rank00000.data"]
    assert torch.equal(ck.load(remote / "s")["w"], torch.arange(1000))
    # a failing upload is reported by wait(); the local checkpoint stays published
    (tmp_path / "a-file").write_text("")
    handle = ck.async_save({"w": torch.ones(3)}, tmp_path / "c" / "t",
                           upload_to=f"file://{tmp_path}/a-file/sub")
    with pytest.raises(OSError):
        handle.wait()
    assert handle.state is ck.CkptState.PUBLISHED and handle.uploaded_to is None
    assert ck.verify(tmp_path / "c" / "t").ok


def test_an_upload_onto_the_checkpoint_or_into_its_directory_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finding (attack helper 89): upload_to naming the checkpoints' directory (a path or
    a file:// URL) opened each file "wb" over itself: every checkpoint became 0 bytes,
    wait() reported success and latest() returned None. Now refused when the save is called,
    before anything is written, and by upload_checkpoint, however the place is written."""
    root = tmp_path / "ckpts"
    (tmp_path / "alias").symlink_to(root)
    monkeypatch.chdir(tmp_path)
    state = {"w": np.arange(1000, dtype=np.float32)}
    same = (str(root), f"{root}/", f"file://{root}/", f"local://{root}", "ckpts", "./ckpts/",
            f"{tmp_path}/x/../ckpts", str(tmp_path / "alias"), f"file://{tmp_path}/alias/")
    saver = ck.Checkpointer(keep_last=1, upload_to=str(root))
    with pytest.raises(ConfigError, match="step-1, in the checkpoint itself"):
        saver.save(state, root / "step-1")
    for url in same:
        with pytest.raises(ConfigError, match="in the checkpoint itself"):
            ck.save(state, root / "step-1", upload_to=url)
    with pytest.raises(ConfigError, match=f"inside its directory {root}"):
        ck.save(state, root / "step-1", upload_to=root / "step-0")  # retention removes it
    assert not root.exists()  # nothing written
    path = ck.save(state, root / "step-1")
    for url in same:
        with pytest.raises(ConfigError, match="in the checkpoint itself"):
            ck.upload_checkpoint(path, url)
    link = tmp_path / "remote" / "step-1" / "rank00000.data"  # left by someone: into it
    link.parent.mkdir(parents=True)
    link.symlink_to(root / "step-1" / "rank00000.data")
    with pytest.raises(ConfigError, match=r"rank00000\.data, in the checkpoint itself"):
        ck.upload_checkpoint(path, str(tmp_path / "remote"))
    nested = ck.save(state, tmp_path / "step-1" / "c" / "step-1")
    with pytest.raises(ConfigError, match=f"holds its directory {tmp_path}/step-1/c"):
        ck.upload_checkpoint(nested, str(tmp_path))
    assert ck.verify(path).ok and ck.latest(root) == path
    assert ck.load(path)["w"].tobytes() == state["w"].tobytes()
    url = ck.upload_checkpoint(path, f"file://{tmp_path}/elsewhere/")  # beside it is fine
    assert ck.load(url)["w"].tobytes() == state["w"].tobytes()


# Uploads ARGV[1] to ARGV[2], holding still once the first 8 MiB chunk is at the destination
# (it prints "uploading" then, to be killed there)
UPLOADER = """
import sys, time
from lcache import checkpoint as ck
from lcache.io import set_tracer
reads = []
def hold(event):
    if event.io_class == "checkpoint-upload" and event.op == "read":
        reads.append(event)
        if len(reads) == 2:
            print("uploading", flush=True)
            time.sleep(60)
set_tracer(hold)
ck.upload_checkpoint(sys.argv[1], sys.argv[2])
"""


def upload_killed_midway(path: str, url: Path) -> tuple[str, str]:
    """Upload ``path`` to ``url`` in a child process, ``kill -9`` it once its upload is under
    way; its first stdout line ("uploading", or "" when it ended first) and its stderr."""
    proc = subprocess.Popen([sys.executable, "-c", UPLOADER, path, str(url)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env())
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline().strip()
    if line:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(60)
    return line, proc.stderr.read()


def test_an_upload_over_a_remote_checkpoint_is_refused_and_one_cut_short_is_redone(
        tmp_path: Path) -> None:
    """The finding (attack helper 89): a second upload of step-1 (a restarted run, from
    another node) rewrote URL/step-1/rank00000.data in place before the manifest; killed
    there, it left the remote's good copy with its old manifest over 0 bytes of data. A
    remote checkpoint is never overwritten now; what an upload cut short left (no manifest)
    is."""
    remote = tmp_path / "remote"
    first, second = (np.full(6 << 20, v, np.float32) for v in (1.0, 2.0))  # 3 chunks
    ck.save({"w": first}, tmp_path / "a" / "step-1", upload_to=str(remote))
    again = ck.save({"w": second}, tmp_path / "b" / "step-1")
    line, err = upload_killed_midway(again, remote)
    assert ck.verify(remote / "step-1").ok
    assert ck.load(remote / "step-1")["w"].tobytes() == first.tobytes()
    assert line == "" and "CheckpointExistsError" in err and "never overwritten" in err
    # kill -9 in an upload to a new place: no manifest, so not a checkpoint; redone whole
    line, _ = upload_killed_midway(again, tmp_path / "fresh")
    assert line == "uploading" and os.listdir(tmp_path / "fresh" / "step-1") == [
        "rank00000.data"]
    assert ck.list_checkpoints(tmp_path / "fresh") == ([], [])
    url = ck.upload_checkpoint(again, str(tmp_path / "fresh"))
    assert ck.verify(url).ok and ck.load(url)["w"].tobytes() == second.tobytes()


def test_an_upload_over_an_s3_checkpoint_is_refused(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """As above on S3 (a real moto server), where nothing can be renamed in one step: the
    remote copy is left as it was, even when this process listed the prefix before another
    upload wrote its manifest; a prefix without a manifest is written over."""
    import s3fs

    from lcache.io.urls import filesystem_of

    for name, value in (("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "y"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    with moto_s3() as endpoint:
        options = {"endpoint_url": endpoint, "key": "x", "secret": "y"}
        other = s3fs.S3FileSystem(**options, skip_instance_cache=True)  # another uploader
        other.mkdir("bucket")
        saver = ck.Checkpointer(upload_to="s3://bucket/run", storage_options=options)
        handle = saver.async_save({"w": np.ones(1000)}, tmp_path / "a" / "step-1")
        assert handle.wait() and handle.uploaded_to == "s3://bucket/run/step-1"
        before = other.cat("bucket/run/step-1/rank00000.data")
        handle = saver.async_save({"w": np.zeros(1000)}, tmp_path / "b" / "step-1")
        with pytest.raises(ck.CheckpointExistsError, match="named 'step-1'"):
            handle.wait()
        assert handle.state is ck.CkptState.PUBLISHED and handle.uploaded_to is None
        assert other.cat("bucket/run/step-1/rank00000.data") == before
        other.pipe_file("bucket/run/step-2/rank00000.data", b"cut short")
        filesystem_of("s3://bucket/run", options)[0].ls("bucket/run/step-2")  # listed so
        other.pipe_file("bucket/run/step-2/manifest.json", b"{}")
        with pytest.raises(ck.CheckpointExistsError, match="named 'step-2'"):
            saver.save({"w": np.zeros(1000)}, tmp_path / "b" / "step-2")
        other.rm("bucket/run/step-2/manifest.json")
        url = ck.upload_checkpoint(str(tmp_path / "b" / "step-2"), "s3://bucket/run", options)
        for name in ("manifest.json", "rank00000.data"):
            assert other.cat(f"{url}/{name}") == (tmp_path / "b" / "step-2" / name).read_bytes()


def test_an_upload_target_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    saver = ck.Checkpointer(upload_to="http://127.0.0.1:9/bucket")
    with pytest.raises(ConfigError, match=r"cannot upload to http://127\.0\.0\.1:9/bucket"):
        saver.save({"w": torch.zeros(2)}, tmp_path / "s1")
    assert ck.load(tmp_path / "s1")["w"].tolist() == [0.0, 0.0]  # published here anyway
