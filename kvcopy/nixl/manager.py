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
writes nothing to the device caches. The peer is then sent the request's ``notify``
message (best effort) so it can free its blocks. Input errors (bad ids, a plan that
does not fit this manager or peer, page ids outside their region) raise
``ValueError``/``TypeError`` before anything moves. Descriptors NIXL rejects when the
transfer is made (for example a peer whose NIXL metadata was invalidated or
re-registered since ``add_peer``: the prepared descriptors are stale) fail the request.

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
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..copier import BlockCopier
from ..reference import as_words
from ._agent import Agent, NixlError, metadata_name
from .descriptors import check_pairs, desc_rows, index_rows, same_ref
from .handshake import (
    EngineInfo, LayerPair, check_key, check_peer_limits, decode, encode, layer_limit, pair_layers,
)
from .plan import NO_BLOCK, PullPlan, build_multi_pull_plan, expand_blocks, forget_routes
from .regions import RegionSet, build_regions, descriptor_table, tokens_per_group

PROC, DONE, ERR = "PROC", "DONE", "ERR"


@dataclass(frozen=True)
class Completion:
    """What ``complete`` did: ``ok``, else the request's local block ids that failed."""

    ok: bool
    failed_block_ids: Tuple[Tuple[int, ...], ...]  # per local group; empty lists when ok
    error: Optional[str] = None


class PullHandle:
    """One pull in flight or finished. ``state`` is PROC, DONE or ERR; ``error`` says why."""

    __slots__ = ("id", "plan", "notify", "state", "error", "completed", "_xfers", "_done")

    def __init__(self, id_: int, plan: PullPlan, notify: bytes):
        self.id = id_
        self.plan = plan
        self.notify = notify
        self.state = PROC
        self.error: Optional[str] = None
        self.completed = False
        self._xfers: Dict[str, object] = {}  # peer -> NIXL transfer handle not yet released
        self._done: set = set()  # peers whose READ finished

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
        key: Optional[bytes] = None,
    ):
        self._closed = True
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
        self._regions: RegionSet = build_regions(
            device_caches, self.layer_groups, tpp, buffer, block_dim, kv_layout, tp_rank, tp_size, total_kv_heads
        )
        grouped = {n: device_caches[n] for layers in self.layer_groups for n in layers}
        self._device_caches = grouped
        self._copier = None
        if buffer == "host":
            self._copier = BlockCopier(grouped, self._regions.host_views, self.layer_groups,
                                       backend=copy_backend, block_dim=block_dim, kv_layout=kv_layout)
        self._on_cuda = any(t.device.type == "cuda" for t in grouped.values())
        try:
            self._agent = Agent(name, tuple(backends))
        except Exception:
            if self._copier is not None:
                self._copier.close()
            raise
        self._registrations = []
        self._peers: Dict[str, _Peer] = {}
        self._in_flight: Dict[int, PullHandle] = {}
        self._unreleased: List[object] = []  # NIXL handles whose release failed; retried
        self._ids = itertools.count()
        self._local_dlist = None
        self._local_offsets = self._regions.descriptor_offsets.tolist()  # descriptor row of each region
        try:
            for s in self._regions.storages:
                self._registrations.append(self._agent.register([(s.address, s.nbytes, s.device_id)], s.mem_type))
            self._local_dlist = self._agent.prep_local(self._regions.descriptors(), self._regions.mem_type)
        except NixlError:
            self._release_agent()
            raise
        self._info = EngineInfo(
            name=name, buffer=buffer, mem_type=self._regions.mem_type, tp_rank=tp_rank, tp_size=tp_size,
            tokens_per_block=self.tokens_per_block, tokens_per_page=self.tokens_per_page,
            regions=tuple(self._regions.regions), agent_metadata=self._agent.metadata(),
        )
        self._closed = False

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
        try:
            dlist = self._agent.prep_remote(name, descs, remote.mem_type)
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
        Agent.release_dlist(peer.dlist)
        self._agent.release_remote(name)  # parked, not unloaded: see kvcopy.nixl._agent
        forget_routes(peer.info)  # the planner's cached routes must not keep the peer alive

    # ------------------------------------------------------------ P side
    def save(self, block_ids: Sequence[Sequence[int]], wait: bool = True):
        """Copy these logical blocks of every group to the host buffers (host mode).

        One masked ``BlockCopier.to_host`` for all groups; ``NO_BLOCK`` entries are
        skipped. Returns ``None``, or on CUDA with ``wait=False`` the CUDA event to wait
        on before advertising the blocks (see the module docstring).
        """
        self._check_open()
        pages = self._pages(block_ids, "block_ids")
        if self._copier is not None:
            self._copier.to_host(pages)
        if not self._on_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        if wait:
            event.synchronize()
            return None
        return event

    def _pages(self, block_ids, what: str) -> List[np.ndarray]:
        if isinstance(block_ids, (str, bytes)) or len(block_ids) != len(self.layer_groups):
            raise ValueError(f"{what}: expected one block id list per KV cache group ({len(self.layer_groups)})")
        out = []
        for g, ids in enumerate(block_ids):
            arr = np.asarray(ids)
            if arr.size and arr.dtype.kind not in "iu":
                raise TypeError(f"{what}, group {g}: block ids must be integers, got {arr.dtype}")
            arr = arr.astype(np.int64).reshape(-1)
            arr = arr[arr != NO_BLOCK]
            out.append(expand_blocks(arr, self.tokens_per_block[g] // self.tokens_per_page[g]))
        return out

    def notifications(self) -> Dict[str, List[bytes]]:
        """New notify messages by peer name: each says that peer is done reading a request."""
        self._check_open()
        return self._agent.notifications()

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
        return plan

    def pull(self, plan: PullPlan, notify: bytes = b"") -> PullHandle:
        """Post the NIXL READ of ``plan``; ``notify`` is sent to the peer when it is done."""
        self._check_open()
        if not isinstance(notify, (bytes, bytearray)):
            raise TypeError(f"notify must be bytes, got {type(notify).__name__}")
        for name in plan.all_peers:
            if name not in self._peers:
                raise ValueError(f"plan is for unknown peer {name!r}")
        # Everything is checked and built before the first READ is posted.
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
        h = PullHandle(next(self._ids), plan, bytes(notify))
        self._in_flight[h.id] = h
        for name, how, (local_rows, remote_rows) in reads:
            if not len(local_rows):
                h._done.add(name)
                if notify:
                    self._agent.send_notification(name, h.notify)
                continue
            peer = self._peers[name]
            if how == "prepped":
                xfer, state, reason = self._agent.post_read(
                    self._local_dlist, local_rows, peer.dlist, remote_rows, h.notify)
            else:
                xfer, state, reason = self._agent.post_read_descs(
                    local_rows, self._regions.mem_type, name, remote_rows, peer.info.mem_type, h.notify)
            if xfer is not None:
                h._xfers[name] = xfer
            if state == ERR:
                self._fail(h, reason)
                return h
            if state == DONE:
                h._done.add(name)
        if len(h._done) == len(plan.all_peers):
            self._finish(h)
        return h

    def poll(self, h: PullHandle) -> str:
        """``"PROC"``, ``"DONE"`` or ``"ERR"``; a finished transfer's NIXL handle is released."""
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
                self._fail(h, reason if len(h.peers) == 1 else f"peer {name!r}: {reason}")
                return h.state
            if state == DONE:
                h._done.add(name)
        if len(h._done) == len(h.peers):
            self._finish(h)
        return h.state

    def abort(self, h: PullHandle) -> None:
        """Give up a pull in flight: NIXL cancels it, the request fails (``ERR``)."""
        if h.state == PROC:
            self._fail(h, "aborted")

    def complete(self, h: PullHandle) -> Completion:
        """D: after ``DONE``, zero the plan's unread pages and copy the read pages to the
        device caches (one masked copy); after ``ERR``, write nothing and report the
        request's local block ids as failed. Raises while the pull is in flight."""
        if h.completed:
            raise ValueError(f"{h!r} was already completed")
        state = self.poll(h)
        if state == PROC:
            raise ValueError(f"{h!r} is still in flight; poll until DONE or ERR")
        h.completed = True
        if state == ERR:
            return Completion(False, h.plan.local_block_ids, h.error)
        self._check_open()
        self._zero_rows(h.plan)
        self._zero(h.plan.zero_pages)
        if self._copier is not None:
            self._copier.to_device([list(p) for p in h.plan.read_pages])
        return Completion(True, tuple(() for _ in self.layer_groups), None)

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

    def _fail(self, h: PullHandle, reason: Optional[str]) -> None:
        h.state = ERR
        h.error = reason or "transfer failed"
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
        return {"in_flight": len(self._in_flight), "live_transfer_handles": live, "peers": len(self._peers)}

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
