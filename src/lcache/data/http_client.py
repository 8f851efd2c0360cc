"""A lean HTTP/1.1 client for the GETs of samples, on asyncio with pooled keep-alive
connections.

Why not aiohttp for these: a source of one object per sample makes one GET per sample, and on
a small node such an epoch is bound by the client's CPU: this client takes 0.56-0.68x
aiohttp's CPU per GET of 32 KiB (``benchmarks/http_cpu.py``). It knows only the plain case:
a response framed by ``Content-Length``, chunked or by the connection's end, without a
content coding. Anything else (a redirect, a compressed body, a 1xx, a header it cannot
read, options of fsspec's aiohttp session) raises ``NotPlain`` before any byte is taken as
data, and the caller asks aiohttp instead, which handles it as it always did. Errors of the
wire (a reset, a body cut short or mis-framed) are ``ConnectionError``s, which the caller
retries as transient.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_HEAD = 64 << 10  # bytes of a response's status line and headers
MAX_CONNECTIONS = 100  # per loop and host, as aiohttp's default pool
MAX_ERROR_BODY = 64 << 10  # bytes of an error answer's body read (only its status is used)
# Request headers the client writes or whose meaning it would have to implement.
_OWN_HEADERS = frozenset({"host", "connection", "content-length", "transfer-encoding", "te",
                          "upgrade", "expect", "keep-alive", "proxy-connection"})
_NO_BODY = frozenset({204, 304})


class NotPlain(Exception):
    """The request or its response needs a full HTTP client."""


class BrokenResponse(ConnectionError):
    """The connection closed before the response's end, or its framing is broken."""


class ConnectFailed(ConnectionError):
    """No connection could be made: a name not resolved, a host or network unreachable.
    Transient, as aiohttp's connector errors were (a resolver's hiccup passes); a refused
    connection (nothing listens there) and a certificate refused are not."""


class TooLong(Exception):
    """A successful answer's body is longer than the caller's ``limit``: it was not read past
    the limit (a server that ignores Range, or one that never ends, would fill the memory).
    ``response`` is the answer with the body read so far; the message says how long it is."""

    def __init__(self, what: str, response: Response) -> None:
        super().__init__(what)
        self.response = response


class _Enough(Exception):
    """An error answer's body has run past ``MAX_ERROR_BODY``: the answer ends there."""


class StatusError(Exception):
    """An answer of status 400 or above; ``status`` tells whether it is worth asking again."""

    def __init__(self, status: int, reason: str, url: str) -> None:
        super().__init__(f"{status}, message={reason!r}, url={url!r}")
        self.status = status


@dataclass(slots=True)
class Response:
    status: int
    reason: str
    headers: Mapping[str, str]  # looked up in lower case; a repeated header: its first value
    body: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


def _plain_target(url: Any, headers: dict[str, str]) -> tuple[tuple[str, str, int], bytes]:
    """(pool key, request bytes) for a GET of ``url`` (a ``yarl.URL``)."""
    scheme = url.scheme.lower()
    if scheme not in ("http", "https") or url.raw_user is not None or not url.raw_host:
        raise NotPlain("a scheme, credentials or a host this client does not handle")
    host = url.raw_host
    authority = f"[{host}]" if ":" in host else host
    if not url.is_default_port():
        authority += f":{url.port}"
    lines = [f"GET {url.raw_path_qs or '/'} HTTP/1.1", f"Host: {authority}"]
    given = {name.lower() for name in headers}
    for name, value in headers.items():
        name, value = str(name), str(value)
        if name.lower() in _OWN_HEADERS or any(c in name + value for c in "\r\n\0") or \
                (name.lower() == "accept-encoding" and value.strip().lower() != "identity"):
            raise NotPlain(f"the request header {name!r}")
        lines.append(f"{name}: {value}")
    if "accept-encoding" not in given:
        lines.append("Accept-Encoding: identity")
    if "user-agent" not in given:
        lines.append("User-Agent: lcache")
    try:
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    except UnicodeEncodeError:
        raise NotPlain("a header that is not Latin-1") from None
    return (scheme, host, url.port or 0), request


def _parse_head(head: bytes) -> tuple[int, str, dict[str, str], bool]:
    """(status, reason, headers, keep-alive) of a response head without its blank line."""
    try:
        text = head.decode("latin-1")
        status_line, *lines = text.split("\r\n")
        version, code, reason = [*status_line.split(" ", 2), ""][:3]
        status = int(code)
    except ValueError:
        raise NotPlain("a status line this client cannot read") from None
    if version not in ("HTTP/1.1", "HTTP/1.0") or not code.isdigit() or len(code) != 3:
        raise NotPlain(f"the status line {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or line[0] in " \t":
            raise NotPlain(f"the header line {line[:80]!r}")
        name, value = name.lower(), value.strip()
        if name == "content-length" and headers.get(name, value) != value:
            raise NotPlain("two Content-Length headers")
        headers.setdefault(name, value)
    close = headers.get("connection", "").lower()
    keep = "close" not in close if version == "HTTP/1.1" else "keep-alive" in close
    return status, reason, headers, keep


class _Connection(asyncio.Protocol):
    """One connection; one request at a time. ``response()`` is its answer's future."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False  # answered a request before (a reused connection)
        self._waiter: asyncio.Future[Response] | None = None
        self._limit: int | None = None  # most body bytes a successful answer may have
        self._reset()

    def _reset(self) -> None:
        self._buf = bytearray()
        self._head: tuple[int, str, dict[str, str], bool] | None = None
        self._mode = ""  # "length", "chunked" or "eof", once the head is read
        self._left = 0  # body bytes still due ("length"), or of the current chunk
        self._chunk_state = "size"  # "size", "data", "crlf", "trailer"
        self._parts: list[bytes] = []
        self._taken = 0  # body bytes in _parts
        self._got_any = False

    # -------------------------------------------------------------- the protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            self._abort()  # bytes nobody asked for: the connection cannot be trusted
            return
        self._got_any = True
        try:
            self._feed(data)
        except _Enough:
            self._finish(keep=False)
        except Exception as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        if self._waiter is not None and not self._waiter.done() and self._mode == "eof":
            self._finish(keep=False)
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            if self._mode == "eof" and exc is None:
                self._finish(keep=False)
            else:
                self._waiter.set_exception(BrokenResponse(
                    "the server closed the connection before the response's end"
                    + (f" ({exc})" if exc else "")))

    # -------------------------------------------------------------- requests
    def send(self, request: bytes, limit: int | None) -> asyncio.Future[Response]:
        assert self.transport is not None
        self._reset()
        self._limit = limit
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._waiter

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: BaseException) -> None:
        self._abort()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    def _finish(self, keep: bool) -> None:
        assert self._head is not None and self._waiter is not None
        if not (keep and self._head[3]) or self._buf:  # bytes past the end: not reusable
            self._abort()
        self.used = True
        self._waiter.set_result(self._response())

    def _response(self) -> Response:
        assert self._head is not None
        status, reason, headers, _ = self._head
        return Response(status, reason, headers, b"".join(self._parts))

    def _keep(self, piece: bytes) -> None:
        """Take ``piece`` of the body, within the room the answer has."""
        assert self._head is not None
        room = MAX_ERROR_BODY if self._head[0] >= 400 else self._limit
        if room is not None and self._taken + len(piece) > room:
            self._parts.append(piece[: room - self._taken])
            if self._head[0] >= 400:
                raise _Enough
            raise TooLong(f"answered more than {room} bytes", self._response())
        if piece:
            self._parts.append(piece)
            self._taken += len(piece)

    # -------------------------------------------------------------- parsing
    def _feed(self, data: bytes) -> None:
        if self._head is None:
            self._buf += data
            end = self._buf.find(b"\r\n\r\n")
            if end < 0 or end > MAX_HEAD:  # whether it came in one piece or many
                if len(self._buf) > MAX_HEAD:
                    raise NotPlain("a response head over 64 KiB")
                return
            self._head = head = _parse_head(bytes(self._buf[:end]))
            data = bytes(self._buf[end + 4:])
            self._buf = bytearray()
            self._start_body(head[0], head[2])
            if self._mode == "":
                self._finish(keep=not data)
                return
        if self._mode == "length":
            take = data[:self._left]
            self._keep(take)
            self._left -= len(take)
            if self._left == 0:
                self._buf += data[len(take):]
                self._finish(keep=True)
        elif self._mode == "chunked":
            self._buf += data
            self._chunks()
        else:  # "eof": until the connection closes
            self._keep(data)

    def _start_body(self, status: int, headers: dict[str, str]) -> None:
        if status < 200 or 300 <= status < 400:
            raise NotPlain(f"a {status} answer")  # 1xx, redirects
        coding = headers.get("content-encoding", "identity").strip().lower()
        if coding not in ("identity", ""):
            raise NotPlain(f"a body in {coding!r}")
        transfer = headers.get("transfer-encoding", "").strip().lower()
        if status in _NO_BODY:
            self._mode = ""
        elif transfer:
            if transfer != "chunked":
                raise NotPlain(f"a body in transfer-encoding {transfer!r}")
            self._mode = "chunked"
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit() or not length.isascii():
                raise NotPlain(f"Content-Length: {length[:40]!r}")
            self._left = int(length)
            self._mode = "length" if self._left else ""
            if self._limit is not None and status < 400 and self._left > self._limit:
                raise TooLong(f"answered {self._left} bytes", self._response())
        else:
            self._mode = "eof"

    def _chunks(self) -> None:
        buf = self._buf
        while True:
            if self._chunk_state == "size":
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > 4096:
                        raise BrokenResponse("a chunk size line over 4 KiB")
                    return
                size = bytes(buf[:end]).split(b";", 1)[0].strip()
                if not size or size.strip(b"0123456789abcdefABCDEF"):
                    raise BrokenResponse(f"the chunk size {size[:20]!r}")
                del buf[:end + 2]
                self._left = int(size, 16)
                self._chunk_state = "data" if self._left else "trailer"
            elif self._chunk_state == "data":
                take = bytes(buf[:self._left])
                if not take:
                    return
                self._keep(take)
                del buf[:len(take)]
                self._left -= len(take)
                if self._left == 0:
                    self._chunk_state = "crlf"
            elif self._chunk_state == "crlf":
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise BrokenResponse("a chunk not followed by CRLF")
                del buf[:2]
                self._chunk_state = "size"
            else:  # trailer fields, up to an empty line
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise BrokenResponse("trailers over 64 KiB")
                    return
                del buf[:end + 2]
                if end == 0:
                    self._finish(keep=True)
                    return


class _Pool:
    """Idle connections of one event loop, by (scheme, host, port), and how many are open."""

    def __init__(self) -> None:
        self.idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self.open: dict[tuple[str, str, int], int] = {}
        self.waiting: dict[tuple[str, str, int], deque[asyncio.Future[None]]] = {}

    async def take(self, key: tuple[str, str, int]) -> _Connection:
        idle = self.idle.setdefault(key, [])
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and \
                    not conn.transport.is_closing():
                return conn
            self._gone(key)
        while self.open.get(key, 0) >= MAX_CONNECTIONS:
            waiter = asyncio.get_running_loop().create_future()
            self.waiting.setdefault(key, deque()).append(waiter)
            await waiter
            if idle:
                return await self.take(key)
        self.open[key] = self.open.get(key, 0) + 1
        scheme, host, port = key
        secure = scheme == "https"
        port = port or (443 if secure else 80)
        try:
            _, conn = await asyncio.get_running_loop().create_connection(
                _Connection, host, port, ssl=_tls() if secure else None,
                server_hostname=host if secure else None)
        except BaseException as exc:
            self._gone(key)
            # socket.gaierror, EHOSTUNREACH, ENETUNREACH; not a refusal (a ConnectionError)
            if isinstance(exc, OSError) and not isinstance(exc, (ConnectionError, ssl.SSLError)):
                raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from exc
            raise
        return conn

    def give(self, key: tuple[str, str, int], conn: _Connection) -> None:
        if conn.closed or conn.transport is None or conn.transport.is_closing():
            self._gone(key)
        else:
            self.idle.setdefault(key, []).append(conn)
            self._wake(key)

    def drop(self, key: tuple[str, str, int], conn: _Connection) -> None:
        conn._abort()
        self._gone(key)

    def _gone(self, key: tuple[str, str, int]) -> None:
        self.open[key] = self.open.get(key, 1) - 1
        self._wake(key)

    def _wake(self, key: tuple[str, str, int]) -> None:
        waiters = self.waiting.get(key)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


# Per event loop. A forked child (a DataLoader worker) runs its own loop, so it never touches
# the connections of the parent's pool, whose sockets it shares.
_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pool] = \
    weakref.WeakKeyDictionary()


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


async def get(url: Any, headers: dict[str, str], limit: int | None = None) -> Response:
    """GET ``url`` (a ``yarl.URL``) with ``headers``. Raises ``NotPlain`` (ask a full client),
    ``TooLong`` (a successful answer of more than ``limit`` bytes), ``BrokenResponse`` or
    another ``OSError`` of the connection; the status is the caller's to check. An error
    answer's body is cut at ``MAX_ERROR_BODY``."""
    key, request = _plain_target(url, headers)
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None:
        pool = _POOLS[loop] = _Pool()
    for _ in range(MAX_CONNECTIONS + 1):
        conn = await pool.take(key)
        reused = conn.used
        try:
            response = await conn.send(request, limit)
        except BrokenResponse:
            pool.drop(key, conn)
            # A kept-alive connection the server closed as we wrote: asked again at once,
            # as browsers and aiohttp do; not a failure of the server. On the next idle
            # one too (a server that restarted closed them all), until a new connection.
            # (Twice only, it raised "unreachable".)
            if reused and not conn._got_any:
                continue
            raise
        except BaseException:  # NotPlain, TooLong, a timeout's cancellation: answer unread
            pool.drop(key, conn)
            raise
        pool.give(key, conn)
        return response
    raise BrokenResponse(f"every connection kept alive to {key[1]} was closed as a request "
                         "went out")
