"""Byte rows and runs shared by the buffer modes: READ rows merged by address, bounds,
the runs of a plan's zeroed rows and the byte index of a set of runs.

A *row* is one NIXL descriptor, ``(address, bytes, device id)`` as uint64 (a row pair
is one local and one remote row of the same size); a *run* is ``(start, bytes)`` inside
one buffer. Arena mode merges a request's READ rows by address (:func:`merge_rows`),
so a request whose bytes line up on both sides is one descriptor; every mode zeroes the
rows of read pages past the prompt (:func:`zero_runs`) in the buffer NIXL wrote. Byte
ranges as ``(starts, ends)`` are merged (:func:`merged`) and compared (:func:`overlaps`)
to keep later pulls out of what a READ given up on may still write.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

# D reads a gap between two runs of one peer when it is this small and the same on both
# sides (a sliding window's dropped page, a prefix hit's cached pages, padding between
# units): the gap lies inside both spans, which this request owns, and D never scatters
# it. One more descriptor cost about 4.6 us over a bulk READ of the same bytes in the
# NIXL table of docs/bench.md (1,152 per-page descriptors against one, 36 MiB over UCX
# loopback), which is what moving about 20 KiB costs at that READ's bandwidth; on RDMA
# NICs posting a descriptor costs more, not less.
BRIDGE_BYTES = 64 << 10


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


def check_inside(rows: np.ndarray, start: int, nbytes: int, what: str) -> None:
    """Every row lies in ``[start, start + nbytes)``; else ``ValueError`` naming ``what``."""
    if len(rows) and (int(rows[:, 0].min()) < start or int((rows[:, 0] + rows[:, 1]).max()) > start + nbytes):
        raise ValueError(f"arena plan: a READ row falls outside {what} [{start}, +{nbytes})")


def zero_runs(pages, page_stride: int, base: int, num_chunks: int, chunk_stride: int,
              segments) -> Tuple[np.ndarray, np.ndarray]:
    """(starts, bytes) of the ``segments`` (``(offset, bytes)`` per chunk) of every chunk
    of ``pages``, addressed from ``base`` (page ``p`` chunk ``c`` at ``base + p *
    page_stride + c * chunk_stride``)."""
    at = np.asarray(pages, dtype=np.int64) * page_stride + base
    starts: List[np.ndarray] = []
    lens: List[np.ndarray] = []
    for c in range(num_chunks):
        for off, n in segments:
            starts.append(at + c * chunk_stride + off)
            lens.append(np.full(len(at), n, dtype=np.int64))
    if not starts:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(starts), np.concatenate(lens)


def byte_index(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The index of every byte of the runs ``(starts[i], lens[i])``, run by run."""
    if not len(starts):
        return np.empty(0, np.int64)
    return np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens) + np.arange(int(lens.sum()))


def merged(starts: np.ndarray, ends: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Byte ranges ``[starts[i], ends[i])`` as sorted, disjoint, non-adjacent ranges."""
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    if len(starts) <= 1:
        return starts.copy(), ends.copy()
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    new = np.concatenate([[True], s[1:] > e[:-1]])
    first = np.flatnonzero(new)
    last = np.concatenate([first[1:], [len(s)]]) - 1
    return s[first], e[last]


def overlaps(starts: np.ndarray, ends: np.ndarray, held_starts: np.ndarray, held_ends: np.ndarray) -> bool:
    """Whether any range ``[starts[i], ends[i])`` shares a byte with the ranges held
    (sorted and disjoint, as :func:`merged` makes them); empty ranges share none."""
    if not len(starts) or not len(held_starts):
        return False
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    i = np.searchsorted(held_ends, starts, side="right")  # the first held range ending past each start
    inside = (i < len(held_starts)) & (ends > starts)
    return bool(np.any(held_starts[i[inside]] < ends[inside]))
