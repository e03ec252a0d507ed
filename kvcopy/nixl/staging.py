"""Request-packed staging ("arena" buffer mode): pack order, the staged-request record,
D's read ranges, P's pack and D's scatter.

Canonical orders of a request's span (both sides compute them from a handshake and
the record's ``order`` alone):

* a **unit** is one (KV cache group, region) pair: the layers of one group that view one
  tensor the same way (they are staged once). Units are sorted by their first layer
  name, so two engines with the same layers order them the same way whatever their
  group plans. Each unit's segment starts at a multiple of its chunk bytes (padding
  only between units of different chunk sizes). Page positions are the request's:
  position ``k`` holds tokens ``[k * T, (k + 1) * T)``; P stages the blocks covering
  its ``num_tokens`` (``NO_BLOCK`` positions are holes nobody reads).
* **token order** (``arena_order="token"``, the default, record order
  ``unit/chunk/page:v1``): a segment is ``[chunk][page position][page chunk]``. One
  layer's K (or V) for the whole request is one contiguous run, tokens in order.
* **head order** (``arena_order="head"``, ``unit/head/chunk/page:v1``, HND pages
  only): a segment is ``[head][chunk][page position][head slab]``, where a head slab
  is one head's ``[token][head size]`` of a page chunk. A run of KV heads of one layer,
  K and V and all pages, is one contiguous run: a TP head slice per layer. A page
  chunk ``[2][head][token][head size]`` (block-first ``[NB, 2, H, T, D]`` HND pages,
  K and V in one chunk) stages as ``[head][K/V][chunk][page position][head slab]``:
  still one run per head range. Units without a head axis in that form (MLA, NHD
  pages in a mixed model) keep token order.
  P chooses the order; D lays out its own span in the record's order, so the runs
  line up.

What a pull costs in NIXL descriptors per (request, peer), after merging runs adjacent
on both sides (gaps of at most :data:`BRIDGE_BYTES` that are the same on both sides
are read across, so small cases often merge further). Measured by the tests, 3
layers, HND, 5 pages of 16 tokens (``tests/test_nixl_staging.py``):

==============================  ==========================  ======================
case                            token order                 head order
==============================  ==========================  ======================
equal geometry, no prefix hit   **1**                       **1**
prefix hit of ``C`` tokens      1 per (unit, chunk)         1 per (unit, head, chunk)
different page sizes            1 per (unit, chunk) where   1 per (unit, head, chunk)
                                the token pieces line up    where they line up
different TP sizes (HND)        1 per (unit, chunk, page):  **1 per (unit, peer)**:
                                30 (P TP2 -> D TP4)         3 (P TP2 -> D TP4, and
                                                            TP4 -> TP2 per peer)
different TP sizes (NHD)        1 per (unit, chunk, token)  (refused: no HND pages)
different group plans           units pair by layer; runs merge across units only
                                where both sides order them alike
==============================  ==========================  ======================

So: token order where P and D run the same TP size (prefix hits stay cheap), head
order where D's TP size differs from P's and pages are HND.

D's side is planned with the ordinary planner (:mod:`kvcopy.nixl.plan`) over
*virtual* engines whose regions are the units of each span (page stride = chunk
bytes, chunk stride = pages x chunk bytes), so the bytes D
writes are exactly those the mirror would write (the byte oracle's rules, token pieces
and zeroed rows included); descriptors are then merged by address.

The virtual engines are address-free (address 0 = the span's start; a plan moves its
rows by the two spans' addresses, which merging does not see) and cached per request
shape (:class:`~kvcopy.nixl.identity_cache.IdentityCache`: D's and each peer's engine by identity, held weakly, the
order, the page counts per group). With them the plan over the virtual engines, its
READ rows and zero runs are cached (per token count, cached tokens and holes). The
planner's route cache then hits too, and a request's own work is the translation, the
span checks, its real pages and the copier's id lists. Measured
(``bench/arena_plan_cost.py``, seeds/2 with 6 groups, 36 MiB, loaded 2-core machine):
``plan_pull`` + ``discard`` 10.3 -> 1.5 ms for a shape seen before (a 36 MiB memcpy:
4-6 ms); ~11 ms for a new shape.

A head-order virtual region keeps its pages' axes with the head stride moved outside
the page, so the planner's byte segments land in the head-major span unchanged; the
descriptor check then bounds a segment by the axes' reach (:func:`chunk_extents`), and
every READ row is checked to lie inside the two spans.

Copies: one ``BlockCopier`` per distinct block size and page geometry (one for uniform
models), whose "groups" are the (unit, chunk) pairs in token order and the (unit,
chunk, head) triples in head order: device view = that chunk (head) of the unit's
tensor, host view = the whole arena seen as blocks of that size. P's pack is one call
per copier (planned, then run), D's scatter one h2d call per copier (planned, which
checks it, when the pull is planned; run as it is by ``complete``); head order has
``heads`` times more, smaller blocks (one head slab each) in the same call.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, fields
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..checks import per_group_counts
from ..copier import BlockCopier
from ..tables import CallPlan
from .arena import Arena, ArenaFull, Span
from .descriptors import check_pairs, desc_rows
from .handshake import EngineInfo, LayerPair, pair_layers
from .identity_cache import IdentityCache
from .plan import NO_BLOCK, PullPlan, build_multi_pull_plan, expand_blocks
from .regions import RegionInfo

ORDER = "unit/chunk/page:v1"  # the token order (the default)
HEAD_ORDER = "unit/head/chunk/page:v1"
ORDERS = {"token": ORDER, "head": HEAD_ORDER}  # the manager's arena_order -> the record's name
# D reads a gap between two runs of one peer when it is this small and the same on both
# sides (a sliding window's dropped page, a prefix hit's cached pages, padding between
# units): the gap lies inside both spans, which this request owns, and D never scatters
# it. Why 64 KiB: one more descriptor costs about what moving a few tens of KiB costs
# (measured here, UCX loopback: 1,152 per-page descriptors over 36 MiB added ~6 ms,
# ~5 us each, ~10-20 KiB of bandwidth); on RDMA NICs the posting cost per descriptor is
# higher, not lower.
BRIDGE_BYTES = 64 << 10
MAX_GRANULE = 1 << 26  # an arena granule above 64 MiB (lcm of odd chunk sizes) is refused


@dataclass(frozen=True)
class Unit:
    """One (group, region) pair of an engine: its layers are staged once."""

    group: int
    region: int
    layers: Tuple[str, ...]
    num_chunks: int
    chunk_bytes: int
    heads: int = 1  # head order: heads per page chunk (with outer 1, 1: the unit is staged as in token order)
    head_bytes: int = 0  # head order: bytes of one head's slab of a page chunk (= chunk_bytes / heads)
    head_stride: int = 0  # elements between heads in the page chunk (the head axis' stride)
    outer: int = 1  # head order: slabs per head (2: K and V of a [2][head][token][size] page chunk)
    outer_stride: int = 0  # elements between those slabs of one head in the page chunk (0: one)

    @property
    def block_bytes(self) -> int:
        """Bytes the copier moves per block in head order (one head's slab of a page chunk)."""
        return self.head_bytes or self.chunk_bytes

    @property
    def slabs(self) -> int:
        """Slabs per page chunk in head order, head-major (slab ``h * outer + o``)."""
        return self.heads * self.outer


def _head_slabs(r) -> Tuple[int, int, int, int, int]:
    """(heads, bytes per head slab, head stride, slabs per head, their stride; strides in
    elements) where the page chunk is ``[head][everything else, dense]`` (HND pages) or
    ``[o][head][everything else, dense]`` with one axis ``o`` outside the heads (K/V of
    a block-first ``[NB, 2, H, T, D]`` page, one chunk), else (0, chunk bytes, 0, 1, 0)."""
    none = 0, r.chunk_bytes, 0, 1, 0
    names = [n for n, _, _ in r.axes or ()]
    if "head" not in names:
        return none
    _, k, stride = r.axes[names.index("head")]
    rest, outer = 1, []
    for n, size, st in r.axes:
        if n != "head" and size > 1:
            if st >= stride:
                outer.append((n, size, st))
            else:
                rest *= size
    if len(outer) > 1 or (outer and (outer[0][0] == "token" or outer[0][2] != k * rest)):
        return none  # tokens outside the heads (NHD), or more than one axis outside them
    o, o_stride = (outer[0][1], outer[0][2]) if outer else (1, 0)
    if stride != rest or o * k * rest * r.itemsize != r.chunk_bytes:
        return none
    return k, rest * r.itemsize, stride, o, o_stride


def stage_units(info: EngineInfo, order: str = ORDER) -> List[Unit]:
    """The units of an engine in canonical order (sorted by first layer name); in head
    order, HND units are split into head slabs."""
    if order not in ORDERS.values():
        raise ValueError(f"unknown staging order {order!r}; known: {sorted(ORDERS.values())}")
    out = []
    for r in info.regions:
        by_group: Dict[int, List[str]] = {}
        for name, g in r.members:
            by_group.setdefault(g, []).append(name)
        heads, head_bytes, head_stride, outer, outer_stride = (
            _head_slabs(r) if order == HEAD_ORDER else (0, r.chunk_bytes, 0, 1, 0))
        if heads == 0 or heads * outer == 1:  # no head axis, or one head slab: as in token order
            heads, head_bytes, head_stride, outer, outer_stride = 1, 0, 0, 1, 0
        for g, names in by_group.items():
            out.append(Unit(g, r.index, tuple(sorted(names)), r.num_chunks, r.chunk_bytes,
                            heads, head_bytes, head_stride, outer, outer_stride))
    out.sort(key=lambda u: u.layers[0])
    return out


def span_layout(units: Sequence[Unit], pages_per_group: Sequence[int]) -> Tuple[List[int], int]:
    """(segment offset per unit, span bytes) for these page counts per group."""
    off, segs = 0, []
    for u in units:
        off = -(-off // u.chunk_bytes) * u.chunk_bytes
        segs.append(off)
        off += u.num_chunks * pages_per_group[u.group] * u.chunk_bytes
    return segs, off


def granule_for(units: Sequence[Unit], base: int = 4096) -> int:
    """Span alignment: a multiple of every chunk size (host block ids are offset / chunk bytes)."""
    g = base
    for u in units:
        g = g * u.chunk_bytes // math.gcd(g, u.chunk_bytes)
    if g > MAX_GRANULE:
        raise ValueError(f"arena mode: chunk sizes {sorted({u.chunk_bytes for u in units})} need a "
                         f"{g}-byte span alignment (over {MAX_GRANULE}); use the mirror (buffer='host')")
    return g


_REGION_FIELDS = tuple(f.name for f in fields(RegionInfo))


def virtual_engine(info: EngineInfo, units: Sequence[Unit], segs: Sequence[int], pages: Sequence[int],
                   base: int = 0) -> EngineInfo:
    """``info`` with one region per unit, laid out as a span at address ``base``. A
    head-slab unit's region keeps its page chunk's axes with the head axis' stride
    moved outside the pages (``[head][chunk][page][slab]``): the planner's byte
    segments then land in the head-major span as they are."""
    regions = []
    for i, (u, off) in enumerate(zip(units, segs)):
        r = info.regions[u.region]
        n = pages[u.group]
        b = u.block_bytes
        axes = r.axes
        if u.slabs > 1:  # [head][outer][chunk][page][slab]
            outer_step = u.num_chunks * n * b // r.itemsize  # elements per [chunk][page][slab] block
            moved = {"head": u.outer * outer_step}
            if u.outer > 1:
                moved.update({name: outer_step for name, size, st in r.axes
                              if st == u.outer_stride and size == u.outer})
            axes = tuple((name, size, moved.get(name, st)) for name, size, st in r.axes)
        # RegionInfo(**fields) rather than dataclasses.replace: ~4x cheaper (measured:
        # 192 regions per seeds/2 request, ~2.9 -> ~0.7 ms on a cold shape here)
        f = {k: getattr(r, k) for k in _REGION_FIELDS}
        f.update(index=i, members=tuple((name, u.group) for name in u.layers), address=base + off, device_id=0,
                 num_pages=n, page_stride=b, chunk_stride=n * b if u.num_chunks > 1 else 0, axes=axes)
        regions.append(RegionInfo(**f))
    # A virtual block is one page: the planner's block ids are then page positions.
    return EngineInfo(name=info.name, buffer="arena", mem_type="DRAM", tp_rank=info.tp_rank,
                      tp_size=info.tp_size, tokens_per_block=info.tokens_per_page,
                      tokens_per_page=info.tokens_per_page, regions=tuple(regions), agent_metadata=b"")


@dataclass(frozen=True)
class StagedRequest:
    """What P staged for one request (plain, serializable: P hands it to D with the
    request's transfer parameters). ``blocks[g][i]`` is 1 where P staged block position
    ``i`` of group ``g``, 0 for a hole (``NO_BLOCK``)."""

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

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: Mapping) -> "StagedRequest":
        try:
            rec = cls(engine=str(d["engine"]), request_id=str(d["request_id"]), offset=int(d["offset"]),
                      nbytes=int(d["nbytes"]), num_tokens=int(d["num_tokens"]),
                      blocks=tuple(tuple(int(x) for x in b) for b in d["blocks"]), order=str(d["order"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed staged-request record: {type(exc).__name__}: {exc}") from None
        if rec.order not in ORDERS.values():
            raise ValueError(f"staged-request record in order {rec.order!r}; this kvcopy reads "
                             f"{sorted(ORDERS.values())}")
        if rec.offset < 0 or rec.nbytes < 0 or rec.num_tokens < 0:
            raise ValueError(f"staged-request record with a negative field: {rec}")
        if any(x not in (0, 1) for b in rec.blocks for x in b):
            raise ValueError("staged-request record: block flags must be 0 or 1")
        return rec

    @classmethod
    def from_bytes(cls, data: bytes) -> "StagedRequest":
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"a staged-request record is bytes, got {type(data).__name__}")
        try:
            d = json.loads(bytes(data).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed staged-request record: {exc}") from None
        if not isinstance(d, dict):
            raise ValueError("malformed staged-request record: not an object")
        return cls.from_dict(d)


@dataclass
class ArenaPlan:
    """D's plan for one request in arena mode: read P's spans into D's span, then
    scatter. Quacks like a :class:`PullPlan` for the manager (peers, local block ids)."""

    plan: PullPlan  # over the virtual engines (page ids = page positions)
    span: Span
    reads: Dict[str, Tuple[np.ndarray, np.ndarray]]  # peer -> (local rows, remote rows)
    scatter: List[CallPlan]  # per copier: its planned h2d call (span -> KV pages, zero granule -> zeroed pages)
    zero_pages: Tuple[Tuple[int, ...], ...]  # real local pages complete() zeroes, per group
    zero_runs: Tuple[np.ndarray, np.ndarray]  # (arena offsets, bytes) zeroed in D's span first
    local_block_ids: Tuple[Tuple[int, ...], ...]  # real, per group
    read_pages: Tuple[Tuple[int, ...], ...]  # real, per group
    order: str = ORDER  # the staging order of both spans (the records')
    live: bool = True  # D's span is owned
    pulled: bool = False
    extra: Dict[str, object] = field(default_factory=dict)

    @property
    def peer(self) -> str:
        return self.plan.peer

    @property
    def all_peers(self) -> Tuple[str, ...]:
        return self.plan.all_peers

    @property
    def num_bytes(self) -> int:
        return self.plan.num_bytes

    @property
    def num_descriptors(self) -> int:
        return sum(len(l) for l, _ in self.reads.values())


def merge_rows(local: np.ndarray, remote: np.ndarray, bridge: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Rows sorted by local address, merged where a row continues the previous one on
    both sides, or (``bridge`` > 0) follows it after a gap of the same ``<= bridge``
    bytes on both sides: the gap is then read too (see :data:`BRIDGE_BYTES`)."""
    if len(local) <= 1:
        return local, remote
    order = np.argsort(local[:, 0], kind="stable")
    la, ra, n = local[order, 0].astype(np.int64), remote[order, 0].astype(np.int64), local[order, 1].astype(np.int64)
    gap_l, gap_r = la[1:] - (la[:-1] + n[:-1]), ra[1:] - (ra[:-1] + n[:-1])
    cont = (gap_l == gap_r) & (gap_l >= 0) & (gap_l <= bridge)
    starts = np.flatnonzero(np.concatenate([[True], ~cont]))
    ends = np.concatenate([starts[1:], [len(la)]]) - 1
    total = la[ends] + n[ends] - la[starts]
    lrows = np.stack([la[starts], total, local[order[starts], 2].astype(np.int64)], 1).astype(np.uint64)
    rrows = np.stack([ra[starts], total, remote[order[starts], 2].astype(np.int64)], 1).astype(np.uint64)
    return lrows, rrows


class _Copiers:
    """One BlockCopier per block size and page geometry; its groups are the units'
    (unit, chunk, head slab) triples (head 0 only, the whole page chunk, in token order)."""

    def __init__(self, units: Sequence[Unit], device_caches: Mapping[str, torch.Tensor],
                 layouts, arena_buf: torch.Tensor, backend: str):
        self.units = list(units)
        self.members: Dict[tuple, List[Tuple[int, int, int]]] = {}  # (block bytes, geometry) -> [(unit, chunk, head)]
        self.copiers: List[Tuple[int, BlockCopier]] = []
        dev: Dict[tuple, Dict[str, torch.Tensor]] = {}
        host: Dict[tuple, Dict[str, torch.Tensor]] = {}
        block_dims: Dict[str, int] = {}
        for i, u in enumerate(units):
            t = device_caches[u.layers[0]]
            layout = layouts[u.layers[0]]
            cd = _chunk_dim(t, layout) if u.num_chunks > 1 else None
            bd = layout.block_dim - (cd is not None and cd < layout.block_dim)  # after dropping the chunk axis
            for c in range(u.num_chunks):
                chunk = t if cd is None else t.select(cd, c)
                hd = _axis_dim(chunk, bd, u.heads, u.head_stride, "head") if u.heads > 1 else None
                for h in range(u.slabs):
                    view = chunk if hd is None else chunk.select(hd, h // u.outer)
                    vbd = bd - (hd is not None and hd < bd)
                    if u.outer > 1:  # then the slab of this head: K or V
                        od = _axis_dim(view, vbd, u.outer, u.outer_stride, "K/V")
                        view = view.select(od, h % u.outer)
                        vbd -= od < vbd
                    key = f"u{i}c{c}h{h}"
                    # the whole arena as blocks of this block size, with the view's own in-block strides
                    strides, shape = list(view.stride()), list(view.shape)
                    strides[vbd] = u.block_bytes // view.element_size()
                    shape[vbd] = arena_buf.numel() // u.block_bytes
                    # one copier per block size and in-block geometry: the copier's host views
                    # of one arena must be the same region (same bytes, same geometry)
                    ck = (u.block_bytes, view.element_size(),
                          tuple((n, st) for d, (n, st) in enumerate(zip(view.shape, view.stride())) if d != vbd))
                    dev.setdefault(ck, {})[key] = view
                    host.setdefault(ck, {})[key] = torch.as_strided(arena_buf.view(view.dtype), shape, strides, 0)
                    block_dims[key] = vbd
                    self.members.setdefault(ck, []).append((i, c, h))
        # Per copier, for ArenaStaging._calls: (block bytes, unit, group and slab index
        # (head * chunks + chunk) per copier group, then per KV cache group the copier
        # groups of its units).
        self.index = []
        for ck, members in self.members.items():
            unit = np.array([i for i, _, _ in members], np.int64)
            group = np.array([self.units[i].group for i, _, _ in members], np.int64)
            slab = np.array([h * self.units[i].num_chunks + c for i, c, h in members], np.int64)
            self.index.append((ck[0], unit, group, slab,
                               [(g, np.flatnonzero(group == g)) for g in sorted(set(group.tolist()))]))
        try:
            for ck, members in self.members.items():
                names = [[f"u{i}c{c}h{h}"] for i, c, h in members]
                self.copiers.append((ck[0], BlockCopier(dev[ck], host[ck], names, backend=backend,
                                                        block_dim={n[0]: block_dims[n[0]] for n in names})))
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        for _, c in self.copiers:
            c.close()
        self.copiers = []


def _axis_dim(chunk: torch.Tensor, bd: int, size: int, stride: int, what: str) -> int:
    for d in range(chunk.dim()):
        if d != bd and chunk.shape[d] == size and chunk.stride(d) == stride:
            return d
    raise ValueError(f"cannot find the {what} axis ({size} of stride {stride}) of a page "
                     f"chunk of shape {tuple(chunk.shape)}")


def _chunk_dim(t: torch.Tensor, layout) -> int:
    for d in range(t.dim()):
        if d != layout.block_dim and t.shape[d] == layout.num_chunks and \
                t.stride(d) * layout.itemsize == layout.chunk_stride:
            return d
    raise ValueError(f"cannot find the chunk axis of a tensor of shape {tuple(t.shape)}")


# Request shapes kept per D (LRU); the planner's route cache holds 256. One seeds/2
# 6-group shape (96 units, one virtual plan, routes) measured ~250 KiB of host
# memory (tracemalloc): ~32 MiB for 128 such shapes (more where shapes keep several
# virtual plans: prefix hits, holes).
SHAPE_CACHE_SIZE = 128
PLANS_PER_SHAPE = 16  # virtual plans kept per shape (prefix hits and holes make more than one)


@dataclass(frozen=True)
class _Shape:
    """What the plans of one request shape share: the virtual engines of D and of each
    peer, address-free (address 0 = the start of the span: a plan moves its rows by
    the spans' addresses), the peers' layer pairs, the span sizes and region extents.
    Handing the planner the same objects for every request of a shape makes its route
    cache (:func:`kvcopy.nixl.plan._routes`, keyed by identity) hit."""

    local: EngineInfo  # D's virtual engine
    segs: Tuple[int, ...]  # D's segment offset per unit
    nbytes: int  # D's span bytes
    peers: Tuple[Tuple[EngineInfo, Tuple[LayerPair, ...]], ...]  # per peer: virtual engine, layer pairs
    peer_bytes: Tuple[int, ...]  # per peer: the bytes its staged span must hold
    local_extents: List[int]  # chunk_extents of the virtual engines
    peer_extents: Tuple[List[int], ...]
    # (tokens, cached tokens per group, D's and the peers' holes) -> _VirtualPlan, at most
    # PLANS_PER_SHAPE (oldest out first): the plan over the virtual engines is a function of these alone
    plans: Dict[tuple, "_VirtualPlan"] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class _VirtualPlan:
    """One plan over a shape's virtual engines and what follows from it alone: the READ
    rows per peer and the zero runs, relative to the spans' starts (a request moves
    copies of them by its spans' addresses)."""

    plan: PullPlan
    reads: Dict[str, Tuple[np.ndarray, np.ndarray]]  # peer -> (local rows, remote rows), span-relative
    zero_runs: Tuple[np.ndarray, np.ndarray]  # (offsets in D's span, bytes)


class ArenaStaging:
    """The arena of one manager and everything that packs into it and scatters out of it."""

    def __init__(self, info: EngineInfo, device_caches: Mapping[str, torch.Tensor], layouts,
                 nbytes: int, ttl_s: float, backend: str, pin: bool, order: str = "token"):
        if order not in ORDERS:
            raise ValueError(f"arena_order must be one of {sorted(ORDERS)}, got {order!r}")
        self.order = ORDERS[order]  # the order save() stages in; plan_pull follows the records'
        self.units = stage_units(info)
        granule = granule_for(self.units)  # head slabs divide chunks: one granule serves both orders
        if nbytes < 2 * granule:
            raise ValueError(f"arena_bytes {nbytes} is smaller than two span granules ({granule} bytes each)")
        self.buffer = torch.empty(int(nbytes) // granule * granule, dtype=torch.uint8, pin_memory=pin)
        self.base = self.buffer.data_ptr()
        # Written once here so no READ or pack ever pays the first-touch page faults
        # (measured: a 36 MiB READ into untouched memory 2.6x the same READ into touched
        # memory). Granule 0 stays zero: complete() zeroes D's pages past the prompt by
        # copying from it in the same masked call that scatters the read pages.
        self.buffer.zero_()
        self.arena = Arena(self.buffer.numel(), granule, reserved=granule)
        self.ttl_s = float(ttl_s)
        if order == "head" and not any(_head_slabs(r)[0] for r in info.regions):
            raise ValueError("arena_order='head' needs HND pages (a page chunk [head][token][...]): "
                             "no layer here has them; use arena_order='token'")
        self._make = (info, device_caches, layouts, backend)
        self._by_order: Dict[str, _Copiers] = {}
        self._copiers_for(self.order)
        self._staged: Dict[bytes, List] = {}  # P: request id -> [span, deadline, readers left]
        self._deferred: List[Span] = []  # D: spans whose READ handle release failed
        self._quarantine: List[Tuple[float, Span]] = []  # D: (free after, span) of READs given up on
        self.info = info  # this engine's geometry: the manager plans with this one object (see IdentityCache)
        self.shapes = IdentityCache(SHAPE_CACHE_SIZE)  # D: the virtual engines per request shape
        self.pairings = IdentityCache(SHAPE_CACHE_SIZE)  # D: layer pairs per (peer, order), whatever the shape

    def _copiers_for(self, order: str) -> "_Copiers":
        """The units and copiers of one staging order (built on first use: D builds the
        head-order copiers when the first head-order record arrives). Where no unit
        splits into head slabs (NHD or MLA pages, one head per rank) both orders stage
        the same units: their copiers are shared, not built twice."""
        cps = self._by_order.get(order)
        if cps is None:
            info, caches, layouts, backend = self._make
            units = stage_units(info, order)
            cps = next((c for c in self._by_order.values() if c.units == units), None)
            if cps is None:
                cps = _Copiers(units, caches, layouts, self.buffer, backend)
            self._by_order[order] = cps
        return cps

    # ------------------------------------------------------------ P side
    def save(self, info: EngineInfo, block_ids, num_tokens: int, request_id, readers: int,
             count_failure: bool = True) -> StagedRequest:
        rid = _request_key(request_id)
        if rid in self._staged:
            raise ValueError(f"request {request_id!r} is already staged")
        if int(num_tokens) < 0 or readers < 1:
            raise ValueError(f"num_tokens {num_tokens} and readers {readers} must be >= 0 and >= 1")
        if isinstance(block_ids, (str, bytes)) or len(block_ids) != info.num_groups:
            raise ValueError(f"block_ids: expected one block id list per KV cache group ({info.num_groups})")
        self.expire()
        n_tok = int(num_tokens)
        held, positions, pages = [], [], []
        for g, ids in enumerate(block_ids):
            arr = np.asarray(ids)
            if arr.size and arr.dtype.kind not in "iu":
                raise TypeError(f"block_ids, group {g}: block ids must be integers, got {arr.dtype}")
            arr = arr.astype(np.int64).reshape(-1)
            n_blocks = -(-n_tok // info.tokens_per_block[g])  # positions P lacks are holes
            arr = np.concatenate([arr[:n_blocks], np.full(max(0, n_blocks - len(arr)), NO_BLOCK, np.int64)])
            if arr.size and (arr < NO_BLOCK).any():
                raise ValueError(f"block_ids, group {g}: negative block id {int(arr.min())}")
            r = info.tokens_per_block[g] // info.tokens_per_page[g]
            held.append(tuple(int(x != NO_BLOCK) for x in arr))
            p = expand_blocks(arr, r)[:-(-n_tok // info.tokens_per_page[g])]  # the pages holding prompt tokens
            positions.append(np.flatnonzero(p != NO_BLOCK))
            pages.append(p)
        counts = [len(p) for p in pages]
        segs, total = span_layout(self.units, counts)
        span = self.arena.allocate(total, count_failure)
        cps = self._copiers_for(self.order)
        try:
            calls = self._calls(cps, span, segs, counts, [p[k] for p, k in zip(pages, positions)], positions)
            # every copy is checked before the first moves, and planned once
            planned = [copier.plan("d2h", dev, host) for (cb, copier), (dev, host) in zip(cps.copiers, calls)]
            for (cb, copier), call in zip(cps.copiers, planned):
                copier.run("d2h", call)
        except Exception:
            self.arena.free(span)
            raise
        self._staged[rid] = [span, time.monotonic() + self.ttl_s, int(readers)]
        return StagedRequest(info.name, rid.decode("latin-1"), span.offset, span.nbytes, n_tok, tuple(held),
                             self.order)

    @staticmethod
    def _calls(cps: "_Copiers", span: Span, segs, counts, dev_pages, positions, zero_pages=None):
        """Per copier: (device ids, host ids) per (unit, chunk, head slab) group; ``zero_pages``
        (per group) are copied from the arena's zero granule (host block 0). A unit's
        segment is ``[head][chunk][page][block]`` (one head slab per page chunk in
        token order), so group (u, c, h) starts at block ``(h * chunks + c) * pages``."""
        # Plain int lists: the copier's native planner takes those (numpy arrays take
        # its numpy path: measured 430 ms against ~50 ms for seeds/2's 192 groups).
        # Host ids: one broadcast add and one tolist per (copier, KV cache group), not
        # per copier group (seeds/2, 192 groups: ~0.7 -> ~0.2 ms per plan here).
        zeros = [None if zero_pages is None else np.asarray(z, np.int64) for z in (zero_pages or dev_pages)]
        dev_of = [np.concatenate([d, z]).tolist() if z is not None and len(z) else np.asarray(d).tolist()
                  for d, z in zip(dev_pages, zeros)]
        seg_at, count = np.asarray(segs, np.int64), np.asarray(counts, np.int64)
        out = []
        for cb, unit, group, slab, by_group in cps.index:
            first = (span.offset + seg_at[unit] + slab * count[group] * cb) // cb
            host: List[Optional[List[int]]] = [None] * len(unit)
            for g, at in by_group:
                rows = first[at][:, None] + np.asarray(positions[g], np.int64)[None, :]
                z = zeros[g]
                if z is not None and len(z):
                    rows = np.concatenate([rows, np.zeros((len(at), len(z)), np.int64)], 1)
                for j, row in zip(at.tolist(), rows.tolist()):
                    host[j] = row
            out.append(([dev_of[g] for g in group.tolist()], host))
        return out

    def on_notifications(self, notifs: Mapping[str, List[bytes]]) -> None:
        """P: each notification naming a staged request is one reader done with it."""
        for msgs in notifs.values():
            for m in msgs:
                entry = self._staged.get(bytes(m))
                if entry is None:
                    continue
                entry[2] -= 1
                if entry[2] <= 0:
                    self._drop(bytes(m))

    def expire(self, now: Optional[float] = None) -> int:
        """Free P's spans past their time to live; returns how many."""
        now = time.monotonic() if now is None else now
        old = [rid for rid, (_, deadline, _) in self._staged.items() if deadline <= now]
        for rid in old:
            self._drop(rid)
        return len(old)

    def release(self, request_id) -> None:
        """P: free a staged request's span now (the caller knows no READ will touch it)."""
        rid = _request_key(request_id)
        if rid not in self._staged:
            raise ValueError(f"request {request_id!r} is not staged")
        self._drop(rid)

    def _drop(self, rid: bytes) -> None:
        span = self._staged.pop(rid)[0]
        self.arena.free(span)

    @property
    def staged(self) -> List[str]:
        return [r.decode("latin-1") for r in self._staged]

    # ------------------------------------------------------------ D side
    def plan_pull(self, info: EngineInfo, peers: Sequence[EngineInfo], records, num_tokens: int,
                  local_block_ids, num_cached_tokens) -> ArenaPlan:
        names = [p.name for p in peers]
        if isinstance(records, (bytes, bytearray, memoryview)):
            records = StagedRequest.from_bytes(records)
        if isinstance(records, StagedRequest):
            if len(names) != 1:
                raise ValueError("several peers: pass a mapping peer name -> its StagedRequest")
            records = {names[0]: records}
        if not isinstance(records, Mapping):
            raise TypeError("records: a StagedRequest, or a mapping peer name -> StagedRequest")
        n_tok = int(num_tokens)
        recs, remote_ids, peer_counts = [], {}, []
        for p in peers:
            rec = records.get(p.name)
            if isinstance(rec, (bytes, bytearray)):
                rec = StagedRequest.from_bytes(rec)
            if not isinstance(rec, StagedRequest):
                raise ValueError(f"no StagedRequest for peer {p.name!r}")
            peer_counts.append(self._check_record(p, rec, n_tok, remote_ids))
            recs.append(rec)
        orders = {rec.order for rec in recs}
        if len(orders) > 1:
            raise ValueError(f"the peers staged this request in different orders {sorted(orders)}")
        order = orders.pop() if orders else ORDER  # D's span follows P's order: the runs line up
        if isinstance(local_block_ids, (str, bytes)) or len(local_block_ids) != info.num_groups:
            raise ValueError(f"local_block_ids: expected one block id list per KV cache group ({info.num_groups})")
        local = []
        for g, ids in enumerate(local_block_ids):
            arr = np.asarray(ids)
            if arr.size and arr.dtype.kind not in "iu":
                raise TypeError(f"local_block_ids, group {g}: block ids must be integers, got {arr.dtype}")
            local.append(arr.astype(np.int64).reshape(-1))
        vblocks = []  # D's page positions holding prompt tokens (one page per virtual block)
        for g, arr in enumerate(local):
            lp = expand_blocks(arr, info.tokens_per_block[g] // info.tokens_per_page[g])
            lp = lp[:-(-n_tok // info.tokens_per_page[g])]
            vblocks.append(np.where(lp == NO_BLOCK, NO_BLOCK, np.arange(len(lp))))
        counts = tuple(len(v) for v in vblocks)
        peer_counts = tuple(peer_counts)
        shape = self.shapes.get((info, *peers), (order, counts, peer_counts),
                                lambda: self._shape(info, peers, order, counts, peer_counts))
        remote_spans = {}
        for p, rec, need in zip(peers, recs, shape.peer_bytes):
            if need > rec.nbytes or rec.offset < 0 or rec.offset + rec.nbytes > p.arena[1]:
                raise ValueError(f"record of {p.name!r}: span [{rec.offset}, +{rec.nbytes}) does not hold its "
                                 f"{need} bytes inside the peer's {p.arena[1]}-byte arena")
            remote_spans[p.name] = (p.arena[0] + rec.offset, rec.nbytes)
        # Quarantined spans past their time only: the spans of unreleased READ handles
        # are the manager's call (it knows whether the release went through).
        self.flush_deferred(safe=False)
        span = self.arena.allocate(shape.nbytes)
        try:
            return self._plan(info, shape, remote_ids, remote_spans, n_tok, local, vblocks, counts, span,
                              num_cached_tokens, order)
        except Exception:
            self.arena.free(span)
            raise

    @staticmethod
    def _check_record(p: EngineInfo, rec: StagedRequest, n_tok: int, remote_ids) -> Tuple[int, ...]:
        """Check one peer's record against its handshake; its page positions held go to
        ``remote_ids``; returns its page counts per group (the span's shape)."""
        if rec.engine != p.name:
            raise ValueError(f"record of engine {rec.engine!r} given for peer {p.name!r}")
        if p.buffer != "arena" or p.arena[1] <= 0:
            raise ValueError(f"peer {p.name!r} is in {p.buffer!r} mode, not 'arena': it stages no requests")
        if rec.num_tokens != n_tok:
            raise ValueError(f"record of {p.name!r} staged {rec.num_tokens} tokens, the pull is for {n_tok}")
        if len(rec.blocks) != p.num_groups:
            raise ValueError(f"record of {p.name!r}: {len(rec.blocks)} block lists for {p.num_groups} groups")
        counts, vpages = [], []
        for g, b in enumerate(rec.blocks):
            r = p.tokens_per_block[g] // p.tokens_per_page[g]
            if len(b) != -(-n_tok // p.tokens_per_block[g]):
                raise ValueError(f"record of {p.name!r}, group {g}: {len(b)} blocks staged for {n_tok} tokens")
            flags = np.repeat(np.asarray(b, np.int64), r)[:-(-n_tok // p.tokens_per_page[g])]
            counts.append(len(flags))
            vpages.append(np.where(flags == 1, np.arange(len(flags)), NO_BLOCK))
        remote_ids[p.name] = vpages
        return tuple(counts)

    def _shape(self, info: EngineInfo, peers: Sequence[EngineInfo], order: str, counts: Tuple[int, ...],
               peer_counts: Sequence[Tuple[int, ...]]) -> "_Shape":
        """The address-free virtual engines of one request shape (a cache miss of :attr:`shapes`)."""
        units = self._copiers_for(order).units
        segs, total = span_layout(units, counts)
        vd = virtual_engine(info, units, segs, counts)
        sources, need = [], []
        for p, pc in zip(peers, peer_counts):
            p_units = stage_units(p, order)
            p_segs, p_total = span_layout(p_units, pc)
            vp = virtual_engine(p, p_units, p_segs, pc)
            # Layers pair on what does not depend on page counts (names, dtypes, chunks,
            # heads, in-page axes): once per (peer, order), not per shape.
            pairs = self.pairings.get((info, p), (order,), lambda: tuple(pair_layers(vd, vp)))
            sources.append((vp, pairs))
            need.append(p_total)
        return _Shape(vd, tuple(segs), total, tuple(sources), tuple(need), chunk_extents(vd),
                      tuple(chunk_extents(vp) for vp, _ in sources))

    def _virtual_plan(self, shape: "_Shape", remote_ids, n_tok, vblocks, cached) -> "_VirtualPlan":
        """The plan over the shape's virtual engines, its READ rows and zero runs, relative
        to the spans' starts (every check the planner and the descriptors make runs here)."""
        vd = shape.local
        plan = build_multi_pull_plan(vd, shape.peers, remote_ids, n_tok, vblocks, cached)
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
            reads[vp.name] = merge_rows(*desc_rows(pairs, pieces, vd, vp),
                                        BRIDGE_BYTES if len(shape.peers) == 1 else 0)
        # Rows of read pages past the prompt: zeroed in D's span before the scatter.
        starts, lens = [], []
        for p in plan.pairs:
            if not (p.zero_segments and p.pages_to_zero):
                continue
            reg = vd.regions[p.local.index]
            pg = np.asarray(p.pages_to_zero, np.int64) * reg.page_stride + reg.address
            for c in range(reg.num_chunks):
                for off, n in p.zero_segments:
                    starts.append(pg + c * reg.chunk_stride + off)
                    lens.append(np.full(len(pg), n, np.int64))
        zero_runs = (np.concatenate(starts), np.concatenate(lens)) if starts else \
            (np.empty(0, np.int64), np.empty(0, np.int64))
        return _VirtualPlan(plan, reads, zero_runs)

    def _plan(self, info, shape: "_Shape", remote_ids, remote_spans, n_tok, local, vblocks, counts, span,
              cached, order) -> ArenaPlan:
        cps = self._copiers_for(order)
        segs = shape.segs
        cached = tuple(per_group_counts(cached, info.num_groups, "num_cached_tokens"))
        key = (n_tok, cached, tuple((v == NO_BLOCK).tobytes() for v in vblocks),
               tuple((v == NO_BLOCK).tobytes() for name in sorted(remote_ids) for v in remote_ids[name]))
        virt = shape.plans.get(key)
        if virt is None:
            virt = self._virtual_plan(shape, remote_ids, n_tok, vblocks, cached)
            if len(shape.plans) >= PLANS_PER_SHAPE:
                shape.plans.pop(next(iter(shape.plans)))
            shape.plans[key] = virt
        plan = virt.plan
        d_at = self.base + span.offset  # the virtual engines' address 0, on each side
        reads = {}
        for name, (lrel, rrel) in virt.reads.items():
            lrows, rrows = lrel.copy(), rrel.copy()
            lrows[:, 0] += np.uint64(d_at)
            rrows[:, 0] += np.uint64(remote_spans[name][0])
            # Every byte read lies in the two spans (belt and braces over the planner).
            _inside(lrows, d_at, span.nbytes, "D's span")
            _inside(rrows, *remote_spans[name], f"{name!r}'s staged span")
            reads[name] = (lrows, rrows)
        # Real pages: virtual page ids are page positions.
        real_pages, read_real, zero_real, blocks = [], [], [], []
        for g, arr in enumerate(local):
            r = info.tokens_per_block[g] // info.tokens_per_page[g]
            lp = expand_blocks(arr, r)
            real_pages.append(lp)
            rp = np.asarray(plan.read_pages[g], np.int64)
            read_real.append(lp[rp])
            zfrom = max(counts[g], -(-max(n_tok, plan.num_cached_tokens[g]) // info.tokens_per_page[g]))
            tail = lp[zfrom:]
            z = np.concatenate([lp[np.asarray(plan.zero_pages[g], np.int64)], tail[tail != NO_BLOCK]])
            zero_real.append(tuple(z.tolist()))
            touched = np.concatenate([rp, np.asarray(plan.zero_pages[g], np.int64),
                                      np.arange(zfrom, len(lp))[tail != NO_BLOCK]]) // r
            _, first = np.unique(touched, return_index=True)
            blocks.append(tuple(arr[touched[np.sort(first)]].tolist()))
        zero_runs = (virt.zero_runs[0] + span.offset, virt.zero_runs[1])
        positions = [np.asarray(x, np.int64) for x in plan.read_pages]
        ids = self._calls(cps, span, segs, counts, read_real, positions,
                          [np.asarray(z, np.int64) for z in zero_real])
        # Planned (checked and packed) now: complete() must not fail after the read, and
        # it runs these calls as they are.
        scatter = [copier.plan("h2d", dev, host) for (cb, copier), (dev, host) in zip(cps.copiers, ids)]
        return ArenaPlan(plan=plan, span=span, reads=reads, scatter=scatter, zero_pages=tuple(zero_real),
                         zero_runs=zero_runs, local_block_ids=tuple(blocks),
                         read_pages=tuple(tuple(x.tolist()) for x in read_real), order=order)

    def reads(self, plan: ArenaPlan) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
        if not isinstance(plan, ArenaPlan) or not plan.live or plan.pulled or not self.arena.owns(plan.span):
            raise ValueError("not a live arena plan of this manager (already pulled, completed or discarded?)")
        plan.pulled = True  # one pull per arena plan
        return plan.reads

    def scatter(self, plan: ArenaPlan) -> None:
        """D: zero the rows past the prompt in D's span, then one masked h2d per copier
        (read pages from the span, pages past the prompt from the zero granule)."""
        starts, lens = plan.zero_runs
        if len(starts):
            idx = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens) + np.arange(int(lens.sum()))
            self.buffer.index_fill_(0, torch.as_tensor(idx), 0)
        for (cb, copier), call in zip(self._copiers_for(plan.order).copiers, plan.scatter):
            copier.run("h2d", call)

    def discard(self, plan: ArenaPlan, safe: bool = True, quarantine: bool = False) -> None:
        """D: free the plan's span (``safe`` False: a READ handle on it is not released
        yet; ``quarantine``: a READ given up on may still land in it, so it is freed only
        after ``ttl_s``)."""
        if not plan.live:
            return
        plan.live = False
        if quarantine:
            self._quarantine.append((time.monotonic() + self.ttl_s, plan.span))
        elif safe:
            self.arena.free(plan.span)
        else:
            self._deferred.append(plan.span)

    def flush_deferred(self, safe: bool = True, now: Optional[float] = None) -> None:
        """D: free the spans whose READ handles are released now (``safe``), and the
        quarantined spans past their time."""
        if safe and self._deferred:
            for s in self._deferred:
                self.arena.free(s)
            self._deferred = []
        if self._quarantine:
            now = time.monotonic() if now is None else now
            keep = []
            for deadline, s in self._quarantine:
                if deadline <= now:
                    self.arena.free(s)
                else:
                    keep.append((deadline, s))
            self._quarantine = keep

    def stats(self) -> Dict[str, int]:
        out = self.arena.stats()
        out["staged_requests"] = len(self._staged)
        out["quarantined_spans"] = len(self._quarantine)
        return out

    def forget(self, peer: EngineInfo) -> None:
        """D: drop what is cached for a removed peer."""
        self.shapes.forget(peer)
        self.pairings.forget(peer)

    def close(self) -> None:
        self.shapes.clear()
        self.pairings.clear()
        for cps in self._by_order.values():
            cps.close()
        self._by_order = {}


def chunk_extents(info: EngineInfo) -> List[int]:
    """Per region, the bytes from a page chunk's start that its axes reach (the chunk
    bytes, or more for a head-order virtual region, whose heads lie outside the page)."""
    out = []
    for r in info.regions:
        reach = r.itemsize
        for _, size, stride in r.axes or ():
            reach += (size - 1) * stride * r.itemsize
        out.append(max(r.chunk_bytes, reach))
    return out


def _inside(rows: np.ndarray, start: int, nbytes: int, what: str) -> None:
    if len(rows) and (int(rows[:, 0].min()) < start or
                      int((rows[:, 0] + rows[:, 1]).max()) > start + nbytes):
        raise ValueError(f"arena plan: a READ row falls outside {what} [{start}, +{nbytes})")


def _request_key(request_id) -> bytes:
    if isinstance(request_id, str):
        return request_id.encode("latin-1")
    if isinstance(request_id, (bytes, bytearray)) and request_id:
        return bytes(request_id)
    raise TypeError(f"request_id must be a non-empty str or bytes, got {request_id!r}")


__all__ = ["ArenaFull", "ArenaPlan", "ArenaStaging", "HEAD_ORDER", "ORDER", "ORDERS", "chunk_extents",
           "StagedRequest", "Unit", "merge_rows", "span_layout", "stage_units", "virtual_engine"]
