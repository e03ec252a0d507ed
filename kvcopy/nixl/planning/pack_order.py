"""Pack orders of arena mode: where each byte of a request sits in its staged span.

Both sides compute a span's layout from a handshake and the record's ``order`` alone:

* a **unit** is one (KV cache group, region) pair: the layers of one group that view one
  tensor the same way (they are staged once). Units are in **forward order**: by their
  first layer name in natural order (digit runs compared as integers, so
  ``model.layers.2`` comes before ``model.layers.10``), then every *state* unit
  (Mamba/GDN: a region of :data:`STATE_PAGE_TOKENS` tokens per page, one page position
  per request) after every attention unit. So two engines with the same layers order
  them the same way whatever their group plans, and the units of consecutive layers
  are one contiguous byte range of the span: a layer-wise stage fills it front to back,
  and the state, written by every step until the prefill ends, comes last. Each unit's
  segment starts at a multiple of its chunk bytes (padding only between units of
  different chunk sizes). Page positions are the request's:
  position ``k`` holds tokens ``[k * T, (k + 1) * T)``; P stages the blocks covering
  its ``num_tokens`` (``NO_BLOCK`` positions are holes nobody reads).
* **token order** (``arena_order="token"``, the default, record order
  ``unit/chunk/page:v2``): a segment is ``[chunk][page position][page chunk]``. One
  layer's K (or V) for the whole request is one contiguous run, tokens in order.
* **head order** (``arena_order="head"``, ``unit/head/chunk/page:v2``, HND pages
  only): a segment is ``[head][chunk][page position][head slab]``, where a head slab
  is one head's ``[token][head size]`` of a page chunk. A run of KV heads of one layer,
  K and V and all pages, is one contiguous run: a TP head slice per layer. A page
  chunk ``[2][head][token][head size]`` (block-first ``[NB, 2, H, T, D]`` HND pages,
  K and V in one chunk) stages as ``[head][K/V][chunk][page position][head slab]``:
  still one run per head range. Units without a head axis in that form (MLA, NHD
  pages in a mixed model) keep token order.

D plans its READ with the ordinary planner (:mod:`kvcopy.nixl.planning.plan`) over *virtual*
engines whose regions are the units of each span (:func:`virtual_engine`: page stride
= the block bytes, chunk stride = pages x block bytes, address 0 = the span's start),
so the bytes D writes are exactly those the mirror would write (the byte oracle's
rules, token pieces and zeroed rows included). A head-order virtual region keeps its
pages' axes with the head stride moved outside the page, so the planner's byte segments
land in the head-major span unchanged; the descriptor check then bounds a segment by
the axes' reach (:func:`chunk_extents`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Dict, List, Sequence, Tuple

from ..engine.info import EngineInfo
from ..engine.regions import RegionInfo

# v2: units in forward order (natural layer-name order, state units last); v1 sorted names as strings
ORDER = "unit/chunk/page:v2"  # the token order (the default)
HEAD_ORDER = "unit/head/chunk/page:v2"
ORDERS = {"token": ORDER, "head": HEAD_ORDER}  # the manager's arena_order -> the record's name
MAX_GRANULE = 1 << 26  # an arena granule above 64 MiB (lcm of odd chunk sizes) is refused
# Tokens per page of a state group (Mamba/GDN: no token axis; kvcopy.vllm.groups declares
# it so): one page position holds any prompt's state. A region with at least this many
# tokens per page is a state region, from the handshake alone.
STATE_PAGE_TOKENS = 1 << 20
_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> Tuple[object, ...]:
    """``name`` cut into text and integers (``"model.layers.10"`` -> ``("model.layers.", 10, "")``):
    sorting by it puts layer 2 before layer 10. Text and integers alternate from a text
    part, so two keys compare part by part without mixing types."""
    parts = _DIGITS.split(name)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))


def is_state_region(r: RegionInfo) -> bool:
    """Whether a region holds per-request state (see :data:`STATE_PAGE_TOKENS`)."""
    return r.tokens_per_page >= STATE_PAGE_TOKENS


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
    state: bool = False  # a state unit (Mamba/GDN, is_state_region): staged after every attention unit

    @property
    def block_bytes(self) -> int:
        """Bytes the copier moves per block in head order (one head's slab of a page chunk)."""
        return self.head_bytes or self.chunk_bytes

    @property
    def slabs(self) -> int:
        """Slabs per page chunk in head order, head-major (slab ``h * outer + o``)."""
        return self.heads * self.outer


def head_slabs(r: RegionInfo) -> Tuple[int, int, int, int, int]:
    """(heads, bytes per head slab, head stride, slabs per head, their stride; strides in
    elements) where the page chunk is ``[head][everything else, dense]`` (HND pages) or
    ``[o][head][everything else, dense]`` with one axis ``o`` outside the heads (K/V of
    a block-first ``[NB, 2, H, T, D]`` page, one chunk), else (0, chunk bytes, 0, 1, 0)."""
    none = 0, r.chunk_bytes, 0, 1, 0
    axes = r.axes or ()
    names = [n for n, _, _ in axes]
    if "head" not in names:
        return none
    _, k, stride = axes[names.index("head")]
    rest, outer = 1, []
    for n, size, st in axes:
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


def stage_units(regions: Sequence[RegionInfo], order: str = ORDER) -> List[Unit]:
    """The units of an engine's regions in forward order (see the module docstring); in
    head order, HND units are split into head slabs."""
    if order not in ORDERS.values():
        raise ValueError(f"unknown staging order {order!r}; known: {sorted(ORDERS.values())}")
    out = []
    for r in regions:
        by_group: Dict[int, List[str]] = {}
        for name, g in r.members:
            by_group.setdefault(g, []).append(name)
        heads, head_bytes, head_stride, outer, outer_stride = (
            head_slabs(r) if order == HEAD_ORDER else (0, r.chunk_bytes, 0, 1, 0))
        if heads == 0 or heads * outer == 1:  # no head axis, or one head slab: as in token order
            heads, head_bytes, head_stride, outer, outer_stride = 1, 0, 0, 1, 0
        for g, names in by_group.items():
            out.append(Unit(g, r.index, tuple(sorted(names, key=natural_key)), r.num_chunks, r.chunk_bytes,
                            heads, head_bytes, head_stride, outer, outer_stride, is_state_region(r)))
    out.sort(key=lambda u: (u.state, natural_key(u.layers[0])))
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
        if u.slabs > 1 and axes is not None:  # [head][outer][chunk][page][slab] (slabs need a head axis)
            outer_step = u.num_chunks * n * b // r.itemsize  # elements per [chunk][page][slab] block
            moved = {"head": u.outer * outer_step}
            if u.outer > 1:
                moved.update({name: outer_step for name, size, st in axes
                              if st == u.outer_stride and size == u.outer})
            axes = tuple((name, size, moved.get(name, st)) for name, size, st in axes)
        # RegionInfo(**fields) rather than dataclasses.replace, which re-runs the field
        # machinery per call: about 4x cheaper for the 192 regions of a 6-group model
        f = {k: getattr(r, k) for k in _REGION_FIELDS}
        f.update(index=i, members=tuple((name, u.group) for name in u.layers), address=base + off, device_id=0,
                 num_pages=n, page_stride=b, chunk_stride=n * b if u.num_chunks > 1 else 0, axes=axes)
        regions.append(RegionInfo(**f))
    # A virtual block is one page: the planner's block ids are then page positions.
    return EngineInfo(name=info.name, buffer="arena", mem_type="DRAM", tp_rank=info.tp_rank,
                      tp_size=info.tp_size, tokens_per_block=info.tokens_per_page,
                      tokens_per_page=info.tokens_per_page, regions=tuple(regions), agent_metadata=b"")


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
