"""Push over the arena connector's side channel: D's reservations and cancels, P's mailbox.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first. The listener
(:func:`kvcopy.vllm.arena.channel.serve`) answers these beside its other questions, with
the same rules (shape bounded before decoding, every field checked, keyed when
``key_env`` is set)::

    D -> P  (RESERVE_MSG, d_engine, d_rank, d_tp, d_host, d_port, d_generation, [entry, ...])
            entry = [p_rank, token, request_id, num_tokens, order, span_offset, span_bytes,
                     rows, slot_offset, slot_bytes, timeout_s]
            rows  = [p_rel, d_rel, nbytes] triples, int64 little-endian (bytes: a flat message)
    P -> D  {"state": "ok", ...}                  (kept for P rank ``p_rank``'s worker)
    D -> P  (CANCEL_MSG, d_engine, d_rank, [[p_rank, token], ...])
    P -> D  {"state": "ok", "answers": [[p_rank, token, answer, p_generation], ...], ...}
    P's worker -> P  (TAKE_PUSH_MSG, p_rank[, p_generation, [[token, answer], ...][, wait_ms[, [token, ...]]]])
    P -> worker  {"reserve": [[d_engine, d_rank, d_tp, d_host, d_port, d_generation, *entry[1:]], ...],
                  "cancel": [[d_engine, d_rank, token], ...]}

The listener lives in P's scheduler process and cannot reach the workers, so it only
keeps what came, per P rank (:class:`PushBox`), until that rank's worker takes it.

**Long-poll.** Each P worker keeps one ``TAKE_PUSH_MSG`` in flight with ``wait_ms``
(:data:`TAKE_WAIT_MS`): when nothing waits for its rank, the listener parks the question
(:class:`Parked`, at most one per rank; a newer one from the rank ends the older with an
empty reply) and answers it the moment a reservation or cancel for that rank arrives, or
empty at ``wait_ms``. The reply wakes the worker's housekeeping thread
(:meth:`kvcopy.vllm.arena.record_client.SideChannel.ask`'s ``on_done``), which takes the
reservation and asks again, so a reservation reaches P's worker one loopback hop after
D sent it, whether P's engine steps or not, and nothing spins meanwhile. Measured before
(a question every 50 ms housekeeping turn, the reply read at the next turn): RESERVE to
P's worker median 94.5 ms over 20 requests on the shared 2-core machine. A question
without ``wait_ms`` (or 0) is answered at once, as before. The worker checks every field again
through ``TransferManager.push_writes.accept`` before NIXL sees any, and answers D over NIXL
(``f``/``x``, :mod:`kvcopy.nixl.push_writes`). A reservation names where D's side channel is,
so P can fetch D's kvcopy handshake there (``GET_META_MSG``, checked by
``add_target``): with a key only a keyed D can make P connect anywhere.

**Delivery.** A reservation handed to a worker's TAKE_PUSH stays at the listener until
the worker's next question lists its token (the worker acknowledges every reservation a
reply brought, with its next take): one not acknowledged within :data:`RESEND_S` goes
again, with the rank's next reply. A reply can be lost without anyone seeing it: the
listener is held up (its thread starved of the CPU) past the worker's exchange timeout,
the worker gives up and asks again, and the listener then answers the question the
worker gave up, to a socket that is gone. Seen in CI once (P's listener silent for
5 s): before, what that reply carried was gone, and its push failed at D's deadline
(here D's RESERVE timed out too and the push failed at once). A reservation that comes
twice (a resend, or D asking again: :mod:`kvcopy.vllm.arena.push_recv`) is taken once by
the worker (``PushSender``): the listener never has to know whether a reply arrived.

**Cancels** are answered by the worker: it brings its answers (``never``, ``ended``,
``in_flight``: :meth:`kvcopy.nixl.push_writes.PushWrites.cancel`) and its registration generation
with its next ``TAKE_PUSH_MSG``; the listener keeps the latest per token and answers
D's cancels with them (``pending``: the worker has not answered yet). D asks again
every second until ``never``/``ended`` (or an answer from a new generation of P: P
restarted), and only then reuses the span.

**Bounds** (nobody can make the listener keep more, key or not): P ranks below P's TP
size, at most :data:`MAX_QUEUED` reservations (not taken, or taken and not acknowledged)
and as many cancels per rank not taken, :data:`MAX_ANSWERS` answers per rank; a
reservation past its own timeout (at most
:data:`~kvcopy.nixl.wire.push_messages.MAX_TIMEOUT_S`) is dropped, taken or not, at the
rank's next take (one handed out, once it is due again) or when the rank's reservations
reach the bound. A question beyond them is refused with an
error (D fails that load at once and keeps nothing for it).
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...nixl.engine.regions import MAX_NAME
from ...nixl.wire.push_messages import ANSWERS, MAX_ROWS, MAX_TIMEOUT_S, TOKEN_BYTES
from ...nixl.wire.record import MAX_REQUEST_ID, MAX_TOKENS
from .meta import MAX_TP

RESERVE_MSG = b"kvcopy_reserve"
CANCEL_MSG = b"kvcopy_cancel"
TAKE_PUSH_MSG = b"kvcopy_take_push"
ROW = np.dtype("<i8")
ROW_BYTES = 3 * ROW.itemsize
MAX_QUEUED = 4096  # reservations (and cancels) per P rank its worker has not taken
MAX_ANSWERS = 1 << 14  # cancel answers kept per P rank (the oldest go first)
ANSWERS_PER_TAKE = 512  # cancel answers a worker brings per question (a question is at most 64 KiB)
TAKE_RESERVATIONS = 64  # per reply to TAKE_PUSH_MSG (each at most one question's size)
TAKE_CANCELS = 1024
TAKE_WAIT_MS = 1000  # a worker's parked TAKE_PUSH_MSG (below the client's 5 s exchange timeout)
RESEND_S = 5.0  # a reservation handed out and not acknowledged goes again (the worker's exchange timeout)
MAX_ACKS = 4 * TAKE_RESERVATIONS  # tokens acknowledged per question (the rest with the next)
MAX_WAIT_MS = 4000
MAX_TAKE_REPLY = 8 << 20
MAX_HOST = 255
MAX_GENERATION = 64
MAX_ORDER = 64
MAX_SPAN = 1 << 62


def _int(x: Any, lo: int, hi: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _str(x: Any, hi: int) -> bool:
    return isinstance(x, str) and 0 < len(x) <= hi


def _d_fields(d_engine, d_rank, d_tp, d_host, d_port, d_generation) -> bool:
    return _str(d_engine, MAX_NAME) and _int(d_tp, 1, MAX_TP) and _int(d_rank, 0, d_tp - 1) \
        and _str(d_host, MAX_HOST) and _int(d_port, 1, 65535) and _str(d_generation, MAX_GENERATION)


def _entry_fields(token, rid, n_tok, order, off, nbytes, rows, slot_off, slot_bytes, timeout) -> bool:
    return isinstance(token, bytes) and len(token) == TOKEN_BYTES and _str(rid, MAX_REQUEST_ID) \
        and _int(n_tok, 0, MAX_TOKENS) and _str(order, MAX_ORDER) and _int(off, 0, MAX_SPAN) \
        and _int(nbytes, 1, MAX_SPAN) and isinstance(rows, bytes) and 0 < len(rows) <= MAX_ROWS * ROW_BYTES \
        and len(rows) % ROW_BYTES == 0 and _int(slot_off, 0, MAX_SPAN) and _int(slot_bytes, 1, MAX_SPAN) \
        and isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout) \
        and 0 < timeout <= MAX_TIMEOUT_S


def reserve_question(d_engine: str, d_rank: int, d_tp: int, d_host: str, d_port: int, d_generation: str,
                     items: Dict[int, tuple]) -> tuple:
    """D: the RESERVE question for one request, ``items`` by P rank (``Reservation.items``'s values)."""
    entries = []
    for p_rank, (token, rid, n_tok, order, off, nbytes, rows, slot, timeout) in items.items():
        flat = np.asarray(rows, ROW).reshape(-1, 3).tobytes()
        entries.append([p_rank, token, rid, n_tok, order, off, nbytes, flat, slot[0], slot[1], timeout])
    return (RESERVE_MSG, d_engine, d_rank, d_tp, d_host, d_port, d_generation, entries)


def take_question(p_rank: int, generation: str, answers: Sequence[Tuple[bytes, str]],
                  wait_ms: int = TAKE_WAIT_MS, acks: Sequence[bytes] = ()) -> tuple:
    """P's worker: its TAKE_PUSH question, bringing its answers to cancels (at most
    :data:`ANSWERS_PER_TAKE`) and the tokens of the reservations it took (at most
    :data:`MAX_ACKS`; the caller keeps the rest of both for the next one), parked by the
    listener up to ``wait_ms`` while nothing waits for ``p_rank`` (module docstring)."""
    return (TAKE_PUSH_MSG, p_rank, generation, [[t, a] for t, a in answers[:ANSWERS_PER_TAKE]], int(wait_ms),
            list(acks[:MAX_ACKS]))


class Parked:
    """A TAKE_PUSH question the listener answers later: for ``rank``, by ``deadline``
    (monotonic). ``finish`` turns the reply's parts into what is sent (the keyed
    wrapper, made when the reply goes)."""

    def __init__(self, rank: int, deadline: float) -> None:
        self.rank, self.deadline = rank, deadline
        self.finish: Callable[[List[bytes]], List[bytes]] = lambda parts: parts


def cancel_answers_of(d: Any, asked: Sequence[Tuple[int, bytes]]) -> Dict[int, Tuple[str, str]]:
    """D: P's answers (decoded reply to a cancel) as ``{p_rank: (answer, p_generation)}``
    for the ``(p_rank, token)`` pairs asked; ``ValueError`` for a refusal or a malformed reply."""
    if not isinstance(d, dict) or d.get("state") != "ok" or not isinstance(d.get("answers"), list):
        raise ValueError(f"P refused the cancel: {str(d.get('error') if isinstance(d, dict) else d)[:200]}")
    want = dict(asked)
    out = {}
    for a in d["answers"]:
        if isinstance(a, list) and len(a) == 4 and _int(a[0], 0, MAX_TP - 1) and want.get(a[0]) == a[1] \
                and a[2] in ANSWERS + ("pending",) and isinstance(a[3], str) and len(a[3]) <= MAX_GENERATION:
            out[a[0]] = (a[2], a[3])
    return out


def item_of(entry: Sequence) -> tuple:
    """P's worker: the ``TransferManager.push_writes.accept`` item of a taken reservation's entry
    (``entry[6:]`` of :meth:`PushBox.take`'s rows)."""
    token, rid, n_tok, order, off, nbytes, rows, slot_off, slot_bytes, timeout = entry
    return (token, rid, n_tok, order, off, nbytes, np.frombuffer(rows, ROW).reshape(-1, 3).tolist(),
            [slot_off, slot_bytes], float(timeout))


class PushBox:
    """P's listener: reservations and cancels per P rank (of ``tp_size``) until its
    worker takes them, and the worker's answers to cancels (module docstring)."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = int(tp_size)
        self._lock = threading.Lock()
        self._reserve: Dict[int, Deque[Tuple[list, float]]] = {}  # rank -> (row, when it expires)
        # rank -> token -> (row, when handed out, when it expires): until the worker acknowledges it
        self._handed: Dict[int, "OrderedDict[bytes, Tuple[list, float, float]]"] = {}
        self._cancel: Dict[int, Deque[list]] = {}
        self._answers: Dict[int, "OrderedDict[bytes, Tuple[str, str]]"] = {}  # rank -> token -> (answer, generation)

    def answer(self, kind: bytes, args: Sequence) -> Optional[Any]:
        """The reply to a push question (a plain object to encode), a :class:`Parked`
        take (answered later by the listener), or None when ``kind``/``args`` are not a
        well-formed push question."""
        tp = self.tp_size
        if kind == RESERVE_MSG and len(args) == 7 and _d_fields(*args[:6]) and isinstance(args[6], list) \
                and 0 < len(args[6]) <= MAX_TP \
                and all(isinstance(e, list) and len(e) == 11 and _int(e[0], 0, MAX_TP - 1) and _entry_fields(*e[1:])
                        for e in args[6]):
            ranks = [e[0] for e in args[6]]
            if max(ranks) >= tp or len(set(ranks)) != len(ranks):
                return {"state": "failed", "error": f"P has {tp} TP ranks, once each: reservation for ranks {ranks}"}
            with self._lock:
                now = time.monotonic()
                full = [r for r in ranks if self._held(r, now) >= MAX_QUEUED]
                if full:
                    return {"state": "failed", "error": f"P's ranks {full} hold {MAX_QUEUED} reservations not taken"}
                for e in args[6]:  # e[10]: the reservation's timeout (at most MAX_TIMEOUT_S): then P drops it
                    self._reserve.setdefault(e[0], deque()).append((list(args[:6]) + list(e[1:]), now + e[10]))
            return {"state": "ok"}
        if kind == CANCEL_MSG and len(args) == 3 and _str(args[0], MAX_NAME) and _int(args[1], 0, MAX_TP - 1) \
                and isinstance(args[2], list) and 0 < len(args[2]) <= MAX_TP \
                and all(isinstance(c, list) and len(c) == 2 and _int(c[0], 0, MAX_TP - 1) and isinstance(c[1], bytes)
                        and len(c[1]) == TOKEN_BYTES for c in args[2]):
            if any(c[0] >= tp for c in args[2]):
                return {"state": "failed", "error": f"P has {tp} TP ranks"}
            return self._cancels(args[0], args[1], args[2])
        if kind == TAKE_PUSH_MSG and len(args) in (1, 3, 4, 5) and _int(args[0], 0, tp - 1) \
                and (len(args) == 1 or (_str(args[1], MAX_GENERATION) and _answers(args[2]))) \
                and (len(args) < 4 or _int(args[3], 0, MAX_WAIT_MS)) and (len(args) < 5 or _tokens(args[4])):
            if len(args) == 5:
                with self._lock:
                    handed = self._handed.setdefault(args[0], OrderedDict())
                    for token in args[4]:
                        handed.pop(token, None)
            if len(args) >= 3:
                with self._lock:
                    kept = self._answers.setdefault(args[0], OrderedDict())
                    for token, how in args[2]:
                        kept[token] = (how, args[1])
                        kept.move_to_end(token)
                    while len(kept) > MAX_ANSWERS:
                        kept.popitem(last=False)
            if len(args) >= 4 and args[3] > 0 and not self.ready(args[0]):
                return Parked(args[0], time.monotonic() + args[3] / 1e3)
            return self.take(args[0])
        return None

    def ready(self, rank: int) -> bool:
        """Whether a reservation or cancel waits for ``rank``'s worker (a reservation
        handed out :data:`RESEND_S` ago and not acknowledged waits again)."""
        with self._lock:
            return bool(self._reserve.get(rank) or self._cancel.get(rank) or self._resend(rank, time.monotonic()))

    def _resend(self, rank: int, now: float) -> List[bytes]:
        """Tokens handed to ``rank``'s worker :data:`RESEND_S` ago or more, not acknowledged
        (oldest first), past their reservation's timeout dropped. Call with the lock held."""
        out: List[bytes] = []
        expired: List[bytes] = []
        handed = self._handed.get(rank)
        if handed is None:
            return out
        for token, (_, at, expires) in handed.items():
            if now - at < RESEND_S:
                break  # handed in order: the rest are younger
            (expired if now >= expires else out).append(token)
        for token in expired:
            del handed[token]
        return out

    def _held(self, rank: int, now: float) -> int:
        """Reservations kept for ``rank`` (queued, or handed out and not acknowledged),
        those past their timeout dropped first when there are :data:`MAX_QUEUED`. Call
        with the lock held."""
        queued, handed = self._reserve.get(rank), self._handed.setdefault(rank, OrderedDict())
        if len(queued or ()) + len(handed) >= MAX_QUEUED:
            if queued:
                self._reserve[rank] = deque(q for q in queued if now < q[1])
            for token in [t for t, (_, _, expires) in handed.items() if now >= expires]:
                del handed[token]
        return len(self._reserve.get(rank, ())) + len(handed)

    def _cancels(self, d_engine: str, d_rank: int, asked: List[list]) -> dict:
        """Queue a cancel for the worker unless it answered it for good; reply with what it answered."""
        out = []
        with self._lock:
            for p_rank, token in asked:
                how, generation = self._answers.get(p_rank, {}).get(token, ("pending", ""))
                if how not in ("never", "ended"):
                    q = self._cancel.setdefault(p_rank, deque())
                    if len(q) >= MAX_QUEUED:
                        return {"state": "failed", "error": f"P's rank {p_rank} holds {MAX_QUEUED} cancels not taken"}
                    q.append([d_engine, d_rank, token])
                out.append([p_rank, token, how, generation])
        return {"state": "ok", "answers": out}

    def take(self, rank: int) -> Dict[str, List[list]]:
        """The reply to ``rank``'s take: reservations due again first, then new ones (each
        kept until acknowledged), and cancels."""
        now = time.monotonic()
        with self._lock:
            handed = self._handed.setdefault(rank, OrderedDict())
            out = [handed.pop(t)[::2] for t in self._resend(rank, now)[:TAKE_RESERVATIONS]]
            queued = self._reserve.get(rank)
            while queued and len(out) < TAKE_RESERVATIONS:
                row, expires = queued.popleft()
                if now < expires:
                    out.append((row, expires))
            for row, expires in out:
                handed.pop(row[6], None)  # row[6]: the token; a copy handed before goes to the end with it
                handed[row[6]] = (row, now, expires)
            return {"reserve": [row for row, _ in out], "cancel": _pop(self._cancel.get(rank), TAKE_CANCELS)}


def _answers(x: Any) -> bool:
    return isinstance(x, list) and len(x) <= ANSWERS_PER_TAKE and all(
        isinstance(a, list) and len(a) == 2 and isinstance(a[0], bytes) and len(a[0]) == TOKEN_BYTES
        and a[1] in ANSWERS for a in x)


def _tokens(x: Any) -> bool:
    return isinstance(x, list) and len(x) <= MAX_ACKS and all(
        isinstance(t, bytes) and len(t) == TOKEN_BYTES for t in x)


def _pop(q: Optional[Deque[list]], n: int) -> List[list]:
    out: List[list] = []
    while q and len(out) < n:
        out.append(q.popleft())
    return out


def taken_of(d: Any) -> Tuple[List[Tuple[Tuple, tuple]], List[Tuple[str, int, bytes]]]:
    """P's worker: the reply to ``TAKE_PUSH_MSG`` (decoded, shape bounded) as
    ``([(D fields, accept item), ...], [(d_engine, d_rank, token), ...])``; ``ValueError``
    when malformed."""
    if not isinstance(d, dict) or set(d) != {"reserve", "cancel"} or not isinstance(d["reserve"], list) \
            or not isinstance(d["cancel"], list):
        raise ValueError(f"malformed push reply: {str(d.get('error') if isinstance(d, dict) else d)[:200]}")
    reserve = []
    for r in d["reserve"]:
        if not (isinstance(r, list) and len(r) == 16 and _d_fields(*r[:6]) and _entry_fields(*r[6:])):
            raise ValueError("malformed reservation in the push reply")
        reserve.append((tuple(r[:6]), item_of(r[6:])))
    cancel = []
    for c in d["cancel"]:
        if not (isinstance(c, list) and len(c) == 3 and _str(c[0], MAX_NAME) and _int(c[1], 0, MAX_TP - 1)
                and isinstance(c[2], bytes) and len(c[2]) == TOKEN_BYTES):
            raise ValueError("malformed cancel in the push reply")
        cancel.append((c[0], c[1], c[2]))
    return reserve, cancel
