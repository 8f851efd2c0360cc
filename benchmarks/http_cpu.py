"""Client CPU per GET of a sample over HTTP: lcache's lean client against aiohttp.

A source of one object per sample makes one GET per sample; on a small node such an epoch is
bound by the CPU. This runs ``--gets`` GETs of ``--sample-size`` objects, ``--concurrency`` in
flight, against lcache's throttled test server (in its own process, unthrottled unless asked,
so that only the client's CPU is counted here), four ways, in rounds that turn the order:

  aiohttp            a bare aiohttp session (fsspec's HTTP client)
  lean               ``lcache.data.http_client.get``, bare
  source_aiohttp     ``FileSource.fetch_many`` in batches of ``--batch`` with fsspec session
                     options (``client_kwargs``), which send every GET through aiohttp: the
                     whole fetch path as it was
  source_lean        ``FileSource.fetch_many`` as users get it: the lean client

    python benchmarks/http_cpu.py --json
    python benchmarks/http_cpu.py --gets 3000 --sample-size 32KiB --latency 0.003

Prints one JSON object: per way, the median over ``--rounds`` of the client's CPU
microseconds per GET (this process, every thread) and of the wall seconds, and the ratios
of the lean ways to the aiohttp ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lcache.data import FileSource, http_client
from lcache.store import parse_size

SERVER = """
import sys, time
from lcache.testing.remote import ThrottledServer
with ThrottledServer(sys.argv[1], latency=float(sys.argv[2]), bandwidth=float(sys.argv[3])) as s:
    print(s.url, flush=True)
    time.sleep(1e9)
"""


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _aiohttp(urls: list[str], concurrency: int) -> None:
    import aiohttp

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            sem = asyncio.Semaphore(concurrency)

            async def one(url: str) -> None:
                async with sem, session.get(url) as r:
                    await r.read()
            await asyncio.gather(*(one(u) for u in urls))
    asyncio.run(run())


def _lean(urls: list[str], concurrency: int) -> None:
    import yarl

    async def run() -> None:
        sem = asyncio.Semaphore(concurrency)

        async def one(url: str) -> None:
            async with sem:
                await http_client.get(yarl.URL(url), {})
        await asyncio.gather(*(one(u) for u in urls))
    asyncio.run(run())


def _source(url: str, n: int, batch: int, concurrency: int, via_aiohttp: bool
            ) -> Callable[[], None]:
    # Session options make a filesystem whose GETs all go through aiohttp (http_client
    # takes only a session without options); the source is listed before the clock starts.
    options = {"client_kwargs": {"trust_env": False}} if via_aiohttp else None
    source = FileSource(url + "/", storage_options=options, concurrency=concurrency)
    assert len(source) == n

    def run() -> None:
        for first in range(0, n, batch):
            source.fetch_many(range(first, min(n, first + batch)))
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gets", type=int, default=3000)
    parser.add_argument("--sample-size", default="32KiB")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32, help="samples per fetch_many")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per request")
    parser.add_argument("--bandwidth", type=float, default=0.0, help="bytes/s (0: no limit)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", dest="as_json")
    a = parser.parse_args(argv)
    if a.gets < 1 or a.concurrency < 1 or a.batch < 1 or a.rounds < 1:
        parser.error("--gets, --concurrency, --batch and --rounds must be at least 1")
    size = parse_size(a.sample_size, "--sample-size")
    with tempfile.TemporaryDirectory(prefix="lcache-http-cpu-") as root:
        folder = Path(root) / "d"
        folder.mkdir()
        for i in range(a.gets):
            (folder / f"{i:07d}.bin").write_bytes(os.urandom(size))
        server = subprocess.Popen([sys.executable, "-c", SERVER, root, str(a.latency),
                                   str(a.bandwidth)], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            url = server.stdout.readline().strip() + "/d"
            urls = [f"{url}/{i:07d}.bin" for i in range(a.gets)]
            ways: dict[str, Callable[[], None]] = {
                "aiohttp": lambda: _aiohttp(urls, a.concurrency),
                "lean": lambda: _lean(urls, a.concurrency),
                "source_aiohttp": _source(url, a.gets, a.batch, a.concurrency, True),
                "source_lean": _source(url, a.gets, a.batch, a.concurrency, False),
            }
            for run in ways.values():  # warm-up: imports, connections
                run()
            cpu: dict[str, list[float]] = {name: [] for name in ways}
            wall: dict[str, list[float]] = {name: [] for name in ways}
            names = list(ways)
            for r in range(a.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    c0, t0 = _cpu(), time.perf_counter()
                    ways[name]()
                    wall[name].append(time.perf_counter() - t0)
                    cpu[name].append((_cpu() - c0) / a.gets * 1e6)
        finally:
            server.kill()
            server.wait()
    rows: dict[str, Any] = {
        name: {"cpu_us_per_get": round(statistics.median(cpu[name]), 1),
               "wall_s": round(statistics.median(wall[name]), 3)} for name in cpu}
    result = {"gets": a.gets, "sample_size": size, "concurrency": a.concurrency,
              "latency": a.latency, "bandwidth": a.bandwidth, "rounds": a.rounds, **rows,
              "lean_cpu_over_aiohttp": round(rows["lean"]["cpu_us_per_get"]
                                             / rows["aiohttp"]["cpu_us_per_get"], 3),
              "source_lean_cpu_over_source_aiohttp": round(
                  rows["source_lean"]["cpu_us_per_get"]
                  / rows["source_aiohttp"]["cpu_us_per_get"], 3)}
    if a.as_json:
        print(json.dumps(result, indent=1))
    else:
        for name, row in rows.items():
            print(f"{name:15s} {row['cpu_us_per_get']:7.1f} us of client CPU per GET, "
                  f"{row['wall_s']:.3f} s")


if __name__ == "__main__":
    main()
