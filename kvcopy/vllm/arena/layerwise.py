"""P's layer-wise staging in the arena connector (``layerwise``): pages copied as their layers finish.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first.

P's scheduler sends, every step, each request computing prompt tokens
(:class:`~kvcopy.vllm.arena.meta.ArenaLayerStep`: its table, tokens computed before and
after the step). Per step, on P's worker:

* ``bind_connector_metadata`` (before the forward, under the worker's lock):
  :meth:`LayerwiseStage.bind` allocates the span of a request at its first step
  (``ArenaStaging.begin``; a full arena leaves the request to the whole-request staging
  at its last step: layer-wise is an optimisation, never a requirement), and plans the
  copies of the page positions that settle this step (``ArenaStaging.settle``, one
  planned call per unit, checked before any runs). A request whose computed tokens went
  back (preempted) is staged again from its first position.
* ``save_kv_layer(name)`` (vLLM calls it after the layer's attention wrote its KV):
  :meth:`LayerwiseStage.layer_done` hands the units whose last layer is ``name`` to the
  copy thread (one thread, on vLLM's KV-transfer cores, :mod:`kvcopy.vllm.affinity`).
  The copy is a native call that releases the GIL, so the copy of layer ``l`` runs
  while the forward computes layer ``l + 1``. It takes no lock: everything it touches
  was built at bind and belongs to this step. For a request whose prefill ends in the
  step, ``on_copied`` then hands the units copied to a chunked push
  (:mod:`kvcopy.vllm.arena.push_chunks`, which takes the worker's lock: ``wait_for_save``
  waits for the copies before it takes the lock). Once that request's last
  unit is copied and none is left for the sweep, :meth:`LayerwiseStage.finish_early`
  makes its record there and then (under that lock), so its push's final WRITE goes
  from the copy thread right after the last layer's copy instead of after
  ``wait_for_save``'s close.
* ``wait_for_save``: :meth:`LayerwiseStage.close_step` waits for the copy thread, then
  the completeness sweep copies every unit that got no ``save_kv_layer`` (state units:
  GDN/Mamba layers never call it; FULL CUDA graphs replay without it; an attention path
  without vLLM's decorator), and requests whose prefill ended are finished into their
  records, which the stager reports as it reports whole-request ones.

Correctness never depends on ``save_kv_layer`` being called: the sweep covers what it
did not. A copy never starts before its layer ran: it is queued by that layer's own
``save_kv_layer``, or by the sweep after the forward.

**On a GPU** (:mod:`kvcopy.nixl.modes.side_stream`, a :class:`SideStream` given at
build): ``save_kv_layer`` records an event on the forward's stream after the layer's
compute and hands it with the units to the copy thread, which makes the side stream
wait for it and enqueues the copies there with their grid capped (``layerwise_ctas``
CTAs), so they overlap the next layers' compute. ``close_step`` makes the forward's
stream wait for the side stream (GPU-side: no host wait on the forward's thread), then
sweeps on that stream with the copier's full grid; a request's record is finished once
an event after that completed. A layer's copies are followed by one event on the side
stream, after every final request's copies of that layer (and their page sums' read
back, one copy per request: :meth:`~kvcopy.nixl.modes.partial_stage.StepCopies.read_back`); a
second thread (the *waiter*) waits for it once (the only host wait, which neither the
forward's thread nor the copy thread makes) before ``on_copied`` WRITEs each request's
units of the layer, and once the request's last one ended (no layer of it left in
flight) :meth:`LayerwiseStage.finish_early` makes the record there, as on the
CPU. ``wait_for_save`` does not wait for the waiter: what it hands on after the close
goes in the final WRITE, and a record the close made first is not made again. A copy the
side stream refused at launch fails its request's layer-wise staging as on the CPU
(staged whole at its last step). While a CUDA graph is captured no copy is queued (the
sweep copies).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
from vllm.logger import init_logger

from ...nixl import ArenaFull
from ...nixl.manager import TransferManager
from ...nixl.modes.partial_stage import PartialStage, StepCopies
from ...nixl.modes.side_stream import Job, SideStream
from ...nixl.planning.pack_order import natural_key
from ...nixl.sum_check import PendingResult
from ..affinity import threads_on
from .meta import ArenaLayerStep

logger = init_logger("vllm.kvcopy")


class FinishingRecord(PendingResult):
    """A request's record once its copies ended (GPU: after its event), made under the
    worker's lock by the stager's ``_check_copies``."""

    def __init__(self, manager: TransferManager, part: PartialStage):
        self._m, self._part = manager, part
        self._record = None

    @property
    def request_id(self) -> str:
        return self._part.rid.decode("latin-1")

    def ready(self) -> bool:
        return True

    def abandon(self) -> None:
        """The request was aborted before its record was made: its span goes."""
        arena = self._m.arena
        if self._record is None and arena is not None:
            arena.abandon(self._part)

    def result(self):
        if self._record is None:
            arena = self._m.arena
            assert arena is not None
            self._record = arena.finish(self._part)
        return self._record


class LayerwiseStage:
    """One P rank's layer-wise staging (see the module docstring); driven by the stager
    under the worker's lock, except :meth:`layer_done` (the forward's thread, no lock)."""

    def __init__(self, manager: TransferManager, cpus: Optional[FrozenSet[int]], name: str, keep_s: float,
                 side: Optional[SideStream] = None):
        self.m = manager
        arena = manager.arena
        if arena is not None and arena.on_cuda and side is None:
            raise ValueError("layer-wise staging of a CUDA arena runs on a side stream: pass a SideStream")
        self.side = side  # GPU: the layers' copies run there (module docstring)
        self.keep_s = keep_s  # a request with no step for this long is dropped (its span freed)
        self.parts: Dict[str, Tuple[PartialStage, float]] = {}  # request -> (its stage, last step)
        self.whole: Set[str] = set()  # no span at their first step, or a copy failed: staged whole at their last
        self.taken: Set[str] = set()  # finished layer-wise this step: the stager does not stage them whole
        self._step: List[Tuple[str, StepCopies]] = []  # this step's copies
        self._final: List[str] = []  # requests whose prefill ends this step
        self._futures: List[Future] = []
        self._copy_failed: Dict[str, str] = {}  # written by the copy thread, read after it was waited for
        self.final_parts: Dict[str, PartialStage] = {}  # this step's requests whose prefill ends in it
        # called by the copy thread with (request, units) after the copies of a final step's
        # units ended (a chunked push: kvcopy.vllm.arena.push_chunks); takes its own lock
        self.on_copied: Optional[Callable[[str, List[int]], None]] = None
        self._last_layer = self._last_layers()
        self.at_layer = 0  # unit copies queued by save_kv_layer
        self.swept = 0  # unit copies made by the sweep
        self.no_span = 0  # requests with no span at their first step (staged whole at their last)
        self.early = 0  # records made by the copy thread (finish_early)
        # The copy thread, started here so it inherits the transfer CPUs (an executor
        # starts its thread on the first submit, from whichever thread submits).
        with threads_on(cpus):
            enter = None if side is None else side.enter_thread  # GPU: the KV's device made the thread's
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"kvcopy-arena-layers-{name}", initializer=enter)
            self._pool.submit(lambda: None).result()
            # GPU: the thread that waits for the side stream's events and hands the units on
            self._waiter = ThreadPoolExecutor(1, thread_name_prefix=f"kvcopy-arena-waits-{name}",
                                              initializer=enter) if side is not None else None
            if self._waiter is not None:
                self._waiter.submit(lambda: None).result()
        self._handing: List[Future] = []  # GPU: the waiter's jobs (a test may wait for them)
        # GPU: per request, its jobs with an event not waited for yet; finish_early waits for 0
        self._in_flight: Dict[str, int] = {}
        self._flight_lock = threading.Lock()

    def _last_layers(self) -> Dict[str, List[int]]:
        """layer name -> the units whose last layer (in forward order) it is."""
        arena = self.m.arena
        assert arena is not None
        out: Dict[str, List[int]] = {}
        for u, unit in enumerate(arena.span_copiers(arena.order).units):
            out.setdefault(max(unit.layers, key=natural_key), []).append(u)
        return out

    # ------------------------------------------------------------ before the forward
    def bind(self, layers: Dict[str, ArenaLayerStep]) -> None:
        arena = self.m.arena
        assert arena is not None
        now = time.monotonic()
        self._step, self._final, self.final_parts = [], [], {}
        self._handing = [f for f in self._handing if not f.done()]
        for rid, ls in layers.items():
            if rid in self.whole:
                continue
            entry = self.parts.get(rid)
            try:
                if entry is None:
                    part = arena.begin(self.m.info, ls.num_tokens, rid, 1, count_failure=False)
                else:
                    part = entry[0]
                    if ls.computed_tokens < part.done_tokens:  # preempted: computed again from the start
                        part.restart()
                self.parts[rid] = (part, now)
                self._step.append((rid, arena.settle(part, ls.block_ids, ls.done_tokens)))
            except ArenaFull:
                self.whole.add(rid)
                self.no_span += 1
                continue
            except (ValueError, TypeError) as exc:
                self._fail(rid, f"layer-wise staging: {exc}")
                continue
            if ls.done_tokens >= ls.num_tokens:
                self._final.append(rid)
                self.final_parts[rid] = part

    # ------------------------------------------------------------ in the forward
    def layer_done(self, name: str) -> None:
        """vLLM's ``save_kv_layer``: queue the copies of the units ``name`` completes."""
        units = self._last_layer.get(name)
        if not units or not self._step:
            return
        steps = [(rid, s) for rid, s in self._step if any(s.has(u) for u in units)]
        if not steps:
            return
        if self.side is None:
            self.at_layer += len(units)
            self._futures.append(self._pool.submit(self._copy, units, steps))
        elif not self.side.capturing():
            after = self.side.mark()  # the layer's compute, on the forward's stream
            self.at_layer += len(units)
            self._futures.append(self._pool.submit(self._copy_on_side, units, steps, after))

    def _copy(self, units: List[int], steps: List[Tuple[str, StepCopies]]) -> None:
        for rid, step in steps:
            try:
                mine = [u for u in units if step.has(u)]
                for u in mine:
                    step.run(u)
                step.read_back(mine)  # sums folded at run on the CPU: a no-op there
            except Exception as exc:  # noqa: BLE001 -- planned calls; reported as the request's failure
                self._copy_failed.setdefault(rid, f"layer-wise copy failed: {exc}")
                continue
            if self.on_copied is not None and rid in self.final_parts:
                self._copied(rid, [u for u in units if step.has(u)])

    def _copy_on_side(self, units: List[int], steps: List[Tuple[str, StepCopies]], after) -> None:
        """The copy thread, on a GPU: the units enqueued on the side stream after the
        layer's event ``after`` (no host wait here); the final requests' units are handed
        on by the waiter thread once the layer's one event after them completed (one
        waiter job per layer, whatever the number of final requests)."""
        assert self.side is not None and self._waiter is not None
        chunked = self.on_copied is not None
        jobs = [Job(rid, step, [u for u in units if step.has(u)], chunked and rid in self.final_parts)
                for rid, step in steps]
        self._flights([j.key for j in jobs if j.signal], 1)  # before any unit is marked copied
        try:
            queued = self.side.copy(after, jobs)
        except Exception as exc:  # noqa: BLE001 -- the side stream refused the layer's event: staged whole
            for job in jobs:
                self._copy_failed.setdefault(job.key, f"layer-wise copy failed: {exc}")
            self._flights([j.key for j in jobs if j.signal], -1)
            return
        handed: List[Tuple[str, List[int]]] = []
        event = None
        for job, q in zip(jobs, queued):  # one per job, in order
            if q.error is not None:
                self._copy_failed.setdefault(q.key, f"layer-wise copy failed: {q.error}")
            if q.event is not None:
                handed.append((q.key, list(q.units)))
                event = q.event  # the same for every job that asked (SideStream.copy)
            elif job.signal:  # failed: nothing to wait for, its request only
                self._flights([job.key], -1)
        if handed:
            self._handing.append(self._waiter.submit(self._hand_on, handed, event))

    def _hand_on(self, handed: List[Tuple[str, List[int]]], event) -> None:
        """The waiter thread: each ``(request, units)`` of ``handed`` (one layer's) is in
        its span once ``event`` completed (one host wait, on this thread only); then each
        goes to the chunked push / finish_early, every request's in-flight count already
        down (its record may be made as soon as its own units are handed on)."""
        assert self.side is not None
        try:
            self.side.wait(event)
        except Exception:  # noqa: BLE001 -- a CUDA error: the record's own event reports it
            logger.exception("kvcopy arena: waiting for the layer-wise copies of %s failed",
                             ", ".join(rid for rid, _ in handed))
            return
        finally:
            self._flights([rid for rid, _ in handed], -1)
        for rid, units in handed:
            self._copied(rid, units)

    def _flights(self, rids: List[str], delta: int) -> None:
        if rids:
            with self._flight_lock:
                for rid in rids:
                    n = self._in_flight.get(rid, 0) + delta
                    if n:
                        self._in_flight[rid] = n
                    else:
                        self._in_flight.pop(rid, None)

    def _copied(self, rid: str, units: List[int]) -> None:
        assert self.on_copied is not None
        try:
            self.on_copied(rid, units)
        except Exception:  # noqa: BLE001 -- the final WRITE carries what a chunk did not
            logger.exception("kvcopy arena: pushing the units of %s copied so far failed", rid)

    def finish_early(self, rid: str):
        """The copy thread (a GPU: the waiter thread), under the worker's lock, after
        ``rid``'s copies of a step: ``rid``'s record (its span staged, as
        :meth:`close_step` would) when this is the step its prefill ends in, every unit
        of it was copied at its layer (nothing left for the sweep) and the copies ended
        (the CPU: they end in the call; a GPU: the waiter waited for the event after
        each of its layers, none is in flight); else None."""
        entry = self.parts.get(rid)
        arena = self.m.arena
        if entry is None or rid not in self._final or rid in self._copy_failed or arena is None \
                or not entry[0].complete or rid in self._in_flight:
            return None
        record = arena.finish(entry[0])
        del self.parts[rid]
        self._final.remove(rid)
        self.taken.add(rid)
        self.early += 1
        return record

    def wait_copies(self) -> None:
        """Wait for this step's copies (called without the worker's lock: a copy's
        ``on_copied`` takes it)."""
        for f in list(self._futures):
            f.result()

    # ------------------------------------------------------------ after the forward
    def close_step(self) -> List[Tuple[str, object, Optional[torch.cuda.Event]]]:
        """Wait for the copy thread, sweep what no ``save_kv_layer`` copied, and return
        the requests whose prefill ended: (request, its record or a pending one, the
        GPU event after its copies or None)."""
        for f in self._futures:
            f.result()
        self._futures = []
        if self.side is not None:
            self.side.join()  # on the GPU: the sweep and the records' events after every side copy
        for rid, why in self._copy_failed.items():
            self._fail(rid, why)
        self._copy_failed = {}
        for rid, step in self._step:
            if rid in self.whole:
                continue
            try:
                left = step.left()
                for u in left:
                    step.run(u)
                    self.swept += 1
                step.read_back(left)  # a GPU: one copy of their sums, before the records' events
            except Exception as exc:  # noqa: BLE001
                self._fail(rid, f"layer-wise copy failed: {exc}")
        self._step = []
        out: List[Tuple[str, object, Optional[torch.cuda.Event]]] = []
        for rid in self._final:
            entry = self.parts.pop(rid, None)
            if entry is None:
                continue
            pending = FinishingRecord(self.m, entry[0])
            self.taken.add(rid)
            if self.side is not None:
                out.append((rid, pending, self.side.mark()))
            else:
                out.append((rid, pending.result(), None))
        self._final = []
        return out

    def takes(self, rid: str) -> bool:
        """Whether ``rid``, whose prefill ended this step, was staged layer by layer (else
        the stager stages it whole); forgets it."""
        self.whole.discard(rid)
        if rid in self.taken:
            self.taken.discard(rid)
            return True
        return False

    def drop(self, rid: str) -> None:
        """The request ended before its prefill did (aborted): its span goes (no copy of
        it runs: called between steps)."""
        self._abandon(rid)
        self.whole.discard(rid)
        self.taken.discard(rid)

    def expire(self, now: float) -> None:
        """Drop requests with no step for ``keep_s`` (P's scheduler lost them)."""
        for rid in [r for r, (_, seen) in self.parts.items() if now - seen > self.keep_s]:
            logger.warning("kvcopy arena: layer-wise staging of %s had no step for %.0f s; dropped", rid, self.keep_s)
            self.drop(rid)

    def _fail(self, rid: str, why: str) -> None:
        """Layer-wise staging of ``rid`` failed: its span goes, and its last step stages it whole."""
        logger.warning("kvcopy arena: %s; staged whole at the end of its prefill", why)
        self._abandon(rid)
        self.whole.add(rid)

    def _abandon(self, rid: str) -> None:
        entry = self.parts.pop(rid, None)
        if entry is not None:
            arena = self.m.arena
            assert arena is not None
            arena.abandon(entry[0])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)
        if self.side is not None:
            self.side.close()  # nothing queues on it any more: kvcopy's own stream destroyed
