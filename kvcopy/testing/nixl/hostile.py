"""Hostile inputs to a transfer manager: edits of the plans it hands out, and mutations
of a staged-request record's wire form.

:func:`plan_edits`: for a plan type (host mode's ``PullPlan`` or arena mode's
``ArenaPlan``), one edit per field set to another live request's value and one set to
garbage (``object.__setattr__``: the plans are frozen), then edits of what a plan holds:
region pairs and refs, the span, the READ rows and zero runs (written in place, made
writable, through their bases, reshaped). Each edit is ``(name, edit(plan, other))``;
an edit may raise where it is made (that is a refusal too).

:func:`nixl_part`: NIXL's agent metadata cut out of a kvcopy handshake by hand, as anyone
who sees a handshake on the wire can (the HMAC authenticates it, nothing hides it): a
bare NIXL agent loaded with it reaches the engine's registered memory and its
notifications.

:func:`record_mutations`: every single-bit flip of the wire bytes, random byte changes,
every truncation, extensions, and JSON edits re-framed with a fresh digest: malformed
ones (duplicate keys, booleans, floats, strings and ``-0`` for integers, missing and
extra fields, deep nesting, another encoding) and well-formed ones with another meaning
(offset, sizes, tokens, blocks, order, names), without the managers' key. A reader using
the key must refuse every one (``ValueError``/``TypeError``).
"""
from __future__ import annotations

import dataclasses
import json
import struct
from functools import partial
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy as np

from ...nixl.wire.handshake import MAGIC
from ...nixl.wire.record import RECORD, canonical

Edit = Tuple[str, Callable[[Any, Any], None]]


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)


def _field_from(name: str, a, b) -> None:
    _set(a, name, getattr(b, name))


def _field_none(name: str, a, b) -> None:
    _set(a, name, None)


def _pair_field_from(name: str, a, b) -> None:
    _set(a.pairs[0], name, getattr(b.pairs[0], name))


def _ref_field_zero(name: str, a, b) -> None:
    _set(a.pairs[0].local, name, 0)


def _arrays(plan) -> list:
    return [x for rows in plan.reads.values() for x in rows] + list(plan.zero_runs)


def _rows_from(a, b) -> None:
    a.reads[a.peers[0]] = b.reads[b.peers[0]]


def _span_offset_from(a, b) -> None:
    _set(a.span, "offset", b.span.offset)


def _span_empty(a, b) -> None:
    _set(a.span, "nbytes", 0)


def _arrays_writable(a, b) -> None:
    for x in _arrays(a):
        x.setflags(write=True)


def _bases_writable(a, b) -> None:
    for x in _arrays(a):
        x.base.setflags(write=True)


def _arrays_zeroed(a, b) -> None:
    for x in _arrays(a):
        x[...] = 0


def _arrays_reshaped(a, b) -> None:
    for x in _arrays(a):
        x.shape = (x.size,)


def _pairs_reversed(a, b) -> None:
    _set(a, "pairs", tuple(reversed(b.pairs)))


def _pages_of_copy(a, b) -> None:
    _set(a, "read_pages", dataclasses.replace(b).read_pages)


def plan_edits(buffer: str) -> List[Edit]:
    """Every field of the plan type of ``buffer`` mode, and of what a plan holds (module
    docstring), edited."""
    from ...nixl.modes.arena import ArenaPlan
    from ...nixl.planning.plan import PullPlan, RegionPair

    plan_type = ArenaPlan if buffer == "arena" else PullPlan
    out: List[Edit] = []
    for f in dataclasses.fields(plan_type):
        out.append((f"{f.name} <- B's", partial(_field_from, f.name)))
        out.append((f"{f.name} <- None", partial(_field_none, f.name)))
    if buffer == "arena":
        out += [("reads[peer] <- B's rows", _rows_from), ("span.offset <- B's", _span_offset_from),
                ("span.nbytes <- 0", _span_empty), ("row arrays made writable", _arrays_writable),
                ("row arrays' bases made writable", _bases_writable), ("row arrays written in place", _arrays_zeroed),
                ("row arrays reshaped", _arrays_reshaped),
                ("row arrays' bytes rebuilt as B's", partial(_field_from, "reads"))]
    else:
        out += [(f"pairs[0].{f.name} <- B's", partial(_pair_field_from, f.name))
                for f in dataclasses.fields(RegionPair)]
        out += [(f"pairs[0].local.{name} <- 0", partial(_ref_field_zero, name))
                for name in ("index", "num_pages", "page_stride", "chunk_bytes")]
        out.append(("pairs <- B's, reversed", _pairs_reversed))
    out.append(("a copy with B's pages (dataclasses.replace)", _pages_of_copy))
    return out


def _malformed(d: dict) -> Iterator[Tuple[str, bytes]]:
    """JSON bodies that are not a record (each names what is wrong)."""
    body = canonical(d)
    yield "duplicate key", body[:-1] + b',"offset":' + str(d["offset"]).encode() + b"}"
    for field in ("offset", "nbytes", "num_tokens"):
        for bad in (True, float(d[field]), str(d[field]), None, [d[field]], -1):
            yield f"{field} = {bad!r}", canonical({**d, field: bad})
    yield "offset -0", body.replace(b'"offset":' + str(d["offset"]).encode(), b'"offset":-0', 1)
    yield "blocks of floats", canonical({**d, "blocks": [[float(x) for x in b] for b in d["blocks"]]})
    yield "blocks of 2", canonical({**d, "blocks": [[2 for _ in b] for b in d["blocks"]]})
    yield "blocks nested", canonical({**d, "blocks": [[list(b)] for b in d["blocks"]]})
    yield "order unknown", canonical({**d, "order": "random"})
    yield "extra field", canonical({**d, "extra": 1})
    for field in d:
        yield f"missing {field}", canonical({k: v for k, v in d.items() if k != field})
    yield "spaces", json.dumps(d, sort_keys=True).encode()
    yield "keys unsorted", json.dumps(dict(reversed(list(d.items()))), separators=(",", ":")).encode()
    yield "deep nesting", b'{"blocks":' + b"[" * 5000 + b"]" * 5000 + b"}"
    yield "NaN", body.replace(b'"num_tokens":' + str(d["num_tokens"]).encode(), b'"num_tokens":NaN', 1)
    yield "not an object", b"[]"
    yield "not JSON", b"\xff" + body[1:]


def _well_formed(d: dict, granule: int) -> Iterator[Tuple[str, bytes]]:
    """Records with another meaning (a P without the key could frame any of these)."""
    for field, deltas in (("offset", (granule, -granule, 1)), ("nbytes", (granule, -granule)),
                          ("num_tokens", (1, -1, 16))):
        for delta in deltas:
            if d[field] + delta >= 0:
                yield f"{field} {delta:+d}", canonical({**d, field: d[field] + delta})
    flipped = [[1 - x for x in b] for b in d["blocks"]]
    yield "blocks flipped", canonical({**d, "blocks": flipped})
    yield "order switched", canonical({**d, "order": "head" if d["order"] == "token" else "token"})
    yield "request id swapped", canonical({**d, "request_id": d["request_id"] + "-other"})
    yield "engine renamed", canonical({**d, "engine": d["engine"] + "-other"})


def record_mutations(wire: bytes, key: Optional[bytes], granule: int, seed: int = 0) -> Iterator[Tuple[str, bytes]]:
    """(what, bytes) for each mutation of ``wire`` (module docstring); ``key`` is the
    key the genuine record was framed with (the re-framed ones never carry it)."""
    rng = np.random.default_rng(seed)
    for at in range(len(wire)):
        for bit in range(8):
            yield f"bit {at * 8 + bit} flipped", wire[:at] + bytes([wire[at] ^ (1 << bit)]) + wire[at + 1:]
    for _ in range(256):
        at, value = int(rng.integers(len(wire))), int(rng.integers(256))
        if value != wire[at]:
            yield f"byte {at} = {value}", wire[:at] + bytes([value]) + wire[at + 1:]
    for n in range(len(wire)):
        yield f"truncated to {n}", wire[:n]
    for extra in (b"\0", b"\0" * 32, wire):
        yield f"extended by {len(extra)}", wire + extra
    (body,) = RECORD.unframe(wire, key)
    d = json.loads(body)
    for what, new in list(_malformed(d)) + list(_well_formed(d, granule)):
        yield f"re-framed, {what}", RECORD.frame((new,))


def nixl_part(metadata: bytes) -> bytes:
    """The NIXL agent metadata inside a kvcopy handshake (``metadata``), cut out by its
    declared lengths without checking anything (see the module docstring)."""
    header, agent = struct.unpack_from("<QQ", metadata, len(MAGIC) + 8)
    start = len(MAGIC) + 8 + 16 + header
    return metadata[start:start + agent]
