"""Arena mode (``buffer="arena"``): a request's life in P's and D's staging arenas.

One pinned arena per manager, registered with NIXL once (:mod:`kvcopy.nixl.modes.spans`: the
span allocator). Both sides lay a request out in a span by one pack order
(:mod:`kvcopy.nixl.planning.pack_order`); the copiers that fill and empty spans are
:mod:`kvcopy.nixl.modes.span_copiers`; what P tells D is a :class:`~kvcopy.nixl.wire.record.StagedRequest`.

P (:meth:`ArenaStaging.stage`): the span's size follows from the token count and the
handshake alone, so it is allocated (or :class:`ArenaFull` raised, at once for a
request larger than the arena) before anything proportional to the request is built;
then one d2h call per copier packs the pages holding the prompt's tokens. The span is
freed when ``readers`` distinct D agents sent a notification naming the request
(:meth:`on_notifications`), after ``ttl_s`` (:meth:`expire`), or by :meth:`release`.
The TTL is P's only bound on a D that never reports (it died, or lost the record): P
cannot see a one-sided READ of its memory, so it cannot tell an idle reader from a
gone one (docs/nixl.md, "Late READs", says what this asks of D's deadlines).

D (:meth:`ArenaStaging.plan`): each peer's record is checked against its handshake
(engine, mode, tokens, block positions, the span inside the peer's arena and large
enough), D's span is allocated, and the plan's READ rows (D's span <- P's spans), the
rows to zero in D's span and the scatter calls (span -> D's KV pages, the zero granule
-> D's pages past the prompt) are built and checked, into an :class:`ArenaWork` the
manager keeps, and an :class:`ArenaPlan` describing them for the caller. :meth:`complete`
zeroes and scatters; :meth:`free` frees D's span. The manager calls ``free`` once the
plan is completed or discarded and no READ of it may still land (a READ given up on
holds its span until NIXL reports it ended: :meth:`hold`), so no span a READ may still
write is handed out again.

The plan over the virtual engines (the planner's view of the two spans) depends on the
request's *shape* only: the staging order, the page counts per group on each side and
the peers. Shapes are cached (:class:`~kvcopy.nixl.modes.keyed_cache.KeyedCache`, keyed by
those values and the peers' keys, at most :data:`SHAPE_CACHE_SIZE`), with their routes
and up to :data:`PLANS_PER_SHAPE` virtual plans (per token count, cached tokens and
hole pattern), so a request of a known shape only moves cached rows by its spans'
addresses, checks them, maps page positions to its real pages and builds the copier's
id lists (figures: ``docs/nixl.md``, "Host cost per request").
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from ...checks import integer, per_group_counts
from ...core.copier import CallPlan
from .spans import Arena, ArenaFull, Span
from .base import BufferMode, Peer, Read
from ..planning.descriptors import check_pairs, desc_rows
from ..engine.info import EngineInfo, LayerPair, pair_layers
from .keyed_cache import KeyedCache
from ..options import ManagerOptions
from ..planning.pack_order import ORDER, ORDERS, chunk_extents, granule_for, head_slabs, span_layout, stage_units, \
    virtual_engine
from ..planning.plan import NO_BLOCK, Plan, PullPlan, build_multi_pull_plan, expand_blocks, request_block_ids
from ..wire.record import PageSums, StagedRequest, check_record, record_capacity, request_key
from ..engine.regions import RegionSet, build_regions
from ..planning.routes import Routes, plan_routes
from .rows import BRIDGE_BYTES, byte_index, check_inside, merge_rows, zero_runs
from .partial_stage import PartialStage, StepCopies, plan_step
from .side_stream import CudaStreams, StreamOps
from .span_copiers import SpanCopiers
from .span_sums import ArenaSums, ScatterCheck
from ..sum_check import SumCheck

# Request shapes kept per D (LRU). One shape of a 6-group model (96 units, one virtual
# plan, routes) holds about 250 KiB of host memory (docs/nixl.md): ~32 MiB for 128.
SHAPE_CACHE_SIZE = 128
PLANS_PER_SHAPE = 16  # virtual plans kept per shape (prefix hits and holes make more than one)


@dataclass(frozen=True, eq=False, kw_only=True)
class ArenaPlan(Plan):
    """D's plan for one request in arena mode: read P's spans into D's span, then scatter.
    ``read_pages``, ``zero_pages`` and ``local_block_ids`` are D's real pages and blocks.
    A description for the caller: the manager pulls and completes from its own
    :class:`ArenaWork`, so nothing done to this object (its arrays are read-only views
    of ``bytes`` and its own copies) reaches memory. Plans are compared by identity."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    span: Span  # D's span
    reads: Mapping[str, Tuple[np.ndarray, np.ndarray]]  # peer -> (local rows, remote rows), read-only copies
    zero_runs: Tuple[np.ndarray, np.ndarray]  # (arena offsets, bytes) zeroed in D's span before the scatter
    order: str  # the staging order of both spans (the records')
    read_bytes: int  # bytes the READs move

    @property
    def num_bytes(self) -> int:
        return self.read_bytes

    @property
    def num_descriptors(self) -> int:
        return sum(len(rows) for rows, _ in self.reads.values())


class ArenaWork(NamedTuple):
    """What the pull and completion of one arena plan do, kept by the manager and never
    handed out: D's span, the READs (rows between the two spans, checked), the zero runs
    and the scatter calls (immutable call plans), the staging order, and D's pages."""

    offset: int  # D's span
    nbytes: int
    reads: Tuple[Read, ...]
    zero_starts: np.ndarray
    zero_lens: np.ndarray
    scatter: Tuple[CallPlan, ...]
    order: str
    read_pages: Tuple[Tuple[int, ...], ...]
    local_block_ids: Tuple[Tuple[int, ...], ...]
    zero_pages: Tuple[Tuple[int, ...], ...]
    check: Optional[ScatterCheck]  # what the scatter's sums are compared with (P's, from the record)
    unchecked: Optional[str]  # else why the sums are not compared


@dataclass(frozen=True)
class _Shape:
    """What the plans of one request shape share: the virtual engines of D and of each
    peer, address-free (address 0 = the start of a span: a plan moves its rows by the
    spans' addresses), the peers' layer pairs and the routes over them, the span sizes
    and region extents."""

    local: EngineInfo  # D's virtual engine
    segs: Tuple[int, ...]  # D's segment offset per unit
    nbytes: int  # D's span bytes
    peers: Tuple[Tuple[EngineInfo, Tuple[LayerPair, ...]], ...]  # per peer: virtual engine, layer pairs
    routes: Routes
    peer_bytes: Tuple[int, ...]  # per peer: the bytes its staged span must hold
    local_extents: List[int]  # chunk_extents of the virtual engines
    peer_extents: Tuple[List[int], ...]
    # (tokens, cached tokens per group, D's and the peers' holes) -> _VirtualPlan, at most
    # PLANS_PER_SHAPE (oldest out first): the plan over the virtual engines is a function of these alone
    plans: Dict[tuple, "_VirtualPlan"] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class _VirtualPlan:
    """One plan over a shape's virtual engines and what follows from it alone: the READ
    rows per peer and the zero runs, relative to the spans' starts."""

    plan: PullPlan
    reads: Dict[str, Tuple[np.ndarray, np.ndarray]]  # peer -> (local rows, remote rows), span-relative
    zero_runs: Tuple[np.ndarray, np.ndarray]  # (offsets in D's span, bytes)


@dataclass
class _Staged:
    """P: one staged request: its span, when its time to live ends, how many distinct
    readers must report, and those that did."""

    span: Span
    deadline: float
    readers: int
    done: Set[str] = field(default_factory=set)
    payload: int = 0  # the packed bytes at the span's start; the record slot follows (push)
    slot: int = 0
    writing: int = 0  # push WRITEs of it in flight (kvcopy.nixl.push_writes): never freed while > 0
    dropped: bool = False  # freed once the WRITEs in flight ended


@dataclass(frozen=True)
class _Request:
    """One request on D, checked: its records' page positions, spans and counts."""

    info: EngineInfo
    order: str
    num_tokens: int
    cached: Tuple[int, ...]
    local: List[np.ndarray]  # D's block ids per group
    vblocks: List[np.ndarray]  # D's page positions holding prompt tokens (NO_BLOCK: a hole)
    counts: Tuple[int, ...]  # D's page positions per group
    remote_ids: Dict[str, List[np.ndarray]]  # per peer: its staged page positions per group
    peer_counts: Tuple[Tuple[int, ...], ...]
    peer_keys: Tuple[int, ...]
    records: Tuple[StagedRequest, ...]


class ArenaStaging(BufferMode):
    """The arena of one manager and everything that packs into it and scatters out of it."""

    name = "arena"
    mem_type = "DRAM"

    def __init__(self, regions: RegionSet, device_caches: Mapping[str, torch.Tensor], nbytes: int, ttl_s: float,
                 backend: str, pin: bool, order: str = "token", key: Optional[bytes] = None, checksum: bool = False,
                 max_ctas: Optional[int] = None):
        if order not in ORDERS:
            raise ValueError(f"arena_order must be one of {sorted(ORDERS)}, got {order!r}")
        self.regions = regions
        self.region_infos = tuple(regions.regions)
        self.on_cuda = pin
        self.order = ORDERS[order]  # the order stage() packs in; plan() follows the records'
        self.units = stage_units(self.region_infos)
        granule = granule_for(self.units)  # head slabs divide chunks: one granule serves both orders
        if nbytes < 2 * granule:
            raise ValueError(f"arena_bytes {nbytes} is smaller than two span granules ({granule} bytes each)")
        if order == "head" and not any(head_slabs(r)[0] for r in self.region_infos):
            raise ValueError("arena_order='head' needs HND pages (a page chunk [head][token][...]): "
                             "no layer here has them; use arena_order='token'")
        self.buffer = torch.empty(int(nbytes) // granule * granule, dtype=torch.uint8, pin_memory=pin)
        self.base = self.buffer.data_ptr()
        # Written once here so no READ or pack pays the first-touch page faults (a READ
        # into untouched memory took 2.6x, docs/nixl.md). Granule 0 stays zero: D's
        # pages past the prompt are zeroed by copying from it in the scatter call.
        self.buffer.zero_()
        self.arena = Arena(self.buffer.numel(), granule, reserved=granule)
        self.ttl_s = float(ttl_s)
        self._key = key  # the shared key records in wire form must carry
        self._caches = device_caches
        self._backend = backend
        self._max_ctas = max_ctas
        self._by_order: Dict[str, SpanCopiers] = {}
        self.sums = ArenaSums(checksum, next(iter(device_caches.values())).device)  # page sums (span_sums)
        # D on a GPU: the streams its scatters are ordered with (None: a CPU copy ends in its
        # call). A CPU test may set a recording StreamOps to drive that path (kvcopy.testing.streams).
        self.streams: Optional[StreamOps] = CudaStreams(self.sums.device) if pin else None
        self._scattering: Dict[int, List] = {}  # D, streams: span offset -> events after the scatters reading it
        self._freeing: Dict[int, Tuple[List, int]] = {}  # spans finished while a scatter may still read them
        self.span_copiers(self.order)
        self._staged: Dict[bytes, _Staged] = {}  # P: request id -> its span and readers
        self._partial: Dict[bytes, PartialStage] = {}  # P: requests staged unit by unit, not finished
        self._orphans: Dict[int, PartialStage] = {}  # P: abandoned while chunk WRITEs read them (hold_part)
        self._held: Dict[int, int] = {}  # D: works with a READ given up on that may still land -> span bytes
        self.shapes = KeyedCache(SHAPE_CACHE_SIZE)  # D: the virtual engines per request shape
        self.pairings = KeyedCache(SHAPE_CACHE_SIZE)  # D: layer pairs per (peer, order), whatever the shape

    @classmethod
    def build(cls, device_caches, layer_groups, tokens_per_page, opts: ManagerOptions) -> "ArenaStaging":
        regions = build_regions(device_caches, layer_groups, tokens_per_page, "device", opts.block_dim,
                                opts.kv_layout, opts.tp_rank, opts.tp_size, opts.total_kv_heads)
        grouped = {n: device_caches[n] for g in layer_groups for n in g}
        on_cuda = any(t.device.type == "cuda" for t in grouped.values())
        return cls(regions, grouped, opts.arena_bytes, opts.arena_ttl_s, opts.copy_backend, on_cuda,
                   opts.arena_order, opts.key, opts.checksum, opts.max_ctas)

    def registrations(self):
        return [(self.base, self.arena.nbytes, 0, "DRAM")]

    @property
    def arena_range(self) -> Tuple[int, int]:
        return (self.base, self.arena.nbytes)

    def span_copiers(self, order: str) -> SpanCopiers:
        """The units and copiers of one staging order (built on first use: D builds the
        head-order copiers when the first head-order record arrives). Where no unit
        splits into head slabs (NHD or MLA pages, one head per rank) both orders stage
        the same units: their copiers are shared, not built twice."""
        cps = self._by_order.get(order)
        if cps is None:
            units = stage_units(self.region_infos, order)
            cps = next((c for c in self._by_order.values() if c.units == units), None)
            if cps is None:
                cps = SpanCopiers(units, self._caches, self.regions.layouts, self.buffer, self._backend,
                                  self._max_ctas)
            self._by_order[order] = cps
        return cps

    def _check_engine(self, info: EngineInfo) -> None:
        """``info`` is the record of the engine this staging was built for."""
        if info.regions is not self.region_infos and info.regions != self.region_infos:
            raise ValueError(f"engine record {info.name!r} is not the one this arena was built for")

    # ------------------------------------------------------------ P side
    def stage(self, info, block_ids, num_tokens, request_id, readers, waits=False, count_failure=True):
        if num_tokens is None or request_id is None:
            raise ValueError("arena mode: save needs num_tokens and request_id")
        self._check_engine(info)
        rid = request_key(request_id)
        n_tok = integer(num_tokens, "num_tokens", minimum=0)
        readers = integer(readers, "readers", minimum=1)
        if rid in self._staged:
            raise ValueError(f"request {request_id!r} is already staged")
        ids = request_block_ids(info, block_ids, "block_ids")
        self.expire()
        counts = [-(-n_tok // t) for t in info.tokens_per_page]  # the page positions holding prompt tokens
        segs, total = span_layout(self.units, counts)
        # A record slot follows the payload: a push WRITEs both in one descriptor (kvcopy.nixl.push_writes)
        slot = record_capacity(info, n_tok, rid)
        span = self.arena.allocate(total + slot, count_failure)  # before anything proportional to the request
        try:
            held, positions, pages = [], [], []
            for g, arr in enumerate(ids):
                n_blocks = -(-n_tok // info.tokens_per_block[g])  # positions P lacks are holes
                arr = np.concatenate([arr[:n_blocks], np.full(max(0, n_blocks - len(arr)), NO_BLOCK, np.int64)])
                held.append(tuple((arr != NO_BLOCK).astype(int).tolist()))
                p = expand_blocks(arr, info.tokens_per_block[g] // info.tokens_per_page[g])[:counts[g]]
                positions.append(np.flatnonzero(p != NO_BLOCK))
                pages.append(p)
            cps = self.span_copiers(self.order)
            layout = self.sums.layout(cps, self.order, info.tokens_per_page, "d2h")
            # every copy is checked before the first moves, and planned once
            calls = cps.plan("d2h", cps.ids(span.offset, segs, counts, [p[k] for p, k in zip(pages, positions)],
                                            positions))
            sums = self.sums.pack(cps, calls, layout, positions)
        except Exception:
            self.arena.free(span)
            raise
        self._staged[rid] = _Staged(span, time.monotonic() + self.ttl_s, readers, payload=total, slot=slot)
        record = StagedRequest(info.name, rid.decode("latin-1"), span.offset, span.nbytes, n_tok, tuple(held),
                               self.order, tp_rank=info.tp_rank, generation=info.generation)
        return self.sums.record(record, layout, sums, positions, counts)

    # ------------------------------------------------------------ P side, unit by unit
    def begin(self, info, num_tokens, request_id, readers, count_failure=True) -> PartialStage:
        """Allocate a request's span for staging unit by unit over steps
        (:mod:`kvcopy.nixl.modes.partial_stage`); :class:`ArenaFull` as :meth:`stage`."""
        self._check_engine(info)
        rid = request_key(request_id)
        n_tok = integer(num_tokens, "num_tokens", minimum=0)
        readers = integer(readers, "readers", minimum=1)
        if rid in self._staged or rid in self._partial:
            raise ValueError(f"request {request_id!r} is already staged")
        self.expire()
        counts = [-(-n_tok // t) for t in info.tokens_per_page]
        segs, total = span_layout(self.units, counts)
        span = self.arena.allocate(total + record_capacity(info, n_tok, rid), count_failure)  # as stage()
        part = PartialStage(info, rid, span, segs, counts, n_tok, readers, self.order)
        part.restart()
        self._partial[rid] = part
        return part

    def settle(self, part: PartialStage, block_ids, done_tokens) -> StepCopies:
        """Plan the copies of the page positions of ``part`` that settled now that
        ``done_tokens`` of its prompt are computed, ``block_ids`` its table this step
        (token-anchored, as for :meth:`stage`). Every call is checked here; nothing is
        copied until the caller runs the units."""
        if self._partial.get(part.rid) is not part:
            raise ValueError("not a request this arena is staging unit by unit")
        ids = request_block_ids(part.info, block_ids, "block_ids")
        done = integer(done_tokens, "done_tokens", minimum=0)
        if done < part.done_tokens:
            raise ValueError(f"done_tokens {done} went back from {part.done_tokens}: restart() the request")
        cps = self.span_copiers(part.order)
        layout = self.sums.layout(cps, part.order, part.info.tokens_per_page, "d2h")
        return plan_step(part, cps, layout if self.sums.on else None, ids, done, self.sums.device)

    def finish(self, part: PartialStage) -> StagedRequest:
        """The record of a request staged unit by unit, once every position settled and
        every unit of every step was copied (on a GPU: after those copies ended; its sums,
        read back to pinned memory behind them, are folded here). The span is then staged
        as :meth:`stage`'s are."""
        if self._partial.get(part.rid) is not part:
            raise ValueError("not a request this arena is staging unit by unit")
        if not part.complete:
            raise ValueError(f"request {part.rid!r}: {part.done_tokens} of {part.num_tokens} tokens settled, "
                             f"units {[s.left() for s in part.steps if s.left()]} not copied")
        info = part.info
        record = StagedRequest(info.name, part.rid.decode("latin-1"), part.span.offset, part.span.nbytes,
                               part.num_tokens, part.held(info.tokens_per_block, info.tokens_per_page), part.order,
                               tp_rank=info.tp_rank, generation=info.generation)
        if self.sums.on:
            layout = self.sums.layout(self.span_copiers(part.order), part.order, info.tokens_per_page, "d2h")
            record = record.with_sums(PageSums.of(layout.fingerprint, part.values(layout)))
        del self._partial[part.rid]
        # the payload as span_layout made it (the allocation may be rounded up), its record slot after it
        _, payload = span_layout(self.units, part.counts)
        # chunk WRITEs still reading it (hold_part) now count as the staged span's
        self._staged[part.rid] = _Staged(part.span, time.monotonic() + self.ttl_s, part.readers, payload=payload,
                                         slot=record_capacity(info, part.num_tokens, part.rid), writing=part.writing)
        part.finished = True
        return record

    def abandon(self, part: PartialStage) -> None:
        """Free the span of a request staged unit by unit (no copy of it may still run);
        while chunk WRITEs read it (:meth:`hold_part`), once the last one ended."""
        if self._partial.pop(part.rid, None) is part:
            if part.writing:
                self._orphans[id(part)] = part
            else:
                self.arena.free(part.span)

    def hold_part(self, part: PartialStage) -> None:
        """P: a push WRITE of some of ``part``'s units is posted (:mod:`kvcopy.nixl.push_writes`):
        its span stays until :meth:`unhold_part`, whether the request is finished,
        abandoned or dropped meanwhile."""
        if self._partial.get(part.rid) is not part:
            raise ValueError(f"request {part.rid!r} is not being staged unit by unit here")
        part.writing += 1

    def unhold_part(self, part: PartialStage) -> None:
        part.writing -= 1
        if part.finished:  # its count moved to the staged span at finish()
            self.end_write(part.rid)
        elif not part.writing and self._orphans.pop(id(part), None) is part:
            self.arena.free(part.span)

    def on_notifications(self, new: Mapping[str, List[bytes]]) -> None:
        """P: a notification naming a staged request says its sender (a D agent, by
        the name NIXL delivers it under) is done with it; the span is freed once
        ``readers`` distinct agents said so (a second message from one agent counts
        once), then the spans past their time to live go too."""
        for sender, msgs in new.items():
            for m in msgs:
                entry = self._staged.get(bytes(m))
                if entry is None or entry.dropped:
                    continue
                entry.done.add(sender)
                if len(entry.done) >= entry.readers:
                    self._drop(bytes(m))
        self.expire()

    def expire(self, now: Optional[float] = None) -> int:
        """Free P's spans past their time to live; returns how many."""
        now = time.monotonic() if now is None else now
        old = [rid for rid, entry in self._staged.items() if entry.deadline <= now and not entry.dropped]
        for rid in old:
            self._drop(rid)
        return len(old)

    def release(self, request_id) -> None:
        """P: free a staged request's span now (the caller knows no READ will touch it)."""
        rid = request_key(request_id)
        if rid not in self._staged or self._staged[rid].dropped:
            raise ValueError(f"request {request_id!r} is not staged")
        self._drop(rid)

    def _drop(self, rid: bytes) -> None:
        entry = self._staged[rid]
        if entry.writing:  # a push WRITE reads it: freed when the last one ended (end_write)
            entry.dropped = True
            return
        del self._staged[rid]
        self.arena.free(entry.span)

    def begin_write(self, request_id) -> _Staged:
        """P: a push WRITE of this staged request is posted; its span stays until :meth:`end_write`."""
        entry = self._staged.get(request_key(request_id))
        if entry is None or entry.dropped:
            raise ValueError(f"request {request_id!r} is not staged")
        entry.writing += 1
        return entry

    def end_write(self, request_id) -> None:
        rid = request_key(request_id)
        entry = self._staged[rid]
        entry.writing -= 1
        if entry.dropped and not entry.writing:
            self._drop(rid)

    @property
    def staged(self) -> List[str]:
        return [r.decode("latin-1") for r, e in self._staged.items() if not e.dropped]

    # ------------------------------------------------------------ D side
    def plan(self, info, peers, records, num_tokens, local_block_ids, num_cached_tokens=0, request_id=None):
        self._check_engine(info)
        req = self._request(info, peers, records, num_tokens, local_block_ids, num_cached_tokens, request_id)
        keys = req.peer_keys
        shape = self.shapes.get((req.order, req.counts, req.peer_counts, keys),
                                lambda: self._shape(info, peers, req.order, req.counts, req.peer_counts), tags=keys)
        remote_spans = {}
        for p, rec, need in zip(peers, req.records, shape.peer_bytes):
            if need > rec.nbytes or rec.offset + rec.nbytes > p.info.arena[1]:
                raise ValueError(f"record of {p.name!r}: span [{rec.offset}, +{rec.nbytes}) does not hold its "
                                 f"{need} bytes inside the peer's {p.info.arena[1]}-byte arena")
            remote_spans[p.name] = (p.info.arena[0] + rec.offset, rec.nbytes)
        self._free_scattered()
        span = self.arena.allocate(shape.nbytes)
        try:
            return self._arena_plan(req, shape, span, remote_spans)
        except Exception:
            self.arena.free(span)
            raise

    def _request(self, info, peers: Sequence[Peer], records, num_tokens, local_block_ids, cached,
                 request_id) -> _Request:
        """Check one request's arguments and its peers' records (see :func:`~kvcopy.nixl.wire.record.check_record`):
        wire bytes and record objects alike, through one checker."""
        if request_id is None:
            raise ValueError("arena mode: plan_pull needs request_id= (the request the records must name)")
        rid = request_key(request_id).decode("latin-1")
        names = [p.name for p in peers]
        if isinstance(records, (bytes, bytearray, memoryview, StagedRequest)):
            if len(names) != 1:
                raise ValueError("several peers: pass a mapping peer name -> its StagedRequest")
            records = {names[0]: records}
        if not isinstance(records, Mapping):
            raise TypeError("records: a StagedRequest, or a mapping peer name -> StagedRequest")
        n_tok = integer(num_tokens, "remote_num_tokens", minimum=0)
        recs, remote_ids, peer_counts = [], {}, []
        for p in peers:
            rec = records.get(p.name)
            if isinstance(rec, (bytes, bytearray, memoryview)):
                rec = StagedRequest.from_bytes(rec, self._key)
            elif isinstance(rec, StagedRequest):
                rec = StagedRequest.checked(rec)
            else:
                raise ValueError(f"no StagedRequest for peer {p.name!r}")
            counts, remote_ids[p.name] = check_record(p.info, rec, n_tok, rid)
            peer_counts.append(counts)
            recs.append(rec)
        orders = {rec.order for rec in recs}
        if len(orders) > 1:
            raise ValueError(f"the peers staged this request in different orders {sorted(orders)}")
        local = request_block_ids(info, local_block_ids, "local_block_ids", n_tok)
        vblocks = []  # D's page positions holding prompt tokens (one page per virtual block)
        for g, arr in enumerate(local):
            lp = expand_blocks(arr, info.tokens_per_block[g] // info.tokens_per_page[g])
            lp = lp[:-(-n_tok // info.tokens_per_page[g])]
            vblocks.append(np.where(lp == NO_BLOCK, NO_BLOCK, np.arange(len(lp))))
        return _Request(info=info, order=orders.pop() if orders else ORDER, num_tokens=n_tok,
                        cached=tuple(per_group_counts(cached, info.num_groups, "num_cached_tokens")), local=local,
                        vblocks=vblocks, counts=tuple(len(v) for v in vblocks), remote_ids=remote_ids,
                        peer_counts=tuple(peer_counts), peer_keys=tuple(p.key for p in peers), records=tuple(recs))

    def _shape(self, info: EngineInfo, peers: Sequence[Peer], order: str, counts: Tuple[int, ...],
               peer_counts: Sequence[Tuple[int, ...]]) -> _Shape:
        """The address-free virtual engines of one request shape (a miss of :attr:`shapes`)."""
        units = self.span_copiers(order).units
        segs, total = span_layout(units, counts)
        vd = virtual_engine(info, units, segs, counts)
        sources, need = [], []
        for p, pc in zip(peers, peer_counts):
            p_units = stage_units(p.info.regions, order)
            p_segs, p_total = span_layout(p_units, pc)
            vp = virtual_engine(p.info, p_units, p_segs, pc)
            # Layers pair on what does not depend on page counts (names, dtypes, chunks,
            # heads, in-page axes): once per (peer, order), not per shape.
            pairs = self.pairings.get((p.key, order), _pairing(vd, vp), tags=(p.key,))
            sources.append((vp, pairs))
            need.append(p_total)
        return _Shape(vd, tuple(segs), total, tuple(sources), plan_routes(vd, sources), tuple(need),
                      chunk_extents(vd), tuple(chunk_extents(vp) for vp, _ in sources))

    def _virtual_plan(self, shape: _Shape, req: _Request) -> _VirtualPlan:
        """The plan over the shape's virtual engines, its READ rows and zero runs, relative
        to the spans' starts (every check the planner and the descriptors make runs here)."""
        key = (req.num_tokens, req.cached, tuple((v == NO_BLOCK).tobytes() for v in req.vblocks),
               tuple((v == NO_BLOCK).tobytes() for name in sorted(req.remote_ids) for v in req.remote_ids[name]))
        virt = shape.plans.get(key)
        if virt is not None:
            return virt
        vd = shape.local
        plan = build_multi_pull_plan(vd, shape.peers, req.remote_ids, req.num_tokens, req.vblocks, req.cached,
                                     routes=shape.routes)
        reads = {}
        for (vp, _), extents in zip(shape.peers, shape.peer_extents):
            pairs = [p for p in plan.pairs if p.local_pages and plan.peer_of(p) == vp.name]
            if not pairs:
                reads[vp.name] = (np.empty((0, 3), np.uint64), np.empty((0, 3), np.uint64))
                continue
            pieces = check_pairs(pairs, vd, vp, vp.name, (shape.local_extents, extents))
            # Bridging gaps is safe with one peer only: with several, a gap in one
            # peer's rows may be bytes another peer's READ writes. Merging is the same
            # before or after moving both sides by their span's address.
            reads[vp.name] = merge_rows(*desc_rows(pairs, pieces, vd, vp), BRIDGE_BYTES if len(shape.peers) == 1 else 0)
        # Rows of read pages past the prompt: zeroed in D's span before the scatter.
        runs = [zero_runs(p.pages_to_zero, reg.page_stride, reg.address, reg.num_chunks, reg.chunk_stride,
                          p.zero_segments)
                for p in plan.pairs if p.zero_segments and p.pages_to_zero for reg in (vd.regions[p.local.index],)]
        starts = np.concatenate([s for s, _ in runs]) if runs else np.empty(0, np.int64)
        lens = np.concatenate([n for _, n in runs]) if runs else np.empty(0, np.int64)
        virt = _VirtualPlan(plan, reads, (starts, lens))
        if len(shape.plans) >= PLANS_PER_SHAPE:
            shape.plans.pop(next(iter(shape.plans)))
        shape.plans[key] = virt
        return virt

    def _arena_plan(self, req: _Request, shape: _Shape, span: Span, remote_spans) -> Tuple[ArenaPlan, ArenaWork]:
        virt = self._virtual_plan(shape, req)
        d_at = self.base + span.offset  # the virtual engines' address 0, on each side
        reads, shown = [], {}
        for name, (lrel, rrel) in virt.reads.items():
            lrows, rrows = lrel.copy(), rrel.copy()
            lrows[:, 0] += np.uint64(d_at)
            rrows[:, 0] += np.uint64(remote_spans[name][0])
            # Every byte read lies in the two spans (belt and braces over the planner).
            check_inside(lrows, d_at, span.nbytes, "D's span")
            start, nbytes = remote_spans[name]
            check_inside(rrows, start, nbytes, f"{name!r}'s staged span")
            reads.append(Read(name, False, _read_only(lrows), _read_only(rrows)))
            shown[name] = (frozen_copy(lrows), frozen_copy(rrows))
        read_real, zero_real, blocks = _real_pages(req, virt.plan)
        cps = self.span_copiers(req.order)
        ids = cps.ids(span.offset, shape.segs, req.counts, read_real,
                      [np.asarray(x, np.int64) for x in virt.plan.read_pages],
                      [np.asarray(z, np.int64) for z in zero_real])
        # Planned (checked and packed) now: complete() must not fail after the read, and
        # it runs these calls as they are.
        scatter = tuple(cps.plan("h2d", ids))
        zero_starts, zero_lens = virt.zero_runs[0] + span.offset, virt.zero_runs[1].copy()
        read_pages = tuple(tuple(x.tolist()) for x in read_real)
        layout = self.sums.layout(cps, req.order, req.info.tokens_per_page, "h2d") if self.sums.on else None
        check, unchecked = self.sums.check(layout, req.records, req.peer_counts == (req.counts,), virt.reads,
                                           len(zero_lens), virt.plan.read_pages, [len(z) for z in zero_real],
                                           read_pages)
        work = ArenaWork(span.offset, span.nbytes, tuple(reads), _read_only(zero_starts), _read_only(zero_lens),
                         scatter, req.order, read_pages, blocks, tuple(zero_real), check, unchecked)
        plan = ArenaPlan(peers=virt.plan.peers, remote_num_tokens=req.num_tokens, num_cached_tokens=req.cached,
                         read_pages=read_pages, zero_pages=tuple(zero_real), local_block_ids=blocks,
                         span=Span(span.offset, span.nbytes), reads=MappingProxyType(shown),
                         zero_runs=(frozen_copy(zero_starts), frozen_copy(zero_lens)), order=req.order,
                         read_bytes=virt.plan.num_bytes)
        return plan, work

    def reads(self, work) -> List[Read]:
        return list(work.reads)

    def complete(self, work) -> Tuple[Optional[SumCheck], Optional[str]]:
        """D: zero the rows past the prompt in D's span, then one masked h2d per copier
        (read pages from the span, pages past the prompt from the zero granule), its
        page sums compared with P's where they can be (:mod:`kvcopy.nixl.modes.span_sums`)."""
        if len(work.zero_starts):
            self.buffer.index_fill_(0, torch.as_tensor(byte_index(work.zero_starts, work.zero_lens)), 0)
        try:
            check = self.sums.scatter(self.span_copiers(work.order), work.scatter, work.check)
        finally:  # (a call that raised may have enqueued others before it)
            self.scattered(work.offset)
        return check, work.unchecked

    def scattered(self, offset: int, event=None) -> None:
        """D, with :attr:`streams`: a scatter reading the span at ``offset`` was enqueued
        on the current stream; ``event`` (recorded after it on that stream) or a new one
        recorded now marks its end, and :meth:`free` keeps the span until every such
        event completed. Nothing on a CPU (the copy ended in its call)."""
        if self.streams is None:
            return
        if event is None:
            event = self.streams.event(blocking=True)  # close() waits for it asleep
            event.record(self.streams.current())
        self._scattering.setdefault(offset, []).append(event)

    def check_writable(self, work) -> None:
        """Nothing to check: a plan's span is its own until no READ may write it."""

    def hold(self, work, pull_id: int) -> None:
        """D's span stays owned (the manager frees it only once the READ ended); counted."""
        self._held[id(work)] = work.nbytes

    def unhold(self, work) -> None:
        self._held.pop(id(work), None)

    def free(self, work) -> None:
        """D: free the plan's span (the plan is finished and no READ of it may land), or,
        with :attr:`streams` while a scatter may still read it, once every scatter that
        read it ended: :meth:`_free_scattered`, which every allocation and ``stats``
        call first (its events are not asked here: right after a scatter was enqueued
        the answer is almost always not yet, and each ask is a driver call)."""
        events = self._scattering.pop(work.offset, None)
        if events:
            self._freeing[work.offset] = (events, work.nbytes)
            return
        self.arena.free(Span(work.offset, work.nbytes))

    def _free_scattered(self, wait: bool = False) -> None:
        """Free the spans whose scatters ended (``wait``: wait for them all: ``close``)."""
        for offset, (events, nbytes) in list(self._freeing.items()):
            if wait:
                for event in events:
                    event.synchronize()
            elif not all(event.query() for event in events):
                continue
            del self._freeing[offset]
            self.arena.free(Span(offset, nbytes))

    def stats(self) -> Dict[str, int]:
        self._free_scattered()
        out = self.arena.stats()
        out["staged_requests"] = len(self.staged)
        out["partial_requests"] = len(self._partial)
        out["held_spans"] = len(self._held)
        out["held_bytes"] = sum(self._held.values())
        out.update(self.sums.stats.as_dict())
        return out

    def memory(self) -> List[object]:
        return [self.buffer]

    def forget(self, peer: Peer) -> None:
        """D: drop what is cached for a removed peer."""
        self.shapes.forget(peer.key)
        self.pairings.forget(peer.key)

    def close(self) -> None:
        self._free_scattered(wait=True)  # no scatter reads the arena once it is gone
        for events in self._scattering.values():  # (those of spans not finished yet too)
            for event in events:
                event.synchronize()
        self._scattering = {}
        self.shapes.clear()
        self.pairings.clear()
        for cps in self._by_order.values():
            cps.close()
        self._by_order = {}


def _pairing(local: EngineInfo, remote: EngineInfo) -> Callable[[], Tuple[LayerPair, ...]]:
    return lambda: tuple(pair_layers(local, remote))


def _real_pages(req: _Request, plan: PullPlan):
    """D's real pages read and zeroed per group, and the blocks the plan touches (virtual
    page ids are page positions)."""
    read_real, zero_real, blocks = [], [], []
    info = req.info
    for g, arr in enumerate(req.local):
        r = info.tokens_per_block[g] // info.tokens_per_page[g]
        lp = expand_blocks(arr, r)
        rp = np.asarray(plan.read_pages[g], np.int64)
        read_real.append(lp[rp])
        zfrom = max(req.counts[g], -(-max(req.num_tokens, plan.num_cached_tokens[g]) // info.tokens_per_page[g]))
        tail = lp[zfrom:]
        z = np.concatenate([lp[np.asarray(plan.zero_pages[g], np.int64)], tail[tail != NO_BLOCK]])
        zero_real.append(tuple(z.tolist()))
        touched = np.concatenate([rp, np.asarray(plan.zero_pages[g], np.int64),
                                  np.arange(zfrom, len(lp))[tail != NO_BLOCK]]) // r
        _, first = np.unique(touched, return_index=True)
        blocks.append(tuple(arr[touched[np.sort(first)]].tolist()))
    return read_real, zero_real, tuple(blocks)


def _read_only(a: np.ndarray) -> np.ndarray:
    """``a``, read-only: arrays the staging keeps for itself and never hands out."""
    a.setflags(write=False)
    return a


def frozen_copy(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` no one can write: a read-only view of ``bytes`` (numpy refuses to
    make it writable, and ``bytes`` cannot change), for arrays handed to the caller."""
    return np.frombuffer(a.tobytes(), dtype=a.dtype).reshape(a.shape)


__all__ = ["ArenaFull", "ArenaPlan", "ArenaStaging", "request_key"]
