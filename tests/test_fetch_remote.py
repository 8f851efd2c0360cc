"""``fetch_many`` against a real loopback HTTP server that misbehaves on purpose
(``ThrottledServer(fault=...)``): bounded concurrency, retries of transient errors only,
timeouts, coalesced ranges split exactly, and responses of the wrong length refused."""

from __future__ import annotations

import gc
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import lcache.trace
from lcache.data import FileSource, RangeSource, SourceError
from lcache.data.fetch import Want, fetch, plan
from lcache.data.remote import FetchOptions, Remote, is_transient
from lcache.errors import ConfigError
from lcache.testing.remote import ThrottledServer

from .test_trace_recorder import _events, _files, _io

FAST = {"backoff": 0.001}  # retries without the production backoff


def _blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture
def objects(tmp_path: Path) -> list[bytes]:
    """``d/000.bin``... 40 objects of distinct sizes."""
    (tmp_path / "d").mkdir()
    blobs = [_blob(i, 300 + 17 * i) for i in range(40)]
    for i, blob in enumerate(blobs):
        (tmp_path / "d" / f"{i:03d}.bin").write_bytes(blob)
    return blobs


@pytest.fixture
def big(tmp_path: Path) -> bytes:
    data = _blob(99, 200_000)
    (tmp_path / "big.bin").write_bytes(data)
    return data


def _names(n: int) -> list[tuple[str, int]]:
    return [(f"{i:03d}.bin", 300 + 17 * i) for i in range(n)]


def _by_script(script: dict[int, str | None]) -> Callable[[str, int], str | None]:
    """The same fault for the nth GET of every path (``{1: "503", 2: "reset"}``)."""
    return lambda path, nth: script.get(nth)


# ------------------------------------------------------------------------ concurrency
class InFlight:
    """A fault hook that holds each GET (of a path ``only`` accepts) briefly and records how
    many were held at once."""

    def __init__(self, only: Callable[[str], bool] = lambda path: True) -> None:
        self.lock = threading.Lock()
        self.now = self.most = 0
        self.only = only

    def __call__(self, path: str, nth: int) -> None:
        if not self.only(path):
            return
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(0.05)
        with self.lock:
            self.now -= 1


@pytest.mark.parametrize("concurrency", [1, 6, 24])
def test_requests_in_flight_are_bounded(tmp_path: Path, objects: list[bytes],
                                        concurrency: int) -> None:
    hook = InFlight()
    with ThrottledServer(str(tmp_path), fault=hook) as server:
        src = FileSource(server.url + "/d/", files=_names(40), concurrency=concurrency)
        order = [*random.Random(1).sample(range(40), 40), 5, 5]  # any order, repeats
        assert src.fetch_many(order) == [objects[i] for i in order]
    # Never more in flight than allowed; most of that when there is work for it (the
    # server's one accepting thread staggers the first connections).
    assert concurrency // 2 < hook.most <= concurrency, hook.most


# ------------------------------------------------------------------------ retries
@pytest.mark.parametrize("script", [
    {1: "503", 2: "500", 3: "502"},
    {1: "429"},
    {1: "reset", 2: "reset"},
    {1: "cut"},  # the body ends before its announced length
], ids=["5xx", "429", "reset", "cut-body"])
def test_transient_errors_are_retried(tmp_path: Path, objects: list[bytes],
                                      script: dict[int, str | None]) -> None:
    with ThrottledServer(str(tmp_path), fault=_by_script(script)) as server:
        src = FileSource(server.url + "/d/", files=_names(12), retries=3, **FAST)
        assert src.fetch_many(range(12)) == objects[:12]
        assert all(server.paths[f"/d/{i:03d}.bin"] == len(script) + 1 for i in range(12))


def test_a_5xx_storm_is_reported_after_the_retries(tmp_path: Path, objects: list[bytes]) -> None:
    with ThrottledServer(str(tmp_path), fault=lambda path, nth: "503") as server:
        src = FileSource(server.url + "/d/", files=_names(3), retries=2, **FAST)
        with pytest.raises(SourceError) as info:
            src.fetch_many([2])
        assert server.paths["/d/002.bin"] == 3
    message = str(info.value)
    assert f"sample 2 ({server.url}/d/002.bin) after 3 attempts" in message, message
    assert "503" in message and isinstance(info.value, OSError)


@pytest.mark.parametrize("status", ["404", "403"])
def test_missing_or_refused_objects_are_not_retried(tmp_path: Path, objects: list[bytes],
                                                    status: str) -> None:
    with ThrottledServer(str(tmp_path), fault=lambda path, nth: status) as server:
        src = FileSource(server.url + "/d/", files=_names(3), retries=5, **FAST)
        with pytest.raises(SourceError) as info:
            src.fetch_many([0, 1])
        assert sum(server.paths.values()) <= 2  # one GET per object at most, no retry
    assert "after" not in str(info.value) and f"{server.url}/d/00" in str(info.value)


def test_every_failed_request_of_a_batch_is_collected(tmp_path: Path, objects: list[bytes],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """One error is raised, and the others' are not left for asyncio to print as "Task
    exception was never retrieved" tracebacks on the user's terminal."""
    with ThrottledServer(str(tmp_path), fault=lambda path, nth: "404") as server:
        src = FileSource(server.url + "/d/", files=_names(8), retries=0, **FAST)
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for pair in range(0, 8, 2):  # two answers at once: both often fail in one wait
                with pytest.raises(SourceError):
                    src.fetch_many([pair, pair + 1])
            del src
            gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_a_stalled_request_times_out_and_is_retried(tmp_path: Path,
                                                    objects: list[bytes]) -> None:
    with ThrottledServer(str(tmp_path), fault=_by_script({1: "stall"})) as server:
        server.stall_seconds = 1.0
        src = FileSource(server.url + "/d/", files=_names(4), timeout=0.3, retries=1, **FAST)
        assert src.fetch_many(range(4)) == objects[:4]
        assert all(server.paths[f"/d/{i:03d}.bin"] == 2 for i in range(4))
        always = FileSource(server.url + "/d/", files=_names(6), timeout=0.3, retries=0)
        with pytest.raises(SourceError, match=r"sample 5 .*no answer within 0.3 s \(timeout=\)"):
            always.fetch_many([5])


def test_transient_or_not() -> None:
    import aiohttp

    assert is_transient(TimeoutError()) and is_transient(ConnectionResetError())
    assert not is_transient(FileNotFoundError("x")) and not is_transient(PermissionError())
    assert not is_transient(ConnectionRefusedError())
    info = aiohttp.RequestInfo(aiohttp.client.URL("http://h/x"), "GET", {})  # type: ignore[arg-type]
    for status, transient in ((500, True), (503, True), (429, True), (408, True),
                              (400, False), (403, False), (416, False)):
        exc = aiohttp.ClientResponseError(info, (), status=status)
        assert is_transient(exc) is transient, status
    assert is_transient(aiohttp.ServerDisconnectedError())
    with pytest.raises(ConfigError):
        FetchOptions(concurrency=0)
    with pytest.raises(ConfigError, match="unknown source options"):
        FileSource("/nowhere", files=[("a", 1)], retry=3)


# ------------------------------------------------------------------------ coalescing
def _ranges(seed: int, n: int, size: int, gap: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    offsets, lengths, pos = [], [], 0
    for _ in range(n):
        length = rng.randrange(100, 3000)
        offsets.append(pos)
        lengths.append(length)
        pos += length + gap
    assert pos < size
    return offsets, lengths


def test_nearby_ranges_are_one_request_split_exactly(tmp_path: Path, big: bytes) -> None:
    offsets, lengths = _ranges(1, 30, len(big), gap=100)
    with ThrottledServer(str(tmp_path)) as server:
        src = RangeSource(server.url, "big.bin", offsets, lengths, coalesce_gap=100)
        wanted = random.Random(2).sample(range(30), 30)
        got = src.fetch_many(wanted)
        assert got == [big[offsets[i]:offsets[i] + lengths[i]] for i in wanted]
        assert server.paths["/big.bin"] == 1
        apart = RangeSource(server.url, "big.bin", offsets, lengths, coalesce_gap=99)
        assert apart.fetch_many(wanted) == got
        assert server.paths["/big.bin"] == 31  # gaps over the threshold: one each
        capped = RangeSource(server.url, "big.bin", offsets, lengths, max_request=10_000)
        assert capped.fetch_many(wanted) == got
        assert 31 + 5 <= server.paths["/big.bin"] < 31 + 30


@pytest.mark.parametrize("fault,why", [
    ("short", r"sample \d+: http://\S+/big.bin ended after \d+ of bytes \d+-\d+"),
    ("ignore-range", r"answered 200000 bytes for bytes 0-\d+ \(a server that ignores Range"),
])
def test_a_coalesced_answer_of_the_wrong_length_is_refused(tmp_path: Path, big: bytes,
                                                           fault: str, why: str) -> None:
    offsets, lengths = _ranges(3, 10, len(big), gap=0)
    with ThrottledServer(str(tmp_path), fault=lambda path, nth: fault) as server:
        src = RangeSource(server.url, "big.bin", offsets, lengths)
        with pytest.raises(SourceError, match=why):
            src.fetch_many(range(10))
        assert server.paths["/big.bin"] == 1  # a wrong length is not a transient error


def test_an_answer_from_the_wrong_place_is_refused(tmp_path: Path, big: bytes) -> None:
    """The right length from the wrong place (a server or proxy that mislabels a range):
    fsspec reads any body, and these bytes were cached as the samples."""
    offsets, lengths = _ranges(3, 10, len(big) - 5000, gap=0)
    offsets = [o + 5000 for o in offsets]
    with ThrottledServer(str(tmp_path), fault=lambda path, nth: "misplaced") as server:
        src = RangeSource(server.url, "big.bin", offsets, lengths)
        with pytest.raises(SourceError, match=r"big.bin answered a request for bytes 5000-\d+ "
                           r"with other bytes \(Content-Range: bytes 0-"):
            src.fetch_many(range(10))
        assert server.paths["/big.bin"] == 1  # not transient: not asked again


def test_a_whole_object_answered_for_a_range_after_byte_0_is_refused(tmp_path: Path) -> None:
    """The finding: a server without Range support answers 200 with the whole object; an
    object rewritten shorter since it was listed made that the right length for a range
    from byte 1000, and its first bytes were cached as the sample."""
    (tmp_path / "f.bin").write_bytes(b"O" * 2000)
    with ThrottledServer(str(tmp_path), fault=lambda path, nth: "ignore-range") as server:
        src = RangeSource(server.url, "f.bin", [1000], [1000])
        (tmp_path / "f.bin").write_bytes(b"N" * 1000)
        with pytest.raises(SourceError, match=r"f.bin answered a request for bytes 1000-2000 "
                           r"with other bytes \(the whole object\)"):
            src.fetch_many([0])
    with ThrottledServer(str(tmp_path), fault=lambda path, nth: "loud-range") as server:
        src = RangeSource(server.url, "f.bin", [100], [500])  # RFC 9110 case and spacing
        assert src.fetch_many([0]) == [b"N" * 500]


def test_a_server_that_gzips_what_it_sends_still_gives_the_stored_bytes(
        tmp_path: Path, objects: list[bytes], big: bytes) -> None:
    """nginx's gzip compresses a response (and drops Range) for a client that accepts it,
    and aiohttp inflated it: a range of a shard came back as the whole file, refused."""
    with ThrottledServer(str(tmp_path), fault=lambda path, nth: "gzip") as server:
        src = FileSource(server.url + "/d/")  # sizes from HEAD, then whole objects
        assert src.fetch_many(range(40)) == objects
        offsets, lengths = _ranges(3, 10, len(big), gap=0)
        ranges = RangeSource(server.url, "big.bin", offsets, lengths)
        assert ranges.fetch_many(range(10)) == [big[o:o + n] for o, n in zip(offsets, lengths,
                                                                               strict=True)]


def test_short_answer_names_the_first_sample_cut(tmp_path: Path, big: bytes) -> None:
    offsets, lengths = [0, 1000, 2000, 3000], [1000] * 4
    with ThrottledServer(str(tmp_path), fault=lambda path, nth: "short") as server:
        src = RangeSource(server.url, "big.bin", offsets, lengths)
        with pytest.raises(SourceError, match=r"^sample 2: .* ended after 0 of bytes 2000-3000"):
            src.fetch_many([3, 0, 2, 1])  # 2000 of 4000 bytes came: samples 2 and 3 are cut


@settings(max_examples=60, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 900)), min_size=1,
                      max_size=25),
       gap=st.integers(0, 2000), cap=st.integers(1, 6000))
# found by CI: a want inside a request already over the cap (one larger want) was asked again
@example(spans=[(0, 1)] * 7 + [(0, 2), (0, 1)], gap=0, cap=1)
def test_plan_covers_every_want_within_its_limits(spans: list[tuple[int, int]], gap: int,
                                                  cap: int) -> None:
    wants = [Want(i, "f" if i % 3 else "g", s, s + n) for i, (s, n) in enumerate(spans)]
    requests = plan(wants, gap, cap)
    served = sorted(p for r in requests for p in r.wants)
    assert served == list(range(len(wants)))
    for r in requests:
        assert r.start is not None and r.end is not None
        assert all(wants[p].path == r.path and r.start <= wants[p].start  # type: ignore[operator]
                   and wants[p].end <= r.end for p in r.wants)  # type: ignore[operator]
        assert r.end - r.start <= cap or any(  # or no larger than one of its wants
            (wants[p].start, wants[p].end) == (r.start, r.end) for p in r.wants)
    per_path: dict[str, list[tuple[int, int]]] = {}
    for r in requests:
        per_path.setdefault(r.path, []).append((r.start, r.end))  # type: ignore[arg-type]
    for spans_of in per_path.values():  # requests of one object are further apart than gap,
        spans_of.sort()                 # or merging them would pass the cap
        for (s1, e1), (s2, e2) in itertools.pairwise(spans_of):
            assert s2 - e1 > gap or max(e1, e2) - s1 > cap


@settings(max_examples=25, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, 150_000), st.integers(1, 20_000)), min_size=1,
                      max_size=40),
       gap=st.integers(0, 50_000))
def test_local_ranges_exact_property(tmp_path_factory: pytest.TempPathFactory,
                                     spans: list[tuple[int, int]], gap: int) -> None:
    root = tmp_path_factory.mktemp("ranges")
    data = _blob(5, 170_000)
    (root / "f.bin").write_bytes(data)
    remote = Remote(str(root), None, FetchOptions(coalesce_gap=gap, max_request=64 << 10))
    path = remote.path("f.bin")
    got = fetch(remote, [Want(i, path, s, s + n) for i, (s, n) in enumerate(spans)])
    assert got == [data[s:s + n] for s, n in spans]


# ------------------------------------------------------------------------ tracing
def test_every_request_is_a_data_source_event(tmp_path: Path, big: bytes) -> None:
    offsets, lengths = [0, 500, 10_000], [500, 500, 700]
    trace = tmp_path / "t.trace"
    with ThrottledServer(str(tmp_path), fault=_by_script({1: "503"})) as server:
        src = RangeSource(server.url, "big.bin", offsets, lengths, coalesce_gap=0, **FAST)
        lcache.trace.enable(str(trace))
        try:
            assert src.fetch_many([2, 0, 1]) == [big[10_000:10_700], big[:500], big[500:1000]]
        finally:
            lcache.trace.disable()
    events = _events(trace)
    names = _files(events)
    got = sorted((names[(e["pid"], e["args"]["fid"])], e["args"]["off"], e["args"]["size"],
                  e["args"]["ret"]) for e in _io(events) if e["cat"] == "data-source")
    url = server.url + "/big.bin"
    # Two requests (0-1000 coalesced, 10000-10700); the first GET of the file got a 503.
    served = [(url, 0, 1000, 1000), (url, 10_000, 700, 700)]
    assert [e for e in got if e[3] > 0] == served
    assert [e for e in got if e[3] < 0] in ([(url, 0, 1000, -5)], [(url, 10_000, 700, -5)])


def test_opening_a_source_is_traced(tmp_path: Path, objects: list[bytes]) -> None:
    """Listing a directory and asking each object's size (an HTML listing has none) are
    data-source events too: a traced run shows the seconds a source takes to open."""
    trace = tmp_path / "t.trace"
    with ThrottledServer(str(tmp_path)) as server:
        lcache.trace.enable(str(trace))
        try:
            src = FileSource(server.url + "/d/", **FAST)
        finally:
            lcache.trace.disable()
        heads = dict(server.heads)
    assert len(src) == 40
    events = _events(trace)
    names = _files(events)
    ops = [(e["name"], names[(e["pid"], e["args"]["fid"])], e["args"]["ret"])
           for e in _io(events) if e["cat"] == "data-source"]
    url = server.url + "/d/"
    assert [(op, ret) for op, name, ret in ops if op == "list"] == [("list", 40)]
    assert [name for op, name, _ in ops if op == "list"] in ([url], [url.rstrip("/")])
    stats = sorted(name for op, name, ret in ops if op == "stat" and ret == 0)
    assert stats == sorted(server.url + path for path in heads)
    assert len(stats) == 40
