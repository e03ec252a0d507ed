"""Chunked push: a pushed request's spans cut by units, on both sides.

A span is ``[unit 0][unit 1]...[unit n-1]`` (:func:`~kvcopy.nixl.planning.pack_order.span_layout`:
one contiguous segment per unit, units in forward order, state units last), then the
record slot. A layer-wise P (:mod:`kvcopy.nixl.modes.partial_stage`) has a unit's bytes
final once its copy in the request's last step ended, so it can WRITE units ``[lo, hi)``
before the rest (:meth:`kvcopy.nixl.push_writes.PushWrites.post_units`) and say so with a ``c``
notice naming that range of *its* units.

P (:func:`unit_bounds`, :func:`clip_rows`): units ``[lo, hi)`` are P's bytes
``[bounds[lo], bounds[hi])``; the reservation's rows (``[p_rel, d_rel, nbytes]``, planned
by D) are cut to that range, so a chunk WRITEs exactly the bytes of those units that D
reads, to where D planned them.

D (:func:`plan_units`, at reserve, from P's handshake alone): per unit of D's span the P
units of each peer whose bytes it reads (from the rows), its zero runs, and its scatter
calls (each span copier's whole scatter call, checked at reserve and cut into one call
per unit by ``BlockCopier.split``, as P's per-unit copies are; so nothing can fail to
plan once bytes landed). On ``c`` D scatters every unit whose P units have all landed
(:func:`scatter`); the rest after P's ``f``. Sums: each call sums its pages inside the
copy, as the whole-request scatter does; a page's sum depends on its bytes and its place
in the staged block only, and the fold is a sum over triples, so folding the calls unit
by unit (:class:`UnitSums`) gives the values the whole scatter's fold gives, compared
with P's record when it arrives (in the final WRITE's trailer). On the CPU each call is
folded as it ends, so at ``f`` only the units scattered then are left to fold.

**On a GPU** (``ArenaStaging.streams`` set: :class:`~kvcopy.nixl.modes.side_stream.CudaStreams`,
or in CPU tests a recording :class:`~kvcopy.testing.streams.RecordedStreams`) D lands
chunks at ``c`` too, with no host wait: each :func:`scatter` enqueues its units' calls on
the calling thread's current stream, copies their sums into one pinned host buffer on
that stream right behind them and records an event; the span is held until that event
completed (``ArenaStaging.scattered``, the rule of the whole-request scatter), and the
sums are folded once it completed, found by asking it at the next ``state`` (never a
wait, never a ``.cpu()``). The comparison at ``f`` stays pending until the last
read-back is folded (``Completion.ready``), as the whole-request GPU landing's does.
"""
from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ...core.copier import CallPlan
from ..planning.pack_order import span_layout, stage_units
from .rows import byte_index
from .side_stream import StreamOps
from .span_sums import fold_sealed


def unit_bounds(units, counts: Sequence[int]) -> np.ndarray:
    """Where each unit of a span starts, then where its payload ends (``len(units) + 1`` offsets)."""
    segs, total = span_layout(units, counts)
    return np.asarray(list(segs) + [total], np.int64)


def runs(mask: np.ndarray) -> List[Tuple[int, int]]:
    """The maximal runs ``[lo, hi)`` of True in ``mask``."""
    edges = np.diff(np.concatenate([[0], np.asarray(mask, bool).astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def clip_rows(rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``rows`` ``[p_rel, d_rel, nbytes]`` cut to P's bytes ``[lo, hi)`` (rows outside dropped)."""
    a = np.maximum(rows[:, 0], lo)
    b = np.minimum(rows[:, 0] + rows[:, 2], hi)
    keep = a < b
    out = np.stack([a, rows[:, 1] + (a - rows[:, 0]), b - a], axis=1)[keep]
    return out.astype(np.int64)


class UnitCall(NamedTuple):
    """One planned h2d call of one D unit: the copier, the plan, the triples' numbers ``J``
    (in the call's order) and the unit's KV cache group."""

    copier: int
    call: CallPlan
    js: np.ndarray
    group: int


class UnitScatter(NamedTuple):
    """D's per-unit landing of one reservation (module docstring), immutable once made."""

    needs: Tuple[Optional[Tuple[np.ndarray, ...]], ...]  # per D unit, per peer: the P units it reads (None: at f)
    p_units: Tuple[int, ...]  # per peer: its span's units
    zero: Tuple[Tuple[np.ndarray, np.ndarray], ...]  # per D unit: (arena offsets, bytes) zeroed first
    calls: Tuple[Tuple[UnitCall, ...], ...]  # per D unit
    positions: Tuple[np.ndarray, ...]  # per group: the page positions D reads
    zero_counts: Tuple[int, ...]  # per group: pages zeroed after them in each triple's call

    def ready(self, landed: Sequence[np.ndarray], done: np.ndarray) -> List[int]:
        """D units not scattered yet whose P units all landed (``landed``: per peer, bool per P unit)."""
        return [u for u, need in enumerate(self.needs)
                if not done[u] and need is not None and all(bool(ok[n].all()) for ok, n in zip(landed, need))]


def plan_units(staging, shape, req, peers, span_offset: int, rows, read_real, read_pages, zero_real,
               zero_starts: np.ndarray, zero_lens: np.ndarray, layout) -> UnitScatter:
    """D, at reserve: the per-unit landing of a reservation (module docstring). ``rows``:
    per peer ``[p_rel, d_rel, nbytes]``; ``read_real``/``read_pages``/``zero_real``: what the
    whole scatter copies (:meth:`ArenaStaging._arena_plan`'s); ``layout``: D's h2d sum
    layout, or None with checksums off."""
    cps = staging.span_copiers(req.order)
    d_bounds = np.asarray(list(shape.segs) + [shape.nbytes], np.int64)
    p_bounds = [unit_bounds(stage_units(p.info.regions, req.order), pc) for p, pc in zip(peers, req.peer_counts)]
    needs: List[Optional[Tuple[np.ndarray, ...]]] = []
    for u in range(len(cps.units)):
        per_peer: List[np.ndarray] = []
        for p, pb in zip(peers, p_bounds):
            r = clip_rows(np.asarray(rows[p.name])[:, [1, 0, 2]], int(d_bounds[u]), int(d_bounds[u + 1]))
            if not len(r):  # D reads nothing of this peer into this unit
                per_peer.append(np.zeros(0, np.int64))
                continue
            first = np.searchsorted(pb, r[:, 1], "right") - 1
            last = np.searchsorted(pb, r[:, 1] + r[:, 2] - 1, "right") - 1
            if (first < 0).any() or (last >= len(pb) - 1).any():  # reads past P's payload: landed at f only
                break
            per_peer.append(np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last)])))
        needs.append(tuple(per_peer) if len(per_peer) == len(peers) else None)
    rel = zero_starts - span_offset
    unit_of = np.searchsorted(d_bounds, rel, "right") - 1
    zero = tuple((zero_starts[unit_of == u], zero_lens[unit_of == u]) for u in range(len(cps.units)))
    ids = cps.ids(span_offset, shape.segs, req.counts, read_real, [np.asarray(x, np.int64) for x in read_pages],
                  [np.asarray(z, np.int64) for z in zero_real])
    calls: List[List[UnitCall]] = [[] for _ in cps.units]
    for k, (dev, host) in enumerate(ids):
        # the whole scatter's call, checked once, cut into one call per unit
        for u, call, triples in cps.split_by_unit(k, "h2d", cps.copiers[k].plan("h2d", dev, host)):
            js = layout.numbers[k][triples] if layout is not None else np.zeros(0, np.int64)
            calls[u].append(UnitCall(k, call, js, cps.units[u].group))
    return UnitScatter(tuple(needs), tuple(len(pb) - 1 for pb in p_bounds), zero, tuple(tuple(c) for c in calls),
                       tuple(np.asarray(x, np.int64) for x in read_pages), tuple(len(z) for z in zero_real))


class UnitSums:
    """D: the page sums of one reservation's units scattered so far, per group folded
    over the page positions D reads (``us.positions``; the zeroed pages after them in
    each triple's call are not compared).

    ``streams`` None (a CPU copy): each call's sums are in when it returns, so they are
    folded at once. Else (a GPU, or a recording stand-in): each :func:`scatter`'s sums
    are copied into pinned host memory on the current stream right behind its copies,
    and an event recorded after (:meth:`read_back`); they are folded only once that
    event completed, found by asking it (:meth:`settle`, never a wait). Until every
    read-back is folded the comparison is pending (:meth:`ready`), as the whole-request
    GPU landing's is (``Completion.ready``); :meth:`arrays` waits (only for a caller that
    reads the verdict before it is ready)."""

    def __init__(self, us: UnitScatter, streams: Optional[StreamOps] = None):
        self._us, self._streams = us, streams
        self._values = [np.zeros(len(p), np.uint64) for p in us.positions]
        self._batch: List[Tuple[UnitCall, torch.Tensor]] = []  # streams: calls enqueued, not read back yet
        self._pending: List[Tuple[List[UnitCall], torch.Tensor, Any]] = []  # (calls, host sums, event after)

    @property
    def deferred(self) -> bool:
        """Whether sums reach the host behind events (a GPU) rather than in the copy's call."""
        return self._streams is not None

    def add(self, uc: UnitCall, out: torch.Tensor) -> None:
        if self._streams is None:
            self._fold(uc, out)
        else:
            self._batch.append((uc, out))

    def read_back(self) -> Any:
        """Streams: copy the sums of the calls added since the last read-back into one
        pinned host buffer on the current stream (the one the copies were enqueued on,
        so behind them), then record an event there; returns it (None: nothing added)."""
        if not self._batch:
            return None
        assert self._streams is not None
        batch, self._batch = self._batch, []
        sizes = [int(out.numel()) for _, out in batch]
        host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=batch[0][1].is_cuda)
        at = 0
        for (_, out), n in zip(batch, sizes):
            host[at:at + n].copy_(out, non_blocking=True)
            at += n
        event = self._streams.event(blocking=True)  # a reader before ready() sleeps in its wait
        event.record(self._streams.current())
        self._pending.append(([uc for uc, _ in batch], host, event))
        return event

    def settle(self) -> None:
        """Fold the read-backs whose event completed (asks each; never waits)."""
        keep = []
        for entry in self._pending:
            if entry[2].query():
                self._fold_host(entry)
            else:
                keep.append(entry)
        self._pending = keep

    def ready(self) -> bool:
        """Every sum added is folded, or can be without waiting."""
        self.settle()
        return not self._pending and not self._batch

    def arrays(self) -> List[np.ndarray]:
        """Per group, the sum over every call added of its sealed page sums; waits for
        the read-backs not completed yet (none once :meth:`ready` said so)."""
        for entry in self._pending:
            entry[2].synchronize()
            self._fold_host(entry)
        self._pending = []
        return self._values


    def _fold_host(self, entry: Tuple[List[UnitCall], torch.Tensor, Any]) -> None:
        at = 0
        for uc in entry[0]:
            n = uc.call.num_blocks
            self._fold(uc, entry[1][at:at + n])
            at += n

    def _fold(self, uc: UnitCall, out: torch.Tensor) -> None:
        pos = self._us.positions[uc.group]
        n, z = len(pos), self._us.zero_counts[uc.group]
        got = out.numpy().view(np.uint64).reshape(len(uc.js), n + z)[:, :n]  # host memory (a CPU copy, a read-back)
        with np.errstate(over="ignore"):
            self._values[uc.group] += fold_sealed(uc.js, pos, got)


def scatter(staging, offset: int, order: str, us: UnitScatter, units: Sequence[int], summed: bool,
            sums: UnitSums) -> None:
    """Zero and scatter D units ``units`` from D's span (at ``offset`` in the arena) into
    D's KV; with ``summed`` their page sums are added to ``sums``. With the staging's
    ``streams`` the copies are enqueued on the calling thread's current stream, their
    sums read back behind them, and the span held until the event after them completed
    (``ArenaStaging.scattered``). That stream is safe for any thread that calls this (the
    engine's, or a housekeeping one): these pages belong to a request vLLM waits to load,
    and D reports the load finished only after every such event completed, so the
    forward that reads them is enqueued after."""
    cps = staging.span_copiers(order)
    try:
        for u in units:
            starts, lens = us.zero[u]
            if len(starts):
                staging.buffer.index_fill_(0, torch.as_tensor(byte_index(starts, lens)), 0)
            for uc in us.calls[u]:
                copier = cps.copiers[uc.copier]
                if summed:
                    out = torch.empty(uc.call.num_blocks, dtype=torch.int64, device=staging.sums.device)
                    copier.run("h2d", uc.call, out)
                    sums.add(uc, out)
                else:
                    copier.run("h2d", uc.call)
    finally:
        if staging.streams is not None:  # what was enqueued reads the span until this event
            staging.scattered(offset, sums.read_back())
