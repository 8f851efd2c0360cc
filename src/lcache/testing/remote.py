"""A throttled loopback HTTP server: the "slow remote storage" of tests, demo and benchmarks.

Serves a directory (GET with Range support, and an HTML listing that fsspec's HTTP
filesystem can walk) with a fixed latency per request and one bandwidth cap shared by all
connections, so every system under test sees the same remote. Counts requests (per path)
and bytes. ``fault=`` makes it misbehave on chosen requests (see ``FAULTS``), to test
retries and the checks of what came back.

Why asyncio, on one thread: a remote's own work should not weigh on the machine that runs
the systems under test. ``http.server``'s thread per connection cost about 1.5 ms of CPU
per request on a 2-core VM (32 threads taking turns at the GIL), so a system that makes
many small requests was measured against this server's CPU, not against the remote's
latency and bandwidth. This one costs a small fraction of that.
"""

from __future__ import annotations

import asyncio
import email.utils
import gzip
import html
import json
import os
import socket
import struct
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

# What ``fault(path, nth)`` may answer for the nth GET of a path (None: serve it):
FAULTS = {
    "500": "HTTP 500", "502": "HTTP 502", "503": "HTTP 503", "403": "HTTP 403",
    "404": "HTTP 404", "429": "HTTP 429",
    "reset": "close the connection with a TCP reset before answering",
    "cut": "announce the full length, send half the body, close the connection",
    "short": "answer honestly with half the asked bytes (a truncated object)",
    "ignore-range": "send the whole file with 200, as a server without Range support",
    "misplaced": "answer a range with as many bytes from the start of the file, labelled so "
                 "(right length, wrong place)",
    "loud-range": "label a range 'BYTES  a-b/size' (RFC 9110 allows any case and spacing)",
    "sort-links": "a listing also links its sort orders (?C=N;O=D), as Apache and nginx do",
    "stall": "wait stall_seconds (30) before closing without an answer (a client timeout)",
    "gzip": "to a client that accepts gzip, send the whole file gzipped with 200 (as nginx's "
            "gzip does, dropping Range)",
}
REASONS = {200: "OK", 206: "Partial Content", 301: "Moved Permanently", 403: "Forbidden",
           404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error",
           501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable"}
CHUNK = 256 << 10


class _Throttle:
    """A token bucket shared by all connections: ``rate`` bytes/s (0 = unlimited)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._next = time.monotonic()

    def delay(self, nbytes: int) -> float:
        """Seconds to wait before sending ``nbytes`` (the server's one thread calls it)."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        start = max(now, self._next)
        self._next = start + nbytes / self.rate
        return self._next - now


class _Close(Exception):
    """End this connection (after a fault, or a request that asks to)."""


class ThrottledServer:
    """``ThrottledServer(root, latency=0.005, bandwidth=100e6)``: 5 ms per request and
    100 MB/s for all connections together (the defaults, 0 and 0, throttle nothing);
    ``.url`` is its base URL. Use as a context manager (serves from a background thread).
    ``fault(path, nth)`` is asked before each GET (the nth of that URL path, from 1) and may
    name one of ``FAULTS``.
    ``etags=True`` adds an ETag (size and modification time) to files, as object stores
    send; ``stats_path`` answers the counters as JSON there, uncounted and unthrottled."""

    def __init__(self, root: str, *, latency: float = 0.0, bandwidth: float = 0.0,
                 fault: Callable[[str, int], str | None] | None = None,
                 etags: bool = False, stats_path: str | None = None) -> None:
        self.root = os.path.abspath(root)
        self.fault = fault  # (URL path, nth GET of it) -> a FAULTS key, or None
        self.stall_seconds = 30.0
        self.latency = latency
        self.throttle = _Throttle(bandwidth)
        self.etags = etags
        self.stats_path = stats_path
        self.stats_lock = threading.Lock()  # for readers in other threads
        self.requests = 0
        self.bytes_sent = 0
        self.paths: Counter[str] = Counter()  # GETs per URL path
        self.heads: Counter[str] = Counter()  # HEADs per URL path
        self.in_flight = 0  # GET and HEAD requests being answered, and the most at once
        self.most_in_flight = 0
        self.connection_errors = 0  # clients that dropped a connection mid-answer
        self._hooks = ThreadPoolExecutor(64, thread_name_prefix="throttled-server-fault")
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", 0, backlog=1024))
        self.port = self._server.sockets[0].getsockname()[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThrottledServer:
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="throttled-server")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join()
        self._loop.close()
        self._hooks.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------------- connections
    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no delayed-ACK waits
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    break
                lines = head.decode("latin-1").split("\r\n")
                method, target, version = [*lines[0].split(" "), "", ""][:3]
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (line.partition(":") for line in lines[1:] if line)}
                await self._answer(method, target, headers, writer)
                if version != "HTTP/1.1" or headers.get("connection", "").lower() == "close":
                    break
        except (_Close, asyncio.CancelledError):  # a fault, or the server stopping
            pass
        except ConnectionError:  # routine: a client dropped a kept-alive connection
            self.connection_errors += 1
        finally:
            writer.close()

    async def _answer(self, method: str, target: str, headers: dict[str, str],
                      writer: asyncio.StreamWriter) -> None:
        if method == "GET" and self.stats_path is not None and target == self.stats_path:
            body = json.dumps({"bytes_sent": self.bytes_sent, "requests": self.requests,
                               "most_in_flight": self.most_in_flight}).encode()
            self._send(writer, 200, {"Content-Type": "application/json"}, body)
            return
        if method not in ("GET", "HEAD"):
            self._send(writer, 501, {}, b"")
            return
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.latency)
            if method == "HEAD":
                with self.stats_lock:
                    self.heads[target] += 1
                await self._serve(target, headers, writer, None, body=False)
                return
            with self.stats_lock:
                self.requests += 1
                self.paths[target] += 1
                nth = self.paths[target]
            fault = None
            if self.fault is not None:  # a hook may block (tests hold requests in it)
                fault = await asyncio.get_running_loop().run_in_executor(
                    self._hooks, self.fault, target, nth)
            if fault is not None and fault not in FAULTS:
                raise ValueError(f"unknown fault {fault!r}; one of {sorted(FAULTS)}")
            if fault is not None and fault.isdigit():
                self._send(writer, int(fault), {"Connection": "close"}, b"")
                raise _Close
            if fault == "reset":  # SO_LINGER 0: close() sends RST instead of FIN
                writer.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                raise _Close
            if fault == "stall":
                await asyncio.sleep(self.stall_seconds)
                raise _Close
            await self._serve(target, headers, writer, fault, body=True)
        finally:
            self.in_flight -= 1

    async def _serve(self, target: str, headers: dict[str, str],
                     writer: asyncio.StreamWriter, fault: str | None, *, body: bool) -> None:
        url_path = urllib.parse.unquote(target.split("?", 1)[0].split("#", 1)[0])
        parts = [p for p in url_path.split("/") if p not in ("", ".", "..")]
        path = os.path.join(self.root, *parts)
        if os.path.isdir(path):
            if not url_path.endswith("/"):
                # quoted: "a%20b" decoded is "a b", which is another folder
                self._send(writer, 301, {"Location": urllib.parse.quote(url_path + "/")}, b"")
                return
            listing = _listing(path, url_path, sort_links=fault == "sort-links")
            self._send(writer, 200, {"Content-Type": "text/html; charset=utf-8"},
                       listing if body else b"", length=len(listing))
            return
        try:
            f = open(path, "rb")  # noqa: SIM115
        except OSError:
            self._send(writer, 404, {}, b"")
            return
        with f:
            st = os.fstat(f.fileno())
            size = st.st_size
            meta = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                    "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True)}
            if self.etags:
                meta["ETag"] = f'"{size:x}-{st.st_mtime_ns:x}"'
            if not body:
                self._send(writer, 200, meta, b"", length=size)
                return
            if fault == "gzip" and "gzip" in headers.get("accept-encoding", ""):
                packed = gzip.compress(f.read())
                self._send(writer, 200, {**meta, "Content-Encoding": "gzip"}, packed)
                return
            start, end, status = 0, size, 200
            rng = headers.get("range", "")
            if rng.startswith("bytes=") and fault != "ignore-range":
                lo, _, hi = rng[6:].partition("-")
                start = int(lo) if lo else max(0, size - int(hi))
                end = min(size, int(hi) + 1) if hi and lo else size
                status = 206
                meta["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
            if fault == "misplaced" and status == 206:
                start, end = 0, end - start
                meta["Content-Range"] = f"bytes 0-{end - 1}/{size}"
            elif fault == "loud-range" and status == 206:
                meta["Content-Range"] = f"BYTES  {start}-{end - 1}/{size}"
            announced = end - start
            if fault == "short":
                announced = (end - start) // 2
                end = start + announced
            elif fault == "cut":
                end = start + (end - start) // 2
            self._send(writer, status, meta, b"", length=announced)
            f.seek(start)
            left = end - start
            while left:
                chunk = f.read(min(left, CHUNK))
                if not chunk:
                    break
                delay = self.throttle.delay(len(chunk))
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(chunk)
                await writer.drain()
                left -= len(chunk)
                with self.stats_lock:
                    self.bytes_sent += len(chunk)
            if fault == "cut":
                raise _Close

    @staticmethod
    def _send(writer: asyncio.StreamWriter, status: int, headers: dict[str, str],
              body: bytes, length: int | None = None) -> None:
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}",
                 f"Content-Length: {len(body) if length is None else length}",
                 *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)


def _listing(path: str, url_path: str, sort_links: bool = False) -> bytes:
    """An HTML page of the directory's entries (directories end in "/"), as
    ``http.server`` writes it: what fsspec's HTTP filesystem reads links from."""
    names = sorted(os.listdir(path), key=str.lower)
    items = [f'<li><a href="?C={c};O=D">sort</a></li>' for c in "NM"] if sort_links else []
    for name in names:
        link = name + "/" if os.path.isdir(os.path.join(path, name)) else name
        items.append(f'<li><a href="{urllib.parse.quote(link)}">{html.escape(link)}</a></li>')
    title = html.escape(f"Directory listing for {url_path}")
    page = (f"<!DOCTYPE HTML>\n<html>\n<head><title>{title}</title></head>\n<body>\n"
            f"<h1>{title}</h1>\n<hr>\n<ul>\n" + "\n".join(items) + "\n</ul>\n<hr>\n</body>\n"
            "</html>\n")
    return page.encode("utf-8", "surrogateescape")
