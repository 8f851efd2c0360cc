"""What a source holds: its objects' paths, sizes and versions, listed concurrently, or
given by the user (``files=``), or reused from the cache directory.

An async filesystem is walked with one listing request per directory, ``concurrency`` in
flight, each with the timeout and retries of ``Remote.attempt``; objects whose listing lacks
a size or a version (HTTP) are asked with a concurrent HEAD each. A progress line shows on a
terminal once a listing takes more than a second.

**A kept listing** (``DIR/source-listing.json``) is reused only when it can be no staler than
a fresh one: by the other ranks of the same launch on this node (children of one launcher
process, e.g. torchrun's agent: they list once, under ``DIR/listing.lock``) that were
already running when it was made, or when the user allows it with ``listing_ttl`` seconds.
A later run from the same parent (a shell with ``LOCAL_RANK`` exported, torchrun's restart of
its workers) started after the listing was made, so it lists again and sees every object
rewritten before it started. A reused listing does not see objects rewritten since
it was made, so the cache's check of rewritten samples (``listing.bin``) cannot either.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from lcache import jsondoc
from lcache.data.remote import Remote, SourceError, climbs, object_version
from lcache.errors import ConfigError, DiskFullError
from lcache.io import atomic_write, close_file, private_dir, read_and_close
from lcache.io.files import open_owned

log = logging.getLogger("lcache")

LISTING_FILE = "source-listing.json"
LISTING_FORMAT = 2  # 1 kept one listing per directory
KEPT_LISTINGS = 16  # listings kept per directory (train, val, ...), the newest
PROGRESS_AFTER_S = 1.0


#: A listing's size of an object the remote would not size (an HTTP HEAD without a length).
#: Not 0: an empty object is one, and one later rewritten with bytes was fetched whole and
#: cached, with no check of its size.
UNKNOWN_SIZE = -1
LISTING_FORMAT = 2  # of a kept listing


@dataclass
class Listing:
    paths: list[str]  # filesystem paths, in sample order
    sizes: npt.NDArray[np.int64]  # UNKNOWN_SIZE where the remote gave none
    versions: list[str]  # object_version of each ("" where unknown)


def listed_size(info: dict[str, Any]) -> int:
    """The size in an fsspec info dict, or ``UNKNOWN_SIZE``."""
    size = info.get("size")
    return UNKNOWN_SIZE if size is None else int(size)


def suffix_filter(suffixes: Sequence[str] | None) -> Callable[[str], bool]:
    """Whether a path ends with one of ``suffixes``, ignoring case (".jpg" keeps "x.JPG")."""
    if suffixes is None or (isinstance(suffixes, (tuple, list)) and not suffixes):
        return lambda p: True
    if isinstance(suffixes, str):
        suffixes = (suffixes,)
    if not isinstance(suffixes, (tuple, list)) or \
            not all(isinstance(s, str) and s for s in suffixes):
        raise ConfigError(f"suffixes={suffixes!r:.200}: give name endings as strings, e.g. "
                          "(\".jpg\", \".png\")")
    ends = tuple(s.lower() for s in suffixes)
    return lambda p: p.lower().endswith(ends)


# ----------------------------------------------------------------------------- progress
class Progress:
    """Counts of something slow (a listing, an indexing), shown on stderr once it takes
    longer than ``PROGRESS_AFTER_S`` (on a terminal, or always with ``show=True``; never with
    ``show=False``) as ``"{what}: 12 files, 3 directories"``."""

    def __init__(self, what: str, show: bool | None) -> None:
        self.what = what
        self.show = sys.stderr.isatty() if show is None else show
        self.start = time.monotonic()
        self.counts: dict[str, int] = {}
        self._bar: Any = None
        self._task: Any = None
        self._lock = threading.Lock()

    def update(self, **counts: int) -> None:
        with self._lock:  # shards are indexed by several threads
            self._update(counts)

    def _update(self, counts: dict[str, int]) -> None:
        for name, n in counts.items():
            self.counts[name] = self.counts.get(name, 0) + n
        if self._bar is None:
            if not self.show or time.monotonic() - self.start < PROGRESS_AFTER_S:
                return
            from rich.console import Console
            from rich.progress import Progress as Bar
            from rich.progress import SpinnerColumn, TextColumn

            self._bar = Bar(SpinnerColumn(), TextColumn("{task.description}"),
                            console=Console(stderr=True, force_terminal=True),
                            transient=True)
            self._task = self._bar.add_task("")
            self._bar.start()
        self._bar.update(self._task, description=self._text())

    def _text(self) -> str:
        return f"{self.what}: " + ", ".join(f"{n} {name}" for name, n in self.counts.items())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            log.info("lcache: %s, %.1f s", self._text(), time.monotonic() - self.start)


# ----------------------------------------------------------------------------- listing
async def _walk(remote: Remote, root: str, progress: Progress) -> dict[str, dict[str, Any]]:
    """Every object under ``root``: one ``_ls`` per directory, concurrently."""
    fs, _ = remote.fs()
    refresh = {"refresh": True} if "refresh" in _params(fs._ls) else {}
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    http = bool({"http", "https"} & set(protocols))  # an HTML page's links, not object names
    sem = asyncio.Semaphore(remote.options.concurrency)
    files: dict[str, dict[str, Any]] = {}
    seen = {root.rstrip("/")}
    left_out: list[str] = []  # object names no sample may have (a key "a/../b" on S3)

    async def visit(folder: str) -> None:
        async with sem:
            entries = await remote.attempt(
                lambda: fs._ls(folder, detail=True, **refresh),
                lambda: f"cannot list {remote.url if folder == root else remote.full_url(folder)}",
                (remote.full_url(folder), 0, 0), "list")
        below = folder.rstrip("/") + "/"
        subdirs = []
        for entry in entries:
            raw = str(entry["name"])
            name = raw.rstrip("/")
            rest = name[len(below):] if name.startswith(below) else ""
            if climbs(rest) or (http and ("?" in rest or "#" in rest)):
                if not http:  # a real key; in an HTML page, a link to the parent
                    left_out.append(raw)
                continue  # "%2e%2e/x" is "../x"; "?C=N;O=D" is the page sorted, not a file
            if entry.get("type") != "directory" and raw.endswith("/"):
                # an object store's "folder" marker (the S3 console makes p/dir/): listed as
                # the file p/dir, which does not exist, it failed every epoch
                if entry.get("size"):
                    left_out.append(raw)
                continue
            if entry.get("type") == "directory":
                # Only below this folder: an HTML listing also links to parents and siblings.
                if name.startswith(below) and name not in seen:
                    seen.add(name)
                    subdirs.append(name)
                elif not http and name in seen and raw.endswith("/"):
                    left_out.append(raw)  # an S3 prefix "d//": its keys "d//x" were lost
            elif name.startswith(below) or name == folder.rstrip("/"):
                files[name] = entry
        progress.update(files=len(entries) - len(subdirs), directories=1)
        await asyncio.gather(*(visit(d) for d in subdirs))

    await visit(root)
    if left_out:
        log.warning("lcache: %d names under %s have a '..' part or end in '/' (an object "
                    "store's key may; a sample's name may not): what they hold is left out, "
                    "e.g. %s", len(left_out), remote.url, sorted(left_out)[0])
    return files


def _params(fn: Any) -> Mapping[str, Any]:
    import inspect

    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def list_objects(remote: Remote, keep: Callable[[str], bool], progress: bool | None = None,
                 avoid: str | None = None) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """fsspec infos of the objects under the remote's URL that ``keep`` accepts, each with a
    size and (where the filesystem has one) a version; and the paths it did not accept.
    A local walk does not enter folder ``avoid`` (the cache directory)."""
    fs, root = remote.fs()
    root = root.rstrip("/")
    bar = Progress(f"listing {remote.url}", progress)
    try:
        if remote.is_async:
            found = remote.run(lambda: _walk(remote, root, bar))
        elif _is_local(fs):
            found = _find_local(remote, root, bar, avoid)
        else:
            try:
                found = fs.find(root, detail=True)
            except Exception as exc:
                raise SourceError(f"cannot list {remote.url}: {type(exc).__name__}: "
                                  f"{exc}") from exc
            bar.update(files=len(found))
        objects = [p for p, info in found.items() if info.get("type") != "directory"]
        infos = {p: found[p] for p in objects if keep(p)}
        # e.g. HTTP listings carry neither sizes nor versions: ask each object (HEAD)
        bare = [p for p, info in infos.items() if not info.get("size") or
                not object_version(info)]
        if bare:
            infos.update(zip(bare, remote.infos(bare), strict=True))
    finally:
        bar.close()
    if not found:
        try:  # find() hides connection errors behind an empty listing; ls() raises them
            fs.ls(root)
        except Exception as exc:
            raise SourceError(f"cannot list {remote.url}: {type(exc).__name__}: "
                              f"{exc}") from exc
    return infos, [p for p in objects if p not in infos]


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _find_local(remote: Remote, root: str, progress: Progress,
                avoid: str | None = None) -> dict[str, dict[str, Any]]:
    """The regular files under local ``root``, following links as torchvision's ImageFolder
    does (``os.walk(followlinks=True)`` in each class folder: a class that is a link to
    another class, or to a folder inside one, has that folder's files too), with the size
    and version of what a link points to (fsspec's find gives the link's own, so a target
    rewritten with the same size went unseen). Each folder at the top is walked on its own,
    in name order, and within it each folder once: one reached again through a link (a
    loop, or links that branch and meet, which would make the walk exponential) is skipped,
    and so are ``root`` itself, ``avoid`` (the cache directory, should a link lead there)
    and the folders in it. Not samples, with one warning: FIFOs, sockets, devices and
    dangling links (reading one would block forever or never end)."""
    found: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    never = _folder_ids(avoid) if avoid else set()
    root = root or "/"
    # (folder, the folders walked in its top-level folder's walk): torchvision walks each
    # class on its own, so one walk's folders must not hide another class's (a link to a
    # class, or into one, made its label and the labels after it differ from torchvision's)
    stack: list[tuple[str, set[tuple[int, int]]]] = [(root, never)]
    while stack:
        folder, walked = stack.pop()
        try:
            st = os.stat(folder)
            if folder == root and not stat.S_ISDIR(st.st_mode):  # the URL names one file
                return {root: _local_info(root, st)} if stat.S_ISREG(st.st_mode) else {}
            names = sorted(os.listdir(folder))
        except OSError as exc:
            raise SourceError(f"cannot list {remote.url}: {type(exc).__name__}: {exc}") from exc
        if folder == root:
            never.add((st.st_dev, st.st_ino))
        below = []
        for name in names:
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError:
                skipped.append(path)
                continue
            if stat.S_ISDIR(st.st_mode):
                ident = (st.st_dev, st.st_ino)
                if ident in walked:
                    skipped.append(path)
                else:
                    own = set(never) if folder == root else walked
                    own.add(ident)
                    below.append((path, own))
            elif stat.S_ISREG(st.st_mode):
                found[path] = _local_info(path, st)
            else:
                skipped.append(path)
        stack.extend(reversed(below))  # popped in name order
        progress.update(files=len(names) - len(below), directories=1)
    if skipped:
        log.warning("lcache: %d entries under %s are not regular files or folders to walk "
                    "(FIFOs, sockets, devices, dangling links, links to a folder walked "
                    "already) and are not samples, e.g. %s", len(skipped), remote.url,
                    sorted(skipped)[0])
    return found


def _folder_ids(path: str) -> set[tuple[int, int]]:
    """``(st_dev, st_ino)`` of folder ``path`` and every folder in it (a cache directory
    holds a few)."""
    ids = set()
    for where, _, _ in os.walk(path):  # not into links; a folder it cannot read: skipped
        with contextlib.suppress(OSError):
            st = os.stat(where)
            ids.add((st.st_dev, st.st_ino))
    return ids


def _local_info(path: str, st: os.stat_result) -> dict[str, Any]:
    """The fields of fsspec's local info that lcache uses, so a listing reads as it did."""
    return {"name": path, "size": st.st_size, "type": "file", "created": st.st_ctime,
            "mtime": st.st_mtime, "ino": st.st_ino}


def given_files(remote: Remote, files: Sequence[str] | Mapping[str, int] |
                Sequence[tuple[str, int]]) -> Listing:
    """The listing of ``files`` (names under the URL, in sample order): with sizes given
    (``{"a.jpg": 1234}`` or ``[("a.jpg", 1234)]``) nothing is asked; names alone are asked
    for their sizes and versions concurrently."""
    if isinstance(files, (str, bytes)) or not isinstance(files, (Mapping, Sequence)):
        raise ConfigError(f"files={files!r:.200}: give a list of names, of (name, size) pairs, "
                          "or a name->size mapping")
    items = list(files.items()) if isinstance(files, Mapping) else list(files)
    if items and all(isinstance(f, str) for f in items):
        paths = [remote.path(str(f)) for f in items]
        infos = remote.infos(paths)
        if _is_local(remote.fs()[0]):
            for p, info in zip(paths, infos, strict=True):
                if info.get("type") != "file":  # info follows links: a regular file is "file"
                    raise SourceError(f"files=: {p} is not a regular file (a directory, a "
                                      "FIFO, a socket or a device), so it is not a sample")
        return Listing(paths, np.array([listed_size(i) for i in infos], np.int64),
                       [object_version(i) for i in infos])
    pairs = []
    for item in items:
        if (not isinstance(item, (tuple, list)) or len(item) != 2
                or not isinstance(item[0], str) or isinstance(item[1], bool)):
            raise ConfigError(f"files= takes names, (name, size) pairs or a name->size "
                              f"mapping, not {item!r}")
        name, size = item
        if not isinstance(size, (int, np.integer)) or not 0 <= size < 1 << 62:
            raise ConfigError(f"files=: the size of {name!r} must be an int in [0, 2**62), "
                              f"not {size!r}")
        pairs.append((remote.path(str(name)), int(size)))
    return Listing([p for p, _ in pairs], np.array([n for _, n in pairs], np.int64),
                   [""] * len(pairs))


# ----------------------------------------------------------------------------- keeping it
def launch_id() -> str | None:
    """The launch this process is a rank of on this node, or None outside a launcher: the
    ranks of one torchrun or srun are children of one process, told apart from any later
    launch by its pid, its start time and the boot."""
    if not any(k in os.environ for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID")):
        return None
    try:
        ppid = os.getppid()
        with open(f"/proc/{ppid}/stat", "rb") as f:
            started = f.read().rsplit(b")", 1)[1].split()[19].decode()
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except (OSError, IndexError):
        return None
    return f"{boot}:{ppid}:{started}"


def started_at() -> float | None:
    """When this process started, in seconds since boot (to the clock tick, 10 ms), or None
    where /proc does not say; comparable with ``since_boot()``."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def since_boot() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@contextmanager
def kept_listing(cache_dir: str | None, key: dict[str, Any], ttl: float
                 ) -> Iterator[tuple[Listing | None, Callable[[Listing], None]]]:
    """``(listing, keep)``: the listing kept in ``cache_dir`` for ``key`` if it may be
    reused (see the module doc), else None; ``keep(listing)`` stores a fresh one. Held
    under ``DIR/listing.lock`` so the ranks of a node list once. One file keeps the
    listings of several keys (a train and a val source sharing a directory each kept theirs
    over the other's, and their ranks listed apart)."""
    if cache_dir is None:
        yield None, lambda listing: None
        return
    cache_dir = private_dir(os.path.abspath(cache_dir), "cache directory")
    path = os.path.join(cache_dir, LISTING_FILE)
    digest = _digest(key)
    launch = launch_id()
    fd = open_owned(os.path.join(cache_dir, "listing.lock"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        kept = _load(path)
        entry = kept.get(digest)
        found = None if entry is None else _listing(entry)
        if found is not None and entry is not None:
            started = started_at() if launch is not None else None
            # Another rank's listing of this launch, made (or taken) while this process ran,
            # both times since boot (the start is known to the clock tick: a 20 ms margin;
            # a start in wall-clock time, a second early, missed listings made in the first
            # second). Not this process's own: made again, a dataset lists again.
            sibling = (launch is not None and entry["launch"] == launch
                       and entry["pid"] != os.getpid()
                       and started is not None and entry["at_boot"] > started + 0.02)
            if not (sibling or 0 <= time.time() - entry["made"] < ttl):
                found = None
            elif not sibling and launch is not None:
                # taken by its age: the siblings take it too, even once it is older than
                # their TTL (one rank listed again after the TTL ran out, and the ranks saw
                # two listings)
                entry.update(launch=launch, at_boot=since_boot(), pid=os.getpid())
                _save(path, kept)

        def keep(listing: Listing) -> None:
            kept[digest] = {"made": time.time(), "launch": launch, "at_boot": since_boot(),
                            "pid": os.getpid(), "paths": listing.paths,
                            "sizes": listing.sizes.tolist(), "versions": listing.versions}
            _save(path, kept)

        yield found, keep
    finally:
        close_file(fd)


def forget_listing(cache_dir: str, key: dict[str, Any]) -> None:
    """Drop the listing kept in ``cache_dir`` for ``key``: an object changed since it was
    made, and until its TTL ran out every open took it again, each fetch of that object
    refused as changed."""
    cache_dir = os.path.abspath(cache_dir)
    fd = open_owned(os.path.join(cache_dir, "listing.lock"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        kept = _load(os.path.join(cache_dir, LISTING_FILE))
        if kept.pop(_digest(key), None) is not None:
            _save(os.path.join(cache_dir, LISTING_FILE), kept)
    finally:
        close_file(fd)


def _digest(key: dict[str, Any]) -> str:
    # Not sort_keys: it sorts the mappings inside too, and files={"b": 1, "a": 1} was given
    # the listing of {"a": 1, "b": 1}: sample 0 served a's bytes for b
    # The format in the digest: a listing kept before UNKNOWN_SIZE had 0 for "not known".
    return xxhash.xxh3_128_hexdigest(json.dumps([LISTING_FORMAT, key], default=str).encode())


def _listing(entry: dict[str, Any]) -> Listing | None:
    """The listing a kept entry holds, or None if it is damaged."""
    paths, sizes, versions = (entry.get(k) for k in ("paths", "sizes", "versions"))
    numbers = all(type(entry.get(k)) in (int, float) for k in ("made", "at_boot", "pid"))
    if not (numbers and isinstance(paths, list) and isinstance(sizes, list)
            and isinstance(versions, list) and len(paths) == len(sizes) == len(versions)
            and isinstance(entry.get("launch"), (str, type(None)))):
        return None
    if not all(isinstance(x, str) for x in (*paths, *versions)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= UNKNOWN_SIZE for n in sizes):
        return None
    return Listing(paths, np.array(sizes, np.int64), versions)


def _save(path: str, kept: dict[str, Any]) -> None:
    """Write the kept listings, the ``KEPT_LISTINGS`` newest. On a full disk they are not
    kept (a warning says so): the listing is in hand, and a full cache disk must not stop
    training."""
    newest = sorted(kept.items(), key=lambda kv: -float(kv[1].get("made", 0))
                    if isinstance(kv[1], dict) else 0.0)[:KEPT_LISTINGS]
    kept.clear()
    kept.update(newest)
    body = {"format": LISTING_FORMAT, "listings": kept}
    try:
        atomic_write(path, json.dumps(body).encode(), io_class="cache-meta")
    except DiskFullError as exc:
        log.warning("lcache: the source's listing is not kept in %s (%s); ranks and runs "
                    "list it again", os.path.dirname(path), exc)


def _load(path: str) -> dict[str, Any]:
    """The kept listings by key digest ({} if none, or damaged: they are listed anew)."""
    try:
        fd = open_owned(path, os.O_RDONLY)
    except FileNotFoundError:
        return {}
    try:
        doc = jsondoc.loads(read_and_close(fd))
    except ValueError:
        return {}
    ok = (isinstance(doc, dict) and doc.get("format") == LISTING_FORMAT
          and isinstance(doc.get("listings"), dict))
    return {k: v for k, v in doc["listings"].items() if isinstance(v, dict)} if ok else {}
