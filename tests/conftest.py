"""Shared fixtures for the store and I/O tests."""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lcache.store import Store

KIB = 1024
MIB = 1024 * KIB
SEG = 64 * KIB

#: A small store: 64 KiB segments, room for a handful of them.
SMALL = {"segment_size": SEG, "capacity": 16 * SEG, "max_writers": 2, "max_byte_keys": 256}


def subprocess_env() -> dict[str, str]:
    """Environment for child Python processes: this interpreter's lcache, no stray output."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def rewrite_unseen(path: Path, data: bytes, listed: os.stat_result | None = None) -> None:
    """Write ``data`` over ``path`` in place, then set its modification time back (to
    ``listed``'s, default: the one it had): a change its listed version cannot tell at the
    fetch (bit rot, a server whose versions are modification times; ``served`` gives the
    folder over HTTP), so the checks of the bytes themselves must refuse it. A local
    source's next open tells it by the inode change time."""
    st = listed or path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@contextmanager
def served(folder: Path) -> Iterator[str]:
    """The URL of ``folder`` on an HTTP server on loopback (for ``rewrite_unseen``)."""
    from lcache.testing.remote import ThrottledServer

    with ThrottledServer(str(folder.parent)) as server:
        yield f"{server.url}/{folder.name}/"


#: The repository's root: README.md and docs/ live there.
ROOT = Path(__file__).resolve().parents[1]


def doc_blocks(page: str, lang: str = "python") -> list[str]:
    """The ``lang`` code blocks of ``page`` (``README.md``, ``docs/trace.md``...)."""
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / page).read_text(), flags=re.DOTALL)


#: a docs block that checks its own results
CHECKS_ITSELF = re.compile(r"^\s*assert\b", re.MULTILINE)


def run_doc_python(page: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a docs page's Python block as a reader would, with ``tmp_path`` as the working
    directory and the temporary directory, and no trace of the test run's own; returns what
    it printed (also printed here, for ``-s``). A runner checks the block asserts
    (``CHECKS_ITSELF``) or prints the figures the page gives."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("LCACHE_TRACE", raising=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(ROOT / page), "exec"), {"__name__": "__doc__"})
    sys.stdout.write(out.getvalue())
    return out.getvalue()


def run_doc_shell(script: str, tmp_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a docs page's shell block in ``tmp_path`` with this interpreter's ``lcache`` first
    on the PATH; fails the test on a non-zero exit."""
    env = {k: v for k, v in subprocess_env().items() if k != "LCACHE_TRACE"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr
    return run


@pytest.fixture
def python() -> str:
    return sys.executable



def run_as_nobody(imports: str, body: str, arg: str) -> str:
    """Run ``body`` as the user nobody with ``sys.argv[1] = arg``; returns its stdout, stripped.

    ``imports`` run first, as root: nobody cannot read root's Python installation.
    """
    code = (f"import os, sys\n{imports}\n"
            "os.setgroups([])\nos.setgid(65534)\nos.setuid(65534)\n" + body)
    done = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True,
                          timeout=120, env=subprocess_env(), check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()

def bounded_memory() -> None:
    # A failing input must not take the machine (old code grew to 8 GB on some of them).
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def run_lcache(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The real ``lcache`` CLI in a child process, untraced, with at most 4 GiB of memory."""
    env = subprocess_env()
    env.pop("LCACHE_TRACE", None)
    return subprocess.run([sys.executable, "-m", "lcache", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60, preexec_fn=bounded_memory)


def assert_one_line_error(run: subprocess.CompletedProcess[str], *words: str) -> str:
    """Exit status 2 and one line on stderr naming each of ``words``; no traceback."""
    err = run.stderr
    assert "Traceback" not in err + run.stdout, err
    assert run.returncode == 2, (run.returncode, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)
    return err


def signal_when(proc: subprocess.Popen[str], ready: Any, sig: int,
                timeout: float = 60) -> str:
    """Send ``sig`` to ``proc`` once ``ready()`` is true (failing if it ends first or
    ``timeout`` passes), wait for it to end and return its stderr; it is killed if
    anything fails on the way."""
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the moment to signal never came"
            time.sleep(0.005)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        return err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def gloo_env() -> dict[str, str]:
    """The environment of a process that joins a gloo group on loopback, one thread."""
    env = subprocess_env()
    env.update(OMP_NUM_THREADS="1")
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def run_torchrun(args: list[str], timeout: float, nproc: int = 2,
                 hint: str = "") -> tuple[str, str]:
    """``torchrun --standalone --nproc_per_node NPROC ARGS`` with gloo on loopback; returns
    (stdout, stderr), and fails the test on a timeout or a non-zero exit.

    A session of its own, so a timeout kills the ranks too, not only torchrun.
    """
    path = Path(sys.executable).parent / "torchrun"
    if not path.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    env = gloo_env()
    proc = subprocess.Popen([str(path), "--standalone", "--nproc_per_node", str(nproc), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun ran over {timeout} s{hint}:\n{out[-3000:]}\n{err[-8000:]}")
    assert proc.returncode == 0, out[-3000:] + err[-6000:]
    return out, err

@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def open_store(store_dir: Path) -> Iterator[Any]:
    """``open_store(**overrides)`` opens a store in ``store_dir`` (SMALL settings by default);
    every store opened this way is closed at the end of the test."""
    opened: list[Store] = []

    def factory(path: Path | None = None, **overrides: Any) -> Store:
        settings = {**SMALL, **overrides}
        store = Store.open(path or store_dir, **settings)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        if not store._closed:
            store.close()


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A directory under /tmp that the user ``nobody`` can reach (tmp_path's parents are 0700)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    top = Path(tempfile.mkdtemp(prefix="lcache-nobody-"))
    top.chmod(0o755)
    try:
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


@contextmanager
def mounted_tmpfs(where: Path, size: str, options: str = "") -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. "3m") mounted at ``where`` with mount ``options`` (e.g.
    ",ro"; skips the test without root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700{options}", "tmpfs",
                           str(where)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@contextmanager
def moto_s3() -> Iterator[str]:
    """A real moto S3 server on 127.0.0.1 (its endpoint URL), killed on exit; skips the test
    when moto_server is not installed."""
    moto = Path(sys.executable).with_name("moto_server")
    if not moto.exists():
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 60
    try:
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                pytest.fail(f"moto_server exited with {proc.returncode}: {err[-2000:]}")
            try:
                opener.open(url + "/moto-api/", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("moto_server did not answer within 60 s")
                time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait(30)


def fork_while_held(lock: Any, target: Any, *args: Any) -> int | None:
    """Fork a child running ``target(*args)`` while another thread of this process holds
    ``lock``; the child's exit code, or None when it hung (killed after 20 s)."""
    import multiprocessing
    import threading

    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(30)
        proc = multiprocessing.get_context("fork").Process(target=target, args=args)
        proc.start()
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join()
            return None
        return proc.exitcode
    finally:
        release.set()
        holder.join()


def make_files(root: Path, n: int, size: int | None = None) -> list[bytes]:
    """``n`` files ``s0000.bin``... under ``root`` (sorted = numbered), distinct contents (of
    ``size`` bytes, or 700 + 53 i)."""
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        data = random.Random(i).randbytes(size if size is not None else 700 + 53 * i)
        (root / f"s{i:04d}.bin").write_bytes(data)
        out.append(data)
    return out


def local_samples(root: Path, n: int = 20) -> Path:
    """``root`` made with ``n`` random 1,000-byte samples ``000.bin``..."""
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"{i:03d}.bin").write_bytes(os.urandom(1000))
    return root
