"""Fused staging copy in Triton: every layer of every KV cache group in one launch.

This is the Triton twin of ``kernels/block_copy.cuh``: the same tables, the same item
and segment arithmetic, one ``tl.load``/``tl.store`` pair per tile of integer words.

Data layout (built by :mod:`kvcopy.core.tables`, uploaded once per copier direction)
-----------------------------------------------------------------------------
``entries``        int64 ``[E, 20]``: src base, dst base, src/dst block stride, run
                   bytes, runs per page, three page-run dims (count, src stride, dst
                   stride), outermost first, then (columns 16-18) the dims' key strides
                   for checksums (bytes; see ``kvcopy.core.tables``). Base addresses
                   are raw ``data_ptr()`` values: device memory, or pinned host memory
                   read and written by the SMs over unified addressing. The kernel
                   casts them with ``.to(tl.pointer_type(...))``.
``group_offsets``  int64 ``[G+1]``, ``group_entries`` int64: group ``g``'s entries.
``call``           int64, per call: ``[run_offsets (G+1) | item_offsets (G+1) |
                   runs (R x 3)]``; item ``i`` = (entry, run), entry-major per group.

Work decomposition and grid mapping
-----------------------------------
An item is ``segments`` byte ranges contiguous on both sides (one per page run of a
merged block run, one per (block, page run) otherwise; ``Item::segment`` in the
header). A page run's offsets on both sides come from its digits over the entry's
three dims (int32 divisions per row), so a layout-converting copy (C-byte runs of a
head-major page against a token-major one) is the same loop. The dims are read from
the entry row each step (L1 hits) rather than kept per worker: kept, they pushed
ptxas from 8 to 16 bytes of stack at 128 registers (sm_90). Each segment
is cut into **rows** of at most ``ROW_BYTES`` bytes, so item ``i`` has
``rows(i) = segments(i) * ceil(segment_bytes(i) / ROW_BYTES)`` rows, and the call is
one flat row space of ``T = sum rows(i)`` rows.

The grid is persistent: ``P`` programs (``P <= max_ctas``), each running ``ROWS``
independent **workers** side by side (one per row of a ``[ROWS, ROW_ELEMS]`` tile).
Worker ``w`` of ``W = P * ROWS`` owns the contiguous row range
``[w*T/W, (w+1)*T/W)``: every worker moves the same number of rows (+-1), whatever
the mix of chunk sizes, run lengths, layers and groups, and a 2 MiB chunk is spread
over as many workers as it has rows instead of serializing on one program.

Each program first scans the item list in windows of ``SCAN`` items (vectorized:
group of each item by comparing against ``item_offsets``, then gathers of the run and
entry rows) to get ``T``, and a second time to find, with a cumulative sum, the item
and row where each of its workers starts. The scan costs a few microseconds for a few
thousand items, once per program, and needs no host work and no second launch. The
main loop then moves one row per worker per step: addresses from the worker's current
item (``seg = u // tiles``, ``block``/``chunk`` of that segment, ``tile * ROW_BYTES``),
a masked load of the whole tile, then (while those loads are in flight) the step to
the next row and, when some worker crosses into its next item, the gathers that
resolve it, then the store.

Words and offsets
-----------------
Bytes move as integers only (no float arithmetic, so the interpreter's bf16 issues
never apply): ``int32`` elements when every address, stride and size is a multiple
of 4 (``CopyTables.word_bytes``), with ``tl.multiple_of`` telling the compiler the
real alignment (8 or 16 bytes) so it emits ``ld.global.v2/v4.b32``; ``int16``/``int8``
for 2- and 1-byte aligned tables. All address arithmetic is int64 (a 48-layer cache of
2 MiB pages passes 2^31 bytes per layer).

Expected bandwidth
------------------
From 2 KiB chunks up the tile is 16 rows of 2 KiB = 32 KiB per program per step with
4-byte words (8 KiB with 1-byte words): eight 16-byte loads in flight per thread with
8 warps. Host reads over PCIe are bound by bytes in flight: at ~2 us round trip,
55 GB/s needs ~110 KB in flight, which 4 programs already hold; 16 programs
(``max_ctas=16``) hold 512 KiB. The expectation on H100/H200 (PCIe Gen5) is therefore
the contiguous pinned memcpy rate (~55 GB/s) in both directions for chunks from 2 KiB
to 2 MiB, less the per-program scan (a few us per call) on small calls. The default
grid is one program per SM; ptxas gives the kernel 128 registers and no spills
(two programs of 256 threads fit on an SM).

Interpreter
-----------
With ``TRITON_INTERPRET=1`` ``@triton.jit`` produces interpreted functions that run on
CPU tensors, each program instance in Python (keep grids small). :func:`kernels` hands
out the compiled or the interpreted variant on demand, whatever the environment was
when this module was first imported, so callers and tests do not depend on import order.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import threading
from dataclasses import dataclass
from types import ModuleType

import triton
import triton.language as tl

# Rows per program step, and the tile size in elements (32 per thread with 8 warps).
MAX_ROWS = 16
TILE_ELEMS = 8192
MAX_ROW_BYTES = 2048
MIN_ROW_BYTES = 64
SCAN = 256
GROUPS = 8  # group starts resolved with one vector load; more groups take a loop
NUM_WARPS = 8


# Only builtins and this module's own jit functions are used in kernel code: the
# standard library's jit helpers (tl.sum, tl.cumsum, tl.zeros_like) are of the kind
# triton was imported as (compiled or interpreted), which may not be this module's
# kind (see `kernels` below). Sums reduce with the standard `_sum_combine` whenever
# that works: the interpreter recognizes it by identity and sums with numpy without
# calling it (any kind will do), the compiler needs a JITFunction.
@triton.jit
def _add(a, b):
    return a + b


_STD_ADD = getattr(tl.standard, "_sum_combine", None)
_ADD = _add if _STD_ADD is None or (isinstance(_add, triton.runtime.JITFunction)
                                    and not isinstance(_STD_ADD, triton.runtime.JITFunction)) else _STD_ADD


@triton.jit
def _total(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _ADD)


@triton.jit
def _locate(j, valid, call, num_groups, GROUPS: tl.constexpr):
    """Items ``j`` (an int64 vector; lanes with ``valid`` false read item 0) as (group,
    the group's first block run, its block runs, the item's index within the group)."""
    j = tl.where(valid, j, 0)
    item_offsets = call + num_groups + 1
    # group of item j: how many later groups start at or before it (empty groups
    # start where the next one does, so they are stepped over). The first GROUPS
    # starts come in one vector load, not one dependent load per group.
    k = 1 + tl.arange(0, GROUPS)
    starts = tl.load(item_offsets + k, mask=k < num_groups, other=0x7FFFFFFFFFFFFFFF)
    g = _total((j[:, None] >= starts[None, :]).to(tl.int64), 1)
    for k2 in range(GROUPS + 1, num_groups):
        g += (j >= tl.load(item_offsets + k2)).to(tl.int64)
    first_run = tl.load(call + g, mask=valid, other=0)
    runs_in_group = tl.maximum(tl.load(call + g + 1, mask=valid, other=1) - first_run, 1)
    local = j - tl.load(item_offsets + g, mask=valid, other=0)
    return g, first_run, runs_in_group, local


@triton.jit
def _resolve(j, valid, entries, group_offsets, group_entries, call, num_groups,
             ROW_BYTES: tl.constexpr, GROUPS: tl.constexpr, ENTRY_FIELDS: tl.constexpr):
    """Items ``j`` (an int64 vector; lanes with ``valid`` false give zero rows) as
    (src item base, dst item base, src block stride, dst block stride, runs per page,
    the entry row (for the page-run dims), merged, segment bytes,
    rows per segment, rows)."""
    g, first_run, runs_in_group, local = _locate(j, valid, call, num_groups, GROUPS)
    return _resolve_located(valid, g, first_run, runs_in_group, local, entries, group_offsets, group_entries,
                            call, num_groups, ROW_BYTES, ENTRY_FIELDS)


@triton.jit
def _resolve_located(valid, g, first_run, runs_in_group, local, entries, group_offsets, group_entries, call,
                     num_groups, ROW_BYTES: tl.constexpr, ENTRY_FIELDS: tl.constexpr):
    """:func:`_resolve` of items already located (:func:`_locate`)."""
    slot = tl.load(group_offsets + g, mask=valid, other=0) + local // runs_in_group
    entry = entries + ENTRY_FIELDS * tl.load(group_entries + slot, mask=valid, other=0)
    run = call + 2 * (num_groups + 1) + 3 * (first_run + local % runs_in_group)
    src_block = tl.load(run, mask=valid, other=0)
    dst_block = tl.load(run + 1, mask=valid, other=0)
    num_blocks = tl.load(run + 2, mask=valid, other=1)
    src_base = tl.load(entry + 0, mask=valid, other=0)
    dst_base = tl.load(entry + 1, mask=valid, other=0)
    src_bstride = tl.load(entry + 2, mask=valid, other=0)
    dst_bstride = tl.load(entry + 3, mask=valid, other=0)
    run_bytes = tl.load(entry + 4, mask=valid, other=0)
    num_runs = tl.maximum(tl.load(entry + 5, mask=valid, other=1), 1)
    # A block run adjacent on both sides moves each page run of all its blocks as one
    # segment.
    merged = (num_blocks == 1) | ((src_bstride == run_bytes) & (dst_bstride == run_bytes))
    seg_bytes = tl.where(merged, run_bytes * num_blocks, run_bytes)
    num_segs = tl.where(merged, num_runs, num_runs * num_blocks)
    tiles = (seg_bytes + ROW_BYTES - 1) // ROW_BYTES
    src_item = src_base + src_block * src_bstride
    dst_item = dst_base + dst_block * dst_bstride
    # The page-run dims stay in the entry row (read per row, from L1: fewer live values).
    return (src_item, dst_item, src_bstride, dst_bstride, num_runs, tl.where(valid, entry, entries),
            merged, seg_bytes, tiles, num_segs * tiles)


@triton.jit
def _first_rows(entries, group_offsets, group_entries, call, num_groups, n_items, worker, num_workers,
                ROW_BYTES: tl.constexpr, SCAN: tl.constexpr, GROUPS: tl.constexpr, ENTRY_FIELDS: tl.constexpr):
    """The call's rows in total, and for each worker its row count, the item holding its
    first row and that row's index within the item."""
    lane = tl.arange(0, SCAN).to(tl.int64)

    # Pass 1: the number of rows in the call.
    total = n_items * 0
    for start in range(0, n_items, SCAN):
        j = start + lane
        rows = _resolve(j, j < n_items, entries, group_offsets, group_entries, call, num_groups,
                        ROW_BYTES, GROUPS, ENTRY_FIELDS)[9]
        total += _total(rows, 0)

    # Each worker's contiguous share of the rows.
    begin = worker * total // num_workers
    count = (worker + 1) * total // num_workers - begin

    # Pass 2: the item holding each worker's first row = the number of items whose
    # rows all end at or before it; `before` = the rows of those items.
    item = worker * 0
    before = worker * 0
    carry = n_items * 0
    for start in range(0, n_items, SCAN):
        j = start + lane
        valid = j < n_items
        rows = _resolve(j, valid, entries, group_offsets, group_entries, call, num_groups,
                        ROW_BYTES, GROUPS, ENTRY_FIELDS)[9]
        ends = tl.associative_scan(rows, 0, _ADD) + carry
        done = (ends[None, :] <= begin[:, None]) & valid[None, :]
        item += _total(done.to(tl.int64), 1)
        before += _total(tl.where(done, rows[None, :], 0), 1)
        carry += _total(rows, 0)
    return total, count, item, begin - before


@triton.jit
def _row_addresses(src_item, dst_item, src_bstride, dst_bstride, num_runs, entry, merged, tiles, row,
                   ROW_BYTES: tl.constexpr):
    """Source and destination byte address of each worker's row ``row`` of its item,
    and the row's offset within its segment."""
    seg = row // tl.maximum(tiles, 1)
    tile = row - seg * tiles
    block = tl.where(merged, 0, seg // num_runs)
    # Page run -> its digits over the entry's dims (count, src stride, dst stride),
    # outermost first (< 2^31: 32-bit divisions); the outermost digit is what the
    # inner two leave.
    c1 = tl.maximum(tl.load(entry + 9), 1)
    c2 = tl.maximum(tl.load(entry + 12), 1)
    s0 = tl.load(entry + 7)
    d0 = tl.load(entry + 8)
    s1 = tl.load(entry + 10)
    d1 = tl.load(entry + 11)
    s2 = tl.load(entry + 13)
    d2 = tl.load(entry + 14)
    run = (seg - block * num_runs).to(tl.int32)
    i2 = run % c2.to(tl.int32)
    q = run // c2.to(tl.int32)
    i1 = q % c1.to(tl.int32)
    i0 = (q // c1.to(tl.int32)).to(tl.int64)
    i1 = i1.to(tl.int64)
    i2 = i2.to(tl.int64)
    off = tile * ROW_BYTES
    src = src_item + block * src_bstride + i0 * s0 + i1 * s1 + i2 * s2 + off
    dst = dst_item + block * dst_bstride + i0 * d0 + i1 * d1 + i2 * d2 + off
    return src, dst, off


@triton.jit(do_not_specialize=["num_groups"])
def fused_copy_kernel(entries, group_offsets, group_entries, call, num_groups,
                      ELEM: tl.constexpr, ELEM_BYTES: tl.constexpr, WORD: tl.constexpr,
                      ROW_BYTES: tl.constexpr, ROWS: tl.constexpr, SCAN: tl.constexpr,
                      GROUPS: tl.constexpr, ENTRY_FIELDS: tl.constexpr):
    """One launch for a whole call; see the module docstring for the mapping."""
    ROW_ELEMS: tl.constexpr = ROW_BYTES // ELEM_BYTES
    VEC: tl.constexpr = WORD // ELEM_BYTES
    pid = tl.program_id(0).to(tl.int64)
    num_workers = tl.num_programs(0).to(tl.int64) * ROWS
    n_items = tl.load(call + 2 * num_groups + 1)
    worker = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    total, count, item, row = _first_rows(entries, group_offsets, group_entries, call, num_groups, n_items,
                                          worker, num_workers, ROW_BYTES, SCAN, GROUPS, ENTRY_FIELDS)

    (src_item, dst_item, src_bstride, dst_bstride, num_runs, entry,
     merged, seg_bytes, tiles, rows) = _resolve(
        item, item < n_items, entries, group_offsets, group_entries, call, num_groups, ROW_BYTES, GROUPS,
        ENTRY_FIELDS)
    cols = tl.arange(0, ROW_ELEMS)
    steps = (total + num_workers - 1) // num_workers
    for step in range(0, steps):
        active = step < count
        src, dst, off = _row_addresses(src_item, dst_item, src_bstride, dst_bstride, num_runs, entry, merged,
                                       tiles, row, ROW_BYTES)
        n = tl.where(active, tl.minimum(seg_bytes - off, ROW_BYTES) // ELEM_BYTES, 0)
        n = tl.multiple_of(n, VEC)
        src_ptr = tl.multiple_of(src.to(tl.pointer_type(ELEM)), WORD)
        dst_ptr = tl.multiple_of(dst.to(tl.pointer_type(ELEM)), WORD)
        mask = cols[None, :] < n[:, None]
        words = tl.load(src_ptr[:, None] + cols[None, :], mask=mask, eviction_policy="evict_first")
        # Step to the next row while the loads are in flight.
        row += active.to(tl.int64)
        wrap = active & (row >= rows)
        if _total(wrap.to(tl.int32), 0) > 0:
            item += wrap.to(tl.int64)
            row = tl.where(wrap, 0, row)
            (src_item, dst_item, src_bstride, dst_bstride, num_runs, entry,
             merged, seg_bytes, tiles, rows) = _resolve(
                item, item < n_items, entries, group_offsets, group_entries, call, num_groups,
                ROW_BYTES, GROUPS, ENTRY_FIELDS)
        tl.store(dst_ptr[:, None] + cols[None, :], words, mask=mask, eviction_policy="evict_first")


# ---------------------------------------------------------------------- checksums
# The fused copy that also sums each page's checksum (kvcopy.core.checksum, the same function
# as kernels/page_checksum.cuh). Same work split as fused_copy_kernel; per row, each
# element's hash term is computed from the words just loaded, the terms of the row's
# page are summed into its worker's accumulator, and a worker adds its accumulator to
# the page's slot with one atomic when it moves to another page (rows of merged
# segments that cross a page boundary add their other page's terms one by one).
@triton.jit
def _product_term(x):
    """The term of keyed uint64 words: the product of their 32-bit halves, plus them."""
    return (x & 0xFFFFFFFF) * (x >> 32) + x


@triton.jit
def _unsigned(x, ELEM_BYTES: tl.constexpr):
    """Integer elements zero-extended to uint64."""
    if ELEM_BYTES == 1:
        return x.to(tl.uint8, bitcast=True).to(tl.uint64)
    elif ELEM_BYTES == 2:
        return x.to(tl.uint16, bitcast=True).to(tl.uint64)
    elif ELEM_BYTES == 4:
        return x.to(tl.uint32, bitcast=True).to(tl.uint64)
    else:
        return x.to(tl.uint64, bitcast=True)


@triton.jit
def _item_keys(valid, first_run, runs_in_group, local, call, num_groups):
    """Items located by :func:`_locate`: (the key base of their entry's position in its
    group, the call index of their run's first block: their first output slot)."""
    ordinal = (local // runs_in_group).to(tl.uint64)
    block_prefix = call + 2 * (num_groups + 1) + 3 * tl.load(call + num_groups)
    out_index = tl.load(block_prefix + first_run + local % runs_in_group, mask=valid, other=0)
    return ordinal * 0xC2B2AE3D27D4EB4F + 0x9E3779B97F4A7C15, out_index


@triton.jit
def _terms(words, src_ptr, cols, mask, q, run_bytes, pos, base, ELEM_BYTES: tl.constexpr):
    """Hash terms of a tile's elements (0 where none starts): 8-byte elements are hash
    words; narrower ones add the zero-padded 8-byte word that starts at them, if one
    does, its other bytes read from the source."""
    if ELEM_BYTES == 8:
        owner = mask
        value = _unsigned(words, ELEM_BYTES)
    else:
        owner = mask & (q % 8 == 0)
        value = _unsigned(words, ELEM_BYTES)
        for b in tl.static_range(1, 8 // ELEM_BYTES):
            more = tl.load(src_ptr[:, None] + cols[None, :] + b,
                           mask=owner & (q + b * ELEM_BYTES < run_bytes[:, None]), other=0)
            value = value | (_unsigned(more, ELEM_BYTES) << (8 * ELEM_BYTES * b))
    key = base[:, None] + (pos[:, None] + q).to(tl.uint64) * 0x9E3779B97F4A7C15
    return tl.where(owner, _product_term(value ^ key), 0)


@triton.jit
def _worker_start(pid, n_items, entries, group_offsets, group_entries, call, num_groups,
                  ROW_BYTES: tl.constexpr, ROWS: tl.constexpr, SCAN: tl.constexpr, GROUPS: tl.constexpr,
                  ENTRY_FIELDS: tl.constexpr):
    """fused_copy_kernel's two scans: (rows in the call, each worker's first item, its
    row there, its row count)."""
    num_workers = tl.num_programs(0).to(tl.int64) * ROWS
    lane = tl.arange(0, SCAN).to(tl.int64)
    total = n_items * 0
    for start in range(0, n_items, SCAN):
        j = start + lane
        total += _total(_resolve(j, j < n_items, entries, group_offsets, group_entries, call, num_groups,
                                 ROW_BYTES, GROUPS, ENTRY_FIELDS)[9], 0)
    worker = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    begin = worker * total // num_workers
    count = (worker + 1) * total // num_workers - begin
    item = worker * 0
    before = worker * 0
    carry = n_items * 0
    for start in range(0, n_items, SCAN):
        j = start + lane
        valid = j < n_items
        rows = _resolve(j, valid, entries, group_offsets, group_entries, call, num_groups, ROW_BYTES, GROUPS,
                        ENTRY_FIELDS)[9]
        ends = tl.associative_scan(rows, 0, _ADD) + carry
        done = (ends[None, :] <= begin[:, None]) & valid[None, :]
        item += _total(done.to(tl.int64), 1)
        before += _total(tl.where(done, rows[None, :], 0), 1)
        carry += _total(rows, 0)
    return total, item, begin - before, count


@triton.jit(do_not_specialize=["num_groups"])
def fused_copy_sums_kernel(entries, group_offsets, group_entries, call, num_groups, sums,
                           ELEM: tl.constexpr, ELEM_BYTES: tl.constexpr, WORD: tl.constexpr,
                           ROW_BYTES: tl.constexpr, ROWS: tl.constexpr, SCAN: tl.constexpr,
                           GROUPS: tl.constexpr, ENTRY_FIELDS: tl.constexpr):
    """fused_copy_kernel, and each page's checksum added into ``sums`` (zeroed first)."""
    ROW_ELEMS: tl.constexpr = ROW_BYTES // ELEM_BYTES
    VEC: tl.constexpr = WORD // ELEM_BYTES
    pid = tl.program_id(0).to(tl.int64)
    n_items = tl.load(call + 2 * num_groups + 1)
    total, item, row, count = _worker_start(pid, n_items, entries, group_offsets, group_entries, call,
                                            num_groups, ROW_BYTES, ROWS, SCAN, GROUPS, ENTRY_FIELDS)
    valid = item < n_items
    g, first_run, runs_in_group, local = _locate(item, valid, call, num_groups, GROUPS)  # one search per item
    (src_item, dst_item, src_bstride, dst_bstride, num_runs, entry, merged, seg_bytes, tiles,
     rows) = _resolve_located(valid, g, first_run, runs_in_group, local, entries, group_offsets, group_entries,
                              call, num_groups, ROW_BYTES, ENTRY_FIELDS)
    base, out_index = _item_keys(valid, first_run, runs_in_group, local, call, num_groups)
    cols = tl.arange(0, ROW_ELEMS)
    acc = (row * 0).to(tl.uint64)
    cur = row * 0 - 1  # the slot acc belongs to; -1: none yet
    steps = (total + tl.num_programs(0).to(tl.int64) * ROWS - 1) // (tl.num_programs(0).to(tl.int64) * ROWS)
    for step in range(0, steps):
        active = step < count
        seg = row // tl.maximum(tiles, 1)
        block = tl.where(merged, 0, seg // num_runs)
        c1 = tl.maximum(tl.load(entry + 9), 1)
        c2 = tl.maximum(tl.load(entry + 12), 1)
        run = (seg - block * num_runs).to(tl.int32)
        i2 = (run % c2.to(tl.int32)).to(tl.int64)
        i1 = (run // c2.to(tl.int32) % c1.to(tl.int32)).to(tl.int64)
        i0 = (run // c2.to(tl.int32) // c1.to(tl.int32)).to(tl.int64)
        off = (row - seg * tiles) * ROW_BYTES
        src = (src_item + block * src_bstride + i0 * tl.load(entry + 7) + i1 * tl.load(entry + 10)
               + i2 * tl.load(entry + 13) + off)
        dst = (dst_item + block * dst_bstride + i0 * tl.load(entry + 8) + i1 * tl.load(entry + 11)
               + i2 * tl.load(entry + 14) + off)
        pos = i0 * tl.load(entry + 16) + i1 * tl.load(entry + 17) + i2 * tl.load(entry + 18)
        n = tl.multiple_of(tl.where(active, tl.minimum(seg_bytes - off, ROW_BYTES) // ELEM_BYTES, 0), VEC)
        src_ptr = tl.multiple_of(src.to(tl.pointer_type(ELEM)), WORD)
        dst_ptr = tl.multiple_of(dst.to(tl.pointer_type(ELEM)), WORD)
        mask = cols[None, :] < n[:, None]
        words = tl.load(src_ptr[:, None] + cols[None, :], mask=mask, eviction_policy="evict_first")
        # Each element's offset in its run and its page's slot: a row of a merged segment
        # starts in page `page0` of the run's blocks and may run into the next ones.
        run_bytes = tl.load(entry + 4)
        page0 = tl.where(merged, off // run_bytes, 0)
        q = (off - page0 * run_bytes)[:, None] + cols[None, :] * ELEM_BYTES
        page = q * 0
        if _total((merged & active).to(tl.int32), 0) > 0:
            page = tl.where(merged[:, None], q // run_bytes[:, None], 0)
            q = q - page * run_bytes[:, None]
        terms = _terms(words, src_ptr, cols, mask, q, run_bytes, pos, base, ELEM_BYTES)
        first = out_index + block + page0
        slot = first[:, None] + page
        same = page == 0
        tl.atomic_add(sums + slot, terms.to(tl.int64, bitcast=True), mask=mask & ~same & (terms != 0),
                      sem="relaxed")
        row_sum = _total(tl.where(same, terms, 0), 1)
        change = active & (first != cur)
        tl.atomic_add(sums + cur, acc.to(tl.int64, bitcast=True), mask=change & (cur >= 0), sem="relaxed")
        acc = tl.where(change, row_sum, tl.where(active, acc + row_sum, acc))
        cur = tl.where(change, first, cur)
        row += active.to(tl.int64)
        wrap = active & (row >= rows)
        if _total(wrap.to(tl.int32), 0) > 0:
            item += wrap.to(tl.int64)
            row = tl.where(wrap, 0, row)
            valid = item < n_items
            g, first_run, runs_in_group, local = _locate(item, valid, call, num_groups, GROUPS)
            (src_item, dst_item, src_bstride, dst_bstride, num_runs, entry, merged, seg_bytes, tiles,
             rows) = _resolve_located(valid, g, first_run, runs_in_group, local, entries, group_offsets,
                                      group_entries, call, num_groups, ROW_BYTES, ENTRY_FIELDS)
            base, out_index = _item_keys(valid, first_run, runs_in_group, local, call, num_groups)
        tl.store(dst_ptr[:, None] + cols[None, :], words, mask=mask, eviction_policy="evict_first")
    tl.atomic_add(sums + cur, acc.to(tl.int64, bitcast=True), mask=cur >= 0, sem="relaxed")


# ---------------------------------------------------------------------- host side
@dataclass(frozen=True)
class LaunchConfig:
    """Compile-time shape of the kernel for one copier direction."""

    elem: object  # tl.int8 / tl.int16 / tl.int32
    elem_bytes: int
    word: int  # alignment of every address, stride and size (<= 16)
    row_bytes: int
    rows: int
    entry_fields: int  # int64 columns of an entry row (kvcopy.native.ENTRY_FIELDS)
    scan: int = SCAN
    groups: int = GROUPS
    num_warps: int = NUM_WARPS

    @property
    def tile_bytes(self) -> int:
        return self.rows * self.row_bytes

    def constexprs(self) -> dict:
        return dict(ELEM=self.elem, ELEM_BYTES=self.elem_bytes, WORD=self.word,
                    ROW_BYTES=self.row_bytes, ROWS=self.rows, SCAN=self.scan, GROUPS=self.groups,
                    ENTRY_FIELDS=self.entry_fields)


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def launch_config(word_bytes: int, min_chunk_bytes: int, entry_fields: int, checksums: bool = False) -> LaunchConfig:
    """Rows about one chunk long, at most 2 KiB: from 2 KiB chunks up every table gets
    the same kernel (16 rows of 2 KiB, a 32 KiB tile), so a sweep over page sizes
    compiles one variant per word size, and a large chunk is cut into 2 KiB rows
    spread over all workers. Smaller chunks get shorter rows (fewer masked lanes).
    ``checksums``: the checksum kernel's shape, whose elements are the 8-byte hash words
    themselves when every address and size is a multiple of 8. ``entry_fields``: the
    entry row's width (kernels/entry_layout.cuh, which this module does not read)."""
    if checksums and word_bytes >= 8:
        elem, elem_bytes = tl.int64, 8
    elif word_bytes >= 4:
        elem, elem_bytes = tl.int32, 4
    elif word_bytes == 2:
        elem, elem_bytes = tl.int16, 2
    else:
        elem, elem_bytes = tl.int8, 1
    row = _pow2_at_least(max(min_chunk_bytes, MIN_ROW_BYTES, word_bytes))
    row = min(row, MAX_ROW_BYTES, TILE_ELEMS * elem_bytes)
    rows = max(1, min(MAX_ROWS, TILE_ELEMS * elem_bytes // row))
    return LaunchConfig(elem=elem, elem_bytes=elem_bytes, word=int(word_bytes), row_bytes=row, rows=rows,
                        entry_fields=int(entry_fields))


def grid_size(total_bytes: int, cfg: LaunchConfig, max_ctas: int) -> int:
    """Programs for a call: no more than there are full tiles, at most ``max_ctas``."""
    tiles = -(-int(total_bytes) // cfg.tile_bytes)
    return max(1, min(int(max_ctas), tiles))


# Compile options given explicitly. FP fusion (FMA contraction) cannot change a kernel
# that moves integers and does integer address math only; asking for it off (Triton
# 3.10's default) keeps codegen the same across 3.9/3.10 and silences 3.9's
# "TRITON_DEFAULT_FP_FUSION is unset" warning without touching the process-wide default
# that the model's own Triton kernels use.
COMPILE_OPTIONS = {"enable_fp_fusion": False}


def launch(mod: ModuleType, grid: int, entries, group_offsets, group_entries, call,
           num_groups: int, cfg: LaunchConfig) -> None:
    """The one kernel launch of a call (``mod`` from :func:`kernels`)."""
    mod.fused_copy_kernel[(grid,)](
        entries, group_offsets, group_entries, call, num_groups,
        num_warps=cfg.num_warps, **COMPILE_OPTIONS, **cfg.constexprs())


def launch_sums(mod: ModuleType, grid: int, entries, group_offsets, group_entries, call,
                num_groups: int, sums, cfg: LaunchConfig) -> None:
    """The one launch of a checksummed call: ``call`` is the call array with its block
    prefix, ``sums`` the zeroed int64 output (one per block of the call)."""
    mod.fused_copy_sums_kernel[(grid,)](
        entries, group_offsets, group_entries, call, num_groups, sums,
        num_warps=cfg.num_warps, **COMPILE_OPTIONS, **cfg.constexprs())


# ------------------------------------------------------- compiled / interpreted
_variants: dict = {}
_lock = threading.Lock()


def is_interpreted(mod: ModuleType) -> bool:
    return not isinstance(mod.fused_copy_kernel, triton.runtime.JITFunction)


def kernels(interpret: bool) -> ModuleType:
    """This module with its kernels compiled (``interpret=False``) or interpreted.

    ``@triton.jit`` picks the interpreter from ``TRITON_INTERPRET`` when it runs. The
    variant this module was imported as is returned as is; the other one is this
    file executed again, once, as a private module with ``TRITON_INTERPRET`` set for
    the duration, so its helper functions are of the same kind as its kernel.
    """
    this = sys.modules[__name__]
    if is_interpreted(this) == bool(interpret):
        return this
    with _lock:
        if interpret not in _variants:
            name = f"{__name__}._{'interpreted' if interpret else 'compiled'}"
            spec = importlib.util.spec_from_file_location(name, __file__)
            assert spec is not None and spec.loader is not None, __file__  # a .py file always has one
            mod = importlib.util.module_from_spec(spec)
            old = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
            try:
                sys.modules[name] = mod
                spec.loader.exec_module(mod)
            finally:
                if old is None:
                    del os.environ["TRITON_INTERPRET"]
                else:
                    os.environ["TRITON_INTERPRET"] = old
            assert is_interpreted(mod) == bool(interpret)
            _variants[interpret] = mod
        return _variants[interpret]
