"""Buffer modes: the memory a manager's transfers go through, and what each step of a
request does in it. ``TransferManager`` keeps the handshake, the peers, NIXL, deadlines
and notifications; everything that differs between the modes is one of these.

=====================  ===========================  ==========================  ==================================
step                   ``"host"`` (MirrorMode)       ``"device"`` (DeviceMode)   ``"arena"`` (ArenaStaging)
=====================  ===========================  ==========================  ==================================
memory registered      a pinned mirror per device   the KV tensors              one pinned arena
                       storage, page for page
P: ``stage``           masked d2h into the mirror   nothing (P's KV is read)    pack into a span; a StagedRequest
P: notifications       nothing                      nothing                     a reader done: free P's span
D: ``plan``            PullPlan by token position   the same                    ArenaPlan: D's span, READ rows
D: ``reads``           rows of the prepared lists,  the same                    rows between the two spans
                       or explicit rows
D: ``complete`` (ok)   zero rows, zero pages,       zero rows and pages in the  zero rows in D's span, scatter
                       masked h2d                   KV                          (and zero) into the KV
D: ``free``            nothing                      nothing                     free D's span
D: ``hold``            the READ's rows: no later    the same                    D's span stays held
                       pull reads or zeroes there
a failed pull wrote    the request's mirror pages   its KV pages                nothing outside D's own span
=====================  ===========================  ==========================  ==================================

A mode is made by ``build`` from the manager's caches, groups and options, never sees
NIXL, and gets the manager's one :class:`~kvcopy.nixl.engine.info.EngineInfo` (``info``)
and its peers (:class:`Peer`) with each call.

``plan`` returns two things: the plan the caller gets (a description) and the mode's
*work* (:class:`Work`): everything ``reads``, ``complete``, ``hold`` and ``free`` use,
made from the mode's own state and never handed out, so nothing the caller does to a
plan object reaches memory. The manager keeps the work (:mod:`kvcopy.nixl.ledger`) and
calls ``free`` once, when the plan is completed or discarded and no READ of it may
still land; between ``hold`` and ``unhold`` a READ given up on may still write what the
work's READ rows name. What it caches per peer is keyed by
``Peer.key``, an int the manager gives each ``add_peer`` and never reuses; ``forget``
drops it when the peer is removed.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple

import numpy as np

from ..engine.info import EngineInfo, LayerPair, SumsRegion
from ..options import ManagerOptions
from ..planning.plan import Plan
from ..engine.regions import RegionInfo, RegionSet
from ..sum_check import SumCheck


@dataclass(frozen=True)
class Peer:
    """A peer as the modes see it: its handshake record, the layer pairing, the first
    descriptor row of each of its regions, and the key caches use for it."""

    key: int
    info: EngineInfo
    layer_pairs: Tuple[LayerPair, ...]
    descriptor_offsets: Tuple[int, ...]

    @property
    def name(self) -> str:
        return self.info.name


class Work(Protocol):
    """What every mode's work says (each mode adds what its steps need)."""

    read_pages: Tuple[Tuple[int, ...], ...]  # per local group: the local pages the READs fill
    zero_pages: Tuple[Tuple[int, ...], ...]  # per local group: the local pages complete() zeroes
    local_block_ids: Tuple[Tuple[int, ...], ...]  # per local group: the blocks the pull writes
    unchecked: Optional[str]  # why complete() will not compare the pages' sums; None: it will


class Read(NamedTuple):
    """One NIXL READ of a pull: from ``peer``, rows as indices into the prepared
    descriptor lists (``prepared``) or explicit ``(address, bytes, device)`` rows."""

    peer: str
    prepared: bool
    local: np.ndarray
    remote: np.ndarray


class BufferMode(ABC):
    """One buffer mode (see the module docstring)."""

    name: ClassVar[str]
    # Where a failed pull's posted READ may have written (Completion.written_in); None:
    # nowhere that outlives the request (arena: D's own span, not reused while it may).
    written_in: ClassVar[Optional[str]] = None
    regions: RegionSet
    region_infos: Tuple[RegionInfo, ...]  # the regions as the handshake advertises them (one tuple, kept)
    mem_type: str  # of the registered memory, as the handshake says it
    on_cuda: bool  # the KV is on CUDA: save() orders its copy with an event

    @classmethod
    @abstractmethod
    def build(cls, device_caches, layer_groups, tokens_per_page, opts: ManagerOptions) -> "BufferMode":
        """The mode of a manager over these caches and groups (``tokens_per_page`` per
        group), with its options."""

    # ---------------------------------------------------------------- memory
    @abstractmethod
    def registrations(self) -> List[Tuple[int, int, int, str]]:
        """(address, bytes, device id, memory type) of each range to register with NIXL."""

    def local_descriptors(self) -> Optional[np.ndarray]:
        """The rows of the local descriptor list prepared once (None: none, pulls post
        explicit rows)."""
        return None

    @property
    def arena_range(self) -> Tuple[int, int]:
        """(address, bytes) of the staging arena the handshake advertises; (0, 0): none."""
        return (0, 0)

    @property
    def sums_region(self) -> Optional[SumsRegion]:
        """Host mode with checksums: the page-sums region the handshake advertises."""
        return None

    # ---------------------------------------------------------------- P side
    @abstractmethod
    def stage(self, info: EngineInfo, block_ids, num_tokens, request_id, readers, waits: bool,
              count_failure: bool):
        """P's ``save``: make these blocks readable by a peer. Returns what D needs (a
        StagedRequest) or None; raises ArenaFull where space runs out (``count_failure``:
        this try counts in the metrics; ``waits``: the caller retries until a deadline)."""

    @abstractmethod
    def on_notifications(self, new: Mapping[str, List[bytes]]) -> None:
        """P: D's notifications since the last call (each: a reader done with a request)."""

    # ---------------------------------------------------------------- D side
    @abstractmethod
    def plan(self, info: EngineInfo, peers: Sequence[Peer], remote, num_tokens, local_block_ids,
             num_cached_tokens, request_id=None) -> Tuple[Plan, "Work"]:
        """D's ``plan_pull`` (``remote``: P's block ids, or its StagedRequest records, which
        must name ``request_id``): the plan for the caller and the mode's work (see the
        module docstring)."""

    @abstractmethod
    def reads(self, work: "Work") -> Sequence[Read]:
        """The READs of a plan, one per peer, made and checked when it was planned."""

    @abstractmethod
    def check_writable(self, work: "Work") -> None:
        """Raise :class:`~kvcopy.nixl.pull.PagesHeld` where the pull of ``work`` would
        read or zero into memory a held READ (:meth:`hold`) may still write."""

    @abstractmethod
    def complete(self, work: "Work") -> Tuple[Optional[SumCheck], Optional[str]]:
        """After every READ of the plan is DONE: write the request into the KV. Returns
        the comparison of the copy's page sums with P's (:mod:`kvcopy.nixl.sum_check`),
        or None and why the pages are not compared."""

    @abstractmethod
    def hold(self, work: "Work", pull_id: int) -> None:
        """A READ of ``work`` (pull ``pull_id``) was given up on before it ended: it may
        still write the work's READ rows until :meth:`unhold`."""

    @abstractmethod
    def unhold(self, work: "Work") -> None:
        """NIXL reported every READ of ``work`` given up on ended."""

    @abstractmethod
    def free(self, work: "Work") -> None:
        """The plan is completed or discarded and no READ of it may land: free what the
        work holds (arena mode: D's span)."""

    def memory(self) -> List[object]:
        """The objects keeping this mode's registered memory alive (kept past ``close``
        where a READ may still land and NIXL's agent could not be shown destroyed)."""
        return []

    @abstractmethod
    def forget(self, peer: Peer) -> None:
        """Drop what is cached for a removed peer."""

    def stats(self) -> Dict[str, int]:
        return {}

    @abstractmethod
    def close(self) -> None:
        """Release the mode's copiers and buffers."""
