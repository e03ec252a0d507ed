"""P's worker in the arena connector: stage finished prefills, free spans when D is done.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first.

Each step (``wait_for_save``) :meth:`ArenaStager.step`:

1. reads D's notifications (:func:`~kvcopy.vllm_arena_meta.parse_notify`): a reader of a
   request says it is done (read, or gave up) and how many D ranks there are; once every D
   rank that reads this P rank (:func:`readers_of`, the same choice D makes with
   :func:`kvcopy.nixl.remote_ranks`) has said so, the span is freed
   (``TransferManager.arena.release``). Spans the arena freed at their TTL are noticed
   here too. Freed spans are reported, so P's scheduler stops serving their records;
2. drops the requests P's scheduler gave up (``reqs_not_processed``: aborted);
3. stages the requests whose prefill ended (``ArenaStage``: one ``TransferManager.save``
   each, one masked copy of every group's own layers into one span). A full arena is
   back-pressure: the request stays queued, retried every step (P's scheduler keeps the
   engine stepping meanwhile), until ``stage_timeout_s``; then it fails. Nothing staged is
   evicted or overwritten (the arena never hands out a live span). On CUDA the copy is
   enqueued (``save(wait=False)``) and the record is reported only once its event has
   completed, so no READ can be posted before the bytes are in the arena, and P's step
   never waits for it. With ``checksum`` the record carries the pack's page sums, read
   back with the copy (:class:`~kvcopy.nixl.span_sums.PendingRecord`) and finished then.

A request staged (or failed) whose blocks P's scheduler holds (``reqs_to_send``: it
finished the request with ``delay_free_blocks``) is reported in ``finished_sending``: P's
KV blocks go back to the pool as soon as the arena holds the copy, not when D has read.
"""
from __future__ import annotations

import time
from typing import Dict, Optional, Set, Tuple

import torch

from .nixl import ArenaFull, remote_ranks
from .nixl.manager import TransferManager
from .nixl.sum_check import finished
from .vllm_arena_meta import ArenaOptions, ArenaStage, KvcopyArenaMetadata, KvcopyArenaWorkerMeta, parse_notify


def readers_of(p_rank: int, p_tp: int, d_tp: int, total_kv_heads: Optional[int]) -> int:
    """How many D ranks (of ``d_tp``) read P rank ``p_rank``: those whose
    :func:`~kvcopy.nixl.remote_ranks` name it (``total_kv_heads`` None: MLA)."""
    return sum(p_rank in remote_ranks(r, d_tp, p_tp, total_kv_heads) for r in range(d_tp))


class ArenaStager:
    """One P rank's staging (see the module docstring)."""

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
        self.readers: Dict[str, Set[str]] = {}  # request -> D agents that said they are done
        self.report = KvcopyArenaWorkerMeta()

    def step(self, meta: KvcopyArenaMetadata) -> None:
        now = time.monotonic()
        self._read_notifications()
        for rid in meta.nixl.reqs_not_processed:
            self._abort(rid)
        self.held.update(meta.nixl.reqs_to_send)
        for rid, stage in meta.stage.items():
            self.pending[rid] = (stage, now + self.opts.stage_timeout_s)
        self._stage_pending(now)
        self._check_copies()

    def _stage_pending(self, now: float) -> None:
        for rid, (stage, deadline) in list(self.pending.items()):
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

    def _check_copies(self) -> None:
        for rid, (record, event) in list(self.syncing.items()):
            if event is None or event.query():  # the pack and its page sums are in host memory
                del self.syncing[rid]
                self.report.staged.setdefault(rid, {})[self.rank] = finished(record).to_bytes(self.key)
                self.done.add(rid)

    def _read_notifications(self) -> None:
        for peer, msgs in self.m.notifications().items():
            for msg in msgs:
                parsed = parse_notify(msg)
                if parsed is None or parsed[0] not in self.live or parsed[0] in self.syncing:
                    continue  # not ours, or a request this rank holds no readable span of
                rid, d_tp = parsed
                seen = self.readers.setdefault(rid, set())
                seen.add(peer)  # distinct D agents: a repeated notification counts once
                if len(seen) >= readers_of(self.rank, self.tp, d_tp, self.heads):
                    self._release(rid)
        arena = self.m.arena
        assert arena is not None
        staged = set(arena.staged)
        for rid in [r for r in self.live if r not in staged]:  # freed at its TTL
            self._forget(rid)

    def _release(self, rid: str) -> None:
        arena = self.m.arena
        assert arena is not None
        if rid in arena.staged:
            arena.release(rid)
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        self.live.discard(rid)
        self.readers.pop(rid, None)
        self.report.released.setdefault(rid, set()).add(self.rank)

    def _abort(self, rid: str) -> None:
        """P's scheduler dropped the request (aborted before it finished): its blocks are
        not held for us; a span staged for it goes now, and D is told it never will be."""
        self.pending.pop(rid, None)
        self.syncing.pop(rid, None)
        if rid in self.live:
            self._release(rid)
        self.report.failed.setdefault(rid, {})[self.rank] = "aborted on P"
        self.done.discard(rid)
        self.held.discard(rid)

    def _fail(self, rid: str, reason: str) -> None:
        self.pending.pop(rid, None)
        self.report.failed.setdefault(rid, {})[self.rank] = reason
        self.done.add(rid)

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
