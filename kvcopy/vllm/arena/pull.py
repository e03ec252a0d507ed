"""D's worker in the arena connector: fetch, plan, pull, complete; report every outcome.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first.

A request to pull (:class:`~kvcopy.vllm.arena.meta.ArenaRecv`) goes through these states,
one :class:`_Job` each, advanced by :meth:`ArenaPuller.step` in the engine thread (the
``TransferManager`` is driven under the worker's lock, :mod:`kvcopy.vllm.arena.connector`):

1. **fetch** (:mod:`kvcopy.vllm.arena.record_client`: one thread, every question in flight at
   once): for each P rank this rank reads (:func:`kvcopy.nixl.remote_ranks`), P's kvcopy
   handshake over P's side channel (once per P rank; again after a failed pull, in case
   P restarted), then P's records for the request, asked again while P says ``pending``
   (still staging: P's arena full), until ``fetch_timeout_s`` from the request's start;
2. **plan**: ``add_peer`` for handshakes not added yet (checked there), then
   ``plan_pull(P ranks, records, tokens, D's token-anchored blocks, D's prefix hit per
   group, request_id=P's request id)``: a record of another request, engine, rank or
   registration is refused; one of an earlier registration of P (P restarted) makes D
   fetch P's handshake again, once. A full arena on D is back-pressure: retried every
   step until the same deadline; with ``require_checksum`` a pull whose pages cannot be
   compared is refused here;
3. **pull**: one NIXL READ per P rank (one descriptor for equal geometry), carrying the
   notification that tells P this reader is done; its deadline is ``pull_timeout_s`` or
   what is left of P's span lifetime, whichever is shorter (a READ must end before P may
   hand the span to another request);
4. **complete**: ``poll`` until ``DONE``/``ERR``, then ``complete``: zero and scatter into
   D's pages in one masked copy (enqueued on the current stream, no host wait), or, for
   a failed pull, nothing written (arena mode: a failed READ only ever lands in D's span).
   With ``checksum`` (the default) the scatter's page sums are compared with the ones P's
   record carries; on CUDA the request is reported at the first step after they reached
   host memory (``Completion.ready``), never by waiting, and a mismatch fails it.

Every request the scheduler waits for ends in ``finished_recving``; one that did not
complete ``ok`` (whatever the cause: a refused handshake or record, P's failure to stage,
an expired span, a deadline, a dead P, a ``Completion(ok=False)`` of any kind) also in
``failed_recving``, and, for single-group models (vLLM refuses block ids otherwise), its
blocks in ``get_block_ids_with_load_errors``: vLLM's scheduler recomputes it.

**Giving up.** D tells P about every request it will not read, so P frees the span at
once instead of at its TTL: a notification ``GAVE_UP`` to each P rank over NIXL where D
holds that rank's handshake (added now if it was fetched and passes ``add_peer``), else
a give-up question over P's side channel (P's scheduler hands it to its workers at its
next step). Requests D needs nothing of (a full prefix hit, an abort before scheduling)
are given up the same way; where the handshake is not cached yet, it is fetched first
and the notification sent by the worker's housekeeping thread (:meth:`ArenaPuller.tick`),
without waiting for D to step. A pull that failed after its READ was posted has told P
already (the manager notifies every peer of a failed pull).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from vllm.logger import init_logger

from ...nixl import ArenaFull, NO_BLOCK, StaleRegistration, remote_ranks
from ...nixl.manager import TransferManager
from ...nixl.planning.plan import Plan
from ...nixl.pull import Completion, PullHandle
from .record_client import Fetch, SideChannel
from ..config import ArenaOptions
from .meta import GAVE_UP, ArenaRecv, agent_name, notify_bytes
from .stats import PullStats
from ..groups import GroupTokens

logger = init_logger("vllm.kvcopy")


@dataclass
class _Job:
    rid: str
    recv: ArenaRecv
    ranks: List[int]
    deadline: float  # fetch + D's arena space
    fetch: Optional[Fetch] = None
    plan: Optional[Plan] = None
    handle: Optional[PullHandle] = None
    completion: Optional[Completion] = None  # completed; on CUDA its checksum verdict may still be on the way
    posted: Tuple[float, float] = (0.0, 0.0)  # monotonic: before the READ was posted, after
    blocks: Tuple[int, ...] = field(default=())  # D's blocks, for load errors
    refetched: bool = False  # P's handshake fetched again after a record of a newer registration


class ArenaPuller:
    """One D rank's pulls (see the module docstring). Not thread-safe: the worker
    serializes every call with its lock."""

    def __init__(self, manager: TransferManager, options: ArenaOptions, tokens: GroupTokens, tp_rank: int,
                 tp_size: int, total_kv_heads: Optional[int], compat: str, single_group: bool,
                 key: Optional[bytes] = None):
        self.m = manager
        self.opts = options
        self.tokens = tokens
        self.rank, self.tp, self.heads = tp_rank, tp_size, total_kv_heads
        self.single_group = single_group
        self.jobs: Dict[str, _Job] = {}
        self.giving_up: Dict[str, _Job] = {}  # requests D will not read, waiting for P's handshake to say so
        self.finished: Set[str] = set()
        self.failed: Set[str] = set()
        self.error_blocks: Set[int] = set()
        self.stats = PullStats()  # vLLM's NIXL connector stats, for its logging and metrics
        self._added: Dict[str, bytes] = {}  # peer name -> the handshake bytes add_peer took
        self.channel = SideChannel(key, compat)

    # ------------------------------------------------------------ start
    def start(self, recv: Dict[str, ArenaRecv]) -> None:
        now = time.monotonic()
        for rid, r in recv.items():
            if rid in self.jobs or rid in self.giving_up:
                logger.warning("kvcopy arena: request %s is already being pulled; ignored", rid)
                continue
            ranks = remote_ranks(self.rank, self.tp, r.remote_tp_size, self.heads) if r.error is None else []
            job = _Job(rid, r, ranks, now + self._timeout_s())
            if r.positions is not None:
                job.blocks = tuple(b for g in r.positions for b in g if b != NO_BLOCK)
            if r.error is not None:
                self.jobs[rid] = job
                self._fail(job, r.error)
            elif r.positions is None:  # nothing to read (a full prefix hit, an abort): P may free it now
                self._give_up(job, "D needs nothing of it")
            else:
                self.jobs[rid] = job
                job.fetch = self.channel.fetch(r.engine_id, r.host, r.port, r.remote_request_id, ranks,
                                               self._timeout_s(), records=self.wants_records)

    wants_records = True  # a pull fetches P's records; a push only P's handshakes

    def _timeout_s(self) -> float:
        """A request's deadline for fetching and D's arena space, from its start."""
        return self.opts.fetch_timeout_s

    # ------------------------------------------------------------ step
    def step(self) -> None:
        now = time.monotonic()
        for job in list(self.jobs.values()):
            try:
                self._advance(job, now)
            except Exception as exc:  # noqa: BLE001 -- any failure fails the request (recomputed), never the engine
                self._fail(job, f"{type(exc).__name__}: {exc}")
        self.tick()

    def tick(self) -> None:
        """Give-ups whose handshake fetch ended: tell P now (no engine step needed)."""
        for job in list(self.giving_up.values()):
            if job.fetch is None or job.fetch.done:
                del self.giving_up[job.rid]
                try:
                    self._tell_p(job)
                except Exception as exc:  # noqa: BLE001 -- P's TTL still frees the span; the engine goes on
                    logger.info("kvcopy arena: telling P that request %s is given up failed: %s", job.rid, exc)

    def _advance(self, job: _Job, now: float) -> None:
        if job.handle is not None:
            if job.completion is None:
                if self.m.poll(job.handle) == "PROC":
                    return
                job.completion = self.m.complete(job.handle)
            self._land(job, "pull")
            return
        if job.plan is None:
            assert job.fetch is not None
            if not job.fetch.done:
                return
            if job.fetch.error is not None:
                raise job.fetch.error
            self._add_peers(job.recv.engine_id, job.fetch.metadata, replace=job.refetched)
            try:
                job.plan = self._plan(job)
            except ArenaFull as exc:
                if exc.ever_fits and now < job.deadline:
                    return  # back-pressure: D's own completions free space
                raise
            except StaleRegistration:
                if job.refetched:
                    raise
                job.refetched = True  # P restarted since its handshake was cached: once more, afresh
                self.channel.forget(job.recv.engine_id, job.ranks)
                r = job.recv
                job.fetch = self.channel.fetch(r.engine_id, r.host, r.port, r.remote_request_id, job.ranks,
                                               max(0.0, job.deadline - now))
                return
        self._pull(job, now)

    def _land(self, job: _Job, what: str) -> None:
        """Report a completed request once its verdict is in host memory."""
        done = job.completion
        assert done is not None
        if not done.ready:  # the scatter's page sums are still on their way from the GPU: never wait
            return
        if done.ok:
            self._finish(job)
        else:
            self._fail(job, f"{what} failed: {done.error}")

    def _add_peers(self, engine_id: str, metadata: Dict[int, bytes], replace: bool = False) -> None:
        """``add_peer`` the handshakes of P ranks not added yet; with ``replace`` (the
        handshakes were just fetched again because a record named a newer registration),
        also those added with other bytes. Without it an added peer stays: another
        request's fetch may hold handshake bytes older than what is added, and the
        record decides (``StaleRegistration``, then this request fetches afresh)."""
        for rank, md in metadata.items():
            name = agent_name(engine_id, rank)
            if name in self._added and (self._added[name] == md or not replace):
                continue
            if name in self._added:  # P re-registered (restarted): its old NIXL metadata is stale
                self.m.remove_peer(name)
                del self._added[name]
            got = self.m.add_peer(md)
            if got != name:
                self.m.remove_peer(got)
                raise ValueError(f"P's side channel answered for TP rank {rank} with peer {got!r}, expected {name!r}")
            self._added[name] = md

    def _plan(self, job: _Job) -> Plan:
        r, f = job.recv, job.fetch
        assert f is not None and f.reply is not None and r.positions is not None
        peers = [agent_name(r.engine_id, rank) for rank in job.ranks]
        records = {agent_name(r.engine_id, rank): f.reply.records[rank] for rank in job.ranks}
        return self.m.plan_pull(peers, records, r.num_tokens, [list(g) for g in r.positions], list(r.cached_tokens),
                                request_id=r.remote_request_id)

    def _pull(self, job: _Job, now: float) -> None:
        f = job.fetch
        assert f is not None and f.reply is not None and job.plan is not None
        timeout = f.reply.ttl_left - (now - f.asked)
        if self.opts.manager.pull_timeout_s is not None:  # (the connector's options refuse None)
            timeout = min(timeout, self.opts.manager.pull_timeout_s)
        if timeout <= 0:
            self.m.discard(job.plan)
            job.plan = None
            raise TimeoutError("P's span expires before a READ could end")
        t0 = time.monotonic()
        job.handle = self.m.pull(job.plan, notify=notify_bytes(job.recv.remote_request_id, self.tp), timeout_s=timeout)
        job.posted = (t0, time.monotonic())

    # ------------------------------------------------------------ outcomes
    def _finish(self, job: _Job) -> None:
        del self.jobs[job.rid]
        if job.plan is not None:
            self.stats.record(time.monotonic() - job.posted[0], job.posted[1] - job.posted[0], job.plan.num_bytes,
                              getattr(job.plan, "num_descriptors", 0))  # an ArenaPlan's
        self.finished.add(job.rid)

    def _fail(self, job: _Job, reason: str) -> None:
        self.jobs.pop(job.rid, None)
        if job.plan is not None and job.handle is None:
            self.m.discard(job.plan)
            job.plan = None
        self.channel.forget(job.recv.engine_id, job.ranks)  # ask P for its handshake again: it may have restarted
        if job.handle is None and job.ranks:  # no READ told P: D gives the request up
            self._give_up(job, reason)
        if not job.recv.awaiting:
            logger.info("kvcopy arena: request %s (nothing to read) failed: %s", job.rid, reason)
            return
        logger.warning("kvcopy arena: pulling request %s from %s failed, vLLM recomputes it: %s", job.rid,
                       job.recv.engine_id, reason)
        self.stats.record_failed()
        self.finished.add(job.rid)
        self.failed.add(job.rid)
        if self.single_group:
            self.error_blocks.update(job.blocks)

    def _give_up(self, job: _Job, reason: str) -> None:
        """Tell every P rank of ``job`` that this reader will not read it (module docstring)."""
        job.plan = job.handle = None
        r = job.recv
        if all(agent_name(r.engine_id, k) in self._added for k in job.ranks) or (job.fetch is not None
                                                                                 and job.fetch.done):
            self._tell_p(job)
            return
        if job.fetch is None:  # fetch P's handshakes, then tell P (tick)
            job.fetch = self.channel.fetch(r.engine_id, r.host, r.port, r.remote_request_id, job.ranks,
                                           self.opts.fetch_timeout_s, records=False)
        logger.debug("kvcopy arena: giving request %s up once P's handshake is in (%s)", job.rid, reason)
        self.giving_up[job.rid] = job

    def _tell_p(self, job: _Job) -> None:
        r = job.recv
        unreached = []
        msg = notify_bytes(r.remote_request_id, self.tp, GAVE_UP)
        known = dict(job.fetch.metadata) if job.fetch is not None else {}
        for k in job.ranks:
            name = agent_name(r.engine_id, k)
            if name not in self._added and k in known:
                try:
                    self._add_peers(r.engine_id, {k: known[k]})
                except Exception as exc:  # noqa: BLE001 -- a handshake D refuses: P is told another way
                    logger.debug("kvcopy arena: P rank %d's handshake refused (%s)", k, exc)
            if name in self._added:
                self.m.notify(name, msg)
            else:
                unreached.append(k)
        if unreached:
            self.channel.give_up(r.host, r.port, r.remote_request_id, unreached, self.m.name, self.tp)

    def results(self) -> Tuple[Set[str], Set[str]]:
        """(finished_recving, failed_recving) since the last call."""
        out = (self.finished, self.failed)
        self.finished, self.failed = set(), set()
        return out

    def take_error_blocks(self) -> Set[int]:
        out, self.error_blocks = self.error_blocks, set()
        return out

    def close(self) -> None:
        """Stop the side-channel client (exchanges in flight are dropped)."""
        self.channel.close()
