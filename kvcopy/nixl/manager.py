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

What differs between the modes is a :class:`~kvcopy.nixl.buffer_mode.BufferMode`
(:mod:`kvcopy.nixl.paged_modes` for host and device, :mod:`kvcopy.nixl.staging` for the
arena); this class keeps the handshake, the peers, NIXL (registration, READs, handles),
deadlines, notifications and the plans it handed out.

Block ids are logical, one list per KV cache group; logical block ``b`` of a group is
kernel pages ``b*r ... b*r + r - 1`` with ``r = tokens_per_block // tokens_per_page``.
Host buffers mirror device pages one to one, so concurrent requests, whose blocks are
disjoint, never share a host page. Ids and token counts from the caller are checked
once, on the way in (:mod:`kvcopy.checks`, :func:`~kvcopy.nixl.plan.request_block_ids`).

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
by :mod:`kvcopy.nixl.descriptors` in a fixed number of numpy calls. Rows of
read pages past the prompt are zeroed by ``complete`` in the buffers NIXL wrote, before
the h2d copy.

Not thread-safe: one thread drives a manager.
"""
from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Type

import torch

from ..checks import name as checked_name, seconds
from ._agent import Agent, NixlError, metadata_name
from .arena import ArenaFull
from .buffer_mode import BufferMode, Peer, Read
from .handshake import EngineInfo, check_peer_limits, decode, encode, layer_limit, pair_layers
from .options import ManagerOptions
from .paged_modes import DeviceMode, MirrorMode
from .plan import Plan
from .pull import DONE, ERR, PROC, Completion, PullHandle
from .regions import MAX_NAME, RegionSet, descriptor_table, tokens_per_group
from .staging import ArenaStaging

MODES: Dict[str, Type[BufferMode]] = {"host": MirrorMode, "device": DeviceMode, "arena": ArenaStaging}


@dataclass(frozen=True)
class _Remote:
    """A peer added with ``add_peer``: what the modes see, and NIXL's prepared descriptor
    list of its regions (None: an arena peer, read at its staged spans only)."""

    peer: Peer
    dlist: object


@dataclass(frozen=True)
class _Issued:
    """A plan this manager's ``plan_pull`` returned (held weakly), and the peer records it
    was made for: a plan is accepted only while it is this object and its peers are these."""

    ref: weakref.ref
    peers: Tuple[Tuple[str, _Remote], ...]


class TransferManager:
    """NIXL transfers of paged KV between engines (see the module docstring).

    Keyword options (``**options``, or ``options=ManagerOptions(...)``): see
    :class:`~kvcopy.nixl.options.ManagerOptions`."""

    def __init__(self, name: str, device_caches: Mapping[str, torch.Tensor], layer_groups: Sequence[Sequence[str]],
                 tokens_per_block, tokens_per_page=None, buffer: str = "host", backends: Sequence[str] = ("UCX",),
                 *, options: Optional[ManagerOptions] = None, **overrides):
        self._closed = True  # until built: close() (and __del__) then touch nothing
        self.name = checked_name(name, "name (the NIXL agent name)", MAX_NAME)
        opts = ManagerOptions.make(options, overrides)
        self.pull_timeout_s = opts.pull_timeout_s
        # Shared HMAC key (docs/nixl.md, "Trust model"): metadata() is authenticated
        # with it, add_peer accepts only metadata authenticated with it, and so for
        # staged-request records in wire form.
        self._key = opts.key
        if isinstance(layer_groups, (str, bytes)) or any(isinstance(g, (str, bytes)) for g in layer_groups):
            raise TypeError("layer_groups is a sequence of sequences of layer names, one per group")
        self.layer_groups = tuple(tuple(g) for g in layer_groups)
        tpb, tpp = tokens_per_group(tokens_per_block, tokens_per_page, len(self.layer_groups))
        self.tokens_per_block, self.tokens_per_page = tuple(tpb), tuple(tpp)
        if buffer not in MODES:
            raise ValueError(f"buffer must be one of {tuple(MODES)}, got {buffer!r}")
        self.buffer = buffer
        self._mode = mode = MODES[buffer].build(device_caches, self.layer_groups, tpp, opts)
        try:
            self._agent = Agent(self.name, tuple(backends), opts.progress_delay_us)
        except Exception:
            mode.close()
            raise
        self._registrations: List[object] = []
        self._kept: Dict[str, List[bytes]] = {}  # notifications save() read for the caller
        self._peers: Dict[str, _Remote] = {}
        self._peer_keys = itertools.count()  # Peer.key: never reused, so caches never serve a re-added peer
        self._in_flight: Dict[int, PullHandle] = {}
        self._unreleased: List[object] = []  # NIXL handles whose release failed; retried
        self._ids = itertools.count()
        # Plans and handles are bound to the manager (and peers) that made them: a plan
        # edited by the caller, made by another manager or for a peer since removed or
        # re-added is refused before anything moves (see _bound_plan).
        self._token = object()
        self._plans: Dict[int, _Issued] = {}
        self._local_dlist = None
        self._register(mode)
        self._info = EngineInfo(
            name=self.name, buffer=buffer, mem_type=mode.mem_type, tp_rank=opts.tp_rank, tp_size=opts.tp_size,
            tokens_per_block=self.tokens_per_block, tokens_per_page=self.tokens_per_page,
            regions=mode.region_infos, agent_metadata=self._agent.metadata(), arena=mode.arena_range,
        )
        self._closed = False

    def _register(self, mode: BufferMode) -> None:
        """Register the mode's memory with NIXL and prepare its local descriptors."""
        try:
            for address, nbytes, device_id, mem_type in mode.registrations():
                self._registrations.append(self._agent.register([(address, nbytes, device_id)], mem_type))
            descs = mode.local_descriptors()
            if descs is not None:
                self._local_dlist = self._agent.prep_local(descs, mode.mem_type)
        except NixlError:
            self._release_agent()
            mode.close()
            raise

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
        return self._mode.regions

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
        peer = Peer(next(self._peer_keys), remote, tuple(layer_pairs), tuple(offsets.tolist()))
        self._peers[name] = _Remote(peer, dlist)
        return name

    def peers(self) -> List[str]:
        return list(self._peers)

    def remove_peer(self, name: str) -> None:
        """Forget a peer: its pulls in flight fail (``ERR``), its descriptors are released,
        and what the buffer mode cached for it is dropped."""
        remote = self._peers.pop(name, None)
        if remote is None:
            raise ValueError(f"unknown peer {name!r}")
        for h in [h for h in self._in_flight.values() if name in h.peers]:
            self._fail(h, f"peer {name!r} was removed")
        if remote.dlist is not None:
            Agent.release_dlist(remote.dlist)
        self._agent.release_remote(name)  # parked, not unloaded: see kvcopy.nixl._agent
        self._mode.forget(remote.peer)

    # ------------------------------------------------------------ P side
    def save(self, block_ids: Sequence[Sequence[int]], wait: bool = True, *, num_tokens=None,
             request_id=None, readers: int = 1, space_timeout_s: Optional[float] = None):
        """Copy these logical blocks of every group to the host buffers (host mode).

        One masked ``BlockCopier.to_host`` for all groups; ``NO_BLOCK`` entries are
        skipped. Returns ``None``, or on CUDA with ``wait=False`` the CUDA event to wait
        on before advertising the blocks (see the module docstring).

        Arena mode: stages the blocks covering ``num_tokens`` in a span of the arena for
        ``request_id`` and returns the :class:`~kvcopy.nixl.record.StagedRequest` to
        hand to D (``(record, event)`` with ``wait=False`` on CUDA). The span is freed
        when ``readers`` notifications ``request_id`` arrived (:meth:`notifications`),
        or after ``arena_ttl_s``. Raises :class:`~kvcopy.nixl.ArenaFull` when no span fits,
        at once, or with ``space_timeout_s`` after waiting that long for D's notifications
        (or TTLs) to free enough space (this call then blocks the host: it is opt-in).
        Nothing is copied before the span is held.
        """
        self._check_open()
        wait_s = seconds(space_timeout_s, "space_timeout_s")
        deadline = None if wait_s is None else time.monotonic() + wait_s
        looked = False  # at D's notifications since this call started
        while True:
            final = looked and (deadline is None or time.monotonic() >= deadline)
            try:
                record = self._mode.stage(self._info, block_ids, num_tokens, request_id, readers,
                                             wait_s is not None, final)
                break
            except ArenaFull as exc:
                if final or not exc.ever_fits:
                    raise
            if looked:
                time.sleep(0.001)  # a notification or a TTL frees space; nothing else will
            self.notifications(keep=True)  # spans freed by D's notifications so far
            looked = True
        if not self._mode.on_cuda:
            return record
        event = torch.cuda.Event()
        event.record()
        if wait:
            event.synchronize()
            return record
        return event if record is None else (record, event)

    def notifications(self, keep: bool = False) -> Dict[str, List[bytes]]:
        """New notify messages by peer name: each says that peer is done reading a request
        (arena mode: frees that request's span once all its readers said so)."""
        self._check_open()
        new = self._agent.notifications()
        self._mode.on_notifications(new)
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
                  num_cached_tokens=0) -> Plan:
        """Plan one request's pull by token position (see :mod:`kvcopy.nixl.plan`).

        ``peer`` is one peer name, or a sequence of them: the TP ranks of one engine
        this rank reads KV heads from (see :func:`kvcopy.nixl.remote_ranks`).
        ``remote_block_ids`` is one list per remote group, shared by those ranks, or a
        mapping peer name -> such lists; in arena mode, the peers' StagedRequest records
        (or their wire bytes). One plan, one ``pull``, one ``complete``.
        """
        self._check_open()
        names = [peer] if isinstance(peer, str) else list(peer)
        for name in names:
            if name not in self._peers:
                raise ValueError(f"unknown peer {name!r}; add_peer its metadata first")
        self._retry_releases()
        self._mode.reclaim(handles_released=not self._unreleased)
        plan = self._mode.plan(self._info, [self._peers[n].peer for n in names], remote_block_ids,
                                  remote_num_tokens, local_block_ids, num_cached_tokens)
        self._bind(plan, names)
        return plan

    def _bind(self, plan: Plan, names: Sequence[str]) -> None:
        """Remember ``plan`` (by identity, weakly) and the peer records it was made for."""
        key, plans = id(plan), self._plans

        def forget(ref, key=key, plans=plans):  # no reference to self: no cycle
            entry = plans.get(key)
            if entry is not None and entry.ref is ref:
                del plans[key]

        plans[key] = _Issued(weakref.ref(plan, forget), tuple((n, self._peers[n]) for n in names))

    def _bound_plan(self, plan, check_peers: bool = True) -> None:
        """Refuse a plan this manager's ``plan_pull`` did not return, or (``check_peers``)
        one whose peers were removed or re-added since: plans are plain frozen data a
        caller can rebuild with other pages (``dataclasses.replace``), and nothing past
        this check re-derives them from the handshakes."""
        entry = self._plans.get(id(plan)) if isinstance(plan, Plan) else None
        if entry is None or entry.ref() is not plan:
            raise ValueError(
                f"{type(plan).__name__} is not a plan made by TransferManager {self.name!r}'s plan_pull "
                "(plans are bound to the manager that made them; an edited or copied plan is refused)")
        if check_peers:
            for name, remote in entry.peers:
                if self._peers.get(name) is not remote:
                    raise ValueError(f"the plan was made for peer {name!r}, which was removed or re-added "
                                     "since: plan_pull again")

    def _own(self, h) -> None:
        if not isinstance(h, PullHandle) or h._owner is not self._token:
            raise ValueError(f"{h!r} is not a pull of TransferManager {self.name!r}")

    def pull(self, plan: Plan, notify: bytes = b"", timeout_s: Optional[float] = None) -> PullHandle:
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
        reads = self._mode.reads(self._info, plan, {n: self._peers[n].peer for n in plan.all_peers})
        h = PullHandle(next(self._ids), plan, bytes(notify), timeout_s, self._token)
        self._post(h, reads)
        return h

    def _post(self, h: PullHandle, reads: Sequence[Read]) -> None:
        self._in_flight[h.id] = h
        for read in reads:
            name = read.peer
            if not len(read.local):
                h._done.add(name)
                if h.notify:
                    self._agent.send_notification(name, h.notify)
                continue
            remote = self._peers[name]
            if read.prepared:
                xfer, state, reason = self._agent.post_read(
                    self._local_dlist, read.local, remote.dlist, read.remote, h.notify)
            else:
                xfer, state, reason = self._agent.post_read_descs(
                    read.local, self._info.mem_type, name, read.remote, remote.peer.info.mem_type, h.notify)
            if xfer is not None:
                h._xfers[name] = xfer
                h._posted = True
            if state == ERR:
                self._fail(h, reason, ended=name)
                return
            if state == DONE:
                h._done.add(name)
        if len(h._done) == len(h.peers):
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
        """D: after ``DONE``, write the request into the device caches (zero the plan's
        unread pages, copy the read pages: one masked copy); after ``ERR``, write nothing
        and report the request's local block ids as failed. Either way, free what the
        plan holds (arena mode: D's span). Raises while the pull is in flight."""
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
        mode, plan = self._mode, h.plan
        try:
            if state == DONE:
                mode.complete(plan)
        finally:
            self._retry_releases()
            mode.free(plan, failed=state == ERR, abandoned=h._abandoned, handles_released=not self._unreleased)
        if state == DONE:
            return Completion(True, tuple(() for _ in self.layer_groups), None)
        if not h._posted or mode.written_in is None:
            return Completion(False, plan.local_block_ids, h.error)
        return Completion(False, plan.local_block_ids, h.error, plan.read_pages, mode.written_in)

    def discard(self, plan: Plan) -> None:
        """Free what a plan that will not be pulled holds (arena mode: D's span)."""
        self._bound_plan(plan, check_peers=False)  # only this manager's plans free its spans
        self._mode.discard(plan)

    @property
    def arena(self) -> Optional[ArenaStaging]:
        """The staging arena (arena mode), else None; ``arena.stats()`` for its metrics."""
        return self._mode if isinstance(self._mode, ArenaStaging) else None

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
        """Counts for leak checks: pulls in flight, NIXL transfer handles not yet released,
        peers, and the buffer mode's own (arena mode: spans and bytes)."""
        self._retry_releases()
        live = sum(len(h._xfers) for h in self._in_flight.values()) + len(self._unreleased)
        out = {"in_flight": len(self._in_flight), "live_transfer_handles": live, "peers": len(self._peers)}
        out.update(self._mode.stats())
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
        self._mode.close()

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
