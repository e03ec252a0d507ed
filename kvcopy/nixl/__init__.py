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
from .agent import NixlError, nixl_available
from .engine.geometry import remote_ranks
from .manager import TransferManager
from .modes.spans import ArenaFull
from .options import ManagerOptions
from .planning.plan import NO_BLOCK, Plan
from .pull import Completion, PagesHeld, PullHandle
from .sum_check import ChecksumRequired
from .wire.record import StagedRequest, StaleRegistration

# What a user of TransferManager calls and catches; the engine records, wire formats,
# plans and routes are reached through their modules (kvcopy.nixl.engine.*, .wire.*,
# .planning.*, .modes.*, .agent).
__all__ = [
    "ArenaFull",
    "ChecksumRequired",
    "Completion",
    "ManagerOptions",
    "NO_BLOCK",
    "NixlError",
    "PagesHeld",
    "Plan",
    "PullHandle",
    "StagedRequest",
    "StaleRegistration",
    "TransferManager",
    "nixl_available",
    "remote_ranks",
]
