"""A bound on a msgpack message's shape, checked before any decoder sees it.

msgpack decoders (msgspec's among them) recurse once per nesting level: about 1 KB of
``0x91`` bytes (an array holding an array holding ...) makes them raise
``RecursionError``, from whatever thread decodes it. :func:`check_shape` walks the
bytes without recursion and without building anything, and refuses (``ValueError``) a
message that is larger than ``max_bytes``, nests containers deeper than ``max_depth``,
holds more than ``max_items`` values in all, declares a container or string longer than
the bytes left, uses the never-used byte ``0xc1``, or is followed by extra bytes. Only a
message that passes is handed to the decoder.

Format (the msgpack spec): one type byte, then per type a fixed number of length or
value bytes; fixmap/fixarray/fixstr carry their count in the type byte; maps count
two values per entry.
"""
from __future__ import annotations

import struct
from typing import Tuple

# type byte -> bytes of its big-endian length field, for strings, binaries and exts
_LENGTH_BYTES = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4, 0xc7: 1, 0xc8: 2, 0xc9: 4}
_EXT = (0xc7, 0xc8, 0xc9)  # an ext has a type byte after its length
# type byte -> bytes that follow it (numbers, fixext: type byte + data)
_FIXED = {0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8, 0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8,
          0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}
# type byte -> (bytes of its count field, values per entry) for arrays and maps
_CONTAINERS = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}
_UNSIGNED = {1: ">B", 2: ">H", 4: ">I"}


def check_shape(data: bytes, max_bytes: int, max_depth: int, max_items: int) -> None:
    """Refuse ``data`` (``ValueError`` saying why) unless it is one msgpack value within
    the bounds (module docstring); never raises anything else, whatever the bytes."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"a msgpack message must be bytes, got {type(data).__name__}")
    view = bytes(data)
    n = len(view)
    if n > max_bytes:
        raise ValueError(f"message of {n} bytes, more than {max_bytes}")
    pending = [1]  # per open container (the message itself at the bottom): values still to read
    at = items = 0
    while pending:
        if pending[-1] == 0:
            pending.pop()
            continue
        pending[-1] -= 1
        items += 1
        if items > max_items:
            raise ValueError(f"more than {max_items} values")
        at, count = _value(view, at)
        if at > n or count > n - at:  # each value takes at least one byte
            raise ValueError("truncated, or a length past the message's end")
        if count:
            if len(pending) > max_depth:
                raise ValueError(f"nested deeper than {max_depth}")
            pending.append(count)
    if at != n:
        raise ValueError(f"{n - at} bytes after the message")


def _value(view: bytes, at: int) -> Tuple[int, int]:
    """The value starting at ``at``: (where its own bytes end, the values a container holds)."""
    if at >= len(view):
        raise ValueError("truncated")
    t = view[at]
    at += 1
    if t <= 0x7f or t >= 0xe0 or t in (0xc0, 0xc2, 0xc3):
        return at, 0
    if 0x80 <= t <= 0x8f:
        return at, 2 * (t & 0x0f)
    if 0x90 <= t <= 0x9f:
        return at, t & 0x0f
    if 0xa0 <= t <= 0xbf:
        return at + (t & 0x1f), 0
    if t in _FIXED:
        return at + _FIXED[t], 0
    if t in _LENGTH_BYTES:
        size, at = _read_unsigned(view, at, _LENGTH_BYTES[t])
        return at + size + (1 if t in _EXT else 0), 0
    if t in _CONTAINERS:
        width, per = _CONTAINERS[t]
        entries, at = _read_unsigned(view, at, width)
        return at, per * entries
    raise ValueError(f"byte {t:#04x} at {at - 1} is not a msgpack type")


def _read_unsigned(view: bytes, at: int, width: int):
    if at + width > len(view):
        raise ValueError("truncated")
    (value,) = struct.unpack_from(_UNSIGNED[width], view, at)
    return value, at + width
