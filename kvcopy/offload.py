"""Offloading jobs: device KV blocks to and from host chunks, one copier call per job, page sums checked.

The engine under :mod:`kvcopy.vllm.offload` (vLLM's ``OffloadingConnector``), free of
vLLM so it runs and is measured where vLLM is not installed.

Data layout (vLLM 0.33's CPU offloading):

* device tensor ``t``: int8 ``(num_blocks, page_t)``, block stride ``S_t >= page_t``
  (padded pages, or a packed row holding every layer of a block);
* a KV cache group is a list of layers ``(t, bytes)``: the layer's page is the first
  ``bytes <= page_t`` bytes of each row of ``t`` (groups may share tensors: overlaid
  hybrids);
* host tensor ``t``: int8 ``(num_chunks, blocks_per_chunk * page_t)``, rows any stride
  apart (a private tensor, or this worker's slot of each row of a shared region);
  sub-block ``j`` of chunk ``c`` is bytes ``[j * page_t, (j + 1) * page_t)`` of row ``c``;
* a job names, per group, ``n`` device blocks and the chunks holding them: the group's
  blocks start at sub-block ``block_index % blocks_per_chunk`` of its first chunk (a
  request's first block need not start a chunk); a group with no block has no chunk.

One :class:`~kvcopy.core.copier.BlockCopier` is built over "layers" ``(g, j, k)``: the device
view ``t[:, :bytes]`` and the host view ``host_t[:, j * page_t:][:, :bytes]`` of layer
``k`` of group ``g``, in copier group ``g * blocks_per_chunk + j``. A job is one planned
call (every group's layers, each group masked to its own) in the direction it names.

Checksums (:mod:`kvcopy.core.checksum`): with ``checksum`` on, a store's copy returns one sum
per sub-block page (over its group's layers), kept here per sub-block (8 bytes each,
host memory); a load's copy returns the sums of the pages it reads, compared when the
job completes with those of the store that wrote them. A difference, or a sub-block no
checksummed store wrote, fails the job (:attr:`JobResult.ok` false). The comparison
reads 8 bytes per page; the data is never read twice.

Device jobs run on one CUDA stream per queue ("store", "load", "expedited"), each
waiting for the caller's current stream first (a store reads what the model wrote; a
load writes blocks whose zeroing may still be queued), in submission order, with
events for completion and timing: :meth:`OffloadCopier.submit` never waits for the
device, :meth:`OffloadCopier.finished` polls, :meth:`OffloadCopier.wait` synchronizes
the jobs it names. CPU jobs copy in :meth:`~OffloadCopier.submit`.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from .core.copier import BlockCopier
from .core.options import ChecksumOptions
from .core.tables import CallPlan

QUEUES = ("store", "load", "expedited")


@dataclass(frozen=True)
class OffloadOptions(ChecksumOptions):
    """The options of offloading copies (``kv_connector_extra_config["kvcopy"]`` in vLLM:
    ``checksum``, page sums computed by stores and compared by loads; ``copy_backend``;
    ``max_ctas``). Its fields are :class:`~kvcopy.core.options.ChecksumOptions`'; the
    copies run on ``(blocks, page)`` rows, so ``kv_layout`` and ``block_dim`` are unused."""


@dataclass(frozen=True)
class JobResult:
    """A finished job: ``ok`` false when a load's pages failed their checksums."""

    job_id: int
    store: bool
    ok: bool
    num_bytes: int
    seconds: float
    bad_pages: int = 0  # pages whose sums differ from their store's
    unstored_pages: int = 0  # pages no checksummed store wrote
    bad_chunks: Tuple[int, ...] = ()  # the chunks holding those pages, for messages


Layer = Tuple[int, int]  # (device tensor index, page bytes)


def check_tensors(device_tensors: Sequence[torch.Tensor], groups: Sequence[Sequence[Layer]]) -> torch.device:
    """The device of the tensors, after checking each is an int8 ``(blocks, page)`` row
    view whose rows do not overlap, and each layer fits its tensor's page."""
    if not device_tensors:
        raise ValueError("offloading: no KV cache tensor")
    devices = set()
    for i, t in enumerate(device_tensors):
        where = f"offloading: KV tensor {i}"
        if t.dtype != torch.int8 or t.dim() != 2:
            raise ValueError(f"{where} is {t.dtype} of shape {tuple(t.shape)}; expected int8 (blocks, page bytes)")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{where}: a page's bytes are not contiguous (stride {t.stride()})")
        if t.shape[0] > 1 and t.stride(0) < t.shape[1]:
            raise ValueError(f"{where}: pages of consecutive blocks overlap (block stride {t.stride(0)} < page "
                             f"{t.shape[1]} bytes): this KV cache layout does not keep a block's bytes together")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{where} is on {t.device}: kvcopy copies CPU and CUDA KV caches only")
        devices.add(t.device)
    if len(devices) > 1:
        raise ValueError(f"offloading: KV tensors on several devices {sorted(map(str, devices))}")
    for g, layers in enumerate(groups):
        for idx, nbytes in layers:
            if not 0 <= idx < len(device_tensors):
                raise ValueError(f"offloading: group {g} names tensor {idx} of {len(device_tensors)}")
            if not 0 < nbytes <= device_tensors[idx].shape[1]:
                raise ValueError(f"offloading: group {g}: a layer page of {nbytes} bytes in tensor {idx} of "
                                 f"{device_tensors[idx].shape[1]}-byte pages")
    return devices.pop()


@dataclass
class _Job:
    job_id: int
    store: bool
    num_bytes: int
    subs: np.ndarray  # sub-block index (chunk * blocks_per_chunk + j) of each block of the call
    sums: Optional[torch.Tensor]  # the copy's sums, on the copy's device
    sums_host: Optional[torch.Tensor] = None  # ... copied to pinned host memory (device jobs)
    expected: Optional[np.ndarray] = None  # a load's stored sums (uint64)
    stored: Optional[np.ndarray] = None  # ... and which of its sub-blocks a checksummed store wrote
    unstored: int = 0
    start: Any = None  # device jobs: timing events
    end: Any = None
    seconds: float = 0.0  # CPU jobs: the copy's wall time


class OffloadCopier:
    """Offloading jobs between device blocks and host chunks (module docstring).

    ``device_tensors``: int8 ``(num_blocks, page_t)`` views; ``groups``: per KV cache
    group its layers as ``(tensor index, page bytes)``; ``host_tensors``: one int8
    ``(num_chunks, blocks_per_chunk * page_t)`` tensor per device tensor."""

    def __init__(self, device_tensors: Sequence[torch.Tensor], groups: Sequence[Sequence[Layer]],
                 host_tensors: Sequence[torch.Tensor], blocks_per_chunk: int, options: OffloadOptions):
        self.device = check_tensors(device_tensors, groups)
        if len(host_tensors) != len(device_tensors):
            raise ValueError(f"offloading: {len(host_tensors)} host tensors for {len(device_tensors)} KV tensors")
        if isinstance(blocks_per_chunk, bool) or not isinstance(blocks_per_chunk, int) or blocks_per_chunk < 1:
            raise ValueError(f"offloading: blocks_per_chunk must be a positive integer, got {blocks_per_chunk!r}")
        self.bpc = blocks_per_chunk
        self.options = options
        self.num_groups = len(groups)
        self.num_chunks = int(host_tensors[0].shape[0])
        self.copier = self._build(device_tensors, groups, host_tensors)
        if options.checksum:
            why = self.copier.checksum_reason("d2h") or self.copier.checksum_reason("h2d")
            if why:
                self.copier.close()
                raise ValueError(f"offloading: kvcopy.checksum is on but {why}; set kvcopy.checksum to false "
                                 "to use this backend")
        self.on_gpu = self.device.type == "cuda"
        self._sums = np.zeros(self.num_chunks * blocks_per_chunk, dtype=np.uint64)  # last store's sum per sub-block
        self._stored = np.zeros(self.num_chunks * blocks_per_chunk, dtype=bool)  # ... written by a checksummed store
        self._done: List[JobResult] = []  # CPU jobs, finished in submit
        self._queues: Dict[str, Deque[_Job]] = {q: deque() for q in QUEUES}
        self._streams = {q: torch.cuda.Stream(self.device) for q in QUEUES} if self.on_gpu else {}
        self._events: Dict[int, Any] = {}  # device job id -> its end event

    def _build(self, device_tensors, groups, host_tensors) -> BlockCopier:
        device: Dict[str, torch.Tensor] = {}
        host: Dict[str, torch.Tensor] = {}
        names: List[List[str]] = []
        for g, layers in enumerate(groups):
            for j in range(self.bpc):
                mine = []
                for k, (idx, nbytes) in enumerate(layers):
                    page = device_tensors[idx].shape[1]
                    h = host_tensors[idx]
                    if h.dtype != torch.int8 or h.dim() != 2 or h.shape[1] != self.bpc * page \
                            or h.shape[0] != self.num_chunks or h.device.type != "cpu":
                        raise ValueError(f"offloading: host tensor {idx} is {h.dtype} {tuple(h.shape)} on {h.device}, "
                                         f"expected int8 ({self.num_chunks}, {self.bpc * page}) on the CPU")
                    name = f"group{g}.layer{k}.sub{j}"
                    device[name] = device_tensors[idx][:, :nbytes]
                    host[name] = h[:, j * page:j * page + nbytes]
                    mine.append(name)
                names.append(mine)
        return BlockCopier(device, host, names, options=self.options, block_dim=0)

    # -------------------------------------------------------------- ids
    def job_ids(self, group_sizes: Sequence[int], block_indices: Sequence[int], device_ids,
                chunk_ids) -> Tuple[List[list], List[list], np.ndarray]:
        """Per copier group the device block ids and the chunk ids of one job, and the
        sub-block index of each block of the call in the copier's order. ``ValueError``
        when the counts do not add up (nothing has moved then)."""
        bpc = self.bpc
        dev_ids = np.asarray(device_ids, dtype=np.int64)
        chunks_all = np.asarray(chunk_ids, dtype=np.int64)
        if len(group_sizes) != self.num_groups or len(block_indices) != self.num_groups:
            raise ValueError(f"offloading: a job for {len(group_sizes)} KV cache groups, the caches have "
                             f"{self.num_groups}")
        dev: List[list] = []
        host: List[list] = []
        subs: List[np.ndarray] = []
        d_at = c_at = 0
        for n, first in zip(group_sizes, block_indices):
            n = int(n)
            skip = int(first) % bpc
            n_chunks = -(-(n + skip) // bpc) if n else 0
            blocks, chunks = dev_ids[d_at:d_at + n], chunks_all[c_at:c_at + n_chunks]
            d_at, c_at = d_at + n, c_at + n_chunks
            if len(blocks) != n or len(chunks) != n_chunks:
                break  # too few ids: refused below
            pos = skip + np.arange(n, dtype=np.int64)
            chunk_of, j_of = chunks[pos // bpc], pos % bpc
            for j in range(bpc):
                sel = j_of == j if bpc > 1 else slice(None)
                dev.append(blocks[sel].tolist())
                host.append(chunk_of[sel].tolist())
                subs.append(chunk_of[sel] * bpc + j)
        if d_at != len(dev_ids) or c_at != len(chunks_all):
            raise ValueError(f"offloading: {len(dev_ids)} device blocks and {len(chunks_all)} chunks do not match "
                             f"group sizes {list(group_sizes)} from block indices {list(block_indices)} "
                             f"({bpc} blocks per chunk)")
        return dev, host, np.concatenate(subs) if subs else np.zeros(0, np.int64)

    # -------------------------------------------------------------- jobs
    def submit(self, job_id: int, store: bool, group_sizes: Sequence[int], block_indices: Sequence[int],
               device_ids, chunk_ids, queue: str = "") -> None:
        """Start a job: ``store`` copies device blocks to chunks, else chunks to device
        blocks. ``queue`` (device jobs): "store", "load" (the default by direction) or
        "expedited". The ids are checked before any byte moves."""
        queue = queue or ("store" if store else "load")
        if queue not in QUEUES:
            raise ValueError(f"offloading: queue must be one of {QUEUES}, got {queue!r}")
        dev, host, subs = self.job_ids(group_sizes, block_indices, device_ids, chunk_ids)
        direction = "d2h" if store else "h2d"
        call = self.copier.plan(direction, dev, host)
        n = len(subs)
        sums = torch.empty(n, dtype=torch.int64, device=self.device) if self.options.checksum and n else None
        job = _Job(job_id, store, call.total_bytes, subs, sums)
        if sums is not None and not store:
            job.expected, job.stored = self._sums[subs], self._stored[subs]
            job.unstored = int(n - np.count_nonzero(job.stored))
        if self.on_gpu:
            self._enqueue(queue, job, direction, call)
        else:
            t0 = time.perf_counter()
            self.copier.run(direction, call, sums)
            job.seconds = time.perf_counter() - t0
            self._done.append(self._finish(job))

    def _enqueue(self, queue: str, job: _Job, direction: str, call: CallPlan) -> None:
        stream = self._streams[queue]
        job.start = torch.cuda.Event(enable_timing=True)
        job.end = torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            job.start.record(stream)
            self.copier.run(direction, call, job.sums)
            if job.sums is not None:
                job.sums_host = torch.empty(len(job.subs), dtype=torch.int64, pin_memory=True)
                job.sums_host.copy_(job.sums, non_blocking=True)
            job.end.record(stream)
        self._queues[queue].append(job)
        self._events[job.job_id] = job.end

    def _finish(self, job: _Job) -> JobResult:
        """A finished job's sums recorded (store) or compared (load)."""
        bad = 0
        chunks: Tuple[int, ...] = ()
        if job.sums is not None:
            got = (job.sums_host if job.sums_host is not None else job.sums).numpy().view(np.uint64)
            if job.store:
                self._sums[job.subs] = got
                self._stored[job.subs] = True
            else:
                assert job.expected is not None and job.stored is not None
                differ = (got != job.expected) & job.stored
                bad = int(np.count_nonzero(differ))
                if bad or job.unstored:
                    chunks = tuple(np.unique(job.subs[differ | ~job.stored] // self.bpc).tolist())
        seconds = job.seconds if job.end is None else job.start.elapsed_time(job.end) * 1e-3
        return JobResult(job.job_id, job.store, not (bad or job.unstored), job.num_bytes, seconds, bad,
                         job.unstored, chunks)

    def finished(self) -> List[JobResult]:
        """The jobs finished since the last call (device jobs: polled, never waited for)."""
        out, self._done = self._done, []
        for jobs in self._queues.values():
            while jobs and jobs[0].end.query():
                job = jobs.popleft()
                self._events.pop(job.job_id, None)
                out.append(self._finish(job))
        return out

    def wait(self, job_ids: Set[int]) -> None:
        """Block until the named device jobs are done (unknown or CPU ids: nothing)."""
        for job_id in job_ids:
            event = self._events.get(job_id)
            if event is not None:
                event.synchronize()

    def close(self) -> None:
        """Let every device job finish, then release the copier. Idempotent."""
        for stream in self._streams.values():
            stream.synchronize()
        for jobs in self._queues.values():
            jobs.clear()
        self._events.clear()
        self.copier.close()
