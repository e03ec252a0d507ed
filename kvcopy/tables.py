"""The tables every backend consumes: static entry tables and the packed per-call runs.

Static, built once per copier and direction (:class:`CopyTables`):

* ``entries``: int64 ``[E, 16]``, one row per copied layer, deduplicated by storage
  within a group (two names for the same bytes are copied once). Columns, in the order
  of ``kernels/block_copy.cuh``'s ``EntryField`` (bytes throughout): src base address,
  dst base address, src block stride, dst block stride, run bytes, runs per page, then
  three nested run dims ``(count, src stride, dst stride)``, outermost first, and one
  zero. A page is ``runs per page`` runs of ``run bytes``, run ``r`` at the offsets its
  digits over the dims give (:class:`kvcopy.layout.PagePairing`, computed here once
  per entry from both sides' layouts): one run per page when both sides order a dense
  page alike, two for KV-first, ``C``-element runs for a head-major page against a
  token-major one. Addresses are ``data_ptr()`` values: host pointers of pinned memory
  are valid on the device under unified addressing.
* ``group_offsets`` int64 ``[G+1]`` and ``group_entries``: group ``g`` copies entries
  ``group_entries[group_offsets[g]:group_offsets[g+1]]``, its layer mask. A layer in no
  group (KV-sharing) has no entry and is never touched.

Per call (:func:`pack_call`), one int64 array so a GPU backend uploads it in one copy:
``[run_offsets (G+1) | item_offsets (G+1) | runs (R x 3)]``. A run is ``(src first
block, dst first block, count)``: consecutive ids on both sides merge into one run, so
a run of adjacent pages moves as one large segment. Item ``i`` is one (entry, run)
pair; ``item_offsets[g+1] - item_offsets[g] = entries(g) * runs(g)``.

Building the call is vectorized numpy over the ids: no Python loop over layers or
blocks, only over groups.
"""
from __future__ import annotations

import array
import ctypes
import itertools
import operator
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .layout import MAX_RUN_DIMS, PageLayout, alignment, pair_pages

ENTRY_FIELDS = 16
(
    SRC_BASE,
    DST_BASE,
    SRC_BLOCK_STRIDE,
    DST_BLOCK_STRIDE,
    RUN_BYTES,
    RUNS_PER_PAGE,
) = range(6)
RUN_DIMS = 6  # first of MAX_RUN_DIMS x (count, src stride, dst stride) columns


@dataclass
class CopyTables:
    """Static description of one direction of a copier."""

    entries: np.ndarray  # int64 [E, 16]
    group_offsets: np.ndarray  # int64 [G+1]
    group_entries: np.ndarray  # int64 [sum]
    src_tensors: List[torch.Tensor]  # per entry (kept alive: the table holds raw addresses)
    dst_tensors: List[torch.Tensor]
    src_block_dims: List[int]
    dst_block_dims: List[int]
    entry_names: List[str]  # a layer name per entry, for messages
    src_device: torch.device
    dst_device: torch.device
    word_bytes: int  # widest word (<= 16) every address, stride and size is aligned to
    group_block_bytes: np.ndarray  # int64 [G]: bytes one block id moves in group g
    max_ctas: Optional[int] = None  # grid cap of the kernel backends (BlockCopier(max_ctas=))
    backend_state: dict = field(default_factory=dict)  # what backends cache per table

    @property
    def num_groups(self) -> int:
        return len(self.group_offsets) - 1

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    def group_entry_ids(self, g: int) -> np.ndarray:
        return self.group_entries[self.group_offsets[g] : self.group_offsets[g + 1]]

    def cta_cap(self) -> Optional[int]:
        """The kernel backends' grid cap: ``max_ctas`` given to the copier, else the
        ``KVCOPY_MAX_CTAS`` environment variable, else None (uncapped)."""
        value, where = self.max_ctas, "max_ctas"
        if value is None:
            env = os.environ.get("KVCOPY_MAX_CTAS", "").strip()
            if not env:
                return None
            value, where = env, "KVCOPY_MAX_CTAS"
        n = 0
        if isinstance(value, str) and value.strip().isdigit():
            n = int(value)
        elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            n = int(value)
        if n < 1:
            raise ValueError(f"{where} must be a positive integer, got {value!r}")
        return n

    def max_run_bytes(self) -> int:
        return int(self.entries[:, RUN_BYTES].max()) if len(self.entries) else 0

    def min_run_bytes(self) -> int:
        return int(self.entries[:, RUN_BYTES].min()) if len(self.entries) else 0

    def page_bytes(self) -> np.ndarray:
        """int64 [E]: bytes one block moves per entry."""
        return self.entries[:, RUN_BYTES] * self.entries[:, RUNS_PER_PAGE]


def build_tables(
    group_entry_lists: Sequence[Sequence[int]],
    src: Sequence[Tuple[torch.Tensor, PageLayout]],
    dst: Sequence[Tuple[torch.Tensor, PageLayout]],
    names: Sequence[str],
) -> CopyTables:
    """Tables for entries ``src[i] -> dst[i]``; group g copies ``group_entry_lists[g]``."""
    rows = []
    for (st, sl), (dt, dl), name in zip(src, dst, names):
        try:
            pair = pair_pages(sl, dl)
        except ValueError as exc:
            raise ValueError(f"layer {name!r}: {exc}") from None
        row = [st.data_ptr(), dt.data_ptr(), sl.block_stride, dl.block_stride,
               pair.run_bytes, pair.runs_per_page]
        for dim in pair.dims:
            row.extend(dim)
        rows.append(row + [0] * (ENTRY_FIELDS - len(row)))
    entries = np.array(rows, dtype=np.int64).reshape(-1, ENTRY_FIELDS)
    offsets = np.zeros(len(group_entry_lists) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(e) for e in group_entry_lists])
    flat = np.array([i for e in group_entry_lists for i in e], dtype=np.int64)
    # The widest word dividing every address, stride and size the item body adds up
    # (counts excluded; trivial dims' zero strides divide by anything).
    sized = [SRC_BASE, DST_BASE, SRC_BLOCK_STRIDE, DST_BLOCK_STRIDE, RUN_BYTES]
    sized += [RUN_DIMS + 3 * k + j for k in range(MAX_RUN_DIMS) for j in (1, 2)]
    word = alignment(*entries[:, sized].ravel().tolist()) if len(entries) else 16
    page_bytes = entries[:, RUN_BYTES] * entries[:, RUNS_PER_PAGE]
    group_bytes = np.array([int(page_bytes[list(e)].sum()) for e in group_entry_lists], dtype=np.int64)
    src_dev = src[0][0].device if src else torch.device("cpu")
    dst_dev = dst[0][0].device if dst else torch.device("cpu")
    return CopyTables(
        entries=entries,
        group_offsets=offsets,
        group_entries=flat,
        src_tensors=[t for t, _ in src],
        dst_tensors=[t for t, _ in dst],
        src_block_dims=[l.block_dim for _, l in src],
        dst_block_dims=[l.block_dim for _, l in dst],
        entry_names=list(names),
        src_device=src_dev,
        dst_device=dst_dev,
        word_bytes=word,
        group_block_bytes=group_bytes,
    )


@dataclass
class CallPlan:
    """One call's validated ids and their packed runs.

    ``src_flat``/``dst_flat`` hold every group's ids concatenated (group ``g`` has
    ``group_lens[g]``); ``packed`` is the kernels' call array.
    """

    src_flat: Sequence[int]  # int64 buffer (numpy array or array.array)
    dst_flat: Sequence[int]
    group_lens: Sequence[int]  # [G]
    packed: np.ndarray  # int64 [run_offsets | item_offsets | runs]
    packed_address: int  # address of packed[0], for C launchers
    num_groups: int
    total_bytes: int
    # Words of the block prefix (runs + 1) the native planner wrote right after
    # ``packed`` in the same buffer (the `cuda` call array is then
    # ``packed_address``, ``len(packed) + prefix_words`` words); 0 when not written.
    prefix_words: int = 0
    # The copier direction that planned this call (``BlockCopier.plan``), so that
    # ``BlockCopier.run`` takes only its own plans; None for a plan made elsewhere.
    made_by: object = field(default=None, repr=False, compare=False)

    @property
    def num_runs(self) -> int:
        return int(self.packed[self.num_groups])

    @property
    def num_items(self) -> int:
        return int(self.packed[2 * self.num_groups + 1])

    @property
    def src_ids(self) -> List[np.ndarray]:
        """Per-group source ids (numpy views)."""
        return self._split(self.src_flat)

    @property
    def dst_ids(self) -> List[np.ndarray]:
        return self._split(self.dst_flat)

    def _split(self, flat) -> List[np.ndarray]:
        arr = np.asarray(flat, dtype=np.int64)
        return np.split(arr, np.cumsum(np.asarray(self.group_lens, dtype=np.int64))[:-1])

    def run_offsets(self) -> np.ndarray:
        return self.packed[: self.num_groups + 1]

    def item_offsets(self) -> np.ndarray:
        return self.packed[self.num_groups + 1 : 2 * (self.num_groups + 1)]

    def runs(self) -> np.ndarray:
        return self.packed[2 * (self.num_groups + 1) :].reshape(-1, 3)


def merge_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """``[R, 3]`` runs (src start, dst start, count) of ids consecutive on both sides."""
    n = len(src)
    if n == 0:
        return np.empty((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [n])))
    return np.stack((src[starts], dst[starts], counts), axis=1)


def pack_call(tables: CopyTables, src_ids: List[np.ndarray], dst_ids: List[np.ndarray]) -> CallPlan:
    """Pack validated per-group ids into the kernels' call array (numpy; the native
    :class:`CallPlanner` does validation and packing in one C pass)."""
    g_count = tables.num_groups
    runs = [merge_runs(s, d) for s, d in zip(src_ids, dst_ids)]
    run_counts = np.array([len(r) for r in runs], dtype=np.int64)
    entry_counts = np.diff(tables.group_offsets)
    header = np.zeros(2 * (g_count + 1), dtype=np.int64)
    np.cumsum(run_counts, out=header[1 : g_count + 1])
    np.cumsum(entry_counts * run_counts, out=header[g_count + 2 :])
    packed = np.concatenate([header] + [r.ravel() for r in runs]) if runs else header
    lens = np.array([len(x) for x in src_ids], dtype=np.int64)
    empty = np.empty(0, dtype=np.int64)
    packed = np.ascontiguousarray(packed, dtype=np.int64)
    return CallPlan(
        src_flat=np.concatenate(src_ids) if g_count else empty,
        dst_flat=np.concatenate(dst_ids) if g_count else empty,
        group_lens=lens,
        packed=packed,
        packed_address=packed.ctypes.data,
        num_groups=g_count,
        total_bytes=int(np.dot(tables.group_block_bytes, lens)) if g_count else 0,
    )


class CallPlanner:
    """Validates and packs a call in one native pass (``csrc/call_plan.cpp``).

    ``src_limit``/``dst_limit``: per group, ids must lie in ``[0, limit)``;
    ``dst_class``: per group, groups of one class write shared destination bytes and
    must use disjoint ids. :meth:`plan` returns None when the ids are invalid or not
    plain lists/arrays of integers: the caller then runs the numpy path, which raises
    the detailed error. Not thread-safe: one planner per copier direction.
    """

    def __init__(self, fn, tables: CopyTables, src_limit, dst_limit, dst_class, prefix: bool = False):
        self._fn = fn
        self._prefix = bool(prefix)  # fn is kvcopy_plan_call_prefix: room for the prefix
        self._tables = tables
        self._g = tables.num_groups
        self._src_limit = np.asarray(src_limit, dtype=np.int64)
        self._dst_limit = np.asarray(dst_limit, dtype=np.int64)
        self._dst_class = np.asarray(dst_class, dtype=np.int64)
        self._entries_per_group = np.diff(tables.group_offsets).astype(np.int64)
        self._capacity = int(self._dst_limit.max()) if self._g else 0
        classes = int(self._dst_class.max()) + 1 if self._g else 0
        self._seen = np.zeros(classes * max(self._capacity, 1), dtype=np.int64)
        self._stamp = 0
        self._err = np.zeros(3, dtype=np.int64)
        self._group_bytes = tables.group_block_bytes.tolist()
        self._err_address = ctypes.c_void_p(self._err.ctypes.data)
        # Constant arguments converted to ctypes once (~0.1 us each per call saved).
        self._static = [ctypes.c_void_p(a.ctypes.data) for a in (
            self._src_limit, self._dst_limit, self._dst_class, self._entries_per_group, self._seen)]
        self._g_arg = ctypes.c_int64(self._g)
        self._capacity_arg = ctypes.c_int64(self._capacity)

    def plan(self, src_ids, dst_ids) -> Optional[CallPlan]:
        # Plain lists/tuples of ints only; anything else takes the numpy path. Buffers
        # are array.array: their addresses cost a fraction of numpy's .ctypes (~2 us).
        g = self._g
        same = dst_ids is src_ids  # to_host(ids)/to_device(ids): one id list for both sides
        for x in (src_ids if same else itertools.chain(src_ids, dst_ids)):
            if type(x) not in _PLAIN or _may_hold_bools(x):  # the numpy path refuses bools
                return None
        lens = array.array("q", map(len, src_ids))
        if not same and array.array("q", map(len, dst_ids)) != lens:
            return None
        try:
            src = array.array("q", itertools.chain.from_iterable(src_ids))
            dst = src if same else array.array("q", itertools.chain.from_iterable(dst_ids))
        except (TypeError, OverflowError):
            return None
        n_ids = len(src)
        packed = array.array("q", bytes(8 * (2 * (g + 1) + (4 * n_ids + 1 if self._prefix else 3 * n_ids))))
        self._stamp += 1
        lim_s, lim_d, cls, epg, seen = self._static
        address = packed.buffer_info()[0]
        src_address = src.buffer_info()[0]
        n = self._fn(self._g_arg, src_address, src_address if same else dst.buffer_info()[0],
                     lens.buffer_info()[0], lim_s, lim_d, cls, epg, seen, self._capacity_arg, self._stamp,
                     address, self._err_address)
        if n < 0:
            return None
        return CallPlan(
            src_flat=src,
            dst_flat=dst,
            group_lens=lens,
            packed=np.frombuffer(packed, dtype=np.int64, count=n),
            packed_address=address,
            num_groups=g,
            total_bytes=sum(map(operator.mul, self._group_bytes, lens)),
            prefix_words=packed[g] + 1 if self._prefix else 0,
        )


_PLAIN = (list, tuple)
_INT_ONLY = frozenset((int,))


def _may_hold_bools(ids) -> bool:
    """Whether a list of ids holds a Python bool (``array('q')`` would take it as 0/1).
    ``in`` is a C loop comparing by identity, then value (~5 ns per id); the type scan
    (~30-60 ns per id) runs only for lists holding a 0 or 1."""
    return (True in ids or False in ids) and not _INT_ONLY.issuperset(map(type, ids))
