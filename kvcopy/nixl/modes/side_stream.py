"""Layer-wise staging on a GPU: each layer's unit copies on a side stream, after that layer's compute, on a few CTAs.

What runs where (P's worker; :mod:`kvcopy.vllm.arena.layerwise` drives it, vLLM is not
imported here):

* **the forward's thread**, when a layer's attention has enqueued its KV writes
  (vLLM's ``save_kv_layer``): :meth:`SideStream.mark` records an event ``E_l`` on that
  thread's current stream, the one the forward runs on. Nothing waits on the host.
* **the copy thread**: :meth:`SideStream.copy` makes the side stream wait for ``E_l``
  (on the GPU), then, with the side stream current on that thread, enqueues each job's
  planned unit copies (:meth:`~kvcopy.nixl.modes.partial_stage.StepCopies.run`, the
  copier launching on torch's current stream) with the call's grid capped at
  :attr:`SideStream.max_ctas` (``BlockCopier.run(..., max_ctas=)``), each job's page
  sums read back to the step's pinned host buffer in one copy after its units
  (:meth:`~kvcopy.nixl.modes.partial_stage.StepCopies.read_back`), and records **one**
  event after every job of the layer when any job asked for one (not one per job: a
  layer with 16 final requests records one event, not 16). It never waits on the host:
  the next layer's copies are enqueued as soon as that layer's ``save_kv_layer`` hands
  them over.
* **a waiter thread** (P's, for a chunked push and the record made right after the last
  layer): one :meth:`SideStream.wait` per layer for that event (a blocking event: the
  thread sleeps), then every request's units of the layer are WRITten. The only host
  wait, never on the forward's thread, and the forward's thread never waits for this one.
* **the forward's thread at the step's close** (``wait_for_save``): :meth:`SideStream.join`
  makes the current stream wait for the side stream (on the GPU): what that stream runs
  next (the sweep of units no ``save_kv_layer`` copied, the records' events, the next
  step's forward, which may overwrite the pages) comes after every copy queued so far.

So a layer's copy starts after its compute and overlaps the next layers' compute, and
nothing on the host waits for the GPU except the waiter thread.

**Grid.** One copy of one layer's pages of a request is a few hundred KiB to a few MiB.
On the full grid (one CTA per SM) it would take every SM from the next layer's kernels
for its duration; capped at a few CTAs it leaves them almost all. The connector's
``layerwise_ctas`` (default 4) is the cap: SGLang's GPU<->host copy kernel reaches the
copy-engine ceiling with 4 SMs (SGLang PR 40278). This copy goes device to host: a CTA
loads from device memory and stores to pinned host memory, stores the GPU posts over
PCIe without waiting for an answer, so a few CTAs fill the link. Even where a round
trip bounds it (loads from host memory, the other direction), one CTA of kvcopy's
kernel keeps 32 KiB of loads in flight (16 warps x 32 lanes x 4 x 16 B): 4 CTAs, 128
KiB, about 64 GB/s at a 2 us round trip (Little's law), above a PCIe 5 x16 link's
50-55 GB/s. Expected, not measured: no GPU has run this path yet;
``bench/gpu_check.py``'s ``ladder`` step measures GB/s per cap (1, 2, 4 ... 32 CTAs),
which is how the default should be checked on a given link. The whole-request staging
and the sweep run on the current stream with the copier's own grid.

**Streams and events** come from a :class:`StreamOps`: :class:`CudaStreams` (torch's
``torch.cuda.Event``, ``stream.wait_event``, ``stream.wait_stream``,
``torch.cuda.stream(s)``), or in CPU tests a recording one
(:class:`kvcopy.testing.streams.RecordedStreams`) that notes what each stream and
event did and on which thread.

**The side stream is kvcopy's own**: ``kvcopy_cuda_stream_create`` (libkvcopy_cuda)
makes a non-blocking stream at the device's lowest priority, wrapped in a
``torch.cuda.ExternalStream`` and destroyed at :meth:`SideStream.close`.
``torch.cuda.Stream()`` would hand out one of a fixed pool of streams per device and
priority, round robin: another user of it in the process (another library's side
stream) could get the same one, and their work would serialize behind each other.
Lowest priority: where CTAs of several streams wait for SMs, the block scheduler
starts those of a higher-priority stream first, so the copies never take an SM ahead
of a waiting kernel of the forward's. On today's GPUs the lowest priority is the
default one, the forward's (vLLM does not raise it): the two are then equals, and the
grid cap above is what leaves the forward its SMs. Without libkvcopy_cuda a pooled
stream at the lowest priority is used, with a warning.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any, ContextManager, List, NamedTuple, Optional, Protocol, Sequence, Set

import torch

from ... import native
from ...checks import integer
from .partial_stage import StepCopies

logger = logging.getLogger(__name__)

LAYERWISE_CTAS = 4  # the default cap of a layer's copy (module docstring, "Grid")
MAX_LAYERWISE_CTAS = 1024  # a cap above any GPU's SM count is a typo, not a choice


class StreamOps(Protocol):
    """Where :class:`SideStream` gets its streams and events. Streams have
    ``wait_event(event)`` and ``wait_stream(stream)``; events ``record(stream)``,
    ``query()`` and ``synchronize()``: torch.cuda's API."""

    def current(self) -> Any:
        """The calling thread's current stream."""

    def stream(self) -> Any:
        """A new stream of the caller's own (no other user is handed it)."""

    def close_stream(self, stream: Any) -> None:
        """Release a stream of :meth:`stream` (work queued on it still completes)."""

    def event(self, blocking: bool = False) -> Any:
        """A new event (no timing); ``blocking``: a host wait for it sleeps instead of
        spinning a core (the events the waiter thread waits for)."""

    def use(self, stream: Any) -> ContextManager:
        """``stream`` current on the calling thread inside the block."""

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph."""

    def enter_thread(self) -> None:
        """First thing on a thread of kvcopy's that makes a stream current or waits for an
        event (the copy and waiter threads): the streams' device made that thread's."""


class CudaStreams:
    """:class:`StreamOps` of torch.cuda on ``device``."""

    def __init__(self, device: torch.device):
        # an index always: torch.cuda.set_device refuses a bare "cuda"
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self._own: Set[int] = set()  # handles (cudaStream_t) of the streams kvcopy made and has not destroyed

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def stream(self) -> torch.cuda.Stream:
        """A non-blocking stream at the lowest priority, kvcopy's own (module docstring)."""
        lib, why = native.load("kvcopy_cuda")
        if lib is None:
            logger.warning("kvcopy: no libkvcopy_cuda (%s): the layer-wise side stream is one of torch's pooled "
                           "streams, which another user of torch.cuda.Stream() may share", why)
            return torch.cuda.Stream(self.device, priority=1)  # above the range: torch maps it to the lowest
        handle, priority = ctypes.c_void_p(), ctypes.c_int()
        with torch.cuda.device(self.device):  # the C call creates it on the current device
            native.check(lib.kvcopy_cuda_stream_create(self.device.index, ctypes.byref(handle),
                                                       ctypes.byref(priority)), "kvcopy_cuda_stream_create")
        assert handle.value is not None
        self._own.add(handle.value)
        return torch.cuda.ExternalStream(handle.value, device=self.device)

    def close_stream(self, stream: torch.cuda.Stream) -> None:
        handle = getattr(stream, "cuda_stream", None)
        if handle not in self._own:  # torch's (no libkvcopy_cuda): the pool keeps it
            return
        self._own.discard(handle)
        lib, _ = native.load("kvcopy_cuda")
        assert lib is not None
        try:  # on the stream's device, as made; a failure is logged: this runs at shutdown, where a
            # sticky CUDA error is likely and raising would skip closing NIXL after it
            with torch.cuda.device(self.device):
                native.check(lib.kvcopy_cuda_stream_destroy(handle), "kvcopy_cuda_stream_destroy")
        except Exception:  # noqa: BLE001 -- the process is going; the stream goes with its context
            logger.exception("kvcopy: destroying the layer-wise side stream failed")

    def event(self, blocking: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(blocking=blocking)

    def use(self, stream: torch.cuda.Stream) -> ContextManager:
        return torch.cuda.stream(stream)

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def enter_thread(self) -> None:
        # A new thread's current device is 0. Leaving ``torch.cuda.stream(s)`` there makes
        # the stream current again that was current on entry, device 0's, which switches
        # the thread to device 0: a CUDA context on GPU 0 for every other TP rank's worker
        # (hundreds of MiB on a GPU vLLM filled to 90%), or an error out of the copy.
        torch.cuda.set_device(self.device)


class Job(NamedTuple):
    """One request's units of one layer: ``key`` (the caller's name for it), its step's
    planned copies, the units to run, and whether an event should follow them (one
    event follows every job of the call that asked: :meth:`SideStream.copy`)."""

    key: Any
    step: StepCopies
    units: Sequence[int]
    signal: bool


class Queued(NamedTuple):
    """A job enqueued on the side stream: the event after it (None: not asked for, or it
    failed; else the call's one event, the same object for every job that asked) and
    the error that stopped it (its later units were not enqueued)."""

    key: Any
    units: Sequence[int]
    event: Any
    error: Optional[Exception]


class SideStream:
    """One P rank's side stream for layer-wise copies (see the module docstring)."""

    def __init__(self, ops: StreamOps, max_ctas: int = LAYERWISE_CTAS):
        self.max_ctas = integer(max_ctas, "layerwise_ctas", 1, MAX_LAYERWISE_CTAS)
        self.ops = ops
        self.stream: Any = ops.stream()

    def capturing(self) -> bool:
        """A CUDA graph is being captured on the calling thread's stream: no copy is
        queued then (the sweep copies after the forward)."""
        return self.ops.capturing()

    def enter_thread(self) -> None:
        """Run first on the copy and waiter threads (an executor's ``initializer``):
        :meth:`StreamOps.enter_thread`."""
        self.ops.enter_thread()

    def mark(self) -> Any:
        """An event on the calling thread's current stream after what it enqueued so far
        (the forward's thread: the layer's compute; at the close: the sweep)."""
        event = self.ops.event()
        event.record(self.ops.current())
        return event

    def copy(self, after: Any, jobs: Sequence[Job]) -> List[Queued]:
        """The copy thread: the side stream waits for ``after`` (a :meth:`mark`), then
        each job's units are enqueued on it, capped, each job's page sums read back in
        one copy after its units; then one event after all of them when a job that did
        not fail asked for one (every such job's :attr:`Queued.event`). A job whose copy
        raises (a planned call refused at launch) is returned with its error and no
        event; the others go on."""
        self.stream.wait_event(after)
        out: List[Queued] = []
        signalled = []  # places in ``out`` of the jobs the event is for
        with self.ops.use(self.stream):
            for job in jobs:
                try:
                    for u in job.units:
                        job.step.run(u, max_ctas=self.max_ctas)
                    job.step.read_back(job.units)
                except Exception as exc:  # noqa: BLE001 -- the caller stages this request whole
                    out.append(Queued(job.key, job.units, None, exc))
                    continue
                if job.signal:
                    signalled.append(len(out))
                out.append(Queued(job.key, job.units, None, None))
            if signalled:
                event = self.ops.event(blocking=True)  # the waiter thread sleeps in its wait
                event.record(self.stream)
                for i in signalled:
                    out[i] = out[i]._replace(event=event)
        return out

    @staticmethod
    def wait(event: Any) -> None:
        """The calling thread waits for ``event`` (a job's): its copies and sums are in
        host memory. Never called on the forward's thread (P's waiter thread calls it)."""
        event.synchronize()

    def join(self) -> None:
        """The calling thread's current stream waits, on the GPU, for every copy queued
        on the side stream so far (the forward's thread at the step's close, after the
        copy thread enqueued this step's copies)."""
        self.ops.current().wait_stream(self.stream)

    def close(self) -> None:
        """Release the side stream (:meth:`StreamOps.close_stream`; copies queued on it
        still complete). Called once nothing queues on it any more."""
        if self.stream is not None:
            stream, self.stream = self.stream, None
            self.ops.close_stream(stream)

