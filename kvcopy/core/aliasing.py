"""Where a copier's destination writes may meet, decided once at build, and the per-call
check that keeps them apart.

Layers of different KV cache groups can be views of one allocation (hybrid models).
:func:`check_destinations` sorts every pair of destination entries whose byte extents
intersect into: the same region (groups must use different ids in one call: an alias
class for the native planner), interleaved per-layer views of one cross-layer
allocation (:func:`interleaved`: never a byte in common), or views overlaid on the rows
of a common grid (:func:`shared_rows`: pages alias only within one row), and refuses
anything else. :func:`check_shared_rows` is the per-call check for overlays with
different block strides. :func:`region_key` says when two layer views are one region
(copied once); :func:`planner_limits` gives the planner each group's block bound.
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Tuple

import torch

from .layout import PageLayout, byte_extent
from .tables import CallPlan


def region_key(t: torch.Tensor, l: PageLayout) -> tuple:
    # The element order is part of the region: two views of the same bytes in different
    # orders (an LBNHC view and a contiguous view of one allocation) place a page's
    # elements differently, so they are not one region to copy once.
    return (t.device, t.data_ptr(), l.block_stride, l.chunk_stride, l.chunk_bytes, l.num_chunks, l.num_blocks,
            l.itemsize, l.page_dims)


def planner_limits(groups, layouts) -> List[Tuple[int, str]]:
    out = []
    for layers in groups:
        if layers:
            name = min(layers, key=lambda n: layouts[n].num_blocks)
            out.append((layouts[name].num_blocks, name))
        else:
            out.append((0, "-"))
    return out


def check_destinations(entries, group_entries, tensors, layouts, side) -> Tuple[List[List[int]], List[tuple]]:
    """Which groups' destination writes may meet, and how to keep them apart per call.

    Every pair of destination entries whose byte extents intersect must be one of:

    * **the same region** (same base, geometry and element order): groups writing it
      must use different ids in one call; a group with two such entries would write
      the same bytes from two sources and is refused;
    * **interleaved** (:func:`interleaved`): no byte in common at any ids;
    * **overlaid on shared rows** (:func:`shared_rows`): pages alias only within one
      row of a common row grid, page ``i`` of a view in row ``i // r``; pages in
      different rows never share a byte. A group overlaid with itself is refused (it
      writes the same ids to both views); groups with the same block stride
      (``r = 1`` on both sides) must use different ids in one call, and groups with
      different strides (``r`` of 1 and of n: a kernel-page view over a logical-block
      view) different rows;

    anything else can collide at different ids and raises.

    Returns ``(alias_classes, row_pairs)``: classes of groups whose ids must be
    disjoint within a call (merged transitively, each group in at most one class, as
    the native planner wants one class per group), and ``(g_pages, r, g_rows)`` triples
    (one side of a pair with different strides has ``r = 1``, its ids are rows) whose
    rows must be disjoint, checked by :func:`check_shared_rows`.
    Both are empty for models without overlays, so a call costs nothing more then.
    """
    key = [region_key(tensors[n], layouts[n]) for n in entries]
    groups_of_entry: Dict[int, set] = {}
    for g, es in enumerate(group_entries):
        for e in es:
            groups_of_entry.setdefault(e, set()).add(g)
    classes = _same_region_classes(entries, group_entries, groups_of_entry, key, side)
    row_pairs: Dict[Tuple[int, int], tuple] = {}
    for a, b in _overlapping_extents(entries, tensors):
        if key[a] == key[b]:
            continue  # the same region: classes above
        la, lb = layouts[entries[a]], layouts[entries[b]]
        base_a, base_b = tensors[entries[a]].data_ptr(), tensors[entries[b]].data_ptr()
        if interleaved(la, lb, base_a, base_b):
            continue
        rows = shared_rows(la, lb, base_a, base_b)
        if rows is None:
            raise ValueError(
                f"layers {entries[a]!r} and {entries[b]!r}: {side} tensors overlap without being the "
                "same region or aliasing only at the same block; kvcopy cannot order their writes"
            )
        if rows != DISJOINT:
            _add_overlay(entries[a], entries[b], groups_of_entry.get(a, set()), groups_of_entry.get(b, set()),
                         rows, side, classes, row_pairs)
    return merge_classes(classes, len(group_entries)), sorted(row_pairs.values())


def _overlapping_extents(entries, tensors):
    """Pairs of entries whose byte extents intersect (one sort, a sweep per device)."""
    spans = []
    for e, name in enumerate(entries):
        t = tensors[name]
        start, end = byte_extent(t)
        spans.append((str(t.device), start, end, e))
    spans.sort()
    for i in range(len(spans)):
        dev_i, _, e_i, a = spans[i]
        for j in range(i + 1, len(spans)):
            dev_j, s_j, _, b = spans[j]
            if dev_j != dev_i or s_j >= e_i:
                break
            yield a, b


def _same_region_classes(entries, group_entries, groups_of_entry, key, side) -> List[set]:
    """Groups writing one identical destination region (each from its own source)."""
    by_key: Dict[tuple, List[int]] = {}
    for e in range(len(entries)):
        by_key.setdefault(key[e], []).append(e)
    classes = []
    for es in by_key.values():
        gs = set().union(*(groups_of_entry.get(e, set()) for e in es))
        for g in range(len(group_entries)):
            if len([e for e in es if e in group_entries[g]]) > 1:
                raise ValueError(
                    f"group {g}: layers {[entries[e] for e in es]} write the same {side} "
                    "bytes from different sources"
                )
        if len(gs) > 1:
            classes.append(gs)
    return classes


def _add_overlay(name_a, name_b, groups_a, groups_b, rows, side, classes, row_pairs) -> None:
    """Record what a call must check for two entries overlaid on shared rows."""
    r_a, r_b = rows
    for g_a in groups_a:
        for g_b in groups_b:
            if g_a == g_b:
                raise ValueError(
                    f"group {g_a}: layers {min(name_a, name_b)!r} and {max(name_a, name_b)!r} overlap in {side} "
                    "bytes with different page shapes; one group writes the same block ids to both"
                )
            if r_a == r_b:
                classes.append({g_a, g_b})
            else:  # (group of kernel pages, pages per row, group of rows)
                row_pairs[min(g_a, g_b), max(g_a, g_b)] = (g_a, r_a, g_b) if r_a > 1 else (g_b, r_b, g_a)


def merge_classes(classes: List[set], num_groups: int) -> List[List[int]]:
    """Classes that share a group merged, transitively (union-find): each group ends up
    in at most one class, which the native planner needs (one stamp row per group).
    Stricter than pairwise, and free in practice: vLLM's block ids are unique across
    groups (one pool)."""
    parent = list(range(num_groups))

    def root(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    for c in classes:
        first, *rest = sorted(c)
        for g in rest:
            parent[root(g)] = root(first)
    merged: Dict[int, List[int]] = {}
    for g in sorted(set().union(*classes)) if classes else []:
        merged.setdefault(root(g), []).append(g)
    return sorted(merged.values())


def interleaved(la: PageLayout, lb: PageLayout, base_a: int, base_b: int) -> bool:
    """Whether two views whose extents overlap never share a byte: per-layer views of
    one cross-layer allocation (vLLM's ``[B, L, ...]``, ``[B, H, L, ...]``,
    ``[L, H, B, ...]`` layer views) have the same shape and strides and sit a multiple
    of some layer stride apart. Sufficient test: the views' dims plus a dim of two
    with their distance as stride, sorted by stride, nest (each stride at least the
    extent of the dims inside it), so no two elements of the pair share a byte."""
    dims_a = sorted([(n, st * la.itemsize) for n, st in la.page_dims] + [(la.num_blocks, la.block_stride)])
    dims_b = sorted([(n, st * lb.itemsize) for n, st in lb.page_dims] + [(lb.num_blocks, lb.block_stride)])
    if dims_a != dims_b or la.itemsize != lb.itemsize or base_a == base_b:
        return False
    extent = la.itemsize
    for n, stride in sorted([(2, abs(base_a - base_b))] + [d for d in dims_a if d[0] > 1], key=lambda d: d[1]):
        if stride < extent:
            return False
        extent += (n - 1) * stride
    return True


DISJOINT = "disjoint"


def shared_rows(la: PageLayout, lb: PageLayout, base_a: int, base_b: int):
    """How two overlapping views of one allocation with different page geometry alias:
    ``(r_a, r_b)``, :data:`DISJOINT`, or None when kvcopy cannot tell.

    The rule: let ``s_a``, ``s_b`` be the block strides with one a multiple of the
    other, ``S = max(s_a, s_b)``, ``r_v = S / s_v``, ``o = min(base_a, base_b)``, and
    ``span_v`` the bytes from a page's first byte to its last. If each view has
    ``(base_v - o) + span_v <= s_v``, page ``i`` of view ``v`` lies inside row
    ``i // r_v`` of the grid ``[o + k S, o + (k+1) S)``. Proof: page ``i`` starts at
    ``o + (base_v - o) + (i mod r_v) s_v + (i // r_v) S`` and ends by
    ``o + (i // r_v) S + (r_v - 1) s_v + (base_v - o) + span_v <= o + (i // r_v + 1) S``.
    Rows do not intersect, so pages of the two views can share a byte only when
    ``i // r_a == j // r_b``: ids in different rows give disjoint writes.

    vLLM 0.33's overlays meet it: groups viewed from byte 0 with pages padded to the
    largest (same stride, ``r = 1``), unified block sizes (same page bytes, another
    shape), packed pages side by side in a block-outermost row, and a block split into
    kernel pages next to a group that is not split (GDN state: ``r`` of 1 against
    ``r = block / kernel page`` for attention), where ``i // r`` is the logical block
    and logical ids are unique across groups. When the two views' footprints within
    a row (the hull of a row's ``r_v`` pages) do not meet, they never share a byte.
    """
    s_a, s_b = la.block_stride, lb.block_stride
    if s_a <= 0 or s_b <= 0 or max(s_a, s_b) % min(s_a, s_b):
        return None
    row = max(s_a, s_b)
    r_a, r_b = row // s_a, row // s_b
    origin = min(base_a, base_b)
    off_a, off_b = base_a - origin, base_b - origin
    end_a, end_b = off_a + _page_span(la), off_b + _page_span(lb)
    if end_a > s_a or end_b > s_b:
        return None
    if (r_a - 1) * s_a + end_a <= off_b or (r_b - 1) * s_b + end_b <= off_a:
        return DISJOINT
    return r_a, r_b


def _page_span(l: PageLayout) -> int:
    """Bytes from the first byte of a page to its last, inclusive."""
    return (l.num_chunks - 1) * l.chunk_stride + l.chunk_bytes


def check_shared_rows(row_pairs, call: CallPlan, side: str) -> None:
    """Per call, for views overlaid with different block strides: no row is written by
    both groups of a pair. One side of a pair has ``r = 1`` (its ids are rows: logical
    blocks), the other ``r > 1`` (kernel pages, ``r`` to a row): row ``j`` is taken
    when any of pages ``j r .. j r + r - 1`` is. One set of page ids per group and one
    C-level ``isdisjoint`` per row id (state groups name one or two blocks per request);
    nothing has been written when it raises."""
    flat = call.dst_flat
    starts = [0, *itertools.accumulate(call.group_lens)]
    pages: Dict[int, set] = {}
    for g_page, r, g_row in row_pairs:
        if g_page not in pages:
            pages[g_page] = set(flat[starts[g_page]:starts[g_page + 1]])
        taken = pages[g_page]
        for j in flat[starts[g_row]:starts[g_row + 1]]:
            first = j * r
            if not taken.isdisjoint(range(first, first + r)):
                i = min(taken.intersection(range(first, first + r)))
                raise ValueError(
                    f"groups {g_page} and {g_row} overlay {side} bytes: group {g_page}'s block id {i} and group "
                    f"{g_row}'s block id {j} are the same block (ids // {r} and // 1: {j}); block ids must be "
                    "unique across groups"
                )

