"""What a cache directory caches, so it never serves one dataset's bytes for another's.

``DIR/cache.json`` describes the source: its kind and URL, the user's ``name`` and
``fingerprint``, and, for a source without a listing (a map-style dataset), a digest of the
full bytes of a fixed pseudo-random probe of its items. Opening the directory for a source
that differs in any of these is refused. ``DIR/listing.bin`` holds one fingerprint per sample
of a source with a listing (path, size, ETag or modification time): samples whose
fingerprint changed since they were cached are dropped when the cache is opened, and the
log says which; with ``check=False`` (versions trusted) samples whose index now names another
object or range still are.

Every open handle holds ``DIR/users.lock`` shared, and cached samples change meaning only
under an exclusive hold of it: a handle opened for a listing in which samples changed
(another split with ``files=``, a file added in the middle) is refused while one for the old
listing is open anywhere, since that one would go on caching its own samples under the same
numbers. Samples appended at the end are not refused: no open handle asks for them.
"""

from __future__ import annotations

import fcntl
import inspect
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from lcache import jsondoc
from lcache.errors import ConfigError
from lcache.io import atomic_write, close_file
from lcache.io.files import open_owned

log = logging.getLogger("lcache")

FORMAT = 2  # format 1 (lcache 0.1) identified a dataset by its length and a size estimate
PROBES = 32  # items whose full bytes identify a dataset without a listing
REPEATS = 4  # of them read twice: a dataset with random items is refused
COMPARED = ("kind", "source", "location", "name", "fingerprint", "content")


def probe_indices(n: int) -> list[int]:
    """``PROBES`` items spread over ``0..n-1``: one at a pseudo-random place in each of
    ``PROBES`` equal strata. A function of ``n`` alone, the same in every version (a hash, not
    a random generator whose stream may change)."""
    k = min(n, PROBES)
    picks = []
    for j in range(k):
        lo, hi = j * n // k, (j + 1) * n // k
        picks.append(lo + xxhash.xxh3_64_intdigest(f"lcache-probe:{n}:{j}".encode()) % (hi - lo))
    return picks


def probe_contents(source: Any) -> tuple[str, list[int]]:
    """A digest of the full bytes of the items ``probe_indices`` picks, and their sizes.

    Two opens of one dataset probe the same items. Raises ConfigError if an item differs
    between two reads.
    """
    digest = xxhash.xxh3_128()
    sizes = []
    first: dict[int, bytes] = {}
    for i in probe_indices(len(source)):
        data = source.fetch(i)
        digest.update(i.to_bytes(8, "little") + len(data).to_bytes(8, "little"))
        digest.update(data)
        sizes.append(len(data))
        if len(first) < REPEATS:
            first[i] = data
    for i, data in first.items():
        if source.fetch(i) != data:
            raise ConfigError(
                f"{source.url}: item {i} differs between two reads, so its items are random "
                "(augmentations?) and caching them would replay one draw forever; cache the "
                "deterministic part and apply random transforms in CachedDataset(transform=...), "
                "which runs on every read")
    return digest.hexdigest(), sizes


@dataclass
class Identity:
    """What a source is, as far as a cache directory is concerned."""

    doc: dict[str, Any]
    listing: npt.NDArray[np.uint64] | None  # per-sample fingerprints, if it has a listing


def identify(source: Any, name: str | None, fingerprint: str | None) -> Identity:
    doc: dict[str, Any] = {"kind": type(source).__name__, "source": source.url,
                           "samples": len(source), "name": name, "fingerprint": fingerprint}
    if getattr(source, "location", ""):  # an endpoint: absent from caches made without one
        doc["location"] = source.location
    listing = source.fingerprints() if hasattr(source, "fingerprints") else None
    scheme = getattr(source, "fingerprint_scheme", None)
    if scheme is not None:  # absent from caches made before the scheme changed
        doc["fingerprints"] = scheme
    if listing is None:
        content = getattr(source, "content", None)
        doc["content"] = content if isinstance(content, str) else probe_contents(source)[0]
        return Identity(doc, listing)
    # What each index names, versions aside: compared even with check=False. A source
    # whose fingerprints cannot leave versions out gives them all: any change is compared.
    takes = "versions" in inspect.signature(source.fingerprints).parameters
    layout = source.fingerprints(versions=False) if takes else listing
    doc["layout"] = _digest(np.asarray(layout, "<u8").tobytes())
    if not getattr(source, "versioned", lambda: True)() and fingerprint is None:
        # With a fingerprint the user names the version; without, say what is at stake.
        log.warning("lcache: %s gives no version finer than a whole second, or none (an "
                    "HTTP server with Last-Modified alone, nginx's default ETags, one with "
                    "neither, or files= with sizes): an object rewritten with the same size "
                    "(with any size, where no size is given either) cannot be told from the "
                    "cached one; pass fingerprint= (a dataset version) to be safe",
                    source.url)
    return Identity(doc, listing)


def _alone(users: int) -> bool:
    """Whether no other handle holds ``DIR/users.lock`` (left held exclusive if so)."""
    try:
        fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _describe(doc: dict[str, Any]) -> str:
    extra = "".join(f", {k} {doc[k]!r}" for k in ("location", "name", "fingerprint")
                    if doc.get(k))
    return f"{doc.get('kind')} {doc.get('source')!r} ({doc.get('samples')} samples{extra})"


def read_cache_json(cache_dir: str) -> bytes | None:
    """The bytes of ``DIR/cache.json`` (at most 1 MiB), or None if there is none: the one
    place that reads it (opening a cache, ``lcache stats``).

    Opened without blocking (``O_NONBLOCK``) and checked to be a regular file, so a FIFO or
    a device under its name is an error rather than a hang or an endless read.

    Raises:
        ConfigError: ``cache.json`` is not a regular file (a link, a FIFO, a device...).
    """
    try:
        fd = open_owned(os.path.join(cache_dir, "cache.json"), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, 1 << 20)
    finally:
        close_file(fd)


@dataclass
class Opened:
    """The outcome of checking a directory: the cache id (a new one when the directory is
    new, reset or had samples invalidated), and the samples to drop from the store."""

    cache_id: str
    reset: bool  # the store's contents are of unknown origin: drop them all
    changed: npt.NDArray[np.int64]
    users: int = -1  # the descriptor holding DIR/users.lock shared, for the handle to keep
    # reset with no cache.json at all (not a damaged one or an older lcache's): a store with
    # records there is not this cache's, which writes cache.json before caching a sample
    described: bool = True
    # the stored fingerprints were made by an older scheme (an upgrade of lcache): every
    # cached sample reads as changed, though its object may not be
    rescheme: bool = False


class DirectoryIdentity:
    """``DIR/cache.json`` and ``DIR/listing.bin``, read and updated under ``DIR/cache.lock``."""

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        self.json_path = os.path.join(cache_dir, "cache.json")
        self.listing_path = os.path.join(cache_dir, "listing.bin")

    @contextmanager
    def check(self, ident: Identity, check_listing: bool) -> Iterator[Opened]:
        """Compare ``ident`` with what the directory caches; the caller drops what the
        yielded ``Opened`` says, then the new identity is published (all under a lock that
        every rank and process opening the directory takes, so one of them does it)."""
        fd = open_owned(os.path.join(self.cache_dir, "cache.lock"), os.O_RDWR | os.O_CREAT)
        users, known = -1, 0
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            stored = self._load()
            if stored is None:
                opened = Opened(os.urandom(8).hex(), True, np.zeros(0, np.int64),
                                described=os.path.lexists(self.json_path))
            else:
                self._refuse_other_source(stored, ident.doc)
                if stored.get("layout") != ident.doc.get("layout"):
                    check_listing = True  # indices name other samples: trust no version
                changed, known = self._changed(ident.listing, stored) if check_listing else \
                    (np.zeros(0, np.int64), 0)
                # A new id when samples change: the staging area (named by the id) of an
                # earlier run may still hold their old bytes. Not for samples appended: no
                # sample of that id had their numbers (workers of open handles re-join it).
                appended = bool(len(changed)) and bool((changed >= known).all())
                cache_id = os.urandom(8).hex() if len(changed) and not appended \
                    else str(stored["id"])
                opened = Opened(cache_id, False, changed, rescheme=bool(len(changed)) and
                                stored.get("fingerprints") != ident.doc.get("fingerprints"))
            users = open_owned(os.path.join(self.cache_dir, "users.lock"),
                               os.O_RDWR | os.O_CREAT)
            # Samples appended to the listing are safe from open handles: they never ask for
            # them. Any other change is not.
            if opened.reset or (opened.changed < known).any():
                self._refuse_if_open(users, stored, ident.doc, len(opened.changed))
            elif len(opened.changed) and not _alone(users):
                log.warning("lcache: %d samples were appended to the listing of %s while it "
                            "is open elsewhere with %d; what opened it before does not see "
                            "them, so the ranks of one job must see one listing (a launcher's "
                            "ranks share it: docs/cache.md)", len(opened.changed),
                            ident.doc.get("source"), known)
            fcntl.flock(users, fcntl.LOCK_SH)
            opened.users = users
            yield opened
            if opened.reset or len(opened.changed) or stored is None or (
                    ident.listing is not None and not check_listing and
                    not os.path.exists(self.listing_path)):
                self._publish(ident, opened.cache_id)
        except BaseException:
            if users >= 0:
                close_file(users)
            raise
        finally:
            close_file(fd)

    def join(self, cache_id: str) -> int:
        """For a handle unpickled in another process (a DataLoader worker started with
        spawn): hold ``DIR/users.lock`` shared as its parent does, if the directory still
        caches what the handle was opened for. Returns the descriptor.

        Raises:
            ConfigError: the directory was opened for another listing since.
        """
        fd = open_owned(os.path.join(self.cache_dir, "cache.lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            stored = self._load()
            if stored is None or stored.get("id") != cache_id:
                raise ConfigError(
                    f"{self.cache_dir} was opened for another listing since this handle was "
                    "made (in the parent of this process); make the dataset again")
            users = open_owned(os.path.join(self.cache_dir, "users.lock"),
                               os.O_RDWR | os.O_CREAT)
            fcntl.flock(users, fcntl.LOCK_SH)
            return users
        finally:
            close_file(fd)

    def _refuse_if_open(self, users: int, stored: dict[str, Any] | None, doc: dict[str, Any],
                        changed: int) -> None:
        """Refuse to change what the cached samples mean while a handle uses them."""
        if not _alone(users):
            what = (f"{changed} of its samples changed or name other objects since it was "
                    "opened there" if stored is not None else "its cache.json is gone")
            raise ConfigError(
                f"{self.cache_dir} is open for {_describe(stored or doc)} (in another process, "
                f"or a handle of this one not closed), and {what}: close that first "
                "(cache.close()), or use one cache directory per dataset and split")

    def _load(self) -> dict[str, Any] | None:
        """The stored identity, or None if there is none this version can trust."""
        raw = read_cache_json(self.cache_dir)
        if raw is None:
            return None
        try:
            doc = jsondoc.loads(raw)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or "id" not in doc:
            log.warning("lcache: %s was written by an older lcache or is damaged; the "
                        "samples cached there are dropped", self.json_path)
            return None
        return doc

    def _refuse_other_source(self, stored: dict[str, Any], doc: dict[str, Any]) -> None:
        differs = [k for k in COMPARED if stored.get(k) != doc.get(k)]
        if "content" in doc and stored.get("samples") != doc["samples"]:
            differs.append("samples")
        if not differs:
            return
        why = ("the contents of its items differ" if differs == ["content"]
               else "its " + ", ".join(differs) + (" differs" if len(differs) == 1
                                                   else " differ"))
        if "kind" in differs and stored.get("kind") == "FileSource":
            # what `lcache warm` makes: the user meant this cache, not another dataset
            why += ("; `lcache warm` fills a cache of plain files (FileSource): warm a cache "
                    f"for {doc.get('kind')} with lcache.data.warm.warm_cache (docs/cache.md)")
        raise ConfigError(
            f"{self.cache_dir} caches {_describe(stored)}, not {_describe(doc)} ({why}); "
            "use another cache directory (one per dataset and split) or delete it")

    def _changed(self, listing: npt.NDArray[np.uint64] | None, stored: dict[str, Any]
                 ) -> tuple[npt.NDArray[np.int64], int]:
        """Samples whose fingerprint changed (or that were added or removed), and how many
        samples the stored listing has (all of them, if it is unknown)."""
        if listing is None:
            return np.zeros(0, np.int64), 0
        try:
            fd = open_owned(self.listing_path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                raw = os.pread(fd, size, 0)
            finally:
                close_file(fd)
        except FileNotFoundError:
            raw = None
        old = None
        # cache.json names its listing.bin: a run killed between writing the two left a
        # listing.bin of another listing than the one the cached samples were checked with.
        if raw is not None and len(raw) % 8 == 0 and stored.get("listing", _digest(raw)) == \
                _digest(raw):
            old = np.frombuffer(raw, "<u8")
        if old is None:  # unknown: every cached sample is suspect
            return np.arange(len(listing), dtype=np.int64), len(listing)
        common = min(len(old), len(listing))
        changed = np.flatnonzero(old[:common] != listing[:common])
        tail = np.arange(common, max(len(old), len(listing)), dtype=np.int64)
        return np.concatenate([changed, tail]).astype(np.int64), len(old)

    def _publish(self, ident: Identity, cache_id: str) -> None:
        # The listing first: cache.json is what makes the directory's contents trusted.
        doc = {"format": FORMAT, "id": cache_id, **ident.doc}
        if ident.listing is not None:
            raw = ident.listing.astype("<u8").tobytes()
            atomic_write(self.listing_path, raw, io_class="cache-meta")
            doc["listing"] = _digest(raw)
        atomic_write(self.json_path, json.dumps(doc, indent=1).encode(), io_class="cache-meta")
