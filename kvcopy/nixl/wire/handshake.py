"""The handshake: an engine's :class:`~kvcopy.nixl.engine.info.EngineInfo` as versioned,
digested (optionally keyed) metadata bytes, checked field by field.

Wire format (all integers little-endian; the frame is :mod:`kvcopy.nixl.wire.framing`'s,
with two parts, as for the staged-request records of arena mode)::

    b"KVCOPY-NIXL\\0"  magic, 12 bytes
    u32              version (HANDSHAKE_VERSION)
    u32              flags: bit 0 set = an HMAC follows the digest
    u64              length J of the JSON header
    u64              length A of the NIXL agent metadata
    J bytes          JSON header, UTF-8: engine fields + one object per region
    A bytes          the NIXL agent metadata, opaque
    32 bytes         SHA-256 of every byte before it
    [32 bytes]       HMAC-SHA256 (shared key) of every byte before it, if flag bit 0

The JSON header carries the engine's name, buffer mode and memory type, TP rank and
size, its registration generation (``GENERATION_HEX`` hex digits drawn when the
manager was made: a record names it, so a record of an earlier registration under the
same name is refused), per KV cache group its tokens per logical block and per kernel page, and per
region everything :class:`~kvcopy.nixl.engine.regions.RegionInfo` holds: members ``(layer,
group)``, address, page count and strides, chunks, dtype, layout, tokens per page, KV
heads (total and the range this rank holds), head size, named in-chunk axes.

:func:`decode` treats the bytes as untrusted network input and checks, in this order
and before anything proportional to a declared count is allocated or looped over: the
magic, the version (never guessed), the two declared lengths against the payload's own
length and against :data:`MAX_HEADER_BYTES`/:data:`MAX_AGENT_BYTES`, the SHA-256
digest over the whole payload, the HMAC when a key is involved, then the JSON (duplicate
keys refused) and every header field
(:mod:`kvcopy.nixl.wire.schema`: types, ranges, known dtypes and layouts, the fields of each
region against each other, the regions against the engine's groups). Only then does
the manager hand the agent metadata to NIXL. Whether a peer can be served at all
(limits by the local engine, layer pairing) is :mod:`kvcopy.nixl.engine.info`'s.

What the digest and the key protect against, and what they do not (docs/nixl.md,
"Trust model"): the digest catches accidental corruption (bit flips, truncation,
concatenation, a wrong length) anywhere in the payload, NIXL's part included; it does
not authenticate, since anyone can recompute it. A shared key (HMAC) authenticates:
without the key no one can make metadata a keyed manager accepts. Neither encrypts,
prevents replay of metadata recorded earlier, nor protects against a peer that holds
the key: NIXL still parses its agent metadata.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional

from ..engine.info import GENERATION_HEX, MAX_TOKENS_PER_BLOCK, MAX_TP, EngineInfo, SumsRegion, check_generation
from ..engine.regions import (
    BUFFER_MODES, MAX_GROUPS, MAX_LAYERS, MAX_NAME, MAX_TOKENS_PER_PAGE, MEM_TYPES, RegionInfo, sum_slots,
)
from .framing import Framing
from .region_record import region_from_dict, region_to_dict
from .schema import Record, loads

MAGIC = b"KVCOPY-NIXL\0"
# 5: the registration generation; 4: host mode's page-sums region; 3: lengths, digest, HMAC;
# 2: named in-chunk axes
HANDSHAKE_VERSION = 5

# Documented maxima (docs/nixl.md, "Limits"): what a handshake may declare at all.
MAX_HEADER_BYTES = 8 << 20  # JSON header: ~500 bytes per region, so ~16,000 regions
MAX_AGENT_BYTES = 16 << 20  # NIXL agent metadata: ~200 bytes per NIXL registration
# Two parts: the JSON header (at least one byte), NIXL's agent metadata.
HANDSHAKE = Framing(MAGIC, HANDSHAKE_VERSION, ((1, MAX_HEADER_BYTES), (0, MAX_AGENT_BYTES)),
                    "handshake metadata", "handshake")

def header_of(info: EngineInfo) -> dict:
    """The JSON header of ``info``, as a plain dict."""
    return {
        "name": info.name,
        "buffer": info.buffer,
        "mem_type": info.mem_type,
        "tp_rank": info.tp_rank,
        "tp_size": info.tp_size,
        "generation": info.generation,
        "tokens_per_block": list(info.tokens_per_block),
        "tokens_per_page": list(info.tokens_per_page),
        "regions": [region_to_dict(r) for r in info.regions],
        "arena": list(info.arena),
        "sums": None if info.sums is None else info.sums.to_dict(),
    }


def encode(info: EngineInfo, key: Optional[bytes] = None) -> bytes:
    """The handshake payload of ``info``; with ``key``, authenticated by its HMAC."""
    return frame(json.dumps(header_of(info), separators=(",", ":")).encode(), info.agent_metadata, key)


def frame(body: bytes, agent_metadata: bytes, key: Optional[bytes] = None) -> bytes:
    """The wire format above for any header bytes ``body`` and the agent metadata (the
    handshake fuzzer frames malformed headers with valid digests)."""
    return HANDSHAKE.frame((body, agent_metadata), key)


def decode(data: bytes, key: Optional[bytes] = None, max_layers: int = MAX_LAYERS) -> EngineInfo:
    """Check a peer's handshake payload (see the module docstring) and read it.

    ``key`` None: the payload must carry no HMAC (a keyed peer's metadata is refused:
    it cannot be authenticated here, and accepting it would hide a configuration
    mismatch). ``key`` given: the payload must carry an HMAC made with it.
    ``max_layers`` bounds the regions and layers before any is read (``add_peer``
    passes :func:`layer_limit` of its engine). Raises
    ``ValueError`` (``TypeError`` for a non-bytes payload) saying what is wrong.
    """
    header, agent = HANDSHAKE.unframe(data, key)
    return _engine_info(loads(header, "handshake header"), agent, min(max_layers, MAX_LAYERS))


def _engine_info(h, agent_metadata: bytes, max_layers: int) -> EngineInfo:
    """The engine record from a decoded header: every field checked, then the regions
    against the engine (indices, groups, tokens per page, unique layer names)."""
    r = Record(h, "handshake header")
    name = r.name("name", MAX_NAME)
    buffer = r.choice("buffer", BUFFER_MODES + ("arena",))
    mem_type = r.choice("mem_type", MEM_TYPES)
    tp_size = r.integer("tp_size", 1, MAX_TP)
    tp_rank = r.integer("tp_rank", 0, tp_size - 1)
    generation = check_generation(r.name("generation", GENERATION_HEX), r.at("generation"))
    tpb = r.integers("tokens_per_block", 1, MAX_GROUPS, 1, MAX_TOKENS_PER_BLOCK)
    tpp = r.integers("tokens_per_page", len(tpb), len(tpb), 1, MAX_TOKENS_PER_PAGE)
    raw_regions = r.entries("regions", 1, max_layers)  # a region holds at least one layer
    arena = r.integers("arena", 2, 2, 0, (1 << 64) - 1)  # (address, bytes) of an arena-mode engine's arena
    raw_sums = r.optional("sums")
    r.done()
    where = "malformed handshake header"
    if buffer in ("host", "arena") and mem_type != "DRAM":
        raise ValueError(f"{where}: {buffer} buffers in {mem_type}")
    if (buffer == "arena") != (arena[1] > 0) or arena[0] + arena[1] >= 1 << 64:
        raise ValueError(f"{where}: arena {arena} for a {buffer!r}-mode engine")
    for g, (b, p) in enumerate(zip(tpb, tpp)):
        if b % p:
            raise ValueError(f"{where}: group {g}: {b} tokens per block is not a multiple of {p} per page")
    regions = []
    seen: Dict[str, int] = {}
    layers = 0
    for i, raw in enumerate(raw_regions):
        region = region_from_dict(raw)
        if region.index != i:
            raise ValueError(f"{where}: region {i} says it is region {region.index}")
        layers += len(region.members)
        if layers > max_layers:
            raise ValueError(f"{where}: more than {max_layers} layers")
        for layer, g in region.members:
            if g >= len(tpb):
                raise ValueError(f"{where}: region {i}, layer {layer!r}: group {g} of {len(tpb)}")
            if layer in seen:
                raise ValueError(f"{where}: layer {layer!r} is in region {seen[layer]} and region {i}")
            seen[layer] = i
            if region.tokens_per_page != tpp[g]:
                raise ValueError(f"{where}: region {i}, layer {layer!r}: {region.tokens_per_page} tokens per "
                                 f"page, its group {g} says {tpp[g]}")
            if tpb[g] // tpp[g] > region.num_pages:  # a logical block is pages of every layer of its group
                raise ValueError(f"{where}: group {g}: a block of {tpb[g] // tpp[g]} pages, region {i} has "
                                 f"{region.num_pages}")
        regions.append(region)
    sums = None if raw_sums is None else _sums_region(raw_sums, buffer, regions, len(tpb))
    return EngineInfo(
        name=name, buffer=buffer, mem_type=mem_type, tp_rank=tp_rank, tp_size=tp_size,
        tokens_per_block=tuple(tpb), tokens_per_page=tuple(tpp), regions=tuple(regions),
        agent_metadata=agent_metadata, arena=(arena[0], arena[1]), sums=sums, generation=generation,
    )


def _sums_region(raw, buffer: str, regions: List[RegionInfo], num_groups: int) -> SumsRegion:
    """A host-mode engine's page-sums region: 8 bytes per slot of its regions, inside the
    address space, with a fingerprint of lowercase hex digits."""
    where = "malformed handshake header, sums"
    r = Record(raw, where)
    address = r.integer("address", 0, (1 << 64) - 1)
    nbytes = r.integer("bytes", 1, (1 << 63) - 1)
    layout = r.name("layout", 32)
    r.done()
    if buffer != "host":
        raise ValueError(f"{where}: a page-sums region for a {buffer!r}-mode engine (host mode only)")
    if address + nbytes >= 1 << 64 or nbytes != 8 * int(sum_slots(regions, num_groups)[-1]):
        raise ValueError(f"{where}: {nbytes} bytes at {address:#x}, not 8 per page slot of its regions")
    if len(layout) != 32 or layout.strip("0123456789abcdef"):
        raise ValueError(f"{where}: layout {layout[:40]!r} is not 32 lowercase hex digits")
    return SumsRegion(address, nbytes, layout)


