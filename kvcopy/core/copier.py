"""``BlockCopier``: every layer of every KV cache group of a request in one backend call.

Built once (at KV cache registration) from the device caches, the host staging buffers
and the engine's KV cache groups; everything static is validated there and turned into
the entry tables of :mod:`kvcopy.core.tables`, one per direction. A call then only checks
its ids and merges them into runs (:mod:`kvcopy.core.planner`: one C pass over every
group) and hands one packed array to the backend: no Python loop over layers or blocks.

The contract: for each group ``g``, each layer ``l`` in ``g`` and
each ``i``, block ``src_ids[g][i]`` of ``src[l]`` is written to block ``dst_ids[g][i]``
of ``dst[l]``, and no other destination byte changes. A layer in no group (a
KV-sharing layer) is never read or written. Layers of different groups that are views
of one storage (hybrid models) are copied at their own group's blocks only; two names
for the same bytes within a group are copied once. Bad input raises ``ValueError`` or
``TypeError`` naming the group, layer and id before any byte moves (ids are checked by
:mod:`kvcopy.core.planner`). Device and host tensors that share bytes are refused at build,
and a storage replaced or freed after build is refused at the call
(:mod:`kvcopy.core.storages`, per unique storage).
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..copy_backends import Backend, choose_backend, get_backend
from .checksum import SumFold
from .checksum import check_output as check_checksum_output
from .checksum import copy_device as checksum_device
from .layout import PageLayout, byte_extent, describe, pair_pages
from ..checks import shown
from .planner import CallPlanner
from .storages import StorageGuard, check_disjoint
from .tables import CallPlan, CopyTables, build_tables

IdLists = Sequence[Sequence[int]]


class _Direction:
    """One direction's tables, backend and call planner."""

    def __init__(self, tables: CopyTables, backend: Backend, planner: CallPlanner, dst_side: str, row_pairs=()):
        self.tables = tables
        self.backend = backend
        self.planner = planner
        self.dst_side = dst_side
        self.row_pairs = tuple(row_pairs)  # overlaid groups of different block strides (_check_shared_rows)
        self._sums_check: Optional[tuple] = None

    def sums_check(self) -> tuple:
        """(why the backend cannot sum these tables or None, the sums' device, whether
        that is the CPU): worked out on the first checksummed call, as none changes
        afterwards (``torch.device.type`` took 15-20 us per read right after a copy)."""
        if self._sums_check is None:
            device = checksum_device(self.tables.src_device, self.tables.dst_device)
            self._sums_check = (self.backend.checksum_reason(self.tables), device, device.type == "cpu")
        return self._sums_check


class BlockCopier:
    """Masked block copies between device KV caches and host staging buffers.

    ``device_caches`` and ``host_buffers`` map layer names to tensors whose pages have
    the same logical shape and element size (the number of blocks may differ); each
    side may order a page's elements its own way (a head-major host buffer against a
    token-major cache): the copy converts, element ``[i, j, ...]`` of a page to element
    ``[i, j, ...]`` (:func:`kvcopy.core.layout.pair_pages`). ``layer_groups`` has one sequence of
    layer names per KV cache group. ``backend`` is ``"auto"`` or a name from
    :func:`kvcopy.available_backends`. ``block_dim`` (an int, or a dict by layer name)
    names the block axis where the shape is ambiguous; ``kv_layout`` ("NHD"/"HND")
    names token and head axes for code that needs them. ``max_ctas`` caps the grid of
    the kernel backends (``cuda``, ``triton``) to leave SMs to the model (default:
    ``KVCOPY_MAX_CTAS``, else uncapped; see ``CopyTables.cta_cap``).

    Device and host tensors of a layer have one dtype, or one of them is a raw integer
    type (``uint8`` for fp8, ``int16`` for bf16 ...) holding the other's bits;
    ``reinterpret_dtypes=True`` allows two different floating types of one element size
    (their bits are copied unconverted), which is otherwise refused (``TypeError``).
    ``layer_groups`` must name at least one layer.

    ``directions`` names the directions to build (``"d2h"``, ``"h2d"``; default both):
    a copier built for ``"d2h"`` only accepts device bytes shared by layers with
    different host buffers (reading shared bytes into separate buffers is well
    defined), which the ``"h2d"`` tables refuse; calling an unbuilt direction raises.

    Calls enqueue on the current CUDA stream and never synchronize the host; CPU
    backends run synchronously.

    Threads: one copier may be called from several threads at once (``to_host``,
    ``to_device``, ``plan``, ``run``); each call is checked and copied as if it were
    alone. The call planner keeps no state between calls (its duplicate check uses a
    per-thread array in the native library), a plan is immutable, and the backends'
    per-copier state is read-only during calls. Calls from several threads on one CUDA
    stream are ordered on it as they are enqueued. :meth:`close` must not run while
    another thread is in a call: it releases what those calls use.
    """

    def __init__(
        self,
        device_caches: Mapping[str, torch.Tensor],
        host_buffers: Mapping[str, torch.Tensor],
        layer_groups: Sequence[Sequence[str]],
        backend: str = "auto",
        block_dim: Optional[int | Mapping[str, int]] = None,
        kv_layout: str = "NHD",
        max_ctas: Optional[int] = None,
        directions: Sequence[str] = ("d2h", "h2d"),
        reinterpret_dtypes: bool = False,
    ):
        if isinstance(directions, str) or not directions or any(d not in ("d2h", "h2d") for d in directions):
            raise ValueError(f"directions must be 'd2h' and/or 'h2d', got {list(directions)!r}")
        if isinstance(layer_groups, (str, bytes)) or any(
            isinstance(g, (str, bytes)) for g in layer_groups
        ):
            raise TypeError("layer_groups is a sequence of sequences of layer names, one per group")
        self.layer_groups: Tuple[Tuple[str, ...], ...] = tuple(tuple(g) for g in layer_groups)
        if not any(self.layer_groups):
            raise ValueError(f"layer_groups {list(map(list, self.layer_groups))!r} names no layer: a BlockCopier "
                             "copies at least one layer of one group")
        self._reinterpret_dtypes = reinterpret_dtypes
        self.device_layouts: Dict[str, PageLayout] = {}
        self.host_layouts: Dict[str, PageLayout] = {}
        self._device_caches = dict(device_caches)
        self._host_buffers = dict(host_buffers)
        seen: Dict[str, int] = {}
        for g, layers in enumerate(self.layer_groups):
            for name in layers:
                if name in seen:
                    raise ValueError(f"layer {name!r} is in group {seen[name]} and group {g}")
                seen[name] = g
                self._check_layer(g, name, block_dim, kv_layout)
        devices = {self._device_caches[n].device for n in seen}
        if len(devices) > 1:
            first = {d: next(n for n in seen if self._device_caches[n].device == d) for d in devices}
            raise ValueError(
                "device caches live on several devices ("
                + ", ".join(f"{d}: layer {n!r}" for d, n in first.items())
                + "); one BlockCopier copies to and from one device"
            )
        grouped = list(seen)
        device_grouped = {n: self._device_caches[n] for n in grouped}
        host_grouped = {n: self._host_buffers[n] for n in grouped}
        check_disjoint(device_grouped, host_grouped)
        self._storages = StorageGuard(device_grouped, host_grouped)  # checked before every copy
        self._max_ctas = max_ctas
        self._closed = False
        self._d2h = self._direction("device", "host", backend) if "d2h" in directions else None
        self._h2d = self._direction("host", "device", backend) if "h2d" in directions else None

    # ------------------------------------------------------------------ building
    def _check_layer(self, g, name, block_dim, kv_layout) -> None:
        where = f"group {g}, layer {name!r}"
        for side, caches in (("device", self._device_caches), ("host", self._host_buffers)):
            if name not in caches:
                raise ValueError(f"{where}: no {side} tensor for this layer")
            if not isinstance(caches[name], torch.Tensor):
                raise TypeError(f"{where}: {side} entry is a {type(caches[name]).__name__}, not a tensor")
        dev, host = self._device_caches[name], self._host_buffers[name]
        if host.device.type != "cpu":
            raise ValueError(f"{where}: host buffer is on {host.device}, expected cpu")
        if dev.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{where}: device cache on unsupported device {dev.device}")
        bd = block_dim.get(name) if isinstance(block_dim, Mapping) else block_dim
        try:
            dl = describe(dev, bd, kv_layout)
            hl = describe(host, bd, kv_layout)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        try:
            pair_pages(dl, hl)  # same logical page and element size; any two orders
        except ValueError as exc:
            raise ValueError(f"{where}: device and host {exc}") from None
        if dev.dtype != host.dtype and not (self._reinterpret_dtypes or _raw_bits(dev.dtype) or _raw_bits(host.dtype)):
            # Bytes are copied as they are: an fp16 buffer for a bf16 cache would read garbage.
            raise TypeError(
                f"{where}: device cache is {dev.dtype} but host buffer is {host.dtype}; the copy moves bytes, "
                f"so the host would hold {dev.dtype} bits read as {host.dtype}. Use one dtype on both sides, view "
                "one side as a raw integer type (e.g. .view(torch.int16)), or pass reinterpret_dtypes=True"
            )
        self.device_layouts[name], self.host_layouts[name] = dl, hl

    def _direction(self, src_side: str, dst_side: str, backend: str) -> _Direction:
        tensors = {"device": self._device_caches, "host": self._host_buffers}
        layouts = {"device": self.device_layouts, "host": self.host_layouts}
        src_t, dst_t = tensors[src_side], tensors[dst_side]
        src_l, dst_l = layouts[src_side], layouts[dst_side]
        # Entries deduplicated by the bytes they touch on both sides, within a group.
        entry_of: Dict[tuple, int] = {}
        entries: List[str] = []
        group_entries: List[List[int]] = []
        for layers in self.layer_groups:
            mine: List[int] = []
            for name in layers:
                key = (_region_key(src_t[name], src_l[name]), _region_key(dst_t[name], dst_l[name]))
                if key not in entry_of:
                    entry_of[key] = len(entries)
                    entries.append(name)
                if entry_of[key] not in mine:
                    mine.append(entry_of[key])
            group_entries.append(mine)
        alias_classes, row_pairs = _check_destinations(entries, group_entries, dst_t, dst_l, dst_side)
        tables = build_tables(
            group_entries,
            [(src_t[n], src_l[n]) for n in entries],
            [(dst_t[n], dst_l[n]) for n in entries],
            entries,
            staging="dst" if dst_side == "host" else "src",
        )
        tables.max_ctas = self._max_ctas
        tables.cta_cap()  # a bad max_ctas / KVCOPY_MAX_CTAS fails here, not mid-call
        chosen = choose_backend(tables) if backend == "auto" else get_backend(backend)
        reason = chosen.unsupported_reason(tables)
        if reason:
            raise ValueError(f"backend {chosen.name!r} cannot copy {src_side}->{dst_side}: {reason}")
        chosen.prepare(tables)
        planner = CallPlanner(tables, _limits(self.layer_groups, src_l), _limits(self.layer_groups, dst_l),
                              alias_classes, (src_side, dst_side),
                              [layers[0] if layers else "-" for layers in self.layer_groups], origin=object())
        return _Direction(tables, chosen, planner, dst_side, row_pairs)

    # ------------------------------------------------------------------ calls
    @property
    def backend(self) -> str:
        """Name of the backend in use (the same for both directions unless ``auto``)."""
        built = self._d2h or self._h2d
        assert built is not None, "a BlockCopier has at least one direction"
        return built.backend.name

    def backends(self) -> Dict[str, str]:
        return {side: d.backend.name for side, d in (("to_host", self._d2h), ("to_device", self._h2d))
                if d is not None}

    def to_host(self, block_ids: IdLists, host_block_ids: Optional[IdLists] = None,
                checksums: Optional[torch.Tensor] = None) -> CallPlan:
        """Device -> host: block ``block_ids[g][i]`` to host block ``host_block_ids[g][i]``.

        ``checksums``: an int64 tensor of one element per block of the call (group after
        group) on the copy's device, overwritten with each page's checksum as the copy
        computes it (:mod:`kvcopy.core.checksum`); the ``ce`` backend raises instead."""
        return self._run("d2h", block_ids, block_ids if host_block_ids is None else host_block_ids, checksums)

    def to_device(self, block_ids: IdLists, host_block_ids: Optional[IdLists] = None,
                  checksums: Optional[torch.Tensor] = None) -> CallPlan:
        """Host -> device: host block ``host_block_ids[g][i]`` to block ``block_ids[g][i]``
        (``checksums`` as for :meth:`to_host`)."""
        return self._run("h2d", block_ids if host_block_ids is None else host_block_ids, block_ids, checksums)

    def plan(self, direction: str, block_ids: IdLists, host_block_ids: Optional[IdLists] = None) -> CallPlan:
        """Validate and pack a call without copying (``"d2h"`` or ``"h2d"``); :meth:`run`
        copies it later without validating again. The plan is immutable (nothing in it
        can be edited between the two)."""
        host = block_ids if host_block_ids is None else host_block_ids
        d = self._built(direction)
        return self._validate(d, block_ids, host) if direction == "d2h" else self._validate(d, host, block_ids)

    def run(self, direction: str, call: CallPlan, checksums: Optional[torch.Tensor] = None) -> CallPlan:
        """Copy a call this copier planned with :meth:`plan` for ``direction`` (the ids
        were checked then; the storages are checked now, as for every call);
        ``checksums`` as for :meth:`to_host`."""
        self._copy(self._planned(direction, call), call, checksums)
        return call

    def run_and_fold(self, direction: str, call: CallPlan, checksums: torch.Tensor, fold: SumFold) -> Optional[int]:
        """:meth:`run` with ``checksums``, then ``fold`` of them (:class:`~kvcopy.core.checksum.SumFold`):
        the count of its values that differ from its ``want``, computed in the copy's
        own host call where the backend can (``cpu``). None where it cannot (a GPU
        copy, whose sums are still on their way; a call with no block to copy): the
        copy and its sums are made, nothing is folded."""
        d = self._planned(direction, call)
        if checksums is None:
            raise TypeError("run_and_fold: checksums must be a torch.Tensor, got None")
        if type(fold) is not SumFold:
            raise TypeError(f"fold must be a SumFold, got {type(fold).__name__}")
        return self._copy(d, call, checksums, fold)

    def _planned(self, direction: str, call: CallPlan) -> _Direction:
        d = self._built(direction)
        if type(call) is not CallPlan or call.origin is not d.planner.origin:
            raise ValueError(f"run: not a {direction!r} call planned by this BlockCopier")
        if self._closed:
            raise ValueError("BlockCopier is closed")
        return d

    def tables(self, direction: str) -> CopyTables:
        """The static tables of ``direction`` ("d2h" or "h2d")."""
        return self._built(direction).tables

    def checksum_reason(self, direction: str) -> Optional[str]:
        """Why calls in ``direction`` cannot compute checksums (a ``ce`` copier), or
        None: for callers that check it once at build rather than at their first call."""
        return self._built(direction).sums_check()[0]

    def _built(self, direction: str) -> _Direction:
        if direction == "d2h":
            d = self._d2h
        elif direction == "h2d":
            d = self._h2d
        else:
            raise ValueError(f"direction must be 'h2d' or 'd2h', got {shown(direction)}")
        if d is None:
            raise ValueError(f"this BlockCopier was built without the {direction!r} direction")
        return d

    def _run(self, direction: str, src_ids: IdLists, dst_ids: IdLists,
             checksums: Optional[torch.Tensor] = None) -> CallPlan:
        d = self._built(direction)
        call = self._validate(d, src_ids, dst_ids)
        self._copy(d, call, checksums)
        return call

    def _copy(self, d: _Direction, call: CallPlan, checksums: Optional[torch.Tensor],
              fold: Optional[SumFold] = None) -> Optional[int]:
        if checksums is not None:
            why, device, on_cpu = d.sums_check()
            if why:
                raise ValueError(f"checksums requested but {why}")
            check_checksum_output(checksums, call.num_blocks, device, on_cpu)
            if not call.num_items:
                checksums.zero_()  # blocks of groups without layers: nothing to add
                return None
            self._storages.check()
            if fold is not None:
                return d.backend.copy_with_checksums_folded(d.tables, call, checksums, fold.at)
            d.backend.copy_with_checksums(d.tables, call, checksums)
        elif call.num_items:
            self._storages.check()
            d.backend.copy(d.tables, call)
        return None

    def _validate(self, d: _Direction, src_ids: IdLists, dst_ids: IdLists) -> CallPlan:
        if self._closed:
            raise ValueError("BlockCopier is closed")
        call = d.planner.plan(src_ids, dst_ids)
        if d.row_pairs:
            _check_shared_rows(d.row_pairs, call, d.dst_side)
        return call

    def close(self) -> None:
        """Release what the backends hold (pinned registrations). Idempotent."""
        if not getattr(self, "_closed", True):
            self._closed = True
            for d in (self._d2h, self._h2d):
                if d is not None:
                    d.backend.release(d.tables)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------- helpers
def _raw_bits(dtype: torch.dtype) -> bool:
    """An integer type: a container of another type's bits rather than a number format."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _region_key(t: torch.Tensor, l: PageLayout) -> tuple:
    # The element order is part of the region: two views of the same bytes in different
    # orders (an LBNHC view and a contiguous view of one allocation) place a page's
    # elements differently, so they are not one region to copy once.
    return (t.device, t.data_ptr(), l.block_stride, l.chunk_stride, l.chunk_bytes, l.num_chunks, l.num_blocks,
            l.itemsize, l.page_dims)


def _limits(groups, layouts) -> List[Tuple[int, str]]:
    out = []
    for layers in groups:
        if layers:
            name = min(layers, key=lambda n: layouts[n].num_blocks)
            out.append((layouts[name].num_blocks, name))
        else:
            out.append((0, "-"))
    return out


def _check_destinations(entries, group_entries, tensors, layouts, side) -> Tuple[List[List[int]], List[tuple]]:
    """Which groups' destination writes may meet, and how to keep them apart per call.

    Every pair of destination entries whose byte extents intersect must be one of:

    * **the same region** (same base, geometry and element order): groups writing it
      must use different ids in one call; a group with two such entries would write
      the same bytes from two sources and is refused;
    * **interleaved** (:func:`_interleaved`): no byte in common at any ids;
    * **overlaid on shared rows** (:func:`_shared_rows`): pages alias only within one
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
    rows must be disjoint, checked by :func:`_check_shared_rows`.
    Both are empty for models without overlays, so a call costs nothing more then.
    """
    key = [_region_key(tensors[n], layouts[n]) for n in entries]
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
        if _interleaved(la, lb, base_a, base_b):
            continue
        rows = _shared_rows(la, lb, base_a, base_b)
        if rows is None:
            raise ValueError(
                f"layers {entries[a]!r} and {entries[b]!r}: {side} tensors overlap without being the "
                "same region or aliasing only at the same block; kvcopy cannot order their writes"
            )
        if rows != _DISJOINT:
            _add_overlay(entries[a], entries[b], groups_of_entry.get(a, set()), groups_of_entry.get(b, set()),
                         rows, side, classes, row_pairs)
    return _merge_classes(classes, len(group_entries)), sorted(row_pairs.values())


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


def _merge_classes(classes: List[set], num_groups: int) -> List[List[int]]:
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


def _interleaved(la: PageLayout, lb: PageLayout, base_a: int, base_b: int) -> bool:
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


_DISJOINT = "disjoint"


def _shared_rows(la: PageLayout, lb: PageLayout, base_a: int, base_b: int):
    """How two overlapping views of one allocation with different page geometry alias:
    ``(r_a, r_b)``, :data:`_DISJOINT`, or None when kvcopy cannot tell.

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
        return _DISJOINT
    return r_a, r_b


def _page_span(l: PageLayout) -> int:
    """Bytes from the first byte of a page to its last, inclusive."""
    return (l.num_chunks - 1) * l.chunk_stride + l.chunk_bytes


def _check_shared_rows(row_pairs, call: CallPlan, side: str) -> None:
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

