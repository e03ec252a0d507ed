"""What one engine rank advertises, and whether a peer can serve it: no bytes on the wire.

:class:`EngineInfo` is one rank's record (name, buffer mode, memory type, TP rank and
size, registration generation, tokens per block and per page of each KV cache group,
its :class:`~kvcopy.nixl.engine.regions.RegionInfo` list, NIXL's agent metadata, the
arena or page-sums region of its buffer mode). The handshake
(:mod:`kvcopy.nixl.wire.handshake`) encodes and checks it; planning reads it.

:func:`check_peer_limits` bounds what a peer may declare by the local engine
(descriptors, layers). :func:`pair_layers` decides, before any transfer, whether a peer
can serve this engine: every local grouped layer must exist on the peer with the same
meaning of its bytes (element size, layout kind, chunks, total KV heads, head size).
Everything that differs is listed in one ``ValueError``. Layers are paired by name,
each with its own group on each side, so the pairing is per (local group, remote
group). Different tokens per page, TP sizes (heads held) and NHD/HND orders are
accepted where both sides name their token and head axes: plans move token pieces and
head ranges.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Tuple

import numpy as np

from .geometry import chunk_axes
from .regions import MAX_LAYERS, RegionInfo, RegionRef, descriptor_table

MAX_TP = 1024
GENERATION_HEX = 16  # lowercase hex digits of a registration generation (64 random bits)
NO_GENERATION = "0" * GENERATION_HEX  # engines that register nothing (virtual engines, plan tests)
MAX_GROUP_PAGES = 1 << 62  # the page-id bound of a group without regions (EngineInfo.group_blocks)
MAX_TOKENS_PER_BLOCK = 1 << 20
# Limits that follow from the local engine (check_peer_limits): a peer of the same
# model has about as many layers, and a number of descriptors within what TP and page
# size ratios explain (TP 8 vs 1 times 4x smaller pages is 32x).
EXTRA_LAYERS = 64  # layers a peer may advertise beyond 2x this engine's grouped layers
DESCRIPTOR_FACTOR = 64  # a peer's descriptors: at most this many times this engine's ...
MIN_DESCRIPTOR_LIMIT = 1 << 20  # ... or this many, whichever is larger ...
MAX_DESCRIPTORS = 1 << 26  # ... and never more than this (24 bytes each at add_peer)
_MAX_LISTED = 12

# RegionInfo fields a pulled layer must agree on, with the words an error uses.
_MUST_MATCH = (
    ("itemsize", "element size"),
    ("page_shape", "in-page (size, stride) layout"),
    ("num_chunks", "chunks per page"),
    ("chunk_bytes", "chunk bytes"),
    ("kind", "layout kind"),
    ("kv_layout", "kv layout"),
    ("tokens_per_page", "tokens per page"),
    ("total_kv_heads", "total KV heads"),
    ("heads", "KV heads held (first, count)"),
    ("head_size", "head size"),
)
# ... where both sides name their token and head axes: pages then move in token pieces
# and head ranges, so tokens per page, heads held and NHD/HND may differ.
_MUST_MATCH_SLICED = (
    ("itemsize", "element size"),
    ("num_chunks", "chunks per page"),
    ("kind", "layout kind"),
    ("total_kv_heads", "total KV heads"),
    ("head_size", "head size"),
)


@dataclass(frozen=True)
class SumsRegion:
    """Host mode: where an engine keeps the page sums of its last save of each page
    (:mod:`kvcopy.nixl.modes.mirror_sums`): the registered range, 8 bytes per slot of
    :func:`~kvcopy.nixl.engine.regions.sum_slots`, and the fingerprint of how they are computed."""

    address: int
    nbytes: int
    layout: str  # LAYOUT_HEX lowercase hex digits

    def to_dict(self) -> dict:
        return {"address": self.address, "bytes": self.nbytes, "layout": self.layout}


@dataclass(frozen=True)
class EngineInfo:
    """One engine rank's side of the handshake."""

    name: str
    buffer: str
    mem_type: str
    tp_rank: int
    tp_size: int
    tokens_per_block: Tuple[int, ...]  # per KV cache group
    tokens_per_page: Tuple[int, ...]
    regions: Tuple[RegionInfo, ...]
    agent_metadata: bytes
    arena: Tuple[int, int] = (0, 0)  # "arena" mode: (address, bytes) of the registered staging arena
    sums: Optional[SumsRegion] = None  # "host" mode with checksums: the page-sums region
    generation: str = NO_GENERATION  # drawn per registration (TransferManager); records name it

    @property
    def num_groups(self) -> int:
        return len(self.tokens_per_block)

    def layers(self) -> Dict[str, Tuple[int, int]]:
        """layer name -> (group, region index)."""
        return {name: (g, r.index) for r in self.regions for name, g in r.members}

    # Derived per-region data, computed once per EngineInfo (the manager keeps one per
    # engine and per peer) instead of per plan and per pull. ``cached_property`` writes
    # the instance ``__dict__`` directly, so it works on this frozen dataclass; the
    # values are not fields (not compared, hashed or encoded).
    @cached_property
    def region_refs(self):
        """``RegionRef`` per region, by index: plans share these objects, so ``pull``
        recognizes its own regions by identity (a ``RegionRef.of`` per pair was a
        visible part of a 64-layer plan's host cost)."""
        return tuple(RegionRef.of(r) for r in self.regions)

    @cached_property
    def region_axes(self):
        """:func:`~kvcopy.nixl.engine.geometry.chunk_axes` per region, by index."""
        return tuple(chunk_axes(r) for r in self.regions)

    @cached_property
    def group_blocks(self) -> Tuple[int, ...]:
        """Per group, the logical blocks every region of the group holds: its block ids
        lie in ``[0, group_blocks[g])`` (or are ``NO_BLOCK``). A group with no region
        holds no page; its bound only keeps ``id * pages per block`` inside int64."""
        pages = [MAX_GROUP_PAGES] * self.num_groups
        for r in self.regions:
            for _, g in r.members:
                pages[g] = min(pages[g], r.num_pages)
        return tuple(n // (b // p) for n, b, p in zip(pages, self.tokens_per_block, self.tokens_per_page))


def check_generation(value: str, where: str) -> str:
    """``value`` if it is :data:`GENERATION_HEX` lowercase hex digits."""
    if len(value) != GENERATION_HEX or value.strip("0123456789abcdef"):
        raise ValueError(f"{where}: generation {value[:40]!r} is not {GENERATION_HEX} lowercase hex digits")
    return value


def num_descriptors(info: EngineInfo) -> int:
    """Page descriptors (pages x chunks over the regions), and the page-sums slots."""
    return sum(r.num_descriptors for r in info.regions) + (0 if info.sums is None else info.sums.nbytes // 8)


def engine_descriptors(info: EngineInfo) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`~kvcopy.nixl.engine.regions.descriptor_table` of the engine's regions, then one
    8-byte descriptor per page-sums slot (host mode with checksums): they start at row
    ``offsets[-1]``."""
    descs, offsets = descriptor_table(info.regions)
    if info.sums is None:
        return descs, offsets
    n = info.sums.nbytes // 8
    rows = np.empty((n, 3), dtype=np.uint64)
    rows[:, 0] = np.uint64(info.sums.address) + np.arange(n, dtype=np.uint64) * np.uint64(8)
    rows[:, 1] = 8
    rows[:, 2] = 0
    return np.concatenate([descs, rows]), offsets


def layer_limit(local: EngineInfo) -> int:
    """The most layers (and so regions) a peer of this engine may advertise."""
    return min(MAX_LAYERS, 2 * sum(len(r.members) for r in local.regions) + EXTRA_LAYERS)


def check_peer_limits(local: EngineInfo, remote: EngineInfo) -> None:
    """Refuse a peer declaring more than this engine explains (see the limits above):
    checked by ``add_peer`` before the peer's descriptors are built (the layer limit
    is already applied by :func:`decode` when given ``max_layers``)."""
    remote_layers = sum(len(r.members) for r in remote.regions)
    if remote_layers > layer_limit(local):
        raise ValueError(f"peer {remote.name!r} advertises {remote_layers} layers; the limit for this "
                         f"engine is {layer_limit(local)}")
    limit = min(MAX_DESCRIPTORS, max(MIN_DESCRIPTOR_LIMIT, DESCRIPTOR_FACTOR * num_descriptors(local)))
    declared = num_descriptors(remote)
    if declared > limit:
        raise ValueError(f"peer {remote.name!r} declares {declared} page descriptors (pages x chunks over its "
                         f"regions); the limit for this engine is {limit}")


@dataclass(frozen=True)
class LayerPair:
    """One pulled layer: its group and region on each side."""

    layer: str
    local_group: int
    local_region: int
    remote_group: int
    remote_region: int


def pair_layers(local: EngineInfo, remote: EngineInfo) -> List[LayerPair]:
    """Pair every local grouped layer with the peer's, or raise saying what differs.

    Layers pair by name, each in its own group on each side. A pair must agree on what a
    byte means: element size, layout kind, chunks per page, total KV heads, head size and
    every in-page axis but tokens and heads. Tokens per page, KV heads held (TP sizes)
    and the NHD/HND order may differ: plans then move token pieces and head ranges
    (:mod:`kvcopy.nixl.engine.geometry`). A layout that names no token axis (``flat``) must
    match whole. A peer holding none of this rank's KV heads is refused too.
    """
    problems: List[str] = []
    if remote.name == local.name:
        problems.append(f"the peer has this engine's own name {local.name!r}")
    remote_layers = remote.layers()
    pairs: List[LayerPair] = []
    missing: List[str] = []
    head_layers, overlapping = 0, 0
    for region in local.regions:
        for name, group in region.members:
            if name not in remote_layers:
                missing.append(name)
                continue
            rg, rr = remote_layers[name]
            peer_region = remote.regions[rr]
            la, ra = chunk_axes(region), chunk_axes(peer_region)
            fields = _MUST_MATCH if la is None or ra is None else _MUST_MATCH_SLICED
            for field, words in fields:
                mine, theirs = getattr(region, field), getattr(peer_region, field)
                if mine != theirs:
                    problems.append(f"layer {name!r}: {words} {mine} (local) vs {theirs} (peer)")
            if la is not None and ra is not None and la.others() != ra.others():
                problems.append(f"layer {name!r}: in-page axes besides tokens and heads "
                                f"{list(la.others())} (local) vs {list(ra.others())} (peer)")
            if region.heads is not None and peer_region.heads is not None:
                head_layers += 1
                (a, n), (b, m) = region.heads, peer_region.heads
                overlapping += max(a, b) < min(a + n, b + m)
            elif (region.heads is None) != (peer_region.heads is None):
                problems.append(f"layer {name!r}: KV heads held {region.heads} (local) vs {peer_region.heads} (peer)")
            pairs.append(LayerPair(name, group, region.index, rg, rr))
    if missing:
        problems.append(f"{len(missing)} layer(s) not on the peer (or in no group there): {missing[:_MAX_LISTED]}")
    if head_layers and not overlapping and not problems:
        problems.append(f"the peer (TP rank {remote.tp_rank} of {remote.tp_size}) holds none of the KV heads "
                        f"this rank (TP rank {local.tp_rank} of {local.tp_size}) holds")
    if problems:
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise ValueError(
            f"peer {remote.name!r} cannot serve {local.name!r}:\n  "
            + "\n  ".join(problems[:_MAX_LISTED]) + more
        )
    return pairs
