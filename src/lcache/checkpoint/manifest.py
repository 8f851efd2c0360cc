"""The manifest file: a checksummed JSON document, written compact, read within fixed bounds.

A manifest comes from disk, so it may be damaged or crafted. It is read only if it is at most
``MAX_MANIFEST_BYTES``, and parsed only after a scan of its text has found nesting no deeper
than ``MAX_JSON_DEPTH`` and no number longer than ``MAX_INT_DIGITS`` digits: a damaged
manifest costs a bounded amount of memory and time and raises ``CorruptionError``, never a
``RecursionError`` or a ``ValueError`` that would stop a listing of its intact siblings. The
bounds are what the format needs (docs/checkpoint.md, "Limits"); a save refuses a state that
would need more (``format.encode_tree`` for the depth, ``check_manifest_room`` for the size).
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeGuard

import numpy as np

from lcache.checkpoint.format import ALIGN, MAX_STATE_DEPTH, checksum, is_plain_name
from lcache.errors import CorruptionError

FORMAT = "lcache-checkpoint"
VERSION = 1
# About 200 bytes an array (its table entry plus its place in the tree): room for some
# 300,000 arrays, all ranks together; parsing that much takes about 0.5 GB for a moment.
MAX_MANIFEST_BYTES = 64 << 20
MAX_ORDER = 1e11 - 1  # a checkpoint's place in its directory, in seconds like created_unix
# document, body, shards, shard, tree root: 5 levels; then 2 per level of the state, and a
# dict's int key object ({"int": k} in its key list) 2 more below its node.
MAX_JSON_DEPTH = 5 + 2 * MAX_STATE_DEPTH + 2
MAX_INT_DIGITS = 4300  # CPython's int_max_str_digits default; ints beyond 64 bits are hex
_ENVELOPE = 4096  # the manifest's bytes besides the shards and meta, with room to spare

_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1
_SCAN = 1 << 18  # bytes a scan step takes: its temporaries stay near 10 MiB


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def dump_manifest(body: dict[str, Any]) -> bytes:
    """The manifest file's bytes: the body plus a checksum of it (a flipped bit is caught)."""
    doc = {"format": FORMAT, "version": VERSION, "xxh3": checksum(_canonical(body)),
           "body": body}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _runs(mask: np.ndarray[Any, Any], idx: np.ndarray[Any, Any], carry: int
          ) -> np.ndarray[Any, Any]:
    """Length of the run of True in ``mask`` ending at each position (``carry`` Trues
    before the first)."""
    last_false = np.maximum.accumulate(np.where(mask, -1, idx))
    run = idx - last_false
    run[last_false == -1] += carry
    return run


def scan_json(raw: bytes | bytearray) -> tuple[int, int]:
    """(deepest nesting of brackets, longest run of digits), both outside strings, of UTF-8
    JSON text, without parsing it.

    The depth is never less than the depth ``json.loads`` recurses to (for valid text, or the
    valid part before an error). Vectorized and in steps, so time and memory stay linear
    for any input (a regular expression that skips strings is quadratic on an unterminated
    run of escaped quotes).
    """
    data = np.frombuffer(raw, np.uint8)
    idx = np.arange(min(len(data), _SCAN), dtype=np.int32)
    depth = deepest = longest = 0
    inside = slashes = digits = 0  # state at the end of the previous step
    for start in range(0, len(data), _SCAN):
        chunk = data[start : start + _SCAN]
        at = idx[: len(chunk)]
        run = _runs(chunk == ord("\\"), at, slashes)
        before = np.concatenate(([slashes], run[:-1]))  # backslashes just before each byte
        quote = (chunk == ord('"')) & (before % 2 == 0)  # not escaped
        in_string = np.bitwise_xor.accumulate(quote.view(np.uint8)) ^ np.uint8(inside)
        outside = in_string == 0
        levels = np.cumsum(_DEPTH_STEP[chunk] * outside, dtype=np.int64) + depth
        deepest = max(deepest, int(levels.max()))
        number = _runs(((chunk - ord("0")) < 10) & outside, at, digits)
        longest = max(longest, int(number.max()))
        depth, inside = int(levels[-1]), int(in_string[-1])
        slashes, digits = int(run[-1]), int(number[-1])
    return deepest, longest


def _check_text(raw: bytes | bytearray, where: str) -> str:
    """The manifest as text, after the checks that bound what parsing it can cost."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptionError(f"{where} is {len(raw)} bytes, more than a manifest can be "
                              f"({MAX_MANIFEST_BYTES >> 20} MiB); the checkpoint is damaged")
    try:
        text = raw.decode("utf-8")  # strict: no UTF-16 or BOM guessing as json.loads does
    except UnicodeDecodeError as exc:
        raise CorruptionError(f"{where} is not UTF-8 text; the checkpoint is damaged") from exc
    depth, digits = scan_json(raw)
    if digits > MAX_INT_DIGITS:
        raise CorruptionError(f"{where} holds a number of more than {MAX_INT_DIGITS} digits; "
                              "the checkpoint is damaged")
    if depth > MAX_JSON_DEPTH:
        raise CorruptionError(f"{where} is nested {depth} levels deep, more than a manifest "
                              f"can be ({MAX_JSON_DEPTH}); the checkpoint is damaged")
    return text


def parse_manifest(raw: bytes | bytearray, where: str) -> dict[str, Any]:
    """The manifest body, after checking bounds, format, version, checksum and fields.

    Raises:
        CorruptionError: whatever is wrong with it; nothing else.
    """
    text = _check_text(raw, where)
    try:
        doc = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, and numbers beyond the digit limit
        raise CorruptionError(f"{where} is not valid JSON ({exc}); the checkpoint is damaged"
                              ) from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptionError(f"{where} is not an lcache checkpoint manifest")
    if doc.get("version") != VERSION:
        raise CorruptionError(f"{where} has format version {doc.get('version')!r:.20}; this "
                              f"lcache reads version {VERSION}")
    body = doc.get("body")
    if not isinstance(body, dict) or checksum(_canonical(body)) != doc.get("xxh3"):
        raise CorruptionError(f"{where}: manifest checksum mismatch; the file is damaged")
    check_body(body, where)
    return body


def _is_int(value: Any) -> TypeGuard[int]:
    return type(value) is int  # not bool, not float


def check_body(body: dict[str, Any], where: str) -> None:
    """Check the fields every reader relies on (array entries are checked per shard, by
    ``format.ArrayRef.from_json``, when a shard is read)."""
    shards, world = body.get("shards"), body.get("world_size")
    if not (_is_int(world) and isinstance(shards, list) and 1 <= world == len(shards)):
        raise CorruptionError(f"{where}: shard list does not match world_size")
    created = body.get("created_unix")
    if not (_is_int(created) or isinstance(created, float)) or not 0 <= created < 1e11:
        raise CorruptionError(f"{where}: invalid creation time {created!r:.40}")
    order = body.get("order", 0)
    if not (_is_int(order) or isinstance(order, float)) or not 0 <= order <= MAX_ORDER:
        raise CorruptionError(f"{where}: invalid order {order!r:.40}")
    if not isinstance(body.get("meta", {}), dict):
        raise CorruptionError(f"{where}: meta is not a JSON object")
    ranks: set[int] = set()
    for shard in shards:
        if not isinstance(shard, dict):
            raise CorruptionError(f"{where}: a shard entry is not a JSON object")
        rank, fname, nbytes = shard.get("rank"), shard.get("file"), shard.get("data_bytes")
        if not _is_int(rank) or not 0 <= rank < world or rank in ranks:
            raise CorruptionError(f"{where}: invalid or repeated shard rank {rank!r:.40}")
        ranks.add(rank)
        if not is_plain_name(fname):
            raise CorruptionError(f"{where}: invalid data file name {fname!r:.80}: a plain "
                                  "name in the checkpoint's directory was expected")
        if not _is_int(nbytes) or nbytes < 0 or nbytes % ALIGN:
            raise CorruptionError(f"{where}: invalid data file size {nbytes!r:.40}")
        if not isinstance(shard.get("arrays"), list) or "tree" not in shard:
            raise CorruptionError(f"{where}: shard {rank} has no array table or tree")


def check_manifest_room(shard: dict[str, Any], world: int, meta: dict[str, Any]) -> None:
    """Refuse, before its data is written, a save whose manifest could pass the cap: every
    rank checks that ``world`` shards the size of its own would fit.

    Raises:
        UnsupportedValueError: naming the size and the cap.
    """
    from lcache.checkpoint.errors import UnsupportedValueError

    size = world * len(_canonical(shard)) + len(_canonical(meta)) + _ENVELOPE
    if size > MAX_MANIFEST_BYTES:
        raise UnsupportedValueError(
            f"this state's checkpoint manifest would be about {math.ceil(size / 2**20)} MiB, "
            f"more than the {MAX_MANIFEST_BYTES >> 20} MiB a manifest may be: fewer arrays "
            "(e.g. flatten many small tensors into one) or shorter strings in the state")


def check_meta(meta: Any) -> dict[str, Any]:
    """``meta`` as stored: a JSON object that the reader's bounds accept.

    Raises:
        ConfigError: it is not a dict of JSON values, or is nested too deep.
    """
    from lcache.checkpoint.errors import ConfigError

    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise ConfigError(f"meta must be a dict of JSON values, got {type(meta).__name__}")
    try:
        raw = _canonical(meta)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"meta must be a dict of JSON values ({exc}); convert what is not "
                          "(e.g. numpy numbers with int() or float())") from exc
    depth, digits = scan_json(raw)
    if depth > MAX_JSON_DEPTH - 2 or digits > MAX_INT_DIGITS:  # meta is 2 levels down
        raise ConfigError(f"meta is nested more than {MAX_JSON_DEPTH - 2} levels deep or holds "
                          f"a number of more than {MAX_INT_DIGITS} digits; keep it small")
    return meta
