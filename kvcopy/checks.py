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
        raise ValueError(f"{what} must be >= {minimum}, got {shown(value)}" + (" (negative)" if n < 0 else ""))
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


def is_plain_int(value) -> bool:
    """An int or numpy integer that is not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def sequence(value, what: str, length: Optional[int] = None):
    """A list, tuple or 1-D+ array (not a string, bytes, mapping, set or scalar), of
    ``length`` items when given."""
    if isinstance(value, (str, bytes, bytearray, dict, set, frozenset)) or not hasattr(value, "__len__") \
            or not hasattr(value, "__getitem__") or (isinstance(value, np.ndarray) and value.ndim == 0):
        raise TypeError(f"{what} must be a list or tuple, got {shown(value)} ({type(value).__name__})")
    if length is not None and len(value) != length:
        raise ValueError(f"{what}: expected {length} item(s), got {len(value)}: {shown(value)}")
    return value


def block_ids(ids, what: str) -> np.ndarray:
    """One flat list of block ids as int64: a list/tuple of ints, a 1-D integer numpy
    array or CPU tensor. Bools (any kind), floats, strings, nested lists and values
    outside int64 (a uint64 ``2**64 - 1`` would wrap to -1, ``NO_BLOCK``) are refused."""
    given = ids
    try:
        import torch  # noqa: PLC0415  (kvcopy imports torch anyway; keeps this module light)
        if isinstance(ids, torch.Tensor):
            if ids.device.type != "cpu":
                raise TypeError(f"{what}: block ids must be host data, got a {ids.device} tensor")
            if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
                raise TypeError(f"{what}: block ids must be integers, got a {ids.dtype} tensor")
            ids = ids.numpy()
    except ImportError:  # pragma: no cover
        pass
    sequence(ids, what)
    if isinstance(ids, np.ndarray):
        arr = ids
    else:
        if not all(map(is_plain_int, ids)):
            bad = next(x for x in ids if not is_plain_int(x))
            if isinstance(bad, (list, tuple, np.ndarray)):
                raise ValueError(f"{what}: block ids must be a flat list, got {shown(given)}")
            raise TypeError(f"{what}: block ids must be integers (not bools, floats, strings or lists), "
                            f"got {shown(bad)} ({type(bad).__name__}) in {shown(given)}")
        try:
            arr = np.asarray(ids)
        except OverflowError:
            arr = np.asarray(ids, dtype=object)
    if arr.ndim != 1:
        raise ValueError(f"{what}: block ids must be a flat list, got shape {arr.shape}: {shown(given)}")
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype == object:  # Python ints past int64
            raise ValueError(f"{what}: block id out of int64 range in {shown(given)}")
        raise TypeError(f"{what}: block ids must be integers, got {arr.dtype}: {shown(given)}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _INT64_MAX:
        raise ValueError(f"{what}: block id {int(arr.max())} out of int64 range (it would wrap to a "
                         f"negative id) in {shown(given)}")
    return arr.astype(np.int64, copy=False)


def per_group_counts(value, n_groups: int, what: str) -> list:
    """An int (the same for every group) or one int per group, each >= 0."""
    if not isinstance(value, (list, tuple, np.ndarray)):
        return [integer(value, what, minimum=0)] * n_groups
    sequence(value, what, n_groups)
    return [integer(v, f"{what}[{g}]", minimum=0) for g, v in enumerate(value)]
