"""Argument checks for numbers from callers: one rule per kind of value, one place.

Every public entry point that takes a count, a token number, a timeout or block ids
converts it here (the copier, the NIXL planner, the transfer manager and its arena), so
every bad input raises ``TypeError`` (wrong kind: a float, a string, a bool, a nested
list, a set, a masked array) or ``ValueError`` (right kind, wrong value: negative, out
of its range, out of int64), and the message names the argument and shows the value as
given (``repr``, shortened), never a converted one.

Why not ``int(x)`` / ``np.asarray(x).astype(np.int64)``: ``int(40.5)`` is 40,
``int("40")`` is 40, ``int(True)`` is 1, ``int(float("inf"))`` raises
``OverflowError``, a uint64 ``2**64 - 1`` becomes -1 (which is ``NO_BLOCK``) under
``astype``, ``np.asarray`` of ragged nested lists raises whatever numpy raises, and a
numpy masked array's mask is ignored by everything that reads it as an array. Python
bools are ints to Python, never to kvcopy.

Ranges: :func:`block_id_lists` checks each id against the bounds its caller states
(``lowest``: -1 where ``NO_BLOCK`` is allowed, else 0; ``limits``: per group, the blocks
the cache holds), once, before anything derived from the ids (pages, spans) is
computed: an id past its cache never reaches page arithmetic, where ``id * pages per
block`` could wrap around int64.

Cost: scalars are an ``isinstance`` or two. Id lists are one ``np.asarray`` plus a
dtype check; a Python list is scanned for non-ints first (one ``all`` over the list;
~10 us per 1,000 ids).
"""
from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence

import numpy as np

_INT64_MAX = np.iinfo(np.int64).max
SHOWN = 80  # characters of a bad value a message shows


def shown(value, limit: int = SHOWN) -> str:
    """``repr(value)``, cut to ``limit`` characters (a huge list, or a peer's megabytes,
    stays readable). A ``repr`` that raises is shown as the type's name."""
    try:
        text = repr(value)
    except Exception:  # a repr that raises is still a bad input, not a crash
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_plain_int(value) -> bool:
    """An int or numpy integer that is not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def integer(value, what: str, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    """``value`` as a Python int: an ``int`` or numpy integer, not a bool (Python's or
    numpy's), not a float, not a string; in ``[minimum, maximum]`` where given, and in
    int64."""
    if not is_plain_int(value):
        raise TypeError(f"{what} must be an integer, got {shown(value)} ({type(value).__name__})")
    n = int(value)
    if minimum is not None and n < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {shown(value)}" + (" (negative)" if n < 0 else ""))
    if maximum is not None and n > maximum:
        raise ValueError(f"{what} must be <= {maximum}, got {shown(value)}")
    if n > _INT64_MAX:
        raise ValueError(f"{what} {shown(value)} does not fit in int64")
    return n


def seconds(value, what: str, allow_zero: bool = False) -> Optional[float]:
    """A duration: None (none), or a finite number of seconds, positive (or zero with
    ``allow_zero``); not a bool, not a string."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} must be a number of seconds or None, got {shown(value)} ({type(value).__name__})")
    s = float(value)
    if not (math.isfinite(s) and (s > 0 or (allow_zero and s == 0))):
        raise ValueError(f"{what} must be {'>= 0' if allow_zero else 'positive'} and finite, got {shown(value)}")
    return s


def _refuse_masked(value, what: str) -> None:
    if isinstance(value, np.ma.MaskedArray):
        raise TypeError(f"{what}: a numpy masked array (its mask would be ignored): pass the ids it means, "
                        f"got {shown(value)}")


def sequence(value, what: str, length: Optional[int] = None):
    """A list, tuple or 1-D+ array (not a string, bytes, mapping, set, dict view,
    generator, scalar or masked array), of ``length`` items when given."""
    _refuse_masked(value, what)
    if isinstance(value, (str, bytes, bytearray, dict, set, frozenset)) or not hasattr(value, "__len__") \
            or not hasattr(value, "__getitem__") or (isinstance(value, np.ndarray) and value.ndim == 0):
        raise TypeError(f"{what} must be a list or tuple, got {shown(value)} ({type(value).__name__})")
    if length is not None and len(value) != length:
        raise ValueError(f"{what}: expected {length} item(s), got {len(value)}: {shown(value)}")
    return value


def items(value, what: str) -> list:
    """The items of a caller's outer sequence (see :func:`sequence`), read by index as
    ``len()`` counts them: a sequence whose ``len()`` promises items it does not have
    raises ``ValueError`` here, not ``IndexError`` later."""
    sequence(value, what)
    n = len(value)
    try:
        return [value[i] for i in range(n)]
    except IndexError:
        raise ValueError(f"{what}: len() says {n} item(s), but they cannot all be read: {shown(value)}") from None


def _torch_ids(ids, what: str):
    """A CPU integer tensor as numpy; anything else as it is."""
    try:
        import torch  # noqa: PLC0415  (kvcopy imports torch anyway; keeps this module light)
    except ImportError:  # pragma: no cover
        return ids
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise TypeError(f"{what}: block ids must be host data, got a {ids.device} tensor")
        if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise TypeError(f"{what}: block ids must be integers, got a {ids.dtype} tensor")
        return ids.numpy()
    return ids


def block_ids(ids, what: str, lowest: Optional[int] = None, limit: Optional[int] = None) -> np.ndarray:
    """One flat list of block ids as int64: a list/tuple of ints, a 1-D integer numpy
    array or CPU tensor. Bools (any kind), floats, strings, nested lists, masked arrays
    and values outside int64 (a uint64 ``2**64 - 1`` would wrap to -1, ``NO_BLOCK``) are
    refused; with ``lowest`` / ``limit``, so is an id below ``lowest`` or at or past
    ``limit``."""
    given = ids
    ids = _torch_ids(ids, what)
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
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (lowest is not None or limit is not None):
        lo, hi = int(arr.min()), int(arr.max())
        if lowest is not None and lo < lowest:
            extra = f" (only {lowest} = none)" if lowest < 0 else ""
            raise ValueError(f"{what}: negative block id {lo}{extra} in {shown(given)}")
        if limit is not None and hi >= limit:
            raise ValueError(f"{what}: block id {hi} out of range [0, {limit}) in {shown(given)}")
    return arr


def block_id_lists(value, n_groups: int, what: str, lowest: int = 0,
                   limits: Optional[Sequence[Optional[int]]] = None) -> List[np.ndarray]:
    """One flat block id list per KV cache group, each as int64 (see :func:`block_ids`),
    each id ``>= lowest`` and below its group's ``limits[g]`` where given. A value that
    is not a list of lists raises ``TypeError``; the wrong number of lists ``ValueError``."""
    value = items(value, f"{what} (one block id list per KV cache group)")
    if len(value) != n_groups:
        raise ValueError(f"{what}: expected one block id list per KV cache group ({n_groups}), got "
                         f"{len(value)}: {shown(value)}")
    return [block_ids(ids, f"{what}, group {g}", lowest, None if limits is None else limits[g])
            for g, ids in enumerate(value)]


def per_group_counts(value, n_groups: int, what: str, minimum: int = 0) -> List[int]:
    """An int (the same for every group) or one int per group, each >= ``minimum``."""
    if not isinstance(value, (list, tuple, np.ndarray)):
        return [integer(value, what, minimum=minimum)] * n_groups
    sequence(value, what)
    if len(value) != n_groups:
        raise ValueError(f"{what}: expected one value per KV cache group ({n_groups}), got {len(value)}: "
                         f"{shown(value)}")
    return [integer(v, f"{what}[{g}]", minimum=minimum) for g, v in enumerate(value)]


def name(value, what: str, max_len: int) -> str:
    """A non-empty string of at most ``max_len`` characters, no NUL."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {shown(value)} ({type(value).__name__})")
    if not 0 < len(value) <= max_len or "\0" in value:
        raise ValueError(f"{what} must be 1 to {max_len} characters without NUL, got {shown(value)}")
    return value


def env_int(variable: str, default: int, minimum: int = 0) -> int:
    """The integer environment variable ``variable`` (``default`` when unset or blank);
    ``ValueError`` naming it when it is not an integer of at least ``minimum``."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value = int(text, 10)
    except ValueError:
        raise ValueError(f"{variable} must be an integer, got {shown(text)}") from None
    if value < minimum:
        raise ValueError(f"{variable} must be at least {minimum}, got {value}")
    return value


def env_flag(variable: str, default: bool) -> bool:
    """The switch ``variable``: ``1`` on, ``0`` off, unset or blank ``default``;
    ``ValueError`` naming it for anything else."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    if text not in ("0", "1"):
        raise ValueError(f"{variable} must be 0 or 1, got {shown(text)}")
    return text == "1"
