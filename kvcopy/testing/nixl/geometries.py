"""Random P/D geometries for the pull fuzzer, and what D must hold after each pull.

A :class:`Spec` is one case: layers (GQA or MLA, full or sliding-window attention), a
KV cache group plan on each side, tokens per block and per page per group on each
side, a layout per side (NHD, HND, KV-first NHD/HND, ``[pages, 2, tokens, heads,
size]``), a dtype, total KV heads and head size, TP sizes of P and D, aliasing across
groups, a KV-sharing layer, a prompt length, a sliding window, D's prefix hit, random
block ids with spare capacity, one D rank and the P ranks it is given
(:func:`random_spec`). P's ranks hold one *logical* KV (per layer, token and head:
random bytes, :func:`logical_kv`) in their pages (:func:`build_caches`); D's caches are
random poison.

:func:`expected` computes what D's caches must hold independently of any plan, from
token and head semantics with torch views per layout (no byte offsets, no page
geometry): every D page read holds the logical KV of its tokens and of the heads this
D rank holds, rows of a read page whose token piece (the page cut at both sides' page
boundaries) starts at or past the prompt are zero, pages allocated past the prompt are
zero, everything else (cached pages, pages not in the request, other layers, the
KV-sharing layer) keeps its poison.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ...nixl.engine.geometry import rank_heads, remote_ranks
from ...nixl.engine.info import EngineInfo
from ...nixl.wire.record import record_capacity
from ...nixl.planning.pack_order import granule_for, span_layout, stage_units
from ...nixl.planning.plan import NO_BLOCK, expand_blocks
from ...nixl.engine.regions import build_regions
from ...nixl.modes.arena import ArenaStaging
from .oracle import clone_caches

DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "uint8": torch.uint8,
}
if hasattr(torch, "float8_e4m3fn"):
    DTYPES["float8_e4m3fn"] = torch.float8_e4m3fn
LAYOUTS = ("nhd", "hnd", "kvf_nhd", "kvf_hnd", "bf_kv")
_PARTNER = {"nhd": "hnd", "hnd": "nhd", "kvf_nhd": "kvf_hnd", "kvf_hnd": "kvf_nhd", "bf_kv": "bf_kv"}


@dataclass
class SideSpec:
    """One engine's geometry (every TP rank of it)."""

    tp_size: int
    layout: str
    groups: List[List[str]]
    tokens_per_block: List[int]
    tokens_per_page: List[int]
    num_pages: int
    block_ids: List[List[int]]  # per group, anchored at token 0; NO_BLOCK outside a window
    alias: List[Tuple[str, str]] = field(default_factory=list)  # layers sharing one tensor

    @property
    def kv_layout(self) -> str:
        return "HND" if self.layout.endswith("hnd") else "NHD"

    def group_of(self, layer: str) -> int:
        return next(g for g, names in enumerate(self.groups) if layer in names)


@dataclass
class Spec:
    """One fuzz case (plain data: a child process can rebuild the same engines from it)."""

    seed: int
    dtype: str
    total_kv_heads: int
    head_size: int
    latent: int
    layers: List[Tuple[str, str, str]]  # (name, "gqa" | "mla", "full" | "swa")
    num_tokens: int
    num_cached: int
    p: SideSpec
    d: SideSpec
    d_rank: int
    p_ranks: List[int]

    def kind(self, layer: str) -> str:
        return next(k for n, k, _ in self.layers if n == layer)

    def side(self, which: str) -> SideSpec:
        return self.p if which == "p" else self.d

    def heads(self, which: str, rank: int) -> Tuple[int, int]:
        return rank_heads(rank, self.side(which).tp_size, self.total_kv_heads)

    def summary(self) -> str:
        kinds = "".join("M" if k == "mla" else ("S" if a == "swa" else "F") for _, k, a in self.layers)
        return (f"seed={self.seed} {self.dtype} layers={kinds} H={self.total_kv_heads} "
                f"TP {self.p.tp_size}->{self.d.tp_size} (D rank {self.d_rank} <- P {self.p_ranks}) "
                f"layout {self.p.layout}->{self.d.layout} groups {self.p.groups}->{self.d.groups} "
                f"tpb/tpp {self.p.tokens_per_block}/{self.p.tokens_per_page}->"
                f"{self.d.tokens_per_block}/{self.d.tokens_per_page} N={self.num_tokens} C={self.num_cached}")


# ------------------------------------------------------------------ engines from a spec
def _shape(spec: Spec, side: SideSpec, layer: str, rank: int) -> Tuple[int, ...]:
    tpp = side.tokens_per_page[side.group_of(layer)]
    npg = side.num_pages
    if spec.kind(layer) == "mla":
        return (npg, tpp, spec.latent)
    h = rank_heads(rank, side.tp_size, spec.total_kv_heads)[1]
    d = spec.head_size
    return {
        "nhd": (npg, tpp, h, d), "hnd": (npg, h, tpp, d), "kvf_nhd": (2, npg, tpp, h, d),
        "kvf_hnd": (2, npg, h, tpp, d), "bf_kv": (npg, 2, tpp, h, d),
    }[side.layout]


def page_view(t: torch.Tensor, layout: str, kind: str, page: int) -> torch.Tensor:
    """One page of a layer as uint8 ``[K/V, tokens, heads, row bytes]`` (a view)."""
    b = t.view(torch.uint8)
    if kind == "mla":
        return b[page].unsqueeze(1).unsqueeze(0)
    if layout == "nhd":
        return b[page].unsqueeze(0)
    if layout == "hnd":
        return b[page].transpose(0, 1).unsqueeze(0)
    if layout == "kvf_nhd":
        return b[:, page]
    if layout == "kvf_hnd":
        return b[:, page].transpose(1, 2)
    return b[page]  # bf_kv


def kv_slots(layout: str) -> int:
    """K/V slots a page holds: 2 for the 5-D layouts, 1 for ``[pages, tokens, heads, size]``
    (one cache, K or V, or K and V packed in the head size)."""
    return 2 if layout.startswith("kvf") or layout == "bf_kv" else 1


def logical_kv(spec: Spec) -> Dict[str, torch.Tensor]:
    """Per layer, uint8 ``[K/V, tokens, heads, row bytes]``: the prompt's KV as P computed it."""
    cap = max(len(ids) * b for ids, b in zip(spec.p.block_ids, spec.p.tokens_per_block))
    itemsize = torch.empty(0, dtype=DTYPES[spec.dtype]).element_size()
    gen = torch.Generator().manual_seed(spec.seed * 7919 + 1)
    out = {}
    for name, kind, _ in spec.layers:
        shape = (1, cap, 1, spec.latent * itemsize) if kind == "mla" else (
            kv_slots(spec.p.layout), cap, spec.total_kv_heads, spec.head_size * itemsize)
        out[name] = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    return out


def build_caches(spec: Spec, which: str, rank: int, logical: Optional[Dict[str, torch.Tensor]] = None
                 ) -> Dict[str, torch.Tensor]:
    """One rank's KV caches: random bytes; on P, the logical KV at every page it holds."""
    side = spec.side(which)
    dtype = DTYPES[spec.dtype]
    gen = torch.Generator().manual_seed(spec.seed * 1009 + (17 if which == "p" else 29) * (rank + 1))
    caches: Dict[str, torch.Tensor] = {}
    shared = {b: a for a, b in side.alias}
    for name, _, _ in spec.layers:
        if name in shared:
            continue
        shape = _shape(spec, side, name, rank)
        raw = torch.randint(0, 256, (math.prod(shape) * torch.empty(0, dtype=dtype).element_size(),),
                            dtype=torch.uint8, generator=gen)
        caches[name] = raw.view(dtype).view(shape)
    for b, a in shared.items():
        caches[b] = caches[a]
    if which == "d":
        caches["kv_sharing"] = caches[spec.layers[0][0]]  # reads another layer's KV: in no group
        return caches
    logical = logical if logical is not None else logical_kv(spec)
    h0, hn = spec.heads("p", rank)
    for g, names in enumerate(side.groups):
        tpp = side.tokens_per_page[g]
        pages = expand_blocks(side.block_ids[g], side.tokens_per_block[g] // tpp)
        for name in names:
            kind = spec.kind(name)
            src = logical[name] if kind == "mla" else logical[name][:, :, h0:h0 + hn]
            for k, page in enumerate(pages):
                if page != NO_BLOCK:
                    page_view(caches[name], side.layout, kind, int(page))[...] = src[:, k * tpp:(k + 1) * tpp]
    return caches


def engine_info(spec: Spec, which: str, rank: int, caches: Dict[str, torch.Tensor], name: str) -> EngineInfo:
    """The handshake record of one rank, without NIXL."""
    side = spec.side(which)
    regions = build_regions(caches, side.groups, side.tokens_per_page, "host", None, side.kv_layout,
                            rank, side.tp_size, spec.total_kv_heads)
    return EngineInfo(name=name, buffer="host", mem_type=regions.mem_type, tp_rank=rank, tp_size=side.tp_size,
                      tokens_per_block=tuple(side.tokens_per_block), tokens_per_page=tuple(side.tokens_per_page),
                      regions=tuple(regions.regions), agent_metadata=b"")


def manager_kwargs(spec: Spec, which: str, rank: int) -> dict:
    """What a TransferManager for this rank needs besides name and caches."""
    side = spec.side(which)
    return dict(layer_groups=side.groups, tokens_per_block=side.tokens_per_block,
                tokens_per_page=side.tokens_per_page, kv_layout=side.kv_layout, tp_rank=rank,
                tp_size=side.tp_size, total_kv_heads=spec.total_kv_heads)


# ------------------------------------------------------------------ the expectation
def expected(spec: Spec, d_before: Dict[str, torch.Tensor], logical: Dict[str, torch.Tensor]
             ) -> Tuple[Optional[Dict[str, torch.Tensor]], Optional[str]]:
    """D's caches after a correct pull, or (None, why) when no exact pull exists."""

    p, d = spec.p, spec.d
    n, c = spec.num_tokens, spec.num_cached
    held: set = set()
    for r in spec.p_ranks:
        h0, hn = spec.heads("p", r)
        held.update(range(h0, h0 + hn))
    dh0, dhn = spec.heads("d", spec.d_rank)
    if any(k == "gqa" for _, k, _ in spec.layers) and not set(range(dh0, dh0 + dhn)) <= held:
        return None, "heads"
    if any(k == "gqa" for _, k, _ in spec.layers) and (
            kv_slots(p.layout) != kv_slots(d.layout) or p.layout.startswith("kvf") != d.layout.startswith("kvf")):
        return None, "layouts"
    out = clone_caches(d_before)
    for g, names in enumerate(d.groups):
        tl = d.tokens_per_page[g]
        dpages = expand_blocks(d.block_ids[g], d.tokens_per_block[g] // tl)
        for name in names:
            kind = spec.kind(name)
            pg = p.group_of(name)
            tr = p.tokens_per_page[pg]
            ppages = expand_blocks(p.block_ids[pg], p.tokens_per_block[pg] // tr)
            src = logical[name] if kind == "mla" else logical[name][:, :, dh0:dh0 + dhn]
            for k, page in enumerate(dpages):
                if page == NO_BLOCK or k < c // tl:
                    continue
                view = page_view(out[name], d.layout, kind, int(page))
                start = k * tl
                if start < n:
                    t = np.arange(start, start + tl)
                    piece = np.maximum(start, t // tr * tr)
                    moved = piece < n
                    need = np.unique(t[moved] // tr)
                    if (need >= len(ppages)).any() or (ppages[need[need < len(ppages)]] == NO_BLOCK).any():
                        return None, "pages"
                    rows = torch.zeros(view.shape, dtype=torch.uint8)
                    idx = torch.as_tensor(np.flatnonzero(moved))
                    rows[:, idx] = src[:, torch.as_tensor(t[moved])]
                    view[...] = rows
                elif start >= max(n, c):
                    view[...] = 0
    return out, None


# ------------------------------------------------------------------ random cases
def _split(rng, names: List[str]) -> List[List[str]]:
    if not names:
        return []
    size = int(rng.choice([1, 2, 3, len(names)]))
    return [names[i:i + size] for i in range(0, len(names), size)]


def allocate(rng, tpb: Sequence[int], tpp: Sequence[int], counts: Sequence[int], firsts: Sequence[int]
             ) -> Tuple[int, List[List[int]]]:
    """(pages per tensor, block ids per group): ``counts[g]`` block positions of which the
    first ``firsts[g]`` are NO_BLOCK, random blocks whose pages are disjoint across groups."""
    groups = range(len(tpb))
    r = [b // p for b, p in zip(tpb, tpp)]
    need = sum((cnt - f) * rr for cnt, f, rr in zip(counts, firsts, r))
    unit = max(r + [4])  # whole units of the largest block (powers of two): no fragmentation
    num_pages = -(-(need + int(rng.integers(1, 12))) // unit) * unit
    used = np.zeros(num_pages, dtype=bool)
    block_ids: List[List[int]] = [[] for _ in groups]
    for g in sorted(groups, key=lambda g: -r[g]):  # largest blocks first, aligned
        slots = num_pages // r[g]
        free = [b for b in range(slots) if not used[b * r[g]:(b + 1) * r[g]].any()]
        chosen = [int(x) for x in rng.choice(free, size=counts[g] - firsts[g], replace=False)]
        for b in chosen:
            used[b * r[g]:(b + 1) * r[g]] = True
        block_ids[g] = [NO_BLOCK] * firsts[g] + chosen
    return num_pages, block_ids


def side(tp: int, layout: str, groups: List[List[str]], tokens_per_block: Sequence[int],
         tokens_per_page: Sequence[int], num_tokens: int, seed: int = 0, spare: int = 1,
         window_first: Optional[Sequence[int]] = None) -> SideSpec:
    """A side with random blocks for a ``num_tokens`` prompt (for hand-written cases):
    ``spare`` blocks of spare capacity per group, ``window_first[g]`` leading NO_BLOCK
    positions (a sliding-window group)."""
    rng = np.random.default_rng(seed)
    counts = [-(-num_tokens // b) + spare for b in tokens_per_block]
    firsts = list(window_first or [0] * len(groups))
    num_pages, ids = allocate(rng, tokens_per_block, tokens_per_page, counts, firsts)
    return SideSpec(tp, layout, [list(g) for g in groups], list(tokens_per_block), list(tokens_per_page),
                    num_pages, ids)


def _side(rng, layers, tp, layout, n, window, want_cover=None, cover_p=0.95):
    """A side's plan, page and block sizes and block ids for an n-token prompt."""
    full = [nm for nm, _, a in layers if a == "full"]
    swa = [nm for nm, _, a in layers if a == "swa"]
    groups = _split(rng, full) + _split(rng, swa)
    order = rng.permutation(len(groups))
    groups = [groups[i] for i in order]
    tpp_of = {a: int(rng.choice([2, 4, 8, 16])) for a in ("full", "swa")}
    if rng.random() < 0.5:
        tpp_of["swa"] = tpp_of["full"]
    ratio_of = {a: int(rng.choice([1, 1, 2, 4])) for a in ("full", "swa")}
    attn = {nm: a for nm, _, a in layers}
    tpp = [tpp_of[attn[gr[0]]] for gr in groups]
    tpb = [tpp_of[attn[gr[0]]] * ratio_of[attn[gr[0]]] for gr in groups]
    # Block positions per group; SWA groups hold only the window (NO_BLOCK before it).
    counts, firsts = [], []
    for g, gr in enumerate(groups):
        count = -(-n // tpb[g]) + int(rng.random() < 0.4)
        first = 0
        if attn[gr[0]] == "swa":
            x = max(0, n - window)
            first = x // tpb[g]
            if want_cover is not None and rng.random() < cover_p:
                first = min(first, want_cover // tpb[g])
        counts.append(max(count, 1))
        firsts.append(min(first, max(count, 1) - 1))
    num_pages, block_ids = allocate(rng, tpb, tpp, counts, firsts)
    alias = []
    kinds = {nm: k for nm, k, _ in layers}
    fg = [gr for gr in groups if attn[gr[0]] == "full"]
    sg = [gr for gr in groups if attn[gr[0]] == "swa"]
    if fg and sg and tpp_of["full"] == tpp_of["swa"] and rng.random() < 0.3:
        a, b = fg[0][0], sg[0][0]
        if kinds[a] == kinds[b]:
            alias.append((a, b))
    return SideSpec(tp, layout, groups, tpb, tpp, num_pages, block_ids, alias)


def random_spec(rng: np.random.Generator, seed: int) -> Spec:
    n_layers = int(rng.integers(1, 7))
    u = rng.random()
    kinds = ["gqa"] * n_layers if u < 0.7 else ["mla"] * n_layers if u < 0.9 else [
        str(rng.choice(["gqa", "mla"])) for _ in range(n_layers)]
    hybrid = rng.random() < 0.45
    layers = [(f"model.layers.{i}.attn", kinds[i], "swa" if hybrid and i % 2 else "full") for i in range(n_layers)]
    n = int(rng.integers(1, 161))
    window = int(rng.integers(8, 97))
    p_layout = str(rng.choice(LAYOUTS))
    v = rng.random()
    d_layout = p_layout if v < 0.75 else _PARTNER[p_layout] if v < 0.995 else str(rng.choice(LAYOUTS))
    tp_p, tp_d = int(rng.choice([1, 2, 4, 8])), int(rng.choice([1, 2, 4, 8]))
    d = _side(rng, layers, tp_d, d_layout, n, window)
    d_start = min((f * b for ids, b in zip(d.block_ids, d.tokens_per_block)
                   for f in [next((i for i, x in enumerate(ids) if x != NO_BLOCK), 0)]), default=0)
    p = _side(rng, layers, tp_p, p_layout, n, window, want_cover=d_start)
    cached = 0
    if rng.random() < 0.3:
        b = d.tokens_per_block[0]
        cached = int(rng.integers(0, n + 1)) // b * b
    total = int(rng.choice([1, 2, 4, 8]))
    d_rank = int(rng.integers(0, tp_d))
    has_gqa = any(k == "gqa" for k in kinds)
    needed = remote_ranks(d_rank, tp_d, tp_p, total if has_gqa else None)
    if has_gqa and any(k == "mla" for k in kinds) and d_rank % tp_p not in needed:
        needed = sorted(set(needed) | {d_rank % tp_p}) if rng.random() < 0.5 else needed
    w = rng.random()
    if w < 0.7:
        p_ranks = needed
    elif w < 0.99 or len(needed) < 2:
        p_ranks = list(range(tp_p))
    else:
        p_ranks = needed[1:]  # short of a rank: must raise
    return Spec(seed=seed, dtype=str(rng.choice(sorted(DTYPES))), total_kv_heads=total,
                head_size=int(rng.choice([4, 8, 16])), latent=int(rng.choice([8, 16, 24])), layers=layers,
                num_tokens=n, num_cached=cached, p=p, d=d, d_rank=d_rank, p_ranks=p_ranks)


# ------------------------------------------------------------------ one case


# ------------------------------------------------------------------ arena mode
def arena_order(spec: Spec) -> str:
    """The staging order a case's P ranks use in arena mode (see the module docstring)."""
    gqa = any(kind == "gqa" for _, kind, _ in spec.layers)  # MLA pages have no head axis
    return "head" if spec.seed % 2 and spec.p.kv_layout == "HND" and gqa else "token"


def arena_staging(spec: Spec, which: str, rank: int, caches: Dict[str, torch.Tensor], name: str, spans: int = 0,
                  pin: bool = False):
    """(arena staging, its handshake record) of one rank in arena mode, without NIXL,
    page sums on; its arena holds ``spans`` spans of the request (default: one on P, two
    on D: see :func:`kvcopy.testing.nixl.fuzz.run_arena_case`); ``pin``: a pinned arena
    (CUDA caches, as a manager builds it for them)."""
    one = spec.side(which)
    regions = build_regions(caches, one.groups, one.tokens_per_page, "device", None, one.kv_layout,
                            rank, one.tp_size, spec.total_kv_heads)
    info = EngineInfo(name=name, buffer="arena", mem_type="DRAM", tp_rank=rank, tp_size=one.tp_size,
                      tokens_per_block=tuple(one.tokens_per_block), tokens_per_page=tuple(one.tokens_per_page),
                      regions=tuple(regions.regions), agent_metadata=b"")
    units = stage_units(info.regions)
    pages = [-(-spec.num_tokens // t) for t in one.tokens_per_page]
    # the spans (P's with its record slot, for request ids up to 64 bytes), the zero granule, slack
    slot = record_capacity(info, spec.num_tokens, b"r" * 64) if which == "p" else 0
    need = (spans or (2 if which == "d" else 1)) * (span_layout(units, pages)[1] + slot) + 3 * granule_for(units)
    if which == "d":  # a push's record slots (one per P rank)
        p_info = replace(info, name="P" + "9" * 8, tokens_per_block=tuple(spec.p.tokens_per_block),
                         tokens_per_page=tuple(spec.p.tokens_per_page))
        need += len(spec.p_ranks) * record_capacity(p_info, spec.num_tokens, b"req")
    grouped = {n: caches[n] for g in one.groups for n in g}
    order = arena_order(spec) if which == "p" else "token"  # D's span follows the record's order
    st = ArenaStaging(regions, grouped, need, 60.0, "auto", pin, order, checksum=True)
    return st, replace(info, arena=(st.base, st.arena.nbytes))
