"""In-page geometry for heterogeneous pulls: token and head axes, byte segments, head owners.

A page chunk (the whole page, or K or V of a KV-first page) is a dense array whose
axes are named here from the region's layout (:mod:`kvcopy.core.layout`): ``token``,
``head`` and the rest (``o0``, ``o1``, ...: head size, a K/V axis inside the chunk,
MLA's latent) in tensor order. A pull between pages of different token counts or head
ranges moves a *selection* of a chunk: tokens ``[t, t + n)`` and heads ``[h, h + k)``
of every other axis. :func:`segments` lists the bytes of a selection on both sides in
one logical order and cuts them into runs contiguous on both sides, so a token slice
of an NHD page is one run, a token slice of an HND page is one run per head, a head
range of an HND page is one run, and a head range of an NHD page is one run per token.

:func:`head_owners` picks, for each KV head a rank holds, the peer rank it is read
from (replicated heads are read once, from one holder); :func:`remote_ranks` says which
peer ranks a rank needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .regions import RegionInfo

# More byte runs than this per chunk of one page pair is refused: the layouts would
# cost one NIXL descriptor per element row.
MAX_SEGMENTS_PER_CHUNK = 4096


@dataclass(frozen=True)
class ChunkAxes:
    """In-chunk axes of a region: names, sizes and strides (elements)."""

    names: Tuple[str, ...]
    sizes: Tuple[int, ...]
    strides: Tuple[int, ...]
    itemsize: int

    def size(self, name: str) -> int:
        return self.sizes[self.names.index(name)] if name in self.names else 1

    def others(self) -> Tuple[Tuple[str, int], ...]:
        return tuple((n, s) for n, s in zip(self.names, self.sizes) if n not in ("token", "head"))


def chunk_axes(r: RegionInfo) -> Optional[ChunkAxes]:
    """Named in-chunk axes of a region (``RegionInfo.axes``), or None where the layout
    names no token axis."""
    if r.axes is None:
        return None
    names, sizes, strides = zip(*r.axes)
    return ChunkAxes(tuple(names), tuple(sizes), tuple(strides), int(r.itemsize))


def segments(local: ChunkAxes, remote: ChunkAxes, local_sel: Tuple[Tuple[int, int], Tuple[int, int]],
             remote_sel: Tuple[Tuple[int, int], Tuple[int, int]]) -> Tuple[Tuple[int, int, int], ...]:
    """Byte runs ``(local offset, remote offset, bytes)`` moving a selection of a chunk.

    ``*_sel`` is ``((first token, tokens), (first head, heads))`` on that side; every
    other axis is moved whole (the two sides must agree on them). Raises ``ValueError``
    when the runs would be more than :data:`MAX_SEGMENTS_PER_CHUNK`.
    """
    return _segments(local, remote, local_sel, remote_sel)


@lru_cache(maxsize=4096)
def _segments(local: ChunkAxes, remote: ChunkAxes, local_sel, remote_sel):
    if local.itemsize != remote.itemsize or local.others() != remote.others():
        raise ValueError(f"in-page axes {local.others()} vs {remote.others()} do not match")
    (lt, n), (lh, k) = local_sel
    (rt, n2), (rh, k2) = remote_sel
    if (n, k) != (n2, k2):
        raise ValueError(f"selections of different sizes: {n}x{k} vs {n2}x{k2}")
    # Logical order: the local side's axes, slowest first.
    names = sorted(local.names, key=lambda a: -local.strides[local.names.index(a)])
    for a in remote.names:
        if a not in names:
            names.append(a)

    def spans(ax: ChunkAxes, t0: int, h0: int):
        out = []
        for a in names:
            start, count = (t0, n) if a == "token" else (h0, k) if a == "head" else (0, ax.size(a))
            stride = ax.strides[ax.names.index(a)] * ax.itemsize if a in ax.names else 0
            if a in ax.names and start + count > ax.size(a):
                raise ValueError(f"selection {a} [{start}, {start + count}) outside {ax.size(a)}")
            out.append((start, count, stride, ax.size(a)))
        return out

    ls, rs = spans(local, lt, lh), spans(remote, rt, rh)
    elem = local.itemsize
    # Fold the fastest axes into the element while they are whole and dense on both sides.
    while ls and all(s[0] == 0 and s[1] == s[3] and s[2] == elem for s in (ls[-1], rs[-1])):
        elem *= ls[-1][1]
        ls, rs = ls[:-1], rs[:-1]
    lo = np.zeros(1, dtype=np.int64)
    ro = np.zeros(1, dtype=np.int64)
    for (l0, cnt, lst, _), (r0, _, rst, _) in zip(ls, rs):
        idx = np.arange(cnt, dtype=np.int64)
        lo = (lo[:, None] + (l0 + idx)[None, :] * lst).reshape(-1)
        ro = (ro[:, None] + (r0 + idx)[None, :] * rst).reshape(-1)
    if len(lo) > 1:
        breaks = np.flatnonzero((np.diff(lo) != elem) | (np.diff(ro) != elem)) + 1
    else:
        breaks = np.empty(0, dtype=np.int64)
    if len(breaks) + 1 > MAX_SEGMENTS_PER_CHUNK:
        raise ValueError(
            f"the pages' layouts cut one chunk into {len(breaks) + 1} byte runs "
            f"(over {MAX_SEGMENTS_PER_CHUNK}); use the same kv_layout on both sides"
        )
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(lo)]])
    return tuple((int(lo[s]), int(ro[s]), int((e - s) * elem)) for s, e in zip(starts, ends))


def local_segments(ax: ChunkAxes, tokens: Tuple[int, int]) -> Tuple[Tuple[int, int], ...]:
    """(offset, bytes) runs of tokens ``[t, t + n)`` of every head of one chunk."""
    heads = (0, ax.size("head"))
    return tuple((lo, n) for lo, _, n in segments(ax, ax, (tokens, heads), (tokens, heads)))


def holds(heads: Optional[Tuple[int, int]], h: int) -> bool:
    return heads is not None and heads[0] <= h < heads[0] + heads[1]


def head_owners(local_heads: Optional[Tuple[int, int]], peer_heads: Sequence[Optional[Tuple[int, int]]],
                prefer: int) -> List[Tuple[int, int, int, int]]:
    """``[(peer index, local first head, remote first head, heads)]`` covering this
    rank's heads, each head read from one peer that holds it (``holders[prefer %
    len(holders)]``: replicated heads spread over the local ranks). ``local_heads`` None
    (MLA, no head axis): everything from one peer. Raises ``ValueError`` naming the
    first head no peer holds."""
    if local_heads is None:
        return [(prefer % len(peer_heads), 0, 0, 0)] if peer_heads else []
    first, count = local_heads
    out: List[List[int]] = []
    for h in range(first, first + count):
        holders = [i for i, ph in enumerate(peer_heads) if holds(ph, h)]
        if not holders:
            raise ValueError(f"KV head {h} is held by none of the given peers")
        i = holders[prefer % len(holders)]
        r = h - (peer_heads[i] or (0, 0))[0]  # a holder has heads: holds() is False without
        if out and out[-1][0] == i and out[-1][2] + out[-1][3] == r:
            out[-1][3] += 1
        else:
            out.append([i, h - first, r, 1])
    return [(a, b, c, d) for a, b, c, d in out]


def rank_heads(tp_rank: int, tp_size: int, total_kv_heads: int) -> Tuple[int, int]:
    """(first head, count) a TP rank holds (one replicated head when TP > heads)."""
    if total_kv_heads >= tp_size:
        per = total_kv_heads // tp_size
        return tp_rank * per, per
    return tp_rank * total_kv_heads // tp_size, 1


def remote_ranks(tp_rank: int, tp_size: int, remote_tp_size: int,
                 total_kv_heads: Optional[int] = None) -> List[int]:
    """The peer TP ranks this rank reads from: the holders :func:`head_owners` picks
    for each of its KV heads, or one rank for MLA (``total_kv_heads`` None)."""
    if total_kv_heads is None:
        return [tp_rank % remote_tp_size]
    heads = [rank_heads(r, remote_tp_size, total_kv_heads) for r in range(remote_tp_size)]
    owners = head_owners(rank_heads(tp_rank, tp_size, total_kv_heads), heads, tp_rank)
    return sorted({i for i, _, _, _ in owners})


def token_pieces(positions: np.ndarray, local_tpp: int, remote_tpp: int, num_tokens: int
                 ) -> Dict[Tuple[int, int, int], List[Tuple[int, int]]]:
    """Token pieces of the local page positions read: ``{(local token offset, remote
    token offset, tokens): [(local position, remote position)]}``; a piece that starts at
    or past ``num_tokens`` is a zero piece, keyed ``(offset, -1, tokens)`` with remote
    position -1 (the rest of that page is zeroed, not read)."""
    out: Dict[Tuple[int, int, int], List[Tuple[int, int]]] = {}
    if local_tpp == remote_tpp:
        out[(0, 0, local_tpp)] = [(int(k), int(k)) for k in positions]
        return out
    for k in positions:
        k = int(k)
        a, end = k * local_tpp, (k + 1) * local_tpp
        while a < end:
            if a >= num_tokens:
                out.setdefault((a - k * local_tpp, -1, end - a), []).append((k, -1))
                break
            kr = a // remote_tpp
            b = min(end, (kr + 1) * remote_tpp)
            out.setdefault((a - k * local_tpp, a - kr * remote_tpp, b - a), []).append((k, kr))
            a = b
    return out
