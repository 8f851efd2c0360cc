"""Reading tar members without ``tarfile``: 512-byte headers (ustar, GNU long names, pax
extended headers, base-256 sizes), each header's checksum checked. One scanner serves both
indexing a shard (reads through a callback, skipping member data) and splitting a fetched
sample (reads from memory), so both see the same members."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

from lcache.data.remote import SourceCorruptionError

BLOCK = 512
_ZERO = bytes(BLOCK)
REGULAR = (b"0", b"\0", b"7")  # a file ("7": contiguous file, read as one)


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    kind: bytes  # the typeflag
    start: int  # the first byte of its headers (extended headers included)
    data: int  # the first byte of its data
    size: int
    end: int  # the byte after its padded data: where the next member starts


def padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _cstr(field: bytes | memoryview) -> str:
    raw = bytes(field).split(b"\0", 1)[0]
    return raw.decode("utf-8", "surrogateescape")


def _number(field: bytes | memoryview) -> int:
    raw = bytes(field)
    if raw[0] & 0x80:  # base-256 (GNU), for sizes of 8 GiB and more
        return int.from_bytes(bytes([raw[0] & 0x7F]) + raw[1:], "big")
    text = raw.replace(b"\0", b" ").strip()
    if text.strip(b"01234567"):  # int(..., 8) takes "-1000": a size of -512 loops the scan
        raise ValueError(f"not an octal number: {text!r}")
    return int(text, 8) if text else 0


def _header(block: bytes | memoryview, where: Callable[[], str], verify: bool,
            why: str) -> tuple[str, bytes, int]:
    """``(name, typeflag, size)`` of a header block, its checksum checked if ``verify``."""
    raw = bytes(block)
    try:
        size = _number(raw[124:136])
        stored = _number(raw[148:156]) if verify else 0
    except (ValueError, IndexError):
        raise SourceCorruptionError(f"{where()}: not a tar header: {why}") from None
    if verify:
        rest = raw[:148] + raw[156:]
        unsigned = sum(rest) + 8 * 32  # the checksum field counts as spaces
        signed = unsigned - 256 * sum(1 for b in rest if b > 127)  # old tars summed signed
        if stored not in (unsigned, signed):
            raise SourceCorruptionError(f"{where()}: tar header checksum {stored} is not "
                                        f"{unsigned}: {why}")
    name = _cstr(raw[0:100])
    if raw[257:263] == b"ustar\0":  # POSIX: a prefix field holds the start of long names
        prefix = _cstr(raw[345:500])
        if prefix:
            name = f"{prefix}/{name}"
    return name, raw[156:157], size


def _pax(data: bytes | memoryview, where: Callable[[], str]) -> dict[str, str]:
    """The records of a pax extended header: ``"LEN key=value\\n"`` each."""
    raw, out, pos = bytes(data), {}, 0
    while pos < len(raw) and raw[pos] != 0:
        length = raw[pos:pos + 24].partition(b" ")[0]
        try:
            n = int(length)
        except ValueError:
            raise SourceCorruptionError(f"{where()}: a corrupt pax header") from None
        record = raw[pos:pos + n]
        key, eq, value = record[len(length) + 1:].partition(b"=")
        if n <= 0 or not eq or not record.endswith(b"\n"):
            raise SourceCorruptionError(f"{where()}: a corrupt pax header")
        out[key.decode("utf-8", "surrogateescape")] = value[:-1].decode(
            "utf-8", "surrogateescape")
        pos += n
    return out


def _pax_size(value: str, where: Callable[[], str], why: str) -> int:
    # ASCII digits only: int() takes "-512" (a header that points back at itself: the scan
    # would go round forever), " 1_0" and other scripts' digits
    if not (value.isascii() and value.isdigit()):
        raise SourceCorruptionError(f"{where()}: a pax size of {value!r}: {why}")
    return int(value)


def scan(read: Callable[[int, int], bytes | memoryview], start: int, end: int,
         where: Callable[[int], str], *, verify: bool = True,
         archive: bool = False) -> Iterator[Member]:
    """The members in bytes ``start..end`` (``read(offset, n)`` gives bytes), their extended
    headers folded in. ``where(offset)`` names the place for errors.

    ``archive``: the bytes are a whole tar, which ends with its end-of-archive block (a
    shard without one was cut short). Else they are some members of one (a sample), which
    end exactly at ``end``. A member or header past ``end`` is an error either way; so is a
    header whose checksum is wrong, if ``verify``."""
    cut = ("a truncated shard" if archive else
           "the sample's bytes end inside a member: the shard changed since it was indexed?")
    bad = "corrupt bytes" + ("" if archive else ", or the shard changed since it was indexed")
    pos = start
    first: int | None = None  # where the extended headers of the next member began
    long_name: str | None = None
    pax: dict[str, str] = {}
    while pos < end:
        head = read(pos, min(2, end - pos)) if archive and pos == start else b""
        if bytes(head) == b"\x1f\x8b":  # say so, not "truncated" or "checksum"
            raise SourceCorruptionError(f"{where(pos)}: a gzip-compressed tar: compressed "
                                        "shards have no per-sample byte ranges; store them "
                                        "uncompressed")
        if pos + BLOCK > end:
            raise SourceCorruptionError(f"{where(pos)}: {end - pos} bytes left, less than a "
                                        f"tar header: {cut}")
        block = read(pos, BLOCK)
        if bytes(block) == _ZERO:
            if archive and first is not None:
                raise SourceCorruptionError(f"{where(first)}: extended headers of no member "
                                            "before the end of the archive: corrupt bytes")
            if archive:
                return
            raise SourceCorruptionError(f"{where(pos)}: an end-of-archive block: {cut}")
        name, kind, size = _header(block, partial(where, pos), verify, bad)
        if "size" in pax and kind not in (b"x", b"g", b"L", b"K"):  # the member's own size
            size = _pax_size(pax["size"], partial(where, pos if first is None else first), bad)
        data = pos + BLOCK
        nxt = data + padded(size)
        if data + size > end:
            raise SourceCorruptionError(
                f"{where(pos)}: member {name!r} has {size} bytes from byte {data}, past the "
                f"end at {end}: {cut}")
        if kind in (b"x", b"L", b"K", b"g"):
            if kind == b"x":
                pax = _pax(read(data, size), partial(where, pos))
            elif kind == b"L":
                long_name = _cstr(read(data, size))
            if kind != b"g":  # a global header belongs to no member
                first = pos if first is None else first
            pos = nxt
            continue
        if kind == b"S" or any(k.startswith("GNU.sparse") for k in pax):
            # tarfile (which WebDataset reads with) rebuilds the holes; a byte range cannot
            raise SourceCorruptionError(f"{where(pos)}: member {name!r} is a GNU sparse file, "
                                        "which lcache does not read; write the shard without "
                                        "sparse members (tar without --sparse)")
        yield Member(pax.get("path") or long_name or name, kind,
                     pos if first is None else first, data, size, nxt)
        first, long_name, pax = None, None, {}
        pos = nxt
    if archive:
        raise SourceCorruptionError(f"{where(end)}: no end-of-archive block: {cut}")
    if first is not None:
        raise SourceCorruptionError(f"{where(first)}: extended headers of no member: {cut}")
