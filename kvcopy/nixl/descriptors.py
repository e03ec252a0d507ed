"""A plan's NIXL descriptor rows for one peer, checked and built in a fixed number of numpy calls.

``TransferManager.pull`` turns a :class:`~kvcopy.nixl.plan.PullPlan`'s region pairs
into what NIXL reads: indices into the prepared descriptor lists (pairs that move whole
chunks) or explicit ``(address, bytes, device)`` rows (pairs with byte segments). The
rows are in (pair, chunk, segment, page) order, as before this module existed, so
adjacent pages stay adjacent rows and NIXL merges them the same way.

Why a module: the per-pull work used to be numpy calls per pair and per chunk (two
``asarray`` of the page tuples, range checks, one add per chunk and side), which for
64 layers x 500 pages cost ~27 ms per pull on this loaded 2-core machine, and
``RegionRef.of`` per pair for the region checks. Here:

* the plan's page tuples are converted once per distinct tuple object (the planner
  shares one tuple per token piece between all the layers it serves, so a homogeneous
  plan has one local and one remote page array, whatever the layer count), with their
  min and max for the range checks;
* region checks compare with the engine's cached ``region_refs`` by identity first
  (the planner hands out those objects), by value otherwise;
* each (pair, chunk, segment) is one entry of a few Python lists; the rows are then one
  ``repeat`` + gather + multiply-add over all of them.

What is checked is unchanged: regions are this manager's and the peer's, byte segments
lie inside a chunk, page counts agree, pages lie inside their region (NIXL only checks
an index against the whole list: a page past its region would silently read the next
region).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

from .handshake import EngineInfo
from .plan import RegionPair, RegionRef


def same_ref(ref: RegionRef, refs: Sequence[RegionRef]) -> bool:
    """``ref`` is region ``ref.index`` of ``refs`` (identity first: plans share the objects)."""
    return ref.index < len(refs) and (ref is refs[ref.index] or ref == refs[ref.index])


class Pieces:
    """The distinct (local pages, remote pages) tuples of some pairs, as arrays."""

    def __init__(self) -> None:
        self._of: Dict[Tuple[int, int], int] = {}
        self.local: List[np.ndarray] = []
        self.remote: List[np.ndarray] = []
        self.bounds: List[Tuple[int, int, int, int]] = []  # (local min, max, remote min, max)

    def add(self, pair: RegionPair) -> int:
        """Index of ``pair``'s piece (``pair`` must stay alive while this object is used:
        pieces are keyed by the tuples' ``id``)."""
        key = (id(pair.local_pages), id(pair.remote_pages))
        j = self._of.get(key)
        if j is None:
            lp = np.asarray(pair.local_pages, dtype=np.int64)
            rp = np.asarray(pair.remote_pages, dtype=np.int64)
            j = self._of[key] = len(self.local)
            self.local.append(lp)
            self.remote.append(rp)
            self.bounds.append((int(lp.min()) if len(lp) else 0, int(lp.max()) if len(lp) else -1,
                                int(rp.min()) if len(rp) else 0, int(rp.max()) if len(rp) else -1))
        return j

    def expand(self, piece: Sequence[int], l_add, l_mul, r_add, r_mul) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows for entries ``e`` (one per (pair, chunk, segment)), entry by entry, each
        over its piece's pages ``i``: ``l_add[e] + l_mul[e] * local[i]`` and the same on
        the remote side. Returns (local, remote, entry of each row)."""
        if len(self.local) == 1:  # one piece (homogeneous plans): one broadcast per side
            lp, rp = self.local[0], self.remote[0]
            col = lambda v: np.asarray(v, np.int64)[:, None]  # noqa: E731
            la = (col(l_add) + col(l_mul) * lp).reshape(-1)
            ra = (col(r_add) + col(r_mul) * rp).reshape(-1)
            return la, ra, np.repeat(np.arange(len(piece)), len(lp))
        lens = np.array([len(a) for a in self.local], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        piece = np.asarray(piece, dtype=np.int64)
        n = lens[piece]
        entry = np.repeat(np.arange(len(piece)), n)
        # position of each row in the concatenated page arrays
        at = np.arange(int(n.sum()), dtype=np.int64) + np.repeat(starts[piece] - (np.cumsum(n) - n), n)
        lp = np.concatenate(self.local)[at]
        rp = np.concatenate(self.remote)[at]
        la = np.asarray(l_add, np.int64)[entry] + np.asarray(l_mul, np.int64)[entry] * lp
        ra = np.asarray(r_add, np.int64)[entry] + np.asarray(r_mul, np.int64)[entry] * rp
        return la, ra, entry


def check_pairs(pairs: Sequence[RegionPair], local: EngineInfo, remote: EngineInfo, name: str) -> Pieces:
    """Refuse pairs that do not fit this manager's regions and peer ``name``'s (see the
    module docstring); returns their pieces."""
    pieces = Pieces()
    mine, theirs = local.region_refs, remote.region_refs
    for pair in pairs:
        if not same_ref(pair.local, mine):
            raise ValueError(f"plan region {pair.local.index} is not this manager's region")
        if not same_ref(pair.remote, theirs):
            raise ValueError(f"plan region {pair.remote.index} is not peer {name!r}'s region")
        for lo, ro, n in pair.segments:
            if n <= 0 or lo < 0 or ro < 0 or lo + n > pair.local.chunk_bytes or ro + n > pair.remote.chunk_bytes:
                raise ValueError(f"plan byte segment {(lo, ro, n)} outside a chunk of region "
                                 f"{pair.local.index} or peer region {pair.remote.index}")
        if len(pair.local_pages) != len(pair.remote_pages):
            raise ValueError("plan pair has different local and remote page counts")
        lmin, lmax, rmin, rmax = pieces.bounds[pieces.add(pair)]
        for lo_, hi_, ref, side in ((lmin, lmax, pair.local, "local"), (rmin, rmax, pair.remote, "remote")):
            if lo_ < 0 or hi_ >= ref.num_pages:
                raise ValueError(f"plan {side} page {hi_ if hi_ >= ref.num_pages else lo_} "
                                 f"out of range [0, {ref.num_pages}) of region {ref.index}")
    return pieces


def index_rows(pairs: Sequence[RegionPair], pieces: Pieces, local_offsets: Sequence[int],
               remote_offsets: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """int32 indices into the prepared descriptor lists, (pair, chunk, page) order: row
    ``offset[r] + c * num_pages + p`` is chunk ``c`` of page ``p`` of region ``r``
    (offsets: a list of ints is faster to index than an array)."""
    piece, l_add, r_add = [], [], []
    for pair in pairs:
        j = pieces.add(pair)
        lo, ro = int(local_offsets[pair.local.index]), int(remote_offsets[pair.remote.index])
        for c in range(pair.local.num_chunks):
            piece.append(j)
            l_add.append(lo + c * pair.local.num_pages)
            r_add.append(ro + c * pair.remote.num_pages)
    if not piece:
        return np.empty(0, np.int32), np.empty(0, np.int32)
    ones = np.ones(len(piece), np.int64)
    la, ra, _ = pieces.expand(piece, l_add, ones, r_add, ones)
    return la.astype(np.int32), ra.astype(np.int32)


def desc_rows(pairs: Sequence[RegionPair], pieces: Pieces, local: EngineInfo,
              remote: EngineInfo) -> Tuple[np.ndarray, np.ndarray]:
    """Explicit (address, bytes, device) rows for both sides, (pair, chunk, segment,
    page) order; rows adjacent on both sides are merged."""
    piece, l_add, l_mul, r_add, r_mul, size = [], [], [], [], [], []
    for pair in pairs:
        j = pieces.add(pair)
        lr, rr = local.regions[pair.local.index], remote.regions[pair.remote.index]
        for c in range(pair.local.num_chunks):
            for lo, ro, n in pair.byte_segments():
                piece.append(j)
                l_add.append(lr.address + c * lr.chunk_stride + lo)
                l_mul.append(lr.page_stride)
                r_add.append(rr.address + c * rr.chunk_stride + ro)
                r_mul.append(rr.page_stride)
                size.append(n)
    if not piece:
        return np.empty((0, 3), np.uint64), np.empty((0, 3), np.uint64)
    la, ra, entry = pieces.expand(piece, l_add, l_mul, r_add, r_mul)
    n = np.asarray(size, np.int64)[entry]
    # merge runs: row i+1 continues row i on both sides
    cont = (la[:-1] + n[:-1] == la[1:]) & (ra[:-1] + n[:-1] == ra[1:])
    starts = np.flatnonzero(np.concatenate([[True], ~cont]))
    total = np.add.reduceat(n, starts)
    local_rows = np.stack([la[starts], total, np.full(len(starts), local.regions[0].device_id)], 1)
    remote_dev = remote.regions[pairs[0].remote.index].device_id
    remote_rows = np.stack([ra[starts], total, np.full(len(starts), remote_dev)], 1)
    return local_rows.astype(np.uint64), remote_rows.astype(np.uint64)
