"""The two buffer modes that read P's pages straight into D's pages: ``"host"`` (a
pinned mirror of each device storage, :class:`MirrorMode`) and ``"device"`` (the KV
tensors themselves, :class:`DeviceMode`).

Both register every storage of :func:`~kvcopy.nixl.engine.regions.build_regions` and prepare
one local descriptor per page chunk once; a pull's READ rows index those lists (pairs
moving whole chunks) or are explicit rows (pairs with byte segments), built by
:mod:`kvcopy.nixl.planning.descriptors` in a fixed number of numpy calls. Plans come from the
planner (:mod:`kvcopy.nixl.planning.plan`) with routes cached per set of peers, keyed by the
peers' keys (:mod:`kvcopy.nixl.modes.keyed_cache`, at most :data:`ROUTE_CACHE_SIZE` sets).

Host mode: P's ``save`` is one masked d2h (``BlockCopier.to_host``) into the mirror, D's
``complete`` zeroes the rows past the prompt in the mirror pages NIXL wrote and D's
pages allocated past the prompt, then one masked h2d of the pages read. The h2d is
planned (checked) when the pull is planned, so ``complete`` cannot fail after the READ
on a bad id. Device mode: NIXL reads P's KV into D's KV; ``complete`` only zeroes.

A plan's READ rows and the rows ``complete`` zeroes are made when it is planned
(:class:`PagedWork`), so what a pull writes never depends on the plan object the caller
holds. A READ given up on before it ended may still land (docs/nixl.md, "Late READs"):
its rows are *held* (:meth:`PagedMode.hold`) until NIXL reports it ended, and a pull
that would read or zero into a held byte raises :class:`~kvcopy.nixl.pull.PagesHeld`
before anything is posted. The check compares byte ranges (the local descriptor rows
and zero runs, by address), so aliased layers and groups are covered; it costs nothing
while no READ is held.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ...core.copier import BlockCopier
from ...core.layout import as_words
from .base import BufferMode, Peer, Read
from ..planning.descriptors import check_pairs, desc_rows, index_rows, same_ref
from ..engine.info import EngineInfo
from .keyed_cache import KeyedCache
from ..options import ManagerOptions
from ..planning.plan import NO_BLOCK, PullPlan, build_multi_pull_plan, expand_blocks, request_block_ids
from ..pull import PagesHeld
from ..engine.regions import RegionSet, build_regions
from ..planning.routes import plan_routes
from .rows import byte_index, merged, overlaps, zero_runs
from ..engine.info import SumsRegion
from .mirror_sums import HostCheck, HostSums, PendingSums
from ..sum_check import SumCheck, SumStats

ROUTE_CACHE_SIZE = 256  # sets of peers whose routes are kept (one per TP-rank set a D rank reads)


class PagedWork(NamedTuple):
    """What a host- or device-mode pull does, made when it is planned: its READs (rows
    checked against both sides; arrays nobody else holds) and the rows of read pages
    past the prompt that ``complete`` zeroes, as (layer, pages, page stride, chunks,
    chunk stride, (offset, bytes) per chunk)."""

    reads: Tuple[Read, ...]
    zero_rows: Tuple[Tuple[str, Tuple[int, ...], int, int, int, Tuple[Tuple[int, int], ...]], ...]
    read_pages: Tuple[Tuple[int, ...], ...]
    zero_pages: Tuple[Tuple[int, ...], ...]
    local_block_ids: Tuple[Tuple[int, ...], ...]
    check: Optional[HostCheck] = None  # host mode: what complete's page sums are compared with
    unchecked: Optional[str] = "device mode carries no page sums"  # else why they are not


class PagedMode(BufferMode):
    """What host and device mode share (see the module docstring)."""

    zeroes_registered_pages = False  # complete() zeroes whole pages in the memory NIXL writes

    def __init__(self, regions: RegionSet, device_caches: Mapping[str, torch.Tensor], layer_groups):
        self.regions = regions
        self.region_infos = tuple(regions.regions)
        self.mem_type = regions.mem_type
        self._groups = [tuple(g) for g in layer_groups]
        self._caches = {n: device_caches[n] for g in self._groups for n in g}
        self.on_cuda = any(t.device.type == "cuda" for t in self._caches.values())
        self._local_offsets = regions.descriptor_offsets.tolist()  # descriptor row of each region
        self._routes = KeyedCache(ROUTE_CACHE_SIZE)
        # works whose READ was given up on: id -> (work, pull id, starts, ends of the bytes it may write)
        self._held: Dict[int, Tuple[PagedWork, int, np.ndarray, np.ndarray]] = {}
        self._descriptors: Optional[np.ndarray] = None  # the local descriptor table, built on first need

    def registrations(self):
        return [(s.address, s.nbytes, s.device_id, s.mem_type) for s in self.regions.storages]

    def local_descriptors(self) -> Optional[np.ndarray]:
        return self.regions.descriptors()

    # ---------------------------------------------------------------- P side
    def stage(self, info, block_ids, num_tokens, request_id, readers, waits, count_failure):
        if waits:
            raise ValueError(f"space_timeout_s: arena mode only ({self.name} mode has no spans to wait for)")
        ids = request_block_ids(info, block_ids, "block_ids")
        pages: List[Any] = [expand_blocks(a[a != NO_BLOCK], b // p)  # int64 arrays: the copier takes them
                            for a, b, p in zip(ids, info.tokens_per_block, info.tokens_per_page)]
        return self._save(pages)

    def _save(self, pages: List[Any]) -> Optional[PendingSums]:
        """P's pages (per group) become readable by a peer (their sums pending on CUDA)."""
        return None

    def on_notifications(self, new) -> None:
        """Nothing to free: a request holds no memory of this mode (P frees its blocks)."""

    # ---------------------------------------------------------------- D side
    def plan(self, info, peers, remote, num_tokens, local_block_ids, num_cached_tokens, request_id=None):
        sources = [(p.info, p.layer_pairs) for p in peers]
        if not isinstance(remote, Mapping) and len(peers) == 1:
            remote = {peers[0].name: remote}
        keys = tuple(p.key for p in peers)
        routes = self._routes.get(keys, lambda: plan_routes(info, sources), tags=keys)
        plan = build_multi_pull_plan(info, sources, remote, num_tokens, local_block_ids, num_cached_tokens,
                                     routes=routes)
        return plan, self._work(info, plan, {p.name: p for p in peers})

    def _work(self, info: EngineInfo, plan: PullPlan, peers: Mapping[str, Peer]) -> PagedWork:
        """The READ rows of ``plan``, checked against both sides, and the rows complete()
        zeroes: primitives and fresh arrays, nothing the plan object shares."""
        mine = info.region_refs
        by_peer: Dict[str, list] = {name: [] for name in plan.all_peers}
        zero_rows = []
        for pair in plan.pairs:
            if pair.zero_segments:
                if not same_ref(pair.local, mine) or any(
                        n <= 0 or off < 0 or off + n > pair.local.chunk_bytes for off, n in pair.zero_segments):
                    raise ValueError(f"plan zero segments {pair.zero_segments[:4]} do not fit region "
                                     f"{pair.local.index}")
                if pair.pages_to_zero:
                    ref = pair.local
                    zero_rows.append((pair.layers[0], tuple(pair.pages_to_zero), ref.page_stride, ref.num_chunks,
                                      ref.chunk_stride, tuple(pair.zero_segments)))
            if pair.local_pages:
                by_peer.get(plan.peer_of(pair), []).append(pair)
        reads = []
        for name, pairs in by_peer.items():
            peer = peers[name]
            pieces = check_pairs(pairs, info, peer.info, name)
            if all(not p.segments for p in pairs):
                local, remote = index_rows(pairs, pieces, self._local_offsets, peer.descriptor_offsets)
                prepared = True
            else:
                local, remote = desc_rows(pairs, pieces, info, peer.info)
                prepared = False
            local.setflags(write=False)
            remote.setflags(write=False)
            reads.append(Read(name, prepared, local, remote))
        return PagedWork(tuple(reads), tuple(zero_rows), plan.read_pages, plan.zero_pages, plan.local_block_ids)

    def reads(self, work) -> List[Read]:
        return list(work.reads)

    def complete(self, work) -> Tuple[Optional[SumCheck], Optional[str]]:
        self._zero_rows(work)
        self._zero_pages(work.zero_pages)
        return None, work.unchecked

    def _zero_rows(self, work: PagedWork) -> None:
        """Rows of read pages past the prompt (a plan's ``zero_segments``), in the
        tensors NIXL wrote (host buffers, or the device caches): the h2d then copies
        whole pages."""
        for layer, pages, page_stride, num_chunks, chunk_stride, segments in work.zero_rows:
            t = self.regions.transfer_tensors[layer]
            buf = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            base = int(t.storage_offset()) * t.element_size()
            starts, lens = zero_runs(pages, page_stride, base, num_chunks, chunk_stride, segments)
            buf.index_fill_(0, torch.as_tensor(byte_index(starts, lens), device=t.device), 0)

    # ---------------------------------------------------------------- late READs
    def hold(self, work, pull_id: int) -> None:
        starts, ends = self._lands(work)
        self._held[id(work)] = (work, pull_id, starts, ends)

    def unhold(self, work) -> None:
        self._held.pop(id(work), None)

    def check_writable(self, work) -> None:
        """Refuse a pull that reads or zeroes into bytes a held READ may still write."""
        if self._held:
            self._refuse_held(*self._writes(work), "this pull would read or zero into")

    def _refuse_held(self, starts: np.ndarray, ends: np.ndarray, what: str) -> None:
        hits = [(w, pid) for w, pid, hs, he in self._held.values() if overlaps(starts, ends, hs, he)]
        if not hits:
            return
        held = tuple(tuple(sorted({p for w, _ in hits for p in w.read_pages[g]})) for g in range(len(self._groups)))
        pulls = tuple(sorted(pid for _, pid in hits))
        raise PagesHeld(
            f"{what} local pages that the READ(s) of pull(s) {list(pulls)}, given up on before they ended, may "
            f"still write (held pages per group: {[list(p[:16]) for p in held]}); they are free again when NIXL "
            "reports those READs ended: retry later, or use other blocks", held, pulls)

    def _table(self) -> np.ndarray:
        if self._descriptors is None:
            descs = self.local_descriptors()
            self._descriptors = descs if descs is not None else self.regions.descriptors()
        return self._descriptors

    def _lands(self, work: PagedWork) -> Tuple[np.ndarray, np.ndarray]:
        """(starts, ends), merged: the bytes the READs of ``work`` write."""
        rows = [self._table()[r.local] if r.prepared else r.local for r in work.reads]
        rows = [r for r in rows if len(r)]
        if not rows:
            return merged(np.empty(0, np.int64), np.empty(0, np.int64))
        both = np.concatenate(rows).astype(np.int64)
        return merged(both[:, 0], both[:, 0] + both[:, 1])

    def _writes(self, work: PagedWork) -> Tuple[np.ndarray, np.ndarray]:
        """(starts, ends): every byte of registered memory the pull of ``work`` and its
        ``complete`` write (its READ rows, the rows it zeroes)."""
        starts, ends = self._lands(work)
        parts_s, parts_e = [starts], [ends]
        for layer, pages, page_stride, num_chunks, chunk_stride, segments in work.zero_rows:
            t = self.regions.transfer_tensors[layer]
            base = t.untyped_storage().data_ptr() + int(t.storage_offset()) * t.element_size()
            s, n = zero_runs(pages, page_stride, base, num_chunks, chunk_stride, segments)
            parts_s.append(s)
            parts_e.append(s + n)
        if self.zeroes_registered_pages:
            s, e = self._page_ranges(work.zero_pages)
            parts_s.append(s)
            parts_e.append(e)
        return np.concatenate(parts_s), np.concatenate(parts_e)

    def _page_ranges(self, pages: Sequence[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
        """(starts, ends): the whole pages ``pages`` (per group) in every registered
        region of their group."""
        parts_s, parts_e = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
        for region in self.region_infos:
            for g in {g for _, g in region.members}:
                if len(pages[g]):
                    s, n = zero_runs(pages[g], region.page_stride, region.address, region.num_chunks,
                                     region.chunk_stride, ((0, region.chunk_bytes),))
                    parts_s.append(s)
                    parts_e.append(s + n)
        return np.concatenate(parts_s), np.concatenate(parts_e)

    def free(self, work) -> None:
        """Nothing to free: the pages a plan writes are the request's own, the caller's to reuse."""

    def stats(self) -> Dict[str, int]:
        return {"held_reads": len(self._held)}

    def memory(self) -> List[object]:
        return list(self.regions.transfer_tensors.values())

    def _zero_pages(self, zero_pages: Sequence[Sequence[int]]) -> None:
        """D's pages allocated past the prompt, in every distinct tensor view of their group."""
        for g, pages in enumerate(zero_pages):
            if not pages:
                continue
            seen = set()
            for name in self._groups[g]:
                t = self._caches[name]
                layout = self.regions.layouts[name]
                key = (t.data_ptr(), layout.block_stride, layout.block_dim)
                if key in seen:
                    continue
                seen.add(key)
                ids = torch.as_tensor(pages, dtype=torch.int64, device=t.device)
                as_words(t).index_fill_(layout.block_dim, ids, 0)

    def forget(self, peer: Peer) -> None:
        self._routes.forget(peer.key)

    def close(self) -> None:
        self._routes.clear()


class MirrorMode(PagedMode):
    """``buffer="host"``: a pinned host mirror of each device storage."""

    name = "host"
    written_in = "host buffers"

    def __init__(self, regions: RegionSet, device_caches, layer_groups, tokens_per_page, opts: ManagerOptions):
        super().__init__(regions, device_caches, layer_groups)
        self._copier = BlockCopier(self._caches, regions.host_views, self._groups, options=opts)
        self.sum_stats = SumStats()
        self.sums: Optional[HostSums] = None  # the page-sums region (kvcopy.nixl.modes.mirror_sums), checksum=True
        if opts.checksum:
            try:
                device = next(iter(self._caches.values())).device
                self.sums = HostSums(regions, self._copier, tokens_per_page, self.on_cuda, device, self.sum_stats)
            except Exception:
                self._copier.close()
                raise

    @classmethod
    def build(cls, device_caches, layer_groups, tokens_per_page, opts: ManagerOptions) -> "MirrorMode":
        regions = build_regions(device_caches, layer_groups, tokens_per_page, "host", opts.block_dim, opts.kv_layout,
                                opts.tp_rank, opts.tp_size, opts.total_kv_heads)
        return cls(regions, device_caches, layer_groups, tokens_per_page, opts)

    @property
    def sums_region(self) -> Optional[SumsRegion]:
        return None if self.sums is None or not self.sums.region.nbytes else self.sums.region

    def registrations(self):
        out = super().registrations()
        region = self.sums_region
        if region is not None:
            out.append((region.address, region.nbytes, 0, "DRAM"))
        return out

    def local_descriptors(self) -> Optional[np.ndarray]:
        descs = self.regions.descriptors()
        return descs if self.sums is None or self.sums_region is None else np.concatenate([descs, self.sums.rows()])

    def _save(self, pages: List[Any]) -> Optional[PendingSums]:
        if self._held:  # the mirror pages this rank's own READs given up on may still write
            self._refuse_held(*self._page_ranges(pages), "save would write")
        if self.sums is not None:
            return self.sums.save(self._copier, pages)
        self._copier.to_host(pages)
        return None

    def plan(self, info, peers, remote, num_tokens, local_block_ids, num_cached_tokens, request_id=None):
        plan, work = super().plan(info, peers, remote, num_tokens, local_block_ids, num_cached_tokens)
        # complete() must not fail after the read: check its copy now
        self._copier.plan("h2d", [list(r) + list(z) for r, z in zip(work.read_pages, work.zero_pages)])
        if self.sums is None:
            return plan, work._replace(unchecked="checksum off on D")
        if len(peers) != 1 or len(work.reads) != 1:
            return plan, work._replace(unchecked="D reads this request from several peers")
        read, check, why = self.sums.plan(peers[0], plan, work.reads[0], bool(work.zero_rows), work.read_pages,
                                          int(self.regions.descriptor_offsets[-1]))
        return plan, work._replace(reads=(read,), check=check, unchecked=why)

    def complete(self, work) -> Tuple[Optional[SumCheck], Optional[str]]:
        super().complete(work)
        if work.check is None or self.sums is None:
            self._copier.to_device([list(p) for p in work.read_pages])
            self.sum_stats.unchecked()
            return None, work.unchecked
        return self.sums.complete(self._copier, work.read_pages, work.check), None

    def stats(self) -> Dict[str, int]:
        out = super().stats()
        out.update(self.sum_stats.as_dict())
        return out

    def close(self) -> None:
        super().close()
        self._copier.close()


class DeviceMode(PagedMode):
    """``buffer="device"``: NIXL reads and writes the KV tensors themselves."""

    name = "device"
    written_in = "device caches"
    zeroes_registered_pages = True

    @classmethod
    def build(cls, device_caches, layer_groups, tokens_per_page, opts: ManagerOptions) -> "DeviceMode":
        if opts.require_checksum:
            raise ValueError("require_checksum: device mode carries no page sums; use host or arena mode")
        regions = build_regions(device_caches, layer_groups, tokens_per_page, "device", opts.block_dim,
                                opts.kv_layout, opts.tp_rank, opts.tp_size, opts.total_kv_heads)
        return cls(regions, device_caches, layer_groups)
