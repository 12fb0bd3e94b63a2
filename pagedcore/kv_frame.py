"""How one block travels through a store: a header naming what it holds, the payload, and a checksum over both.

``MAGIC | header length (u32, little endian) | header (JSON) | payload | SHA-256 of everything before it``. The header
names the block's key, the model fingerprint, the KV group and the block's own tokens; :func:`decode` checks the
checksum first (a truncated, corrupted or half-written block fails it), then that the header is the block asked for
(a file renamed, or written by another model, under this key). Any failure is a :class:`FrameError` with its
``reason`` (``"checksum"``, ``"fingerprint"`` or ``"foreign"``); the caller counts it and treats it as a miss.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

__all__ = ["FrameError", "decode", "encode"]

MAGIC = b"PCKVBLK1"
_LEN = struct.Struct("<I")
_DIGEST = 32


class FrameError(Exception):
    """A stored block that must not be loaded; ``reason`` is ``"checksum"``, ``"fingerprint"`` or ``"foreign"``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def encode(key: str, fingerprint: str, group: int, tokens: Sequence[int], payload: bytes) -> bytes:
    """One block, framed.

    Example:
        >>> data = encode("ab", "fp", 0, [1, 2], b"kv")
        >>> decode(data, "ab", "fp", 0, [1, 2])
        b'kv'
        >>> decode(data[:-1], "ab", "fp", 0, [1, 2])
        Traceback (most recent call last):
        ...
        pagedcore.kv_frame.FrameError: checksum: ...
        >>> decode(data, "ab", "another model", 0, [1, 2])
        Traceback (most recent call last):
        ...
        pagedcore.kv_frame.FrameError: fingerprint: ...
    """
    header = json.dumps(
        {"key": key, "fingerprint": fingerprint, "group": group, "tokens": list(tokens), "size": len(payload)},
        separators=(",", ":"),
    ).encode()
    body = b"".join((MAGIC, _LEN.pack(len(header)), header, payload))
    return body + hashlib.sha256(body).digest()


def decode(data: bytes, key: str, fingerprint: str, group: int, tokens: Sequence[int]) -> bytes:
    """The payload of a framed block, after checking it is whole and is the block asked for (see the module).

    Example:
        >>> data = encode("ab", "fp", 0, [1, 2], b"kv")
        >>> decode(data, "ab", "fp", 0, [1, 3])
        Traceback (most recent call last):
        ...
        pagedcore.kv_frame.FrameError: foreign: the file holds another block than its name says
    """
    if len(data) < len(MAGIC) + _LEN.size + _DIGEST or not data.startswith(MAGIC):
        raise FrameError("checksum", f"{len(data)} bytes do not hold a framed block")
    body, digest = memoryview(data)[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise FrameError("checksum", "the checksum does not match (truncated or corrupted)")
    (size,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    try:
        header = json.loads(bytes(body[start : start + size]))
    except ValueError as exc:
        raise FrameError("checksum", f"unreadable header ({exc})") from exc
    payload = bytes(body[start + size :])
    if not isinstance(header, dict) or header.get("size") != len(payload):
        raise FrameError("checksum", "the header does not describe the payload")
    if header.get("fingerprint") != fingerprint:
        raise FrameError("fingerprint", "written for another model, dtype, layout or weights")
    if header.get("key") != key or header.get("group") != group or header.get("tokens") != list(tokens):
        raise FrameError("foreign", "the file holds another block than its name says")
    return payload
