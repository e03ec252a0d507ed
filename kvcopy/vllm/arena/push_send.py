"""P's worker serving push (D's ``transfer_mode: "push"``): take reservations, WRITE, answer.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first. P serves pull
and push at once; the mode is D's. Each housekeeping turn (and after each step's
staging) :meth:`PushSender.tick`:

1. takes the reservations and cancels P's side channel got for this rank
   (``TAKE_PUSH_MSG`` to its own scheduler's listener, one question in flight, parked
   there until something comes; its reply calls :attr:`PushSender.wake`, the
   housekeeper's, so the turn that takes it starts at once:
   :mod:`kvcopy.vllm.arena.push_channel`);
2. for a D it has not added (or of another registration), fetches D's kvcopy handshake
   from D's side channel (``GET_META_MSG``, checked by ``add_target``: compatibility,
   digest, key, sizes; a D of another registration replaces the old one), then hands
   each reservation to ``TransferManager.push_writes.accept``, which checks every field before
   NIXL sees any. A refused reservation is logged and answered ``x`` (or ``never`` to
   D's cancel where D could not be added); one whose token this worker took already
   (the listener's resend, D asking again) is dropped quietly. Every reservation taken
   is acknowledged with the next ``TAKE_PUSH_MSG`` (until then the listener keeps it and
   hands it out again: :mod:`kvcopy.vllm.arena.push_channel`, "Delivery"). A reservation naming a registration of D
   other than the one added makes P fetch D's handshake again, and only a handshake
   that changed replaces D's (a stale reservation, sent before D re-registered or
   replayed, is refused; D's live reservations stay);
3. matches each accepted reservation to one of P's requests: the id D named (P's own,
   which the sequential proxy hands D), else the one request P stages or holds with
   the same vLLM base id (concurrent dispatch: D named its own id, which differs from
   P's by the engine's random suffix; two such requests: refused as ambiguous). A
   reservation P cannot match yet waits until D's deadline: under concurrent dispatch
   it usually arrives before P's prefill ends;
4. posts each matched reservation whose request is staged (its record finished: the
   pack and its sums are in the arena) in one WRITE per reservation
   (``push_writes.post``: for equal geometry one descriptor, the record included), and answers
   ``x`` for one whose request P could not stage or aborted. A post that raises (NIXL,
   UCX) is answered ``x`` at once, that reservation alone: the others go on;
5. polls the WRITEs; each one ended is answered ``f``/``x`` by the manager, and counts
   as that D rank done with P's span (:meth:`~kvcopy.vllm.arena.stage.ArenaStager.note_read`):
   P's span lives pack + WRITE, not until D's next message.

**A raise fails what it concerns, never the step's caller** (:meth:`PushSender.step`
runs on the copy thread for the request it just staged, at ``wait_for_save`` and in the
housekeeper, and serves every reservation each time): one while a reservation is
matched, posted or refused answers that reservation ``x``; one while the WRITEs are
polled fails the reservation whose WRITE it concerns (the manager's
:meth:`~kvcopy.nixl.push_writes.PushWrites.poll`: a status check that raises is that
handle's failure); one while an ended reservation is counted as read is logged (P's span
then goes at its time to live). What could still leave ``step`` is of no reservation
(the loop itself): failing the request its caller worked for would fail an innocent one
and keep the cause, so the caller logs it and the next turn tries again; a reservation
never served fails at its deadline (P's poll answers ``x``; where that poll is what
raises, D's own deadline and its ``CANCEL``, which :meth:`PushSender.tick` answers
outside ``step``).

A cancel whose reservation was not posted is answered ``x`` at once; one in flight is
answered when its WRITE ends. Each cancel's answer (``never``/``ended``/``in_flight``)
also goes back to P's listener with the next ``TAKE_PUSH_MSG``, which answers D's
cancels with it (:mod:`kvcopy.vllm.arena.push_channel`). Reservations not posted by
their own timeout are answered ``x`` by the manager.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Set, Tuple

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id
from vllm.logger import init_logger

from ...nixl.manager import TransferManager
from ...nixl.wire.record import StagedRequest
from .channel import pushes_of
from .meta import agent_name
from .push_channel import ANSWERS_PER_TAKE, MAX_ACKS, MAX_TAKE_REPLY, TAKE_WAIT_MS, take_question
from .push_chunks import ChunkPoster
from .record_client import Fetch, Reply, SideChannel
from .stage import ArenaStager, namesakes
from .stats import PullStats

logger = init_logger("vllm.kvcopy")

FETCH_TIMEOUT_S = 10.0  # D's handshake, fetched from D's side channel
# How often P's housekeeper reaps its WRITEs in flight (:attr:`PushSender.poll_s`). NIXL
# sends D's notification (``f``, a chunk's ``c``) only once P's own status check sees a
# WRITE DONE, and an idle P engine does not step. A final WRITE, or a D's handshake on its
# way (its reservations wait for it): every WRITE_POLL_S (a loopback WRITE of a few MiB
# takes 1-3 ms; one posted right after a notice to the same D stays in flight past its
# post: NIXL's UCX WRITE ends with a flush of the endpoint, a round trip to D, 0.05-0.8 ms:
# docs/vllm.md). Chunk WRITEs only (a layer-wise push while P's forward runs): every
# CHUNK_POLL_S. A chunk's ``c`` lets D scatter it before the prefill ends, so a few ms
# late costs D nothing, while each poll takes P's CPU (and the GIL) from the forward.
WRITE_POLL_S = 0.001
CHUNK_POLL_S = 0.01
MAX_STALE = 64  # registrations of one D remembered as stale (refused without fetching D's handshake again)


class PushSender:
    """One P rank's pushes (module docstring). Not thread-safe: the worker serializes
    every call with its lock."""

    def __init__(self, manager: TransferManager, stager: ArenaStager, channel: SideChannel,
                 listener: Tuple[str, int], tp_rank: int, stats: PullStats):
        self.m, self.stager, self.channel, self.stats = manager, stager, channel, stats
        self.listener, self.rank = listener, tp_rank
        self._asking: Optional[Reply] = None  # the parked TAKE_PUSH (the long-poll)
        self._telling: Optional[Reply] = None  # a TAKE_PUSH of wait 0 bringing answers made meanwhile
        self._fetching: Dict[str, Tuple[Fetch, List[tuple]]] = {}  # D agent -> (its handshake fetch, work waiting)
        self._generation: Dict[str, str] = {}  # D agent -> the registration added
        self._handshake: Dict[str, bytes] = {}  # D agent -> the handshake bytes added
        self._stale: Dict[str, Set[str]] = {}  # D agent -> registrations named after its handshake said otherwise
        self._answers: List[Tuple[bytes, str]] = []  # cancels answered, for the listener (next TAKE_PUSH)
        self._acks: List[bytes] = []  # tokens of the reservations taken, acknowledged with the next TAKE_PUSH
        self._waiting: Dict[bytes, str] = {}  # accepted, not posted: token -> the request id D named
        self._matched: Dict[bytes, str] = {}  # waiting tokens matched to P's request by base id
        self._readers: Dict[bytes, int] = {}  # accepted: token -> D's TP size
        self._posted: Dict[bytes, Tuple[float, float, int, int]] = {}  # token -> (before post, after, bytes, descs)
        self.refused = 0  # reservations refused (logged)
        self.ambiguous = 0  # of which: refused because several of P's requests share their base id
        self.final_posts = 0  # final WRITEs posted (chunks: ChunkPoster.posted)
        self.chunks = ChunkPoster(manager)  # a layer-wise request's units pushed in its last step
        self.wake: Optional[Callable[[], None]] = None  # the housekeeper's: a reply to TAKE_PUSH came

    def tick(self) -> None:
        self._take()
        self._targets_in()
        self.step()

    def step(self) -> None:
        """Post what is staged, answer what will not be, notify what ended. A raise for
        one reservation fails it alone (a post's: :meth:`_post`; matching or refusing it:
        answered ``x`` here; polling its WRITEs: the manager's ``poll``); the step goes on
        (module docstring)."""
        for token, named in list(self._waiting.items()):
            try:
                self._serve(token, named)
            except Exception:  # noqa: BLE001 -- this reservation's: x, the others go on
                logger.exception("kvcopy arena: %s: serving the reservation for request %s failed (answered x)",
                                 self.m.name, named[:80])
                self._waiting.pop(token, None)
                self._matched.pop(token, None)
                self.m.push_writes.refuse(token)
        self._reap()

    def _serve(self, token: bytes, named: str) -> None:
        """One waiting reservation: posted when its request is staged, refused when it failed."""
        rid = self._matched.get(token) or self._match(token, named)
        if rid is None:
            return  # not here yet (concurrent dispatch), or refused as ambiguous
        record = self.stager.records.get(rid)
        if record is not None:
            del self._waiting[token]
            self._matched.pop(token, None)
            self._post(token, named, rid, record)
        elif rid in self.stager.failures:
            self._refuse(token)

    def _post(self, token: bytes, named: str, rid: str, record: StagedRequest) -> None:
        """The final WRITE of one reservation. One that raises is answered ``x`` by the
        manager (once none of its chunk WRITEs is in flight; its span's WRITE mark given
        back) and logged; it never reaches the caller, so the other reservations of the
        step, of this request or another, are posted all the same."""
        t0 = time.monotonic()
        try:
            nbytes, descs = (self.m.push_writes.post(token, record) if rid == named
                             else self.m.push_writes.post(token, record, staged_as=rid))
        except ValueError as exc:  # answered x by the manager
            logger.warning("kvcopy arena: pushing request %s failed: %s", rid, exc)
            return
        except Exception:  # noqa: BLE001 -- NIXL or UCX raising: this reservation only, x now (not at D's deadline)
            logger.exception("kvcopy arena: %s: posting the WRITE of request %s failed (answered x)", self.m.name, rid)
            self.m.push_writes.refuse(token)
            return
        self._posted[token] = (t0, time.monotonic(), nbytes, descs)
        self.final_posts += 1

    def quick(self) -> None:
        """The housekeeper's hurried turn (while :attr:`urgent`): D's handshakes that came
        are taken in, WRITEs that ended answered; matching and posting wait for the whole
        turn or the next step (matching costs a pass over P's requests per reservation)."""
        if self._fetching:
            self._targets_in()
        self._reap()

    def _reap(self) -> None:
        self.m.push_writes.poll()  # a raise for one reservation fails it there; the poll goes on
        for token, rid, target in self.m.push_writes.take_closed():
            self._waiting.pop(token, None)
            self._matched.pop(token, None)
            d_tp = self._readers.pop(token, None)
            posted = self._posted.pop(token, None)
            try:
                if posted is not None:  # as vLLM's push connector reports its WRITEs, on P
                    self.stats.record(time.monotonic() - posted[0], posted[1] - posted[0], posted[2], posted[3])
                if d_tp is not None:
                    self.stager.note_read(rid, target, d_tp)
            except Exception:  # noqa: BLE001 -- answered already: the others are counted all the same
                logger.exception("kvcopy arena: %s: counting %s's reservation of request %s as read failed (its "
                                 "span goes at its time to live)", self.m.name, target, rid[:80])

    def _match(self, token: bytes, named: str) -> Optional[str]:
        """The request of this P a reservation naming ``named`` is for: ``named`` itself
        when P knows it (D had P's id: the sequential proxy), else the one request P knows
        whose vLLM base id (:func:`get_base_request_id`: the engine's random suffix
        stripped) is ``named``'s (D named its own id: concurrent dispatch). None while P
        knows none: the reservation waits (until its deadline), as P may get the request
        after D. Two or more: refused as ambiguous (``x``; D recomputes). A base match is
        kept for the reservation's life, so a later namesake cannot change it."""
        known = self.stager.known()
        if named in known or named in self.stager.failures:
            return named
        hits = namesakes(named, known)
        if not hits:  # failed here: answered at once, not at D's deadline
            hits = namesakes(named, self.stager.failures)[-1:]
        if len(hits) > 1:
            del self._waiting[token]
            self.refused += 1
            self.ambiguous += 1
            logger.warning("kvcopy arena: %s: reservation for request %s refused: P has %d requests with its "
                           "base id %s", self.m.name, named[:80], len(hits), get_base_request_id(named)[:80])
            self.m.push_writes.refuse(token)
            return None
        if hits:
            self._matched[token] = hits[0]
            return hits[0]
        return None

    def _take(self) -> None:
        for asking in (self._asking, self._telling):
            if asking is None or not asking.done:
                continue
            if asking is self._asking:
                self._asking = None
            else:
                self._telling = None
            try:
                if asking.parts is None:
                    raise asking.error or RuntimeError("no reply")
                reserve, cancel = pushes_of(asking.parts)
            except Exception as exc:  # noqa: BLE001 -- this engine's own side channel: logged, asked again
                logger.warning("kvcopy arena: %s: taking reservations from this engine's side channel: %s",
                               self.m.name, exc)
                reserve, cancel = [], []
            for d, item in reserve:
                self._acks.append(item[0])
                self._reservation(d, item)
            for d_engine, d_rank, token in cancel:
                self._cancel(agent_name(d_engine, d_rank), token)
        if self._asking is None:
            # answers left over: this question is not parked, so the next one goes at the next turn
            self._asking = self._ask(0 if len(self._answers) > ANSWERS_PER_TAKE else TAKE_WAIT_MS)
        elif self._answers and self._telling is None:
            # answers made while the take is parked (_targets_in): the listener answers a take
            # of wait 0 at once and leaves the parked one parked (up to TAKE_WAIT_MS)
            self._telling = self._ask(0)

    def _ask(self, wait_ms: int) -> Reply:
        """A TAKE_PUSH with the cancel answers that fit, parked up to ``wait_ms`` at the listener."""
        host, port = self.listener
        question = take_question(self.rank, self.m.info.generation, self._answers, wait_ms, self._acks)
        del self._answers[:ANSWERS_PER_TAKE]  # one lost with its question: D asks again
        del self._acks[:MAX_ACKS]  # one lost with its question: the listener hands its reservation out again
        return self.channel.ask(host, port, msgspec.msgpack.encode(question), MAX_TAKE_REPLY, self._woken)

    def _woken(self) -> None:
        if self.wake is not None:
            self.wake()

    def _reservation(self, d: tuple, item: tuple) -> None:
        d_engine, d_rank, d_tp, d_host, d_port, d_generation = d
        name = agent_name(d_engine, d_rank)
        if self.m.push_writes.known(item[0]) or any(w[2][0] == item[0] for w in self._fetching.get(name, (0, []))[1]):
            # taken already: the listener's resend of a reply that may have been lost, or D
            # asking again after no answer in time (kvcopy.vllm.arena.push_channel, "Delivery");
            # accept would refuse it and the refusal answers nothing: the first goes on untouched
            logger.debug("kvcopy arena: %s: reservation of %s for request %s taken already", self.m.name, name,
                         str(item[1])[:80])
            return
        if name not in self._fetching and (self._generation.get(name) == d_generation
                                           or d_generation in self._stale.get(name, ())):
            self._accept(name, d_generation, d_tp, item)
            return
        if name not in self._fetching:
            self.channel.forget(d_engine, [d_rank])
            self._fetching[name] = (self.channel.fetch(d_engine, d_host, d_port, "", [d_rank], FETCH_TIMEOUT_S,
                                                       records=False), [])
        self._fetching[name][1].append((d_generation, d_tp, item))

    def _cancel(self, name: str, token: bytes) -> None:
        waiting = self._fetching.get(name)
        if waiting is not None and any(w[2][0] == token for w in waiting[1]):
            waiting[1][:] = [w for w in waiting[1] if w[2][0] != token] + [(None, 0, (token,))]
            return  # answered once D's handshake is in
        self._answers.append((token, self.m.push_writes.cancel(token, name if name in self._generation else None)))

    def _targets_in(self) -> None:
        """Add the D handshakes fetched, then take the work that waited for them."""
        for name, (fetch, work) in list(self._fetching.items()):
            if not fetch.done:
                continue
            del self._fetching[name]
            try:
                if fetch.error is not None:
                    raise fetch.error
                (md,) = fetch.metadata.values()
                if self._handshake.get(name, md) != md:  # D registered anew: its old endpoint goes
                    self.m.remove_target(name)
                    del self._generation[name], self._handshake[name]
                if name not in self._generation:  # else the same registration: a stale reservation, refused below
                    got = self.m.add_target(md)
                    if got != name:
                        self.m.remove_target(got)
                        raise ValueError(f"D's side channel answered with {got!r}, expected {name!r}")
                    self._generation[name] = self.m.push_writes.targets()[name].generation
                    self._handshake[name] = md
            except Exception as exc:  # noqa: BLE001 -- a D P cannot add: its reservations are refused
                self.refused += sum(g is not None for g, _, _ in work)
                logger.warning("kvcopy arena: %s: D %s's handshake not added (%d reservations refused): %s",
                               self.m.name, name, len(work), exc)
                for generation, _, item in work:
                    if generation is None:
                        self._answers.append((item[0], self.m.push_writes.cancel(item[0])))
                    else:
                        self.m.push_writes.refused(item[0], None)
                continue
            stale = self._stale.setdefault(name, set())
            if len(stale) > MAX_STALE:
                stale.clear()
            stale.update(g for g, _, _ in work if g is not None and g != self._generation[name])
            for generation, d_tp, item in work:
                if generation is None:  # a cancel that came while the handshake was on its way
                    self._answers.append((item[0], self.m.push_writes.cancel(item[0], name)))
                else:
                    self._accept(name, generation, d_tp, item)

    def _accept(self, name: str, generation: str, d_tp: int, item: tuple) -> None:
        try:
            token = self.m.push_writes.accept(name, generation, item)
        except ValueError as exc:
            self.refused += 1
            logger.warning("kvcopy arena: %s: reservation of %s for request %s refused: %s", self.m.name, name,
                           str(item[1])[:80], exc)
            self.m.push_writes.refused(item[0], name)
            return
        self._waiting[token] = item[1]
        self._readers[token] = d_tp
        rid = item[1] if item[1] in self.chunks.parts else self._match(token, item[1])
        if rid is not None:
            self.chunks.accepted(token, rid)

    def _refuse(self, token: bytes) -> None:
        """Drop an accepted reservation not posted and answer it ``x`` (once none of its
        chunk WRITEs is in flight)."""
        del self._waiting[token]
        self._matched.pop(token, None)
        self.m.push_writes.refuse(token)

    def tokens_for(self, rid: str) -> List[bytes]:
        """The reservations accepted for P's request ``rid`` (matched as :meth:`_match`
        does) and not posted yet."""
        return [t for t, named in list(self._waiting.items())
                if named == rid or (t in self._waiting and (self._matched.get(t) or self._match(t, named)) == rid)]

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._fetching)

    @property
    def writes_posted(self) -> int:
        """WRITEs posted so far, final ones and chunks: the housekeeper's fast poll restarts
        when this changed."""
        return self.final_posts + self.chunks.posted

    @property
    def awaited(self) -> bool:
        """Whether a final WRITE posted and not seen ended, or a D's handshake on its way,
        is in flight: what D waits for at once (not only chunks during P's forward)."""
        return bool(self._posted or self._fetching)

    @property
    def poll_s(self) -> Optional[float]:
        """How soon the housekeeper should turn again (None: nothing in flight):
        :attr:`awaited`, :data:`WRITE_POLL_S`; only chunk WRITEs (posted by the copy
        thread), :data:`CHUNK_POLL_S`."""
        if self.awaited:
            return WRITE_POLL_S
        return CHUNK_POLL_S if self.m.push_writes.writing else None

    @property
    def urgent(self) -> bool:
        """Whether anything is in flight that the housekeeper polls (:attr:`poll_s`)."""
        return self.poll_s is not None

