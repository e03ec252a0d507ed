"""Argument checks shared by the copier and the NIXL manager: one rule per kind of value.

Every public entry point that takes a count, a token number, a timeout or block ids
converts it here, so every bad input raises ``TypeError`` (wrong kind: a float, a
string, a bool, a nested list) or ``ValueError`` (right kind, wrong value: negative,
out of int64), and the message names the argument and shows the value as given
(``repr``, shortened), never a converted one.

Why not ``int(x)`` / ``np.asarray(x).astype(np.int64)``: ``int(40.5)`` is 40,
``int("40")`` is 40, ``int(True)`` is 1, a uint64 ``2**64 - 1`` becomes -1 (which is
``NO_BLOCK``) under ``astype``, and ``np.asarray`` of ragged nested lists raises
whatever numpy raises. Python bools are ints to Python, never to kvcopy.

Cost: scalars are an ``isinstance`` or two. Id lists are one ``np.asarray`` plus a
dtype check; a Python list is scanned for bools only when numpy made it an integer
array (one ``any`` over the list; ~10 us per 1,000 ids).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

_INT64_MAX = np.iinfo(np.int64).max


def shown(value, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a huge list stays readable)."""
    try:
        text = repr(value)
    except Exception:  # a repr that raises is still a bad input, not a crash
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def integer(value, what: str, minimum: Optional[int] = None) -> int:
    """``value`` as a Python int: an ``int`` or numpy integer, not a bool (Python's or
    numpy's), not a float, not a string; at least ``minimum`` when given."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {shown(value)} ({type(value).__name__})")
    n = int(value)
    if minimum is not None and n < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {shown(value)}")
    if n > _INT64_MAX:
        raise ValueError(f"{what} {shown(value)} does not fit in int64")
    return n


def seconds(value, what: str) -> Optional[float]:
    """A timeout: None (none), or a positive finite number of seconds (not a bool)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} must be a number of seconds or None, got {shown(value)} ({type(value).__name__})")
    s = float(value)
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"{what} must be positive and finite, got {shown(value)}")
    return s
