"""kvcopy.nixl: paged KV transfers between engines over NIXL, through host buffers or not.

``TransferManager`` (one per engine rank) registers the KV (host staging buffers, one
per device storage, or the device tensors), exchanges versioned handshake metadata,
plans pulls by token position (across different group plans, page sizes and TP sizes:
one plan may read from several peers), reads with NIXL and completes with one masked
copy.
``buffer="arena"`` stages each request in one span of a fixed-size pinned arena
instead (:mod:`kvcopy.nixl.modes.arena`: one descriptor per request for equal geometry).
What differs between the buffer modes is :mod:`kvcopy.nixl.modes.base`.
The byte oracle that applies a plan without NIXL, and the fuzzers that check plans
against it, are test tooling (:mod:`kvcopy.testing.nixl`). See ``docs/nixl.md``.

Importing this package does not import NIXL; creating a manager does (``nixl``,
``nixl_cu12`` or ``nixl_cu13``, whichever is installed).
"""
from .agent import NixlError, load_nixl, nixl_available
from .modes.spans import ArenaFull
from .engine.geometry import rank_heads, remote_ranks
from .wire.handshake import HANDSHAKE_VERSION, decode, encode
from .engine.info import EngineInfo, LayerPair, pair_layers
from .manager import TransferManager
from .options import ManagerOptions
from .planning.plan import (
    NO_BLOCK, Plan, PullPlan, RegionPair, RegionRef, build_multi_pull_plan, build_pull_plan, expand_blocks,
)
from .pull import Completion, PagesHeld, PullHandle
from .wire.record import StagedRequest, StaleRegistration
from .engine.regions import RegionInfo, RegionSet, build_regions
from .planning.routes import Routes, plan_routes
from .modes.arena import ArenaPlan
from .sum_check import ChecksumRequired

__all__ = [
    "ArenaFull",
    "ArenaPlan",
    "ChecksumRequired",
    "Completion",
    "EngineInfo",
    "HANDSHAKE_VERSION",
    "LayerPair",
    "ManagerOptions",
    "NO_BLOCK",
    "NixlError",
    "PagesHeld",
    "Plan",
    "PullHandle",
    "PullPlan",
    "RegionInfo",
    "RegionPair",
    "RegionRef",
    "RegionSet",
    "Routes",
    "StagedRequest",
    "StaleRegistration",
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
    "plan_routes",
    "rank_heads",
    "remote_ranks",
]
