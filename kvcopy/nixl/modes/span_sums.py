"""Page sums of arena spans: what P's pack records and what D's scatter must reproduce.

Both copies of a staged request compute page checksums while they move the bytes
(:mod:`kvcopy.core.checksum`): P's pack (one d2h call per span copier) and D's scatter (one
h2d call per span copier). A span copier's groups are (unit, chunk, head slab) triples
(:mod:`kvcopy.nixl.modes.span_copiers`) with one layer view each, so its sum of block
``(triple j, i)`` covers that triple's slab of one page, keyed by the byte positions
inside the staged block: the same bytes staged on both sides sum alike.

Data layout
-----------
Per copier, the sums tensor is int64 ``[call.num_blocks]``: the copier's triples in
its order, each with its pages in call order (P: the page positions P holds; D: the
positions D reads, then the pages D zeroes from the zero granule, never compared).
Folded per KV cache group ``g`` and page position ``k`` (uint64, mod 2^64)::

    value[g][k] = SUM over triples j of group g of  seal(sum[j, k], position = J(j) * 2^40 + k)

``J`` numbers every triple of the engine (by unit, then slab), and :func:`kvcopy.core.checksum.seal`
binds a sum to it and to the page position, so layers, chunks or head slabs that trade
places, or pages that do, change the values. One value per (group, page position): a
record carries ``ceil(tokens / tokens per page)`` values per group (8 bytes each, as
hex), whatever the number of layers.

When D compares (:func:`scatter_check`; everything else counts the request *unchecked*)
----------------------------------------------------------------------------------
Only identically staged pages: the record carries P's sums and their layout
fingerprint (:class:`SumLayout`: the order, tokens per page per group, the units, each
copier's key (block bytes, element size, in-page geometry) and run bytes), which must
equal D's for the record's order; one peer; P's page counts equal D's; and the READ
moves every byte to the same offset in D's span as in P's (its rows, span-relative, are
the same on both sides), with no row zeroed in D's span. Then D's block ``(j, k)``
holds exactly P's block ``(j, k)`` after a correct READ, and D compares every page
position it reads. Pages D does not read (prefix hits, holes) and pages it zeroes are
not compared: no byte of them crossed. Different page sizes, TP slices, group plans or
in-page layouts fail the fingerprint or the row test: such requests are unchecked.

Cost: P and D each fold ``blocks`` sums on the host (two ``mix64`` per block), and on
CUDA one device-to-host copy of the sums (:class:`~kvcopy.nixl.sum_check.Readback`).
After a 6 MiB copy has swept the caches each torch or numpy call costs 15-20x its warm
time, so on CPU the path after the copy makes as few as it can: the sums tensors of a
call shape are made once and reused (D compares before ``complete`` returns, P folds
before ``save`` returns), and with one span copier on the ``cpu`` backend the fold (P)
and the fold and comparison (D) run inside the copy's own C call
(:class:`~kvcopy.core.checksum.SumFold`, ``kvcopy_cpu_copy_sums_fold``); otherwise one call
of the host library's ``kvcopy_fold_page_sums`` after it (numpy without the library).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ... import native
from ...core.checksum import POSITION_MUL, SumFold, address_of, fold_segments, mix64
from ...core.copier import CallPlan
from ...core.tables import RUN_BYTES
from ..wire.record import LAYOUT_HEX, PageSums, StagedRequest
from .span_copiers import SpanCopiers
from ..sum_check import PendingResult, Readback, SumCheck, SumStats, mismatch_message

SUM_LAYOUT_VERSION = "kvcopy-span-sums:v2"  # v2: the page sums' word term is product_term
POSITION_BITS = 40  # page positions stay below 2^40 (tokens are bounded by 2^40)
FOLDS_KEPT = 64  # index plans of fold() kept per layout (one per distinct set of page positions)


class SumLayout:
    """How one side's span copiers sum a staging order's pages: each triple's number
    ``J``, and the fingerprint that both sides compute alike exactly when their staged
    pages are the same bytes at the same places."""

    def __init__(self, cps: SpanCopiers, tokens_per_page: Sequence[int], order: str, direction: str):
        triples = sorted({(u, s) for _, unit, _, slab, _ in cps.index for u, s in zip(unit.tolist(), slab.tolist())})
        number = {t: j for j, t in enumerate(triples)}
        self.numbers: List[np.ndarray] = []  # per copier: J per copier group
        self.groups: List[np.ndarray] = []  # per copier: KV cache group per copier group
        self.by_group: List[list] = []  # per copier: (group, its copier groups)
        copiers = []
        for (_, unit, group, slab, by_group), copier, key in zip(cps.index, cps.copiers, cps.keys):
            js = np.array([number[t] for t in zip(unit.tolist(), slab.tolist())], np.int64)
            tables = copier.tables(direction)
            runs = [int(tables.entries[tables.group_entry_ids(j), RUN_BYTES].max()) for j in range(len(js))]
            self.numbers.append(js)
            self.groups.append(group)
            self.by_group.append(by_group)
            copiers.append([key, js.tolist(), runs])
        units = [[list(u.layers), u.group, u.num_chunks, u.chunk_bytes, u.heads, u.outer, u.block_bytes]
                 for u in cps.units]
        desc = {"version": SUM_LAYOUT_VERSION, "order": order, "tokens_per_page": [int(t) for t in tokens_per_page],
                "units": units, "copiers": copiers}
        text = json.dumps(desc, sort_keys=True, separators=(",", ":")).encode()
        self.fingerprint = hashlib.sha256(text).hexdigest()[:LAYOUT_HEX]
        self._folds: Dict[tuple, FoldPlan] = {}  # fold()'s index plans by page positions

    def fold_plan(self, positions: Sequence[np.ndarray], zero_counts: Optional[Sequence[int]] = None) -> "FoldPlan":
        """:meth:`fold`'s index plan for these page positions (cached: one per distinct
        set of positions, :data:`FOLDS_KEPT` kept)."""
        zeros = tuple(int(z) for z in zero_counts) if zero_counts is not None else (0,) * len(positions)
        pos = [np.asarray(p, np.int64) for p in positions]
        key = (tuple(p.tobytes() for p in pos), zeros)
        plan = self._folds.get(key)
        if plan is None:
            plan = self._fold_plan(pos, zeros)
            if len(self._folds) >= FOLDS_KEPT:
                self._folds.pop(next(iter(self._folds)))
            self._folds[key] = plan
        return plan

    def fold(self, arrays: Sequence[np.ndarray], positions: Sequence[np.ndarray],
             zero_counts: Optional[Sequence[int]] = None) -> List[np.ndarray]:
        """Per group, the folded value of each page position in ``positions[g]`` (see
        the module docstring); ``arrays``: the copiers' sums (uint64), each triple's
        ``len(positions[g])`` pages followed by ``zero_counts[g]`` pages not folded."""
        plan = self.fold_plan(positions, zero_counts)
        return plan.per_group(plan.values(arrays))

    def _fold_plan(self, pos: List[np.ndarray], zeros: Tuple[int, ...]) -> "FoldPlan":
        """fold()'s index plan: (each copier's number of sums; the indices, into all
        copiers' sums end to end, of the sums folded, ordered by (group, position);
        their seal bounds ``mix64(((J << 40) + position) * POSITION_MUL)``; where each
        (group, position)'s sums start; per group, its values' slice of the sums'
        result and whether any triple of the group has sums)."""
        reads = np.array([len(p) for p in pos], np.int64)
        sizes, base = [], 0
        per_group: List[List[Tuple[np.ndarray, np.ndarray]]] = [[] for _ in pos]  # (indices, J) blocks
        for js, group, by_group in zip(self.numbers, self.groups, self.by_group):
            per = reads[group] + np.asarray(zeros, np.int64)[group]
            starts = np.cumsum(per) - per + base
            for g, at in by_group:
                n = int(reads[g])
                if n:  # [n positions, len(at) triples]
                    per_group[g].append((starts[at][None, :] + np.arange(n)[:, None], js[at]))
            size = int(per.sum())
            sizes.append(size)
            base += size
        gather: List[np.ndarray] = []
        bounds: List[np.ndarray] = []
        value_starts: List[np.ndarray] = []
        spans: List[Tuple[int, int, bool]] = []
        done = gathered = 0
        for g, blocks in enumerate(per_group):
            n = int(reads[g])
            if not blocks:  # no triple of this group: its values are 0
                spans.append((done, done + n, False))
                continue
            idx = np.concatenate([b for b, _ in blocks], axis=1)  # [n, triples of g]
            js = np.concatenate([j for _, j in blocks])
            sealed_at = (js[None, :] << POSITION_BITS) + pos[g][:, None]
            gather.append(idx.ravel())
            bounds.append(seal_bounds(sealed_at.ravel()))
            value_starts.append(gathered + idx.shape[1] * np.arange(n, dtype=np.int64))
            spans.append((done, done + n, True))  # groups with no triple take no slot
            done += n
            gathered += idx.size
        g, b, v = (_read_only(_joined(gather, np.int64)), _read_only(_joined(bounds, np.uint64)),
                   _read_only(_joined(value_starts, np.int64)))
        fold = SumFold(g, b, v, np.zeros(len(v), np.uint64)) if len(sizes) == 1 else None
        return FoldPlan(tuple(sizes), g, b, v, tuple(spans), (address_of(g), address_of(b), address_of(v)), fold)


class FoldPlan(NamedTuple):
    """How :meth:`SumLayout.fold` folds the sums of one set of page positions (arrays
    read-only in use: made once, shared by every request with those positions)."""

    sizes: Tuple[int, ...]  # each copier's number of sums
    gather: np.ndarray  # indices, into all copiers' sums end to end, ordered by (group, position)
    bounds: np.ndarray  # their seal bounds mix64(((J << 40) + position) * POSITION_MUL)
    starts: np.ndarray  # where each (group, position)'s sums start in the gathered ones
    spans: Tuple[Tuple[int, int, bool], ...]  # per group: its slice of the values, and whether it has sums
    # The addresses of gather, bounds and starts for kvcopy_fold_page_sums: derived, kept
    # so the call after a copy reads no array interface (made by SumLayout._fold_plan alone).
    at: Tuple[int, int, int]
    # The same fold for the copy's own host call, wanting zeros (one copier only; else None):
    # each request's check takes it with that request's values (SumFold.wanting).
    fold: Optional[SumFold]

    def values(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """The folded values of the groups with sums, end to end (group, then position):
        one call of the host library's ``kvcopy_fold_page_sums``, or :meth:`numpy_values`
        without the library."""
        x = self._joined(arrays)
        out = np.empty(len(self.starts), np.uint64)
        if self._fold(x, address_of(out), 0) is None:
            return self.numpy_values(arrays)
        return out

    def differs(self, arrays: Sequence[np.ndarray], want: np.ndarray, want_at: int) -> bool:
        """Whether :meth:`values` differs from ``want`` (at address ``want_at``; ``len(starts)``
        values), in one call of the host library where it is there: D's comparison
        after the scatter where the scatter's own call could not fold (several copiers,
        a backend other than ``cpu``). ~14 numpy calls cost 60-100 us there, once the
        scatter had swept the caches, against 45-55 us for one ctypes call (scratch
        timings of a 6 MiB ``complete`` on a 2-core Xeon VM, not saved)."""
        x = self._joined(arrays)
        differ = self._fold(x, 0, want_at)
        if differ is None:
            return not bool((self.numpy_values(arrays) == want).all())
        return differ > 0

    def _joined(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        if len(arrays) != len(self.sizes):
            raise ValueError(f"sums of {len(arrays)} copiers for a layout of {len(self.sizes)}")
        for out, size in zip(arrays, self.sizes):
            if len(out) != size:
                raise ValueError(f"sums of {len(out)} blocks for a call of {size}")
        x = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        if x.dtype != np.uint64 or not x.flags.c_contiguous:
            raise ValueError(f"page sums must be contiguous uint64, got {x.dtype}")
        return x

    def _fold(self, x: np.ndarray, values_at: int, want_at: int) -> Optional[int]:
        """kvcopy_fold_page_sums: the count of values differing from ``want`` (0 when
        not compared); None without the host library."""
        fold = _fold_function()
        if fold is None:
            return None
        g, b, v = self.at
        plan = native.Fold.make(gather=g, bounds=b, num_gather=len(self.gather), starts=v,
                                num_values=len(self.starts), values=values_at, want=want_at)
        differ = fold(address_of(x), len(x), ctypes.addressof(plan))
        if differ < 0:  # the plan's own indices: never out of range
            raise RuntimeError("kvcopy_fold_page_sums: a fold plan index out of range")
        return differ

    def numpy_values(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """:meth:`values` in numpy (the oracle of the host library's fold, and its
        stand-in without it): :func:`kvcopy.core.checksum.fold_segments` over every
        copier's sums at once, ~15 numpy calls whatever the copiers and groups."""
        return fold_segments(self._joined(arrays), self.gather, self.bounds, self.starts)

    def per_group(self, values: np.ndarray) -> List[np.ndarray]:
        """:meth:`values` cut per group; a group with no triple folds to zeros."""
        return [values[a:b] if summed else np.zeros(b - a, np.uint64) for a, b, summed in self.spans]


_FOLD: List[Any] = []  # [the ctypes function, or None], loaded on first use


def _fold_function():
    """The host library's ``kvcopy_fold_page_sums``, or None without the library."""
    if not _FOLD:
        lib, _ = native.load("kvcopy_cpu")
        fn = None
        if lib is not None:
            fn = lib.kvcopy_fold_page_sums
        _FOLD.append(fn)
    return _FOLD[0]


def _joined(parts: List[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def seal_bounds(positions: np.ndarray) -> np.ndarray:
    """``mix64(position * POSITION_MUL)``: :func:`kvcopy.core.checksum.seal`'s bound with seed 0,
    so ``mix64(sum ^ bound)`` is ``seal(sum, 0, position)``."""
    with np.errstate(over="ignore"):
        return mix64(positions.astype(np.uint64) * np.uint64(POSITION_MUL))


def fold_sealed(js: np.ndarray, positions: np.ndarray, sums: np.ndarray) -> np.ndarray:
    """One call's page sums (``sums[t, i]``: triple ``js[t]``'s page at ``positions[i]``)
    sealed at their places and summed over the triples: per position, the call's share
    of the fold (a sum over triples, so calls fold unit by unit to the whole's values)."""
    sealed_at = (np.asarray(js, np.int64)[:, None] << POSITION_BITS) + positions[None, :]
    with np.errstate(over="ignore"):
        sealed = mix64(sums ^ seal_bounds(sealed_at.ravel()).reshape(sums.shape))
        return sealed.sum(axis=0, dtype=np.uint64)


# ---------------------------------------------------------------- P
def page_sums(layout: SumLayout, arrays: Sequence[np.ndarray], positions: Sequence[np.ndarray],
              counts: Sequence[int], folded: Optional[Tuple[FoldPlan, np.ndarray]] = None) -> PageSums:
    """The record's sums: per group one value per page position (0 for a hole);
    ``folded``: the fold plan for ``positions`` and its values, where the copy's call
    made them already (no plan looked up after the copy)."""
    plan, made = folded if folded is not None else (layout.fold_plan(positions), None)
    values = []
    for g, v in enumerate(plan.per_group(plan.values(arrays) if made is None else made)):
        if len(positions[g]) != counts[g]:  # holes (sorted distinct positions, fewer than counts[g])
            v, held = np.zeros(counts[g], np.uint64), v
            v[np.asarray(positions[g], np.int64)] = held
        values.append(v)
    return PageSums.of(layout.fingerprint, values)


class PendingRecord(PendingResult):
    """P's record while its sums are on their way from the GPU (``save(wait=False)`` on
    CUDA with checksums): :meth:`ready` never waits; :meth:`result` waits for the pack
    if it has not ended, and gives the :class:`~kvcopy.nixl.wire.record.StagedRequest`."""

    def __init__(self, record: StagedRequest, readback: Readback, layout: SumLayout,
                 positions: Sequence[np.ndarray], counts: Sequence[int],
                 folded: Optional[Tuple[FoldPlan, np.ndarray]] = None):
        self._record = record
        self._readback = readback
        self._layout = layout
        self._positions = positions
        self._counts = counts
        self._folded = folded
        self._done: Optional[StagedRequest] = None

    @property
    def request_id(self) -> str:
        return self._record.request_id

    def ready(self) -> bool:
        return self._done is not None or self._readback.ready()

    def result(self) -> StagedRequest:
        if self._done is None:
            sums = page_sums(self._layout, self._readback.arrays(), self._positions, self._counts, self._folded)
            self._done = self._record.with_sums(sums)
        return self._done

    def __repr__(self) -> str:
        return f"PendingRecord({self.request_id!r}, ready={self.ready()})"


# ---------------------------------------------------------------- D
class ScatterCheck(NamedTuple):
    """What D's scatter of one request is compared with, made when it is planned from
    the record the manager parsed (arrays read-only, never handed out)."""

    layout: SumLayout
    positions: Tuple[np.ndarray, ...]  # per group: the page positions D reads
    zero_counts: Tuple[int, ...]  # per group: the pages the scatter zeroes after them
    expected: Tuple[np.ndarray, ...]  # per group: P's value at each of those positions
    local_pages: Tuple[Tuple[int, ...], ...]  # per group: D's page for each (to name it)
    plan: FoldPlan  # the layout's fold plan for these positions
    want: Optional[np.ndarray]  # plan.values() of a match, or None where no fold can match
    want_at: int  # want's address (0 when None)
    fold: Optional[SumFold]  # plan and want for the copy's own host call (one copier), else None

    def compare(self, arrays: Sequence[np.ndarray]) -> Optional[str]:
        """None if every page D read sums as P's did, else the message naming those
        that differ: the comparison after the scatter, where its own call could not
        fold (:attr:`fold` None, or a backend other than ``cpu``). A match is one call
        (:meth:`FoldPlan.differs`): this runs right after the scatter swept the caches,
        where every numpy call costs; only a mismatch folds per group to name the pages."""
        if self.want is not None and not self.plan.differs(arrays, self.want, self.want_at):
            return None
        return self.differences(arrays) if self.want is None else self.named(arrays)

    def named(self, arrays: Sequence[np.ndarray]) -> str:
        """The message for sums a comparison found different: :meth:`differences`, or,
        should the fold that names pages find none (it folds the same sums, so only a
        bug could make it), a mismatch all the same: a request is failed, never used,
        when a comparison said its bytes changed."""
        return self.differences(arrays) or UNNAMED

    def differences(self, arrays: Sequence[np.ndarray]) -> Optional[str]:
        """The message naming the pages whose values differ from P's (None if none do):
        a fold per group, made once a comparison has found a difference."""
        got = self.plan.per_group(self.plan.values(arrays))
        bad = [(g, int(self.positions[g][i]), self.local_pages[g][i])
               for g in range(len(got)) for i in np.flatnonzero(got[g] != self.expected[g]).tolist()]
        return mismatch_message(bad) if bad else None


UNNAMED = "checksum mismatch: the bytes D received differ from those P staged (the pages could not be named)"
UNLIKE = "P's staged pages are not D's (page sizes, TP slices, group plans or in-page layouts differ)"


def scatter_check(layout: SumLayout, record: StagedRequest, same_counts: bool,
                  reads: Dict[str, Tuple[np.ndarray, np.ndarray]], zeroed_rows: int,
                  positions: Sequence[Sequence[int]], zero_counts: Sequence[int],
                  local_pages: Sequence[Sequence[int]]) -> Tuple[Optional[ScatterCheck], Optional[str]]:
    """(the check, None), or (None, why D cannot compare) for one request (see the
    module docstring). ``reads``: per peer, the READ rows relative to each span's start;
    ``same_counts``: P's page counts per group equal D's. A record whose sums do not
    have one value per page position raises ``ValueError``."""
    sums = record.sums
    if sums is None:
        return None, "P sent no page sums (checksum off on P)"
    if sums.layout != layout.fingerprint or not same_counts:
        return None, UNLIKE
    if len(reads) != 1:
        return None, "D reads this request from several peers"
    (lrel, rrel), = reads.values()
    if lrel.shape != rrel.shape or not np.array_equal(lrel[:, :2], rrel[:, :2]):
        return None, UNLIKE
    if zeroed_rows:
        return None, "rows past the prompt are zeroed in D's span"
    if not any(len(p) for p in positions):
        return None, "D reads no page of this request (all cached)"
    if len(sums.pages) != len(positions):
        raise ValueError(f"record of {record.engine!r}: sums for {len(sums.pages)} groups, D has {len(positions)}")
    expected = []
    for g, given in enumerate(positions):
        values = sums.values(g)
        pos = np.array(given, np.int64)  # a copy, read-only below
        if len(pos) and pos.max() >= len(values):
            raise ValueError(f"record of {record.engine!r}, group {g}: {len(values)} page sums, D reads page "
                             f"position {int(pos.max())}")
        e = values[pos]
        e.setflags(write=False)
        pos.setflags(write=False)
        expected.append((pos, e))
    plan = layout.fold_plan([p for p, _ in expected], zero_counts)
    want = matching_values(plan, [e for _, e in expected])
    return ScatterCheck(layout, tuple(p for p, _ in expected), tuple(int(z) for z in zero_counts),
                        tuple(e for _, e in expected), tuple(tuple(p) for p in local_pages), plan,
                        want, 0 if want is None else address_of(want), scatter_fold(plan, want)), None


def scatter_fold(plan: FoldPlan, want: Optional[np.ndarray]) -> Optional[SumFold]:
    """The :class:`~kvcopy.core.checksum.SumFold` a one-copier scatter's call compares with
    (``plan``'s gather, bounds and starts, ``want``), or None: several copiers (their
    sums are joined first), or no value can match."""
    if want is None or plan.fold is None:
        return None
    return plan.fold.wanting(want)


def matching_values(plan: FoldPlan, expected: Sequence[np.ndarray]) -> Optional[np.ndarray]:
    """What ``plan.values()`` gives when every page matches ``expected`` (per group),
    read-only; None when nothing can match: a group with no triple on D folds to zeros,
    so P's values there must be zero too."""
    if any(e.any() for e, (_, _, summed) in zip(expected, plan.spans) if not summed):
        return None
    return _read_only(np.concatenate([np.zeros(0, np.uint64)] + [np.asarray(e, np.uint64) for e, (_, _, summed)
                                                                 in zip(expected, plan.spans) if summed]))


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


# ---------------------------------------------------------------- one arena's sums
class ArenaSums:
    """One arena's page sums: on or off, each (order, direction)'s :class:`SumLayout`
    (built on first use, with the copiers), and the counts of compared requests."""

    def __init__(self, on: bool, device: torch.device):
        self.on = bool(on)
        self.device = device
        self._on_cuda = device.type == "cuda"  # a bool: torch.device.type took 15-20 us cold after a copy
        self.stats = SumStats()
        self._layouts: Dict[Tuple[str, str], SumLayout] = {}
        # CPU: the sums tensors of each call shape and their host arrays, made once and
        # reused (P folds them before save returns; D compares them before complete
        # returns). Right after a copy has swept the caches, making them per request took
        # 100-130 us of a 6 MiB complete (two tensors and their numpy views; 3 us each
        # with warm caches; scratch timing on a 2-core Xeon VM, not saved).
        self._outs: Dict[Tuple[int, ...], Tuple[List[torch.Tensor], Readback]] = {}

    def layout(self, cps: SpanCopiers, order: str, tokens_per_page: Sequence[int], direction: str) -> SumLayout:
        key = (order, direction)
        found = self._layouts.get(key)
        if found is None:
            if self.on:  # a backend that cannot sum (ce) refuses here, before any request
                for copier in cps.copiers:
                    empty = copier.plan(direction, [[] for _ in copier.layer_groups])
                    copier.run(direction, empty, torch.empty(0, dtype=torch.int64, device=self.device))
            found = self._layouts[key] = SumLayout(cps, tokens_per_page, order, direction)
        return found

    # P
    def pack(self, cps: SpanCopiers, calls: Sequence[CallPlan], layout: SumLayout, positions: Sequence[np.ndarray]
             ) -> Optional[Tuple[List[torch.Tensor], Optional[Readback], Optional[Tuple[FoldPlan, np.ndarray]]]]:
        """Run P's pack; its sums tensors, (CPU) their host arrays, and the values folded
        in the copy's own host call where it could (one copier on ``cpu``); None when off."""
        if not self.on:
            cps.run("d2h", calls)
            return None
        outs, host = self._sums_outs(calls)
        if host is not None:
            plan = layout.fold_plan(positions)
            fold = plan.fold
            if fold is not None and plan.sizes[0] == calls[0].num_blocks:  # else page_sums refuses the sizes
                fold = fold.collecting()
                if cps.run_and_fold("d2h", calls, outs, fold) is not None and fold.values is not None:
                    return outs, host, (plan, fold.values)
                return outs, host, None
        cps.run("d2h", calls, outs)
        return outs, host, None

    def _sums_outs(self, calls: Sequence[CallPlan]) -> Tuple[List[torch.Tensor], Optional[Readback]]:
        """Sums tensors for ``calls``: on CUDA new ones (read back later), on CPU the
        ones of this call shape, reused, with their host arrays."""
        if self._on_cuda:
            return [torch.empty(c.num_blocks, dtype=torch.int64, device=self.device) for c in calls], None
        sizes = tuple(c.num_blocks for c in calls)
        found = self._outs.get(sizes)
        if found is None:
            outs = [torch.empty(n, dtype=torch.int64, device=self.device) for n in sizes]
            if len(self._outs) >= FOLDS_KEPT:
                self._outs.pop(next(iter(self._outs)))
            found = self._outs[sizes] = (outs, Readback(outs))
        return found

    def record(self, record: StagedRequest, layout: SumLayout,
               sums: Optional[Tuple[List[torch.Tensor], Optional[Readback], Optional[Tuple[FoldPlan, np.ndarray]]]],
               positions: Sequence[np.ndarray], counts: Sequence[int]):
        """``record`` with P's sums (``pack``'s), or a :class:`PendingRecord` while they
        are on a GPU. On CPU folded now (if the copy's call did not): the next call
        reuses the tensors."""
        if sums is None:
            return record
        outs, host, folded = sums
        pending = PendingRecord(record, host or Readback(outs), layout, positions, counts, folded)
        return pending if host is None else pending.result()

    # D
    def check(self, layout: Optional[SumLayout], records: Sequence[StagedRequest], same_counts: bool,
              reads: Dict[str, Tuple[np.ndarray, np.ndarray]], zeroed_rows: int, positions: Sequence[Sequence[int]],
              zero_counts: Sequence[int], local_pages: Sequence[Sequence[int]]):
        """(check, None) or (None, why not): :func:`scatter_check` when sums are on."""
        if layout is None:
            return None, "checksum off on D"
        if len(records) != 1:
            return None, "D reads this request from several peers"
        return scatter_check(layout, records[0], same_counts, reads, zeroed_rows, positions, zero_counts, local_pages)

    def scatter(self, cps: SpanCopiers, calls: Sequence[CallPlan], check: Optional[ScatterCheck],
                ) -> Optional[SumCheck]:
        """Run D's scatter, with sums where ``check`` compares them; on CPU compared
        before this returns (the sums tensors are reused by the next call)."""
        if check is None:
            cps.run("h2d", calls)
            self.stats.unchecked()
            return None
        outs, host = self._sums_outs(calls)
        if host is not None and check.fold is not None and check.plan.sizes[0] == calls[0].num_blocks:
            differ = cps.run_and_fold("h2d", calls, outs, check.fold)
            if differ is not None:  # compared in the copy's call: only a mismatch folds again, to name pages
                return SumCheck.made(check.named(host.arrays()) if differ else None, self.stats)
        else:
            cps.run("h2d", calls, outs)
        result = SumCheck(host or Readback(outs), check.compare, self.stats)
        if host is not None:
            result.result()
        return result
