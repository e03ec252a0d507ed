"""The side channel of the arena connector: the messages, P's record store and listener.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first. D's client
(every question in flight at once, from one thread) is :mod:`kvcopy.vllm.arena.record_client`.

vLLM's NIXL scheduler already runs a ZMQ ROUTER socket on P (``VLLM_NIXL_SIDE_CHANNEL_HOST``
and ``_PORT``, sent to D in every request's ``kv_transfer_params`` as ``remote_host`` and
``remote_port``) that answers ``(GET_META_MSG, pp_rank, tp_rank)`` with a worker's
handshake payload. :func:`serve` is that listener with more questions. Each exchange is
one request, one reply (msgpack)::

    D -> P  (GET_META_MSG, 0, tp_rank)                 P -> D  [NixlHandshakePayload, perf_counter]
    D -> P  (RECORDS_MSG, request_id, [ranks])         P -> D  [{"state", "records", "ttl_left", "error"}]
    D -> P  (RECORDS_MSG, [[request_id, [ranks]], ...])   P -> D  [[{...}, ...]]   (one reply per request)
    D -> P  (GIVEUP_MSG, request_id, [ranks], reader, d_tp)   P -> D  [{"state": "ok", ...}]
    P's worker -> P  (TAKE_GIVEUPS_MSG, tp_rank)       P -> worker  [{"give_ups": [[request_id, reader, d_tp], ...]}]
    D -> P  RESERVE_MSG, CANCEL_MSG; P's worker -> P  TAKE_PUSH_MSG: push (kvcopy.vllm.arena.push_channel)

D asks in the second form: the requests it waits for from one P, up to
:data:`MAX_BATCH` in one question, so P's listener answers a few questions a second
per D however many requests wait (one question per request and poll would make a
hundred waiting requests thousands of questions, and TCP connections, a second).
``state`` is ``ready`` (every rank's record, ``[[rank, wire bytes], ...]``), ``pending``
(not staged yet: ask again), ``failed`` (a rank could not stage it, or its span is freed
already) or ``expired`` (P's TTL would end before a READ could). ``ttl_left`` is what is
left of P's span lifetime, measured from when the scheduler got the record (so it
overstates the age by one step at most; :class:`RecordStore` subtracts a margin for that).
A give-up says D's agent ``reader`` (of a D of TP size ``d_tp``) will not read the
request on those P ranks (D could not tell P's workers over NIXL: it refused P's
handshake, or never got it). P's scheduler keeps it per P rank until that rank's worker
takes it (its housekeeping thread asks every :data:`GIVEUP_POLL_S`, whether the engine
steps or not: vLLM's scheduler reaches its workers only in a step); there it counts as
that reader's notification (:mod:`kvcopy.vllm.arena.stage`).

**With a key** (``key_env``) every question but ``HELLO_MSG`` is wrapped, and P answers
nothing else (a handshake, a record, a give-up only to a peer that proved it holds the
key)::

    D -> P  (HELLO_MSG,)                                P -> D  [{"challenge": c}]
    D -> P  (AUTH_MSG, c, n, question, mac_q)           P -> D  [{"parts": [...], "challenge": c2, "mac": mac_r}]
    mac_q = HMAC(key, "kvcopy-arena-question" | c | n | question)
    mac_r = HMAC(key, "kvcopy-arena-reply" | n | c2 | the parts, each length-prefixed)

``c`` is a challenge P drew (16 random bytes), good for one question within
:data:`CHALLENGE_TTL_S`; ``n`` is D's nonce, fresh per question. P checks ``mac_q`` and
that ``c`` is one it issued and nobody used (so a recorded question replayed is
refused); D checks ``mac_r`` over its own nonce (so a recorded or forged reply is
refused) and keeps ``c2`` for its next question. Nothing is encrypted: the handshake
(NIXL's agent metadata in it) crosses the wire readable (docs/nixl.md, "Trust model").

Everything that arrives is untrusted: each message's shape is bounded before it is
decoded (:mod:`kvcopy.msgpack_shape`: a 1 KB message nested 1,000 deep killed the
listener by ``RecursionError``), every field is checked, every handler catches whatever
it raises and answers with an error, and a listener that dies anyway is restarted and
logged (:func:`serve`). D hands record bytes to kvcopy's ``plan_pull``, which checks them
again (:mod:`kvcopy.nixl.wire.record`).
"""
from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG, NixlHandshakePayload
from vllm.logger import init_logger
from vllm.utils.network_utils import make_zmq_path, make_zmq_socket

from ...msgpack_shape import check_shape
from ...nixl.wire.record import MAX_RECORD_BYTES, MAX_REQUEST_ID
from ...nixl.engine.regions import MAX_NAME
from .meta import MAX_TP, KvcopyArenaWorkerMeta
from .push_channel import CANCEL_MSG, MAX_TAKE_REPLY, RESERVE_MSG, TAKE_PUSH_MSG, Parked, PushBox, taken_of

logger = init_logger("vllm.kvcopy")

RECORDS_MSG = b"kvcopy_records"
GIVEUP_MSG = b"kvcopy_giveup"
TAKE_GIVEUPS_MSG = b"kvcopy_take_giveups"
HELLO_MSG = b"kvcopy_hello"
AUTH_MSG = b"kvcopy_auth"
STATES = ("ready", "pending", "failed", "expired")
MAX_QUESTION_BYTES = 1 << 16
MAX_BATCH = 64  # requests in one records question (and at most half of MAX_QUESTION_BYTES of them)
MAX_DEPTH = 4  # the deepest message either side sends: a records reply (map, list, pair) in a keyed wrapper
MAX_ITEMS = MAX_BATCH * (MAX_TP + 8)
MAX_METADATA_REPLY = 64 << 20  # kvcopy's handshake: 8 MiB header + 16 MiB NIXL metadata, framed
MAX_RECORDS_REPLY = 64 << 20
MAX_TTL_S = 1e6
NONCE_BYTES = 16
MAC_BYTES = 32
CHALLENGE_TTL_S = 30.0
MAX_CHALLENGES = 4096  # outstanding on P (the oldest go first): bounded whoever asks
MAX_GIVE_UPS = 4096  # requests per P rank with give-ups its worker has not taken yet
GIVE_UPS_PER_REPLY = 1024
MAX_GIVE_UPS_REPLY = 4 << 20
GIVEUP_POLL_S = 0.2  # how often P's workers take the give-ups P's side channel got
RESTART_DELAY_S = 0.1
HELD_UP_S = 1.0  # the listener's loop back this late is logged (a client's exchange times out at 5 s)


class Malformed(ValueError):
    """A message from the other side that is not what the protocol says."""


def decode_bounded(data: bytes, max_bytes: int, what: str) -> Any:
    """``data`` decoded, its shape bounded first (module docstring); :class:`Malformed` for anything else."""
    try:
        check_shape(data, max_bytes, MAX_DEPTH, MAX_ITEMS)
        return msgspec.msgpack.decode(data)
    except Exception as exc:  # noqa: BLE001 -- whatever a decoder raises on a peer's bytes is a malformed message
        raise Malformed(f"malformed {what} ({type(exc).__name__}: {str(exc)[:200]})") from None


# ---------------------------------------------------------------- authentication (with a key)
def question_mac(key: bytes, challenge: bytes, nonce: bytes, question: bytes) -> bytes:
    return hmac.new(key, b"kvcopy-arena-question\0" + challenge + nonce + question, hashlib.sha256).digest()


def reply_mac(key: bytes, nonce: bytes, challenge: bytes, parts: Sequence[bytes]) -> bytes:
    framed = b"".join(struct.pack("<Q", len(p)) + p for p in parts)
    return hmac.new(key, b"kvcopy-arena-reply\0" + nonce + challenge + framed, hashlib.sha256).digest()


def wrap(key: bytes, challenge: bytes, question: bytes) -> Tuple[bytes, bytes]:
    """D: the keyed form of ``question`` under P's ``challenge``, and D's nonce for the reply."""
    nonce = os.urandom(NONCE_BYTES)
    return msgspec.msgpack.encode((AUTH_MSG, challenge, nonce, question,
                                   question_mac(key, challenge, nonce, question))), nonce


def unwrap(key: bytes, nonce: bytes, parts: Sequence[bytes], what: str) -> Tuple[List[bytes], bytes]:
    """D: the parts of P's keyed reply to the question of ``nonce``, and P's next challenge."""
    if len(parts) != 1:
        raise Malformed(f"malformed {what}: {len(parts)} parts, one expected")
    d = decode_bounded(parts[0], MAX_METADATA_REPLY + 4096, what)
    if isinstance(d, dict) and set(d) == {"state", "records", "ttl_left", "error"}:
        raise Malformed(f"P refused the question ({str(d['error'])[:200]}): {what} not keyed")
    if not isinstance(d, dict) or set(d) != {"parts", "challenge", "mac"}:
        raise Malformed(f"malformed {what}: not a keyed reply")
    inner, challenge, mac = d["parts"], d["challenge"], d["mac"]
    if not (isinstance(inner, list) and 0 < len(inner) <= 4 and all(isinstance(p, bytes) for p in inner)
            and isinstance(challenge, bytes) and len(challenge) == NONCE_BYTES and isinstance(mac, bytes)):
        raise Malformed(f"malformed {what}: fields of the wrong kind")
    if not hmac.compare_digest(mac, reply_mac(key, nonce, challenge, inner)):
        raise Malformed(f"{what} not authenticated: its MAC does not match this engine's key")
    return inner, challenge


def challenge_of(parts: Sequence[bytes]) -> bytes:
    """D: the challenge in P's reply to ``HELLO_MSG``."""
    if len(parts) != 1:
        raise Malformed("malformed challenge: one part expected")
    d = decode_bounded(parts[0], 1024, "challenge")
    c = d.get("challenge") if isinstance(d, dict) else None
    if not isinstance(c, bytes) or len(c) != NONCE_BYTES:
        error = d.get("error") if isinstance(d, dict) else None
        raise Malformed(f"P did not give a challenge ({str(error)[:200] if error else 'malformed reply'}): "
                        "is it run with the same key_env key?")
    return c


class Challenges:
    """P: challenges issued, each good once and for :data:`CHALLENGE_TTL_S`, at most
    :data:`MAX_CHALLENGES` outstanding (issuing past that drops the oldest)."""

    def __init__(self) -> None:
        self._issued: "OrderedDict[bytes, float]" = OrderedDict()

    def issue(self, now: float) -> bytes:
        c = os.urandom(NONCE_BYTES)
        self._issued[c] = now + CHALLENGE_TTL_S
        while len(self._issued) > MAX_CHALLENGES:
            self._issued.popitem(last=False)
        return c

    def consume(self, c: bytes, now: float) -> bool:
        """Whether ``c`` was issued, unused and unexpired; used up either way."""
        expiry = self._issued.pop(c, None)
        return expiry is not None and now <= expiry


# ---------------------------------------------------------------- P's record store
@dataclass
class _Entry:
    received: float
    records: Dict[int, bytes] = field(default_factory=dict)
    failed: Dict[int, str] = field(default_factory=dict)
    released: Set[int] = field(default_factory=set)


class RecordStore:
    """P's scheduler: per request, each P rank's staged record (or failure), shared with
    the listener thread, and D's give-ups not yet handed to the workers (P has
    ``tp_size`` ranks). ``ttl_s`` is
    the workers' arena TTL; ``margin_s`` covers the time between a worker staging a
    request and the scheduler receiving its report."""

    def __init__(self, ttl_s: float, margin_s: Optional[float] = None, tp_size: int = 1):
        self.ttl_s = float(ttl_s)
        self.margin_s = max(1.0, 0.1 * self.ttl_s) if margin_s is None else float(margin_s)
        self._lock = threading.Lock()
        self._entries: Dict[str, _Entry] = {}
        self._give_ups: Dict[int, "OrderedDict[str, Dict[str, int]]"] = {}  # P rank -> request -> reader -> D's TP
        self.pushes = PushBox(tp_size)  # D's reservations and cancels for P's ranks (kvcopy.vllm.arena.push_channel)

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

    def give_up(self, request_id: str, ranks: Sequence[int], reader: str, d_tp: int) -> None:
        """D's agent ``reader`` (of ``d_tp`` D ranks) will not read ``request_id`` on ``ranks``
        (see the module docstring)."""
        with self._lock:
            for r in ranks:
                queue = self._give_ups.setdefault(r, OrderedDict())
                queue.setdefault(request_id, {})[reader] = d_tp
                queue.move_to_end(request_id)
                while len(queue) > MAX_GIVE_UPS:
                    queue.popitem(last=False)

    def take_give_ups(self, rank: int) -> List[Tuple[str, str, int]]:
        """(request, reader, D's TP size) given up on P rank ``rank``, not taken yet (at
        most :data:`GIVE_UPS_PER_REPLY` requests; the rest the next time)."""
        with self._lock:
            queue = self._give_ups.get(rank)
            out: List[Tuple[str, str, int]] = []
            while queue and len(out) < GIVE_UPS_PER_REPLY:
                rid, readers = queue.popitem(last=False)
                out += [(rid, reader, d_tp) for reader, d_tp in readers.items()]
        return out


def _reply(state: str, records: Optional[List] = None, ttl_left: float = 0.0, error: str = "") -> dict:
    return {"state": state, "records": records or [], "ttl_left": float(ttl_left), "error": error}


def _failed(error: str) -> List[bytes]:
    return [msgspec.msgpack.encode(_reply("failed", error=error))]


# ---------------------------------------------------------------- P's listener
def serve(encoded_data: Mapping, ready_event: threading.Event, stop_event: threading.Event, host: str, port: int,
          store: RecordStore, key: Optional[bytes] = None) -> None:
    """P's listener thread (vLLM's ``_nixl_handshake_listener`` with more questions).

    A failed first bind raises (after setting ``ready_event``: vLLM's scheduler waits on
    it). Once serving, nothing a peer sends ends it (every question is answered or
    dropped); if it dies anyway (a ZMQ error, a bug) it is logged and started again
    until ``stop_event``."""
    bound = threading.Event()  # set once the first bind succeeded: later failures restart, never raise
    challenges = Challenges() if key is not None else None  # kept over restarts: D's pooled ones stay good
    while not stop_event.is_set():
        try:
            _serve_once(encoded_data, ready_event, stop_event, host, port, store, key, challenges, bound)
            return
        except Exception:
            if not bound.is_set():
                raise
            logger.exception("kvcopy arena: P's side-channel listener at %s:%d died; starting it again", host, port)
            time.sleep(RESTART_DELAY_S)


def _serve_once(encoded_data, ready_event, stop_event, host, port, store, key, challenges, bound) -> None:
    ctx = zmq.Context()
    try:
        try:
            sock = make_zmq_socket(ctx=ctx, path=make_zmq_path("tcp", host, port), socket_type=zmq.ROUTER, bind=True)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_QUESTION_BYTES)
            bound.set()
        finally:
            ready_event.set()  # also when the bind failed: the scheduler must not wait forever (the error is raised)
        parked: Dict[int, Tuple[bytes, Parked]] = {}  # P rank -> its worker's parked TAKE_PUSH (push_channel)
        due = time.monotonic()  # the latest the loop should be back (its poll's wait)
        while not stop_event.is_set():
            now = time.monotonic()
            if now - due > HELD_UP_S:  # the thread did not run (starved of the CPU, or of the GIL)
                logger.warning("kvcopy arena: P's side-channel listener at %s:%d was held up %.1f s: questions "
                               "asked meanwhile may have timed out (D asks a RESERVE again)", host, port, now - due)
            wait = min([1.0] + [max(0.0, p.deadline - now) for _, p in parked.values()])
            due = now + wait
            if sock.poll(int(wait * 1000) + 1, zmq.POLLIN):
                parts = sock.recv_multipart()
                if len(parts) == 3 and parts[1] == b"":  # else not a REQ client: nobody to answer
                    reply = answer(parts[2], encoded_data, store, key, challenges)
                    if isinstance(reply, Parked):
                        older = parked.pop(reply.rank, None)
                        if older is not None:  # the rank asks again (it gave the old one up, or a new worker):
                            _send_take(sock, store, *older, empty=True)  # nothing handed to who may be gone
                        parked[reply.rank] = (parts[0], reply)
                    else:
                        sock.send_multipart([parts[0], b""] + reply)
            now = time.monotonic()
            for rank, (identity, p) in list(parked.items()):
                if store.pushes.ready(rank) or now >= p.deadline:
                    del parked[rank]
                    _send_take(sock, store, identity, p)
    finally:
        ctx.destroy(linger=0)


def _send_take(sock, store: RecordStore, identity: bytes, parked: Parked, empty: bool = False) -> None:
    """Answer a parked TAKE_PUSH with what waits for its rank now (nothing at its deadline,
    nor with ``empty``); never raises, as :func:`answer` (an exception here would restart
    the listener and drop every other parked question)."""
    try:
        taken = {"reserve": [], "cancel": []} if empty else store.pushes.take(parked.rank)
        reply = parked.finish([msgspec.msgpack.encode(taken)])
    except Exception:  # noqa: BLE001 -- a bug must not end the listener: the worker gets an error and asks again
        logger.exception("kvcopy arena: P's side channel failed to answer a parked push take")
        reply = _failed("P could not answer (see its log)")
    sock.send_multipart([identity, b""] + reply)


def answer(question: bytes, encoded_data: Mapping, store: RecordStore, key: Optional[bytes] = None,
           challenges: Optional[Challenges] = None) -> Union[List[bytes], Parked]:
    """The reply parts to one question, or a :class:`Parked` push take the listener
    answers later; never raises (malformed questions get an error)."""
    try:
        q = decode_bounded(question, MAX_QUESTION_BYTES, "question")
        if key is None:
            return _plain(q, encoded_data, store)
        assert challenges is not None
        return _keyed(q, encoded_data, store, key, challenges)
    except Malformed:
        return _failed("malformed question")
    except Exception:  # noqa: BLE001 -- a bug must not end the listener: the peer gets an error, the log the trace
        logger.exception("kvcopy arena: P's side channel failed to answer a question")
        return _failed("P could not answer (see its log)")


def _plain(q: Any, encoded_data: Mapping, store: RecordStore) -> Union[List[bytes], Parked]:
    """An unkeyed P's answer to a question (see the module docstring)."""
    kind, args = (q[0], q[1:]) if isinstance(q, (list, tuple)) and q else (None, ())
    if kind == GET_META_MSG and len(args) == 2 and all(_is_int(a) for a in args):
        payload = encoded_data.get((args[0], args[1]))
        return [payload or b"", msgspec.msgpack.encode(time.perf_counter())]
    if kind == RECORDS_MSG and len(args) == 2 and _request_id(args[0]) and _ranks(args[1]):
        return [msgspec.msgpack.encode(store.lookup(args[0], args[1]))]
    if kind == RECORDS_MSG and len(args) == 1 and isinstance(args[0], list) and 0 < len(args[0]) <= MAX_BATCH \
            and all(isinstance(a, list) and len(a) == 2 and _request_id(a[0]) and _ranks(a[1]) for a in args[0]):
        return [msgspec.msgpack.encode([store.lookup(rid, ranks) for rid, ranks in args[0]])]
    if kind == GIVEUP_MSG and len(args) == 4 and _request_id(args[0]) and _ranks(args[1]) and _reader(args[2]) \
            and _is_int(args[3]) and 1 <= args[3] <= MAX_TP:
        store.give_up(args[0], args[1], args[2], args[3])
        return [msgspec.msgpack.encode(_reply("ok"))]
    if kind == TAKE_GIVEUPS_MSG and len(args) == 1 and _is_int(args[0]) and 0 <= args[0] < MAX_TP:
        return [msgspec.msgpack.encode({"give_ups": [list(g) for g in store.take_give_ups(args[0])]})]
    if kind in (RESERVE_MSG, CANCEL_MSG, TAKE_PUSH_MSG):
        got = store.pushes.answer(kind, args)
        if isinstance(got, Parked):
            return got
        if got is not None:
            return [msgspec.msgpack.encode(got)]
    if kind in (HELLO_MSG, AUTH_MSG):
        return _failed("this P has no key (key_env): ask without one")
    return _failed("malformed question")


def _keyed(q: Any, encoded_data: Mapping, store: RecordStore, key: bytes,
           challenges: Challenges) -> Union[List[bytes], Parked]:
    """A keyed P's answer: a challenge, or the answer to an authenticated question."""
    now = time.monotonic()
    if isinstance(q, (list, tuple)) and len(q) == 1 and q[0] == HELLO_MSG:
        return [msgspec.msgpack.encode({"challenge": challenges.issue(now)})]
    if not (isinstance(q, (list, tuple)) and len(q) == 5 and q[0] == AUTH_MSG
            and all(isinstance(x, bytes) for x in q[1:])):
        return _failed("this P requires authentication (key_env): ask with the key")
    _, challenge, nonce, inner, mac = q
    if len(nonce) != NONCE_BYTES or not hmac.compare_digest(mac, question_mac(key, challenge, nonce, inner)):
        return _failed("not authenticated: the MAC does not match this P's key")
    if not challenges.consume(challenge, now):
        return _failed("not authenticated: unknown, used or expired challenge (ask for a new one)")
    parts = _plain(decode_bounded(inner, MAX_QUESTION_BYTES, "question"), encoded_data, store)
    if isinstance(parts, Parked):  # sealed when it is answered, with a challenge issued then
        parts.finish = lambda later: _sealed(key, nonce, challenges, later)
        return parts
    return _sealed(key, nonce, challenges, parts)


def _sealed(key: bytes, nonce: bytes, challenges: Challenges, parts: List[bytes]) -> List[bytes]:
    """A keyed reply: ``parts``, P's next challenge, their MAC over D's nonce."""
    nxt = challenges.issue(time.monotonic())
    return [msgspec.msgpack.encode({"parts": parts, "challenge": nxt, "mac": reply_mac(key, nonce, nxt, parts)})]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _request_id(x: Any) -> bool:
    return isinstance(x, str) and 0 < len(x) <= MAX_REQUEST_ID


def _ranks(x: Any) -> bool:
    return isinstance(x, list) and 0 < len(x) <= MAX_TP and all(_is_int(r) and 0 <= r < MAX_TP for r in x)


def _reader(x: Any) -> bool:
    return isinstance(x, str) and 0 < len(x) <= MAX_NAME


# ---------------------------------------------------------------- D: reading P's replies
def metadata_of(parts: Sequence[bytes], where: str, compat: str) -> bytes:
    """P rank's kvcopy handshake bytes from its reply to ``GET_META_MSG`` (checked later by ``add_peer``)."""
    if len(parts) == 1:  # P's error reply
        d = decode_bounded(parts[0], 4096, f"reply from P at {where}")
        raise ValueError(f"P at {where} gave no handshake: "
                         f"{str(d.get('error') if isinstance(d, dict) else 'malformed reply')[:200]}")
    if len(parts) != 2 or not parts[0]:
        raise ValueError(f"P at {where} has no handshake for this TP rank")
    try:
        check_shape(parts[0], MAX_METADATA_REPLY, MAX_DEPTH, MAX_ITEMS)
        payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(parts[0])
    except Exception as exc:  # noqa: BLE001 -- a peer's bytes: any decoder failure is a malformed payload
        raise ValueError(f"P at {where}: malformed handshake payload ({type(exc).__name__}: {str(exc)[:200]})") \
            from None
    if payload.compatibility_hash != compat:
        raise ValueError(f"P at {where} is not a kvcopy arena engine of this model and vLLM version "
                         f"(compatibility {payload.compatibility_hash[:40]!r}, expected {compat[:40]!r})")
    return payload.agent_metadata_bytes


@dataclass(frozen=True)
class RecordsReply:
    state: str
    records: Dict[int, bytes]
    ttl_left: float
    error: str


def records_of(parts: Sequence[bytes], ranks: Sequence[int], where: str) -> RecordsReply:
    """P's answer about one request's records on ``ranks`` (see the module docstring)."""
    if len(parts) != 1:
        raise ValueError(f"P at {where}: malformed records reply")
    return _records(decode_bounded(parts[0], MAX_RECORDS_REPLY, f"records reply from P at {where}"), ranks, where)


def batch_of(parts: Sequence[bytes], asked: Sequence[Sequence[int]], where: str) -> List[object]:
    """P's answers to a batched records question, one per request asked (its ranks in
    ``asked``): a :class:`RecordsReply`, or the ``ValueError`` its answer raised."""
    if len(parts) != 1:
        raise ValueError(f"P at {where}: malformed records reply")
    d = decode_bounded(parts[0], MAX_RECORDS_REPLY, f"records reply from P at {where}")
    if not isinstance(d, list) or len(d) != len(asked):
        if isinstance(d, dict) and "error" in d:
            raise ValueError(f"P at {where} refused the question: {str(d['error'])[:200]}")
        raise ValueError(f"P at {where}: malformed records reply ({len(asked)} requests asked)")
    out: List[object] = []
    for one, ranks in zip(d, asked):
        try:
            out.append(_records(one, ranks, where))
        except ValueError as exc:
            out.append(exc)
    return out


def _records(d: Any, ranks: Sequence[int], where: str) -> RecordsReply:
    if not isinstance(d, dict) or set(d) != {"state", "records", "ttl_left", "error"} or d["state"] not in STATES:
        raise ValueError(f"P at {where}: malformed records reply")
    ttl, err, recs = d["ttl_left"], d["error"], d["records"]
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) \
            or not 0 <= ttl <= MAX_TTL_S or not isinstance(err, str) or not isinstance(recs, list):
        raise ValueError(f"P at {where}: malformed records reply")
    records: Dict[int, bytes] = {}
    for item in recs:
        if not (isinstance(item, list) and len(item) == 2 and _is_int(item[0]) and item[0] in ranks
                and isinstance(item[1], bytes) and len(item[1]) <= MAX_RECORD_BYTES + 4096):
            raise ValueError(f"P at {where}: malformed record in the reply")
        records[item[0]] = item[1]
    if d["state"] == "ready" and set(records) != set(ranks):
        raise ValueError(f"P at {where}: records of ranks {sorted(records)}, asked for {sorted(ranks)}")
    return RecordsReply(d["state"], records, float(ttl), err[:1000])


def give_ups_of(parts: Sequence[bytes]) -> List[Tuple[str, str, int]]:
    """P's worker: the give-ups in its scheduler's reply to ``TAKE_GIVEUPS_MSG``."""
    if len(parts) != 1:
        raise ValueError("malformed give-ups reply")
    d = decode_bounded(parts[0], MAX_GIVE_UPS_REPLY, "give-ups reply")
    items = d.get("give_ups") if isinstance(d, dict) else None
    if not isinstance(items, list) or not all(
            isinstance(g, list) and len(g) == 3 and _request_id(g[0]) and _reader(g[1]) and _is_int(g[2])
            and 1 <= g[2] <= MAX_TP for g in items):
        raise ValueError(f"malformed give-ups reply: {str(d.get('error') if isinstance(d, dict) else d)[:200]}")
    return [(g[0], g[1], g[2]) for g in items]


def pushes_of(parts: Sequence[bytes]):
    """P's worker: the reservations and cancels in its scheduler's reply to ``TAKE_PUSH_MSG``
    (:func:`~kvcopy.vllm.arena.push_channel.taken_of`)."""
    if len(parts) != 1:
        raise ValueError("malformed push reply")
    return taken_of(decode_bounded(parts[0], MAX_TAKE_REPLY, "push reply"))


def ok_of(parts: Sequence[bytes], where: str) -> None:
    """P took a give-up (raises saying why not)."""
    if len(parts) != 1:
        raise ValueError(f"P at {where}: malformed reply to a give-up")
    d = decode_bounded(parts[0], 4096, f"reply from P at {where}")
    if not isinstance(d, dict) or d.get("state") != "ok":
        raise ValueError(f"P at {where} refused the give-up: {str(d.get('error') if isinstance(d, dict) else d)[:200]}")
