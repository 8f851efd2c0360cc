"""Self-describing records: a 32-byte header, the key bytes (byte keys only), the payload.

Header layout (little-endian)::

    0  u32 magic "LCR1"     4  u8 version   5  u8 kind (0 int key, 1 byte key)
    6  u16 key_len          8  u32 payload_len
    12 u64 key (the int key, or xxh3-64 of the byte key)
    20 u64 checksum (xxh3-64 of key bytes + payload, seeded with the key)
    28 u32 header check (xxh32 of bytes 0..27)

Every read checks magic, header check, kind, key, length and checksum, so a stale, torn or
corrupted index entry can only produce a miss, never wrong bytes.
"""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass

import xxhash

from lcache.errors import ArgumentTypeError, ConfigError

MAGIC = 0x3152434C  # b"LCR1" read as little-endian u32
VERSION = 1
HEADER = struct.Struct("<IBBHIQQI")
HEADER_SIZE = HEADER.size  # 32
_PREFIX = struct.Struct("<IBBHIQQ")
KIND_INT = 0
KIND_BYTES = 1
MAX_KEY_BYTES = 1024
MAX_INT_KEY = (1 << 63) - 1

_xxh3 = xxhash.xxh3_64_intdigest
_xxh32 = xxhash.xxh32_intdigest


def key_parts(key: int | bytes) -> tuple[int, int, bytes]:
    """``(kind, key64, key_bytes)`` for a user key; rejects what cannot be stored.

    An int key is anything ``operator.index`` takes but a bool (numpy integers: ``put`` of
    an ``np.int64`` was refused while ``get`` took it).

    Raises:
        ConfigError: an int key outside [0, 2**63), or byte keys not 1..1024 bytes long.
        ArgumentTypeError: a key that is neither (also a TypeError).
    """
    if type(key) is not int:
        if isinstance(key, (bytes, bytearray, memoryview)):
            kb = bytes(key)
            if not 0 < len(kb) <= MAX_KEY_BYTES:
                raise ConfigError(f"byte keys must be 1..{MAX_KEY_BYTES} bytes long, got "
                                  f"{len(kb)}")
            return KIND_BYTES, _xxh3(kb), kb
        try:
            if isinstance(key, bool):  # True is 1 to operator.index: a mistake, not a key
                raise TypeError
            key = operator.index(key)
        except TypeError:
            raise ArgumentTypeError(f"keys are int or bytes, got {type(key).__name__}"
                                    ) from None
    if not 0 <= key <= MAX_INT_KEY:
        raise ConfigError(f"int keys must be in [0, 2**63), got {key}")
    return KIND_INT, key, b""


def record_size(key_bytes: bytes, payload_len: int) -> int:
    return HEADER_SIZE + len(key_bytes) + payload_len


def checksum(key64: int, key_bytes: bytes, payload: bytes | memoryview) -> int:
    seed = key64 & 0xFFFFFFFFFFFFFFFF
    if key_bytes:
        return _xxh3(payload, seed=_xxh3(key_bytes, seed=seed))
    return _xxh3(payload, seed=seed)


def pack_header(kind: int, key64: int, key_bytes: bytes, payload: bytes | memoryview) -> bytes:
    prefix = _PREFIX.pack(
        MAGIC, VERSION, kind, len(key_bytes), len(payload), key64,
        checksum(key64, key_bytes, payload),
    )
    return prefix + _xxh32(prefix).to_bytes(4, "little")


@dataclass(frozen=True, slots=True)
class Header:
    kind: int
    key_len: int
    payload_len: int
    key64: int
    checksum: int

    @property
    def size(self) -> int:
        return HEADER_SIZE + self.key_len + self.payload_len


def parse_header(buf: bytes | memoryview) -> Header | None:
    """The header at the start of ``buf``, or ``None`` if it is not a valid header."""
    if len(buf) < HEADER_SIZE:
        return None
    magic, version, kind, key_len, plen, key64, csum, check = HEADER.unpack_from(buf)
    if magic != MAGIC or version != VERSION or kind > KIND_BYTES:
        return None
    if check != _xxh32(buf[: HEADER_SIZE - 4]):
        return None
    if (kind == KIND_INT) != (key_len == 0):
        return None
    return Header(kind, key_len, plen, key64, csum)


def verify(buf: memoryview, kind: int, key64: int, key_bytes: bytes) -> memoryview | None:
    """The payload of the record in ``buf`` if it is intact and holds this key, else ``None``.

    The hot path of every read: the header is checked inline rather than through
    ``parse_header`` (same checks, no object per record).
    """
    if len(buf) < HEADER_SIZE:
        return None
    magic, version, r_kind, key_len, plen, r_key, csum, check = HEADER.unpack_from(buf)
    if (magic != MAGIC or version != VERSION or r_kind != kind or r_key != key64
            or key_len != len(key_bytes) or HEADER_SIZE + key_len + plen != len(buf)
            or check != _xxh32(buf[: HEADER_SIZE - 4])):
        return None
    if key_len and buf[HEADER_SIZE : HEADER_SIZE + key_len] != key_bytes:
        return None
    payload = buf[HEADER_SIZE + key_len :]
    if checksum(key64, key_bytes, payload) != csum:
        return None
    return payload


def verify_any(buf: memoryview) -> Header | None:
    """The header of the record at the start of ``buf`` if the whole record is intact."""
    h = parse_header(buf)
    if h is None or h.size > len(buf):
        return None
    key_bytes = bytes(buf[HEADER_SIZE : HEADER_SIZE + h.key_len])
    if h.kind == KIND_BYTES and _xxh3(key_bytes) != h.key64:
        return None
    payload = buf[HEADER_SIZE + h.key_len : h.size]
    if checksum(h.key64, key_bytes, payload) != h.checksum:
        return None
    return h
