"""What P and D say to each other in a push (arena mode), beside the side channel's messages.

Notifications, P -> D over NIXL, tagged with the key (:mod:`kvcopy.nixl.wire.notices`)::

    b"kvcopy-push\\0" + token (32 hex digits) + b"\\0" + kind     f: every WRITE of it ended DONE
                                                                x: P will never WRITE it,
                                                                   and none is in flight
    b"kvcopy-push\\0" + token + b"\\0" + lo + b"\\0" + hi + b"\\0c"   c: P's units [lo, hi) WRITten,
                                                                   that WRITE ended DONE

and the bounds both sides hold a reservation item to (D plans within them, P refuses
beyond them): a token of :data:`TOKEN_BYTES`, at most :data:`MAX_ROWS` rows, a wait of at
most :data:`MAX_TIMEOUT_S`; P answers a cancel with one of :data:`ANSWERS`. D's half:
:mod:`kvcopy.nixl.push_reservations`; P's: :mod:`kvcopy.nixl.push_writes`.
"""
from __future__ import annotations

from typing import Optional, Tuple

PREFIX = b"kvcopy-push\0"
FINAL, NEVER, CHUNK = b"f", b"x", b"c"
MAX_UNIT_DIGITS = 6  # a chunk notice's unit numbers (spans have far fewer units)
TOKEN_BYTES = 16
MAX_ROWS = 4096
MAX_TIMEOUT_S = 3600.0  # the longest a reservation waits for P (P refuses longer: it keeps each until then)
ANSWERS = ("never", "ended", "in_flight")  # P's answers to a cancel


def notice(token: bytes, kind: bytes) -> bytes:
    return PREFIX + token.hex().encode() + b"\0" + kind


def parse_notice(msg: bytes) -> Optional[Tuple[bytes, bytes]]:
    """(token, kind) of a push notification, or None for anything else (peer input)."""
    if not msg.startswith(PREFIX):
        return None
    body = msg[len(PREFIX):]
    if len(body) != 2 * TOKEN_BYTES + 2 or body[-2:-1] != b"\0" or body[-1:] not in (FINAL, NEVER):
        return None
    try:
        return bytes.fromhex(body[:-2].decode("ascii")), body[-1:]
    except ValueError:
        return None


def chunk_notice(token: bytes, lo: int, hi: int) -> bytes:
    """P's ``c``: its units ``[lo, hi)`` of ``token``'s request were WRITten and the WRITE ended DONE."""
    return PREFIX + token.hex().encode() + b"\0%d\0%d\0" % (lo, hi) + CHUNK


def parse_chunk_notice(msg: bytes) -> Optional[Tuple[bytes, int, int]]:
    """(token, lo, hi) of a chunk notice, or None for anything else (peer input)."""
    if not msg.startswith(PREFIX) or not msg.endswith(b"\0" + CHUNK):
        return None
    parts = msg[len(PREFIX):-2].split(b"\0")
    if len(parts) != 3 or len(parts[0]) != 2 * TOKEN_BYTES \
            or not all(0 < len(x) <= MAX_UNIT_DIGITS and x.isdigit() for x in parts[1:]):
        return None
    lo, hi = int(parts[1]), int(parts[2])
    try:
        token = bytes.fromhex(parts[0].decode("ascii"))
    except ValueError:
        return None
    return (token, lo, hi) if lo < hi else None

