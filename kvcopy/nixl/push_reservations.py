"""D's half of a push in arena mode: spans of D's arena reserved for a request, WRITten by P.

    # D                                                   # P (kvcopy.nixl.push_writes)
    res = m.reservations.reserve(peers, n, d_blocks, cached, rid, timeout_s)
    send res.items[peer] to that P rank (side channel) ->  P accepts, stages, WRITEs, notifies
    m.reservations.state(res.token) -> PROC | DONE | ERR
    done = m.reservations.complete(res.token)             # -> Completion, as a pull's

**D plans, P posts** (:mod:`kvcopy.nixl.modes.arena_push`): D plans the rows between
the spans from P's handshake alone and sends each P rank an *item*: ``(token,
request_id, num_tokens, order, D's span offset, D's span bytes, rows [[p_rel, d_rel,
nbytes], ...], [slot offset, slot bytes], timeout_s)``, span-relative, within the bounds
of :mod:`kvcopy.nixl.wire.push_messages`. For equal geometry an item has one row: one
descriptor per P rank, P's record included (it travels in the slot).

P's notices (``f``, ``x``, ``c``: :mod:`kvcopy.nixl.wire.push_messages`) are read in
``TransferManager.notifications`` (every caller's, so a worker reading P-side
notifications delivers D's too) and :meth:`Reservations.state`. **Chunks** (a layer-wise
P, :mod:`kvcopy.nixl.modes.push_units`): D scatters every unit whose P units all landed
on the ``c`` (in :meth:`Reservations.state`), the rest at ``complete``, and compares the
sums of all at ``complete``; a GPU D alike, its scatters enqueued on the calling thread's
current stream and its sums folded as their events complete, so ``complete``'s verdict
may be pending (``Completion.ready``) and its span is freed once those events completed.

**D's span is never reused while a WRITE may land** (the late-READ rule mirrored: a
one-sided WRITE gives D no handle to wait on or cancel). Only P can say none will: its
``f`` or ``x``, or :meth:`Reservations.release` (the caller learned it another way: P's
answer to a cancel, P restarted under a new registration). A deadline fails the
*request* (``state`` ERR, ``complete`` writes nothing to the KV) while its span stays
*held* (``stats()["push_held_spans"]``); a WRITE landing later lands there only.
A peer's answer to D's cancel goes through :meth:`Reservations.answered`; a peer
registered anew (:meth:`Reservations.peer_restarted`) ends the holds of its old
registration after :data:`RESTART_GRACE_S` (a killed process's endpoints are closed by
then). Holds are bounded: :meth:`Reservations.reserve` refuses while the spans held for
one peer exceed half of D's arena (a frozen P keeps its holds until D closes; new
requests recompute).
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .modes.arena import ArenaPlan, ArenaStaging
from .modes import push_units
from .modes.arena_push import ReservedWork, land, read_trailer, reserve
from .modes.base import Peer
from .pull import DONE, ERR, PROC, Completion
from .wire.handshake import EngineInfo
from .wire.push_messages import (ANSWERS, FINAL, MAX_ROWS, MAX_TIMEOUT_S, NEVER, PREFIX, TOKEN_BYTES,
                                 parse_chunk_notice, parse_notice)
from .wire.record import StagedRequest, request_key

RESTART_GRACE_S = 1.0  # a peer registered anew: its old process's WRITEs are gone after this
HOLD_SHARE = 0.5  # reserve() refuses while one peer's held spans exceed this share of D's arena
TRAILER_REREAD_S = 0.05  # D re-reads a trailer not visible yet when P's "f" came ("done before visible")


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
    sums: Optional[push_units.UnitSums] = None
    trailers: Optional[Dict[str, StagedRequest]] = None  # P's records, read once every f came
    chunks: int = 0  # c notices taken

    @property
    def quiet(self) -> bool:
        """No WRITE of it can land any more."""
        return len(self.ended) == len(self.names)




class Reservations:
    """One manager's reservations, D's half of its pushes (see the module docstring).
    Driven by the manager's one thread."""

    def __init__(self, mode: ArenaStaging, info: EngineInfo, key: Optional[bytes],
                 read_mail: Callable[[], object], require_checksum: bool, peer_of: Callable[[str], Peer]):
        self._peer_of = peer_of  # an added peer by name (ValueError for another)
        self._mode, self._info, self._key = mode, info, key
        self._read_mail = read_mail  # reads NIXL's notifications into on_notices
        self._require = require_checksum
        self._recv: Dict[bytes, _Receiving] = {}
        self._held: Dict[bytes, _Receiving] = {}  # ended for the caller, a WRITE may still land
        self.ignored = 0  # notices naming no live reservation of their sender
        self.chunks_landed = 0  # c notices taken
        self.landed = 0  # pushes loaded (checked and scattered)

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
            job.sums = push_units.UnitSums(us, self._mode.streams)
        assert job.sums is not None
        job.sums.settle()  # a GPU's read-backs that arrived: folded now, so that f has only the last ones left
        landed = [job.landed.get(n, np.zeros(k, bool)) for n, k in zip(job.names, us.p_units)]
        ready = us.ready(landed, job.scattered)
        if not ready:
            return
        job.scattered[ready] = True  # before the copy: a unit half scattered is never scattered again
        try:
            push_units.scatter(self._mode, job.rw.work.offset, job.rw.request.order, us, ready, self._mode.sums.on,
                               job.sums)
        except Exception as exc:  # noqa: BLE001 -- a torch/CUDA error fails this load only
            self._fail(job, f"scattering a pushed chunk failed: {type(exc).__name__}: {exc}")

    def _visible(self, job: _Receiving) -> bool:
        """Every trailer's record reads (a fabric may report a WRITE done before its bytes
        show); kept for ``complete``, which checks them."""
        try:
            job.trailers = {n: read_trailer(self._mode, job.rw, n, self._key) for n in job.names}
        except ValueError:
            job.trailers = None
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
                    check, unchecked = land(self._mode, job.rw, self._key, self._require, job.scattered, job.sums,
                                            job.trailers)
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

    def stats(self) -> Dict[str, int]:
        return {"push_reserved": len(self._recv), "push_held_spans": len(self._held),
                "push_notices_ignored": self.ignored, "push_landed": self.landed,
                "push_chunks_landed": self.chunks_landed}
