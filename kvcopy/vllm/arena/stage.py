"""P's worker in the arena connector: stage finished prefills, free spans when D is done.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first.

Each step (``wait_for_save``) :meth:`ArenaStager.step`:

1. reads D's notifications (:meth:`tick`, below);
2. drops the requests P's scheduler gave up (``reqs_not_processed``: aborted);
3. stages the requests whose prefill ended (``ArenaStage``: one ``TransferManager.save``
   each, one masked copy of every group's own layers into one span). A full arena is
   back-pressure: the request stays queued, retried every step (P's scheduler keeps the
   engine stepping meanwhile), until ``stage_timeout_s``; then it fails. Nothing staged is
   evicted or overwritten (the arena never hands out a live span). On CUDA the copy is
   enqueued (``save(wait=False)``) and the record is reported only once its event has
   completed, so no READ can be posted before the bytes are in the arena, and P's step
   never waits for it. With ``checksum`` the record carries the pack's page sums, read
   back with the copy (:class:`~kvcopy.nixl.modes.span_sums.PendingRecord`) and finished then.

:meth:`tick` runs at every step and, between steps, from the worker's housekeeping
thread (:mod:`kvcopy.vllm.arena.connector`): vLLM steps an engine only while it has requests, and
an idle P must still free what D is done with and what outlived its TTL. It reads D's
notifications (:func:`~kvcopy.vllm.arena.meta.parse_notify`): a reader of a request
says it read it or gave it up, and how many D ranks there are; once every D rank that
reads this P rank (:func:`readers_of`, the same choice D makes with
:func:`kvcopy.nixl.remote_ranks`) has said either, the span is freed
(``TransferManager.arena.release``). A notification for a request not staged yet (D gave
up while P was still waiting for space or copying) is kept (:data:`EARLY_KEPT` at most,
for the TTL) and counted when it is: a request every reader gave up is never staged.
Spans the arena freed at their TTL are noticed here too. Freed spans are reported, so
P's scheduler stops serving their records. Give-ups that came over P's side channel
(:meth:`note_give_ups`: D could not reach this rank over NIXL) count the same.

**A give-up under D's own id.** Under concurrent dispatch D names its own request id,
which differs from P's by the random suffix each engine appends (vLLM's
``get_base_request_id`` strips it). A notification naming no request of this rank is
taken for the one request P stages, holds or waits to stage with the same base id
(:meth:`_resolve`); none or several (ambiguous): kept under D's name as before (and, when
none, matched by base id when such a request is staged). Without this, a D that aborted
a request before scheduling it (so it never reserved) left P's span to its TTL.

A request staged (or failed) whose blocks P's scheduler holds (``reqs_to_send``: it
finished the request with ``delay_free_blocks``) is reported in ``finished_sending``: P's
KV blocks go back to the pool as soon as the arena holds the copy, not when D has read.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id
from vllm.logger import init_logger

from ...nixl import ArenaFull, remote_ranks
from ...nixl.manager import TransferManager
from ...nixl.sum_check import finished
from ..config import ArenaOptions
from .layerwise import LayerwiseStage, FinishingRecord
from ...nixl.wire.record import StagedRequest
from .meta import (
    GAVE_UP, READ, ArenaStage, KvcopyArenaMetadata, KvcopyArenaWorkerMeta, parse_notify,
)

logger = init_logger("vllm.kvcopy")

EARLY_KEPT = 4096  # requests with notifications that came before their span (oldest dropped past this)


def namesakes(rid: str, requests: Iterable[str]) -> List[str]:
    """Those of ``requests`` with ``rid``'s vLLM base id (``get_base_request_id``: the
    engine's random suffix stripped), ``rid`` itself included when there. A caller takes
    a request by base id only where this lists exactly one: two or more are ambiguous."""
    base = get_base_request_id(rid)
    return [r for r in requests if get_base_request_id(r) == base]


def readers_of(p_rank: int, p_tp: int, d_tp: int, total_kv_heads: Optional[int]) -> int:
    """How many D ranks (of ``d_tp``) read P rank ``p_rank``: those whose
    :func:`~kvcopy.nixl.remote_ranks` name it (``total_kv_heads`` None: MLA)."""
    return sum(p_rank in remote_ranks(r, d_tp, p_tp, total_kv_heads) for r in range(d_tp))


class ArenaStager:
    """One P rank's staging (see the module docstring). Not thread-safe: the worker
    serializes :meth:`step`, :meth:`tick` and the rest with its lock."""

    def __init__(self, manager: TransferManager, options: ArenaOptions, tp_rank: int, tp_size: int,
                 total_kv_heads: Optional[int], key: Optional[bytes]):
        self.m = manager
        self.opts = options
        self.rank, self.tp, self.heads, self.key = tp_rank, tp_size, total_kv_heads, key
        self.pending: Dict[str, Tuple[ArenaStage, float]] = {}  # waiting for arena space, until the deadline
        # CUDA: packed, copy not yet done (the record a PendingRecord while its page sums are on the GPU)
        self.syncing: Dict[str, Tuple[object, Optional[torch.cuda.Event]]] = {}
        self.live: Set[str] = set()  # staged spans not freed yet
        self.done: Set[str] = set()  # staged or failed: P's blocks may go
        self.held: Set[str] = set()  # P's scheduler holds these requests' blocks for us
        self.readers: Dict[str, Tuple[int, Set[str]]] = {}  # request -> (D's TP size, D agents done with it)
        # notifications that came before their span: request -> (D's TP size, readers, until)
        self.early: "OrderedDict[str, Tuple[int, Set[str], float]]" = OrderedDict()
        self.gave_up = 0  # spans freed (or stagings skipped) because every reader gave up
        self.records: Dict[str, StagedRequest] = {}  # live spans' finished records (push posts them)
        self.failures: "OrderedDict[str, str]" = OrderedDict()  # recent: requests not staged, and why
        self.report = KvcopyArenaWorkerMeta()
        self.layers: Optional[LayerwiseStage] = None  # with ``layerwise`` (kvcopy.vllm.arena.layerwise)

    def step(self, meta: KvcopyArenaMetadata) -> None:
        now = time.monotonic()
        if self.layers is not None:  # this step's layer-wise copies end first (aborts below free spans)
            for rid, record, event in self.layers.close_step():
                self.live.add(rid)
                self.syncing[rid] = (record, event)
            self.layers.expire(now)
        self.tick(now)
        for rid in meta.nixl.reqs_not_processed:
            self._abort(rid)
        self.held.update(meta.nixl.reqs_to_send)
        for rid, stage in meta.stage.items():
            if self.layers is not None and self.layers.takes(rid):
                continue  # staged layer by layer
            self.pending[rid] = (stage, now + self.opts.stage_timeout_s)
        self._stage_pending(now)
        self._check_copies(now)

    def staged_early(self, rid: str, record: StagedRequest) -> None:
        """A layer-wise request whose record the copy thread made
        (:meth:`~kvcopy.vllm.arena.layerwise.LayerwiseStage.finish_early`): live and
        pushable now; reported as :meth:`step`'s close would."""
        self.live.add(rid)
        self._staged(rid, record, time.monotonic())

    def fail_early(self, rid: str, reason: str) -> None:
        """A record the copy thread made that :meth:`staged_early` could not report: its
        span goes and the request fails as a staging does (push: ``x`` to D at the
        sender's next step; pull: D's load fails on the report)."""
        arena = self.m.arena
        assert arena is not None
        if rid in arena.staged:
            arena.release(rid)
        self._forget(rid)
        ranks = self.report.staged.get(rid)
        if ranks is not None:
            ranks.pop(self.rank, None)
            if not ranks:
                del self.report.staged[rid]
        self._fail(rid, reason)

    def tick(self, now: Optional[float] = None) -> None:
        """D's notifications, copies that ended, TTLs: everything that needs no step."""
        now = time.monotonic() if now is None else now
        for peer, msgs in self.m.notifications().items():
            for msg in msgs:
                parsed = parse_notify(msg)
                if parsed is not None:
                    self._note(parsed[0], peer, parsed[1], parsed[2], now)
        self._check_copies(now)
        arena = self.m.arena
        assert arena is not None
        staged = set(arena.staged)
        # freed at its TTL; not one still syncing: a layer-wise span on a GPU is staged only
        # once its copies' event is reached (FinishingRecord)
        for rid in [r for r in self.live if r not in staged and r not in self.syncing]:
            self._forget(rid)
        while self.early and next(iter(self.early.values()))[2] < now:
            self.early.popitem(last=False)

    def note_give_ups(self, give_ups) -> None:
        """(request, D agent, D's TP size) that P's side channel got for this rank."""
        now = time.monotonic()
        for rid, reader, d_tp in give_ups:
            self._note(rid, reader, d_tp, GAVE_UP, now)

    def known(self) -> Set[str]:
        """Requests this rank stages, holds staged, or copies layer by layer (not the
        ones still computing: the worker learns a request when its prefill ends, or layer
        by layer). A staged span's record is in :attr:`records` once its copy ended."""
        known = self.live | set(self.pending) | set(self.syncing)
        if self.layers is not None:
            known.update(self.layers.parts)
        return known

    def _resolve(self, rid: str) -> str:
        """The request of this rank a notification naming ``rid`` is about: ``rid``
        itself, else the one request known here with its base id (module docstring)."""
        known = self.known()
        if rid in known:
            return rid
        hits = namesakes(rid, known)
        return hits[0] if len(hits) == 1 else rid

    def _early_of(self, rid: str) -> Optional[str]:
        """The early notifications' key for ``rid`` (being staged): its own, else the one
        kept under another id with its base, when no other known request has that base."""
        if rid in self.early:
            return rid
        keys = namesakes(rid, self.early)
        if len(keys) == 1 and len(namesakes(rid, self.known())) == 1:
            return keys[0]
        return None

    def _note(self, rid: str, reader: str, d_tp: int, kind: bytes, now: float) -> None:
        """``reader`` (a D agent) is done with ``rid`` (read it, or gave it up)."""
        rid = self._resolve(rid)
        if rid in self.live and rid not in self.syncing:
            _, seen = self.readers.setdefault(rid, (d_tp, set()))
            seen.add(reader)  # distinct D agents: a repeated notification counts once
            if len(seen) >= readers_of(self.rank, self.tp, d_tp, self.heads):
                if kind == GAVE_UP:
                    self.gave_up += 1
                self._release(rid)
            return
        _, seen, _ = self.early.setdefault(rid, (d_tp, set(), now + self.opts.manager.arena_ttl_s))
        seen.add(reader)
        self.early.move_to_end(rid)
        while len(self.early) > EARLY_KEPT:
            self.early.popitem(last=False)

    def _everyone_gave_up(self, rid: str) -> Optional[str]:
        """The early notifications' key for ``rid`` when every reader gave it up, else None."""
        key = self._early_of(rid) if self.early else None
        entry = self.early.get(key) if key is not None else None
        return key if entry is not None and len(entry[1]) >= readers_of(self.rank, self.tp, entry[0],
                                                                          self.heads) else None

    def _stage_pending(self, now: float) -> None:
        for rid, (stage, deadline) in list(self.pending.items()):
            key = self._everyone_gave_up(rid)
            if key is not None:  # D gave it up while it waited here: never staged
                self.gave_up += 1
                del self.early[key]
                self._fail(rid, "every reader gave it up before it was staged")
                continue
            try:
                out = self.m.save(stage.block_ids, wait=False, num_tokens=stage.num_tokens, request_id=rid)
            except ArenaFull as exc:
                if exc.ever_fits and now < deadline:
                    continue  # back-pressure: D's notifications or the TTL free space
                self._fail(rid, f"not staged: {exc}")
                continue
            except (ValueError, TypeError) as exc:
                self._fail(rid, f"not staged: {exc}")
                continue
            del self.pending[rid]
            record, event = out if isinstance(out, tuple) else (out, None)
            self.live.add(rid)
            self.syncing[rid] = (record, event)

    def _check_copies(self, now: float) -> None:
        for rid, (record, event) in list(self.syncing.items()):
            if event is None or event.query():  # the pack and its page sums are in host memory
                del self.syncing[rid]
                self._staged(rid, finished(record), now)

    def _staged(self, rid: str, rec: StagedRequest, now: float) -> None:
        self.records[rid] = rec
        self.report.staged.setdefault(rid, {})[self.rank] = rec.to_bytes(self.key)
        self.done.add(rid)
        key = self._early_of(rid) if self.early else None
        d_tp, early, _ = self.early.pop(key, (1, set(), now)) if key is not None else (1, set(), now)
        for reader in early:
            self._note(rid, reader, d_tp, GAVE_UP, now)

    def _release(self, rid: str) -> None:
        arena = self.m.arena
        assert arena is not None
        if rid in arena.staged:
            arena.release(rid)
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        self.live.discard(rid)
        self.records.pop(rid, None)
        self.readers.pop(rid, None)
        self.report.released.setdefault(rid, set()).add(self.rank)

    def _abort(self, rid: str) -> None:
        """P's scheduler dropped the request (aborted before it finished): its blocks are
        not held for us; a span staged for it goes now, and D is told it never will be."""
        self.pending.pop(rid, None)
        record, _ = self.syncing.pop(rid, (None, None))
        if isinstance(record, FinishingRecord):
            record.abandon()
        if self.layers is not None:
            self.layers.drop(rid)
        if rid in self.live:
            self._release(rid)
        self.report.failed.setdefault(rid, {})[self.rank] = "aborted on P"
        self._note_failure(rid, "aborted on P")
        self.done.discard(rid)
        self.held.discard(rid)

    def _fail(self, rid: str, reason: str) -> None:
        self.pending.pop(rid, None)
        self.report.failed.setdefault(rid, {})[self.rank] = reason
        self._note_failure(rid, reason)
        self.done.add(rid)

    def _note_failure(self, rid: str, reason: str) -> None:
        self.failures[rid] = reason
        self.failures.move_to_end(rid)
        while len(self.failures) > EARLY_KEPT:
            self.failures.popitem(last=False)

    def note_read(self, rid: str, reader: str, d_tp: int) -> None:
        """``reader`` (a D agent) is done with ``rid``'s span: its push ended (``f`` or ``x`` sent)."""
        self._note(rid, reader, d_tp, READ, time.monotonic())

    def finished_sending(self) -> Set[str]:
        """Requests whose blocks P's scheduler may free now."""
        out = self.done & self.held
        self.done -= out
        self.held -= out
        return out

    def take_report(self) -> Optional[KvcopyArenaWorkerMeta]:
        report, self.report = self.report, KvcopyArenaWorkerMeta()
        return report if report else None

    @property
    def waiting(self) -> int:
        """Requests queued for arena space or copies in flight."""
        return len(self.pending) + len(self.syncing)
