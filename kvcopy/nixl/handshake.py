"""The handshake: versioned metadata bytes, and the check that a peer can be served.

Wire format (all integers little-endian)::

    b"KVCOPY-NIXL\\0"  magic, 12 bytes
    u32              version (HANDSHAKE_VERSION)
    u64              length J of the JSON header
    J bytes          JSON header, UTF-8: engine fields + one object per region
    rest             the NIXL agent metadata, opaque

The JSON header carries the engine's name, buffer mode and memory type, TP rank and
size, per KV cache group its tokens per logical block and per kernel page, and per
region everything :class:`~kvcopy.nixl.regions.RegionInfo` holds: members ``(layer,
group)``, address, page count and strides, chunks, dtype, layout, tokens per page, KV
heads (total and the range this rank holds), head size.

:func:`decode` refuses bytes that are not a handshake, are truncated, or carry a
version it does not know (never guessed). :func:`pair_layers` decides, before any
transfer, whether a peer can serve this engine: every local grouped layer must exist
on the peer with the same meaning of its bytes (element size, layout kind, chunks, total
KV heads, head size; see :func:`pair_layers`). Everything that differs is
listed in one ``ValueError``. Layers are paired by name, each with its own group on
each side, so the pairing is per (local group, remote group). Different tokens per
page, TP sizes (heads held) and NHD/HND orders are accepted where both sides name
their token and head axes: plans move token pieces and head ranges.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Tuple

from .geometry import chunk_axes
from .regions import RegionInfo, RegionRef

MAGIC = b"KVCOPY-NIXL\0"
HANDSHAKE_VERSION = 2  # 2: regions carry their named in-chunk axes
_HEADER = struct.Struct("<IQ")

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
_MAX_LISTED = 12


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
        recognizes its own regions by identity (measured: ``RegionRef.of`` per pair cost
        about 5 ms of a 64-layer plan on a loaded 2-core machine)."""
        return tuple(RegionRef.of(r) for r in self.regions)

    @cached_property
    def region_axes(self):
        """:func:`~kvcopy.nixl.geometry.chunk_axes` per region, by index."""
        return tuple(chunk_axes(r) for r in self.regions)


def encode(info: EngineInfo) -> bytes:
    header = {
        "name": info.name,
        "buffer": info.buffer,
        "mem_type": info.mem_type,
        "tp_rank": info.tp_rank,
        "tp_size": info.tp_size,
        "tokens_per_block": list(info.tokens_per_block),
        "tokens_per_page": list(info.tokens_per_page),
        "regions": [r.to_dict() for r in info.regions],
        "arena": list(info.arena),
    }
    body = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + _HEADER.pack(HANDSHAKE_VERSION, len(body)) + body + info.agent_metadata


def decode(data: bytes) -> EngineInfo:
    data = bytes(data)
    if not data.startswith(MAGIC):
        raise ValueError("not kvcopy NIXL handshake metadata (bad magic)")
    if len(data) < len(MAGIC) + _HEADER.size:
        raise ValueError("handshake metadata truncated before its header")
    version, length = _HEADER.unpack_from(data, len(MAGIC))
    if version != HANDSHAKE_VERSION:
        raise ValueError(
            f"handshake version {version} is not supported (this kvcopy speaks {HANDSHAKE_VERSION})"
        )
    start = len(MAGIC) + _HEADER.size
    if len(data) < start + length:
        raise ValueError(f"handshake metadata truncated: header says {length} bytes, {len(data) - start} left")
    try:
        h = json.loads(data[start : start + length].decode())
        regions = tuple(RegionInfo.from_dict(r) for r in h["regions"])
        info = EngineInfo(
            name=str(h["name"]), buffer=str(h["buffer"]), mem_type=str(h["mem_type"]),
            tp_rank=int(h["tp_rank"]), tp_size=int(h["tp_size"]),
            tokens_per_block=tuple(int(x) for x in h["tokens_per_block"]),
            tokens_per_page=tuple(int(x) for x in h["tokens_per_page"]),
            regions=regions, agent_metadata=data[start + length :],
            arena=tuple(int(x) for x in h.get("arena", (0, 0))),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed handshake header: {type(exc).__name__}: {exc}") from None
    if len(info.arena) != 2 or min(info.arena) < 0:
        raise ValueError(f"malformed handshake header: arena {info.arena} is not (address, bytes)")
    if len(info.tokens_per_page) != info.num_groups:
        raise ValueError("malformed handshake header: group lists of different lengths")
    for r in regions:
        if any(not 0 <= g < info.num_groups for _, g in r.members):
            raise ValueError(f"malformed handshake header: region {r.index} names a group out of range")
    return info


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
    (:mod:`kvcopy.nixl.geometry`). A layout that names no token axis (``flat``) must
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
