"""The two buffer modes that read P's pages straight into D's pages: ``"host"`` (a
pinned mirror of each device storage, :class:`MirrorMode`) and ``"device"`` (the KV
tensors themselves, :class:`DeviceMode`).

Both register every storage of :func:`~kvcopy.nixl.regions.build_regions` and prepare
one local descriptor per page chunk once; a pull's READ rows index those lists (pairs
moving whole chunks) or are explicit rows (pairs with byte segments), built by
:mod:`kvcopy.nixl.descriptors` in a fixed number of numpy calls. Plans come from the
planner (:mod:`kvcopy.nixl.plan`) with routes cached per set of peers, keyed by the
peers' keys (:mod:`kvcopy.nixl.keyed_cache`, at most :data:`ROUTE_CACHE_SIZE` sets).

Host mode: P's ``save`` is one masked d2h (``BlockCopier.to_host``) into the mirror, D's
``complete`` zeroes the rows past the prompt in the mirror pages NIXL wrote and D's
pages allocated past the prompt, then one masked h2d of the pages read. The h2d is
planned (checked) when the pull is planned, so ``complete`` cannot fail after the READ
on a bad id. Device mode: NIXL reads P's KV into D's KV; ``complete`` only zeroes.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch

from ..copier import BlockCopier
from ..layout import as_words
from .buffer_mode import BufferMode, Peer, Read
from .descriptors import check_pairs, desc_rows, index_rows, same_ref
from .handshake import EngineInfo
from .keyed_cache import KeyedCache
from .options import ManagerOptions
from .plan import NO_BLOCK, PullPlan, build_multi_pull_plan, expand_blocks, request_block_ids
from .regions import RegionSet, build_regions
from .routes import plan_routes
from .rows import byte_index, zero_runs

ROUTE_CACHE_SIZE = 256  # sets of peers whose routes are kept (one per TP-rank set a D rank reads)


class PagedMode(BufferMode):
    """What host and device mode share (see the module docstring)."""

    def __init__(self, regions: RegionSet, device_caches: Mapping[str, torch.Tensor], layer_groups):
        self.regions = regions
        self.region_infos = tuple(regions.regions)
        self.mem_type = regions.mem_type
        self._groups = [tuple(g) for g in layer_groups]
        self._caches = {n: device_caches[n] for g in self._groups for n in g}
        self.on_cuda = any(t.device.type == "cuda" for t in self._caches.values())
        self._local_offsets = regions.descriptor_offsets.tolist()  # descriptor row of each region
        self._routes = KeyedCache(ROUTE_CACHE_SIZE)

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
        self._save(pages)
        return None

    def _save(self, pages: List[Any]) -> None:
        """P's pages (per group) become readable by a peer."""

    def on_notifications(self, new) -> None:
        """Nothing to free: a request holds no memory of this mode (P frees its blocks)."""

    # ---------------------------------------------------------------- D side
    def plan(self, info, peers, remote, num_tokens, local_block_ids, num_cached_tokens) -> PullPlan:
        sources = [(p.info, p.layer_pairs) for p in peers]
        if not isinstance(remote, Mapping) and len(peers) == 1:
            remote = {peers[0].name: remote}
        keys = tuple(p.key for p in peers)
        routes = self._routes.get(keys, lambda: plan_routes(info, sources), tags=keys)
        return build_multi_pull_plan(info, sources, remote, num_tokens, local_block_ids, num_cached_tokens,
                                     routes=routes)

    def reclaim(self, handles_released: bool) -> None:
        """Nothing to reclaim: plans hold no memory of this mode."""

    def reads(self, info: EngineInfo, plan, peers: Mapping[str, Peer]) -> List[Read]:
        if not isinstance(plan, PullPlan):
            raise ValueError(f"a {type(plan).__name__} is not a plan of {self.name} mode")
        mine = info.region_refs
        by_peer: Dict[str, list] = {name: [] for name in plan.all_peers}
        for pair in plan.pairs:
            if pair.zero_segments:
                if not same_ref(pair.local, mine) or any(
                        n <= 0 or off < 0 or off + n > pair.local.chunk_bytes for off, n in pair.zero_segments):
                    raise ValueError(f"plan zero segments {pair.zero_segments[:4]} do not fit region "
                                     f"{pair.local.index}")
            if pair.local_pages:
                by_peer.get(plan.peer_of(pair), []).append(pair)
        reads = []
        for name, pairs in by_peer.items():
            peer = peers[name]
            pieces = check_pairs(pairs, info, peer.info, name)
            if all(not p.segments for p in pairs):
                rows = index_rows(pairs, pieces, self._local_offsets, peer.descriptor_offsets)
                reads.append(Read(name, True, *rows))
            else:
                reads.append(Read(name, False, *desc_rows(pairs, pieces, info, peer.info)))
        return reads

    def complete(self, plan) -> None:
        self._zero_rows(plan)
        self._zero_pages(plan.zero_pages)

    def free(self, plan, failed: bool, abandoned: bool, handles_released: bool) -> None:
        """Nothing to free: the pages a plan writes are the request's own, the caller's to reuse."""

    def _zero_rows(self, plan: PullPlan) -> None:
        """Rows of read pages past the prompt (a plan's ``zero_segments``), in the
        tensors NIXL wrote (host buffers, or the device caches): the h2d then copies
        whole pages."""
        for pair in plan.pairs:
            if not (pair.zero_segments and pair.pages_to_zero):
                continue
            t = self.regions.transfer_tensors[pair.layers[0]]
            buf = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            base = int(t.storage_offset()) * t.element_size()
            starts, lens = zero_runs(pair.pages_to_zero, pair.local.page_stride, base, pair.local.num_chunks,
                                     pair.local.chunk_stride, pair.zero_segments)
            buf.index_fill_(0, torch.as_tensor(byte_index(starts, lens), device=t.device), 0)

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

    def __init__(self, regions: RegionSet, device_caches, layer_groups, opts: ManagerOptions):
        super().__init__(regions, device_caches, layer_groups)
        self._copier = BlockCopier(self._caches, regions.host_views, self._groups, backend=opts.copy_backend,
                                   block_dim=opts.block_dim, kv_layout=opts.kv_layout)

    @classmethod
    def build(cls, device_caches, layer_groups, tokens_per_page, opts: ManagerOptions) -> "MirrorMode":
        regions = build_regions(device_caches, layer_groups, tokens_per_page, "host", opts.block_dim, opts.kv_layout,
                                opts.tp_rank, opts.tp_size, opts.total_kv_heads)
        return cls(regions, device_caches, layer_groups, opts)

    def _save(self, pages: List[Any]) -> None:
        self._copier.to_host(pages)

    def plan(self, info, peers, remote, num_tokens, local_block_ids, num_cached_tokens) -> PullPlan:
        plan = super().plan(info, peers, remote, num_tokens, local_block_ids, num_cached_tokens)
        # complete() must not fail after the read: check its copy now
        self._copier.plan("h2d", [list(r) + list(z) for r, z in zip(plan.read_pages, plan.zero_pages)])
        return plan

    def complete(self, plan) -> None:
        super().complete(plan)
        self._copier.to_device([list(p) for p in plan.read_pages])

    def close(self) -> None:
        super().close()
        self._copier.close()


class DeviceMode(PagedMode):
    """``buffer="device"``: NIXL reads and writes the KV tensors themselves."""

    name = "device"
    written_in = "device caches"

    @classmethod
    def build(cls, device_caches, layer_groups, tokens_per_page, opts: ManagerOptions) -> "DeviceMode":
        regions = build_regions(device_caches, layer_groups, tokens_per_page, "device", opts.block_dim,
                                opts.kv_layout, opts.tp_rank, opts.tp_size, opts.total_kv_heads)
        return cls(regions, device_caches, layer_groups)
