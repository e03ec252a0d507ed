"""``KvcopyArenaConnector``: vLLM 0.33 P/D with kvcopy's arena as the transport.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvcopyArenaConnector",
        "kv_connector_module_path": "kvcopy.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"kvcopy": {"arena_bytes": 4294967296}}}'

vLLM's scheduler side is its own pull connector's (``NixlPullConnectorScheduler``:
``get_num_new_matched_tokens``, the ``WAITING_FOR_REMOTE_KVS`` flow, ``request_finished``
and its ``kv_transfer_params``, the proxy conventions, the side channel); the worker side
is kvcopy's :class:`~kvcopy.nixl.TransferManager` in arena mode, not vLLM's NIXL worker:

* **P** (``wait_for_save``, :mod:`kvcopy.vllm.arena.stage`): each request whose prefill
  ends this step is staged into P's arena with one masked copy (every group's own
  layers at its own blocks, KV-sharing layers never); the blocks go back to vLLM's pool
  as soon as the arena holds them. No host mirror: the arena (``arena_bytes``) is the
  only pinned host memory, and vLLM's ``initialize_host_xfer_buffer`` never runs.
* **D** (``start_load_kv`` / ``get_transfer_results``, :mod:`kvcopy.vllm.arena.pull`):
  kvcopy's handshake, then ``plan_pull`` / ``pull`` / ``complete`` per request, by token
  position (P and D may use different block and kernel-page sizes, which vLLM's own
  host-buffer path refuses, except on an attention backend that splits its pages into K
  and V halves, vLLM's CPU attention: :func:`split_page_tokens`), skipping D's
  prefix-cache hits.
* **D in push mode** (``transfer_mode: "push"``, :mod:`kvcopy.vllm.arena.push_recv`):
  D reserves a span from P's handshake alone and sends P the reservation over P's side
  channel; P's worker (:mod:`kvcopy.vllm.arena.push_send`) WRITEs its staged span into
  it, record included, and says so over NIXL. P serves both modes. A layer-wise P
  holding the reservation during the request's last step WRITEs its layers as their
  copies end (:mod:`kvcopy.vllm.arena.push_chunks`) and D scatters them as they land.
* Failures reach vLLM's load-error path (``failed_recving``; block ids for single-group
  models) and the scheduler recomputes; a full arena is back-pressure with a deadline on
  both sides. Models: what :mod:`kvcopy.vllm.groups` describes (several groups overlaid
  from byte 0, KV-sharing layers, kernel-page splits, MLA, the six layouts, GDN state).

Decisions, and why:

* **A second class, not a mode of** ``KvcopyNixlConnector``. That connector *is* vLLM's
  NIXL worker (its own NIXL agent, vLLM's registration, a host mirror of the KV) with
  one copy replaced; this one has none of it. As a mode, one worker class would carry
  two unrelated transports and the mirror would be half built before the mode is read.
  vLLM picks connectors by class name, so the choice is one word of the config.
* **P's record reaches D over P's side channel, asked for by D.** vLLM 0.33's scheduler
  calls ``request_finished`` (whose return value becomes ``kv_transfer_params``) in its
  per-request loop of ``update_from_output`` *before* ``update_connector_output`` hands it
  the workers' report of the same step, so the record P's worker made in that step's
  ``wait_for_save`` is not there yet. It can come later still: with a drafter
  (``defer_finalize``) ``wait_for_save`` runs after the step's worker metadata was
  taken, and a request waiting for arena space is staged steps after it finished.
  Letting P's scheduler allocate spans instead would need it to know the span layout
  (kvcopy's handshake geometry and pack order) and the arena to allocate at a given
  offset. So P's workers report records (``build_connector_worker_meta``, merged over TP
  ranks), P's scheduler keeps them (:class:`~kvcopy.vllm.arena.channel.RecordStore`),
  and D asks for them at ``remote_host:remote_port`` (already in ``kv_transfer_params``):
  a round trip on the control plane (the requests waiting for one P asked together), and
  D also learns there when P could not stage a request or how long its span lives.
* **The handshake is kvcopy's, over vLLM's side channel.** Each worker's
  ``get_handshake_metadata`` is vLLM's ``NixlHandshakePayload`` whose agent bytes are
  ``TransferManager.metadata()`` (kvcopy's checked format: digest, optional shared-key
  HMAC, bounded sizes); vLLM's scheduler publishes it and its listener (extended to
  answer for records: :func:`~kvcopy.vllm.arena.channel.serve`) serves it. No new port,
  and D reaches P exactly where vLLM's own connector would.

* **Spans are freed without the engine stepping.** vLLM steps an engine only while it
  has requests; each worker runs a housekeeping thread (every :data:`HOUSEKEEPING_S`)
  that, under the worker's lock (the ``TransferManager`` is driven by one thread at a
  time), reads D's notifications and frees what D is done with and what outlived its
  TTL on P (:meth:`~kvcopy.vllm.arena.stage.ArenaStager.tick`), takes the give-ups P's
  side channel got for its rank (asking its own scheduler's listener: vLLM's scheduler
  reaches the workers only in a step), and sends D's give-ups that waited for P's
  handshake (:meth:`~kvcopy.vllm.arena.pull.ArenaPuller.tick`). On P it also runs at once
  when a push reservation arrives (its long-poll reply wakes it:
  :mod:`kvcopy.vllm.arena.push_send`) or P posts a WRITE, and in between, while P's
  WRITEs are in flight or a D's handshake is on its way, every
  :data:`~kvcopy.vllm.arena.push_send.WRITE_POLL_S` (only chunk WRITEs, during P's
  forward: :data:`~kvcopy.vllm.arena.push_send.CHUNK_POLL_S`) reaping them, backing off
  when they take long (:mod:`kvcopy.vllm.arena.housekeeper`).

What each side exchanges: :mod:`kvcopy.vllm.arena.meta`; the side channel's messages,
with and without a key: :mod:`kvcopy.vllm.arena.channel`. Options
(``kv_connector_extra_config["kvcopy"]``): :class:`~kvcopy.vllm.config.ArenaOptions`.
Not supported: DCP/PCP, PP, sleep mode (the arena stays registered), TP pairs with
GDN state groups of different TP sizes (kvcopy refuses them at ``add_peer``),
``bidirectional_kv_xfer`` (refused when the connector is made: :mod:`kvcopy.vllm.checks`,
which also runs vLLM's checks keyed on the name "NixlConnector"). Its transfer threads
start on the cores vLLM's CPU platform reserves for KV transfer
(:mod:`kvcopy.vllm.affinity`), and its pulls reach vLLM as NIXL connector stats
(:mod:`kvcopy.vllm.arena.stats`).
"""
from __future__ import annotations

import threading
import time
from typing import Dict, Optional, Set, Tuple

import msgspec
from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.logger import init_logger

from ...nixl.manager import TransferManager
from ...nixl.modes.side_stream import CudaStreams, SideStream, StreamOps
from ..affinity import threads_on, transfer_cpus
from .channel import (
    GIVEUP_POLL_S, MAX_GIVE_UPS_REPLY, TAKE_GIVEUPS_MSG, RecordStore, give_ups_of, serve,
)
from .record_client import Reply
from ..checks import ARENA, check_arena_only, check_config, conv_state_layout, has_mamba
from ..config import ARENA_SURFACE, ArenaOptions, from_transfer_config
from .housekeeper import Housekeeper
from .layerwise import LayerwiseStage
from .meta import (
    MAX_TP, ArenaLayerStep, ArenaRecv, ArenaStage, KvcopyArenaMetadata, KvcopyArenaWorkerMeta,
    agent_name, compatibility_hash,
)
from .pull import ArenaPuller
from .push_recv import ArenaPushReceiver
from .push_send import PushSender
from .stage import ArenaStager
from ..groups import arena_layout, group_tokens, host_mirror_bytes, kv_sharing_layers, positions

logger = init_logger("vllm.kvcopy")

HOUSEKEEPING_S = 0.05  # how often a worker reads notifications and TTLs between steps

__all__ = ["KvcopyArenaConnector", "KvcopyArenaScheduler", "KvcopyArenaWorker"]


class KvcopyArenaScheduler(NixlPullConnectorScheduler):
    """vLLM's pull scheduler; P stages each prefill once it ends, D pulls by token position."""

    def __init__(self, vllm_config, engine_id: str, kv_cache_config, options: ArenaOptions):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        # The base then tracks P's requests to save (_reqs_need_save) whatever the device.
        self.use_host_buffer = True
        self.options = options
        self.tokens = group_tokens(kv_cache_config)
        self.store = RecordStore(options.manager.arena_ttl_s, tp_size=vllm_config.parallel_config.tensor_parallel_size)
        self.key = options.manager.key
        self.kv_cache_manager = None  # bound by the connector (bind_kv_cache_manager)
        self._stage: Dict[str, ArenaStage] = {}
        self._layers: Dict[str, ArenaLayerStep] = {}  # layer-wise: this step's prefill requests
        self._recv: Dict[str, ArenaRecv] = {}
        # P: requests sent to the workers for staging, not yet reported by every rank
        self._awaiting: Dict[str, Tuple[float, Set[int]]] = {}

    def _nixl_handshake_listener(self, encoded_data, ready_event, stop_event, host, port):
        """vLLM's listener thread, answering for records too (the base starts it)."""
        serve(encoded_data, ready_event, stop_event, host, port, self.store, self.key)

    # ------------------------------------------------------------ P
    def _build_save_meta(self, meta, scheduler_output) -> None:
        """Requests whose prefill ends this step, with their whole block table; with
        ``layerwise`` every request computing prompt tokens this step, with its table now."""
        for rid, n in (scheduler_output.num_scheduled_tokens or {}).items():
            req = self._reqs_need_save.get(rid)
            if req is None:
                continue
            final = req.num_computed_tokens + n >= req.num_prompt_tokens
            if not (final or self.options.layerwise):
                continue
            if self.kv_cache_manager is None:
                raise RuntimeError("KvcopyArenaConnector: no KV cache manager bound to the scheduler side")
            table = self.kv_cache_config.select_transfer_block_ids(self.kv_cache_manager.get_block_ids(rid))
            ids = tuple(tuple(g) for g in positions(self.tokens, table, req.num_prompt_tokens))
            prompt = int(req.num_prompt_tokens)
            if self.options.layerwise:
                self._layers[rid] = ArenaLayerStep(ids, prompt, int(req.num_computed_tokens),
                                                   min(prompt, int(req.num_computed_tokens + n)))
            if not final:
                continue
            del self._reqs_need_save[rid]
            self._stage[rid] = ArenaStage(ids, prompt)
            self._awaiting[rid] = (time.monotonic() + self.options.stage_timeout_s + self.store.margin_s, set())

    def request_finished(self, request, block_ids):
        rid = request.request_id
        unstaged = rid in self._reqs_need_save  # finished before its prefill ended: nothing to stage
        delay, params = super().request_finished(request, block_ids)
        if rid in self._reqs_not_processed:  # aborted: the workers drop it
            self._awaiting.pop(rid, None)
            self.store.fail(rid, "aborted on P")
        elif unstaged and params is not None and params.get("do_remote_prefill"):
            self._reqs_need_save.pop(rid, None)
            self._reqs_need_send.pop(rid, None)
            self.store.fail(rid, "finished before its prefill was staged")
            delay = False
        return delay, params

    def update_connector_output(self, connector_output) -> None:
        super().update_connector_output(connector_output)
        report = connector_output.kv_connector_worker_meta
        if not isinstance(report, KvcopyArenaWorkerMeta):
            return
        self.store.update(report)
        for rid, by_rank in list(report.staged.items()) + list(report.failed.items()):
            entry = self._awaiting.get(rid)
            if entry is not None:
                entry[1].update(by_rank)
                if len(entry[1]) >= self.transfer_tp_size:
                    del self._awaiting[rid]

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while P has a request waiting to be staged (arena
        space, a copy), and while D has requests to hand its workers (one aborted before
        it was scheduled: P frees its span)."""
        now = time.monotonic()
        for rid in [r for r, (deadline, _) in self._awaiting.items() if now > deadline]:
            del self._awaiting[rid]
            self.store.fail(rid, "no worker reported it staged")
        return bool(self._awaiting) or bool(self._reqs_need_recv)

    # ------------------------------------------------------------ D
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        rid = request.request_id
        known = rid in self._reqs_need_recv
        self._name_own(request)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if known or rid not in self._reqs_need_recv:
            return
        n = self._get_remote_prefill_token_count(len(request.prompt_token_ids or ()))
        self._recv[rid] = self._recv_meta(request.kv_transfer_params, n,
                                          blocks if num_external_tokens > 0 else None)

    def _name_own(self, request, recv: bool = False) -> None:
        """Concurrent dispatch (push, P has not answered): D names its own request id and
        P matches it by vLLM's base id (push_send; a give-up: stage). vLLM's pull
        scheduler registers a recv only with P's block ids, which a push never reads (and
        without them ``NixlConnectorMetadata.add_new_req_to_recv`` raises ``KeyError``: a
        request aborted before it was scheduled ended D's scheduler). ``recv``: the request
        is in ``_reqs_need_recv`` already (vLLM cleared ``do_remote_prefill`` when it put
        an aborted one there)."""
        params = request.kv_transfer_params
        if self.options.transfer_mode == "push" and params and (recv or params.get("do_remote_prefill")) \
                and not params.get("remote_block_ids"):
            params["remote_request_id"] = request.request_id
            params["remote_block_ids"] = [[]]

    def _recv_meta(self, params, n: int, blocks) -> ArenaRecv:
        """D's blocks as token-anchored lists (prefix-cache hits and null blocks as holes),
        or, with ``blocks`` None, a request D needs nothing of."""
        pos: Optional[Tuple[Tuple[int, ...], ...]] = None
        cached: Tuple[int, ...] = ()
        if blocks is not None:
            per = [blocks.blocks[k] for k in self.tokens.kv_group]
            skip = [[b.block_hash is not None and not b.is_null for b in g] for g in per]
            pos = tuple(tuple(g) for g in positions(self.tokens, [[b.block_id for b in g] for g in per], n, skip))
            cached = tuple(0 if st else min(n, _leading_holes(g) * tpb)
                           for g, st, tpb in zip(per, self.tokens.state, self.tokens.tokens_per_block))
        try:
            port, tp = int(params["remote_port"]), int(params.get("tp_size", 1))
            if not (0 < port < 65536 and 0 < tp <= MAX_TP) or not isinstance(params["remote_host"], str):
                raise ValueError("out of range")
            return ArenaRecv(str(params["remote_engine_id"]), params["remote_host"], port,
                             str(params["remote_request_id"]), tp, n, pos, cached, blocks is not None)
        except (KeyError, TypeError, ValueError) as exc:
            return ArenaRecv("", "", 0, "", 1, n, pos, cached, blocks is not None, f"bad kv_transfer_params: {exc}")

    def build_connector_meta(self, scheduler_output) -> KvcopyArenaMetadata:
        need_recv = {rid: entry[0] for rid, entry in self._reqs_need_recv.items()}
        for req in need_recv.values():  # one aborted before it was scheduled has not been named yet
            self._name_own(req, recv=True)
        nixl = super().build_connector_meta(scheduler_output)  # clears _reqs_need_recv
        recv = {}
        for rid, req in need_recv.items():
            r = self._recv.pop(rid, None)
            if r is None:  # aborted before it was scheduled: P's span can go
                params = req.kv_transfer_params or {}
                r = self._recv_meta(params, int(params.get("remote_num_tokens") or 0), None)
            recv[rid] = r
        stage, self._stage = self._stage, {}
        layers, self._layers = self._layers, {}
        return KvcopyArenaMetadata(nixl, stage, recv, layers)


# Attention backends whose page holds every K row before every V row (vLLM 0.33's CPU
# attention, v1/attention/backends/cpu_attn.py: the [N, C] page viewed as [2N, C/2], K the
# first half), not the token rows of K and V the logical [B, H, N, C] view suggests.
SPLIT_PAGE_BACKENDS = frozenset({"CPU_ATTN"})


def split_page_tokens(vllm_config, layout) -> Optional[Tuple[int, ...]]:
    """Tokens per page of each group when a layer's attention backend splits its pages
    (:data:`SPLIT_PAGE_BACKENDS`), else None. Same-size pages still transfer whole, in
    the backend's own byte order; pages of different sizes do not map token by token, so
    these sizes join the compatibility hash (:func:`~kvcopy.vllm.arena.meta.compatibility_hash`)."""
    context = vllm_config.compilation_config.static_forward_context
    for names in layout.groups:
        for name in names:
            backend = getattr(context.get(name), "attn_backend", None)
            if backend is not None and backend.get_name() in SPLIT_PAGE_BACKENDS:
                return tuple(layout.tokens_per_page)
    return None


def _leading_holes(blocks) -> int:
    """Blocks at the start of a group's table D holds already (prefix-cache hits) or never
    will (vLLM's null block: a sliding window's start)."""
    n = 0
    for b in blocks:
        if not (b.is_null or b.block_hash is not None):
            break
        n += 1
    return n


class KvcopyArenaWorker:
    """One worker rank: its ``TransferManager`` (arena mode), P's stager, D's puller."""

    # P, layer-wise: where the side stream's streams and events come from
    # (kvcopy.nixl.modes.side_stream). None: torch.cuda's when the KV is on a GPU, none on
    # the CPU (copies end in their call there). A test sets a recording one to run the GPU
    # path's ordering on the CPU.
    stream_ops: Optional[StreamOps] = None

    def __init__(self, vllm_config, engine_id: str, kv_cache_config, options: ArenaOptions):
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
        )

        self.vllm_config, self.kv_cache_config, self.options = vllm_config, kv_cache_config, options
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.use_mla = bool(vllm_config.model_config.use_mla)
        self.total_kv_heads = None if self.use_mla else int(vllm_config.model_config.get_total_num_kv_heads())
        self.name = agent_name(engine_id, self.tp_rank)
        self.compat = compatibility_hash(vllm_config)
        self.key = options.manager.key
        self.thread_cpus = transfer_cpus()  # where the transfer threads run (kvcopy.vllm.affinity)
        self.engine_id = engine_id
        self.manager: Optional[TransferManager] = None
        self.stager: Optional[ArenaStager] = None
        self.puller: Optional[ArenaPuller] = None  # D (an ArenaPushReceiver with transfer_mode "push")
        self.sender: Optional[PushSender] = None  # P, serving D's reservations
        self.lock = threading.Lock()  # the manager, stager and puller: the engine thread or the housekeeper
        self.housekeeper: Optional[Housekeeper] = None
        # this engine's own side channel (P: where D's give-ups arrive), as vLLM's scheduler binds it
        self.listener = (envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
                         envs.VLLM_NIXL_SIDE_CHANNEL_PORT + vllm_config.parallel_config.data_parallel_index)
        self.producer = bool(vllm_config.kv_transfer_config.is_kv_producer)
        self._give_ups: Optional[Reply] = None
        self._give_ups_asked = 0.0

    def register_kv_caches(self, kv_caches) -> None:
        layout = arena_layout(self.kv_cache_config, kv_caches, kv_sharing_layers(self.vllm_config), self.use_mla)
        split = split_page_tokens(self.vllm_config, layout)
        conv = conv_state_layout() if has_mamba(self.kv_cache_config) else None
        if split or conv:
            self.compat = compatibility_hash(self.vllm_config, split, conv)
        o = self.options
        replicated = self.total_kv_heads if self.total_kv_heads is not None and self.total_kv_heads < self.tp_size \
            else None  # else each rank's heads x TP, per layer
        # GPU: the streams of P's layer-wise copies; every thread of kvcopy's that launches,
        # waits for or queries GPU work makes the KV's device its own first (enter_thread)
        ops = self.stream_ops
        cuda = [t.device for t in kv_caches.values() if t.device.type == "cuda"]
        if ops is None and cuda:
            ops = CudaStreams(cuda[0])
        # The threads these start (NIXL's progress thread, UCX's async thread, the side channel's
        # client thread and ZMQ's I/O thread, the housekeeper) run off the model's cores:
        # kvcopy.vllm.affinity
        with threads_on(self.thread_cpus):
            self.manager = TransferManager(
                self.name, layout.caches, layout.groups, layout.tokens.tokens_per_block, layout.tokens_per_page,
                buffer="arena", options=o.manager, kv_layout="HND", tp_rank=self.tp_rank, tp_size=self.tp_size,
                total_kv_heads=replicated)
            args = (self.manager, o, layout.tokens, self.tp_rank, self.tp_size, self.total_kv_heads, self.compat,
                    len(self.kv_cache_config.kv_cache_groups) == 1, self.key)
            self.puller = ArenaPushReceiver(*args, own=self.listener, engine_id=self.engine_id) \
                if o.transfer_mode == "push" else ArenaPuller(*args)
            self.stager = ArenaStager(self.manager, o, self.tp_rank, self.tp_size, self.total_kv_heads, self.key)
            if self.producer:
                self.sender = PushSender(self.manager, self.stager, self.puller.channel, self.listener, self.tp_rank,
                                         self.puller.stats)
                self.sender.chunks.min_bytes = o.push_chunk_bytes
            sender = self.sender
            self.housekeeper = Housekeeper(self._tick, self.lock, HOUSEKEEPING_S, self.name,
                                           hurry=None if sender is None else (lambda: sender.poll_s),
                                           quick=None if sender is None else sender.quick,
                                           posts=None if sender is None else (lambda: sender.writes_posted),
                                           enter=None if ops is None else ops.enter_thread)
            if sender is not None:
                sender.wake = self.housekeeper.wake
        if o.layerwise and self.producer:
            side = SideStream(ops, o.layerwise_ctas) if ops is not None else None
            self.stager.layers = LayerwiseStage(self.manager, self.thread_cpus, self.name, o.manager.arena_ttl_s,
                                                side)
            self.stager.layers.on_copied = self._copied
        with threads_on(self.thread_cpus):
            self.housekeeper.start()
        grouped = sum(len(g) for g in layout.groups)
        skipped = len(set(kv_caches) - {n for g in layout.groups for n in g})
        logger.info(
            "kvcopy: arena connector %s: %.3f GiB arena (pinned when the KV is on a GPU; vLLM's host mirror of "
            "these caches would be %.3f GiB), %d transfer groups, %d layers registered%s%s",
            self.name, self.manager.stats()["arena_bytes"] / 2**30, host_mirror_bytes(kv_caches) / 2**30,
            len(layout.groups), grouped, f", {skipped} KV-sharing layers never copied" if skipped else "",
            f"; transfer threads on CPUs {sorted(self.thread_cpus)} (vLLM's cores for KV transfer)"
            if self.thread_cpus else "")

    def _require(self):
        if self.manager is None or self.stager is None or self.puller is None:
            raise RuntimeError("KvcopyArenaConnector: register_kv_caches has not run on this worker")
        return self.stager, self.puller

    def handshake_payload(self) -> NixlHandshakePayload:
        assert self.manager is not None
        return NixlHandshakePayload(compatibility_hash=self.compat, agent_metadata_bytes=self.manager.metadata())

    def _tick(self) -> None:
        """The housekeeper's turn (under the lock): P's notifications, TTLs and give-ups; D's give-ups."""
        if self.stager is None or self.puller is None:
            return
        if self.producer:
            self._take_give_ups()
        self.stager.tick()
        if self.sender is not None:
            self.sender.tick()
        self.puller.tick()

    def _take_give_ups(self) -> None:
        """P: the give-ups this engine's side channel got for this rank (asked every
        ``GIVEUP_POLL_S``, one question in flight)."""
        assert self.stager is not None and self.puller is not None
        asking = self._give_ups
        if asking is not None and asking.done:
            self._give_ups = None
            if asking.parts is not None:
                try:
                    self.stager.note_give_ups(give_ups_of(asking.parts))
                except ValueError as exc:
                    logger.warning("kvcopy arena: %s: this engine's side channel: %s", self.name, exc)
        now = time.monotonic()
        if self._give_ups is None and now - self._give_ups_asked >= GIVEUP_POLL_S:
            self._give_ups_asked = now
            host, port = self.listener
            self._give_ups = self.puller.channel.ask(host, port, msgspec.msgpack.encode((TAKE_GIVEUPS_MSG,
                                                                                        self.tp_rank)),
                                                     MAX_GIVE_UPS_REPLY)

    def start_load(self, meta: KvcopyArenaMetadata) -> None:
        _, puller = self._require()
        with self.lock:
            puller.start(meta.recv)
            puller.step()  # post READs whose records are in, before the forward

    def bind(self, meta: KvcopyArenaMetadata) -> None:
        """P, layer-wise: plan this step's copies before the forward (kvcopy.vllm.arena.layerwise)."""
        stager, _ = self._require()
        if stager.layers is not None:
            with self.lock:
                stager.layers.bind(meta.layers)
                if self.sender is not None:
                    for rid, part in stager.layers.final_parts.items():
                        self.sender.chunks.begin(rid, part, self.sender.tokens_for(rid))

    def _copied(self, rid: str, units) -> None:
        """P's copy thread (a GPU: its waiter thread, once the side stream's event after
        them completed): ``units`` of ``rid``'s last step are copied: chunks go
        (kvcopy.vllm.arena.push_chunks), and once the last one is, the record and the
        final WRITE (LayerwiseStage.finish_early)."""
        with self.lock:
            busy = self.sender is not None and self.sender.urgent
            if self.sender is not None:
                self.sender.chunks.copied(rid, units)
            stager = self.stager
            record = stager.layers.finish_early(rid) if stager is not None and stager.layers is not None else None
            if record is not None:
                assert stager is not None
                if self.sender is not None:
                    self.sender.chunks.staged(rid)
                try:
                    stager.staged_early(rid, record)
                except Exception as exc:  # noqa: BLE001 -- failed now: not left to the span's TTL, D's deadline
                    logger.exception("kvcopy arena: reporting %s staged failed", rid)
                    stager.fail_early(rid, f"not staged: {exc}")
                if self.sender is not None:
                    # its reservations' final WRITEs (x where it failed); a raise for one
                    # reservation fails that one alone, whichever request it is for
                    self._push_step("the copy thread's push after staging " + rid[:80])
            self._hurry(busy)

    def _push_step(self, where: str) -> None:
        """``sender.step()``, under the lock. A raise reaching here is of no reservation
        (step answers each reservation's own: kvcopy.vllm.arena.push_send): failing the
        request the caller worked for would fail an innocent one, so it is logged and the
        next turn (the housekeeper's, the next step's) serves the reservations again."""
        assert self.sender is not None
        try:
            self.sender.step()
        except Exception:  # noqa: BLE001 -- retried next turn; a reservation never served fails at its deadline
            logger.exception("kvcopy arena: %s: %s raised outside any reservation; retried next turn",
                             self.name, where)

    def layer_done(self, name: str) -> None:
        """P, layer-wise: ``name``'s attention ran; queue the copies it completes (no lock)."""
        layers = self.stager.layers if self.stager is not None else None
        if layers is not None:
            layers.layer_done(name)

    def save(self, meta: KvcopyArenaMetadata) -> None:
        stager, _ = self._require()
        if stager.layers is not None:
            stager.layers.wait_copies()  # without the lock: a copy's chunk post takes it
        with self.lock:
            stager.step(meta)
            if self.sender is not None:
                self._push_step("wait_for_save's push")  # post the reservations whose requests are staged now
                self.sender.chunks.end_step()
            self._hurry()

    def _hurry(self, busy_before: bool = False) -> None:
        """P posted WRITEs (chunks, final ones): the housekeeper polls them from now on
        (``PushSender.poll_s``), so D's ``c``/``f`` go as they end; asleep in its long period it
        would see them only at its next turn (up to HOUSEKEEPING_S: an idle engine does not
        step). Woken at once for a final WRITE (or a D's handshake on its way); for chunks
        only when nothing was in flight before (``busy_before``): a chunk posted while
        others are is seen at the next of the turns they get, and a wake per layer would
        run a whole turn per layer during P's forward."""
        if self.housekeeper is None or self.sender is None:
            return
        if self.sender.awaited or (self.sender.urgent and not busy_before):
            self.housekeeper.wake()

    def transfer_results(self) -> KVConnectorTransferResults:
        stager, puller = self._require()
        with self.lock:
            puller.step()
            done, failed = puller.results()
            return KVConnectorTransferResults(finished_sending=stager.finished_sending(), finished_recving=done,
                                              failed_recving=failed)

    def load_error_block_ids(self) -> Set[int]:
        with self.lock:
            return self.puller.take_error_blocks() if self.puller is not None else set()

    def report(self) -> Optional[KvcopyArenaWorkerMeta]:
        with self.lock:
            return self.stager.take_report() if self.stager is not None else None

    def shutdown(self) -> None:
        if self.housekeeper is not None:
            self.housekeeper.stop()
            self.housekeeper = None
        if self.stager is not None and self.stager.layers is not None:
            self.stager.layers.close()
        if self.puller is not None:
            self.puller.close()
        if self.manager is not None:
            self.manager.close()
        self.manager = self.stager = self.puller = self.sender = None



class KvcopyArenaConnector(NixlBaseConnector):
    """vLLM's connector interface over :class:`KvcopyArenaScheduler` (scheduler process)
    and :class:`KvcopyArenaWorker` (each worker); see the module docstring."""

    def __init__(self, vllm_config, role, kv_cache_config):
        check_config(vllm_config, ARENA, kv_cache_config)  # vLLM's checks keyed on "NixlConnector"
        check_arena_only(vllm_config.kv_transfer_config)
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        options = from_transfer_config(self.kv_transfer_config, ARENA_SURFACE)
        self.arena_worker: Optional[KvcopyArenaWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvcopyArenaScheduler(vllm_config, self.engine_id, kv_cache_config, options)
        elif role == KVConnectorRole.WORKER:
            self.arena_worker = KvcopyArenaWorker(vllm_config, self.engine_id, kv_cache_config, options)
        else:
            raise ValueError(f"unsupported KVConnectorRole: {role}")

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        return False

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if isinstance(self.connector_scheduler, KvcopyArenaScheduler):
            self.connector_scheduler.kv_cache_manager = kv_cache_manager

    # ------------------------------------------------------------ worker side
    def _worker(self) -> KvcopyArenaWorker:
        if self.arena_worker is None:
            raise RuntimeError("KvcopyArenaConnector: a worker-side call on the scheduler side")
        return self.arena_worker

    def register_kv_caches(self, kv_caches) -> None:
        self._worker().register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation) -> None:
        """Not used: the arena's own copies move the bytes."""

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.arena_worker is not None and isinstance(connector_metadata, KvcopyArenaMetadata) \
                and connector_metadata.layers:
            self.arena_worker.bind(connector_metadata)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Layer-wise P: the layer's KV is written; its settled pages are copied now."""
        if self.arena_worker is not None:
            self.arena_worker.layer_done(layer_name)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcopyArenaMetadata)
        self._worker().start_load(meta)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcopyArenaMetadata)
        self._worker().save(meta)

    def get_finished(self, finished_req_ids):
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids) -> KVConnectorTransferResults:
        return self._worker().transfer_results()

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._worker().load_error_block_ids()

    def get_handshake_metadata(self) -> NixlHandshakePayload:
        return self._worker().handshake_payload()

    def build_connector_worker_meta(self) -> Optional[KvcopyArenaWorkerMeta]:
        return self._worker().report()

    def get_kv_connector_stats(self):
        """D's pull figures as vLLM's NIXL stats (:mod:`kvcopy.vllm.arena.stats`): vLLM logs
        and exports them as it does its own connector's."""
        worker = self.arena_worker
        if worker is None or worker.puller is None:
            return None
        return worker.puller.stats.take()

    def unregister_kv_caches(self) -> None:
        raise NotImplementedError("KvcopyArenaConnector does not support sleep mode")

    def restore_kv_caches(self) -> None:
        raise NotImplementedError("KvcopyArenaConnector does not support sleep mode")

    def shutdown(self) -> None:
        if self.arena_worker is not None:
            self.arena_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
