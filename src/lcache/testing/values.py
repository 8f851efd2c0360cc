"""Deterministic, self-describing test values.

``make_value(key, version)`` is a pure function: a 16-byte prefix holding the version and a tag
of the key, then bytes derived from (key, version) with SHAKE-256. A reader that gets some bytes
back for ``key`` recovers the version from the prefix and recomputes the whole value, so it can
tell "one of the values written for this key" from "wrong bytes" without any shared state
(a killed writer process cannot tell its parent what it wrote last).
"""

from __future__ import annotations

import hashlib
import struct

from lcache.store.record import HEADER_SIZE

Key = int | bytes

_PREFIX = struct.Struct("<QQ")  # version, key tag
PREFIX_SIZE = _PREFIX.size
MAX_VALUE = 20 * 1024
# Bytes a sealed segment's summary spends per record (u64 key, u32 offset, u32 length, u8 kind).
SUMMARY_BYTES_PER_RECORD = 17


def key_repr(key: Key) -> str:
    """A JSON-friendly, reversible spelling of a key (``"i:42"`` or ``"b:6b6579"``)."""
    return f"i:{key}" if isinstance(key, int) else f"b:{bytes(key).hex()}"


def key_from_repr(text: str) -> Key:
    kind, _, body = text.partition(":")
    return int(body) if kind == "i" else bytes.fromhex(body)


def key_tag(key: Key) -> int:
    digest = hashlib.blake2b(key_repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def value_size(key: Key, version: int, max_size: int = MAX_VALUE) -> int:
    """A mixed size for (key, version): a quarter tiny, half medium, a quarter large."""
    digest = hashlib.blake2b(f"{key_repr(key)}/{version}/size".encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little")
    bucket, r = h & 3, h >> 2
    if bucket == 0:
        size = PREFIX_SIZE + r % 200
    elif bucket == 3:
        size = max_size // 2 + r % (max_size // 2 + 1)
    else:
        size = 1024 + r % (max_size // 2)
    return max(PREFIX_SIZE, min(size, max_size))


def make_value(key: Key, version: int, size: int | None = None) -> bytes:
    """The value written for ``key`` at ``version`` (``size`` defaults to ``value_size``)."""
    if size is None:
        size = value_size(key, version)
    if size < PREFIX_SIZE:
        raise ValueError(f"a self-describing value needs at least {PREFIX_SIZE} bytes")
    seed = f"{key_repr(key)}/{version}".encode()
    body = hashlib.shake_256(seed).digest(size - PREFIX_SIZE) if size > PREFIX_SIZE else b""
    return _PREFIX.pack(version, key_tag(key)) + body


def parse_version(key: Key, data: bytes | memoryview) -> int | None:
    """The version ``data`` was written at if it is exactly ``make_value(key, version)``."""
    raw = bytes(data)
    if len(raw) < PREFIX_SIZE:
        return None
    version, tag = _PREFIX.unpack_from(raw)
    if tag != key_tag(key) or make_value(key, version, len(raw)) != raw:
        return None
    return int(version)


def record_bytes(key: Key, payload_len: int) -> int:
    """Bytes a record of ``payload_len`` takes in a segment, its summary entry included."""
    key_len = 0 if isinstance(key, int) else len(key)
    return HEADER_SIZE + key_len + payload_len + SUMMARY_BYTES_PER_RECORD


def pattern_bytes(size: int, seed: int) -> bytes:
    """``size`` cheap pseudo-random bytes (for tests that do not need self-describing values)."""
    if size <= 0:
        return b""
    block = hashlib.shake_256(seed.to_bytes(8, "little", signed=True)).digest(min(size, 4096))
    return (block * (size // len(block) + 1))[:size]
