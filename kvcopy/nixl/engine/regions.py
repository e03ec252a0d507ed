"""Regions: the memory a manager registers with NIXL and the page geometry of each view.

Two levels, because layers alias (layers of different groups can be views of one
device storage; several layers can view the same bytes the same way):

* a **storage** is one registered byte range. Grouped layers whose device tensors are
  views of one device storage share it: in ``"host"`` mode the storage is one host
  buffer (pinned when the KV caches are on CUDA) covering the bytes those views can
  touch, and each layer's host tensor is the same view (same offset, shape, strides)
  of that buffer, so host page ``p`` of a layer mirrors device page ``p`` byte for
  byte. In ``"device"`` mode the storage is the device bytes themselves (VRAM, or DRAM
  for CPU tensors). A layer in no KV cache group (a KV-sharing layer) gets nothing: no
  host buffer, no region; it is never read or written.
* a **region** is one distinct page geometry inside a storage: the layers (of any
  group) that view the same bytes the same way. It knows its members ``(layer, group)``
  and everything a peer needs to pair and address it: page count, chunks per page (2
  for KV-first ``[2, NB, ...]``, else 1), chunk bytes, page and chunk strides, dtype,
  layout, tokens per page, KV heads (total, and which this rank holds), head size.

Descriptors are per kernel page and per chunk: region ``r`` owns the rows
``offset[r] : offset[r] + num_chunks * num_pages`` of the manager's descriptor list,
chunk-major (row ``offset[r] + c * num_pages + p`` is chunk ``c`` of page ``p``), so a
run of consecutive pages of one chunk is a run of consecutive rows of adjacent memory,
which NIXL merges into one segment when the transfer is made.

Everything a peer needs is in :class:`RegionInfo`, a plain serializable record; the
local side keeps the tensors in :class:`RegionSet`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ...checks import per_group_counts
from ...core.layout import PageLayout, byte_extent, chunks_disjoint, describe

BUFFER_MODES = ("host", "device")  # the manager adds "arena" (kvcopy.nixl.modes.arena)
MEM_TYPES = ("DRAM", "VRAM")
LAYOUT_KINDS = ("kv_first", "blocks_first", "mla", "flat")  # kvcopy.core.layout's kinds
AXIS_NAMES = ("token", "head") + tuple(f"o{i}" for i in range(8))
# Largest values a peer's region may declare (checked by kvcopy.nixl.wire.region_record).
# The engine-relative limits (descriptors, layers) are in kvcopy.nixl.engine.info.
MAX_PAGES = 1 << 31
MAX_CHUNKS = 64
MAX_BYTES = 1 << 48  # strides, chunk bytes, sizes
MAX_DIMS = 8
MAX_HEADS = 1 << 16
MAX_TOKENS_PER_PAGE = 1 << 20
MAX_GROUPS = 64
MAX_LAYERS = 4096  # the largest models have ~130 attention layers
MAX_NAME = 256
MAX_DEVICE_ID = (1 << 16) - 1
DTYPE_SIZES = {
    name: getattr(torch, name).itemsize
    for name in ("float16", "bfloat16", "float32", "float64", "uint8", "int8", "int16", "int32", "int64",
                 "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                 "float8_e5m2fnuz", "float8_e8m0fnu")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_HOST_ALIGN = 64  # host buffers start at an address with the device span's alignment mod 64


@dataclass(frozen=True)
class RegionInfo:
    """One region, as advertised in the handshake (addresses are the owner's)."""

    index: int
    members: Tuple[Tuple[str, int], ...]  # (layer name, KV cache group)
    address: int  # chunk 0 of page 0
    device_id: int
    num_pages: int
    num_chunks: int
    chunk_bytes: int
    page_stride: int  # bytes from page p to p + 1
    chunk_stride: int  # bytes from chunk c to c + 1 of one page (0 with one chunk)
    dtype: str
    itemsize: int
    page_shape: Tuple[Tuple[int, Optional[int]], ...]  # PageLayout.page_geometry: in-page (size, stride)
    kind: str  # layout kind from kvcopy.core.layout: kv_first, blocks_first, mla, flat
    kv_layout: str  # "NHD" or "HND": which in-page axis is tokens, which heads
    tokens_per_page: int
    total_kv_heads: Optional[int]  # the model's KV heads for these layers (None: MLA/unknown)
    heads: Optional[Tuple[int, int]]  # (first head, count) this rank holds
    head_size: Optional[int]
    # In-chunk axes (name, size, stride in elements) in tensor order, names "token",
    # "head", "o0", "o1"...; None where the layout names no token axis or a chunk axis
    # is the token or head axis. Plans slice token pieces and head ranges with it.
    axes: Optional[Tuple[Tuple[str, int, int], ...]] = None

    @property
    def layers(self) -> Tuple[str, ...]:
        return tuple(name for name, _ in self.members)

    @property
    def num_descriptors(self) -> int:
        return self.num_chunks * self.num_pages

    def descriptors(self) -> np.ndarray:
        """``[num_chunks * num_pages, 3]`` uint64 (address, bytes, device id), chunk-major."""
        pages = np.arange(self.num_pages, dtype=np.uint64) * np.uint64(self.page_stride)
        rows = np.empty((self.num_chunks, self.num_pages, 3), dtype=np.uint64)
        for c in range(self.num_chunks):
            rows[c, :, 0] = np.uint64(self.address + c * self.chunk_stride) + pages
        rows[:, :, 1] = self.chunk_bytes
        rows[:, :, 2] = self.device_id
        return rows.reshape(-1, 3)

    def check_consistent(self, where: str) -> None:
        """The fields of one region agree with each other, as :func:`build_regions` makes them."""
        problems = self._extent_problems() + self._shape_problems()
        if problems:
            raise ValueError(f"{where}: " + "; ".join(problems))

    def _extent_problems(self) -> List[str]:
        """Chunks, pages, address and heads against each other."""
        problems = []
        if self.chunk_bytes % self.itemsize:
            problems.append(f"chunk bytes {self.chunk_bytes} not a multiple of itemsize {self.itemsize}")
        if (self.num_chunks == 1) != (self.chunk_stride == 0):
            problems.append(f"chunk stride {self.chunk_stride} with {self.num_chunks} chunk(s)")
        if self.num_pages > 1 and not chunks_disjoint(self.num_pages, self.page_stride, self.num_chunks,
                                                      self.chunk_stride, self.chunk_bytes):
            problems.append("its pages or chunks overlap")
        span = (self.num_pages - 1) * self.page_stride + (self.num_chunks - 1) * self.chunk_stride + self.chunk_bytes
        if self.address + span > 1 << 64:
            problems.append(f"address {self.address:#x} + {span} bytes overflows 64 bits")
        if self.heads is not None and self.total_kv_heads is None:
            problems.append("KV heads held without total KV heads")
        if self.heads is not None and self.total_kv_heads is not None and \
                self.heads[0] + self.heads[1] > self.total_kv_heads:
            problems.append(f"KV heads held {self.heads} (first, count) outside {self.total_kv_heads} total")
        return problems

    def _shape_problems(self) -> List[str]:
        """The page shape and the named axes against the chunk bytes, tokens and heads."""
        problems = []
        chunk_dims = [size for size, stride in self.page_shape if stride is None]
        elems = math.prod(size for size, stride in self.page_shape if stride is not None)
        if chunk_dims not in ([], [self.num_chunks]) or (self.num_chunks > 1) != bool(chunk_dims):
            problems.append(f"page shape {list(self.page_shape)} vs {self.num_chunks} chunk(s)")
        elif elems * self.itemsize != self.chunk_bytes:
            problems.append(f"page shape {list(self.page_shape)} holds {elems * self.itemsize} bytes per chunk, "
                            f"chunk bytes {self.chunk_bytes}")
        if self.axes is None:
            return problems
        names = [n for n, _, _ in self.axes]
        elems = math.prod(size for _, size, _ in self.axes)
        if len(set(names)) != len(names):
            problems.append(f"axis names repeat: {names}")
        if elems * self.itemsize != self.chunk_bytes:
            problems.append(f"axes {list(self.axes)} hold {elems * self.itemsize} bytes, a chunk {self.chunk_bytes}")
        sizes = {n: s for n, s, _ in self.axes}
        if sizes.get("token", self.tokens_per_page) != self.tokens_per_page:
            problems.append(f"token axis of {sizes['token']} vs {self.tokens_per_page} tokens per page")
        if "head" in sizes and (self.heads is None or sizes["head"] != self.heads[1]):
            problems.append(f"head axis of {sizes['head']} vs KV heads held {self.heads}")
        return problems


class RegionRef(NamedTuple):
    """The addressing of one region, as a plan needs it (offsets relative to page 0).
    A tuple: plans share these with the engine record they were made from, so nothing
    reachable from a plan handed out can change them."""

    index: int  # type: ignore[assignment]  # the field shadows tuple.index, which nothing here calls
    num_pages: int
    num_chunks: int
    chunk_bytes: int
    page_stride: int
    chunk_stride: int

    @classmethod
    def of(cls, r: RegionInfo) -> "RegionRef":
        return cls(r.index, r.num_pages, r.num_chunks, r.chunk_bytes, r.page_stride, r.chunk_stride)


@dataclass
class Storage:
    """One registered byte range."""

    address: int
    nbytes: int
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    host_buffer: Optional[torch.Tensor]  # host mode: the uint8 buffer (kept alive here)
    layers: Tuple[str, ...]


@dataclass
class RegionSet:
    """The local regions, their storages and the tensors NIXL moves bytes in and out of."""

    buffer: str
    regions: List[RegionInfo]
    storages: List[Storage]
    transfer_tensors: Dict[str, torch.Tensor]  # per grouped layer: host view or device cache
    host_views: Dict[str, torch.Tensor]  # host mode only
    layouts: Dict[str, PageLayout]  # device layout per grouped layer
    descriptor_offsets: np.ndarray  # int64 [R + 1]

    @property
    def mem_type(self) -> str:
        return self.storages[0].mem_type if self.storages else "DRAM"

    def descriptors(self) -> np.ndarray:
        return descriptor_table(self.regions)[0]


def sum_slots(regions: Sequence[RegionInfo], num_groups: int) -> np.ndarray:
    """Host mode's page-sums region: int64 ``[G + 1]`` offsets, group ``g`` owning 8-byte
    slots ``offsets[g]:offsets[g + 1]``, one per page id every region of the group holds
    (the fewest pages among them; none for a group without regions)."""
    pages = [0] * num_groups
    seen = [False] * num_groups
    for r in regions:
        for g in {g for _, g in r.members}:
            pages[g] = r.num_pages if not seen[g] else min(pages[g], r.num_pages)
            seen[g] = True
    offsets = np.zeros(num_groups + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(pages)
    return offsets


def descriptor_table(regions: Sequence[RegionInfo]) -> Tuple[np.ndarray, np.ndarray]:
    """Every region's descriptors, concatenated in region order, and int64 ``[R + 1]``
    offsets: region ``r`` owns rows ``offsets[r]:offsets[r + 1]``."""
    offsets = np.zeros(len(regions) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([r.num_descriptors for r in regions])
    if not regions:
        return np.empty((0, 3), dtype=np.uint64), offsets
    return np.concatenate([r.descriptors() for r in regions]), offsets


def tokens_per_group(tokens_per_block, tokens_per_page, n_groups: int) -> Tuple[List[int], List[int]]:
    """Per group (tokens per logical block, tokens per kernel page): an int or one int
    per group each (:func:`kvcopy.checks.per_group_counts`), positive, pages dividing blocks."""
    tpb = per_group_counts(tokens_per_block, n_groups, "tokens_per_block", minimum=1)
    tpp = list(tpb) if tokens_per_page is None else per_group_counts(tokens_per_page, n_groups, "tokens_per_page",
                                                                     minimum=1)
    for g, (b, p) in enumerate(zip(tpb, tpp)):
        if b % p:
            raise ValueError(f"group {g}: tokens_per_block {b} is not a multiple of tokens_per_page {p}")
    return tpb, tpp


def chunk_axes_of(t: torch.Tensor, layout: PageLayout) -> Optional[Tuple[Tuple[str, int, int], ...]]:
    """In-chunk axes of a layer tensor, named from its layout (see ``RegionInfo.axes``)."""
    if layout.token_dim is None:
        return None
    chunk_axis = None
    if layout.num_chunks > 1:
        found = [d for d in range(t.dim()) if d != layout.block_dim and t.shape[d] == layout.num_chunks
                 and t.stride(d) * layout.itemsize == layout.chunk_stride]
        if not found:
            return None
        chunk_axis = found[0]
        if chunk_axis in (layout.token_dim, layout.head_dim):
            return None
    out, other = [], 0
    for d in range(t.dim()):
        if d in (layout.block_dim, chunk_axis):
            continue
        if d == layout.token_dim:
            name = "token"
        elif d == layout.head_dim:
            name = "head"
        else:
            name, other = f"o{other}", other + 1
        out.append((name, int(t.shape[d]), int(t.stride(d))))
    return tuple(out)


def _heads(name: str, t: torch.Tensor, layout: PageLayout, total, tp_rank: int, tp_size: int):
    """(total KV heads, (first held, count), head size) of one layer on this rank."""
    if layout.head_dim is None:
        return None, None, int(t.shape[-1]) if layout.kind == "mla" else None
    local = int(t.shape[layout.head_dim])
    head_size = int(t.shape[-1])
    total = total.get(name) if isinstance(total, Mapping) else total
    if total is None:
        total = local * tp_size
    total = int(total)
    if total >= tp_size:
        if local * tp_size != total:
            raise ValueError(
                f"layer {name!r}: {local} KV heads on this rank x TP {tp_size} != {total} total KV heads"
            )
        return total, (tp_rank * local, local), head_size
    if local != 1:  # fewer heads than ranks: each rank holds one replicated head
        raise ValueError(
            f"layer {name!r}: {total} KV heads over TP {tp_size} means one head per rank, tensor has {local}"
        )
    return total, (tp_rank * total // tp_size, 1), head_size


def build_regions(
    device_caches: Mapping[str, torch.Tensor],
    layer_groups: Sequence[Sequence[str]],
    tokens_per_page: Sequence[int],
    buffer: str = "host",
    block_dim=None,
    kv_layout: str = "NHD",
    tp_rank: int = 0,
    tp_size: int = 1,
    total_kv_heads=None,
) -> RegionSet:
    """Allocate host buffers (host mode) and describe every region; registers nothing."""
    if buffer not in BUFFER_MODES:
        raise ValueError(f"buffer must be one of {BUFFER_MODES}, got {buffer!r}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    group_of = _group_of(device_caches, layer_groups)
    layouts = _layouts(device_caches, group_of, tokens_per_page, block_dim, kv_layout)
    storages, transfer_tensors, host_views, storage_of = _storages(device_caches, list(group_of), buffer)
    # Regions: grouped layers by the exact bytes and geometry they view. Two views of the
    # same bytes with other in-page shapes (vLLM's groups overlaid from byte 0: 4 heads x
    # 16 tokens against 2 x 32, attention pages against GDN state rows) are two regions.
    key_to_region: Dict[tuple, int] = {}
    members: List[List[Tuple[str, int]]] = []
    for name in group_of:
        t, l = transfer_tensors[name], layouts[name]
        key = (storage_of[name], t.data_ptr(), l.block_stride, l.chunk_stride, l.chunk_bytes,
               l.num_chunks, l.num_blocks, l.kind, l.page_geometry)
        if key not in key_to_region:
            key_to_region[key] = len(members)
            members.append([])
        members[key_to_region[key]].append((name, group_of[name]))
    def heads(name: str):
        return _heads(name, device_caches[name], layouts[name], total_kv_heads, tp_rank, tp_size)

    regions = [_region(r, mem, transfer_tensors, layouts, storages[storage_of[mem[0][0]]], tokens_per_page,
                       kv_layout, heads) for r, mem in enumerate(members)]
    return RegionSet(
        buffer=buffer, regions=regions, storages=storages, transfer_tensors=transfer_tensors,
        host_views=host_views, layouts=layouts, descriptor_offsets=descriptor_table(regions)[1],
    )


def _group_of(device_caches: Mapping[str, torch.Tensor], layer_groups: Sequence[Sequence[str]]) -> Dict[str, int]:
    """Each grouped layer's group, in group order; a layer in two groups, or without a
    cache, raises, as do caches on several devices."""
    group_of: Dict[str, int] = {}
    for g, layers in enumerate(layer_groups):
        for name in layers:
            if name in group_of:
                raise ValueError(f"layer {name!r} is in group {group_of[name]} and group {g}")
            if name not in device_caches:
                raise ValueError(f"group {g}, layer {name!r}: no device cache for this layer")
            group_of[name] = g
    if not group_of:
        raise ValueError("no layer in any KV cache group: nothing to register")
    devices = {device_caches[n].device for n in group_of if isinstance(device_caches[n], torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(f"KV caches on several devices {sorted(map(str, devices))}: one manager per device")
    return group_of


def _layouts(device_caches: Mapping[str, torch.Tensor], group_of: Mapping[str, int], tokens_per_page: Sequence[int],
             block_dim, kv_layout: str) -> Dict[str, PageLayout]:
    """Each grouped layer's page layout, its token axis checked against its group's page size."""
    layouts: Dict[str, PageLayout] = {}
    for name, g in group_of.items():
        t = device_caches[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"layer {name!r}: device cache is a {type(t).__name__}, not a tensor")
        bd = block_dim.get(name) if isinstance(block_dim, Mapping) else block_dim
        try:
            layouts[name] = layout = describe(t, bd, kv_layout)
        except ValueError as exc:
            raise ValueError(f"group {g}, layer {name!r}: {exc}") from None
        tpp = tokens_per_page[g]
        if layout.token_dim is not None and t.shape[layout.token_dim] != tpp:
            raise ValueError(
                f"group {g}, layer {name!r}: the tensor's token axis {layout.token_dim} "
                f"holds {t.shape[layout.token_dim]} tokens per page, the group says {tpp}"
            )
    return layouts


def _storages(device_caches: Mapping[str, torch.Tensor], grouped: Sequence[str], buffer: str):
    """(storages, transfer tensor per layer, host view per layer, storage index per
    layer): grouped layers by the device storage they view; in host mode one host buffer
    per storage, each layer's host view at its device view's offset, shape and strides."""
    by_storage: Dict[tuple, List[str]] = {}
    for name in grouped:
        t = device_caches[name]
        by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(name)
    pin = any(device_caches[n].device.type == "cuda" for n in grouped) and torch.cuda.is_available()
    storages: List[Storage] = []
    transfer_tensors: Dict[str, torch.Tensor] = {}
    host_views: Dict[str, torch.Tensor] = {}
    storage_of: Dict[str, int] = {}
    for (device, _), names in by_storage.items():
        extents = [byte_extent(device_caches[n]) for n in names]
        lo = min(s for s, _ in extents) // _HOST_ALIGN * _HOST_ALIGN
        hi = max(e for _, e in extents)
        if buffer == "host":
            nbytes = -(-(hi - lo) // _HOST_ALIGN) * _HOST_ALIGN
            host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
            for n in names:
                d = device_caches[n]
                words = host.view(d.dtype)
                host_views[n] = torch.as_strided(words, d.shape, d.stride(), (d.data_ptr() - lo) // d.element_size())
                transfer_tensors[n] = host_views[n]
            storages.append(Storage(host.data_ptr(), nbytes, "DRAM", 0, host, tuple(names)))
        else:
            dev_id = (device.index or 0) if device.type == "cuda" else 0
            storages.append(Storage(lo, hi - lo, "VRAM" if device.type == "cuda" else "DRAM", dev_id, None,
                                    tuple(names)))
            for n in names:
                transfer_tensors[n] = device_caches[n]
        for n in names:
            storage_of[n] = len(storages) - 1
    return storages, transfer_tensors, host_views, storage_of


def _region(r: int, mem: List[Tuple[str, int]], transfer_tensors, layouts, storage: Storage,
            tokens_per_page: Sequence[int], kv_layout: str, heads: Callable[[str], tuple]) -> RegionInfo:
    """Region ``r``: its member layers (which view the same bytes the same way) must
    agree on tokens per page and KV heads."""
    name = mem[0][0]
    t, l = transfer_tensors[name], layouts[name]
    tpps = {tokens_per_page[g] for _, g in mem}
    if len(tpps) > 1:
        raise ValueError(f"layers {[n for n, _ in mem]} share one tensor but their groups "
                         f"disagree on tokens per page: {sorted(tpps)}")
    held = {heads(n) for n, _ in mem}
    if len(held) > 1:
        raise ValueError(f"layers {[n for n, _ in mem]} share one tensor but disagree on KV heads")
    total, own, head_size = held.pop()
    return RegionInfo(
        index=r, members=tuple(mem), address=t.data_ptr(), device_id=storage.device_id,
        num_pages=l.num_blocks, num_chunks=l.num_chunks, chunk_bytes=l.chunk_bytes,
        page_stride=l.block_stride, chunk_stride=l.chunk_stride, dtype=str(l.dtype).replace("torch.", ""),
        itemsize=l.itemsize, page_shape=tuple(l.page_geometry), kind=l.kind, kv_layout=kv_layout,
        tokens_per_page=tpps.pop(), total_kv_heads=total, heads=own, head_size=head_size,
        axes=chunk_axes_of(t, l),
    )
