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

    b"kvcopy-push\\0" + token (32 hex digits) + b"\\0" + kind     f: every WRITE of it ended DONE
                                                                x: P will never WRITE it,
                                                                   and none is in flight
    b"kvcopy-push\\0" + token + b"\\0" + lo + b"\\0" + hi + b"\\0c"   c: P's units [lo, hi) WRITten,
                                                                   that WRITE ended DONE

P sends one only after NIXL reported the WRITE ended (a WRITE carries no NIXL
notification: NIXL would also send it from the release of a handle given up on). D reads
them in ``TransferManager.notifications`` (every caller's, so a worker reading P-side
notifications delivers D's too) and :meth:`Pushes.state`.

**Chunks** (a layer-wise P, :mod:`kvcopy.nixl.modes.push_units`): before the final
:meth:`Pushes.post`, :meth:`Pushes.post_units` WRITEs units ``[lo, hi)`` of the request's
partial stage (the reservation's rows cut to their bytes) as soon as the caller says
their last copies ended; each is told ``c`` once it ended DONE, and the final WRITE
carries what no chunk did, then the record slot. D scatters every unit whose P units
all landed on the ``c`` (in :meth:`Pushes.state`), the rest at ``complete``, and compares
the sums of all at ``complete``.

**D's span is never reused while a WRITE may land** (the late-READ rule mirrored: a
one-sided WRITE gives D no handle to wait on or cancel). Only P can say none will: its
``f`` or ``x``, or :meth:`Pushes.release` (the caller learned it another way: P's
answer to a cancel, P restarted under a new registration). A deadline fails the
*request* (``state`` ERR, ``complete`` writes nothing to the KV) while its span stays
*held* (``stats()["push_held_spans"]``); a WRITE landing later lands there only.
A peer's answer to D's cancel goes through :meth:`Pushes.answered`; a peer registered
anew (:meth:`Pushes.peer_restarted`) ends the holds of its old registration after
:data:`RESTART_GRACE_S` (a killed process's endpoints are closed by then). Holds are
bounded: :meth:`Pushes.reserve` refuses while the spans held for one peer exceed half
of D's arena (a frozen P keeps its holds until D closes; new requests recompute).

P keeps each WRITE handle until NIXL reports it ended, and its staged span with it
(:meth:`~kvcopy.nixl.modes.arena.ArenaStaging.begin_write`); a reservation not posted by
its ``timeout_s`` is answered ``x``, and one P refuses (:meth:`Pushes.refused`) is
answered ``x`` too when D is added. Tokens seen are kept (:data:`MAX_TOMBSTONES`) so a
reservation is never served twice. P keeps at most :data:`MAX_ACCEPTED` reservations
not posted, each at most :data:`MAX_TIMEOUT_S`.
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
from .modes import push_units
from .modes.arena_push import LENGTH, ReservedWork, land, reserve
from .modes.partial_stage import PartialStage
from .modes.base import Peer
from .planning.pack_order import ORDERS
from .pull import DONE, ERR, PROC, Completion
from .wire.handshake import EngineInfo
from .wire.notices import Mailbox
from .wire.record import MAX_TOKENS, StagedRequest, record_capacity, request_key

PREFIX = b"kvcopy-push\0"
FINAL, NEVER, CHUNK = b"f", b"x", b"c"
MAX_UNIT_DIGITS = 6  # a chunk notice's unit numbers (spans have far fewer units)
TOKEN_BYTES = 16
MAX_ROWS = 4096
MAX_TIMEOUT_S = 3600.0  # the longest a reservation waits for P (P refuses longer: it keeps each until then)
MAX_ACCEPTED = 4096  # reservations P keeps not posted (per manager: one P rank)
MAX_TOMBSTONES = 1 << 16
RESTART_GRACE_S = 1.0  # a peer registered anew: its old process's WRITEs are gone after this
HOLD_SHARE = 0.5  # reserve() refuses while one peer's held spans exceed this share of D's arena
ANSWERS = ("never", "ended", "in_flight")  # P's answers to a cancel
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


def chunk_notice(token: bytes, lo: int, hi: int) -> bytes:
    """P's ``c``: its units ``[lo, hi)`` of ``token``'s request were WRITten and the WRITE ended DONE."""
    return PREFIX + token.hex().encode() + b"\0%d\0%d\0" % (lo, hi) + CHUNK


def parse_chunk_notice(msg: bytes) -> Optional[Tuple[bytes, int, int]]:
    """(token, lo, hi) of a chunk notice, or None for anything else (peer input)."""
    if not msg.startswith(PREFIX) or not msg.endswith(b"\0" + CHUNK):
        return None
    parts = msg[len(PREFIX):-2].split(b"\0")
    if len(parts) != 3 or len(parts[0]) != 2 * TOKEN_BYTES \
            or not all(0 < len(x) <= MAX_UNIT_DIGITS and x.isdigit() for x in parts[1:]):
        return None
    lo, hi = int(parts[1]), int(parts[2])
    try:
        token = bytes.fromhex(parts[0].decode("ascii"))
    except ValueError:
        return None
    return (token, lo, hi) if lo < hi else None


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
    generations: Dict[str, str] = field(default_factory=dict)  # peer -> its registration reserved against
    ended: Dict[str, bytes] = field(default_factory=dict)  # peer -> FINAL or NEVER
    restart_at: Dict[str, float] = field(default_factory=dict)  # peer registered anew -> when its holds end
    state: str = PROC
    error: Optional[str] = None
    final_at: Optional[float] = None
    completed: bool = False
    # chunked push (push_units): per peer the P units whose chunk landed, the D units scattered, their sums
    landed: Dict[str, np.ndarray] = field(default_factory=dict)
    scattered: Optional[np.ndarray] = None
    sums: list = field(default_factory=list)
    chunks: int = 0  # c notices taken

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
    # chunked push: the P units WRITTEN before the final WRITE, those WRITEs in flight
    # (handle, lo, hi, the partial stage they read), and whether one failed or P gave up
    sent: Optional[np.ndarray] = None
    chunks: List[tuple] = field(default_factory=list)
    failed: bool = False
    final_state: Optional[str] = None  # the final WRITE's end state
    part: Optional[PartialStage] = None  # the partial stage the chunks were cut from


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
        self.chunks_posted = 0  # P: chunk WRITEs posted (post_units)
        self.chunks_landed = 0  # D: c notices taken
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
        self.sweep()
        limit = HOLD_SHARE * self._info.arena[1]
        for p in ranks:
            held = sum(j.rw.work.nbytes for j in self._held.values() if p.name in j.names and p.name not in j.ended)
            if held > limit:
                raise ValueError(f"{held} bytes of D's arena are held for {p.name!r}, which has not said its WRITEs "
                                 f"ended (more than {HOLD_SHARE:g} of the arena): not reserving more from it")
        rw = reserve(self._mode, self._info, ranks, num_tokens, local_block_ids, num_cached_tokens, request_id)
        many = {n: len(r) for n, r in rw.rows.items() if len(r) > MAX_ROWS}
        if many:
            self._mode.free(rw.work)
            raise ValueError(f"this push needs {max(many.values())} WRITE rows from one P rank, more than P takes "
                             f"({MAX_ROWS}): TP sizes that differ need arena_order 'head' (or pull) for requests "
                             "this long")
        token = secrets.token_bytes(TOKEN_BYTES)
        deadline = time.monotonic() + timeout_s
        rid = request_key(request_id).decode("latin-1")
        items = {p.name: (token, rid, int(num_tokens), rw.request.order, rw.work.offset, rw.work.nbytes,
                          rw.rows[p.name].tolist(), list(rw.slots[p.name]), float(timeout_s)) for p in ranks}
        self._recv[token] = _Receiving(rw, tuple(p.name for p in ranks), deadline,
                                       {p.name: p.info.generation for p in ranks})
        return Reservation(token, rid, MappingProxyType(items), rw.plan, deadline)

    def on_notices(self, new: Mapping[str, List[bytes]]) -> None:
        """Take the push notifications out of ``new`` (NIXL's, by sender; edited in place)."""
        for sender, msgs in new.items():
            keep = []
            for m in msgs:
                if not bytes(m).startswith(PREFIX):
                    keep.append(m)
                    continue
                parsed = parse_notice(bytes(m))
                if parsed is not None:
                    self._ended(sender, *parsed)
                    continue
                chunk = parse_chunk_notice(bytes(m))
                if chunk is not None:
                    self._chunk(sender, *chunk)
                else:
                    self.ignored += 1
            msgs[:] = keep

    def _chunk(self, sender: str, token: bytes, lo: int, hi: int) -> None:
        """P's ``c``: its units ``[lo, hi)`` landed in D's span (scattered at :meth:`state`)."""
        job = self._recv.get(token)
        us = job.rw.units if job is not None else None
        if job is None or us is None or sender not in job.names or sender in job.ended or job.state != PROC \
                or hi > us.p_units[job.names.index(sender)]:
            self.ignored += 1
            return
        landed = job.landed.setdefault(sender, np.zeros(us.p_units[job.names.index(sender)], bool))
        landed[lo:hi] = True
        job.chunks += 1
        self.chunks_landed += 1

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
        self.sweep()
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
        elif job.landed:
            self._scatter_landed(job)
        return job.state

    def _scatter_landed(self, job: _Receiving) -> None:
        """Scatter the D units whose P units all landed (chunked push, :mod:`kvcopy.nixl.modes.push_units`)."""
        us = job.rw.units
        assert us is not None
        if job.scattered is None:
            job.scattered = np.zeros(len(us.needs), bool)
        landed = [job.landed.get(n, np.zeros(k, bool)) for n, k in zip(job.names, us.p_units)]
        ready = us.ready(landed, job.scattered)
        if not ready:
            return
        job.scattered[ready] = True  # before the copy: a unit half scattered is never scattered again
        try:
            push_units.scatter(self._mode, job.rw.request.order, us, ready, self._mode.sums.on, job.sums)
        except Exception as exc:  # noqa: BLE001 -- a torch/CUDA error fails this load only
            self._fail(job, f"scattering a pushed chunk failed: {type(exc).__name__}: {exc}")

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
                    check, unchecked = land(self._mode, job.rw, self._key, self._require, job.scattered, job.sums)
                    self.landed += 1
                    return Completion.of_done(self._info.num_groups, check, unchecked, work)
                except Exception as exc:  # noqa: BLE001 -- a refused record or a failed scatter fails this load only
                    job.state, job.error = ERR, f"the pushed request is not loaded: {type(exc).__name__}: {exc}"
            # chunks scattered before the failure wrote this request's own pages (vLLM rewrites them)
            written = "device caches" if job.scattered is not None and job.scattered.any() else None
            return Completion.of_failed(work, job.error, written, not job.quiet)
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

    def answered(self, token: bytes, name: str, how: str, generation: str) -> None:
        """Peer ``name``'s answer to D's cancel of ``token``, from its registration
        ``generation``: ``never``/``ended`` from the registration reserved against end
        its hold; from another one, the peer restarted (:meth:`peer_restarted`)."""
        job = self._recv.get(token) or self._held.get(token)
        if job is None or name not in job.names or name in job.ended or how not in ANSWERS:
            return
        if generation != job.generations.get(name):
            self.peer_restarted(name, generation)
        elif how in ("never", "ended"):
            self._ended(name, token, NEVER)

    def holding(self, token: bytes) -> bool:
        """Whether ``token``'s span is still reserved or held (a WRITE of it may land)."""
        return token in self._recv or token in self._held

    def peer_restarted(self, name: str, generation: Optional[str] = None, grace_s: float = RESTART_GRACE_S) -> None:
        """Peer ``name`` registered anew as ``generation`` (its old process's endpoints
        are gone): after ``grace_s`` nothing it posted under another registration can
        land (:meth:`sweep` ends those holds; ``generation`` None: the one added as ``name`` now)."""
        if generation is None:
            generation = self._peer_of(name).info.generation
        at = time.monotonic() + grace_s
        for job in list(self._recv.values()) + list(self._held.values()):
            if name in job.names and name not in job.ended and job.generations.get(name) != generation:
                job.restart_at.setdefault(name, at)
        self.sweep()

    def sweep(self) -> None:
        """End the holds of restarted peers whose grace passed."""
        now = time.monotonic()
        for token, job in list(self._recv.items()) + list(self._held.items()):
            for name, at in list(job.restart_at.items()):
                if now >= at and name not in job.ended:
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
        if token in self._send or token in self._seen:
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
        if s.sent is None:
            s.sent = np.zeros(len(bounds) - 1, bool)
        if not (0 <= lo < hi <= len(s.sent)) or s.sent[lo:hi].any():
            raise ValueError(f"units [{lo}, {hi}) out of range or sent already")
        if s.part is not None and s.part is not part:
            raise ValueError("units of another partial stage of this request were sent already")
        self._mode.hold_part(part)  # ValueError: not the staging's live partial stage of it
        s.sent[lo:hi] = True
        s.part = part
        local, remote = self._cut(s, part.span.offset, int(bounds[lo]), int(bounds[hi]))
        if not len(local):
            self._mode.unhold_part(part)
            return 0, 0
        xfer, state, _ = self._agent.post_read_descs(local, "DRAM", s.target, remote, "DRAM", b"", op="WRITE")
        s.chunks.append((xfer, lo, hi, part))
        self.chunks_posted += 1
        if state != PROC:
            self._reap_chunks(token, s)
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
        hold dropped; returns those still in flight."""
        live = []
        for xfer, lo, hi, part in s.chunks:
            state = self._agent.state(xfer)[0] if xfer is not None else ERR
            if state == PROC:
                live.append((xfer, lo, hi, part))
                continue
            if xfer is not None:
                Agent.release(xfer)
            self._mode.unhold_part(part)
            if state != DONE:
                s.failed = True
            elif not s.failed:
                d = self._targets.get(s.target)
                if d is not None:
                    self._mail.send(s.target, d.generation, chunk_notice(token, lo, hi))
        s.chunks = live
        return len(live)

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
        except ValueError:
            self._mode.end_write(s.request_id)
            s.failed = True
            self._advance(token, s, time.monotonic())  # x once no chunk WRITE is in flight
            raise
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
        s.posted, s.xfer = True, xfer
        if xfer is None:
            self._mode.end_write(s.request_id)
            s.final_state = ERR
        self._advance(token, s, time.monotonic())
        return int(local[:, 1].sum()), len(local)

    def refused(self, token, target: Optional[str]) -> None:
        """P refused a reservation item (:meth:`accept` raised, or D could not be added):
        its token, if well-formed and new, is answered ``never`` to a later cancel, and
        ``x`` now where ``target`` is an added D (D fails the load at once)."""
        if not isinstance(token, bytes) or len(token) != TOKEN_BYTES or token in self._send or token in self._seen:
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
        the final WRITE not posted). Returns the WRITEs still in flight."""
        live = self._reap_chunks(token, s) if s.chunks else 0
        if s.xfer is not None:
            state = self._agent.state(s.xfer)[0]
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

    # ------------------------------------------------------------ both
    def stats(self) -> Dict[str, int]:
        return {"push_reserved": len(self._recv), "push_held_spans": len(self._held),
                "push_accepted": sum(not s.posted and not s.chunks for s in self._send.values()),
                "push_writes_in_flight": sum(s.posted or bool(s.chunks) for s in self._send.values()),
                "push_notices_ignored": self.ignored, "push_landed": self.landed,
                "push_chunks_posted": self.chunks_posted, "push_chunks_landed": self.chunks_landed}

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
