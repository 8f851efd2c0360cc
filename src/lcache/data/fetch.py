"""Fetching many samples at once: nearby byte ranges of one object coalesced into one
request, the requests run concurrently (``Remote.bounded``) and retried
(``Remote.attempt``), each response checked for its exact length and split into samples.

A coalesced response is never trusted by position alone: one shorter or longer than asked
(a truncated object, a server that ignores Range) is an error naming the first sample it
would have cut, and a format's ``check`` (tar header checksums, say) sees every sample
before it is returned. A whole object of a known size is asked for one byte more than that
size and refused unless exactly that size arrives: an object rewritten since it was listed
is an error, not new bytes cached under the old listing, and one swapped for something
endless is not read without end. Over HTTP, S3 and local files, every answer's object must
also still have its listed size and version (``Listed``): a range of a rewritten shard, or
an object rewritten with the same size, is an error too.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from lcache.data.remote import Listed, Remote, SourceError, trace_read
from lcache.trace import recorder as _trace


@dataclass(frozen=True, slots=True)
class Want:
    """One sample's bytes: ``path[start:end]``, or the whole object when ``start`` is None;
    the object is of ``size`` bytes as listed (None: not known), and of ``version`` (its
    ``object_version``, "" if not known)."""

    index: int
    path: str
    start: int | None = None
    end: int | None = None
    size: int | None = None
    version: str = ""


@dataclass(slots=True)
class Request:
    """One ranged GET (or a whole object) and the wants it serves (positions in the call)."""

    path: str
    start: int | None
    end: int | None
    wants: list[int] = field(default_factory=list)
    size: int | None = None  # the object's listed size
    version: str = ""  # and version

    def asked(self) -> tuple[int | None, int | None]:
        """The range to ask for: a whole object of a known size up to one byte past it (an
        empty one too: asked whole, one swapped for something endless was read until memory
        ran out; a range of an empty object is 416, see ``fetch``)."""
        if self.start is None and self.size is not None:
            return 0, self.size + 1
        return self.start, self.end

    def listed(self) -> Listed | None:
        """What each answer is checked against (a whole object's size is checked by
        ``_split``, whose error can say more)."""
        size = None if self.start is None else self.size
        return Listed(size, self.version) if size is not None or self.version else None


def plan(wants: Sequence[Want], gap: int, max_request: int) -> list[Request]:
    """Requests for ``wants``: ranges of one object whose gap is at most ``gap`` bytes (or
    that overlap) become one request of at most ``max_request`` bytes (a single want may be
    larger, and the wants inside it join it); whole objects are one request each."""
    requests: list[Request] = []
    by_path: dict[str, list[int]] = {}
    for pos, w in enumerate(wants):
        if w.start is None:
            requests.append(Request(w.path, None, None, [pos], w.size, w.version))
        else:
            by_path.setdefault(w.path, []).append(pos)
    for path, positions in by_path.items():
        positions.sort(key=lambda p: wants[p].start or 0)
        cur: Request | None = None
        for pos in positions:
            w = wants[pos]
            assert w.start is not None and w.end is not None
            # (A want inside the current request joins it even when that request, one large
            # want, is already over max_request: it grows nothing.)
            if (cur is not None and cur.end is not None and cur.start is not None
                    and w.start - cur.end <= gap
                    and (w.end <= cur.end or max(cur.end, w.end) - cur.start <= max_request)):
                cur.end = max(cur.end, w.end)
                cur.wants.append(pos)
            else:
                cur = Request(path, w.start, w.end, [pos], w.size, w.version)
                requests.append(cur)
    return requests


def _samples(wants: Sequence[Want], req: Request) -> str:
    shown = ", ".join(str(wants[p].index) for p in req.wants[:3])
    more = f" and {len(req.wants) - 3} more" if len(req.wants) > 3 else ""
    return f"sample{'s' if len(req.wants) > 1 else ''} {shown}{more}"


def _describe(remote: Remote, wants: Sequence[Want], req: Request) -> str:
    where = "" if req.start is None else f"bytes {req.start}-{req.end} of "
    return f"cannot read {_samples(wants, req)} ({where}{remote.full_url(req.path)})"


def _split(remote: Remote, wants: Sequence[Want], req: Request, data: bytes,
           out: list[bytes | None]) -> None:
    """Cut ``data`` (the response to ``req``) into its wants, after checking its length."""
    if req.start is None:
        if req.size is not None and len(data) != req.size:
            # asked for one byte more than listed (see asked()): that says "larger", no more
            bounded = req.asked()[1] is not None
            now = f"more than {req.size}" if bounded and len(data) > req.size else \
                str(len(data))
            raise SourceError(
                f"{_samples(wants, req)}: {remote.full_url(req.path)} is now {now} "
                f"bytes, {req.size} when it was listed: it changed since the "
                f"source was opened (open it again), or files= gave a wrong size")
        for pos in req.wants:
            out[pos] = data
        return
    assert req.end is not None
    if len(data) != req.end - req.start:
        url = remote.full_url(req.path)
        if len(data) > req.end - req.start:
            raise SourceError(
                f"{_samples(wants, req)}: {url} answered {len(data)} bytes for bytes "
                f"{req.start}-{req.end} (a server that ignores Range requests?)")
        short = min((wants[p] for p in req.wants
                     if (wants[p].end or 0) > req.start + len(data)), key=lambda w: w.start or 0)
        assert short.start is not None
        got = max(0, req.start + len(data) - short.start)
        raise SourceError(f"sample {short.index}: {url} ended after {got} of bytes "
                          f"{short.start}-{short.end}")
    if len(req.wants) == 1 and wants[req.wants[0]].start == req.start:
        out[req.wants[0]] = data
        return
    view = memoryview(data)
    for pos in req.wants:
        w = wants[pos]
        assert w.start is not None and w.end is not None
        out[pos] = bytes(view[w.start - req.start:w.end - req.start])


def fetch(remote: Remote, wants: Sequence[Want],
          check: Callable[[int, bytes], None] | None = None) -> list[bytes]:
    """The bytes of each of ``wants``, in order. ``check(index, data)`` may raise (a
    ``CorruptionError`` naming the sample) to refuse a sample's bytes."""
    if not wants:
        return []
    opts = remote.options
    requests = plan(wants, opts.coalesce_gap, opts.max_request)
    out: list[bytes | None] = [None] * len(wants)
    if len(requests) == 1 and not remote.is_async:
        datas = [_read_here(remote, wants, requests[0])]
    else:
        def job(r: Request) -> Callable[[], Awaitable[bytes]]:
            async def ask() -> bytes:
                try:
                    return await remote.cat(r.path, *r.asked(),
                                            lambda: _describe(remote, wants, r), r.listed())
                except SourceError as exc:
                    if r.start is None and r.size == 0 and _unsatisfiable(exc.__cause__):
                        return b""  # bytes 0-0 of an object still empty: nothing to send
                    raise

            return ask

        datas = remote.run(lambda: remote.bounded(job(r) for r in requests))
    for req, data in zip(requests, datas, strict=True):
        _split(remote, wants, req, data, out)
    result: list[bytes] = []
    for w, piece in zip(wants, out, strict=True):
        assert piece is not None
        if check is not None:
            check(w.index, piece)
        result.append(piece)
    return result


def _unsatisfiable(exc: BaseException | None) -> bool:
    """Whether a request failed as "range not satisfiable" (HTTP 416; S3's InvalidRange,
    which s3fs raises as an OSError saying so)."""
    if exc is None:
        return False
    text = str(exc).lower()
    return getattr(exc, "status", None) == 416 or "not satisfiable" in text or \
        "invalidrange" in text


def _read_here(remote: Remote, wants: Sequence[Want], req: Request) -> bytes:
    """One request to a non-async filesystem, in this thread (no event loop round trip)."""
    url = remote.full_url(req.path)
    start, end = req.asked()
    size = 0 if end is None else end - (start or 0)
    t0 = time.perf_counter_ns() if _trace._active is not None else 0
    try:
        data = remote.read(req.path, start, end, req.listed())
    except Exception as exc:
        trace_read(url, req.start or 0, size, t0, -errno.EIO)
        raise SourceError(f"{_describe(remote, wants, req)}: {type(exc).__name__}: "
                          f"{exc}") from exc
    trace_read(url, req.start or 0, len(data), t0, len(data))
    return data
