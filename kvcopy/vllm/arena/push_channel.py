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
    D -> P  (CANCEL_MSG, d_engine, d_rank, [[p_rank, token], ...])      P -> D  {"state": "ok", ...}
    P's worker -> P  (TAKE_PUSH_MSG, p_rank)
    P -> worker  {"reserve": [[d_engine, d_rank, d_tp, d_host, d_port, d_generation, *entry[1:]], ...],
                  "cancel": [[d_engine, d_rank, token], ...]}

The listener lives in P's scheduler process and cannot reach the workers, so it only
keeps what came, per P rank (:class:`PushBox`, bounded: the oldest go first), until that
rank's worker takes it (its transfer thread asks every housekeeping turn). The worker
checks every field again through ``TransferManager.push.accept`` before NIXL sees any,
and answers D over NIXL (``f``/``x``, :mod:`kvcopy.nixl.push`): a reservation or cancel
is queued and answered "ok" here whatever becomes of it. A reservation names where D's
side channel is, so P can fetch D's kvcopy handshake there (``GET_META_MSG``, checked
by ``add_target``): with a key only a keyed D can make P connect anywhere.
"""
from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...nixl.engine.regions import MAX_NAME
from ...nixl.push import MAX_ROWS, MAX_TIMEOUT_S, TOKEN_BYTES
from ...nixl.wire.record import MAX_REQUEST_ID, MAX_TOKENS
from .meta import MAX_TP

RESERVE_MSG = b"kvcopy_reserve"
CANCEL_MSG = b"kvcopy_cancel"
TAKE_PUSH_MSG = b"kvcopy_take_push"
ROW = np.dtype("<i8")
ROW_BYTES = 3 * ROW.itemsize
MAX_QUEUED = 4096  # reservations (and cancels) per P rank its worker has not taken
TAKE_RESERVATIONS = 64  # per reply to TAKE_PUSH_MSG (each at most one question's size)
TAKE_CANCELS = 1024
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


def item_of(entry: Sequence) -> tuple:
    """P's worker: the ``TransferManager.push.accept`` item of a taken reservation's entry
    (``entry[6:]`` of :meth:`PushBox.take`'s rows)."""
    token, rid, n_tok, order, off, nbytes, rows, slot_off, slot_bytes, timeout = entry
    return (token, rid, n_tok, order, off, nbytes, np.frombuffer(rows, ROW).reshape(-1, 3).tolist(),
            [slot_off, slot_bytes], float(timeout))


class PushBox:
    """P's listener: reservations and cancels per P rank until its worker takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reserve: Dict[int, Deque[list]] = {}
        self._cancel: Dict[int, Deque[list]] = {}

    def answer(self, kind: bytes, args: Sequence) -> Optional[Any]:
        """The reply to a push question (a plain object to encode), or None when
        ``kind``/``args`` are not a well-formed push question."""
        if kind == RESERVE_MSG and len(args) == 7 and _d_fields(*args[:6]) and isinstance(args[6], list) \
                and 0 < len(args[6]) <= MAX_TP \
                and all(isinstance(e, list) and len(e) == 11 and _int(e[0], 0, MAX_TP - 1) and _entry_fields(*e[1:])
                        for e in args[6]):
            with self._lock:
                for e in args[6]:
                    _push(self._reserve, e[0], list(args[:6]) + list(e[1:]))
            return {"state": "ok"}
        if kind == CANCEL_MSG and len(args) == 3 and _str(args[0], MAX_NAME) and _int(args[1], 0, MAX_TP - 1) \
                and isinstance(args[2], list) and 0 < len(args[2]) <= MAX_TP \
                and all(isinstance(c, list) and len(c) == 2 and _int(c[0], 0, MAX_TP - 1) and isinstance(c[1], bytes)
                        and len(c[1]) == TOKEN_BYTES for c in args[2]):
            with self._lock:
                for p_rank, token in args[2]:
                    _push(self._cancel, p_rank, [args[0], args[1], token])
            return {"state": "ok"}
        if kind == TAKE_PUSH_MSG and len(args) == 1 and _int(args[0], 0, MAX_TP - 1):
            return self.take(args[0])
        return None

    def take(self, rank: int) -> Dict[str, List[list]]:
        with self._lock:
            return {"reserve": _pop(self._reserve.get(rank), TAKE_RESERVATIONS),
                    "cancel": _pop(self._cancel.get(rank), TAKE_CANCELS)}


def _push(queues: Dict[int, Deque[list]], rank: int, row: list) -> None:
    q = queues.setdefault(rank, deque())
    q.append(row)
    while len(q) > MAX_QUEUED:
        q.popleft()  # D's deadline fails it; its span is held until P says more (docs/nixl.md)


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
