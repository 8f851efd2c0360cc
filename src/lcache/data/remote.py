"""One remote filesystem per source and process, and how every request to it is made: with a
timeout, retried with backoff on transient errors (5xx, timeouts, resets), traced, and named
in its error.

The filesystem is created lazily in each process (fsspec caches them per process), so a
source pickles cheaply into DataLoader workers and never shares a connection across ``fork``.
Requests to an async filesystem (HTTP, S3, GCS, Azure) run on fsspec's event loop, where
many can be in flight on one connection pool; a local or mounted path is read directly, with
neither timeout nor retries (a blocked local read cannot be interrupted).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import errno
import inspect
import os
import random
import re
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from lcache.data import http_client
from lcache.errors import ConfigError, CorruptionError, LCacheError
from lcache.io.files import close_file, open_regular
from lcache.io.urls import filesystem_of
from lcache.store.layout import format_size
from lcache.trace import recorder as _trace

T = TypeVar("T")


class SourceError(LCacheError, OSError):
    """A sample could not be read from the source; the message names the URL and the key."""


class SourceCorruptionError(SourceError, CorruptionError):
    """The source's bytes are not what its format says (a truncated shard, a bad checksum,
    a corrupt index): a SourceError, so ``on_error="skip"`` can skip the sample, and a
    CorruptionError (a ValueError)."""


class SourceChangedError(SourceError):
    """An object answered with another size or version than its listing's: it was rewritten
    since the source was opened. Not asked again: a changed multi-GB object was fetched five
    times before it failed, and replicas that give one object different ETags (Apache 2.2's
    held the inode) failed 1 sample in 32 even so."""


@dataclass(frozen=True, slots=True)
class Listed:
    """What the listing said of an object, to check each answer against: its size (None: not
    checked here) and its ``object_version``. Why: an answer's length alone does not tell a
    rewritten object. A range cut from a shard rewritten at another size mixed two new
    samples; an S3 object rewritten with the same size was cached under the listed ETag, and
    when the object was put back (its ETag is its content's) those bytes were served as the
    listed version's in every later run."""

    size: int | None
    version: str

    def check(self, size: int | None, answered: dict[str, Any]) -> None:
        """Refuse an answer from an object now of ``size`` bytes (None: not said) whose
        version fields are ``answered`` (those it did not send: None)."""
        if self.size is not None and size is not None and size != self.size:
            raise SourceChangedError(f"the object is now {size} bytes, {self.size} when it was "
                                     "listed: it changed since the source was opened (open it "
                                     "again)")
        listed = version_fields(self.version)
        for name, value in answered.items():
            if value is not None and name in listed and str(value) != listed[name]:
                raise SourceChangedError(
                    f"its {name} is now {value}, {listed[name]} when it was listed: it was "
                    "rewritten since the source was opened (open it again)")


def _changed(before: os.stat_result, after: os.stat_result) -> bool:
    """Whether a file's ``fstat`` moved between two calls (a write in between)."""
    return (before.st_size, before.st_mtime_ns, before.st_ctime_ns) != \
        (after.st_size, after.st_mtime_ns, after.st_ctime_ns)


@dataclass(frozen=True)
class FetchOptions:
    """How a source talks to its remote.

    Attributes:
        concurrency: requests in flight per ``fetch_many`` call (and per listing).
        retries: attempts after the first on a transient error (5xx, 408, 429, timeouts,
            connection resets); 404 and 403 are never retried.
        timeout: seconds one request may take, listing and opening included.
        backoff: the first retry waits up to this long; each next one up to twice as long
            (random, "full jitter", capped at 5 s), so a storm is not answered in lockstep.
        coalesce_gap: byte ranges of one object closer than this are fetched as one request.
            Fetching a gap costs gap / bandwidth, a request latency / concurrency: at
            200 MB/s, 3 ms and 32 in flight they are equal at about 19 KB.
        max_request: a coalesced request is not grown beyond this many bytes.
    """

    concurrency: int = 32
    retries: int = 4
    timeout: float = 60.0
    backoff: float = 0.1
    coalesce_gap: int = 16 << 10
    max_request: int = 8 << 20

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.retries < 0 or self.coalesce_gap < 0:
            raise ConfigError("concurrency must be >= 1, retries and coalesce_gap >= 0")
        if not (self.timeout > 0 and self.backoff >= 0 and self.max_request > 0):
            raise ConfigError("timeout and max_request must be > 0, backoff >= 0")

    @classmethod
    def pop(cls, options: dict[str, Any]) -> FetchOptions:
        """The options named in ``options`` (removed from it), the rest left at defaults."""
        return cls(**{k: options.pop(k) for k in list(options) if k in cls.__dataclass_fields__})


# Fields of an fsspec info dict that change when an object is rewritten: S3/Azure ETag, GCS
# generation and md5Hash, HTTP ETag/Last-Modified/Content-MD5/Digest, and for local files the
# modification time, the inode change time (which no user can set back) and the inode.
VERSION_FIELDS = ("ETag", "etag", "md5Hash", "generation", "VersionId", "version_id",
                  "Content-MD5", "Digest", "Last-Modified", "LastModified", "last_modified",
                  "mtime", "created", "ino")


# Storage options (at any depth: s3fs's client_kwargs) that say where the data is, not who
# may read it: an endpoint, whatever its option is called, and an Azure account.
ENDPOINT_OPTIONS = frozenset({"endpoint_url", "endpoint", "account_url", "account_host",
                              "base_url"})
ACCOUNT_OPTIONS = frozenset({"account_name"})


# Of those, the ones that count whole seconds: an object rewritten with the same size in the
# second it was cached keeps them (an HTTP server that sends no ETag, http.server's).
COARSE_FIELDS = frozenset({"Last-Modified", "LastModified", "last_modified"})


def object_version(info: dict[str, Any]) -> str:
    """The version fields of an fsspec info dict, as one string ("" if it has none)."""
    return "|".join(f"{k}={info[k]}" for k in VERSION_FIELDS if info.get(k) not in (None, ""))


def version_fields(version: str) -> dict[str, str]:
    """The fields of an ``object_version``, by name."""
    return dict(field.partition("=")[::2] for field in version.split("|") if field)


def tells_rewrites(version: str) -> bool:
    """Whether an ``object_version`` changes with every rewrite of the same size: it has a
    field besides whole-second modification times (nginx's ETag, ``"<mtime>-<size>"`` in
    hex, is one of them)."""
    fields = version_fields(version)
    return any(name not in COARSE_FIELDS and not _nginx_etag(value, fields)
               for name, value in fields.items())


def _nginx_etag(value: str, fields: dict[str, str]) -> bool:
    """Whether ETag ``value`` is nginx's default: the Last-Modified seconds and the size."""
    stamp = re.fullmatch(r'(?:W/)?"?([0-9a-f]+)-[0-9a-f]+"?', value.strip())
    modified = fields.get("Last-Modified") or fields.get("last_modified")
    if stamp is None or not modified:
        return False
    with contextlib.suppress(TypeError, ValueError, IndexError):
        seconds = email.utils.parsedate_to_datetime(modified).timestamp()
        return int(stamp.group(1), 16) == int(seconds)
    return False


def _normal_url(url: str) -> str:
    """``url`` with its scheme and host in lower case, without a default port or a trailing
    slash."""
    parts = urllib.parse.urlsplit(url.strip())
    host = (parts.hostname or "").lower()
    default = {"http": 80, "https": 443}.get(parts.scheme.lower())
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = host if port in (None, default) else f"{host}:{port}"
    return urllib.parse.urlunsplit((parts.scheme.lower(), netloc, parts.path.rstrip("/"),
                                    parts.query, ""))


def _implicit_endpoint(scheme: str, options: dict[str, Any]) -> str:
    """The endpoint an S3 or GCS client takes from the environment when no option gives one:
    botocore's ``AWS_ENDPOINT_URL(_S3)`` and the profile's config file, or gcsfs's
    ``STORAGE_EMULATOR_HOST``."""
    if scheme in ("gs", "gcs"):
        return os.environ.get("STORAGE_EMULATOR_HOST", "")
    if scheme not in ("s3", "s3a"):
        return ""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return os.environ[name]
    try:
        import botocore.session

        profile = options.get("profile") or os.environ.get("AWS_PROFILE") or None
        config = botocore.session.Session(profile=profile).get_scoped_config()
    except Exception:  # no botocore, no such profile, an unreadable config: none known
        return ""
    service = config.get("s3")
    nested = service.get("endpoint_url") if isinstance(service, dict) else None
    return str(nested or config.get("endpoint_url") or "")


def climbs(name: str, decoded: bool = True) -> bool:
    """Whether the relative name ``name`` has a ``..`` segment: as written, with a path
    parameter (``..;``, which Tomcat and Spring resolve as ``..``), or, ``decoded``, also
    percent-encoded (HTTP clients decode ``%2e%2e`` and normalise the path: ``d/%2e%2e/x``
    is fetched as ``x``, outside ``d``). A local file system decodes nothing."""
    forms = (name, urllib.parse.unquote(name)) if decoded else (name,)
    return any(part.split(";", 1)[0] == ".." for form in forms for part in form.split("/"))


def _absolute(url: str) -> str:
    """A local path or ``file://``/``local://`` URL with its path made absolute: it names the
    source in the cache's identity and kept listing, and "data" in two project folders is
    two datasets (fsspec reads ``file://data`` as relative to the current folder too)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return os.path.abspath(url)
    if scheme.lower() in ("file", "local") and not rest.startswith("/"):
        return f"{scheme}://{os.path.abspath(rest)}"
    return url


def fingerprint(*parts: object) -> int:
    # surrogateescape: a local file name that is not UTF-8 comes as lone surrogates
    text = "\0".join(map(str, parts))
    return int(xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogateescape")))


def is_transient(exc: BaseException) -> bool:
    """Whether a failed request may succeed if asked again: a 5xx, 408 or 429 answer, a
    timeout, a reset or dropped connection. Not: a missing object, a refusal, a connection
    refused (nothing listens there), a bad URL, an object changed since it was listed."""
    if isinstance(exc, (SourceChangedError, FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError, ConnectionRefusedError, ValueError)):
        return False
    status = getattr(exc, "status", None)  # aiohttp.ClientResponseError
    if status is None:  # botocore's ClientError (s3fs hands some through untranslated)
        status = getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
    if isinstance(status, int):
        return status >= 500 or status in (408, 429)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, ConnectionError)):
        return True
    if getattr(exc, "errno", None) == errno.ECONNREFUSED or getattr(
            getattr(exc, "os_error", None), "errno", None) == errno.ECONNREFUSED:
        return False
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - fsspec[http] brings it
        return False
    # Connection-level failures: reset, disconnected, payload cut short.
    return isinstance(exc, aiohttp.ClientError)


async def _within(call: Callable[[], Awaitable[T]], seconds: float) -> T:
    """``await call()``, cancelled after ``seconds`` (``TimeoutError``). On Python 3.11+ in
    the caller's task: ``wait_for`` made one more task per request (``benchmarks/http_cpu.py``:
    113 against 94 us of CPU a GET through ``FileSource.fetch_many``)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await call()
    return await asyncio.wait_for(call(), seconds)  # pragma: no cover - Python 3.10


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def trace_read(url: str, offset: int, size: int, t0: int, result: int,
               op: str = "read") -> None:
    """Record a request to the source that started at ``t0`` (0: tracing was off): a
    ``read``, or opening the source (``list`` a directory, ``stat`` an object)."""
    if t0:
        _trace.record(op, url, offset, size, "data-source", t0,
                      time.perf_counter_ns() - t0, result)


def _why(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) and not str(exc):
        return f"no answer within {timeout:g} s (timeout=)"
    return f"{type(exc).__name__}: {exc}"


#: The most bytes of an index or a table read whole (``Remote.get_many``): parsed, such a
#: document takes several times its size in memory.
MAX_DOCUMENT = 1 << 30

#: The version fields of an HTTP answer, as fsspec's ``info`` names them.
HTTP_VERSION_HEADERS = ("ETag", "Content-MD5", "Digest", "Last-Modified")


def _range_total(content_range: str | None) -> int | None:
    """The object's size that a ``Content-Range`` (``bytes 0-99/1234``) says, if any."""
    total = (content_range or "").rpartition("/")[2].strip()
    return int(total) if total.isdigit() else None


async def _http_get(fs: Any, url: str, start: int | None, end: int | None,
                    listed: Listed | None, most: int | None = None) -> bytes:
    """Bytes ``start:end`` of ``url`` (all of it when ``start`` is None), with the place of
    the answer checked: fsspec's ``_cat_file`` takes any body, and a server or proxy that
    answered a range with other bytes of the right length had them cached as the sample. A
    200 (the whole object: a server without ranges) is taken for a range from byte 0 only,
    and the caller refuses it unless it is exactly the range. The object's size and version
    fields are checked against ``listed`` (a whole object of no known size too: served by
    ``_cat_file``, one rewritten after the listing was cached under the listed ETag). A
    whole object is read up to ``most`` bytes (None: no bound), a range up to its length."""
    kw = dict(fs.kwargs)
    headers = dict(kw.pop("headers", {}))
    if start is not None and end is not None:
        headers["Range"] = f"bytes={start}-{end - 1}"
    limit = most if start is None or end is None else end - start
    cut = None
    try:
        r = await _http_answer(fs, url, headers, kw, limit)
    except http_client.TooLong as exc:  # checked below, after its status and place
        r, cut = exc.response, exc
    if r.status == 404:
        raise FileNotFoundError(url)
    if r.status >= 400:
        raise http_client.StatusError(r.status, r.reason, url)
    # A 206 must say it starts where asked; a 200 is the whole object, from byte 0.
    answered = (r.header("Content-Range") or "") if r.status == 206 else "bytes 0-"
    unit, _, span = answered.strip().partition(" ")
    first = span.strip().partition("-")[0]
    if unit.lower() != "bytes" or not first.isdigit() or int(first) != (start or 0):
        raise SourceCorruptionError(
            f"{url} answered a request for bytes {start}-{end} with other bytes "
            f"({f'Content-Range: {answered}' if r.status == 206 else 'the whole object'})")
    if cut is not None:
        raise SourceError(f"{url} {cut} for bytes {start}-{end} (a server that ignores Range "
                          "requests?)" if start is not None else
                          f"{url} {cut}, past the {format_size(limit or 0)} it may hold")
    if listed is not None:
        listed.check(_range_total(answered) if r.status == 206 else len(r.body),
                     {name: r.header(name) for name in HTTP_VERSION_HEADERS})
    return r.body


def _plain_session(fs: Any) -> bool:
    """Whether ``fs``'s requests are plain GETs that ``http_client`` makes as aiohttp would:
    no options for its session (authentication, TLS settings, a custom client) and no
    request options besides headers."""
    from fsspec.implementations.http import get_client

    return not fs.client_kwargs and fs.get_client is get_client


async def _http_answer(fs: Any, url: str, headers: dict[str, str], kw: dict[str, Any],
                       limit: int | None = None) -> http_client.Response:
    """The answer to a GET of ``url``: from ``http_client`` where the request and its
    answer are plain, else from fsspec's aiohttp session. Either way a successful answer of
    more than ``limit`` bytes raises ``http_client.TooLong``, and an error answer's body is
    cut at ``http_client.MAX_ERROR_BODY``: a body is never read without bound."""
    target = fs.encode_url(url)
    if not kw and _plain_session(fs):
        try:
            return await http_client.get(target, headers, limit)
        except http_client.NotPlain:
            pass
    import aiohttp

    session = await fs.set_session()
    try:
        async with session.get(target, headers=headers, **kw) as r:
            room = http_client.MAX_ERROR_BODY if r.status >= 400 else limit
            body = bytearray()
            async for piece in r.content.iter_any():  # decoded: a gzip bomb is bounded too
                body += piece
                if room is not None and len(body) > room:
                    answer = http_client.Response(r.status, r.reason or "", r.headers,
                                                  bytes(body[:room]))
                    if r.status >= 400:
                        return answer
                    raise http_client.TooLong(f"answered more than {room} bytes", answer)
            return http_client.Response(r.status, r.reason or "", r.headers, bytes(body))
    except aiohttp.ClientResponseError as exc:
        if type(exc) is not aiohttp.ClientResponseError or exc.status != 400:
            raise
        # aiohttp's own refusal of the answer's head, said as a 400 the server never sent
        # (a real 400 comes back as an answer: the caller makes its StatusError)
        what = str(exc.message).split("\n")[0].rstrip(":")
        raise SourceError(f"{url} sent an answer that is not valid HTTP ({what})") from None


async def _s3_get(fs: Any, path: str, start: int | None, end: int | None,
                  listed: Listed, most: int | None = None) -> bytes:
    """``path[start:end]`` (or all of it, up to ``most`` bytes) from S3, with the object's
    size and ETag checked against ``listed`` (s3fs's ``_cat_file`` returns the body alone).
    A body longer than the range is refused as soon as it is: read whole, an endpoint that
    ignored the range or never ended filled the memory, as over HTTP."""
    bucket, key, version_id = fs.split_path(path)
    kw: dict[str, Any] = {"VersionId": version_id} if version_id else {}
    if start is not None:
        kw["Range"] = f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"
    limit = end - start if start is not None and end is not None else most
    r = await fs._call_s3("get_object", Bucket=bucket, Key=key, **kw)
    parts: list[bytes] = []
    got = 0
    try:
        while chunk := await r["Body"].read(1 << 20 if limit is None else limit + 1 - got):
            parts.append(chunk)
            got += len(chunk)
            if limit is not None and got > limit:
                raise SourceError(f"s3://{bucket}/{key} answered more than {limit} bytes for "
                                  f"bytes {start}-{end} (an endpoint that ignores Range "
                                  "requests?)")
    finally:
        r["Body"].close()
    data = b"".join(parts)
    listed.check(_range_total(r.get("ContentRange")) if start is not None else len(data),
                 {"ETag": r.get("ETag")})
    return data


# Filesystems a forked process got from its parent (DataLoader workers), kept referenced for
# the life of the process. Why: collecting one runs its finalizer, which closes its pooled
# connections through the parent's event loop object, whose epoll set fork shares with the
# parent: each close unregisters the parent's socket there, and the parent's next request on
# it waits for an answer it is never woken for (seen: 60 s timeouts, re-sent GETs).
_INHERITED: list[Any] = []


def _keep_inherited() -> None:
    fsspec_spec = sys.modules.get("fsspec.spec")
    if fsspec_spec is None:
        return
    todo = [fsspec_spec.AbstractFileSystem]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        _INHERITED.extend(getattr(cls, "_cache", {}).values())


os.register_at_fork(after_in_child=_keep_inherited)


class Remote:
    """The fsspec filesystem of ``url``, created lazily in each process."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None,
                 options: FetchOptions | None = None) -> None:
        if not isinstance(url, str) or not url.strip() or "\0" in url:
            raise ConfigError(f"source {url!r:.200}: give a path or URL (a string, without "
                              "a NUL character)")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options={storage_options!r:.200}: give a dict of "
                              "fsspec options (or None)")
        self.url = _absolute(url)
        self.storage_options = dict(storage_options or {})
        self.options = options or FetchOptions()
        self._fs: Any = None
        self._root = ""
        self._pid = -1
        self._pool: ThreadPoolExecutor | None = None
        self._whole_kw: dict[str, Any] = {}
        self._location: str | None = None

    def fs(self) -> tuple[Any, str]:
        # Why the pid: a DataLoader worker forked from us inherits our filesystem object,
        # whose event loop and connections belong to the parent.
        if self._fs is None or self._pid != os.getpid():
            if self._fs is not None:
                _INHERITED.append(self._fs)  # see _INHERITED
            self._pool = None
            fs, root = filesystem_of(self.url, self.storage_options)
            # s3fs splits a whole-object read into parallel parts after a HEAD for its size:
            # one more request per sample (it halved the objects fetched per second).
            cat = getattr(fs, "_cat_file", None)
            wants = cat is not None and "max_concurrency" in inspect.signature(cat).parameters
            self._whole_kw = {"max_concurrency": 1} if wants else {}
            # The pid last: another thread of a forked child that sees it must find our
            # filesystem, not the parent's (fsspec refuses that one).
            self._fs, self._root, self._pid = fs, root, os.getpid()
        return self._fs, self._root

    def location(self) -> str:
        """Where the store the URL names is, besides the URL: its endpoint (an S3-compatible
        one, from the storage options, fsspec's config, ``AWS_ENDPOINT_URL`` or the AWS
        profile's config; GCS's emulator host) and Azure account, normalised (``http://H/``
        and ``http://h:80`` are one); "" when none is set. One bucket and key behind two
        endpoints are two datasets. Credentials are left out: a rotated key names the same
        data. Worked out once per object: the AWS profile's config is a file to read."""
        if self._location is None:
            self._location = self._find_location()
        return self._location

    def _find_location(self) -> str:
        scheme = self.url.partition("://")[0].lower() if "://" in self.url else "file"
        from fsspec.config import conf  # options fsspec applies from its config and env

        endpoints: set[str] = set()
        accounts: set[str] = set()
        todo: list[Any] = [conf.get(scheme, {}), self.storage_options]
        while todo:
            options = todo.pop()
            for key, value in options.items():
                if isinstance(value, dict):
                    todo.append(value)
                elif value in (None, ""):
                    continue
                elif key in ENDPOINT_OPTIONS:
                    endpoints.add(_normal_url(str(value)))
                elif key in ACCOUNT_OPTIONS:
                    accounts.add(str(value))
                elif key == "connection_string":  # Azure: "AccountName=a;BlobEndpoint=u;..."
                    parts = dict(p.partition("=")[::2] for p in str(value).split(";"))
                    if parts.get("BlobEndpoint"):
                        endpoints.add(_normal_url(parts["BlobEndpoint"]))
                    if parts.get("AccountName"):
                        accounts.add(parts["AccountName"])
        if not endpoints:  # the clients' own defaults, which explicit options override
            implicit = _implicit_endpoint(scheme, self.storage_options)
            if implicit:
                endpoints.add(_normal_url(implicit))
        return ";".join([*(f"endpoint={e}" for e in sorted(endpoints)),
                         *(f"account={a}" for a in sorted(accounts))])

    @property
    def is_async(self) -> bool:
        return bool(getattr(self.fs()[0], "async_impl", False))

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "storage_options": self.storage_options,
                "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["storage_options"],  # type: ignore[misc]
                      state["options"])

    def full_url(self, path: str) -> str:
        """``path`` as the user names it: a URL, or a local path as it is."""
        fs, _ = self.fs()
        if "file" in _protocols(fs):
            return path
        return str(fs.unstrip_protocol(path))

    def path(self, relative: str) -> str:
        """The filesystem path of ``relative`` (a name under ``url``).

        Raises:
            ConfigError: ``relative`` is not a name under the URL (``..``, a URL, a NUL):
                ``files=["../../etc/x"]`` would have read and cached a file outside it.
        """
        fs, root = self.fs()
        if not isinstance(relative, str) or "\0" in relative or "://" in relative or \
                climbs(relative, decoded="file" not in _protocols(fs)):
            raise ConfigError(f"{relative!r:.200} is not a name under {self.url}: give names "
                              "relative to it, without '..'")
        if "http" in _protocols(fs) and ("?" in relative or "#" in relative):
            # a URL's query or fragment: "a?b.tar" was fetched as "a"
            raise ConfigError(f"{relative!r:.200} under {self.url}: '?' and '#' end a URL's "
                              "path; give the name percent-encoded (%3F, %23), as listings "
                              "give it")
        return f"{root.rstrip('/')}/{relative.lstrip('/')}"

    # ------------------------------------------------------------------- running requests
    def run(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run the coroutine ``make()`` on the filesystem's event loop; from any thread."""
        fs, _ = self.fs()
        from fsspec.asyn import get_loop, sync

        loop = fs.loop if self.is_async else get_loop()
        return sync(loop, make)  # type: ignore[no-any-return]

    def in_thread(self, call: Callable[[], T]) -> Awaitable[T]:
        """A blocking call of a non-async filesystem, run in this process's thread pool."""
        if self._pool is None or self._pid != os.getpid():
            self.fs()
            self._pool = ThreadPoolExecutor(min(self.options.concurrency, 16),
                                            thread_name_prefix="lcache-source")
        return asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def attempt(self, call: Callable[[], Awaitable[T]], what: Callable[[], str],
                      traced: tuple[str, int, int] | None = None, op: str = "read") -> T:
        """``await call()`` with the timeout, retried with backoff while the error is
        transient; then a SourceError that starts with ``what()`` ("cannot read sample 3
        (URL)"). ``traced`` (url, offset, size): record each attempt as a data-source ``op``
        (result: the bytes read, the entries listed, or 0)."""
        opts = self.options
        for attempt in range(opts.retries + 1):
            t0 = time.perf_counter_ns() if traced and _trace._active is not None else 0
            try:
                result = await _within(call, opts.timeout)
            except Exception as exc:
                if traced:
                    trace_read(*traced, t0, -errno.EIO, op)
                if attempt == opts.retries or not is_transient(exc):
                    tries = f" after {attempt + 1} attempts" if attempt else ""
                    raise SourceError(f"{what()}{tries}: {_why(exc, opts.timeout)}") from exc
                await asyncio.sleep(random.uniform(0, min(5.0, opts.backoff * 2 ** attempt)))
                continue
            if traced:
                got = len(result) if isinstance(result, (bytes, bytearray, memoryview, list)) \
                    else 0
                trace_read(traced[0], traced[1], got if op == "read" else 0, t0, got, op)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    async def bounded(self, calls: Iterable[Callable[[], Awaitable[T]]]) -> list[T]:
        """All of ``calls`` with at most ``concurrency`` in flight, results in order; on the
        first error the others are cancelled, and the error of the first call (in order)
        that failed is raised. ``concurrency`` runners take the calls in turn: a task per
        call waiting on a semaphore cost O(waiters) per acquire (asyncio's ``locked``)."""
        todo = list(enumerate(calls))
        results: list[Any] = [None] * len(todo)
        errors: dict[int, BaseException] = {}
        queue = iter(todo)
        runners: list[asyncio.Future[None]] = []

        async def run() -> None:
            for i, call in queue:
                try:
                    results[i] = await call()
                except Exception as exc:
                    errors[i] = exc
                    for other in runners:
                        if other is not asyncio.current_task():
                            other.cancel()
                    return

        runners.extend(asyncio.ensure_future(run())
                       for _ in range(min(self.options.concurrency, len(todo))))
        if runners:
            await asyncio.gather(*runners, return_exceptions=True)
        if errors:
            raise errors[min(errors)]
        return results

    # ------------------------------------------------------------------- requests
    async def cat(self, path: str, start: int | None, end: int | None,
                  what: Callable[[], str], listed: Listed | None = None,
                  most: int | None = None) -> bytes:
        """The bytes of ``path`` (``start:end``, or all of it), retried; traced. Over HTTP,
        S3 and local files, an answer from an object whose size or version is not
        ``listed``'s is refused (``SourceChangedError``). Over HTTP, a whole object is
        read up to ``most`` bytes (None: no bound)."""
        fs, _ = self.fs()
        url = self.full_url(path)
        traced = (url, start or 0, 0 if end is None else end - (start or 0))
        if self.is_async:
            protocols = _protocols(fs)
            if "http" in protocols and (start is None) == (end is None):
                return await self.attempt(
                    lambda: _http_get(fs, path, start, end, listed, most), what, traced)
            if listed is not None and "s3" in protocols:
                return await self.attempt(lambda: _s3_get(fs, path, start, end, listed, most),
                                          what, traced)
            kw = self._whole_kw if start is None else {}
            return await self.attempt(
                lambda: fs._cat_file(path, start=start, end=end, **kw), what, traced)
        return await self.attempt(
            lambda: self.in_thread(lambda: self.read(path, start, end, listed)), what, traced)

    def read(self, path: str, start: int | None, end: int | None,
             listed: Listed | None = None) -> bytes:
        """``path[start:end]`` on a non-async filesystem, in this thread. A local path is
        opened as a regular file only (without blocking, then checked): a FIFO or a device
        put under a sample's or an index's name would block the read forever or never end.
        A local file's size, modification time and inode are checked against ``listed``
        before the read, and compared again after it, with its inode change time: a rewrite
        during the read mixed two versions. (The inode change time is not compared with the
        listing's: a chmod, a hard link or a backup tool setting the access time back
        changes it, and failed the read; the next open drops what it changed.)"""
        fs, _ = self.fs()
        if "file" not in _protocols(fs):
            return bytes(fs.cat_file(path, start=start, end=end))
        fd = open_regular(path, os.O_RDONLY, follow=True)
        try:
            st = os.fstat(fd)
            size = st.st_size
            if listed is not None:  # as fsspec's LocalFileSystem.info says them
                listed.check(size, {"mtime": st.st_mtime, "ino": st.st_ino})
            lo, hi, _ = slice(start, end).indices(size)
            chunks = []
            while lo < hi:
                piece = os.pread(fd, min(hi - lo, 1 << 28), lo)
                if not piece:
                    break
                chunks.append(piece)
                lo += len(piece)
            if listed is not None and _changed(st, os.fstat(fd)):
                raise SourceChangedError("it changed while it was read (its size, modification "
                                         "or inode change time moved): it was rewritten "
                                         "since the source was opened (open it again)")
            return b"".join(chunks)
        finally:
            close_file(fd)

    def get_many(self, parts: Sequence[tuple[str, int | None, int | None]],
                 what: Callable[[str], str], listed: Listed | None = None) -> list[bytes]:
        """Whole objects or ranges ``(path, start, end)`` that are not samples (an index, a
        shard's header), concurrently, each retried; errors start with ``what(url)``. The
        caller checks the lengths; ``listed``: what each answer's object must be (see
        ``cat``; one object's parts). A whole object over HTTP is read up to
        ``MAX_DOCUMENT`` bytes: a server whose answer never ends filled the memory."""
        if not self.is_async and len(parts) == 1:
            path, start, end = parts[0]
            try:
                return [self.read(path, start, end, listed)]
            except Exception as exc:
                raise SourceError(f"{what(self.full_url(path))}: {type(exc).__name__}: "
                                  f"{exc}") from exc

        def job(path: str, start: int | None, end: int | None
                ) -> Callable[[], Awaitable[bytes]]:
            return lambda: self.cat(path, start, end, lambda: what(self.full_url(path)),
                                    listed, MAX_DOCUMENT)

        return self.run(lambda: self.bounded(job(*part) for part in parts))

    def infos(self, paths: list[str]) -> list[dict[str, Any]]:
        """fsspec ``info`` of each path, concurrently, each retried; asked of the remote,
        never of the filesystem's listing cache (s3fs and gcsfs answer ``info`` from a
        listing made earlier in the process: an object rewritten since kept its old ETag,
        and its old cached bytes were served as current)."""
        fs, _ = self.fs()
        for folder in {p.rpartition("/")[0] for p in paths}:
            fs.invalidate_cache(folder)
        if not self.is_async:
            try:
                return [fs.info(p) for p in paths]
            except Exception as exc:
                raise SourceError(f"cannot stat the files under {self.url}: "
                                  f"{type(exc).__name__}: {exc}") from exc

        def ask(p: str) -> Callable[[], Awaitable[dict[str, Any]]]:
            return lambda: self.attempt(lambda: fs._info(p),
                                        lambda: f"cannot stat {self.full_url(p)}",
                                        (self.full_url(p), 0, 0), "stat")

        return self.run(lambda: self.bounded(ask(p) for p in paths))
