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
of one storage (hybrid models) are copied at their own group's blocks only
(:mod:`kvcopy.core.aliasing` decides at build where their writes may meet); two names
for the same bytes within a group are copied once. Bad input raises ``ValueError`` or
``TypeError`` naming the group, layer and id before any byte moves (ids are checked by
:mod:`kvcopy.core.planner`). Device and host tensors that share bytes are refused at build,
and a storage replaced or freed after build is refused at the call
(:mod:`kvcopy.core.storages`, per unique storage).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..copy_backends import Backend, choose_backend, get_backend
from .aliasing import check_destinations, check_shared_rows, planner_limits, region_key
from .checksum import SumFold
from .checksum import check_output as check_checksum_output
from .checksum import copy_device as checksum_device
from .layout import PageLayout, describe, pair_pages
from .options import CopierOptions, CopyOptions, check_max_ctas
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
        self.row_pairs = tuple(row_pairs)  # overlaid groups of different block strides (check_shared_rows)
        self._sums_check: Optional[tuple] = None

    def sums_check(self) -> tuple:
        """(why the backend cannot sum these tables or None, the sums' device, whether
        that is the CPU): worked out on the first checksummed call, as none changes
        afterwards (``torch.device.type`` took 15-20 us per read right after a copy)."""
        if self._sums_check is None:
            device = checksum_device(self.tables.src_device, self.tables.dst_device)
            self._sums_check = (self.backend.checksum_reason(self.tables), device, device.type == "cpu")
        return self._sums_check


# backend= was renamed copy_backend= (issue 42) so that it cannot be confused with NIXL's
# transport plugins, which NIXL calls backends. Refused rather than taken with a warning: a
# build-time error names the fix at once, and one name stays.
RENAMED_BACKEND = ("BlockCopier: backend= is now copy_backend= (kvcopy's copy backend; NIXL's plugins are a "
                   "TransferManager's transports=)")


class BlockCopier:
    """Masked block copies between device KV caches and host staging buffers.

    ``device_caches`` and ``host_buffers`` map layer names to tensors whose pages have
    the same logical shape and element size (the number of blocks may differ); each
    side may order a page's elements its own way (a head-major host buffer against a
    token-major cache): the copy converts, element ``[i, j, ...]`` of a page to element
    ``[i, j, ...]`` (:func:`kvcopy.core.layout.pair_pages`). ``layer_groups`` has one sequence of
    layer names per KV cache group, and names at least one layer.

    The options are the fields of :class:`~kvcopy.core.options.CopierOptions` (each
    defined and checked there: ``copy_backend``, ``max_ctas``, ``kv_layout``,
    ``block_dim``, ``directions``, ``reinterpret_dtypes``), given as ``options=`` (any
    :class:`~kvcopy.core.options.CopyOptions`, e.g. a ``ManagerOptions``: its copy fields
    are used), as keywords, or both: a keyword overrides the same field of ``options``.
    An unknown keyword raises ``TypeError`` naming it. Calling a direction the copier was
    not built for raises.

    Device and host tensors of a layer have one dtype, or one of them is a raw integer
    type (``uint8`` for fp8, ``int16`` for bf16 ...) holding the other's bits;
    ``reinterpret_dtypes=True`` allows two different floating types of one element size
    (their bits are copied unconverted), which is otherwise refused (``TypeError``).

    Calls enqueue on the current CUDA stream and never synchronize the host; CPU
    backends run synchronously.

    A call's grid: every copying method takes ``max_ctas=N`` (keyword), a cap on that
    call's CTAs (Triton programs) below the copier's own ``max_ctas`` (the smaller of
    the two holds): a copy that should leave the SMs to concurrent work (a layer's KV
    copied on a side stream while the next layer computes) runs capped while the same
    copier's other calls keep their grid. It is checked like the copier's (a positive
    integer) and honoured by ``cuda`` (library and NVRTC launchers) and ``triton``;
    ``cpu``, ``torch`` and ``ce`` (copy engines: no CTAs) accept it and are unaffected.

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
        *,
        options: Optional[CopyOptions] = None,
        **fields,
    ):
        if "backend" in fields:
            raise TypeError(RENAMED_BACKEND)
        self.options = opts = CopierOptions.make(options, fields, "BlockCopier")
        if isinstance(layer_groups, (str, bytes)) or any(
            isinstance(g, (str, bytes)) for g in layer_groups
        ):
            raise TypeError("layer_groups is a sequence of sequences of layer names, one per group")
        self.layer_groups: Tuple[Tuple[str, ...], ...] = tuple(tuple(g) for g in layer_groups)
        if not any(self.layer_groups):
            raise ValueError(f"layer_groups {list(map(list, self.layer_groups))!r} names no layer: a BlockCopier "
                             "copies at least one layer of one group")
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
                self._check_layer(g, name, opts.block_dim, opts.kv_layout)
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
        self._closed = False
        self._d2h = self._direction("device", "host") if "d2h" in opts.directions else None
        self._h2d = self._direction("host", "device") if "h2d" in opts.directions else None

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
        same_bits = self.options.reinterpret_dtypes or _raw_bits(dev.dtype) or _raw_bits(host.dtype)
        if dev.dtype != host.dtype and not same_bits:
            # Bytes are copied as they are: an fp16 buffer for a bf16 cache would read garbage.
            raise TypeError(
                f"{where}: device cache is {dev.dtype} but host buffer is {host.dtype}; the copy moves bytes, "
                f"so the host would hold {dev.dtype} bits read as {host.dtype}. Use one dtype on both sides, view "
                "one side as a raw integer type (e.g. .view(torch.int16)), or pass reinterpret_dtypes=True"
            )
        self.device_layouts[name], self.host_layouts[name] = dl, hl

    def _direction(self, src_side: str, dst_side: str) -> _Direction:
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
                key = (region_key(src_t[name], src_l[name]), region_key(dst_t[name], dst_l[name]))
                if key not in entry_of:
                    entry_of[key] = len(entries)
                    entries.append(name)
                if entry_of[key] not in mine:
                    mine.append(entry_of[key])
            group_entries.append(mine)
        alias_classes, row_pairs = check_destinations(entries, group_entries, dst_t, dst_l, dst_side)
        tables = build_tables(
            group_entries,
            [(src_t[n], src_l[n]) for n in entries],
            [(dst_t[n], dst_l[n]) for n in entries],
            entries,
            staging="dst" if dst_side == "host" else "src",
        )
        tables.max_ctas = self.options.max_ctas
        backend = self.options.copy_backend
        chosen = choose_backend(tables) if backend == "auto" else get_backend(backend)
        reason = chosen.unsupported_reason(tables)
        if reason:
            raise ValueError(f"backend {chosen.name!r} cannot copy {src_side}->{dst_side}: {reason}")
        chosen.prepare(tables)
        groups = self.layer_groups
        planner = CallPlanner(tables, planner_limits(groups, src_l), planner_limits(groups, dst_l), alias_classes,
                              (src_side, dst_side), [layers[0] if layers else "-" for layers in groups],
                              origin=object())
        return _Direction(tables, chosen, planner, dst_side, row_pairs)

    # ------------------------------------------------------------------ calls
    @property
    def copy_backend(self) -> str:
        """Name of the copy backend in use (the same for both directions unless ``auto``)."""
        built = self._d2h or self._h2d
        assert built is not None, "a BlockCopier has at least one direction"
        return built.backend.name

    def copy_backends(self) -> Dict[str, str]:
        """The copy backend of each built direction, by method name (``to_host``, ``to_device``)."""
        return {side: d.backend.name for side, d in (("to_host", self._d2h), ("to_device", self._h2d))
                if d is not None}

    def to_host(self, block_ids: IdLists, host_block_ids: Optional[IdLists] = None,
                checksums: Optional[torch.Tensor] = None, *, max_ctas: Optional[int] = None) -> CallPlan:
        """Device -> host: block ``block_ids[g][i]`` to host block ``host_block_ids[g][i]``.

        ``checksums``: an int64 tensor of one element per block of the call (group after
        group) on the copy's device, overwritten with each page's checksum as the copy
        computes it (:mod:`kvcopy.core.checksum`); the ``ce`` backend raises instead.
        ``max_ctas``: this call's grid cap (see the class docstring)."""
        return self._run("d2h", block_ids, block_ids if host_block_ids is None else host_block_ids, checksums,
                         max_ctas)

    def to_device(self, block_ids: IdLists, host_block_ids: Optional[IdLists] = None,
                  checksums: Optional[torch.Tensor] = None, *, max_ctas: Optional[int] = None) -> CallPlan:
        """Host -> device: host block ``host_block_ids[g][i]`` to block ``block_ids[g][i]``
        (``checksums`` and ``max_ctas`` as for :meth:`to_host`)."""
        return self._run("h2d", block_ids if host_block_ids is None else host_block_ids, block_ids, checksums,
                         max_ctas)

    def plan(self, direction: str, block_ids: IdLists, host_block_ids: Optional[IdLists] = None) -> CallPlan:
        """Validate and pack a call without copying (``"d2h"`` or ``"h2d"``); :meth:`run`
        copies it later without validating again. The plan is immutable (nothing in it
        can be edited between the two)."""
        host = block_ids if host_block_ids is None else host_block_ids
        d = self._built(direction)
        return self._validate(d, block_ids, host) if direction == "d2h" else self._validate(d, host, block_ids)

    def plan_flat(self, direction: str, block_ids, host_block_ids, lens) -> CallPlan:
        """:meth:`plan` of ids as flat int64 numpy arrays, every group's concatenated, and
        ``lens`` ids per group (:meth:`~kvcopy.core.planner.CallPlanner.plan_flat`)."""
        d = self._built(direction)
        if direction == "d2h":
            return self._validate(d, block_ids, host_block_ids, lens)
        return self._validate(d, host_block_ids, block_ids, lens)

    def split(self, direction: str, call: CallPlan, part_of_group, parts: int) -> List[CallPlan]:
        """A call planned here cut into ``parts`` calls by group (``part_of_group``: one
        part number per KV cache group, -1 for none): call ``p`` copies the groups of
        part ``p`` only, as :meth:`plan` of their ids alone would, without checking the
        ids again (:meth:`~kvcopy.core.planner.CallPlanner.split`). For a caller that
        runs one call's groups at different times (layer-wise staging: one unit per
        layer) and checks them once."""
        return self._planned(direction, call, "split").planner.split(call, part_of_group, parts)

    def run(self, direction: str, call: CallPlan, checksums: Optional[torch.Tensor] = None, *,
            max_ctas: Optional[int] = None) -> CallPlan:
        """Copy a call this copier planned with :meth:`plan` for ``direction`` (the ids
        were checked then; the storages are checked now, as for every call);
        ``checksums`` and ``max_ctas`` as for :meth:`to_host`."""
        self._copy(self._planned(direction, call), call, checksums, None, max_ctas)
        return call

    def run_and_fold(self, direction: str, call: CallPlan, checksums: torch.Tensor, fold: SumFold, *,
                     max_ctas: Optional[int] = None) -> Optional[int]:
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
        return self._copy(d, call, checksums, fold, max_ctas)

    def _planned(self, direction: str, call: CallPlan, what: str = "run") -> _Direction:
        d = self._built(direction)
        if type(call) is not CallPlan or call.origin is not d.planner.origin:
            raise ValueError(f"{what}: not a {direction!r} call planned by this BlockCopier")
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
             checksums: Optional[torch.Tensor] = None, max_ctas: Optional[int] = None) -> CallPlan:
        d = self._built(direction)
        call = self._validate(d, src_ids, dst_ids)
        self._copy(d, call, checksums, None, max_ctas)
        return call

    def _copy(self, d: _Direction, call: CallPlan, checksums: Optional[torch.Tensor],
              fold: Optional[SumFold] = None, max_ctas: Optional[int] = None) -> Optional[int]:
        if max_ctas is not None:
            max_ctas = check_max_ctas(max_ctas)
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
                return d.backend.copy_with_checksums_folded(d.tables, call, checksums, fold.at, max_ctas=max_ctas)
            d.backend.copy_with_checksums(d.tables, call, checksums, max_ctas=max_ctas)
        elif call.num_items:
            self._storages.check()
            d.backend.copy(d.tables, call, max_ctas=max_ctas)
        return None

    def _validate(self, d: _Direction, src_ids, dst_ids, flat_lens=None) -> CallPlan:
        if self._closed:
            raise ValueError("BlockCopier is closed")
        call = d.planner.plan(src_ids, dst_ids) if flat_lens is None else \
            d.planner.plan_flat(src_ids, dst_ids, flat_lens)
        if d.row_pairs:
            check_shared_rows(d.row_pairs, call, d.dst_side)
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
