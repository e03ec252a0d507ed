"""Push in arena mode: D reserves a span, P WRITEs its staged span into it, then says so.

    # D                                                   # P
    res = m.push.reserve(peers, n, d_blocks, cached, rid, timeout_s)
    send res.items[peer] to that P rank (side channel) ->  tok = m.push.accept(d_name, d_generation, item)
                                                          m.push.post(tok, record)  # record: the finished save()
                                                          m.push.poll()             # WRITE ended: notify D
    m.push.state(res.token) -> PROC | DONE | ERR
    done = m.push.complete(res.token)                     # -> Completion, as a pull's

**D plans, P posts** (:mod:`kvcopy.nixl.modes.arena_push`): D plans the rows between
the spans from P's handshake alone and sends each P rank an *item*: ``(token,
request_id, num_tokens, order, D's span offset, D's span bytes, rows [[p_rel, d_rel,
nbytes], ...], [slot offset, slot bytes], timeout_s)``, span-relative. P checks every
field before NIXL sees anything (:meth:`Pushes.accept`: D's generation is the one P
added, the token is fresh, D's span lies in D's arena, every row and the slot lie in D's
span, at most :data:`MAX_ROWS` rows, a slot that holds P's record) and again at
:meth:`Pushes.post` (P's rows inside its own staged span, the request's tokens and
order equal to what P staged). A D holding the key can at worst have this request's
bytes written elsewhere into its own arena. For equal geometry an item has one row:
one descriptor per P rank, P's record included (it travels in the slot).

**Notifications**, P -> D over NIXL, tagged with the key (:mod:`kvcopy.nixl.wire.notices`)::

    b"kvcopy-push\\0" + token (32 hex digits) + b"\\0" + kind     f: the WRITE ended DONE
                                                                x: P will never WRITE it,
                                                                   and none is in flight

P sends one only after NIXL reported the WRITE ended (a WRITE carries no NIXL
notification: NIXL would also send it from the release of a handle given up on). D reads
them in ``TransferManager.notifications`` (every caller's, so a worker reading P-side
notifications delivers D's too) and :meth:`Pushes.state`.

**D's span is never reused while a WRITE may land** (the late-READ rule mirrored: a
one-sided WRITE gives D no handle to wait on or cancel). Only P can say none will: its
``f`` or ``x``, or :meth:`Pushes.release` (the caller learned it another way: P's
answer to a cancel, P restarted under a new registration). A deadline fails the
*request* (``state`` ERR, ``complete`` writes nothing to the KV) while its span stays
*held* (``stats()["push_held_spans"]``); a WRITE landing later lands there only.

P keeps each WRITE handle until NIXL reports it ended, and its staged span with it
(:meth:`~kvcopy.nixl.modes.arena.ArenaStaging.begin_write`); a reservation not posted by
its ``timeout_s`` is answered ``x``. Tokens seen are kept (:data:`MAX_TOMBSTONES`) so a
reservation is never served twice.
"""
from __future__ import annotations

import math
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from .agent import Agent
from .modes.arena import ArenaPlan, ArenaStaging
from .modes.arena_push import LENGTH, ReservedWork, land, reserve
from .modes.base import Peer
from .planning.pack_order import ORDERS
from .pull import DONE, ERR, PROC, Completion
from .wire.handshake import EngineInfo
from .wire.notices import Mailbox
from .wire.record import MAX_TOKENS, StagedRequest, record_capacity, request_key

PREFIX = b"kvcopy-push\0"
FINAL, NEVER = b"f", b"x"
TOKEN_BYTES = 16
MAX_ROWS = 4096
MAX_TIMEOUT_S = 1e6
MAX_TOMBSTONES = 1 << 16
TRAILER_REREAD_S = 0.05  # D re-reads a trailer not visible yet when P's "f" came ("done before visible")


def notice(token: bytes, kind: bytes) -> bytes:
    return PREFIX + token.hex().encode() + b"\0" + kind


def parse_notice(msg: bytes) -> Optional[Tuple[bytes, bytes]]:
    """(token, kind) of a push notification, or None for anything else (peer input)."""
    if not msg.startswith(PREFIX):
        return None
    body = msg[len(PREFIX):]
    if len(body) != 2 * TOKEN_BYTES + 2 or body[-2:-1] != b"\0" or body[-1:] not in (FINAL, NEVER):
        return None
    try:
        return bytes.fromhex(body[:-2].decode("ascii")), body[-1:]
    except ValueError:
        return None


@dataclass(frozen=True)
class Reservation:
    """D's reservation, as its caller holds it: the token, per P peer the item to send
    it, and the plan (D's span, pages, descriptors). Changing it changes nothing the
    manager reads."""

    token: bytes
    request_id: str
    items: Mapping[str, tuple]
    plan: ArenaPlan
    deadline: float

    @property
    def num_descriptors(self) -> int:
        return sum(len(item[6]) for item in self.items.values())


@dataclass
class _Receiving:
    """D: one reservation."""

    rw: ReservedWork
    names: Tuple[str, ...]
    deadline: float
    ended: Dict[str, bytes] = field(default_factory=dict)  # peer -> FINAL or NEVER
    state: str = PROC
    error: Optional[str] = None
    final_at: Optional[float] = None
    completed: bool = False

    @property
    def quiet(self) -> bool:
        """No WRITE of it can land any more."""
        return len(self.ended) == len(self.names)


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


class Pushes:
    """One manager's pushes, both roles (see the module docstring). Driven by the
    manager's one thread."""

    def __init__(self, agent: Agent, mail: Mailbox, mode: ArenaStaging, info: EngineInfo, key: Optional[bytes],
                 read_mail: Callable[[], object], require_checksum: bool, peer_of: Callable[[str], Peer]):
        self._peer_of = peer_of  # an added peer by name (ValueError for another)
        self._agent, self._mail, self._mode, self._info, self._key = agent, mail, mode, info, key
        self._read_mail = read_mail  # reads NIXL's notifications into on_notices
        self._require = require_checksum
        self._recv: Dict[bytes, _Receiving] = {}
        self._held: Dict[bytes, _Receiving] = {}  # ended for the caller, a WRITE may still land
        self._send: Dict[bytes, _Sending] = {}
        self._targets: Dict[str, EngineInfo] = {}
        self._seen: "OrderedDict[bytes, str]" = OrderedDict()  # P: token -> "never" | "ended"
        self._closed: List[Tuple[bytes, str, str]] = []  # P: (token, request id, target) answered since take_closed
        self.ignored = 0  # notices naming no live reservation of their sender
        self.landed = 0  # D: pushes loaded (checked and scattered)

    # ------------------------------------------------------------ D
    def reserve(self, peers: Sequence[str], num_tokens, local_block_ids, num_cached_tokens, request_id,
                timeout_s: float) -> Reservation:
        """D: plan ``request_id`` from the P ranks ``peers`` (added peers) into a span of
        D's arena held for it (``ArenaFull`` when none fits: nothing held); send each
        ``items[peer]`` to that P rank. ``timeout_s``: the request fails (its span stays
        held) when P has not pushed it by then."""
        timeout_s = float(timeout_s)
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}")
        ranks = [self._peer_of(n) for n in peers]
        rw = reserve(self._mode, self._info, ranks, num_tokens, local_block_ids, num_cached_tokens, request_id)
        token = secrets.token_bytes(TOKEN_BYTES)
        deadline = time.monotonic() + timeout_s
        rid = request_key(request_id).decode("latin-1")
        items = {p.name: (token, rid, int(num_tokens), rw.request.order, rw.work.offset, rw.work.nbytes,
                          rw.rows[p.name].tolist(), list(rw.slots[p.name]), float(timeout_s)) for p in ranks}
        self._recv[token] = _Receiving(rw, tuple(p.name for p in ranks), deadline)
        return Reservation(token, rid, MappingProxyType(items), rw.plan, deadline)

    def on_notices(self, new: Mapping[str, List[bytes]]) -> None:
        """Take the push notifications out of ``new`` (NIXL's, by sender; edited in place)."""
        for sender, msgs in new.items():
            keep = []
            for m in msgs:
                parsed = parse_notice(bytes(m)) if bytes(m).startswith(PREFIX) else None
                if parsed is None:
                    if not bytes(m).startswith(PREFIX):
                        keep.append(m)
                    continue
                self._ended(sender, *parsed)
            msgs[:] = keep

    def _ended(self, sender: str, token: bytes, kind: bytes) -> None:
        job = self._recv.get(token) or self._held.get(token)
        if job is None or sender not in job.names or sender in job.ended:
            self.ignored += 1
            return
        job.ended[sender] = kind
        if kind == FINAL and job.final_at is None and all(k == FINAL for k in job.ended.values()):
            job.final_at = time.monotonic()
        if token in self._held and job.quiet:
            self._mode.free(self._held.pop(token).rw.work)

    def state(self, token: bytes) -> str:
        job = self._job(token)
        if job.state != PROC:
            return job.state
        self._read_mail()
        now = time.monotonic()
        if NEVER in job.ended.values():
            who = [n for n, k in job.ended.items() if k == NEVER]
            self._fail(job, f"P ({', '.join(who)}) will not push this request")
        elif job.quiet:
            if self._visible(job) or now - (job.final_at or now) >= TRAILER_REREAD_S:
                job.state = DONE
        elif now >= job.deadline:
            late = [n for n in job.names if n not in job.ended]
            self._fail(job, f"deadline: not pushed in time (waiting on {late})")
        return job.state

    def _visible(self, job: _Receiving) -> bool:
        """Every trailer's frame reads (a fabric may report a WRITE done before its bytes show)."""
        buf, base = self._mode.buffer, job.rw.work.offset
        for at, cap in job.rw.slots.values():
            raw = buf[base + at: base + at + cap].numpy().tobytes()
            (n,) = LENGTH.unpack_from(raw)
            try:
                StagedRequest.from_bytes(raw[LENGTH.size:LENGTH.size + n], self._key)
            except ValueError:
                return False
        return True

    def _fail(self, job: _Receiving, reason: str) -> None:
        job.state, job.error = ERR, reason

    def fail(self, token: bytes, reason: str) -> None:
        """D fails the request now (its reservation never reached P, say); its span is
        held as at a deadline until P's answer or :meth:`release`."""
        job = self._job(token)
        if job.state == PROC:
            self._fail(job, reason)

    def complete(self, token: bytes) -> Completion:
        """After ``DONE``: check the trailers and scatter (:func:`~kvcopy.nixl.modes.arena_push.land`);
        after ``ERR``: write nothing. D's span is freed now, or held until no WRITE can land."""
        job = self._job(token)
        if job.completed:
            raise ValueError("this reservation was already completed")
        if self.state(token) == PROC:
            raise ValueError("the push is still in flight; poll state() until DONE or ERR")
        job.completed = True
        work = job.rw.work
        del self._recv[token]
        try:
            if job.state == DONE:
                try:
                    check, unchecked = land(self._mode, job.rw, self._key, self._require)
                    self.landed += 1
                    return Completion.of_done(self._info.num_groups, check, unchecked, work)
                except Exception as exc:  # noqa: BLE001 -- a refused record or a failed scatter fails this load only
                    job.state, job.error = ERR, f"the pushed request is not loaded: {type(exc).__name__}: {exc}"
            return Completion.of_failed(work, job.error, None, not job.quiet)
        finally:
            if job.quiet:
                self._mode.free(work)
            else:
                self._held[token] = job

    def release(self, token: bytes) -> None:
        """D learned that no WRITE of ``token`` can land (P's answer to a cancel: never
        posted, or ended): its span goes once the request is completed."""
        job = self._recv.get(token) or self._held.get(token)
        if job is None:
            return
        for name in job.names:
            job.ended.setdefault(name, NEVER)
        if token in self._held:
            self._mode.free(self._held.pop(token).rw.work)

    def peer_restarted(self, name: str) -> None:
        """Peer ``name`` registered anew (a new generation: the old process's endpoints
        are gone): nothing it posted before can land."""
        for token, job in list(self._recv.items()) + list(self._held.items()):
            if name in job.names and name not in job.ended:
                self._ended(name, token, NEVER)

    def _job(self, token: bytes) -> _Receiving:
        job = self._recv.get(token)
        if job is None:
            raise ValueError("unknown reservation token (completed already, or never made here)")
        return job

    # ------------------------------------------------------------ P
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
            if s.target == name and not s.posted:
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
        if token in self._send or token in self._seen:
            raise ValueError("reservation token used already")
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
        rid = s.request_id.decode("latin-1")
        if staged_as is not None:
            if record.request_id != staged_as:
                raise ValueError(f"record of {record.request_id!r} given as staged for {staged_as!r}")
            s.request_id = request_key(staged_as)  # P's span, held and released under P's id
            record = replace(record, request_id=rid)
        if record.request_id != rid or record.engine != self._info.name or record.num_tokens != s.num_tokens \
                or record.order != s.order:
            self._close(token, "never", None)
            raise ValueError(f"reservation is for {rid!r} of {s.num_tokens} tokens in order {s.order!r}: "
                             f"P staged {record.request_id!r}, {record.num_tokens} tokens, {record.order!r}")
        try:
            entry = self._mode.begin_write(s.request_id)
        except ValueError:  # its span is freed already: nothing to WRITE
            self._close(token, "never", None)
            raise
        try:
            body = record.to_bytes(self._key)
            sizes = s.remote[:, 1].astype(np.int64)
            if LENGTH.size + len(body) > min(entry.slot, s.slot_cap) \
                    or np.any(s.p_rel + sizes > entry.payload + entry.slot):
                raise ValueError("the reservation's rows or record do not fit P's staged span")
            at = entry.span.offset + entry.payload
            self._mode.buffer[at: at + LENGTH.size + len(body)].copy_(
                _bytes_tensor(LENGTH.pack(len(body)) + body))
        except ValueError:
            self._mode.end_write(s.request_id)
            self._close(token, "never", None)
            raise
        local = np.stack([self._mode.base + entry.span.offset + s.p_rel, sizes, np.zeros_like(sizes)], 1)
        xfer, state, _ = self._agent.post_read_descs(local.astype(np.uint64), "DRAM", s.target, s.remote, "DRAM",
                                                     b"", op="WRITE")
        s.posted, s.xfer = True, xfer
        if state != PROC:
            self._write_ended(token, s, state)
        return int(sizes.sum()), len(sizes)

    def refuse(self, token: bytes) -> None:
        """P will not post this reservation (it could not stage the request, or aborted it): ``x``."""
        s = self._send.get(token)
        if s is not None and not s.posted:
            self._close(token, "never", None)

    def poll(self) -> int:
        """Check the WRITEs in flight; notify D of those that ended, answer ``x`` to
        reservations past their deadline. Returns the WRITEs still in flight."""
        now = time.monotonic()
        live = 0
        for token, s in list(self._send.items()):
            if not s.posted:
                if now >= s.deadline:
                    self._close(token, "never", None)
                continue
            state = self._agent.state(s.xfer)[0] if s.xfer is not None else ERR
            if state == PROC:
                live += 1
            else:
                self._write_ended(token, s, state)
        return live

    def _write_ended(self, token: bytes, s: _Sending, state: str) -> None:
        if s.xfer is not None:
            Agent.release(s.xfer)
            s.xfer = None
        self._mode.end_write(s.request_id)
        self._close(token, "ended", state)

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
        (an added D), answered ``x`` over NIXL at once."""
        s = self._send.get(token)
        if s is None:
            if token not in self._seen:
                self._tombstone(token, "never")
                d = self._targets.get(target) if target is not None else None
                if d is not None:
                    self._mail.send(d.name, d.generation, notice(token, NEVER))
            return self._seen.get(token, "never")
        if not s.posted:
            self._close(token, "never", None)
            return "never"
        return "in_flight"

    # ------------------------------------------------------------ both
    def stats(self) -> Dict[str, int]:
        return {"push_reserved": len(self._recv), "push_held_spans": len(self._held),
                "push_accepted": sum(not s.posted for s in self._send.values()),
                "push_writes_in_flight": sum(s.posted for s in self._send.values()),
                "push_notices_ignored": self.ignored, "push_landed": self.landed}

    def close(self) -> bool:
        """Release P's WRITE handles (the agent goes next); whether any was in flight."""
        live = False
        for s in self._send.values():
            if s.xfer is not None:
                live = True
                Agent.release(s.xfer)
                s.xfer = None
        self._send = {}
        return live


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
