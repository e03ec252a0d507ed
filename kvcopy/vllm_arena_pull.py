"""D's worker in the arena connector: fetch, plan, pull, complete; report every outcome.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first.

A request to pull (:class:`~kvcopy.vllm_arena_meta.ArenaRecv`) goes through these states,
one :class:`_Job` each, advanced once per step by :meth:`ArenaPuller.step` (the engine
thread: the ``TransferManager`` is driven from that thread only):

1. **fetch** (a background thread; network only): for each P rank this rank reads
   (:func:`kvcopy.nixl.remote_ranks`), P's kvcopy handshake over P's side channel (once
   per P rank; again after a failed pull, in case P restarted), then P's records for
   the request (:func:`kvcopy.vllm_arena_channel.fetch_records`), asked again while P
   says ``pending`` (still staging: P's arena full), until ``fetch_timeout_s`` from the
   request's start;
2. **plan**: ``add_peer`` for handshakes not added yet (checked there), then
   ``plan_pull(P ranks, records, tokens, D's token-anchored blocks, D's prefix hit per
   group)``; a full arena on D is back-pressure: retried every step until the same
   deadline;
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
blocks in ``get_block_ids_with_load_errors``: vLLM's scheduler recomputes it. Requests D
needs nothing of (a full prefix hit, an abort before scheduling) are pulled with nothing
to read, which only sends P the notification that frees its span; their failures are
logged, not reported.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

import zmq
from vllm.logger import init_logger

from .nixl import ArenaFull, NO_BLOCK, remote_ranks
from .nixl.manager import TransferManager
from .nixl.plan import Plan
from .nixl.pull import Completion, PullHandle
from .vllm_affinity import pin_current_thread
from .vllm_arena_stats import PullStats
from .vllm_arena_channel import fetch_metadata, fetch_records
from .vllm_arena_meta import ArenaOptions, ArenaRecv, agent_name, notify_bytes
from .vllm_groups import GroupTokens

logger = init_logger("vllm.kvcopy")

FETCH_THREADS = 4
EXCHANGE_TIMEOUT_S = 5.0  # one question to P's side channel
POLL_MIN_S, POLL_MAX_S = 0.002, 0.05  # asking again while P says "pending"


@dataclass(frozen=True)
class _Fetched:
    metadata: Dict[int, bytes]  # P rank -> handshake bytes
    records: Dict[int, bytes]  # P rank -> record wire bytes
    ttl_left: float  # of P's spans, from `asked`
    asked: float  # monotonic, before the question that got the records


@dataclass
class _Job:
    rid: str
    recv: ArenaRecv
    ranks: List[int]
    deadline: float  # fetch + D's arena space
    future: Optional[Future] = None
    fetched: Optional[_Fetched] = None
    plan: Optional[Plan] = None
    handle: Optional[PullHandle] = None
    completion: Optional[Completion] = None  # completed; on CUDA its checksum verdict may still be on the way
    posted: Tuple[float, float] = (0.0, 0.0)  # monotonic: before the READ was posted, after
    blocks: Tuple[int, ...] = field(default=())  # D's blocks, for load errors


class ArenaPuller:
    """One D rank's pulls (see the module docstring)."""

    def __init__(self, manager: TransferManager, options: ArenaOptions, tokens: GroupTokens, tp_rank: int,
                 tp_size: int, total_kv_heads: Optional[int], compat: str, single_group: bool,
                 thread_cpus: Optional[FrozenSet[int]] = None):
        self.m = manager
        self.opts = options
        self.tokens = tokens
        self.rank, self.tp, self.heads = tp_rank, tp_size, total_kv_heads
        self.compat = compat
        self.single_group = single_group
        self.jobs: Dict[str, _Job] = {}
        self.finished: Set[str] = set()
        self.failed: Set[str] = set()
        self.error_blocks: Set[int] = set()
        self.stats = PullStats()  # vLLM's NIXL connector stats, for its logging and metrics
        self._added: Dict[str, bytes] = {}  # peer name -> the handshake bytes add_peer took
        self._metadata: Dict[Tuple[str, int], bytes] = {}  # (engine, P rank) -> handshake bytes, shared
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._zmq = zmq.Context()
        # Fetch threads (and ZMQ's I/O thread they start) off the model's cores: kvcopy.vllm_affinity
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="kvcopy-arena-fetch",
                                        initializer=pin_current_thread, initargs=(thread_cpus,))

    # ------------------------------------------------------------ start
    def start(self, recv: Dict[str, ArenaRecv]) -> None:
        now = time.monotonic()
        for rid, r in recv.items():
            if rid in self.jobs:
                logger.warning("kvcopy arena: request %s is already being pulled; ignored", rid)
                continue
            ranks = remote_ranks(self.rank, self.tp, r.remote_tp_size, self.heads) if r.error is None else []
            job = _Job(rid, r, ranks, now + self.opts.fetch_timeout_s)
            if r.positions is not None:
                job.blocks = tuple(b for g in r.positions for b in g if b != NO_BLOCK)
            self.jobs[rid] = job
            if r.error is not None:
                self._fail(job, r.error)
                continue
            job.future = self._pool.submit(self._fetch, r, ranks, job.deadline)

    def _fetch(self, r: ArenaRecv, ranks: List[int], deadline: float) -> _Fetched:
        """Background thread: handshakes (cached) and the records, network only."""
        metadata = {}
        for rank in ranks:
            with self._lock:
                md = self._metadata.get((r.engine_id, rank))
            if md is None:
                md = fetch_metadata(self._zmq, r.host, r.port, rank, self._left(deadline), self.compat)
                with self._lock:
                    self._metadata[(r.engine_id, rank)] = md
            metadata[rank] = md
        wait = POLL_MIN_S
        while not self._stop.is_set():
            asked = time.monotonic()
            reply = fetch_records(self._zmq, r.host, r.port, r.remote_request_id, ranks, self._left(deadline))
            if reply.state == "ready":
                return _Fetched(metadata, reply.records, reply.ttl_left, asked)
            if reply.state != "pending":
                raise RuntimeError(f"P {reply.state}: {reply.error}")
            if time.monotonic() + wait >= deadline:
                raise TimeoutError(f"P did not stage the request within {self.opts.fetch_timeout_s:g} s")
            time.sleep(wait)
            wait = min(2 * wait, POLL_MAX_S)
        raise RuntimeError("the connector is shutting down")

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no records from P within {self.opts.fetch_timeout_s:g} s")
        return min(left, EXCHANGE_TIMEOUT_S)

    # ------------------------------------------------------------ step
    def step(self) -> None:
        now = time.monotonic()
        for job in list(self.jobs.values()):
            try:
                self._advance(job, now)
            except Exception as exc:  # noqa: BLE001 -- any failure fails the request (recomputed), never the engine
                self._fail(job, f"{type(exc).__name__}: {exc}")

    def _advance(self, job: _Job, now: float) -> None:
        if job.handle is not None:
            if job.completion is None:
                if self.m.poll(job.handle) == "PROC":
                    return
                job.completion = self.m.complete(job.handle)
            done = job.completion
            if not done.ready:  # the scatter's page sums are still on their way from the GPU: never wait
                return
            if done.ok:
                self._finish(job)
            else:
                self._fail(job, f"pull failed: {done.error}")
            return
        if job.fetched is None:
            assert job.future is not None
            if not job.future.done():
                return
            job.fetched = job.future.result()  # raises the fetch's failure
            self._add_peers(job)
        if job.plan is None:
            try:
                job.plan = self._plan(job)
            except ArenaFull as exc:
                if exc.ever_fits and now < job.deadline:
                    return  # back-pressure: D's own completions free space
                raise
        self._pull(job, now)

    def _add_peers(self, job: _Job) -> None:
        assert job.fetched is not None
        for rank, md in job.fetched.metadata.items():
            name = agent_name(job.recv.engine_id, rank)
            if self._added.get(name) == md:
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
        r, f = job.recv, job.fetched
        assert f is not None
        peers = [agent_name(r.engine_id, rank) for rank in job.ranks]
        records = {agent_name(r.engine_id, rank): f.records[rank] for rank in job.ranks}
        if r.positions is None:  # nothing to read: a plan of holes only sends P the notification
            local = [[NO_BLOCK] * -(-r.num_tokens // t) for t in self.tokens.tokens_per_block]
            return self.m.plan_pull(peers, records, r.num_tokens, local, r.num_tokens)
        return self.m.plan_pull(peers, records, r.num_tokens, [list(g) for g in r.positions],
                                list(r.cached_tokens))

    def _pull(self, job: _Job, now: float) -> None:
        f = job.fetched
        assert f is not None
        left = f.ttl_left - (now - f.asked)
        timeout = min(self.opts.pull_timeout_s, left)
        assert job.plan is not None
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
        if job.plan is not None and job.recv.awaiting:
            self.stats.record(time.monotonic() - job.posted[0], job.posted[1] - job.posted[0], job.plan.num_bytes,
                              getattr(job.plan, "num_descriptors", 0))  # an ArenaPlan's
        if job.recv.awaiting:
            self.finished.add(job.rid)

    def _fail(self, job: _Job, reason: str) -> None:
        self.jobs.pop(job.rid, None)
        if job.plan is not None and job.handle is None:
            self.m.discard(job.plan)
        with self._lock:  # ask P for its handshake again next time: it may have restarted
            for rank in job.ranks:
                self._metadata.pop((job.recv.engine_id, rank), None)
        if not job.recv.awaiting:
            logger.info("kvcopy arena: notifying P about request %s failed: %s", job.rid, reason)
            return
        logger.warning("kvcopy arena: pulling request %s from %s failed, vLLM recomputes it: %s", job.rid,
                       job.recv.engine_id, reason)
        self.stats.record_failed()
        self.finished.add(job.rid)
        self.failed.add(job.rid)
        if self.single_group:
            self.error_blocks.update(job.blocks)

    def results(self) -> Tuple[Set[str], Set[str]]:
        """(finished_recving, failed_recving) since the last call."""
        out = (self.finished, self.failed)
        self.finished, self.failed = set(), set()
        return out

    def take_error_blocks(self) -> Set[int]:
        out, self.error_blocks = self.error_blocks, set()
        return out

    def close(self) -> None:
        """Stop the fetches (an exchange in flight ends within its timeout), then the sockets."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._zmq.destroy(linger=0)
