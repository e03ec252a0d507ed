"""P's half of a push in arena mode: WRITEs of P's staged spans into spans D reserved.

    # P                                                   # D (kvcopy.nixl.push_reservations)
    m.add_target(d_handshake)                             res = m.reservations.reserve(...)
    tok = m.push_writes.accept(d_name, d_generation, item)   <- res.items[peer], over the side channel
    m.push_writes.post(tok, record)  # record: the finished save()
    m.push_writes.poll()             # WRITE ended: notify D (f, or x)

P checks every field of D's item before NIXL sees anything (:meth:`PushWrites.accept`:
D's generation is the one P added, the token is fresh, D's span lies in D's arena, every
row and the slot lie in D's span, at most
:data:`~kvcopy.nixl.wire.push_messages.MAX_ROWS` rows, a slot that holds P's record) and
again at :meth:`PushWrites.post` (P's rows inside its own staged span, the request's
tokens and order equal to what P staged). A D holding the key can at worst have this
request's bytes written elsewhere into its own arena.

P sends a notice (:mod:`kvcopy.nixl.wire.push_messages`) only after NIXL reported the
WRITE ended (a WRITE carries no NIXL notification: NIXL would also send it from the
release of a handle given up on).

**Chunks** (a layer-wise P, :mod:`kvcopy.nixl.modes.push_units`): before the final
:meth:`PushWrites.post`, :meth:`PushWrites.post_units` WRITEs units ``[lo, hi)`` of the
request's partial stage (the reservation's rows cut to their bytes) as soon as the
caller says their last copies ended; each is told ``c`` once it ended DONE, and the
final WRITE carries what no chunk did, then the record slot.

P keeps each WRITE handle until NIXL reports it ended, and its staged span with it
(:meth:`~kvcopy.nixl.modes.arena.ArenaStaging.begin_write`); a reservation not posted by
its ``timeout_s`` is answered ``x``, and one P refuses (:meth:`PushWrites.refused`) is
answered ``x`` too when D is added. Tokens seen are kept (:data:`MAX_TOMBSTONES`) so a
reservation is never served twice. P keeps at most :data:`MAX_ACCEPTED` reservations
not posted, each at most :data:`~kvcopy.nixl.wire.push_messages.MAX_TIMEOUT_S`.

**A raise fails the reservation it concerns, never the poll.** :meth:`PushWrites.poll`
checks every reservation's WRITEs in one loop (one call for all of P's requests), so a
raise for one must not stop the others (their ``f`` would wait, and the caller would
blame whichever request it was working for):

* NIXL's status check raising is that handle's ``ERR`` (:meth:`~kvcopy.nixl.agent.Agent.state`
  answers it so): the handle is released, its span's WRITE mark given back and its
  reservation answered ``x`` (as a post that raises is), the others polled on. That is
  what NIXL's raise means: ``check_xfer_state`` raises (its binding's
  ``throw_nixl_exception``) only for a negative status of ``getXferStatus`` on the
  handle it is given, which is that handle's own: its backend request failed (the
  status is then kept on the handle, every later check answers it again; UCX's
  ``NIXL_ERR_REMOTE_DISCONNECT``: NIXL also invalidates that peer's metadata and closes
  its endpoint), or ``NIXL_ERR_NOT_FOUND``: the peer's metadata was invalidated while
  the handle was in flight (a disconnect, or its agent unloaded: its endpoint closed).
  None of these says anything of another handle, and none leaves this one able to land
  later, beyond what releasing any failed handle leaves (docs/nixl.md, "Late READs");
* the check raising past ``Agent.state`` (kvcopy's own wrapper failing) says nothing of
  the WRITE, which may still land: the handle counts as in flight (not released, its
  span's WRITE mark kept) and its reservation as failed, answered ``x`` once a later
  check sees the WRITE ended, never before (D's span is never given back under a WRITE
  that may land; a check that raises for good keeps the reservation in flight, which
  D's own deadline and cancel handle as for any WRITE still in flight);
* anything else raising while one reservation is reaped (its span's marks, its notice
  to D) fails that reservation alone: its WRITEs already seen ended are dropped first,
  so the raise is not met again, and it is answered ``x`` once none of its WRITEs is in
  flight (P cannot say for D that a WRITE still posted will not land).

Nothing in :meth:`PushWrites.poll` is shared by reservations beyond the loop itself, so
no raise there is left unattributed.
"""
from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .agent import Agent
from .modes.arena import ArenaStaging
from .modes import push_units
from .modes.arena_push import LENGTH
from .modes.partial_stage import PartialStage
from .planning.pack_order import ORDERS
from .pull import DONE, ERR, PROC
from .wire.handshake import EngineInfo
from .wire.notices import Mailbox
from .wire.push_messages import FINAL, MAX_ROWS, MAX_TIMEOUT_S, NEVER, TOKEN_BYTES, chunk_notice, notice
from .wire.record import MAX_TOKENS, StagedRequest, record_capacity, request_key

MAX_ACCEPTED = 4096  # reservations P keeps not posted (per manager: one P rank)
MAX_TOMBSTONES = 1 << 16

_log = logging.getLogger("kvcopy.nixl")


@dataclass
class _Sending:
    """P: one accepted reservation."""

    target: str
    request_id: bytes
    num_tokens: int
    order: str
    remote: np.ndarray  # D's rows, absolute: (address, bytes, 0)
    p_rel: np.ndarray  # P's offsets in its span
    slot_cap: int
    deadline: float
    xfer: object = None
    posted: bool = False
    # chunked push: the P units WRITTEN before the final WRITE, those WRITEs in flight
    # (handle, lo, hi, the partial stage they read), and whether one failed or P gave up
    sent: Optional[np.ndarray] = None
    chunks: List[tuple] = field(default_factory=list)
    failed: bool = False
    final_state: Optional[str] = None  # the final WRITE's end state
    part: Optional[PartialStage] = None  # the partial stage the chunks were cut from



class PushWrites:
    """One manager's push WRITEs, P's half of its pushes (see the module docstring).
    Driven by the manager's one thread."""

    def __init__(self, agent: Agent, mail: Mailbox, mode: ArenaStaging, info: EngineInfo, key: Optional[bytes]):
        self._agent, self._mail, self._mode, self._info, self._key = agent, mail, mode, info, key
        self._send: Dict[bytes, _Sending] = {}
        self._targets: Dict[str, EngineInfo] = {}
        self._seen: "OrderedDict[bytes, str]" = OrderedDict()  # token -> "never" | "ended"
        self._closed: List[Tuple[bytes, str, str]] = []  # (token, request id, target) answered since take_closed
        self.chunks_posted = 0  # chunk WRITEs posted (post_units)

    def add_target(self, info: EngineInfo) -> None:
        """A D this P may WRITE into (its handshake checked and loaded by the manager)."""
        if info.buffer != "arena" or info.arena[1] <= 0:
            raise ValueError(f"{info.name!r} is in {info.buffer!r} mode: it has no arena to push into")
        self._targets[info.name] = info

    def targets(self) -> Dict[str, EngineInfo]:
        return dict(self._targets)

    def forget_target(self, name: str) -> None:
        """The target's endpoint goes: its reservations not posted are answered never."""
        for token, s in list(self._send.items()):
            if s.target == name and not s.posted and not s.chunks:
                self._close(token, "never", None)
        self._targets.pop(name, None)

    def accept(self, target: str, generation: str, item) -> bytes:
        """Check one reservation item from D ``target`` (registration ``generation``);
        returns its token. Raises ``ValueError`` (nothing kept) for anything wrong."""
        d = self._targets.get(target)
        if d is None:
            raise ValueError(f"unknown push target {target!r}: add its handshake first")
        if generation != d.generation:
            raise ValueError(f"reservation of {target!r} registration {str(generation)[:32]!r}, added as "
                             f"{d.generation}: fetch its handshake again")
        if not isinstance(item, (list, tuple)) or len(item) != 9:
            raise ValueError("malformed reservation: 9 fields expected")
        token, rid, n_tok, order, off, nbytes, rows, slot, timeout = item
        if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
            raise ValueError("malformed reservation: token")
        if self.known(token):
            raise ValueError("reservation token used already")
        if sum(not s.posted for s in self._send.values()) >= MAX_ACCEPTED:
            raise ValueError(f"P holds {MAX_ACCEPTED} reservations not posted already")
        key = request_key(rid)
        if not _int(n_tok, 0, MAX_TOKENS) or order not in ORDERS.values():
            raise ValueError("malformed reservation: tokens or order")
        if not (_int(off, 0, d.arena[1]) and _int(nbytes, 1, d.arena[1] - off)):
            raise ValueError(f"reservation's span [{off}, +{nbytes}) is not inside {target!r}'s arena")
        p_rel, remote = _rows(rows, nbytes, d.arena[0] + off)
        if not (isinstance(slot, (list, tuple)) and len(slot) == 2 and _int(slot[0], 0, nbytes)
                and _int(slot[1], 1, nbytes - slot[0])):
            raise ValueError("malformed reservation: record slot outside D's span")
        if slot[1] < record_capacity(self._info, n_tok, key):
            raise ValueError(f"reservation's record slot of {slot[1]} bytes cannot hold this P's record")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S \
                or not math.isfinite(timeout):
            raise ValueError("malformed reservation: timeout")
        self._send[token] = _Sending(target, key, n_tok, order, remote, p_rel, slot[1],
                                     time.monotonic() + float(timeout))
        return token

    def pending(self, request_id) -> List[bytes]:
        """Tokens accepted for ``request_id`` and not posted yet."""
        key = request_key(request_id)
        return [t for t, s in self._send.items() if s.request_id == key and not s.posted]

    def post_units(self, token: bytes, part: PartialStage, lo: int, hi: int,
                   staged_as: Optional[str] = None) -> Tuple[int, int]:
        """WRITE units ``[lo, hi)`` of ``part`` (the reservation's request, staged unit by
        unit: the caller says those units' copies of its last step ended) into D's span,
        ahead of the final :meth:`post`; D is told ``c`` once the WRITE ended DONE. Returns
        the WRITE's bytes and descriptors ((0, 0): D reads nothing of those units).
        ``staged_as``: P's id of the request when D reserved it under another (as
        :meth:`post`). ``ValueError`` (nothing posted) for a token not accepted, posted or
        failed, a request other than reserved, units out of range or sent already."""
        s = self._send.get(token)
        if s is None or s.posted or s.failed:
            raise ValueError("unknown, posted or failed reservation token")
        want = s.request_id if staged_as is None else request_key(staged_as)
        if part.rid != want or part.num_tokens != s.num_tokens or part.order != s.order \
                or part.done_tokens < part.num_tokens:
            raise ValueError(f"reservation is for {s.request_id!r} of {s.num_tokens} tokens in order {s.order!r}: "
                             f"not this partial stage, or its last step is not planned")
        bounds = push_units.unit_bounds(self._mode.units, part.counts)
        sent = s.sent if s.sent is not None else np.zeros(len(bounds) - 1, bool)
        if not (0 <= lo < hi <= len(sent)) or sent[lo:hi].any():
            raise ValueError(f"units [{lo}, {hi}) out of range or sent already")
        if s.part is not None and s.part is not part:
            raise ValueError("units of another partial stage of this request were sent already")
        self._mode.hold_part(part)  # ValueError: not the staging's live partial stage of it
        # marked chunked only now: a refused chunk leaves the final WRITE whole (one descriptor)
        before = s.sent, s.part
        sent[lo:hi] = True
        s.sent, s.part = sent, part
        try:
            local, remote = self._cut(s, part.span.offset, int(bounds[lo]), int(bounds[hi]))
            if not len(local):
                self._mode.unhold_part(part)
                return 0, 0
            xfer, state, _ = self._agent.post_read_descs(local, "DRAM", s.target, remote, "DRAM", b"", op="WRITE")
        except BaseException:  # nothing posted: the final WRITE carries these units, the hold goes
            sent[lo:hi] = False
            s.sent, s.part = before
            self._mode.unhold_part(part)
            raise
        s.chunks.append((xfer, lo, hi, part))
        self.chunks_posted += 1
        if state != PROC:
            self._advance(token, s, time.monotonic())  # x now if it failed (nothing else in flight)
        return int(local[:, 1].sum()), len(local)

    def sent_units(self, token: bytes) -> Optional[np.ndarray]:
        """P's units of ``token`` WRITten ahead of its final WRITE (a copy), or None if none were."""
        s = self._send.get(token)
        return None if s is None or s.sent is None else s.sent.copy()

    def _cut(self, s: _Sending, span_offset: int, lo: int, hi: int) -> Tuple[np.ndarray, np.ndarray]:
        """(local, remote) NIXL rows of the reservation's rows cut to P's span bytes ``[lo, hi)``."""
        rows = push_units.clip_rows(np.stack([s.p_rel, s.remote[:, 0].astype(np.int64),
                                              s.remote[:, 1].astype(np.int64)], 1), lo, hi)
        zeros = np.zeros(len(rows), np.int64)
        local = np.stack([self._mode.base + span_offset + rows[:, 0], rows[:, 2], zeros], 1)
        return local.astype(np.uint64), np.stack([rows[:, 1], rows[:, 2], zeros], 1).astype(np.uint64)

    def _reap_chunks(self, token: bytes, s: _Sending) -> int:
        """Chunk WRITEs that ended: ``c`` to D for each DONE (unless one failed), the span
        hold dropped; returns those still in flight. A chunk seen ended leaves
        ``s.chunks`` before anything else is done for it: a raise below is not met again."""
        for chunk in list(s.chunks):
            xfer, lo, hi, part = chunk
            state = self._state(xfer, s) if xfer is not None else ERR
            if state == PROC:
                continue
            s.chunks = [c for c in s.chunks if c is not chunk]
            if xfer is not None:
                Agent.release(xfer)
            if state != DONE:
                s.failed = True
            self._mode.unhold_part(part)
            if not s.failed:
                d = self._targets.get(s.target)
                if d is not None:
                    self._mail.send(s.target, d.generation, chunk_notice(token, lo, hi))
        return len(s.chunks)

    def _state(self, xfer, s: _Sending) -> str:
        """A WRITE handle of ``s``: its state. NIXL's raise is ``ERR`` already
        (``Agent.state``); one past it leaves the WRITE's state unknown: ``PROC`` (it
        may still land) and ``s`` failed, answered ``x`` once a check sees it ended
        (module docstring). Logged once per reservation."""
        try:
            return self._agent.state(xfer)[0]
        except Exception:  # noqa: BLE001 -- this reservation's, not the poll's
            if not s.failed:
                _log.exception("kvcopy push: a WRITE's status check of request %r raised: it is answered x once "
                               "the WRITE is seen ended", s.request_id.decode("latin-1")[:80])
            s.failed = True
            return PROC

    def post(self, token: bytes, record: StagedRequest, staged_as: Optional[str] = None) -> Tuple[int, int]:
        """WRITE the staged request ``record`` (this manager's ``save`` of the reservation's
        request, finished: its pack and sums in the arena) into D's span, record included.
        A WRITE NIXL refuses, a request not staged as reserved: ``x`` to D (raises
        ``ValueError`` for a token not accepted or posted already). Returns the WRITE's
        bytes and descriptors. ``staged_as``: the id P staged the request under when the
        caller matched the reservation to it by another id (vLLM's base request id, under
        concurrent dispatch); the record then travels under the reservation's id, so D's
        record check stays exact."""
        s = self._send.get(token)
        if s is None or s.posted:
            raise ValueError("unknown or posted reservation token")
        if s.failed:
            self._advance(token, s, time.monotonic())  # x once its chunk WRITEs ended
            raise ValueError("a chunk WRITE of this reservation failed: it is answered x")
        rid = s.request_id.decode("latin-1")
        if staged_as is not None:
            if record.request_id != staged_as:
                raise ValueError(f"record of {record.request_id!r} given as staged for {staged_as!r}")
            s.request_id = request_key(staged_as)  # P's span, held and released under P's id
            record = replace(record, request_id=rid)
        if record.request_id != rid or record.engine != self._info.name or record.num_tokens != s.num_tokens \
                or record.order != s.order:
            s.failed = True
            self._advance(token, s, time.monotonic())
            raise ValueError(f"reservation is for {rid!r} of {s.num_tokens} tokens in order {s.order!r}: "
                             f"P staged {record.request_id!r}, {record.num_tokens} tokens, {record.order!r}")
        try:
            entry = self._mode.begin_write(s.request_id)
        except ValueError:  # its span is freed already: nothing to WRITE
            s.failed = True
            self._advance(token, s, time.monotonic())
            raise
        try:
            if s.part is not None and entry.span is not s.part.span:
                s.failed = True  # staged again (a copy failed): its chunks came from the span that went
                raise ValueError("the request was staged again after some of its units were pushed")
            body = record.to_bytes(self._key)
            sizes = s.remote[:, 1].astype(np.int64)
            if LENGTH.size + len(body) > min(entry.slot, s.slot_cap) \
                    or np.any(s.p_rel + sizes > entry.payload + entry.slot):
                raise ValueError("the reservation's rows or record do not fit P's staged span")
            at = entry.span.offset + entry.payload
            self._mode.buffer[at: at + LENGTH.size + len(body)].copy_(
                _bytes_tensor(LENGTH.pack(len(body)) + body))
            if s.sent is None:  # the whole request in one WRITE
                local = np.stack([self._mode.base + entry.span.offset + s.p_rel, sizes, np.zeros_like(sizes)], 1)
                local, remote = local.astype(np.uint64), s.remote
            else:  # what no chunk WRITE sent: the units left, then the record slot
                counts = [-(-s.num_tokens // t) for t in self._info.tokens_per_page]
                cuts = [self._cut(s, entry.span.offset, a, b)
                        for a, b in _unsent(s.sent, entry.payload, entry.slot, self._mode.units, counts)]
                local = np.concatenate([c[0] for c in cuts])
                remote = np.concatenate([c[1] for c in cuts])
            xfer, state, _ = self._agent.post_read_descs(local, "DRAM", s.target, remote, "DRAM", b"", op="WRITE")
        except Exception:  # nothing posted (NIXL or UCX raising too): the span's WRITE mark is given back
            self._mode.end_write(s.request_id)
            s.failed = True
            self._advance(token, s, time.monotonic())  # x once no chunk WRITE is in flight
            raise
        s.posted, s.xfer = True, xfer
        if xfer is None:
            self._mode.end_write(s.request_id)
            s.final_state = ERR
        self._advance(token, s, time.monotonic())
        return int(local[:, 1].sum()), len(local)

    def known(self, token) -> bool:
        """Whether ``token`` is a reservation this P holds or ended (posted, answered,
        refused, cancelled): :meth:`accept` refuses it."""
        return isinstance(token, bytes) and (token in self._send or token in self._seen)

    def refused(self, token, target: Optional[str]) -> None:
        """P refused a reservation item (:meth:`accept` raised, or D could not be added):
        its token, if well-formed and new, is answered ``never`` to a later cancel, and
        ``x`` now where ``target`` is an added D (D fails the load at once)."""
        if not isinstance(token, bytes) or len(token) != TOKEN_BYTES or self.known(token):
            return
        self._tombstone(token, "never")
        d = self._targets.get(target) if target is not None else None
        if d is not None:
            self._mail.send(d.name, d.generation, notice(token, NEVER))

    def refuse(self, token: bytes) -> None:
        """P will not post this reservation (it could not stage the request, or aborted
        it): ``x``, once its chunk WRITEs in flight (if any) ended."""
        s = self._send.get(token)
        if s is not None and not s.posted:
            s.failed = True
            self._advance(token, s, time.monotonic())

    def poll(self) -> int:
        """Check the WRITEs in flight; notify D of those that ended, answer ``x`` to
        reservations past their deadline. Returns the WRITEs still in flight."""
        now = time.monotonic()
        return sum(self._advance(token, s, now) for token, s in list(self._send.items()))

    def _advance(self, token: bytes, s: _Sending, now: float) -> int:
        """Reap ``s``'s WRITEs that ended; once none is in flight: ``f`` (the final WRITE
        and every chunk DONE) or ``x`` (one failed, P gave up, the deadline passed with
        the final WRITE not posted). Returns the WRITEs still in flight. Never raises: a
        raise while reaping ``s`` fails ``s`` alone (module docstring)."""
        try:
            return self._advance_once(token, s, now)
        except Exception:  # noqa: BLE001 -- this reservation's, not its caller's (poll: every reservation)
            _log.exception("kvcopy push: reaping the WRITEs of request %r to %s raised: it is answered x",
                           s.request_id.decode("latin-1")[:80], s.target)
            s.failed = True
            live = (s.xfer is not None) + len(s.chunks)
            if not live and token in self._send:
                try:
                    self._close(token, "ended" if s.posted or s.sent is not None else "never", None)
                except Exception:  # noqa: BLE001 -- closed on P; D's cancel finds the tombstone
                    _log.exception("kvcopy push: answering request %r x raised", s.request_id.decode("latin-1")[:80])
            return live

    def _advance_once(self, token: bytes, s: _Sending, now: float) -> int:
        live = self._reap_chunks(token, s) if s.chunks else 0
        if s.xfer is not None:
            state = self._state(s.xfer, s)
            if state == PROC:
                live += 1
            else:
                Agent.release(s.xfer)
                s.xfer, s.final_state = None, state
                self._mode.end_write(s.request_id)
        if live:
            return live
        if s.posted:
            self._close(token, "ended", DONE if s.final_state == DONE and not s.failed else ERR)
        elif s.failed or now >= s.deadline:
            self._close(token, "never" if s.sent is None else "ended", None)
        return 0

    def _close(self, token: bytes, how: str, state: Optional[str]) -> None:
        s = self._send.pop(token)
        self._tombstone(token, how)
        self._closed.append((token, s.request_id.decode("latin-1"), s.target))
        d = self._targets.get(s.target)
        if d is not None:
            self._mail.send(s.target, d.generation, notice(token, FINAL if state == DONE else NEVER))

    def _tombstone(self, token: bytes, how: str) -> None:
        self._seen[token] = how
        while len(self._seen) > MAX_TOMBSTONES:
            self._seen.popitem(last=False)

    def take_closed(self) -> List[Tuple[bytes, str, str]]:
        """P: ``(token, request id, target)`` of each reservation answered (``f`` or ``x``)
        since the last call: that reader is done with P's span."""
        out, self._closed = self._closed, []
        return out

    def cancel(self, token: bytes, target: Optional[str] = None) -> str:
        """D's cancel: ``never`` (not posted, and now never will be), ``ended`` (its WRITE
        ended; D had or will have the notice), ``in_flight`` (ask again). A token never
        seen is tombstoned (a reservation arriving later is refused) and, with ``target``
        (an added D), answered ``x`` over NIXL at once. A cancel from a D other than the
        reservation's changes nothing (``in_flight``)."""
        s = self._send.get(token)
        if s is not None and target is not None and s.target != target:
            return "in_flight"
        if s is None:
            if token not in self._seen:
                self._tombstone(token, "never")
                d = self._targets.get(target) if target is not None else None
                if d is not None:
                    self._mail.send(d.name, d.generation, notice(token, NEVER))
            return self._seen.get(token, "never")
        if not s.posted and not s.chunks:
            how = "never" if s.sent is None else "ended"
            self._close(token, how, None)
            return how
        s.failed = s.failed or not s.posted  # chunks in flight: x once they ended, nothing more posted
        return "in_flight"

    @property
    def writing(self) -> bool:
        """Whether a WRITE (a chunk or a final one) is posted and not seen ended: its
        ``c``/``f`` goes to D only once :meth:`poll` sees it DONE."""
        return any(s.posted or s.chunks for s in self._send.values())

    def stats(self) -> Dict[str, int]:
        return {"push_accepted": sum(not s.posted and not s.chunks for s in self._send.values()),
                "push_writes_in_flight": sum(s.posted or bool(s.chunks) for s in self._send.values()),
                "push_chunks_posted": self.chunks_posted}

    def close(self) -> bool:
        """Release P's WRITE handles (the agent goes next); whether any was in flight."""
        live = False
        for s in self._send.values():
            for xfer in [s.xfer] + [c[0] for c in s.chunks]:
                if xfer is not None:
                    live = True
                    Agent.release(xfer)
            s.xfer, s.chunks = None, []
        self._send = {}
        return live


def _unsent(sent: np.ndarray, payload: int, slot: int, units, counts) -> List[Tuple[int, int]]:
    """P's span byte ranges no chunk WRITE sent: each run of unsent units, then the record slot."""
    bounds = push_units.unit_bounds(units, counts)
    return [(int(bounds[u]), int(bounds[v])) for u, v in push_units.runs(~sent)] + [(payload, payload + slot)]


def _int(x, lo: int, hi: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _rows(rows, span_bytes: int, d_at: int) -> Tuple[np.ndarray, np.ndarray]:
    """P's offsets and D's absolute rows of a reservation's rows, each inside D's span."""
    if not isinstance(rows, (list, tuple)) or not 0 < len(rows) <= MAX_ROWS:
        raise ValueError(f"malformed reservation: 1 to {MAX_ROWS} rows")
    if not all(isinstance(r, (list, tuple)) and len(r) == 3 and _int(r[0], 0, MAX_TOKENS << 20)
               and _int(r[1], 0, span_bytes) and _int(r[2], 1, span_bytes - r[1]) for r in rows):
        raise ValueError("malformed reservation: a row is not [p_rel, d_rel, nbytes] inside D's span")
    a = np.asarray(rows, np.int64)
    remote = np.stack([d_at + a[:, 1], a[:, 2], np.zeros(len(a), np.int64)], 1).astype(np.uint64)
    return a[:, 0], remote


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
