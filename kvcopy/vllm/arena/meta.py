"""What the arena connector's parts tell each other: per-step metadata, notifications.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first. The connector's
settings are :class:`kvcopy.vllm.config.ArenaOptions`.

* Scheduler -> workers, once per step (:class:`KvcopyArenaMetadata`): vLLM's own NIXL
  metadata (which requests P's scheduler finished or dropped) plus, on P, the requests
  whose prefill ends this step (:class:`ArenaStage`: their block table and token count),
  with ``layerwise`` every request computing prompt tokens this step (:class:`ArenaLayerStep`)
  and, on D, the requests to pull (:class:`ArenaRecv`: where P is, and D's blocks as
  token-anchored lists).
* Workers -> scheduler (:class:`KvcopyArenaWorkerMeta`, merged over TP ranks by vLLM's
  ``aggregate``): per request and P rank, the staged record's wire bytes, or why it
  could not be staged, and which staged spans were freed.
* D -> P over NIXL: a reader's notification (:func:`notify_bytes`, :func:`parse_notify`)
  names the request, D's TP size (so each P rank knows how many D ranks read it) and
  whether D read the span or gave the request up without reading it; either way that
  reader is done with it. With a key it carries a tag P checks (:mod:`kvcopy.nixl.wire.notices`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Dict, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ...nixl.engine.info import MAX_TP

# Bumped on any change of what the two sides exchange (records, notifications, replies).
# 2: records bound to request/rank/registration, give-ups, keyed side channel; 3: pack order v2,
# record slots after the payload, push messages (RESERVE, CANCEL, TAKE_PUSH)
ARENA_PROTOCOL = 3
NOTIFY_PREFIX = b"kvcopy-arena\0"
READ, GAVE_UP = b"r", b"g"  # what a reader's notification says


@dataclass(frozen=True)
class ArenaStage:
    """P: stage this request (its prefill ends this step)."""

    block_ids: Tuple[Tuple[int, ...], ...]  # per transfer group, token-anchored (NO_BLOCK: a hole)
    num_tokens: int


@dataclass(frozen=True)
class ArenaLayerStep:
    """P, layer-wise: a request with prompt tokens computed this step (every step of its
    prefill, chunked or not): its table now and how far its prompt is computed."""

    block_ids: Tuple[Tuple[int, ...], ...]  # per transfer group, token-anchored (NO_BLOCK: a hole)
    num_tokens: int  # the prompt's
    computed_tokens: int  # computed before this step (went back: preempted, staged again)
    done_tokens: int  # computed by the end of this step


@dataclass(frozen=True)
class ArenaRecv:
    """D: pull this request from P (``positions`` None: D needs nothing, only tells P so)."""

    engine_id: str
    host: str
    port: int
    remote_request_id: str
    remote_tp_size: int
    num_tokens: int
    positions: Optional[Tuple[Tuple[int, ...], ...]]  # D's blocks per transfer group, token-anchored
    cached_tokens: Tuple[int, ...]  # per transfer group: D's prefix-cache hit (never written)
    awaiting: bool  # the scheduler waits for this request in finished_recving
    error: Optional[str] = None  # the request's kv_transfer_params could not be used: it fails at once


class KvcopyArenaMetadata(KVConnectorMetadata):
    """One step's scheduler -> worker metadata (see the module docstring)."""

    def __init__(self, nixl, stage: Dict[str, ArenaStage], recv: Dict[str, ArenaRecv],
                 layers: Optional[Dict[str, ArenaLayerStep]] = None):
        self.nixl = nixl  # vLLM's NixlConnectorMetadata: reqs_to_send, reqs_not_processed
        self.stage = stage
        self.recv = recv
        self.layers = layers or {}  # P, layer-wise: this step's prefill requests


@dataclass
class KvcopyArenaWorkerMeta(KVConnectorWorkerMetadata):
    """One step's worker -> scheduler report, per request and P rank."""

    staged: Dict[str, Dict[int, bytes]] = field(default_factory=dict)  # record wire bytes
    failed: Dict[str, Dict[int, str]] = field(default_factory=dict)  # why it was not staged
    released: Dict[str, Set[int]] = field(default_factory=dict)  # spans freed (readers done, TTL, abort)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvcopyArenaWorkerMeta":
        if not isinstance(other, KvcopyArenaWorkerMeta):
            raise TypeError(f"cannot aggregate {type(other).__name__} into KvcopyArenaWorkerMeta")
        out = KvcopyArenaWorkerMeta()
        for part in (self, other):
            for rid, records in part.staged.items():
                out.staged.setdefault(rid, {}).update(records)
            for rid, reasons in part.failed.items():
                out.failed.setdefault(rid, {}).update(reasons)
            for rid, ranks in part.released.items():
                out.released.setdefault(rid, set()).update(ranks)
        return out

    def __bool__(self) -> bool:
        return bool(self.staged or self.failed or self.released)


def agent_name(engine_id: str, tp_rank: int) -> str:
    """The NIXL agent (and peer) name of one engine rank's TransferManager."""
    return f"kvcopy-arena-{engine_id}-tp{tp_rank}"


def compatibility_hash(vllm_config, split_page_tokens: Optional[Tuple[int, ...]] = None,
                       conv_state_layout: Optional[str] = None) -> str:
    """What two engines must share to transfer at all (geometry is kvcopy's handshake's job).

    ``split_page_tokens``: tokens per page of each group where the attention backend keeps
    a page's K rows before its V rows (vLLM's CPU attention: ``[N, K | V]`` per token is
    the logical ``[B, H, N, C]`` view, but the backend reads the page as ``[2N, C/2]``, all
    K then all V). Token positions then do not map between pages of different sizes, so
    the page sizes join the factors, readable at the front of the value (D's refusal of a
    P with other page sizes quotes it): such a pair never transfers, and D recomputes.
    ``conv_state_layout``: vLLM's SSM conv-state layout (``DS``/``SD``), for models with
    Mamba/GDN state, whose bytes the arena moves as they lie (:mod:`kvcopy.vllm.checks`)."""
    from vllm import __version__

    m, c = vllm_config.model_config, vllm_config.cache_config
    factors = {"protocol": ARENA_PROTOCOL, "vllm": __version__, "model": m.model, "dtype": str(m.dtype),
               "cache_dtype": str(c.cache_dtype), "split_page_tokens": list(split_page_tokens or ()),
               "conv_state_layout": conv_state_layout}
    digest = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()
    split = f"kv-split-pages-{'-'.join(map(str, split_page_tokens))}:" if split_page_tokens else ""
    return "kvcopy-arena:" + split + digest


def notify_bytes(remote_request_id: str, d_tp_size: int, kind: bytes = READ) -> bytes:
    """D's notification to each P rank it read (``READ``) or gave up without reading
    (``GAVE_UP``) for a request."""
    rid = remote_request_id.encode("utf-8")
    if b"\0" in rid or kind not in (READ, GAVE_UP):
        raise ValueError(f"request id {remote_request_id[:40]!r} holds a NUL, or kind {kind!r} is unknown")
    return NOTIFY_PREFIX + rid + b"\0" + str(int(d_tp_size)).encode() + b"\0" + kind


def parse_notify(msg: bytes) -> Optional[Tuple[str, int, bytes]]:
    """(request id, D's TP size, ``READ`` or ``GAVE_UP``) of a reader's notification, or
    None for anything else (a notification is peer input: malformed ones are ignored,
    never trusted)."""
    if not isinstance(msg, (bytes, bytearray)) or not msg.startswith(NOTIFY_PREFIX):
        return None
    fields = bytes(msg[len(NOTIFY_PREFIX):]).split(b"\0")
    if len(fields) != 3 or fields[2] not in (READ, GAVE_UP):
        return None
    rid, tp, kind = fields
    if not rid or not tp.isdigit() or len(tp) > 4:
        return None
    try:
        text = rid.decode("utf-8")
    except UnicodeDecodeError:
        return None
    size = int(tp)
    return (text, size, kind) if 1 <= size <= MAX_TP else None
