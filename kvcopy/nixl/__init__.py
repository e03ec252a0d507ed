"""kvcopy.nixl: paged KV transfers between engines over NIXL, through host buffers or not.

``TransferManager`` (one per engine rank) registers the KV (host staging buffers, one
per device storage, or the device tensors), exchanges versioned handshake metadata,
plans pulls by token position (across different group plans, page sizes and TP sizes:
one plan may read from several peers), reads with NIXL and completes with one masked
copy.
``buffer="arena"`` stages each request in one span of a fixed-size pinned arena
instead (:mod:`kvcopy.nixl.staging`: one descriptor per request for equal geometry).
The byte oracle that applies a plan without NIXL, and the fuzzers that check plans
against it, are test tooling (:mod:`kvcopy.testing.nixl`). See ``docs/nixl.md``.

Importing this package does not import NIXL; creating a manager does (``nixl``,
``nixl_cu12`` or ``nixl_cu13``, whichever is installed).
"""
from ._agent import NixlError, load_nixl, nixl_available
from .arena import ArenaFull
from .geometry import rank_heads, remote_ranks
from .handshake import HANDSHAKE_VERSION, EngineInfo, LayerPair, decode, encode, pair_layers
from .manager import Completion, PullHandle, TransferManager
from .plan import (
    NO_BLOCK, PullPlan, RegionPair, RegionRef, build_multi_pull_plan, build_pull_plan, expand_blocks,
)
from .regions import RegionInfo, RegionSet, build_regions
from .staging import ArenaPlan, StagedRequest

__all__ = [
    "ArenaFull",
    "ArenaPlan",
    "Completion",
    "EngineInfo",
    "HANDSHAKE_VERSION",
    "LayerPair",
    "NO_BLOCK",
    "NixlError",
    "PullHandle",
    "PullPlan",
    "RegionInfo",
    "RegionPair",
    "RegionRef",
    "RegionSet",
    "StagedRequest",
    "TransferManager",
    "build_multi_pull_plan",
    "build_pull_plan",
    "build_regions",
    "decode",
    "encode",
    "expand_blocks",
    "load_nixl",
    "nixl_available",
    "pair_layers",
    "rank_heads",
    "remote_ranks",
]
