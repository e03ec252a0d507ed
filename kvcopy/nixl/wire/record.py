"""The staged-request record: what P's arena ``save`` tells D about one request, and its wire form.

A :class:`StagedRequest` names P's engine (its NIXL agent), TP rank and registration
generation (:mod:`kvcopy.nixl.wire.handshake`), the request, the span in P's arena (offset,
bytes), the prompt's token count, per KV cache group which block positions P staged
(1) and which are holes (0), the pack order (:mod:`kvcopy.nixl.planning.pack_order`) and, when P
computed them, its page sums (:class:`PageSums`, :mod:`kvcopy.nixl.modes.span_sums`). D
reads P's span at that offset in that order, so every field decides which bytes land
in D's KV: the record crosses a process boundary and is untrusted input. The sums are
what D's scatter must reproduce; the record's digest (and HMAC) covers them, so a span
that changed after P's pack, or a READ that brought other bytes, cannot also bring
matching sums.

A record is bound to what it is used for: D's ``plan_pull`` names the request it pulls
and refuses a record of another request, of another engine or TP rank than the peer it
reads, or of an earlier registration of that peer (another generation: P restarted
under the same name). A record object the caller hands over is checked exactly as a
wire record is (:meth:`StagedRequest.checked`: the same field reader, one checker).

Wire form (:meth:`StagedRequest.to_bytes`, :meth:`StagedRequest.from_bytes`), framed
as the handshake is (:mod:`kvcopy.nixl.wire.framing`)::

    b"KVCOPY-STAGE"  magic, 12 bytes
    u32 version (RECORD_VERSION), u32 flags, u64 length J
    J bytes          the record as canonical JSON: keys sorted, no spaces, ASCII
    32 bytes         SHA-256 of every byte before it
    [32 bytes]       HMAC-SHA256 with the managers' shared key (``key=``), if flag bit 0

Reading one checks the frame first (magic, version, length against
:data:`MAX_RECORD_BYTES`, digest, key), then the JSON: duplicate keys, ``NaN``, nesting
past the recursion limit are refused (:func:`kvcopy.nixl.wire.schema.loads`), every field
through :class:`kvcopy.nixl.wire.schema.Record` (integers are integers, never booleans or
floats, in their ranges; strings are names; the order one of :data:`ORDERS`; every
list bounded before it is walked), and the bytes must be the canonical encoding of what
was read: a record has one encoding, so ``1.0``, ``-0``, ``true``, re-ordered keys or
added spaces are refused too. A bit flipped anywhere fails the digest; a record
re-framed with a fresh digest but other bytes fails the key, where one is used. What
no frame can stop is a peer holding the key that lies about its own arena (a record
pointing at another of its spans); D checks that the span lies in the peer's arena
and holds the bytes the request needs (:mod:`kvcopy.nixl.modes.arena`).
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple

import numpy as np

from .framing import Framing
from ..engine.info import GENERATION_HEX, NO_GENERATION, EngineInfo, MAX_TP, check_generation
from ..planning.pack_order import ORDER, ORDERS
from ..planning.plan import NO_BLOCK
from ..engine.regions import MAX_GROUPS, MAX_NAME
from .schema import Record, check_int, check_list, loads

RECORD_MAGIC = b"KVCOPY-STAGE"
RECORD_VERSION = 2  # 2: the TP rank and the registration generation
MAX_RECORD_BYTES = 8 << 20  # a 1M-token prompt of 16-token blocks is 128 KiB of flags per group
MAX_REQUEST_ID = 1024  # characters
MAX_SPAN = (1 << 63) - 1  # offsets and sizes inside the peer's arena (checked against it on D)
MAX_TOKENS = 1 << 40
MAX_BLOCKS = 1 << 22  # block positions per group (checked against the tokens on D)
SUM_HEX = 16  # hex digits of one page sum (64 bits, most significant digit first)
LAYOUT_HEX = 32  # hex digits of a sum layout's fingerprint
_HEX = re.compile(r"[0-9a-f]*")
RECORD = Framing(RECORD_MAGIC, RECORD_VERSION, ((2, MAX_RECORD_BYTES),), "staged-request record",
                 "staged-request record")
_WHERE = "malformed staged-request record"


class StaleRegistration(ValueError):
    """A record of an earlier registration of the peer (another generation: the peer
    re-registered, or restarted, under the same name since its handshake was added)."""


@dataclass(frozen=True)
class PageSums:
    """P's page sums of one staged request: ``layout``, the fingerprint of how they were
    computed (:class:`~kvcopy.nixl.modes.span_sums.SumLayout`: D compares only sums of the same
    layout), and per KV cache group one value per page position holding prompt tokens
    (0 for a hole), each :data:`SUM_HEX` lowercase hex digits, concatenated."""

    layout: str
    pages: Tuple[str, ...]

    @classmethod
    def of(cls, layout: str, values) -> "PageSums":
        """From per-group uint64 arrays."""
        return cls(layout, tuple(np.asarray(v, np.uint64).astype(">u8").tobytes().hex() for v in values))

    def values(self, group: int) -> np.ndarray:
        """Group ``group``'s sums as uint64 (a fresh array)."""
        return np.frombuffer(bytes.fromhex(self.pages[group]), ">u8").astype(np.uint64)

    def to_dict(self) -> dict:
        return {"layout": self.layout, "pages": list(self.pages)}

    @classmethod
    def from_dict(cls, d: Any) -> "PageSums":
        r = Record(d, f"{_WHERE}, sums")
        layout = _hex(r.name("layout", LAYOUT_HEX), r.at("layout"), LAYOUT_HEX)
        raw = r.entries("pages", 1, MAX_GROUPS)
        r.done()
        return cls(layout, tuple(_hex(v, f"{_WHERE}, sums.pages[{g}]") for g, v in enumerate(raw)))


def _hex(value: Any, where: str, length: int = 0) -> str:
    """``value`` if it is a string of lowercase hex digits: ``length`` of them, else
    whole sums (a multiple of :data:`SUM_HEX`, at most one per block position)."""
    if not isinstance(value, str) or len(value) > SUM_HEX * MAX_BLOCKS:
        raise ValueError(f"{where}: expected a string of hex digits, got {type(value).__name__}"
                         + (f" of {len(value)} characters" if isinstance(value, str) else ""))
    if not _HEX.fullmatch(value) or (len(value) != length if length else len(value) % SUM_HEX):
        want = f"{length} lowercase hex digits" if length else f"lowercase hex digits, {SUM_HEX} per page"
        raise ValueError(f"{where}: expected {want}, got {len(value)} characters")
    return value


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
    sums: Optional[PageSums] = None  # P's page sums; None: P computed none (checksum=False)
    tp_rank: int = 0  # P's TP rank (its handshake's)
    generation: str = NO_GENERATION  # P's registration generation (its handshake's)

    def to_dict(self) -> dict:
        out = {"engine": self.engine, "request_id": self.request_id, "offset": self.offset,
               "nbytes": self.nbytes, "num_tokens": self.num_tokens,
               "blocks": [list(b) for b in self.blocks], "order": self.order, "tp_rank": self.tp_rank,
               "generation": self.generation}
        if self.sums is not None:  # absent, not null: a record has one encoding
            out["sums"] = self.sums.to_dict()
        return out

    def to_bytes(self, key: Optional[bytes] = None) -> bytes:
        """The wire form; with ``key`` (the managers' shared key), authenticated."""
        return RECORD.frame((canonical(self.to_dict()),), key)

    def with_sums(self, sums: Optional[PageSums]) -> "StagedRequest":
        return dataclasses.replace(self, sums=sums)

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
        raw_sums = r.optional("sums")
        tp_rank = r.integer("tp_rank", 0, MAX_TP - 1)
        generation = check_generation(r.name("generation", GENERATION_HEX), r.at("generation"))
        r.done()
        blocks = []
        for g, flags in enumerate(raw):
            at = f"{_WHERE}, blocks[{g}]"
            blocks.append(tuple(check_int(x, 0, 1, f"{at}[{i}]")
                                for i, x in enumerate(check_list(flags, 0, MAX_BLOCKS, at))))
        sums = None if raw_sums is None else PageSums.from_dict(raw_sums)
        return cls(engine, request_id, offset, nbytes, num_tokens, tuple(blocks), order, sums, tp_rank, generation)

    @classmethod
    def checked(cls, rec: Any) -> "StagedRequest":
        """A record object from the caller (in-process), checked exactly as a wire record:
        its fields through :meth:`from_dict` (an offset of ``-1`` or ``True``, a token
        count of ``64.0``, boolean block flags are refused as they are on the wire).
        Returns the checked copy, which is what D uses from then on."""
        if type(rec) is not cls:
            raise TypeError(f"a staged-request record must be a StagedRequest, got {type(rec).__name__}")
        if rec.sums is not None and type(rec.sums) is not PageSums:
            raise TypeError(f"{_WHERE}: sums must be PageSums or None, got {type(rec.sums).__name__}")
        try:
            fields = rec.to_dict()
        except (TypeError, ValueError) as exc:  # e.g. blocks that are not lists
            raise TypeError(f"{_WHERE}: {exc}") from None
        return cls.from_dict(fields)

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


def check_record(p: EngineInfo, rec: StagedRequest, n_tok: int, request_id: str
                 ) -> Tuple[Tuple[int, ...], List[np.ndarray]]:
    """Check one peer's record against its handshake and the request D pulls (D): (its
    page counts per group, the span's shape; its page positions held per group,
    ``NO_BLOCK`` for a hole). Page sums, where it carries them, must number one per
    page position."""
    if rec.request_id != request_id:
        raise ValueError(f"record of request {rec.request_id[:80]!r} given for request {request_id[:80]!r}")
    if rec.engine != p.name:
        raise ValueError(f"record of engine {rec.engine!r} given for peer {p.name!r}")
    if rec.tp_rank != p.tp_rank:
        raise ValueError(f"record of TP rank {rec.tp_rank} given for peer {p.name!r}, TP rank {p.tp_rank}")
    if rec.generation != p.generation:
        raise StaleRegistration(f"record of registration {rec.generation} given for peer {p.name!r}, registered as "
                         f"{p.generation}: the peer re-registered (restarted) since; add_peer its new handshake")
    if p.buffer != "arena" or p.arena[1] <= 0:
        raise ValueError(f"peer {p.name!r} is in {p.buffer!r} mode, not 'arena': it stages no requests")
    if rec.num_tokens != n_tok:
        raise ValueError(f"record of {p.name!r} staged {rec.num_tokens} tokens, the pull is for {n_tok}")
    if len(rec.blocks) != p.num_groups:
        raise ValueError(f"record of {p.name!r}: {len(rec.blocks)} block lists for {p.num_groups} groups")
    counts, vpages = [], []
    for g, b in enumerate(rec.blocks):
        if len(b) != -(-n_tok // p.tokens_per_block[g]):
            raise ValueError(f"record of {p.name!r}, group {g}: {len(b)} blocks staged for {n_tok} tokens")
        flags = np.repeat(np.asarray(b, np.int64), p.tokens_per_block[g] // p.tokens_per_page[g])
        flags = flags[:-(-n_tok // p.tokens_per_page[g])]
        counts.append(len(flags))
        vpages.append(np.where(flags == 1, np.arange(len(flags)), NO_BLOCK))
    if rec.sums is not None:
        got = [len(h) // SUM_HEX for h in rec.sums.pages]
        if got != counts:
            raise ValueError(f"record of {p.name!r}: page sums per group {got[:8]} for page positions {counts[:8]}")
    return tuple(counts), vpages


def record_capacity(p: EngineInfo, n_tok: int, request_id: bytes) -> int:
    """Bytes that hold any record P can make of ``request_id`` (its id as
    :func:`request_key` bytes) over ``n_tok`` tokens, as a u32 length and the wire form
    (sums and a key's HMAC included): from the handshake and the request alone, so both
    sides size a push's record slot alike (:mod:`kvcopy.nixl.wire.push_messages`). Escapes count six
    characters per byte of a name; integers twenty digits."""
    fixed = 4 + 256 + 2 * 32 + 512 + 6 * (len(p.name) + len(request_id))
    groups = 0
    for tpb, tpp in zip(p.tokens_per_block, p.tokens_per_page):
        groups += 48 + 2 * -(-n_tok // tpb) + SUM_HEX * -(-n_tok // tpp)
    return -(-(fixed + groups) // 64) * 64


def request_key(request_id) -> bytes:
    """A request id as the notification bytes that name it: a non-empty str (latin-1)
    or bytes, at most :data:`~kvcopy.nixl.wire.record.MAX_REQUEST_ID` long."""
    if isinstance(request_id, str):
        try:
            key = request_id.encode("latin-1")
        except UnicodeEncodeError:
            raise ValueError(f"request_id {request_id[:40]!r}: only latin-1 characters (or pass bytes)") from None
    elif isinstance(request_id, (bytes, bytearray)):
        key = bytes(request_id)
    else:
        raise TypeError(f"request_id must be a non-empty str or bytes, got {type(request_id).__name__}")
    if not 0 < len(key) <= MAX_REQUEST_ID or b"\0" in key:
        raise ValueError(f"request_id must be 1 to {MAX_REQUEST_ID} characters without NUL, got {request_id[:40]!r}")
    return key
