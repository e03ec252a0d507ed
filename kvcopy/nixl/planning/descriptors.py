"""A plan's NIXL descriptor rows for one peer, checked and built in a fixed number of numpy calls.

``TransferManager.pull`` turns a :class:`~kvcopy.nixl.planning.plan.PullPlan`'s region pairs
into what NIXL reads: indices into the prepared descriptor lists (pairs that move whole
chunks) or explicit ``(address, bytes, device)`` rows (pairs with byte segments). The
rows are in (pair, chunk, segment, page) order, so adjacent pages stay adjacent rows
and NIXL merges them.

Why a module: numpy calls per pair and per chunk (two ``asarray`` of the page tuples,
range checks, one add per chunk and side) cost tens of milliseconds per pull for 64
layers x 500 pages (``docs/nixl.md``, "Host cost per request"), as did ``RegionRef.of``
per pair for the region checks. Here:

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

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..engine.info import EngineInfo
from .plan import RegionPair, RegionRef


_NO_SIZES = np.empty(0, np.int64)


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

    def expand(self, piece: Sequence[int], l_add, l_mul, r_add, r_mul, size=None
               ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows for entries ``e`` (one per (pair, chunk, segment)), entry by entry, each
        over its piece's pages ``i``: ``l_add[e] + l_mul[e] * local[i]`` and the same on
        the remote side (``*_mul`` None: 1), and ``size[e]`` per row when given.
        Returns (local, remote, sizes; no sizes when ``size`` is None)."""
        col = lambda v: np.asarray(v, np.int64)[:, None]  # noqa: E731
        if len(self.local) == 1:  # one piece (homogeneous plans): one broadcast per side
            lp, rp = self.local[0], self.remote[0]
            la = (col(l_add) + (lp if l_mul is None else col(l_mul) * lp)).reshape(-1)
            ra = (col(r_add) + (rp if r_mul is None else col(r_mul) * rp)).reshape(-1)
            n = _NO_SIZES if size is None else np.repeat(np.asarray(size, np.int64), len(lp))
            return la, ra, n
        lens = np.array([len(a) for a in self.local], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        which = np.asarray(piece, dtype=np.int64)
        n = lens[which]
        entry = np.repeat(np.arange(len(which)), n)
        # position of each row in the concatenated page arrays
        at = np.arange(int(n.sum()), dtype=np.int64) + np.repeat(starts[which] - (np.cumsum(n) - n), n)
        lp = np.concatenate(self.local)[at]
        rp = np.concatenate(self.remote)[at]
        la = np.asarray(l_add, np.int64)[entry] + (lp if l_mul is None else np.asarray(l_mul, np.int64)[entry] * lp)
        ra = np.asarray(r_add, np.int64)[entry] + (rp if r_mul is None else np.asarray(r_mul, np.int64)[entry] * rp)
        return la, ra, _NO_SIZES if size is None else np.asarray(size, np.int64)[entry]


def check_pairs(pairs: Sequence[RegionPair], local: EngineInfo, remote: EngineInfo, name: str,
                extents: Optional[Tuple[Sequence[int], Sequence[int]]] = None) -> Pieces:
    """Refuse pairs that do not fit this manager's regions and peer ``name``'s (see the
    module docstring); returns their pieces. ``extents``: (local, remote) bytes per
    region a byte segment may reach from its chunk's start (default: the chunk bytes;
    arena mode passes its own virtual regions' reach, see :mod:`kvcopy.nixl.modes.arena`)."""
    pieces = Pieces()
    mine, theirs = local.region_refs, remote.region_refs
    for pair in pairs:
        lref, rref = pair.local, pair.remote
        if not same_ref(lref, mine):
            raise ValueError(f"plan region {lref.index} is not this manager's region")
        if not same_ref(rref, theirs):
            raise ValueError(f"plan region {rref.index} is not peer {name!r}'s region")
        lmax = extents[0][lref.index] if extents else lref.chunk_bytes
        rmax = extents[1][rref.index] if extents else rref.chunk_bytes
        for lo, ro, n in pair.segments:
            if n <= 0 or lo < 0 or ro < 0 or lo + n > lmax or ro + n > rmax:
                raise ValueError(f"plan byte segment {(lo, ro, n)} outside a chunk of region "
                                 f"{lref.index} or peer region {rref.index}")
        if len(pair.local_pages) != len(pair.remote_pages):
            raise ValueError("plan pair has different local and remote page counts")
        lmin, lmax, rmin, rmax = pieces.bounds[pieces.add(pair)]
        if lmin < 0 or lmax >= lref.num_pages:
            _out_of_range("local", lmin, lmax, lref)
        if rmin < 0 or rmax >= rref.num_pages:
            _out_of_range("remote", rmin, rmax, rref)
    return pieces


def _out_of_range(side: str, lo: int, hi: int, ref: RegionRef) -> None:
    raise ValueError(f"plan {side} page {hi if hi >= ref.num_pages else lo} "
                     f"out of range [0, {ref.num_pages}) of region {ref.index}")


def index_rows(pairs: Sequence[RegionPair], pieces: Pieces, local_offsets: Sequence[int],
               remote_offsets: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """int32 indices into the prepared descriptor lists, (pair, chunk, page) order: row
    ``offset[r] + c * num_pages + p`` is chunk ``c`` of page ``p`` of region ``r``
    (offsets: a list of ints is faster to index than an array)."""
    piece, l_add, r_add = [], [], []
    for pair in pairs:
        j = pieces.add(pair)
        lref, rref = pair.local, pair.remote
        lo, ro = int(local_offsets[lref.index]), int(remote_offsets[rref.index])
        if lref.num_chunks == 1:
            piece.append(j)
            l_add.append(lo)
            r_add.append(ro)
            continue
        for c in range(lref.num_chunks):
            piece.append(j)
            l_add.append(lo + c * lref.num_pages)
            r_add.append(ro + c * rref.num_pages)
    if not piece:
        return np.empty(0, np.int32), np.empty(0, np.int32)
    la, ra, _ = pieces.expand(piece, l_add, None, r_add, None)
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
    la, ra, sizes = pieces.expand(piece, l_add, l_mul, r_add, r_mul, size)
    # merge runs: row i+1 continues row i on both sides
    cont = (la[:-1] + sizes[:-1] == la[1:]) & (ra[:-1] + sizes[:-1] == ra[1:])
    starts = np.flatnonzero(np.concatenate([[True], ~cont]))
    total = np.add.reduceat(sizes, starts)
    local_rows = np.stack([la[starts], total, np.full(len(starts), local.regions[0].device_id)], 1)
    remote_dev = remote.regions[pairs[0].remote.index].device_id
    remote_rows = np.stack([ra[starts], total, np.full(len(starts), remote_dev)], 1)
    return local_rows.astype(np.uint64), remote_rows.astype(np.uint64)
