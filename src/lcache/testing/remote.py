"""A throttled loopback HTTP server: the "slow remote storage" of tests, demo and benchmarks.

Serves a directory (GET with Range support, and an HTML listing that fsspec's HTTP
filesystem can walk) with a fixed latency per request and one bandwidth cap shared by all
connections, so every system under test sees the same remote. Counts requests (per path)
and bytes.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


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

    def do_GET(self) -> None:
        time.sleep(self.server.latency)
        with self.server.stats_lock:
            self.server.requests += 1
            self.server.paths[self.path] += 1
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
            if rng and rng.startswith("bytes="):
                lo, _, hi = rng[6:].partition("-")
                start = int(lo) if lo else max(0, size - int(hi))
                end = min(size, int(hi) + 1) if hi and lo else size
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(end - start))
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
        time.sleep(self.server.latency)
        super().do_HEAD()


class ThrottledServer(ThreadingHTTPServer):
    """``ThrottledServer(root, latency=0.005, bandwidth=100e6)``; ``.url`` is its base URL.
    Use as a context manager (serves from a background thread)."""

    daemon_threads = True
    request_queue_size = 1024  # the default (5) drops connections beyond it: 1 s retries

    def __init__(self, root: str, *, latency: float = 0.0, bandwidth: float = 0.0) -> None:
        super().__init__(("127.0.0.1", 0), partial(_Handler, directory=root))
        self.latency = latency
        self.throttle = _Throttle(bandwidth)
        self.stats_lock = threading.Lock()
        self.requests = 0
        self.bytes_sent = 0
        self.paths: Counter[str] = Counter()  # GETs per URL path
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
