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
    m.notify(peer, b"req-7")              # D: tell P outside a pull (it gives the request up)
    m.close()

Data flow in ``"host"`` mode (the default): P's KV -> ``save`` (``BlockCopier.to_host``)
-> P's host buffers -> NIXL READ posted by D -> D's host buffers -> ``complete``
(``BlockCopier.to_device``) -> D's KV. ``"device"`` mode reads P's KV into D's KV;
``"arena"`` mode (:mod:`kvcopy.nixl.modes.arena`) packs a request into one span of a pinned
arena and returns a ``StagedRequest`` for D's ``plan_pull``. What differs between the
modes is a :class:`~kvcopy.nixl.modes.base.BufferMode`; this class keeps the
handshake, the peers, NIXL (registration, READs, handles), deadlines, notifications and
its records of the plans and pulls it handed out (:mod:`kvcopy.nixl.ledger`).

Block ids are logical, one list per KV cache group (block ``b`` is kernel pages ``b*r
... b*r + r - 1``, ``r = tokens_per_block // tokens_per_page``), checked once, on the
way in (:mod:`kvcopy.checks`, :func:`~kvcopy.nixl.planning.plan.request_block_ids`).

Synchronization (the only host waits, all documented here):

* ``save(..., wait=True)`` on CUDA enqueues the d2h on the current stream, records an
  event and waits for it: D's READ is posted by another process, which kvcopy cannot
  order with a CUDA event, so P must not advertise the blocks before the bytes are in
  host memory. ``wait=False`` returns the event instead; advertise the blocks only
  after it completed. On CPU the copy is synchronous and ``save`` returns ``None``.
* ``complete`` enqueues the zeroing and the h2d on the current stream and returns:
  the blocks are usable by work enqueued after it on that stream. It never waits; with
  checksums on CUDA, reading the :class:`Completion`'s verdict before its ``ready``
  waits for the copy (:mod:`kvcopy.nixl.sum_check`).
* ``pull`` and ``poll`` never touch CUDA.

Failures (ERR, a peer that vanished, descriptors NIXL rejects, a deadline, a checksum
mismatch) are values: ``poll`` returns ``"ERR"``, ``complete`` a :class:`Completion`
with ``ok=False`` and the request's local block ids, saying what may have been written.
Input errors (bad ids, a plan that does not fit this manager or peer, a plan used out
of turn) raise ``ValueError``/``TypeError`` before anything moves.

Notifications: D, not NIXL, tells each peer of a pull that it is done with the
request, exactly once: when that peer's READ is DONE, or when the pull fails (then to
every peer not told yet). READs carry no NIXL notification: NIXL sends one whenever its
status check sees the READ complete, also inside the release of a handle given up on.
``notify`` sends one outside a pull (a request D gives up before reading). With a
shared key each carries a tag its receiver checks (:mod:`kvcopy.nixl.wire.notices`).

Deadlines (``pull(..., timeout_s=)`` or ``pull_timeout_s``): a pull in flight past its
deadline fails at the next ``poll`` (no timer thread: ``poll`` checks the clock).

Late READs (:mod:`kvcopy.nixl.late_reads`): releasing a NIXL handle in flight is not a
cancel, so a pull given up on (deadline, ``abort``, ``remove_peer``, a sibling READ's
error, ``close``) fails for the caller at once while its READ handles are kept and
polled (by ``poll``, ``plan_pull``, ``pull``, ``stats``, ``close``), and what they may
write stays held until NIXL reports them ended. ``close`` destroys the NIXL agent (its
UCX worker) before the memory can be freed, or keeps the memory alive.

Heterogeneous peers (see :mod:`kvcopy.nixl.planning.plan`): a plan may read from several peers,
one NIXL READ each; the handle is DONE when all are, and fails as a whole if one fails.

Integrity (``checksum=True``, :mod:`kvcopy.nixl.modes.span_sums`): arena mode's records carry the
page sums of P's pack; D's scatter sums what it copies, and a mismatch fails the request
(``Completion.ok`` False naming the pages); ``stats()`` counts the outcomes.
``require_checksum=True``: ``plan_pull`` refuses a pull it could not compare (``ChecksumRequired``).

Not thread-safe: one thread drives a manager.
"""
from __future__ import annotations

import gc
import itertools
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Type

import torch

from ..checks import name as checked_name, seconds
from .agent import Agent, NixlError
from .modes.spans import ArenaFull
from .modes.base import BufferMode, Peer, Read
from .wire.handshake import decode, encode
from .engine.info import EngineInfo, check_peer_limits, engine_descriptors, layer_limit, pair_layers
from .late_reads import LateReads
from .wire.notices import Mailbox
from .peer_load import load_peer
from .ledger import COMPLETED, DISCARDED, PULLED, Issued, Ledger, PullRecord
from .options import ManagerOptions
from .modes.paged import DeviceMode, MirrorMode
from .planning.plan import Plan
from .sum_check import NOT_WRITTEN, finished, unchecked_refusal
from .pull import DONE, ERR, PROC, Completion, PullHandle
from .engine.regions import MAX_NAME, RegionSet, tokens_per_group
from .modes.arena import ArenaStaging
from .push_reservations import Reservations
from .push_writes import PushWrites

MODES: Dict[str, Type[BufferMode]] = {"host": MirrorMode, "device": DeviceMode, "arena": ArenaStaging}
# Registered memory of closed managers whose READs may still have landed after close()
# (the NIXL agent could not be shown destroyed): kept for the life of the process.
_KEPT_ALIVE: List[object] = []


@dataclass(frozen=True)
class _Remote:
    """A peer added with ``add_peer``, as the modes see it (its NIXL descriptor list is in
    ``_dlists``: nothing plans and handles keep may keep the agent alive past ``close``)."""

    peer: Peer


class TransferManager:
    """NIXL transfers of paged KV between engines (see the module docstring).

    Keyword options (``**options``, or ``options=ManagerOptions(...)``): see
    :class:`~kvcopy.nixl.options.ManagerOptions`."""

    def __init__(self, name: str, device_caches: Mapping[str, torch.Tensor], layer_groups: Sequence[Sequence[str]],
                 tokens_per_block, tokens_per_page=None, buffer: str = "host",
                 *, options: Optional[ManagerOptions] = None, **overrides):
        self._closed = True  # until built: close() (and __del__) then touch nothing
        self.name = checked_name(name, "name (the NIXL agent name)", MAX_NAME)
        opts = ManagerOptions.make(options, overrides, "TransferManager")
        self.pull_timeout_s = opts.pull_timeout_s
        self.require_checksum = opts.require_checksum  # device mode refuses it (no sums)
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
            self._agent = Agent(self.name, opts.transports, opts.progress_delay_us, opts.nixl_thread_nice)
        except Exception:
            mode.close()
            raise
        self._registrations: List[object] = []
        self._mail = Mailbox(self._agent, self._key, self.name)  # notifications (kvcopy.nixl.wire.notices)
        self._peers: Dict[str, _Remote] = {}
        self._dlists: Dict[str, object] = {}  # peer -> NIXL's prepared list of its regions (not arena peers)
        self._peer_keys = itertools.count()  # Peer.key: never reused, so caches never serve a re-added peer
        self._in_flight: Dict[int, PullRecord] = {}
        self._late = LateReads(mode)  # READs given up on, not yet ended (module docstring)
        self._unreleased: List[object] = []  # NIXL handles of ended READs whose release failed; retried
        self._ids = itertools.count()
        # Plans and handles are found by identity in the ledger; nothing the caller does
        # to them reaches memory (kvcopy.nixl.ledger).
        self._ledger = Ledger()
        self._local_dlist = None
        self._register(mode)
        self._info = EngineInfo(
            name=self.name, buffer=buffer, mem_type=mode.mem_type, tp_rank=opts.tp_rank, tp_size=opts.tp_size,
            tokens_per_block=self.tokens_per_block, tokens_per_page=self.tokens_per_page,
            regions=mode.region_infos, agent_metadata=self._agent.metadata(), arena=mode.arena_range,
            sums=mode.sums_region, generation=secrets.token_hex(8))
        self._reservations: Optional[Reservations] = None
        self._push_writes: Optional[PushWrites] = None
        if isinstance(mode, ArenaStaging):
            self._reservations = Reservations(mode, self._info, self._key, lambda: self.notifications(keep=True),
                                              self.require_checksum, self._peer_obj)
            self._push_writes = PushWrites(self._agent, self._mail, mode, self._info, self._key)
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
        then NIXL loads the peer's agent (:func:`~kvcopy.nixl.peer_load.load_peer`: a
        refusal after that releases it again, so the name can be added with genuine metadata).
        """
        self._check_open()
        remote = decode(metadata, self._key, layer_limit(self._info))
        check_peer_limits(self._info, remote)
        layer_pairs = pair_layers(self._info, remote)
        if remote.name in self._peers:
            raise ValueError(f"peer {remote.name!r} is already added; remove_peer it first")
        descs, offsets = engine_descriptors(remote)  # bounded by check_peer_limits
        dlist = load_peer(self._agent, remote, descs, self.name, self._peers)
        self._peers[remote.name] = _Remote(Peer(next(self._peer_keys), remote, tuple(layer_pairs),
                                                tuple(offsets.tolist())))
        if dlist is not None:
            self._dlists[remote.name] = dlist
        return remote.name

    def peers(self) -> List[str]:
        return list(self._peers)

    def remove_peer(self, name: str) -> None:
        """Forget a peer: its pulls in flight fail (``ERR``; their READs are given up on, see the
        module docstring), its descriptors and what the buffer mode cached for it are dropped;
        after NIXL reported its connection failed, ``add_peer`` of its handshake connects anew."""
        if name not in self._peers:
            raise ValueError(f"unknown peer {name!r}")
        self._reap()  # plans the caller dropped go now, with the peer records they hold
        for rec in [r for r in self._in_flight.values() if name in r.peers]:
            self._fail(rec, f"peer {name!r} was removed")
        remote = self._peers.pop(name)
        dlist = self._dlists.pop(name, None)
        if dlist is not None:
            Agent.release_dlist(dlist)
        self._agent.release_remote(name)  # parked, or unloaded if its connection failed: kvcopy.nixl.agent
        self._mode.forget(remote.peer)

    # ------------------------------------------------------------ P side
    def save(self, block_ids: Sequence[Sequence[int]], wait: bool = True, *, num_tokens=None,
             request_id=None, readers: int = 1, space_timeout_s: Optional[float] = None):
        """Copy these logical blocks of every group to the host buffers (host mode).

        One masked ``BlockCopier.to_host`` for all groups; ``NO_BLOCK`` entries are
        skipped. Returns ``None``, or on CUDA with ``wait=False`` the CUDA event to wait
        on before advertising the blocks (see the module docstring).

        Arena mode: stages the blocks covering ``num_tokens`` in a span of the arena for
        ``request_id`` and returns the :class:`~kvcopy.nixl.wire.record.StagedRequest` to
        hand to D (``(record, event)`` with ``wait=False`` on CUDA, the record then a
        :class:`~kvcopy.nixl.modes.span_sums.PendingRecord` with checksums). The span is freed
        when ``readers`` distinct D agents sent a notification ``request_id``
        (:meth:`notifications`), or after ``arena_ttl_s``. Raises
        :class:`~kvcopy.nixl.ArenaFull` when no span fits, at once, or with
        ``space_timeout_s`` after waiting that long for D's notifications (or TTLs) to
        free enough space (this call then blocks the host: it is opt-in). Nothing is
        copied before the span is held.
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
            return finished(record)
        return event if record is None else (record, event)

    def notifications(self, keep: bool = False) -> Dict[str, List[bytes]]:
        """New notify messages by peer name: each says that peer is done reading a request
        (arena mode: frees that request's span once all its readers said so). With a
        key, only messages whose tag matches, tags stripped (:mod:`kvcopy.nixl.wire.notices`)."""
        self._check_open()
        return self._mail.take(self._info.generation, self._on_mail, keep)  # keep: save() looked

    def _on_mail(self, new: Mapping[str, List[bytes]]) -> None:
        if self._reservations is not None:
            self._reservations.on_notices(new)  # push notifications are taken out (kvcopy.nixl.push_reservations)
        self._mode.on_notifications(new)

    @property
    def reservations(self) -> Reservations:
        """D's half of arena mode's pushes (:mod:`kvcopy.nixl.push_reservations`): spans
        of this arena reserved for requests P WRITEs."""
        self._check_open()
        if self._reservations is None:
            raise ValueError(f"push needs buffer='arena', this manager is {self.buffer!r}")
        return self._reservations

    @property
    def push_writes(self) -> PushWrites:
        """P's half of arena mode's pushes (:mod:`kvcopy.nixl.push_writes`): WRITEs of
        this arena's staged spans into spans D reserved."""
        self._check_open()
        if self._push_writes is None:
            raise ValueError(f"push needs buffer='arena', this manager is {self.buffer!r}")
        return self._push_writes

    def _peer_obj(self, name: str) -> Peer:
        if not isinstance(name, str) or name not in self._peers:
            raise ValueError(f"unknown peer {name!r}; add_peer its metadata first")
        return self._peers[name].peer

    def add_target(self, metadata: bytes) -> str:
        """P: check a D's handshake (as ``add_peer`` does, without pairing layers: P never
        plans) and load it into NIXL, so :meth:`push_writes` may WRITE into its arena."""
        remote = decode(metadata, self._key, layer_limit(self._info))
        check_peer_limits(self._info, remote)
        push = self.push_writes
        if remote.name in push.targets() or remote.name in self._peers:
            raise ValueError(f"target {remote.name!r} is already added")
        load_peer(self._agent, remote, engine_descriptors(remote)[0], self.name, self._peers)  # None: an arena
        push.add_target(remote)
        return remote.name

    def remove_target(self, name: str) -> None:
        self.push_writes.forget_target(name)
        self._agent.release_remote(name)

    # ------------------------------------------------------------ D side
    def plan_pull(self, peer, remote_block_ids, remote_num_tokens: int, local_block_ids,
                  num_cached_tokens=0, *, request_id=None) -> Plan:
        """Plan one request's pull by token position (see :mod:`kvcopy.nixl.planning.plan`).

        ``peer`` is one peer name, or a sequence of them: the TP ranks of one engine
        this rank reads KV heads from (see :func:`kvcopy.nixl.remote_ranks`).
        ``remote_block_ids`` is one list per remote group, shared by those ranks, or a
        mapping peer name -> such lists; in arena mode, the peers' StagedRequest records
        (or their wire bytes) of ``request_id`` (required: :mod:`kvcopy.nixl.wire.record`
        says what they are bound to). One plan, one ``pull``, one ``complete`` (or one
        ``discard``): see :mod:`kvcopy.nixl.ledger`. ``require_checksum``: a pull that
        would read pages it cannot compare raises ``ChecksumRequired`` (:mod:`kvcopy.nixl.sum_check`).
        """
        self._check_open()
        names = [peer] if isinstance(peer, str) else list(peer)
        for name in names:
            if not isinstance(name, str) or name not in self._peers:
                raise ValueError(f"unknown peer {name!r}; add_peer its metadata first")
        self._reap()  # spans whose READs ended are free again
        plan, work = self._mode.plan(self._info, [self._peers[n].peer for n in names], remote_block_ids,
                                     remote_num_tokens, local_block_ids, num_cached_tokens, request_id=request_id)
        refusal = unchecked_refusal(work) if self.require_checksum else None
        if refusal is not None:
            self._mode.free(work)
            raise refusal
        self._ledger.bind(plan, tuple((n, self._peers[n]) for n in names), work)
        return plan

    def _issued(self, plan, check_peers: bool = True) -> Issued:
        """The ledger's record of ``plan``: refuse a plan this manager's ``plan_pull``
        did not return, or (``check_peers``) one whose peers were removed or re-added
        since (nothing past this re-derives a plan from the handshakes)."""
        issued = self._ledger.issued(plan, self.name)
        if check_peers:
            for name, remote in issued.peers:
                if self._peers.get(name) is not remote:
                    raise ValueError(f"the plan was made for peer {name!r}, which was removed or re-added "
                                     "since: plan_pull again")
        return issued

    def pull(self, plan: Plan, notify: bytes = b"", timeout_s: Optional[float] = None) -> PullHandle:
        """Post the NIXL READ(s) of ``plan``; ``notify`` is sent to each peer once, when
        its READ is done or the pull failed (module docstring, "Notifications").

        ``timeout_s`` (default: the manager's ``pull_timeout_s``; None: no deadline):
        a pull still in flight that long after this call fails at the next ``poll``
        (``ERR``, "deadline") and completes like any failed pull; its READs are given up
        on, not released (module docstring, "Late READs"). Raises
        :class:`~kvcopy.nixl.pull.PagesHeld` where the pull would read or zero into pages
        a READ given up on may still write (host and device mode), before posting."""
        self._check_open()
        if not isinstance(notify, (bytes, bytearray)):
            raise TypeError(f"notify must be bytes, got {type(notify).__name__}")
        timeout_s = self.pull_timeout_s if timeout_s is None else seconds(timeout_s, "timeout_s")
        issued = self._issued(plan)
        issued.check(PULLED)
        self._reap()
        self._mode.check_writable(issued.work)
        # Everything is checked and built (when planned) before the first READ is posted.
        reads = self._mode.reads(issued.work)
        issued.advance(PULLED)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        rec = PullRecord(next(self._ids), issued, plan, bytes(notify), timeout_s, deadline)
        handle = self._ledger.add_pull(rec)
        self._post(rec, reads)
        return handle

    def _post(self, rec: PullRecord, reads: Sequence[Read]) -> None:
        self._in_flight[rec.id] = rec
        for read in reads:
            name = read.peer
            if not len(read.local):
                self._ended(rec, name, DONE)
                continue
            remote = self._peers[name]
            # No NIXL notification on the READ: D sends its own (module docstring).
            if read.prepared:
                xfer, state, reason = self._agent.post_read(self._local_dlist, read.local, self._dlists[name],
                                                            read.remote, b"")
            else:
                xfer, state, reason = self._agent.post_read_descs(
                    read.local, self._info.mem_type, name, read.remote, remote.peer.info.mem_type, b"")
            if xfer is not None:
                rec.xfers[name] = xfer
                rec.posted = True
            if state == ERR:
                self._fail(rec, reason, ended=name)
                return
            if state == DONE:
                self._ended(rec, name, DONE)
        if len(rec.done) == len(rec.peers):
            self._finish(rec)

    def poll(self, h: PullHandle) -> str:
        """``"PROC"``, ``"DONE"`` or ``"ERR"``; a finished transfer's NIXL handle is released."""
        rec = self._ledger.pull(h, self.name)
        self._reap()
        if rec.state != PROC:
            return rec.state
        for name, xfer in list(rec.xfers.items()):
            state, reason = self._agent.state(xfer)
            if state == ERR:
                self._fail(rec, reason if len(rec.peers) == 1 else f"peer {name!r}: {reason}", ended=name)
                return rec.state
            if state == DONE:
                self._ended(rec, name, DONE)
        if len(rec.done) == len(rec.peers):
            self._finish(rec)
        elif rec.deadline is not None and time.monotonic() >= rec.deadline:
            late = [n for n in rec.peers if n not in rec.done]
            self._fail(rec, f"deadline: not done {rec.timeout_s:g} s after pull (waiting on {late})")
        return rec.state

    def abort(self, h: PullHandle) -> None:
        """Give up a pull in flight: it fails (``ERR``) at once; its READs are given up on
        (module docstring, "Late READs")."""
        rec = self._ledger.pull(h, self.name)
        if rec.state == PROC:
            self._fail(rec, "aborted")

    def complete(self, h: PullHandle) -> Completion:
        """D: after ``DONE``, write the request into the device caches (zero the plan's
        unread pages, copy the read pages: one masked copy); after ``ERR``, write nothing
        and report the request's local block ids as failed. Either way the plan is
        completed and what it holds is freed (arena mode: D's span), at once or when
        NIXL reports its READs given up on ended. Raises while the pull is in flight."""
        rec = self._ledger.pull(h, self.name)
        if rec.completed:
            raise ValueError(f"{h!r} was already completed")
        state = self.poll(h)
        if state == PROC:
            raise ValueError(f"{h!r} is still in flight; poll until DONE or ERR")
        if state == DONE:
            self._check_open()
        return self._complete(rec)

    def _complete(self, rec: PullRecord, write: bool = True) -> Completion:
        rec.completed = True
        issued, mode, check = rec.issued, self._mode, NOT_WRITTEN
        issued.advance(COMPLETED)
        try:
            if rec.state == DONE and write:
                check = mode.complete(issued.work)
        finally:
            if not issued.landing:
                mode.free(issued.work)
        work = issued.work
        if rec.state == DONE:
            return Completion.of_done(len(self.layer_groups), *check, work)
        return Completion.of_failed(work, rec.error, mode.written_in if rec.posted else None, issued.landing > 0)

    def discard(self, plan: Plan) -> None:
        """Give up a plan that was not pulled: free what it holds (arena mode: D's span).
        A plan pulled, completed or discarded already is refused (``ValueError``)."""
        issued = self._issued(plan, check_peers=False)  # only this manager's plans free its spans
        self._discard(issued)

    def _discard(self, issued: Issued) -> None:
        issued.advance(DISCARDED)
        self._mode.free(issued.work)

    def held_blocks(self) -> Tuple[Tuple[int, ...], ...]:
        """Per local group, the local blocks of pulls whose READs were given up on and
        have not ended (see :class:`Completion`, ``read_pending``)."""
        self._reap()
        return self._late.blocks(len(self.layer_groups))

    @property
    def arena(self) -> Optional[ArenaStaging]:
        """The staging arena (arena mode), else None; ``arena.stats()`` for its metrics."""
        return self._mode if isinstance(self._mode, ArenaStaging) else None

    # ------------------------------------------------------------ bookkeeping
    def notify(self, peer: str, message: bytes) -> None:
        """Send ``message`` to an added peer now, outside any pull (D gives a request up
        before reading it: P frees its span at once), tagged with the key if any."""
        self._check_open()
        if not isinstance(message, (bytes, bytearray)) or not message:
            raise TypeError(f"message must be non-empty bytes, got {type(message).__name__}")
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}; add_peer its metadata first")
        self._mail.send(peer, self._peers[peer].peer.info.generation, bytes(message))

    def _notify(self, rec: PullRecord, name: str) -> None:
        """Tell peer ``name`` the pull is done with its request: once, if it has a
        notify message and the peer is still added."""
        if rec.notify and name not in rec.notified and name in self._peers:
            rec.notified.add(name)
            self._mail.send(name, self._peers[name].peer.info.generation, rec.notify)

    def _ended(self, rec: PullRecord, name: str, state: str) -> None:
        """Peer ``name``'s READ of ``rec`` ended (NIXL said so): release its handle."""
        xfer = rec.xfers.pop(name, None)
        if xfer is not None:
            self._release_xfer(xfer)
        if state == DONE:
            rec.done.add(name)
            self._notify(rec, name)

    def _finish(self, rec: PullRecord) -> None:
        rec.state = DONE
        self._in_flight.pop(rec.id, None)

    def _fail(self, rec: PullRecord, reason: Optional[str], ended: Optional[str] = None) -> None:
        """Fail a pull; ``ended``: the peer whose READ NIXL ended in ERR. READs still in
        flight are given up on: their handles are kept (:meth:`_reap`), and what they may
        write is held."""
        rec.state = ERR
        rec.error = reason or "transfer failed"
        self._in_flight.pop(rec.id, None)
        if ended is not None:
            self._ended(rec, ended, ERR)
        for name, xfer in rec.xfers.items():
            self._late.abandon(rec.issued, name, xfer, rec.id)
        rec.xfers = {}
        for name in rec.peers:  # P frees what the request holds on its side
            self._notify(rec, name)

    def _reap(self) -> None:
        """Act on plans and handles the caller dropped; release the handles of READs
        given up on that NIXL now reports ended, and free what they held."""
        self._ledger.dropped(self._discard, self._drop_pull)
        if self._unreleased:
            self._unreleased = [x for x in self._unreleased if Agent.release(x) is not None]
        self._late.reap(self._agent.state, self._release_xfer)

    def _drop_pull(self, rec: PullRecord) -> None:
        """The caller dropped a handle it had not completed: finish it without writing
        the KV (failing it first if in flight), so what its plan holds is freed."""
        if rec.completed:
            return
        if rec.state == PROC:
            self._fail(rec, "the pull's handle was dropped before it completed")
        self._complete(rec, write=False)

    def _release_xfer(self, xfer) -> None:
        if Agent.release(xfer) is not None:
            self._unreleased.append(xfer)

    def stats(self) -> Dict[str, int]:
        """Counts for leak checks: pulls in flight, NIXL transfer handles not yet released
        (of pulls in flight, and of ended READs whose release failed), READs given up on
        that NIXL has not reported ended, peers, and the buffer mode's own (arena mode:
        spans, bytes and spans held by READs given up on, checksum outcomes; host/device:
        READs held)."""
        if not self._closed:
            self._reap()
        live = sum(len(r.xfers) for r in self._in_flight.values()) + len(self._unreleased)
        out = {"in_flight": len(self._in_flight), "live_transfer_handles": live,
               "abandoned_reads": len(self._late), "peers": len(self._peers),
               "notifications_refused": self._mail.refused}
        out.update(self._mode.stats())
        for half in (self._reservations, self._push_writes):
            if half is not None:
                out.update(half.stats())
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"TransferManager {self.name!r} is closed")

    def close(self) -> None:
        """Fail pulls in flight, release every NIXL handle, deregister, destroy the agent
        (module docstring, "Late READs": memory a READ may still write outlives it)."""
        if self._closed:
            return
        for rec in list(self._in_flight.values()):
            self._fail(rec, "manager closed")
        self._reap()
        for name in list(self._peers):
            self.remove_peer(name)
        pending = self._late.drop(Agent.release)  # a release is no cancel: they may land until the agent is gone
        pending = (self._push_writes is not None and self._push_writes.close()) or pending
        self._unreleased = [x for x in self._unreleased if Agent.release(x) is not None]
        self._closed = True
        destroyed = self._release_agent()
        if pending and not destroyed:
            _KEPT_ALIVE.extend(self._mode.memory())
            logging.getLogger("kvcopy.nixl").warning(
                "TransferManager %r closed with READs that may still land and a NIXL agent still referenced: "
                "its registered memory is kept alive for the life of the process", self.name)
        self._mode.close()

    def _release_agent(self) -> bool:
        """Release the local descriptors and registrations and drop the NIXL agent;
        whether the agent (its UCX worker: nothing it posted can land after) is gone."""
        if self._local_dlist is not None:
            Agent.release_dlist(self._local_dlist)
            self._local_dlist = None
        for reg in self._registrations:
            try:
                self._agent.deregister(reg)
            except Exception:
                pass
        self._registrations = []
        gone = self._agent.close()
        if gone() is not None:
            gc.collect()  # a cycle may still hold it
        return gone() is None and not self._unreleased

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
