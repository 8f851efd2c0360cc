"""A throttled loopback HTTP server: the "slow remote storage" of tests, demo and benchmarks.

Serves a directory (GET with Range support, and an HTML listing that fsspec's HTTP
filesystem can walk) with a fixed latency per request and one bandwidth cap shared by all
connections, so every system under test sees the same remote. Counts requests (per path)
and bytes. ``fault=`` makes it misbehave on chosen requests (see ``FAULTS``), to test
retries and the checks of what came back.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# What ``fault(path, nth)`` may answer for the nth GET of a path (None: serve it):
FAULTS = {
    "500": "HTTP 500", "502": "HTTP 502", "503": "HTTP 503", "403": "HTTP 403",
    "404": "HTTP 404", "429": "HTTP 429",
    "reset": "close the connection with a TCP reset before answering",
    "cut": "announce the full length, send half the body, close the connection",
    "short": "answer honestly with half the asked bytes (a truncated object)",
    "ignore-range": "send the whole file with 200, as a server without Range support",
    "stall": "wait stall_seconds (30) before closing without an answer (a client timeout)",
}


class _Throttle:
    """A token bucket shared by all connections: ``rate`` bytes/s (0 = unlimited)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def wait(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.rate
            delay = self._next - now
        if delay > 0:
            time.sleep(delay)


class _Handler(SimpleHTTPRequestHandler):
    server: ThrottledServer
    protocol_version = "HTTP/1.1"  # keep-alive: no connection set-up per sample
    disable_nagle_algorithm = True  # else headers and body wait on the delayed ACK (40 ms)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    @contextmanager
    def _in_flight(self) -> Iterator[None]:
        with self.server.stats_lock:
            self.server.in_flight += 1
            self.server.most_in_flight = max(self.server.most_in_flight, self.server.in_flight)
        try:
            yield
        finally:
            with self.server.stats_lock:
                self.server.in_flight -= 1

    def do_GET(self) -> None:
        with self._in_flight():
            self._get()

    def _get(self) -> None:
        time.sleep(self.server.latency)
        with self.server.stats_lock:
            self.server.requests += 1
            self.server.paths[self.path] += 1
            nth = self.server.paths[self.path]
        fault = self.server.fault(self.path, nth) if self.server.fault else None
        if fault is not None and self._misbehave(fault):
            return
        self._serve(fault)

    def _misbehave(self, fault: str) -> bool:
        """Act out ``fault`` if it replaces the answer; False if it only alters it."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; one of {sorted(FAULTS)}")
        if fault.isdigit():
            self.send_error(int(fault))
            return True
        if fault == "reset":  # SO_LINGER 0: close() sends RST instead of FIN
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return True
        if fault == "stall":
            time.sleep(self.server.stall_seconds)
            self.close_connection = True
            return True
        return False

    def _serve(self, fault: str | None) -> None:
        path = self.translate_path(self.path)
        if os.path.isdir(path):
            super().do_GET()
            return
        try:
            f = open(path, "rb")  # noqa: SIM115
        except OSError:
            self.send_error(404, "not found")
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            start, end = 0, size
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and fault != "ignore-range":
                lo, _, hi = rng[6:].partition("-")
                start = int(lo) if lo else max(0, size - int(hi))
                end = min(size, int(hi) + 1) if hi and lo else size
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            else:
                self.send_response(200)
            announced = end - start
            if fault == "short":
                end = announced = start + (end - start) // 2
            elif fault == "cut":
                end = start + (end - start) // 2
                self.close_connection = True
            self.send_header("Content-Length", str(announced))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            f.seek(start)
            left = end - start
            while left:
                chunk = f.read(min(left, 256 << 10))
                if not chunk:
                    break
                self.server.throttle.wait(len(chunk))
                self.wfile.write(chunk)
                left -= len(chunk)
                with self.server.stats_lock:
                    self.server.bytes_sent += len(chunk)

    def do_HEAD(self) -> None:
        with self._in_flight():
            time.sleep(self.server.latency)
            with self.server.stats_lock:
                self.server.heads[self.path] += 1
            super().do_HEAD()


class ThrottledServer(ThreadingHTTPServer):
    """``ThrottledServer(root, latency=0.005, bandwidth=100e6)``; ``.url`` is its base URL.
    Use as a context manager (serves from a background thread). ``fault(path, nth)`` is
    asked before each GET (the nth of that URL path, from 1) and may name one of ``FAULTS``."""

    daemon_threads = True
    request_queue_size = 1024  # the default (5) drops connections beyond it: 1 s retries

    def __init__(self, root: str, *, latency: float = 0.0, bandwidth: float = 0.0,
                 fault: Callable[[str, int], str | None] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), partial(_Handler, directory=root))
        self.fault = fault  # (URL path, nth GET of it) -> a FAULTS key, or None
        self.stall_seconds = 30.0
        self.latency = latency
        self.throttle = _Throttle(bandwidth)
        self.stats_lock = threading.Lock()
        self.requests = 0
        self.bytes_sent = 0
        self.paths: Counter[str] = Counter()  # GETs per URL path
        self.heads: Counter[str] = Counter()  # HEADs per URL path
        self.in_flight = 0  # GET and HEAD requests being answered, and the most at once
        self.most_in_flight = 0
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> ThrottledServer:
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
