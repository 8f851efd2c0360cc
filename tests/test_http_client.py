"""The lean HTTP/1.1 client that GETs samples (``lcache.data.http_client``), against a real
loopback server that answers from a script, byte by byte where it matters: every framing it
knows gives the exact body, what it does not know goes to aiohttp, and a connection is
reused only when its answer ended where its framing said."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yarl
from hypothesis import given, settings
from hypothesis import strategies as st

from lcache.data import RangeSource, SourceError, http_client

BODY = bytes(range(256)) * 40  # 10,240 bytes


def _answer(status: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"HTTP/1.1 {status}\r\n{head}\r\n".encode("latin-1") + body


def _chunked(body: bytes, size: int) -> bytes:
    out = b""
    for i in range(0, len(body), size):
        piece = body[i:i + size]
        out += f"{len(piece):x};ext=1\r\n".encode() + piece + b"\r\n"
    return out + b"0\r\nX-Trailer: t\r\n\r\n"


# (method, path, nth request on its connection) -> (answer, then close the connection?);
# answers go out in pieces of ``step`` bytes; None: close without answering.
Script = Callable[[str, str, int], tuple[bytes | None, bool]]
HEAD = _answer("200 OK", {"Content-Length": str(len(BODY))})  # every HEAD: BODY's size


def _read_head(conn: socket.socket, buf: bytes) -> tuple[bytes, bytes] | None:
    """The next request's head on ``conn`` (``buf``: what came after the last one) and the
    bytes after it, or None once the client closed."""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


class ScriptedServer:
    """Answers each GET with ``script`` (a HEAD with BODY's size); counts connections and
    keeps the GETs' heads."""

    def __init__(self, script: Script, step: int = 0, tls: ssl.SSLContext | None = None
                 ) -> None:
        self.script, self.step, self.tls = script, step, tls
        self.connections = 0
        self.requests: list[str] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http{'s' if tls else ''}://localhost:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        if self.tls is not None:
            try:
                conn = self.tls.wrap_socket(conn, server_side=True)
            except (ssl.SSLError, OSError):  # a client that refused the certificate
                conn.close()
                return
        with conn, contextlib.suppress(OSError):  # a client that hung up (a reset)
            buf = b""
            nth = 0
            while True:
                got = _read_head(conn, buf)
                if got is None:
                    return
                head, buf = got
                method, path, _ = head.decode("latin-1").split("\r\n")[0].split(" ")
                if method == "HEAD":
                    conn.sendall(HEAD)
                    continue
                nth += 1
                self.requests.append(head.decode("latin-1"))
                answer, close = self.script(method, path, nth)
                if answer is None:
                    return
                step = self.step or len(answer) or 1
                for i in range(0, len(answer), step):
                    conn.sendall(answer[i:i + step])
                if close:
                    return

    def close(self) -> None:
        self._sock.close()


@contextmanager
def scripted(script: Script, step: int = 0, tls: ssl.SSLContext | None = None
             ) -> Iterator[ScriptedServer]:
    server = ScriptedServer(script, step, tls)
    try:
        yield server
    finally:
        server.close()


def _get(url: str, headers: dict[str, str] | None = None) -> http_client.Response:
    async def go() -> http_client.Response:
        return await http_client.get(yarl.URL(url), headers or {})
    return asyncio.run(go())


@pytest.mark.parametrize("step", [1, 7, 0], ids=["1-byte-sends", "7-byte-sends", "one-send"])
@pytest.mark.parametrize("framing", ["length", "chunked", "until-close", "http/1.0"])
def test_every_framing_gives_the_exact_body(framing: str, step: int) -> None:
    def script(method: str, path: str, nth: int) -> tuple[bytes | None, bool]:
        if framing == "length":
            return _answer("200 OK", {"Content-Length": str(len(BODY))}, BODY), False
        if framing == "chunked":
            return _answer("200 OK", {"Transfer-Encoding": "chunked"}, _chunked(BODY, 1000)), \
                False
        if framing == "http/1.0":
            return b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY, True
        return _answer("200 OK", {}, BODY), True  # framed by the connection's end

    with scripted(script, step) as server:
        async def three() -> list[bytes]:
            return [(await http_client.get(yarl.URL(f"{server.url}/x{i}"), {})).body
                    for i in range(3)]
        assert asyncio.run(three()) == [BODY] * 3
        reusable = framing in ("length", "chunked")
        assert server.connections == (1 if reusable else 3)


def test_a_request_says_its_host_and_asks_for_no_content_coding() -> None:
    with scripted(lambda m, p, n: (_answer("200 OK", {"Content-Length": "2"}, b"ok"), False)
                  ) as server:
        r = _get(f"{server.url}/a%20b?q=1", {"Range": "bytes=0-1"})
        assert (r.status, r.body) == (200, b"ok")
        request = server.requests[0].split("\r\n")
        assert request[0] == "GET /a%20b?q=1 HTTP/1.1"
        assert f"Host: {server.url.split('//')[1]}" in request
        assert "Accept-Encoding: identity" in request and "Range: bytes=0-1" in request


@pytest.mark.parametrize("answer", [
    _answer("302 Found", {"Location": "/elsewhere", "Content-Length": "0"}),
    _answer("200 OK", {"Content-Encoding": "gzip", "Content-Length": "3"}, b"abc"),
    _answer("200 OK", {"Transfer-Encoding": "gzip, chunked"}, b"0\r\n\r\n"),
    b"HTTP/1.1 100 Continue\r\n\r\n",
    b"HTTP/2 200 OK\r\n\r\n",
    _answer("200 OK", {"Content-Length": "3", "content-length": "4"}, b"abc"),
    b"HTTP/1.1 200 OK\r\n folded: header\r\nContent-Length: 0\r\n\r\n",
    _answer("200 OK", {"X-Big": "x" * 70_000, "Content-Length": "2"}, b"ok"),
], ids=["redirect", "gzip", "transfer-coding", "1xx", "http2", "two-lengths", "folded",
        "head-over-64KiB"])
def test_what_the_client_does_not_know_is_left_to_a_full_client(answer: bytes) -> None:
    with scripted(lambda m, p, n: (answer, False)) as server, pytest.raises(http_client.NotPlain):
        _get(f"{server.url}/x")


@pytest.mark.parametrize("header", [{"X-A": "1\r\nX-Injected: 1"}, {"Connection": "close"},
                                    {"Accept-Encoding": "gzip"}])
def test_request_headers_it_cannot_send_as_given_are_left_to_a_full_client(
        header: dict[str, str]) -> None:
    with pytest.raises(http_client.NotPlain):
        _get("http://127.0.0.1:9/x", header)


@pytest.mark.parametrize("answer", [
    _answer("200 OK", {"Content-Length": "100"}, b"x" * 50),
    _answer("200 OK", {"Transfer-Encoding": "chunked"}, b"10\r\n" + b"x" * 8),
    _answer("200 OK", {"Transfer-Encoding": "chunked"}, b"zz\r\n"),
    _answer("200 OK", {"Transfer-Encoding": "chunked"}, b"2\r\nabXY"),
], ids=["cut", "chunk-cut", "bad-size", "no-crlf"])
def test_a_body_cut_short_or_misframed_is_a_connection_error(answer: bytes) -> None:
    with scripted(lambda m, p, n: (answer, True)) as server, \
            pytest.raises(http_client.BrokenResponse):
        _get(f"{server.url}/x")


def test_bytes_past_the_framed_end_are_not_taken_and_the_connection_is_not_reused() -> None:
    extra = _answer("200 OK", {"Content-Length": "3"}, b"abcHTTP/1.1 200 OK\r\n\r\n")
    with scripted(lambda m, p, n: (extra, False)) as server:
        async def two() -> list[bytes]:
            return [(await http_client.get(yarl.URL(f"{server.url}/x"), {})).body
                    for _ in range(2)]
        assert asyncio.run(two()) == [b"abc", b"abc"]
        assert server.connections == 2


def test_a_kept_alive_connection_the_server_closed_is_replaced_without_a_retry() -> None:
    """The server drops a kept-alive connection as the next request arrives (its idle
    timeout, met just then): that request fails before any byte comes back, and is sent
    again on a new connection. The source's retries are 0: a retry would have failed it."""
    ok = _answer("206 Partial Content", {"Content-Length": "10",
                                         "Content-Range": "bytes 0-9/10240"}, BODY[:10])
    with scripted(lambda m, p, n: (ok if n == 1 else None, False)) as server:
        src = RangeSource(server.url, "f.bin", [0], [10], retries=0)
        assert src.fetch_many([0]) == [BODY[:10]]
        assert src.fetch_many([0]) == [BODY[:10]]
        assert len(server.requests) == 3  # the second GET twice


def test_a_source_reads_through_what_the_client_leaves_to_aiohttp() -> None:
    """A redirect and a gzipped answer, through a source: the client hands both to aiohttp,
    which follows the one and inflates the other; the bytes are the stored ones."""
    def script(method: str, path: str, nth: int) -> tuple[bytes | None, bool]:
        if path == "/moved.bin":
            return _answer("302 Found", {"Location": "/f.bin", "Content-Length": "0"}), False
        packed = gzip.compress(BODY[:100])
        return _answer("206 Partial Content", {
            "Content-Range": f"bytes 0-99/{len(BODY)}", "Content-Encoding": "gzip",
            "Content-Length": str(len(packed))}, packed), False

    with scripted(script) as server:
        assert RangeSource(server.url, "moved.bin", [0], [100]).fetch_many([0]) == [BODY[:100]]
        assert RangeSource(server.url, "f.bin", [0], [100]).fetch_many([0]) == [BODY[:100]]


def test_an_error_status_is_retried_when_transient_and_named() -> None:
    answers = iter([_answer("503 Service Unavailable", {"Content-Length": "0"}),
                    _answer("206 Partial Content", {"Content-Range": "bytes 0-9/10240",
                                                    "Content-Length": "10"}, BODY[:10])])
    with scripted(lambda m, p, n: (next(answers), False)) as server:
        src = RangeSource(server.url, "f.bin", [0], [10], backoff=0.001)
        assert src.fetch_many([0]) == [BODY[:10]]
    with scripted(lambda m, p, n: (_answer("403 Forbidden", {"Content-Length": "0"}), False)
                  ) as server:
        with pytest.raises(SourceError, match=r"403, message='Forbidden'"):
            RangeSource(server.url, "f.bin", [0], [10], backoff=0.001).fetch_many([0])
        assert len(server.requests) == 1  # a refusal is not asked again


def test_https_with_the_systems_trust_store(tmp_path: Path) -> None:
    """HTTPS, its certificate checked against the trust store ``SSL_CERT_FILE`` names: a
    GET to a server it vouches for succeeds, the same GET without it is refused. In a child
    process, whose trust store is its own."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    ok = _answer("200 OK", {"Content-Length": str(len(BODY))}, BODY)
    child = ("import asyncio, sys, yarl\n"
             "from lcache.data import http_client\n"
             "r = asyncio.run(http_client.get(yarl.URL(sys.argv[1]), {}))\n"
             "sys.exit(0 if r.body == bytes(range(256)) * 40 else 3)\n")
    with scripted(lambda m, p, n: (ok, False), tls=tls) as server:
        trusted = subprocess.run([sys.executable, "-c", child, f"{server.url}/x"],
                                 env={**os.environ, "SSL_CERT_FILE": str(cert)},
                                 capture_output=True, text=True)
        assert trusted.returncode == 0, trusted.stderr
        assert len(server.requests) == 1
        refused = subprocess.run([sys.executable, "-c", child, f"{server.url}/x"],
                                 env={**os.environ, "SSL_CERT_FILE": str(tmp_path / "none")},
                                 capture_output=True, text=True)
        assert "CERTIFICATE_VERIFY_FAILED" in refused.stderr


@settings(max_examples=40, deadline=None)
@given(body=st.binary(max_size=3000), framing=st.sampled_from(["length", "chunked", "close"]),
       chunk=st.integers(1, 700), step=st.integers(1, 900))
def test_any_body_in_any_framing_and_any_pieces_comes_back_exact(
        body: bytes, framing: str, chunk: int, step: int) -> None:
    if framing == "length":
        answer = _answer("200 OK", {"Content-Length": str(len(body))}, body)
    elif framing == "chunked":
        answer = _answer("200 OK", {"Transfer-Encoding": "chunked"}, _chunked(body, chunk))
    else:
        answer = _answer("200 OK", {}, body)
    with scripted(lambda m, p, n: (answer, framing == "close"), step) as server:
        assert _get(f"{server.url}/x").body == body


class _Wire(asyncio.Transport):
    """The client's side of a connection, fed by hand: what the client wrote, and whether
    it dropped the connection."""

    def __init__(self) -> None:
        super().__init__()
        self.written, self.aborted = b"", False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_an_answer_cut_anywhere_parses_the_same(framing: str) -> None:
    """Every place the bytes of an answer can be cut in two, and one byte at a time, fed to
    the client's protocol as the network would deliver them: the same body each time, the
    connection kept, and not a byte past the end taken."""
    body = bytes(range(256))[:150]
    answer = _answer("200 OK", {"Content-Length": str(len(body))}, body) \
        if framing == "length" else \
        _answer("200 OK", {"Transfer-Encoding": "chunked"}, _chunked(body, 40))
    cuts = [[answer[:k], answer[k:]] for k in range(1, len(answer))] + \
        [[answer[i:i + 1] for i in range(len(answer))]]

    async def parse(pieces: list[bytes]) -> tuple[bytes, bool]:
        conn = http_client._Connection()
        wire = _Wire()
        conn.connection_made(wire)
        answered = conn.send(b"GET / HTTP/1.1\r\n\r\n", None)
        for piece in pieces:
            conn.data_received(piece)
        return (await answered).body, wire.aborted

    for pieces in cuts:
        assert asyncio.run(parse(pieces)) == (body, False)
    assert asyncio.run(parse([answer + b"H"]))[1]  # a byte past the end: dropped


def test_past_the_pools_limit_requests_wait_for_a_connection() -> None:
    """More requests at once than the pool opens connections to one host: the rest wait for
    one to come back, none fails, and no more than the limit are ever opened."""
    def slow(method: str, path: str, nth: int) -> tuple[bytes | None, bool]:
        time.sleep(0.05)  # held: the requests overlap
        return _answer("200 OK", {"Content-Length": "2"}, b"ok"), False

    with scripted(slow) as server:
        async def many() -> list[bytes]:
            gets = [http_client.get(yarl.URL(f"{server.url}/{i}"), {}) for i in range(250)]
            # bounded: a waiter never woken would hang the suite
            return [r.body for r in await asyncio.wait_for(asyncio.gather(*gets), 60)]
        assert asyncio.run(many()) == [b"ok"] * 250
    assert server.connections == http_client.MAX_CONNECTIONS


def test_a_name_that_does_not_resolve_is_a_transient_connection_failure() -> None:
    """As aiohttp's connector errors were: a resolver's hiccup is asked again (a connection
    refused is not: nothing listens there)."""
    from lcache.data.remote import is_transient

    with pytest.raises(http_client.ConnectFailed, match=r"x\.invalid:80") as failed:
        _get("http://x.invalid/a")
    assert is_transient(failed.value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        with pytest.raises(ConnectionRefusedError) as refused:
            _get(f"http://127.0.0.1:{port}/a")
    assert not is_transient(refused.value)


class EndlessServer(ScriptedServer):
    """Answers every GET with ``head`` and then ``piece`` again and again, until the client
    goes away or ``CAP`` bytes of body went out; counts the body bytes sent. HEADs get
    BODY's size."""

    CAP = 256 << 20

    def __init__(self, head: bytes, piece: bytes) -> None:
        self.head, self.piece = head, piece
        self.sent = 0
        self.done = threading.Event()
        super().__init__(lambda m, p, n: (None, True))

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the client hung up: what it was asked
            buf = b""
            try:
                while True:
                    got = _read_head(conn, buf)
                    if got is None:
                        return
                    head, buf = got
                    if head.startswith(b"HEAD"):
                        conn.sendall(HEAD)
                        continue
                    conn.sendall(self.head)
                    while self.sent < self.CAP:
                        conn.sendall(self.piece)
                        self.sent += len(self.piece)
                    return
            finally:
                self.done.set()

    def __enter__(self) -> EndlessServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_MIB = b"x" * (1 << 20)


@pytest.mark.parametrize("head,piece", [
    (_answer("200 OK", {"Content-Length": str(1 << 40)}), _MIB),
    (_answer("200 OK", {"Transfer-Encoding": "chunked"}), b"%x\r\n" % len(_MIB) + _MIB + b"\r\n"),
    (_answer("200 OK", {}), _MIB),
    (_answer("206 Partial Content", {"Content-Range": "bytes 0-9/10240"}), _MIB),
], ids=["huge-length", "endless-chunks", "until-close", "range-until-close"])
def test_an_answer_longer_than_asked_is_not_read_past_the_request(head: bytes,
                                                                  piece: bytes) -> None:
    """A server that ignores Range, or one whose body never ends: the client stops at the
    range's length and names the fault, instead of holding a body of any size in memory
    (or reading it until the timeout)."""
    with EndlessServer(head, piece) as server:
        src = RangeSource(server.url, "f.bin", [0], [10], retries=0, timeout=60)
        with pytest.raises(SourceError, match=r"answered (more than 10|1099511627776) bytes "
                           r"for bytes 0-10 \(a server that ignores Range requests\?\)"):
            src.fetch_many([0])
        assert server.done.wait(30)
        assert server.sent < EndlessServer.CAP // 4  # the client hung up early


def test_an_error_answers_body_is_not_read_past_a_bound() -> None:
    """A 404 (or a 503) with a body that never ends: its status is all that is used."""
    with EndlessServer(_answer("404 Not Found", {}), _MIB) as server:
        with pytest.raises(SourceError, match="FileNotFoundError"):
            RangeSource(server.url, "f.bin", [0], [10], timeout=60).fetch_many([0])
        assert server.done.wait(30)
        assert server.sent < EndlessServer.CAP // 4


def test_a_compressed_answer_is_bounded_after_inflating() -> None:
    """The same through aiohttp (which the client leaves a gzipped body to): 64 MiB of
    zeros in 64 KiB of gzip for a 10-byte range is refused at 10 bytes, not inflated."""
    bomb = gzip.compress(bytes(64 << 20), 9)
    answer = _answer("206 Partial Content", {
        "Content-Range": "bytes 0-9/10240", "Content-Encoding": "gzip",
        "Content-Length": str(len(bomb))}, bomb)
    with scripted(lambda m, p, n: (answer, False)) as server, \
            pytest.raises(SourceError, match=r"answered more than 10 bytes for bytes 0-10"):
        RangeSource(server.url, "f.bin", [0], [10], retries=0).fetch_many([0])


def test_an_index_whose_answer_never_ends_is_not_read_past_a_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An index or a table is read whole, with no size known before: it is read up to
    ``MAX_DOCUMENT`` bytes (1 GiB; 4 MiB here), not until the memory runs out."""
    from lcache.data import MDSSource, remote

    monkeypatch.setattr(remote, "MAX_DOCUMENT", 4 << 20)
    with EndlessServer(_answer("200 OK", {}), _MIB) as server:
        with pytest.raises(SourceError, match=r"cannot read the index \S+/index.json: .*"
                           r"answered more than 4194304 bytes, past the 4.0 MiB it may hold"):
            MDSSource(server.url, retries=0, timeout=60)
        assert server.done.wait(30)
        assert server.sent < EndlessServer.CAP // 4


def test_an_s3_answer_longer_than_asked_is_not_read_past_the_request() -> None:
    """The same over S3 (aiobotocore, s3fs): an endpoint whose 206 never ends was read
    whole, 256 MiB for a 10-byte range, then refused."""
    head = _answer("206 Partial Content", {"Content-Range": "bytes 0-9/10240", "ETag": '"e"'})
    with EndlessServer(head, _MIB) as server:
        src = RangeSource("s3://bucket", "f.bin", [0], [10], retries=0, timeout=60,
                          storage_options={"endpoint_url": server.url, "anon": True})
        with pytest.raises(SourceError, match=r"s3://bucket/f.bin answered more than 10 bytes "
                           r"for bytes 0-10 \(an endpoint that ignores Range requests\?\)"):
            src.fetch_many([0])
        assert server.done.wait(30)
        assert server.sent < EndlessServer.CAP // 4


def test_an_answer_aiohttp_cannot_parse_is_named_as_such_not_as_a_400() -> None:
    """aiohttp refuses a malformed head (here a signed Content-Length) with a
    ClientResponseError of status 400, which read as the server's own 400 (helper 107)."""
    bad = b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-9/10240\r\n" \
          b"Content-Length: +10\r\n\r\n0123456789"
    with scripted(lambda m, p, n: (bad, False)) as server, \
            pytest.raises(SourceError, match=r"f.bin sent an answer that is not valid HTTP "
                          r"\(Invalid character in Content-Length\)") as refused:
        RangeSource(server.url, "f.bin", [0], [10], backoff=0.001).fetch_many([0])
    assert "400" not in str(refused.value)


def test_every_idle_connection_the_server_closed_is_replaced_without_a_retry() -> None:
    """A server that restarted closed all the kept-alive connections: the request is sent
    again on each idle one in turn, then on a new one. It was sent twice only, and then
    raised AssertionError("unreachable") (seen once in the faulty-remote test)."""
    ok = _answer("200 OK", {"Content-Length": "2"}, b"ok")

    def script(method: str, path: str, nth: int) -> tuple[bytes | None, bool]:
        if nth > 1:
            return None, False  # closed as the next request came: the restart
        time.sleep(0.1)  # the first three overlap: three connections
        return ok, False

    with scripted(script) as server:
        async def go() -> list[bytes]:
            first = await asyncio.gather(*[http_client.get(yarl.URL(f"{server.url}/{i}"), {})
                                           for i in range(3)])
            again = await http_client.get(yarl.URL(f"{server.url}/again"), {})
            return [r.body for r in (*first, again)]
        assert asyncio.run(go()) == [b"ok"] * 4
        assert server.connections == 4
