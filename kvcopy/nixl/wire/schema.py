"""Typed, range-checked reading of untrusted JSON records (the handshake header, the
staged-request record of arena mode).

A peer's record is JSON: objects, lists, strings, numbers, ``null``. :func:`loads`
parses it (duplicate keys, ``NaN``/``Infinity`` and nesting past Python's recursion
limit are refused as ``ValueError``, not taken last-wins or raised as whatever the
parser raises).
:class:`Record` reads one object field by field, each read saying what it expects
(an int in a range, a string from a set, a list of at most so many entries), so a
record is validated in the one place that reads it, with no per-input special case:

    r = Record(obj, "region 3")
    pages = r.integer("num_pages", 1, MAX_PAGES)
    kind = r.choice("kind", KINDS)
    r.done()                       # a field nobody read is an error, not ignored

Rules, for every field: JSON ``true``/``false`` are not integers (Python's ``bool`` is
an ``int``; the check refuses it), floats are not integers, ``null`` is only taken
by the ``*_or_none`` readers, and every list has a length limit checked before
anything walks it. Errors are ``ValueError`` naming the record, the field and the
value given (shortened), never ``KeyError``/``TypeError`` from deep inside.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, List, Mapping, Optional

from ...checks import shown


def loads(data: bytes, where: str) -> Any:
    """JSON from a peer: UTF-8, no duplicate keys, no ``NaN``/``Infinity``; every
    failure (deep nesting included) is a ``ValueError`` naming ``where``."""
    try:
        return json.loads(bytes(data).decode("utf-8"), parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"malformed {where}: {type(exc).__name__}: {str(exc)[:200]}") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a peer's record may carry")


def _no_duplicates(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {shown(dup)}")
    return out


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: Any, lo: int, hi: int, where: str) -> int:
    """``value`` if it is an int (not a bool) in ``[lo, hi]``, else ``ValueError``."""
    if not is_int(value):
        raise ValueError(f"{where}: expected an integer, got {shown(value)}")
    if not lo <= value <= hi:
        raise ValueError(f"{where}: {value} out of range [{lo}, {hi}]")
    return value


def check_list(value: Any, min_len: int, max_len: int, where: str) -> list:
    """``value`` if it is a list of ``min_len`` to ``max_len`` entries."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list, got {shown(value)}")
    if not min_len <= len(value) <= max_len:
        raise ValueError(f"{where}: {len(value)} entries, expected {min_len} to {max_len}")
    return value


def check_str(value: Any, max_len: int, where: str) -> str:
    """``value`` if it is a non-empty string of at most ``max_len`` characters, no NUL."""
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {shown(value)}")
    if not 0 < len(value) <= max_len or "\0" in value:
        raise ValueError(f"{where}: {shown(value)} is not a name (1 to {max_len} characters, no NUL)")
    return value


class Record:
    """One JSON object of untrusted input, read field by field (see the module docstring)."""

    def __init__(self, obj: Any, where: str):
        if not isinstance(obj, Mapping):
            raise ValueError(f"{where}: expected an object, got {shown(obj)}")
        self._obj = obj
        self._read: set = set()
        self.where = where

    def _get(self, name: str, optional: bool):
        self._read.add(name)
        if name not in self._obj:
            if optional:
                return None
            raise ValueError(f"{self.where}: field {name!r} is missing")
        value = self._obj[name]
        if value is None and not optional:
            raise ValueError(f"{self.where}: field {name!r} is null")
        return value

    def at(self, name: str) -> str:
        return f"{self.where}, {name}"

    def integer(self, name: str, lo: int, hi: int) -> int:
        return check_int(self._get(name, False), lo, hi, self.at(name))

    def integer_or_none(self, name: str, lo: int, hi: int) -> Optional[int]:
        value = self._get(name, True)
        return None if value is None else check_int(value, lo, hi, self.at(name))

    def name(self, name: str, max_len: int = 256) -> str:
        return check_str(self._get(name, False), max_len, self.at(name))

    def choice(self, name: str, choices: Iterable[str]) -> str:
        value = self._get(name, False)
        options = tuple(choices)
        if not isinstance(value, str) or value not in options:
            raise ValueError(f"{self.at(name)}: {shown(value)} is not one of {list(options)}")
        return value

    def entries(self, name: str, min_len: int, max_len: int) -> List[Any]:
        return check_list(self._get(name, False), min_len, max_len, self.at(name))

    def entries_or_none(self, name: str, min_len: int, max_len: int) -> Optional[List[Any]]:
        value = self._get(name, True)
        return None if value is None else check_list(value, min_len, max_len, self.at(name))

    def optional(self, name: str) -> Any:
        """A field that may be absent (None), unchecked: the caller reads it with its own
        :class:`Record` or check."""
        return self._get(name, True)

    def integers(self, name: str, min_len: int, max_len: int, lo: int, hi: int) -> List[int]:
        values = self.entries(name, min_len, max_len)
        return [check_int(v, lo, hi, f"{self.at(name)}[{i}]") for i, v in enumerate(values)]

    def done(self) -> None:
        """Refuse fields no reader asked for: a header this version does not understand."""
        extra = [k for k in self._obj if k not in self._read]
        if extra:
            raise ValueError(f"{self.where}: unknown field(s) {shown(sorted(map(str, extra)))}")
