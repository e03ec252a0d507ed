"""``TransferManager``: one engine rank's NIXL side of a P/D KV transfer.

    m = TransferManager(name, device_caches, layer_groups, tokens_per_block)
    m.metadata() -> bytes                 # the handshake payload for the peer
    peer = m.add_peer(metadata)           # D: validate P, map layers, prepare descriptors
    m.save(block_ids)                     # P: one masked d2h for all groups
    plan = m.plan_pull(peer, remote_block_ids, remote_num_tokens, local_block_ids,
                       num_cached_tokens=0)   # peer: a name, or the names of P's TP ranks
    h = m.pull(plan, notify=b"req-7")     # D: NIXL READ(s) of P's pages into D's buffers
    m.poll(h) -> "DONE" | "PROC" | "ERR"
    m.complete(h) -> Completion           # D: zero unread pages, one masked h2d
    m.notifications()                     # P: {D's name: [notify, ...]}: D is done reading
    m.close()

Data flow in ``"host"`` mode (the default): P's KV -> ``save`` (``BlockCopier.to_host``,
each group's layers at that group's pages) -> P's host buffers -> NIXL READ posted by D
-> D's host buffers -> ``complete`` (``BlockCopier.to_device``) -> D's KV. In
``"device"`` mode NIXL reads P's KV tensors into D's KV tensors directly; ``save``
only orders the caller's writes and ``complete`` only zeroes.

In ``"arena"`` mode (:mod:`kvcopy.nixl.staging`) one fixed-size pinned arena is
registered instead of a mirror: ``save`` packs the request into one span and returns a
``StagedRequest`` for D, ``plan_pull`` takes it (in place of P's block ids) and
allocates D's span, ``complete`` scatters and zeroes in one masked call and frees D's
span; P's span is freed by D's notification (``notifications``) or a TTL.

Block ids are logical, one list per KV cache group; logical block ``b`` of a group is
kernel pages ``b*r ... b*r + r - 1`` with ``r = tokens_per_block // tokens_per_page``.
Host buffers mirror device pages one to one, so concurrent requests, whose blocks are
disjoint, never share a host page.

Synchronization (the only host waits, all documented here):

* ``save(..., wait=True)`` on CUDA enqueues the d2h on the current stream, records an
  event and waits for it: D's READ is posted by another process, which kvcopy cannot
  order with a CUDA event, so P must not advertise the blocks before the bytes are in
  host memory. ``wait=False`` returns the event instead; advertise the blocks only
  after it completed. On CPU the copy is synchronous and ``save`` returns ``None``.
* ``complete`` enqueues the zeroing and the h2d on the current stream and returns:
  the blocks are usable by work enqueued after it on that stream. It never waits.
* ``pull`` and ``poll`` never touch CUDA.

Failures (ERR, a peer that vanished, descriptors NIXL rejects) are values, not
exceptions: ``poll`` returns ``"ERR"`` and releases the NIXL handle, ``complete``
returns a :class:`Completion` with ``ok=False`` and the request's local block ids, and
writes nothing itself (NIXL may have: host mode, the request's host pages only;
device mode, its destination pages only; :class:`Completion` says which). The peer is then sent the request's ``notify``
message (best effort) so it can free its blocks. Input errors (bad ids, a plan that
does not fit this manager or peer, page ids outside their region) raise
``ValueError``/``TypeError`` before anything moves. Descriptors NIXL rejects when the
transfer is made (for example a peer whose NIXL metadata was invalidated or
re-registered since ``add_peer``: the prepared descriptors are stale) fail the request.

Deadlines: ``pull(..., timeout_s=)`` or the manager's ``pull_timeout_s`` default. A
pull still in flight past its deadline fails at the next ``poll`` (no timer thread:
``poll`` checks the clock), its transfer is released like any failed pull's. See
:class:`Completion` for what a failed pull may leave (its own local pages, in the
memory NIXL writes: host buffers or device caches).

Heterogeneous peers (different group plans, page sizes, TP sizes; see
:mod:`kvcopy.nixl.plan`): a plan may read from several peers, one NIXL READ each; the
handle is DONE when all are, and fails as a whole if one fails. Pairs that move whole
chunks use the descriptor lists prepared at registration and ``add_peer``; pairs with
byte segments use descriptors built from the plan per pull. Both are checked and built
by :mod:`kvcopy.nixl.descriptors` in a fixed number of numpy calls (64 layers x 500
pages: ~0.35 ms, was ~14 ms of per-pair numpy calls on a loaded 2-core machine). Rows of
read pages past the prompt are zeroed by ``complete`` in the buffers NIXL wrote, before
the h2d copy.

Not thread-safe: one thread drives a manager.
"""
from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..checks import block_ids as as_block_ids, seconds, sequence, shown
from ..copier import BlockCopier
from ..layout import as_words
from ._agent import PROGRESS_DELAY_US, Agent, NixlError, metadata_name
from .arena import ArenaFull
from .descriptors import check_pairs, desc_rows, index_rows, same_ref
from .handshake import (
    EngineInfo, LayerPair, check_key, check_peer_limits, decode, encode, layer_limit, pair_layers,
)
from .plan import NO_BLOCK, PullPlan, build_multi_pull_plan, expand_blocks, forget_routes
from .regions import RegionSet, build_regions, descriptor_table, tokens_per_group
from .staging import ArenaPlan, ArenaStaging

PROC, DONE, ERR = "PROC", "DONE", "ERR"


@dataclass(frozen=True)
class Completion:
    """What ``complete`` did: ``ok``, else the request's local block ids that failed.

    A failed pull may have written, or may still write, the bytes of ``written_pages``
    (per local group, the request's local kernel pages NIXL reads into) in
    ``written_in``: ``"host buffers"`` in host mode (the device caches are untouched),
    ``"device caches"`` in device mode (NIXL writes there directly). Never another
    page, never another request's bytes. Both are empty / None when the pull is ok or
    no READ was ever posted. A READ whose release NIXL reported done can still land
    later (seen: a READ to a stopped peer, released, completes when the peer runs
    again): treat those pages as garbage until they are written again.
    """

    ok: bool
    failed_block_ids: Tuple[Tuple[int, ...], ...]  # per local group; empty lists when ok
    error: Optional[str] = None
    written_pages: Tuple[Tuple[int, ...], ...] = ()  # per local group, failed pulls only
    written_in: Optional[str] = None  # "host buffers", "device caches", or None


class PullHandle:
    """One pull in flight or finished. ``state`` is PROC, DONE or ERR; ``error`` says why."""

    __slots__ = ("id", "_plan", "notify", "state", "error", "completed", "timeout_s", "deadline", "_xfers",
                 "_done", "_posted", "_owner", "_abandoned")

    def __init__(self, id_: int, plan: PullPlan, notify: bytes, timeout_s: Optional[float] = None,
                 owner: object = None):
        self.id = id_
        self._plan = plan
        self._owner = owner  # the token of the manager that posted it
        self.notify = notify
        self.timeout_s = timeout_s  # None: no deadline
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s  # time.monotonic()
        self.state = PROC
        self.error: Optional[str] = None
        self.completed = False
        self._xfers: Dict[str, object] = {}  # peer -> NIXL transfer handle not yet released
        self._done: set = set()  # peers whose READ finished
        self._posted = False  # a READ was handed to NIXL (it may write the plan's local pages)
        # D released a READ of it that had not ended (deadline, abort, removed peer, a
        # failed sibling READ): it may still land (docs/nixl.md, "Deadlines")
        self._abandoned = False

    @property
    def plan(self) -> PullPlan:
        return self._plan

    @property
    def peers(self) -> Tuple[str, ...]:
        return self.plan.all_peers

    @property
    def peer(self) -> str:
        return self.plan.peer

    def __repr__(self) -> str:
        tail = f", error={self.error!r}" if self.error else ""
        return f"PullHandle(id={self.id}, peer={self.peer!r}, state={self.state}{tail})"


@dataclass
class _Peer:
    info: EngineInfo
    layer_pairs: List[LayerPair]
    dlist: object
    offsets: List[int]  # descriptor offset per remote region


class TransferManager:
    """NIXL transfers of paged KV between engines (see the module docstring)."""

    def __init__(
        self,
        name: str,
        device_caches: Mapping[str, torch.Tensor],
        layer_groups: Sequence[Sequence[str]],
        tokens_per_block,
        tokens_per_page=None,
        buffer: str = "host",
        backends: Sequence[str] = ("UCX",),
        *,
        kv_layout: str = "NHD",
        block_dim=None,
        tp_rank: int = 0,
        tp_size: int = 1,
        total_kv_heads=None,
        copy_backend: str = "auto",
        pull_timeout_s: Optional[float] = None,
        key: Optional[bytes] = None,
        arena_bytes: int = 1 << 30,
        arena_ttl_s: float = 60.0,
        arena_order: str = "token",
        progress_delay_us: int = PROGRESS_DELAY_US,
    ):
        self._closed = True
        self._arena: Optional[ArenaStaging] = None
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty string (the NIXL agent name), got {shown(name)}")
        self.pull_timeout_s = seconds(pull_timeout_s, "pull_timeout_s")
        # Shared HMAC key (docs/nixl.md, "Trust model"): metadata() is authenticated
        # with it and add_peer accepts only metadata authenticated with it.
        self._key = check_key(key)
        if isinstance(layer_groups, (str, bytes)) or any(isinstance(g, (str, bytes)) for g in layer_groups):
            raise TypeError("layer_groups is a sequence of sequences of layer names, one per group")
        self.name = name
        self.layer_groups = tuple(tuple(g) for g in layer_groups)
        tpb, tpp = tokens_per_group(tokens_per_block, tokens_per_page, len(self.layer_groups))
        self.tokens_per_block, self.tokens_per_page = tuple(tpb), tuple(tpp)
        self.buffer = buffer
        self._regions: RegionSet = build_regions(  # arena mode: the KV's geometry, nothing registered
            device_caches, self.layer_groups, tpp, "device" if buffer == "arena" else buffer, block_dim, kv_layout, tp_rank, tp_size, total_kv_heads
        )
        grouped = {n: device_caches[n] for layers in self.layer_groups for n in layers}
        self._device_caches = grouped
        self._copier = None
        if buffer == "host":
            self._copier = BlockCopier(grouped, self._regions.host_views, self.layer_groups,
                                       backend=copy_backend, block_dim=block_dim, kv_layout=kv_layout)
        self._on_cuda = any(t.device.type == "cuda" for t in grouped.values())
        try:
            if buffer == "arena":  # see kvcopy.nixl.staging
                self._arena = ArenaStaging(self._geometry(tp_rank, tp_size), grouped, self._regions.layouts,
                                           arena_bytes, arena_ttl_s, copy_backend, self._on_cuda,
                                           arena_order)
            self._agent = Agent(name, tuple(backends), progress_delay_us)
        except Exception:
            if self._copier is not None:
                self._copier.close()
            if self._arena is not None:
                self._arena.close()
            raise
        self._registrations = []
        self._kept: Dict[str, List[bytes]] = {}  # arena mode: notifications save() read for the caller
        self._peers: Dict[str, _Peer] = {}
        self._in_flight: Dict[int, PullHandle] = {}
        self._unreleased: List[object] = []  # NIXL handles whose release failed; retried
        self._ids = itertools.count()
        # Plans and handles are bound to the manager (and peers) that made them: a plan
        # edited by the caller, made by another manager or for a peer since removed or
        # re-added is refused before anything moves (see _bound_plan).
        self._token = object()
        self._plans: Dict[int, Tuple[weakref.ref, Tuple[Tuple[str, _Peer], ...]]] = {}
        self._local_dlist = None
        self._local_offsets = self._regions.descriptor_offsets.tolist()  # descriptor row of each region
        try:
            if self._arena is not None:
                self._registrations.append(self._agent.register([(self._arena.base, self._arena.arena.nbytes, 0)],
                                                                "DRAM"))
            for s in self._regions.storages if self._arena is None else ():
                self._registrations.append(self._agent.register([(s.address, s.nbytes, s.device_id)], s.mem_type))
            if self._arena is None:
                self._local_dlist = self._agent.prep_local(self._regions.descriptors(), self._regions.mem_type)
        except NixlError:
            self._release_agent()
            raise
        self._info = EngineInfo(
            name=name, buffer=buffer, mem_type="DRAM" if self._arena is not None else self._regions.mem_type,
            tp_rank=tp_rank, tp_size=tp_size,
            tokens_per_block=self.tokens_per_block, tokens_per_page=self.tokens_per_page,
            regions=tuple(self._regions.regions), agent_metadata=self._agent.metadata(),
            arena=(self._arena.base, self._arena.arena.nbytes) if self._arena is not None else (0, 0),
        )
        self._closed = False

    def _geometry(self, tp_rank: int, tp_size: int) -> EngineInfo:
        return EngineInfo(name=self.name, buffer=self.buffer, mem_type="DRAM", tp_rank=tp_rank, tp_size=tp_size,
                          tokens_per_block=self.tokens_per_block, tokens_per_page=self.tokens_per_page,
                          regions=tuple(self._regions.regions), agent_metadata=b"")

    # ------------------------------------------------------------ handshake
    def metadata(self) -> bytes:
        """The handshake payload (versioned bytes) to hand to the peer."""
        self._check_open()
        return encode(self._info, self._key)

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def regions(self) -> RegionSet:
        return self._regions

    def add_peer(self, metadata: bytes) -> str:
        """Validate a peer's handshake and prepare to read from it; returns its name.

        Everything is checked before any byte reaches NIXL (:func:`decode`: lengths,
        digest, key, every header field; :func:`check_peer_limits`; the layer pairing),
        and a refusal after NIXL loaded the peer's agent releases it again (parked,
        see :mod:`kvcopy.nixl._agent`), so the name can be added with genuine metadata.
        """
        self._check_open()
        remote = decode(metadata, self._key, layer_limit(self._info))
        check_peer_limits(self._info, remote)
        layer_pairs = pair_layers(self._info, remote)
        if remote.name in self._peers:
            raise ValueError(f"peer {remote.name!r} is already added; remove_peer it first")
        agent_name = metadata_name(remote.agent_metadata)
        if agent_name is not None and agent_name != remote.name:
            raise ValueError(f"peer handshake names {remote.name!r} but its NIXL agent metadata is "
                             f"for {agent_name!r}")
        descs, offsets = descriptor_table(remote.regions)  # bounded by check_peer_limits
        try:
            name = self._agent.add_remote(remote.agent_metadata)
        except NixlError as exc:
            self._agent.unload_remote(remote.name)  # NIXL may keep what it loaded before failing
            raise ValueError(f"peer {remote.name!r}: {exc}") from None
        if name != remote.name:
            if name not in self._peers and name != self.name:  # never touch a peer in use
                self._agent.release_remote(name)
            raise ValueError(f"peer handshake names {remote.name!r} but its NIXL agent is {name!r}")
        try:  # an arena peer is read at its staged spans, never at its KV
            dlist = None if remote.buffer == "arena" else self._agent.prep_remote(name, descs, remote.mem_type)
        except NixlError as exc:
            self._agent.release_remote(name)
            raise ValueError(f"peer {name!r}: its advertised regions are not what it registered: {exc}") from None
        self._peers[name] = _Peer(remote, layer_pairs, dlist, offsets.tolist())
        return name

    def peers(self) -> List[str]:
        return list(self._peers)

    def remove_peer(self, name: str) -> None:
        """Forget a peer: its pulls in flight fail (``ERR``), its descriptors are released."""
        peer = self._peers.pop(name, None)
        if peer is None:
            raise ValueError(f"unknown peer {name!r}")
        for h in [h for h in self._in_flight.values() if name in h.peers]:
            self._fail(h, f"peer {name!r} was removed")
        if peer.dlist is not None:
            Agent.release_dlist(peer.dlist)
        self._agent.release_remote(name)  # parked, not unloaded: see kvcopy.nixl._agent
        forget_routes(peer.info)  # the planner's cached routes must not keep the peer alive
        if self._arena is not None:
            self._arena.forget(peer.info)  # nor the arena's virtual engines of its request shapes

    # ------------------------------------------------------------ P side
    def save(self, block_ids: Sequence[Sequence[int]], wait: bool = True, *, num_tokens=None,
             request_id=None, readers: int = 1, space_timeout_s: Optional[float] = None):
        """Copy these logical blocks of every group to the host buffers (host mode).

        One masked ``BlockCopier.to_host`` for all groups; ``NO_BLOCK`` entries are
        skipped. Returns ``None``, or on CUDA with ``wait=False`` the CUDA event to wait
        on before advertising the blocks (see the module docstring).

        Arena mode: stages the blocks covering ``num_tokens`` in a span of the arena for
        ``request_id`` and returns the :class:`~kvcopy.nixl.staging.StagedRequest` to
        hand to D (``(record, event)`` with ``wait=False`` on CUDA). The span is freed
        when ``readers`` notifications ``request_id`` arrived (:meth:`notifications`),
        or after ``arena_ttl_s``. Raises :class:`~kvcopy.nixl.ArenaFull` when no span fits,
        at once, or with ``space_timeout_s`` after waiting that long for D's notifications
        (or TTLs) to free enough space (this call then blocks the host: it is opt-in).
        Nothing is copied before the span is held.
        """
        self._check_open()
        record = None
        if space_timeout_s is not None and self._arena is None:
            raise ValueError("space_timeout_s: arena mode only (host mode has no spans to wait for)")
        if self._arena is not None:
            if num_tokens is None or request_id is None:
                raise ValueError("arena mode: save needs num_tokens and request_id")
            wait_s = seconds(space_timeout_s, "space_timeout_s")
            deadline = None if wait_s is None else time.monotonic() + wait_s
            while True:
                self.notifications(keep=True)  # spans freed by D's notifications so far
                last = deadline is None or time.monotonic() >= deadline
                try:
                    record = self._arena.save(self._info, block_ids, num_tokens, request_id, readers,
                                              count_failure=last)
                    break
                except ArenaFull as exc:
                    if last or not exc.ever_fits:
                        raise
                time.sleep(0.001)  # a notification or a TTL frees space; nothing else will
        else:
            pages = self._pages(block_ids, "block_ids")
            if self._copier is not None:
                self._copier.to_host(pages)
        if not self._on_cuda:
            return record
        event = torch.cuda.Event()
        event.record()
        if wait:
            event.synchronize()
            return record
        return event if record is None else (record, event)

    def _pages(self, block_ids, what: str) -> List[np.ndarray]:
        n = len(self.layer_groups)
        if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__len__") or len(block_ids) != n:
            raise ValueError(f"{what}: expected one block id list per KV cache group ({n}), got {shown(block_ids)}")
        sequence(block_ids, what, n)
        out = []
        for g, ids in enumerate(block_ids):
            arr = as_block_ids(ids, f"{what}, group {g}")
            arr = arr[arr != NO_BLOCK]
            out.append(expand_blocks(arr, self.tokens_per_block[g] // self.tokens_per_page[g]))
        return out

    def notifications(self, keep: bool = False) -> Dict[str, List[bytes]]:
        """New notify messages by peer name: each says that peer is done reading a request
        (arena mode: frees that request's span once all its readers said so)."""
        self._check_open()
        new = self._agent.notifications()
        if self._arena is None:
            return new
        self._arena.on_notifications(new)
        self._arena.expire()
        if keep:  # save() looked: hand these to the next caller
            for k, v in new.items():
                self._kept.setdefault(k, []).extend(v)
            return {}
        out, self._kept = self._kept, {}
        for k, v in new.items():
            out.setdefault(k, []).extend(v)
        return out

    # ------------------------------------------------------------ D side
    def plan_pull(self, peer, remote_block_ids, remote_num_tokens: int, local_block_ids,
                  num_cached_tokens=0) -> PullPlan:
        """Plan one request's pull by token position (see :mod:`kvcopy.nixl.plan`).

        ``peer`` is one peer name, or a sequence of them: the TP ranks of one engine
        this rank reads KV heads from (see :func:`kvcopy.nixl.remote_ranks`).
        ``remote_block_ids`` is one list per remote group, shared by those ranks, or a
        mapping peer name -> such lists. One plan, one ``pull``, one ``complete``.
        """
        self._check_open()
        names = [peer] if isinstance(peer, str) else list(peer)
        for name in names:
            if name not in self._peers:
                raise ValueError(f"unknown peer {name!r}; add_peer its metadata first")
        if self._arena is not None:  # remote_block_ids: the peers' StagedRequest records
            self._retry_releases()
            self._arena.flush_deferred(safe=not self._unreleased)
            plan = self._arena.plan_pull(self._arena.info, [self._peers[n].info for n in names], remote_block_ids,
                                         remote_num_tokens, local_block_ids, num_cached_tokens)
            self._bind(plan, names)
            return plan
        sources = [(self._peers[n].info, self._peers[n].layer_pairs) for n in names]
        if isinstance(remote_block_ids, Mapping):
            ids = remote_block_ids
        elif len(names) == 1:
            ids = {names[0]: remote_block_ids}
        else:
            ids = remote_block_ids
        plan = build_multi_pull_plan(self._info, sources, ids, remote_num_tokens, local_block_ids,
                                     num_cached_tokens)
        if self._copier is not None:  # complete() must not fail after the read: check its copy now
            self._copier.plan("h2d", [list(r) + list(z) for r, z in zip(plan.read_pages, plan.zero_pages)])
        self._bind(plan, names)
        return plan

    def _bind(self, plan: PullPlan, names: Sequence[str]) -> None:
        """Remember ``plan`` (by identity, weakly) and the peer records it was made for."""
        key, plans = id(plan), self._plans

        def forget(ref, key=key, plans=plans):  # no reference to self: no cycle
            if plans.get(key, (None,))[0] is ref:
                del plans[key]

        plans[key] = (weakref.ref(plan, forget), tuple((n, self._peers[n]) for n in names))

    def _bound_plan(self, plan, check_peers: bool = True) -> None:
        """Refuse a plan this manager's ``plan_pull`` did not return, or (``check_peers``)
        one whose peers were removed or re-added since: plans are plain frozen data a
        caller can rebuild with other pages (``dataclasses.replace``), and nothing past
        this check re-derives them from the handshakes."""
        entry = self._plans.get(id(plan)) if isinstance(plan, (PullPlan, ArenaPlan)) else None
        if entry is None or entry[0]() is not plan:
            raise ValueError(
                f"{type(plan).__name__} is not a plan made by TransferManager {self.name!r}'s plan_pull "
                "(plans are bound to the manager that made them; an edited or copied plan is refused)")
        if check_peers:
            for name, peer in entry[1]:
                if self._peers.get(name) is not peer:
                    raise ValueError(f"the plan was made for peer {name!r}, which was removed or re-added "
                                     "since: plan_pull again")

    def _own(self, h) -> None:
        if not isinstance(h, PullHandle) or h._owner is not self._token:
            raise ValueError(f"{h!r} is not a pull of TransferManager {self.name!r}")

    def pull(self, plan: PullPlan, notify: bytes = b"", timeout_s: Optional[float] = None) -> PullHandle:
        """Post the NIXL READ of ``plan``; ``notify`` is sent to the peer when it is done.

        ``timeout_s`` (default: the manager's ``pull_timeout_s``; None: no deadline):
        a pull still in flight that long after this call fails at the next ``poll``
        (``ERR``, "deadline"): its transfer is released (NIXL cancels it) and it
        completes like any failed pull."""
        self._check_open()
        if not isinstance(notify, (bytes, bytearray)):
            raise TypeError(f"notify must be bytes, got {type(notify).__name__}")
        timeout_s = self.pull_timeout_s if timeout_s is None else seconds(timeout_s, "timeout_s")
        self._bound_plan(plan)
        for name in plan.all_peers:
            if name not in self._peers:
                raise ValueError(f"plan is for unknown peer {name!r}")
        # Everything is checked and built before the first READ is posted.
        if self._arena is not None:
            reads = [(name, "descs", rows) for name, rows in self._arena.reads(plan).items()]
        else:
            reads = self._reads(plan)
        h = PullHandle(next(self._ids), plan, bytes(notify), timeout_s, self._token)
        self._post(h, reads)
        return h

    def _reads(self, plan: PullPlan) -> list:
        mine = self._info.region_refs
        by_peer: Dict[str, list] = {name: [] for name in plan.all_peers}
        for pair in plan.pairs:
            if pair.zero_segments:
                if not same_ref(pair.local, mine) or any(
                        n <= 0 or off < 0 or off + n > pair.local.chunk_bytes for off, n in pair.zero_segments):
                    raise ValueError(f"plan zero segments {pair.zero_segments[:4]} do not fit region {pair.local.index}")
            if pair.local_pages:
                by_peer.get(plan.peer_of(pair), []).append(pair)
        reads = []
        for name, pairs in by_peer.items():
            peer = self._peers[name]
            pieces = check_pairs(pairs, self._info, peer.info, name)
            if all(not p.segments for p in pairs):
                rows = index_rows(pairs, pieces, self._local_offsets, peer.offsets)
                reads.append((name, "prepped", rows))
            else:
                reads.append((name, "descs", desc_rows(pairs, pieces, self._info, peer.info)))
        return reads

    def _post(self, h: PullHandle, reads: list) -> None:
        plan = h.plan
        self._in_flight[h.id] = h
        for name, how, (local_rows, remote_rows) in reads:
            if not len(local_rows):
                h._done.add(name)
                if h.notify:
                    self._agent.send_notification(name, h.notify)
                continue
            peer = self._peers[name]
            if how == "prepped":
                xfer, state, reason = self._agent.post_read(
                    self._local_dlist, local_rows, peer.dlist, remote_rows, h.notify)
            else:
                xfer, state, reason = self._agent.post_read_descs(
                    local_rows, self._info.mem_type, name, remote_rows, peer.info.mem_type, h.notify)
            if xfer is not None:
                h._xfers[name] = xfer
                h._posted = True
            if state == ERR:
                self._fail(h, reason, ended=name)
                return
            if state == DONE:
                h._done.add(name)
        if len(h._done) == len(plan.all_peers):
            self._finish(h)

    def poll(self, h: PullHandle) -> str:
        """``"PROC"``, ``"DONE"`` or ``"ERR"``; a finished transfer's NIXL handle is released."""
        self._own(h)
        if h.state != PROC:
            return h.state
        if self._closed:
            return ERR
        self._retry_releases()
        for name, xfer in list(h._xfers.items()):
            if name in h._done:
                continue
            state, reason = self._agent.state(xfer)
            if state == ERR:
                self._fail(h, reason if len(h.peers) == 1 else f"peer {name!r}: {reason}", ended=name)
                return h.state
            if state == DONE:
                h._done.add(name)
        if len(h._done) == len(h.peers):
            self._finish(h)
        elif h.deadline is not None and time.monotonic() >= h.deadline:
            late = [n for n in h.peers if n not in h._done]
            self._fail(h, f"deadline: not done {h.timeout_s:g} s after pull (waiting on {late})")
        return h.state

    def abort(self, h: PullHandle) -> None:
        """Give up a pull in flight: NIXL cancels it, the request fails (``ERR``)."""
        self._own(h)
        if h.state == PROC:
            self._fail(h, "aborted")

    def complete(self, h: PullHandle) -> Completion:
        """D: after ``DONE``, zero the plan's unread pages and copy the read pages to the
        device caches (one masked copy); after ``ERR``, write nothing and report the
        request's local block ids as failed. Raises while the pull is in flight."""
        self._own(h)
        if h.completed:
            raise ValueError(f"{h!r} was already completed")
        state = self.poll(h)
        if state == PROC:
            raise ValueError(f"{h!r} is still in flight; poll until DONE or ERR")
        if state == DONE:
            self._check_open()
            self._bound_plan(h.plan, check_peers=False)  # before the first write
        h.completed = True
        if self._arena is not None:
            return self._complete_arena(h, state)
        if state == ERR:
            if not h._posted:
                return Completion(False, h.plan.local_block_ids, h.error)
            where = "host buffers" if self.buffer == "host" else "device caches"
            return Completion(False, h.plan.local_block_ids, h.error, h.plan.read_pages, where)
        self._zero_rows(h.plan)
        self._zero(h.plan.zero_pages)
        if self._copier is not None:
            self._copier.to_device([list(p) for p in h.plan.read_pages])
        return Completion(True, tuple(() for _ in self.layer_groups), None)

    def _complete_arena(self, h: PullHandle, state: str) -> Completion:
        """Arena mode: zero, scatter D's span into the KV (one masked call per chunk
        size), free the span; on ERR free it and write nothing."""
        plan: ArenaPlan = h.plan
        try:
            if state == DONE:
                self._check_open()
                self._arena.scatter(plan)
        finally:
            self._retry_releases()
            # A READ D released unfinished may still land (see docs/nixl.md,
            # "Deadlines"): its span is not reused for arena_ttl_s. A READ that NIXL
            # ended in ERR has stopped touching it.
            self._arena.discard(plan, safe=not self._unreleased, quarantine=state == ERR and h._abandoned)
        if state == ERR:
            return Completion(False, plan.local_block_ids, h.error)
        return Completion(True, tuple(() for _ in self.layer_groups), None)

    def discard(self, plan: ArenaPlan) -> None:
        """Arena mode: free the span of a plan that will not be pulled."""
        if self._arena is None or not isinstance(plan, ArenaPlan):
            raise ValueError("discard takes an arena-mode plan")
        self._bound_plan(plan, check_peers=False)  # only this manager's plans free its spans
        self._arena.discard(plan)

    @property
    def arena(self) -> Optional[ArenaStaging]:
        """The staging arena (arena mode), else None; ``arena.stats()`` for its metrics."""
        return self._arena

    def _zero_rows(self, plan: PullPlan) -> None:
        """Rows of read pages past the prompt (a plan's ``zero_segments``), in the
        tensors NIXL wrote (host buffers, or the device caches): the h2d then copies
        whole pages."""
        for pair in plan.pairs:
            if not (pair.zero_segments and pair.pages_to_zero):
                continue
            t = self._regions.transfer_tensors[pair.layers[0]]
            buf = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            base = t.storage_offset() * t.element_size()
            pages = np.asarray(pair.pages_to_zero, dtype=np.int64) * pair.local.page_stride + base
            starts, lens = [], []
            for c in range(pair.local.num_chunks):
                for off, n in pair.zero_segments:
                    starts.append(pages + c * pair.local.chunk_stride + off)
                    lens.append(np.full(len(pages), n, dtype=np.int64))
            st, ln = np.concatenate(starts), np.concatenate(lens)
            idx = np.repeat(st - np.concatenate([[0], np.cumsum(ln)[:-1]]), ln) + np.arange(int(ln.sum()))
            buf.index_fill_(0, torch.as_tensor(idx, device=t.device), 0)

    def _zero(self, zero_pages) -> None:
        for g, pages in enumerate(zero_pages):
            if not pages:
                continue
            seen = set()
            for name in self.layer_groups[g]:
                t = self._device_caches[name]
                layout = self._regions.layouts[name]
                key = (t.data_ptr(), layout.block_stride, layout.block_dim)
                if key in seen:
                    continue
                seen.add(key)
                ids = torch.as_tensor(pages, dtype=torch.int64, device=t.device)
                as_words(t).index_fill_(layout.block_dim, ids, 0)

    # ------------------------------------------------------------ bookkeeping
    def _finish(self, h: PullHandle) -> None:
        h.state = DONE
        self._release(h)

    def _fail(self, h: PullHandle, reason: Optional[str], ended: Optional[str] = None) -> None:
        """Fail a pull; ``ended``: the peer whose READ NIXL ended in ERR (the others still
        in flight are released unfinished: abandoned)."""
        h.state = ERR
        h.error = reason or "transfer failed"
        h._abandoned = any(name != ended and name not in h._done for name in h._xfers)
        self._release(h)
        if h.notify:  # let P's ranks whose READ did not finish free their blocks; best effort
            for name in h.peers:
                if name in self._peers and name not in h._done:
                    self._agent.send_notification(name, h.notify)

    def _release(self, h: PullHandle) -> None:
        self._in_flight.pop(h.id, None)
        xfers, h._xfers = list(h._xfers.values()), {}
        for xfer in xfers:
            if Agent.release(xfer) is not None:
                self._unreleased.append(xfer)

    def _retry_releases(self) -> None:
        if self._unreleased:
            self._unreleased = [x for x in self._unreleased if Agent.release(x) is not None]

    def stats(self) -> Dict[str, int]:
        """Counts for leak checks: pulls in flight, NIXL transfer handles not yet released."""
        self._retry_releases()
        live = sum(len(h._xfers) for h in self._in_flight.values()) + len(self._unreleased)
        out = {"in_flight": len(self._in_flight), "live_transfer_handles": live, "peers": len(self._peers)}
        if self._arena is not None:
            out.update(self._arena.stats())
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"TransferManager {self.name!r} is closed")

    def close(self) -> None:
        """Fail pulls in flight, release every NIXL handle, deregister, drop the agent."""
        if self._closed:
            return
        for h in list(self._in_flight.values()):
            self._fail(h, "manager closed")
        for name in list(self._peers):
            self.remove_peer(name)
        self._retry_releases()
        self._closed = True
        self._release_agent()
        if self._copier is not None:
            self._copier.close()
        if self._arena is not None:
            self._arena.close()

    def _release_agent(self) -> None:
        if self._local_dlist is not None:
            Agent.release_dlist(self._local_dlist)
            self._local_dlist = None
        for reg in self._registrations:
            try:
                self._agent.deregister(reg)
            except Exception:
                pass
        self._registrations = []
        self._agent.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
