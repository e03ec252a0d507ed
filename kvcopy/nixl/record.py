"""The staged-request record: what P's arena ``save`` tells D about one request, and its wire form.

A :class:`StagedRequest` names P's engine, the request, the span in P's arena (offset,
bytes), the prompt's token count, per KV cache group which block positions P staged
(1) and which are holes (0), and the pack order (:mod:`kvcopy.nixl.pack_order`). D
reads P's span at that offset in that order, so every field decides which bytes land
in D's KV: the record crosses a process boundary and is untrusted input.

Wire form (:meth:`StagedRequest.to_bytes`, :meth:`StagedRequest.from_bytes`), framed
as the handshake is (:mod:`kvcopy.nixl.framing`)::

    b"KVCOPY-STAGE"  magic, 12 bytes
    u32 version (RECORD_VERSION), u32 flags, u64 length J
    J bytes          the record as canonical JSON: keys sorted, no spaces, ASCII
    32 bytes         SHA-256 of every byte before it
    [32 bytes]       HMAC-SHA256 with the managers' shared key (``key=``), if flag bit 0

Reading one checks the frame first (magic, version, length against
:data:`MAX_RECORD_BYTES`, digest, key), then the JSON: duplicate keys, ``NaN``, nesting
past the recursion limit are refused (:func:`kvcopy.nixl.schema.loads`), every field
through :class:`kvcopy.nixl.schema.Record` (integers are integers, never booleans or
floats, in their ranges; strings are names; the order one of :data:`ORDERS`; every
list bounded before it is walked), and the bytes must be the canonical encoding of what
was read: a record has one encoding, so ``1.0``, ``-0``, ``true``, re-ordered keys or
added spaces are refused too. A bit flipped anywhere fails the digest; a record
re-framed with a fresh digest but other bytes fails the key, where one is used. What
no frame can stop is a peer holding the key that lies about its own arena (a record
pointing at another of its spans); D checks that the span lies in the peer's arena
and holds the bytes the request needs (:mod:`kvcopy.nixl.staging`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from .framing import Framing
from .pack_order import ORDER, ORDERS
from .regions import MAX_GROUPS, MAX_NAME
from .schema import Record, check_int, check_list, loads

RECORD_MAGIC = b"KVCOPY-STAGE"
RECORD_VERSION = 1
MAX_RECORD_BYTES = 8 << 20  # a 1M-token prompt of 16-token blocks is 128 KiB of flags per group
MAX_REQUEST_ID = 1024  # characters
MAX_SPAN = (1 << 63) - 1  # offsets and sizes inside the peer's arena (checked against it on D)
MAX_TOKENS = 1 << 40
MAX_BLOCKS = 1 << 22  # block positions per group (checked against the tokens on D)
RECORD = Framing(RECORD_MAGIC, RECORD_VERSION, ((2, MAX_RECORD_BYTES),), "staged-request record",
                 "staged-request record")
_WHERE = "malformed staged-request record"


@dataclass(frozen=True)
class StagedRequest:
    """What P staged for one request (see the module docstring). ``blocks[g][i]`` is 1
    where P staged block position ``i`` of group ``g``, 0 for a hole (``NO_BLOCK``)."""

    engine: str  # P's engine name (its NIXL agent)
    request_id: str
    offset: int  # span in P's arena
    nbytes: int
    num_tokens: int
    blocks: Tuple[Tuple[int, ...], ...]
    order: str = ORDER

    def to_dict(self) -> dict:
        return {"engine": self.engine, "request_id": self.request_id, "offset": self.offset,
                "nbytes": self.nbytes, "num_tokens": self.num_tokens,
                "blocks": [list(b) for b in self.blocks], "order": self.order}

    def to_bytes(self, key: Optional[bytes] = None) -> bytes:
        """The wire form; with ``key`` (the managers' shared key), authenticated."""
        return RECORD.frame((canonical(self.to_dict()),), key)

    @classmethod
    def from_dict(cls, d: Mapping) -> "StagedRequest":
        """A record from its fields (a peer's JSON object): every field checked."""
        r = Record(d, _WHERE)
        engine = r.name("engine", MAX_NAME)
        request_id = r.name("request_id", MAX_REQUEST_ID)
        offset = r.integer("offset", 0, MAX_SPAN)
        nbytes = r.integer("nbytes", 0, MAX_SPAN)
        num_tokens = r.integer("num_tokens", 0, MAX_TOKENS)
        raw = r.entries("blocks", 1, MAX_GROUPS)
        order = r.choice("order", ORDERS.values())
        r.done()
        blocks = []
        for g, flags in enumerate(raw):
            at = f"{_WHERE}, blocks[{g}]"
            blocks.append(tuple(check_int(x, 0, 1, f"{at}[{i}]")
                                for i, x in enumerate(check_list(flags, 0, MAX_BLOCKS, at))))
        return cls(engine, request_id, offset, nbytes, num_tokens, tuple(blocks), order)

    @classmethod
    def from_bytes(cls, data, key: Optional[bytes] = None) -> "StagedRequest":
        """A record from its wire form (see the module docstring); ``key``: the shared
        key the record must be authenticated with (None: it must carry no HMAC)."""
        (body,) = RECORD.unframe(data, key)
        rec = cls.from_dict(loads(body, "staged-request record"))
        if canonical(rec.to_dict()) != body:
            raise ValueError(f"{_WHERE}: not in canonical form (keys sorted, no spaces, integers as "
                             "integers, each key once)")
        return rec


def canonical(obj) -> bytes:
    """The one encoding of a record's JSON object."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
