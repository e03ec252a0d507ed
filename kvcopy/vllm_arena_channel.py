"""The side channel of the arena connector: P's scheduler serves handshakes and records to D.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first.

vLLM's NIXL scheduler already runs a ZMQ ROUTER socket on P (``VLLM_NIXL_SIDE_CHANNEL_HOST``
and ``_PORT``, sent to D in every request's ``kv_transfer_params`` as ``remote_host`` and
``remote_port``) that answers ``(GET_META_MSG, pp_rank, tp_rank)`` with a worker's
handshake payload. :func:`serve` is that listener with one more question: ``(RECORDS_MSG,
request id, [P ranks])``, answered from the :class:`RecordStore` P's scheduler fills from
its workers' reports. Each exchange is one request, one reply (msgpack):

    D -> P  msgpack((GET_META_MSG, 0, tp_rank))            P -> D  [NixlHandshakePayload, perf_counter]
    D -> P  msgpack((RECORDS_MSG, request_id, [ranks]))    P -> D  [msgpack({"state", "records", "ttl_left",
                                                                             "error"})]

``state`` is ``ready`` (every rank's record, ``[[rank, wire bytes], ...]``), ``pending``
(not staged yet: ask again), ``failed`` (a rank could not stage it, or its span is freed
already) or ``expired`` (P's TTL would end before a READ could). ``ttl_left`` is what is
left of P's span lifetime, measured from when the scheduler got the record (so it
overstates the age by one step at most; :class:`RecordStore` subtracts a margin for that).

Everything that arrives is untrusted: the listener answers malformed questions with an
error (it never raises), D's client bounds reply sizes (``zmq.MAXMSGSIZE``), checks every
field, and hands record bytes to kvcopy's ``plan_pull``, which checks them again
(:mod:`kvcopy.nixl.record`).
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Set

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG, NixlHandshakePayload
from vllm.utils.network_utils import make_zmq_path, make_zmq_socket

from .nixl.record import MAX_RECORD_BYTES, MAX_REQUEST_ID
from .vllm_arena_meta import MAX_TP, KvcopyArenaWorkerMeta

RECORDS_MSG = b"kvcopy_records"
STATES = ("ready", "pending", "failed", "expired")
MAX_QUESTION_BYTES = 1 << 16
MAX_METADATA_REPLY = 64 << 20  # kvcopy's handshake: 8 MiB header + 16 MiB NIXL metadata, framed
MAX_RECORDS_REPLY = 64 << 20
MAX_TTL_S = 1e6


@dataclass
class _Entry:
    received: float
    records: Dict[int, bytes] = field(default_factory=dict)
    failed: Dict[int, str] = field(default_factory=dict)
    released: Set[int] = field(default_factory=set)


class RecordStore:
    """P's scheduler: per request, each P rank's staged record (or failure), shared with
    the listener thread. ``ttl_s`` is the workers' arena TTL; ``margin_s`` covers the time
    between a worker staging a request and the scheduler receiving its report."""

    def __init__(self, ttl_s: float, margin_s: Optional[float] = None):
        self.ttl_s = float(ttl_s)
        self.margin_s = max(1.0, 0.1 * self.ttl_s) if margin_s is None else float(margin_s)
        self._lock = threading.Lock()
        self._entries: Dict[str, _Entry] = {}

    def update(self, report: KvcopyArenaWorkerMeta, now: Optional[float] = None) -> Set[str]:
        """Take one step's worker report; returns the requests that got a record or a failure."""
        now = time.monotonic() if now is None else now
        touched = set(report.staged) | set(report.failed)
        with self._lock:
            for rid, by_rank in report.staged.items():
                self._entries.setdefault(rid, _Entry(now)).records.update(by_rank)
            for rid, reasons in report.failed.items():
                self._entries.setdefault(rid, _Entry(now)).failed.update(reasons)
            for rid, ranks in report.released.items():
                entry = self._entries.get(rid)
                if entry is not None:  # a freed span is never served again
                    entry.released.update(ranks)
                    for r in ranks:
                        entry.records.pop(r, None)
        self.purge(now)
        return touched

    def fail(self, request_id: str, reason: str) -> None:
        """The scheduler's own verdict: this request will never be staged."""
        with self._lock:
            self._entries.setdefault(request_id, _Entry(time.monotonic())).failed[-1] = reason

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._entries.pop(request_id, None)

    def purge(self, now: Optional[float] = None) -> None:
        """Forget entries past their TTL (P's spans are gone by then)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for rid in [r for r, e in self._entries.items() if now - e.received > self.ttl_s]:
                del self._entries[rid]

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, request_id: str, ranks: Sequence[int], now: Optional[float] = None) -> dict:
        """The reply to D's question about ``request_id`` on these P ranks."""
        now = time.monotonic() if now is None else now
        with self._lock:
            e = self._entries.get(request_id)
            if e is None:
                return _reply("pending")
            bad = [f"rank {r}: {e.failed[r]}" for r in ranks if r in e.failed]
            if -1 in e.failed:
                bad.append(e.failed[-1])
            bad += [f"rank {r}: its span was freed (read by another reader, or aborted)" for r in ranks
                    if r in e.released]
            if bad:
                return _reply("failed", error="; ".join(bad))
            ttl_left = self.ttl_s - (now - e.received) - self.margin_s
            if ttl_left <= 0:
                return _reply("expired", error=f"P's span expires within {self.margin_s:g} s")
            if not all(r in e.records for r in ranks):
                return _reply("pending")
            return _reply("ready", records=[[r, e.records[r]] for r in ranks], ttl_left=ttl_left)


def _reply(state: str, records: Optional[List] = None, ttl_left: float = 0.0, error: str = "") -> dict:
    return {"state": state, "records": records or [], "ttl_left": float(ttl_left), "error": error}


def serve(encoded_data: Mapping, ready_event: threading.Event, stop_event: threading.Event, host: str, port: int,
          store: RecordStore) -> None:
    """P's listener thread (vLLM's ``_nixl_handshake_listener`` with records added)."""
    path = make_zmq_path("tcp", host, port)
    ctx = zmq.Context()
    try:
        try:
            sock = make_zmq_socket(ctx=ctx, path=path, socket_type=zmq.ROUTER, bind=True)
            sock.setsockopt(zmq.RCVTIMEO, 1000)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_QUESTION_BYTES)
        finally:
            ready_event.set()  # also when the bind failed: the scheduler must not wait forever (the error is raised)
        while not stop_event.is_set():
            try:
                parts = sock.recv_multipart()
            except zmq.Again:
                continue
            if len(parts) != 3 or parts[1] != b"":
                continue  # not a REQ client: nobody to answer
            sock.send_multipart([parts[0], b""] + answer(parts[2], encoded_data, store))
    finally:
        ctx.destroy(linger=0)


def answer(question: bytes, encoded_data: Mapping, store: RecordStore) -> List[bytes]:
    """The reply parts to one question; malformed questions get an error, never an exception."""
    try:
        kind, a, b = msgspec.msgpack.decode(question)
    except (msgspec.DecodeError, TypeError, ValueError):
        return [msgspec.msgpack.encode(_reply("failed", error="malformed question"))]
    if kind == GET_META_MSG:
        payload = encoded_data.get((a, b)) if isinstance(a, int) and isinstance(b, int) else None
        return [payload or b"", msgspec.msgpack.encode(time.perf_counter())]
    if kind == RECORDS_MSG and isinstance(a, str) and 0 < len(a) <= MAX_REQUEST_ID and isinstance(b, list) \
            and 0 < len(b) <= MAX_TP and all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_TP
                                             for r in b):
        return [msgspec.msgpack.encode(store.lookup(a, b))]
    return [msgspec.msgpack.encode(_reply("failed", error="malformed question"))]


# ---------------------------------------------------------------- D's client
def _exchange(ctx, host: str, port: int, question: bytes, timeout_s: float, max_bytes: int) -> List[bytes]:
    """One request, one reply, on a fresh REQ socket (a REQ socket that timed out cannot be reused)."""
    sock = make_zmq_socket(ctx=ctx, path=make_zmq_path("tcp", host, port), socket_type=zmq.REQ, bind=False)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, max(1, int(timeout_s * 1000)))
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.send(question)
        try:
            return sock.recv_multipart()
        except zmq.Again:
            raise TimeoutError(f"P's side channel {host}:{port} did not answer within {timeout_s:.3g} s") from None
    finally:
        sock.close(linger=0)


def fetch_metadata(ctx, host: str, port: int, tp_rank: int, timeout_s: float, compat: str) -> bytes:
    """P rank ``tp_rank``'s kvcopy handshake bytes (checked later by ``add_peer``)."""
    parts = _exchange(ctx, host, port, msgspec.msgpack.encode((GET_META_MSG, 0, tp_rank)), timeout_s,
                      MAX_METADATA_REPLY)
    if len(parts) != 2 or not parts[0]:
        raise ValueError(f"P at {host}:{port} has no handshake for TP rank {tp_rank}")
    try:
        payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(parts[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"P at {host}:{port}: malformed handshake payload ({exc})") from None
    if payload.compatibility_hash != compat:
        raise ValueError(f"P at {host}:{port} is not a kvcopy arena engine of this model and vLLM version "
                         f"(compatibility {payload.compatibility_hash[:40]!r}, expected {compat[:40]!r})")
    return payload.agent_metadata_bytes


@dataclass(frozen=True)
class RecordsReply:
    state: str
    records: Dict[int, bytes]
    ttl_left: float
    error: str


def fetch_records(ctx, host: str, port: int, request_id: str, ranks: Sequence[int], timeout_s: float
                  ) -> RecordsReply:
    """P's answer about one request's records on ``ranks`` (see the module docstring)."""
    parts = _exchange(ctx, host, port, msgspec.msgpack.encode((RECORDS_MSG, request_id, list(ranks))), timeout_s,
                      MAX_RECORDS_REPLY)
    try:
        if len(parts) != 1:
            raise msgspec.DecodeError("one part expected")
        d = msgspec.msgpack.decode(parts[0])
    except msgspec.DecodeError:
        raise ValueError(f"P at {host}:{port}: malformed records reply") from None
    if not isinstance(d, dict) or set(d) != {"state", "records", "ttl_left", "error"} or d["state"] not in STATES:
        raise ValueError(f"P at {host}:{port}: malformed records reply")
    ttl, err, recs = d["ttl_left"], d["error"], d["records"]
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) \
            or not 0 <= ttl <= MAX_TTL_S or not isinstance(err, str) or not isinstance(recs, list):
        raise ValueError(f"P at {host}:{port}: malformed records reply")
    records: Dict[int, bytes] = {}
    for item in recs:
        if not (isinstance(item, list) and len(item) == 2 and item[0] in ranks and isinstance(item[1], bytes)
                and len(item[1]) <= MAX_RECORD_BYTES + 4096):
            raise ValueError(f"P at {host}:{port}: malformed record in the reply")
        records[item[0]] = item[1]
    if d["state"] == "ready" and set(records) != set(ranks):
        raise ValueError(f"P at {host}:{port}: records of ranks {sorted(records)}, asked for {sorted(ranks)}")
    return RecordsReply(d["state"], records, float(ttl), err[:1000])
