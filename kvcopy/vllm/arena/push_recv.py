"""D's worker in push mode (``transfer_mode: "push"``): reserve, tell P, land when P says so.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first. The pull
path's states and outcomes (:mod:`kvcopy.vllm.arena.pull`) with the middle replaced:

1. **fetch** P's kvcopy handshakes only (no records: P has not necessarily staged yet);
2. **reserve** (``TransferManager.reservations.reserve``): D plans from P's handshake alone and
   holds a span of its arena for the request. D's arena full is back-pressure: retried
   every step until ``push_timeout_s`` from the request's start, then the load fails
   (vLLM recomputes) and P is told D gave the request up;
3. **RESERVE** over P's side channel (:mod:`kvcopy.vllm.arena.push_channel`), one
   question per request naming every P rank this rank reads and where D's own side
   channel is (P fetches D's handshake there). A refusal fails the load; P keeps
   nothing of that question, so the span is freed when it was the only one sent. No
   answer within the exchange's timeout (P's listener held up, the question or its
   answer lost) is asked again, the same question, until ``push_timeout_s``
   (``SideChannel.ask``'s ``until``; a listener held up 5 s was seen in CI): P's worker
   takes a token it holds or ended already as the same reservation and keeps one
   (``PushSender``), so a copy that arrives late changes nothing. A refusal after more
   than one copy was sent (``Reply.copies``) proves nothing of the earlier copies (one
   may still wait at P's listener): the span stays held and goes by the cancel path
   below;
4. **land**: ``reservations.state`` reads P's ``f``/``x`` notifications; on ``f`` from every
   P rank ``reservations.complete`` checks the records that came in the WRITE and scatters, as a
   pull's ``complete`` does. ``x``, a bad record, or ``push_timeout_s`` fail the load
   with D's KV untouched.

**D's span is never reused while a WRITE may land**: after a failure it stays held in
the manager until P answers (``f``/``x``; a WRITE landing late lands there only). D
sends P a CANCEL once the RESERVE exchange ended (never before: it could overtake it;
a copy whose exchange timed out may still wait at P's listener and come after the
CANCEL, which P's worker then drops quietly: the CANCEL tombstoned its token, and P keeps the
last 65,536 tokens per rank, :data:`~kvcopy.nixl.push_writes.MAX_TOMBSTONES`), and
again every :data:`CANCEL_EVERY_S` until P's answer ends the hold (``never``: not posted
and now never will be, ``ended``; ``in_flight``: ask again), whether or not P could
reach D over NIXL. A P registered anew (its handshake changed, or a cancel
answered by another generation) proves its old WRITEs gone after a grace
(``RESTART_GRACE_S``). A request whose reservation cannot be sent (rows beyond what P
takes, a question beyond P's bound) fails at ``reserve`` with nothing held.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import msgspec
from vllm.logger import init_logger

from ...nixl import ArenaFull
from ...nixl.pull import PROC
from ...nixl.push_reservations import Reservation
from .channel import MAX_QUESTION_BYTES, decode_bounded, ok_of
from .meta import agent_name
from .pull import ArenaPuller, _Job
from .push_channel import CANCEL_MSG, cancel_answers_of, reserve_question
from .record_client import Reply

logger = init_logger("vllm.kvcopy")

REPLY_BYTES = 4096
CANCEL_EVERY_S = 1.0  # D asks P again about a held span while P says in_flight (or does not answer)


class _Cancel:
    """A failed reservation D holds a span for, until P's answers end the hold.
    ``reserving``: its RESERVE exchange, if it had not ended (P's refusal frees the span
    only when it refused the one copy sent: ``Reply.copies``)."""

    def __init__(self, reserving: Optional[Reply], res: Reservation, host: str, port: int, ranks: List[int],
                 names: List[str]):
        self.reserving, self.res, self.host, self.port = reserving, res, host, port
        self.ranks, self.names = ranks, names
        self.asking: Optional[Reply] = None
        self.next_at = 0.0


class ArenaPushReceiver(ArenaPuller):
    """One D rank's pushes (see the module docstring). ``own``: this engine's side
    channel (host, port), where P fetches D's handshake; ``engine_id``: this engine's."""

    wants_records = False

    def __init__(self, *args, own: Tuple[str, int], engine_id: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.own, self.engine_id = own, engine_id
        self.reserved: Dict[str, Reservation] = {}
        self.asks: Dict[str, Reply] = {}  # RESERVE exchanges in flight (asked again until the push's deadline)
        self._cancels: List[_Cancel] = []

    def _timeout_s(self) -> float:
        return self.opts.push_timeout_s

    def _advance(self, job: _Job, now: float) -> None:
        if job.completion is not None:
            self._land(job, "push")
            return
        res = self.reserved.get(job.rid)
        if res is None:
            self._reserve(job, now)
            return
        ask = self.asks.get(job.rid)
        if ask is not None and ask.done:
            del self.asks[job.rid]
            try:
                if ask.parts is None:
                    raise ask.error or RuntimeError("no reply")
                ok_of(ask.parts, f"{job.recv.host}:{job.recv.port}")
            except Exception as exc:  # noqa: BLE001 -- any refusal or failure of the exchange fails the load
                self.m.reservations.fail(res.token, f"P did not take the reservation: {exc}")
                if ask.parts is not None and ask.copies == 1:  # P refused the only copy: keeps nothing
                    self.m.reservations.release(res.token)
        if self.m.reservations.state(res.token) == PROC:
            return
        job.completion = self.m.reservations.complete(res.token)
        self._land(job, "push")

    def _reserve(self, job: _Job, now: float) -> None:
        r = job.recv
        assert job.fetch is not None and r.positions is not None
        if not job.fetch.done:
            return
        if job.fetch.error is not None:
            raise job.fetch.error
        self._add_peers(r.engine_id, job.fetch.metadata, replace=True)
        peers = [agent_name(r.engine_id, k) for k in job.ranks]
        try:
            res = self.m.reservations.reserve(peers, r.num_tokens, [list(g) for g in r.positions],
                                              list(r.cached_tokens), r.remote_request_id,
                                              max(1e-3, job.deadline - now))
        except ArenaFull as exc:
            if exc.ever_fits and now < job.deadline:
                return  # back-pressure: D's own completions free space
            raise
        items = {k: res.items[n] for k, n in zip(job.ranks, peers)}
        question = msgspec.msgpack.encode(reserve_question(self.engine_id, self.rank, self.tp, self.own[0],
                                                           self.own[1], self.m.info.generation, items))
        if len(question) > MAX_QUESTION_BYTES - 1024:  # (room for the keyed wrapper)
            self.m.reservations.fail(res.token, "not sent")
            self.m.reservations.release(res.token)
            self.m.reservations.complete(res.token)
            raise ValueError(f"this push's reservation is {len(question)} bytes, more than P's side channel takes "
                             f"({MAX_QUESTION_BYTES}): TP sizes that differ need arena_order 'head' (or pull) for "
                             "requests this long")
        self.reserved[job.rid] = res
        t0 = time.monotonic()
        self.asks[job.rid] = self.channel.ask(r.host, r.port, question, REPLY_BYTES, until=job.deadline,
                                              what=f"request {job.rid}'s RESERVE")
        job.posted = (t0, time.monotonic())

    def _add_peers(self, engine_id: str, metadata: Dict[int, bytes], replace: bool = False) -> None:
        changed = [agent_name(engine_id, k) for k, md in metadata.items()
                   if self._added.get(agent_name(engine_id, k), md) != md]
        super()._add_peers(engine_id, metadata, replace)
        for name in changed:  # P registered anew: nothing its old process posted can land (after a grace)
            self.m.reservations.peer_restarted(name)

    # ------------------------------------------------------------ outcomes
    def _finish(self, job: _Job) -> None:
        res = self.reserved.pop(job.rid)
        ask = self.asks.pop(job.rid, None)  # a copy asked again may still be on its way: its answer is not needed
        if ask is not None:
            ask.stop_asking()
        del self.jobs[job.rid]
        self.stats.record(time.monotonic() - job.posted[0], job.posted[1] - job.posted[0], res.plan.num_bytes,
                          res.num_descriptors)
        self.finished.add(job.rid)

    def _fail(self, job: _Job, reason: str) -> None:
        res = self.reserved.pop(job.rid, None)
        ask = self.asks.pop(job.rid, None)
        if ask is not None:
            ask.stop_asking()  # the CANCEL goes once the copy in flight is answered or timed out
        if res is not None:
            done = job.completion
            if done is None:  # the caller failed it (an exception): end the reservation
                self.m.reservations.fail(res.token, reason)
                held = self.m.reservations
                job.completion = held.complete(res.token) if held.state(res.token) != PROC else None
            r = job.recv
            self._cancels.append(_Cancel(ask, res, r.host, r.port, list(job.ranks),
                                         [agent_name(r.engine_id, k) for k in job.ranks]))
        super()._fail(job, reason)

    def tick(self) -> None:
        super().tick()
        self.m.reservations.sweep()
        self._send_cancels()

    def _send_cancels(self) -> None:
        """CANCELs of failed reservations whose RESERVE exchange ended, until P's
        answers end their holds (module docstring)."""
        now = time.monotonic()
        keep = []
        for c in self._cancels:
            token, where = c.res.token, f"{c.host}:{c.port}"
            if c.reserving is not None:
                if not c.reserving.done:
                    keep.append(c)
                    continue
                reply, copies, c.reserving = c.reserving.parts, c.reserving.copies, None
                if reply is not None and copies == 1:
                    try:
                        ok_of(reply, where)
                    except ValueError:
                        self.m.reservations.release(token)  # P refused it: nothing of it can land
            if c.asking is not None and c.asking.done:
                try:
                    if c.asking.parts is None or len(c.asking.parts) != 1:
                        raise c.asking.error or ValueError("malformed reply")
                    asked = [(k, token) for k in c.ranks]
                    got = cancel_answers_of(decode_bounded(c.asking.parts[0], REPLY_BYTES, f"reply from P at {where}"),
                                            asked)
                    for k, name in zip(c.ranks, c.names):
                        if k in got:
                            self.m.reservations.answered(token, name, *got[k])
                except Exception as exc:  # noqa: BLE001 -- P unreachable or refusing: the span stays held, asked again
                    logger.debug("kvcopy arena: cancel of a push from %s: %s", where, exc)
                c.asking, c.next_at = None, now + CANCEL_EVERY_S
            if not self.m.reservations.holding(token):
                continue
            if c.asking is None and now >= c.next_at:
                question = (CANCEL_MSG, self.engine_id, self.rank, [[k, token] for k in c.ranks])
                c.asking = self.channel.ask(c.host, c.port, msgspec.msgpack.encode(question), REPLY_BYTES)
            keep.append(c)
        self._cancels = keep

    def close(self) -> None:
        self.channel.close()
