"""kvcopy as the copy engine of vLLM 0.33's KV offloading (``OffloadingConnector``).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvcopyOffloadingConnector",
        "kv_connector_module_path": "kvcopy.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"spec_name": "KvcopyOffloadingSpec",
            "spec_module_path": "kvcopy.vllm", "cpu_bytes_to_use": 68719476736}}'

:class:`KvcopyOffloadingSpec` is vLLM's CPU offloading spec (``CPUOffloadingSpec``:
its manager, eviction policies, chunk sizing, ``blocks_per_chunk``/``block_size``
ratios and host layout) whose worker, :class:`KvcopyOffloadingWorker`, moves the bytes
with kvcopy instead of vLLM's per-page descriptors (``cuMemcpyBatchAsync`` for stores,
a Triton kernel for small loads): one :class:`~kvcopy.copier.BlockCopier` call per
transfer job for every KV cache group and layer, each group masked to its own layers,
the backend ``auto`` (or the one named) per device and direction.

Layout. vLLM's connector hands the spec ``CanonicalKVCaches``: int8 device tensors
``(num_blocks, page)`` with block stride ``S`` (``S > page`` for padded or packed
rows), and per group one ref per layer (tensor index, unpadded page bytes). vLLM's
host tensor of device tensor ``t`` is ``(num_chunks, blocks_per_chunk * page_t)``: a
private zeroed (pinned on a GPU) tensor, or on CUDA a strided view of its shared
``/dev/shm`` region (rows ``row_stride`` apart, this worker's slot of each row).
Sub-block ``j`` of chunk ``c`` of tensor ``t`` is bytes ``[j * page_t, j * page_t +
ref bytes)`` of row ``c``. The copier sees one "layer" per (group ``g``, sub-block
``j``, ref ``k``): the device view ``t[:, :ref bytes]`` and the host view ``row[:, j *
page_t:][:, :ref bytes]`` (rows strided), in copier group ``g * blocks_per_chunk + j``.
A job's ids per copier group: the GPU blocks and the chunk ids of the sub-blocks at
position ``j`` (the first chunk of a group may start mid-chunk: vLLM's
``block_indices`` give the skip).

Checksums (``kv_connector_extra_config["kvcopy"]["checksum"]``, on by default): a
store's copy computes one 64-bit sum per sub-block page (:mod:`kvcopy.checksum`: the
copy's own words, keyed by position and layer, summed over the group's layers), kept
per worker in host memory (8 bytes per sub-block); a load's copy computes the sums of
what it reads, and when the job completes they are compared with the stored ones. A
mismatch (or a sub-block with no stored sum) fails the load: vLLM 0.33's
``OffloadingConnector`` has no failure path for offloading jobs (its worker asserts
every ``TransferResult`` succeeded), so :class:`KvcopyOffloadingConnector` routes it
to vLLM's connector load-failure path, ``failed_recving`` (with
``kv_load_failure_policy="recompute"`` the scheduler recomputes the request; vLLM's
default ``"fail"`` ends it with an error), and drops the job's chunks from the
manager so the retry misses them. Under the stock ``OffloadingConnector`` a mismatch
is logged and reported as a failed job, which vLLM's assertion turns into a stopped
engine: never a wrong byte served.

Refused with a clear error: ``canonical_layout`` (the topology-free host layout of
vLLM's tiering spec; vLLM's CPU spec does not write it either), an XPU device (no
kvcopy backend), the ``LHBNC`` KV cache layout (a block's bytes of one layer are not
together there: vLLM's own spec would copy the wrong bytes), and with checksums on:
sync loads (``sync_load_budget_bytes`` > 0: a failed sync load has no failure path
for several KV cache groups). With checksums on, the single-copy MLA host layout
(``replicated_layout``, TP > 1) is not used: every rank stores and checks its own
copy.

GPU jobs run on one stream per direction (and one for expedited loads), each waiting
for the compute stream as vLLM's do, with events for completion and timing: no host
synchronization on the engine thread (``wait`` synchronizes the jobs it is asked
to). CPU jobs (KV caches on the CPU) copy in the call. Importing this module needs
vLLM 0.33.x (``ImportError`` naming the version otherwise).
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

SUPPORTED_VLLM = "0.33"


def _require_vllm() -> str:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"kvcopy.vllm_offload needs vLLM {SUPPORTED_VLLM}.x; vLLM is not importable: {exc}") \
            from exc
    version = getattr(vllm, "__version__", "unknown")
    if version.split("+")[0].rsplit(".", 1)[0] != SUPPORTED_VLLM:
        raise ImportError(f"kvcopy.vllm_offload needs vLLM {SUPPORTED_VLLM}.x, found vLLM {version}")
    return version


VLLM_VERSION = _require_vllm()

import torch  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.logger import init_logger  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.utils.torch_utils import PIN_MEMORY  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    BlockIDsLoadStoreSpec, CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingEvent, OffloadingWorker,
    OffloadKey, TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402
from vllm.v1.kv_offload.cpu.gpu_worker import pin_mmap_region  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import _REGION_SEGMENTS, CPUOffloadingSpec, _all_workers_barrier  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from .copier import BlockCopier  # noqa: E402

logger = init_logger("vllm.kvcopy.offload")

__all__ = ["KvcopyOffloadingConnector", "KvcopyOffloadingSpec", "KvcopyOffloadingWorker", "OffloadOptions"]


# ---------------------------------------------------------------- options
@dataclass(frozen=True)
class OffloadOptions:
    """``kv_connector_extra_config["kvcopy"]`` of the offloading spec."""

    checksum: bool = True  # page sums computed by stores, compared by loads
    backend: str = "auto"  # a kvcopy backend name; auto: measured choice per device and call
    max_ctas: Optional[int] = None  # grid cap of the kernel backends (None: kvcopy's default)

    def __post_init__(self) -> None:
        if not isinstance(self.checksum, bool):
            raise ValueError(f"kvcopy.checksum must be true or false, got {self.checksum!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"kvcopy.backend must be a backend name, got {self.backend!r}")
        if self.max_ctas is not None and (isinstance(self.max_ctas, bool) or not isinstance(self.max_ctas, int)
                                          or self.max_ctas < 1):
            raise ValueError(f"kvcopy.max_ctas must be a positive integer, got {self.max_ctas!r}")

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any]) -> "OffloadOptions":
        raw = extra_config.get("kvcopy") or {}
        if not isinstance(raw, Mapping):
            raise ValueError(f"kv_connector_extra_config['kvcopy'] must be an object, got {raw!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config['kvcopy']: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(raw))


# ---------------------------------------------------------------- the copy layout
def _check_canonical(kv_caches: CanonicalKVCaches) -> torch.device:
    """The device of the canonical tensors, after checking each is an int8 row view
    whose rows do not overlap and each ref fits its tensor's page."""
    if not kv_caches.tensors:
        raise ValueError("KvcopyOffloadingSpec: vLLM handed no KV cache tensor to offload")
    devices = set()
    for i, ct in enumerate(kv_caches.tensors):
        t = ct.tensor
        where = f"KvcopyOffloadingSpec: canonical KV tensor {i}"
        if t.dtype != torch.int8 or t.dim() != 2:
            raise ValueError(f"{where} is {t.dtype} of shape {tuple(t.shape)}; vLLM canonicalizes to int8 "
                             "(blocks, page bytes)")
        if t.shape[1] != ct.page_size_bytes:
            raise ValueError(f"{where}: {t.shape[1]} bytes per row, page_size_bytes {ct.page_size_bytes}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{where}: a page's bytes are not contiguous (stride {t.stride()})")
        if t.shape[0] > 1 and t.stride(0) < t.shape[1]:
            raise ValueError(f"{where}: pages of consecutive blocks overlap (block stride {t.stride(0)} < page "
                             f"{t.shape[1]} bytes): this KV cache layout does not keep a block's bytes together")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{where} is on {t.device}: kvcopy copies CPU and CUDA KV caches only")
        devices.add(t.device)
    if len(devices) > 1:
        raise ValueError(f"KvcopyOffloadingSpec: canonical KV tensors on several devices {sorted(map(str, devices))}")
    for g, refs in enumerate(kv_caches.group_data_refs):
        for ref in refs:
            if not 0 <= ref.tensor_idx < len(kv_caches.tensors):
                raise ValueError(f"KvcopyOffloadingSpec: group {g} names tensor {ref.tensor_idx} of "
                                 f"{len(kv_caches.tensors)}")
            page = kv_caches.tensors[ref.tensor_idx].page_size_bytes
            if not 0 < ref.page_size_bytes <= page:
                raise ValueError(f"KvcopyOffloadingSpec: group {g}: a layer page of {ref.page_size_bytes} bytes in "
                                 f"tensor {ref.tensor_idx} of {page}-byte pages")
    return devices.pop()


class CopyLayout:
    """The copier's view of vLLM's canonical caches and host tensors (module docstring)."""

    def __init__(self, kv_caches: CanonicalKVCaches, cpu_tensors: Sequence[torch.Tensor], blocks_per_chunk: int,
                 options: OffloadOptions):
        self.device = _check_canonical(kv_caches)
        if len(cpu_tensors) != len(kv_caches.tensors):
            raise ValueError(f"{len(cpu_tensors)} host tensors for {len(kv_caches.tensors)} KV cache tensors")
        self.bpc = blocks_per_chunk
        self.num_groups = len(kv_caches.group_data_refs)
        self.num_chunks = int(cpu_tensors[0].shape[0])
        self.num_device_blocks = min(int(ct.tensor.shape[0]) for ct in kv_caches.tensors)
        device: Dict[str, torch.Tensor] = {}
        host: Dict[str, torch.Tensor] = {}
        groups: List[List[str]] = []
        for g, refs in enumerate(kv_caches.group_data_refs):
            for j in range(blocks_per_chunk):
                names = []
                for k, ref in enumerate(refs):
                    ct = kv_caches.tensors[ref.tensor_idx]
                    cpu = cpu_tensors[ref.tensor_idx]
                    if cpu.dtype != torch.int8 or tuple(cpu.shape[1:]) != (blocks_per_chunk * ct.page_size_bytes,):
                        raise ValueError(f"host tensor {ref.tensor_idx} is {cpu.dtype} {tuple(cpu.shape)}, expected "
                                         f"int8 (chunks, {blocks_per_chunk * ct.page_size_bytes})")
                    name = f"group{g}.layer{k}.sub{j}"
                    device[name] = ct.tensor[:, :ref.page_size_bytes]
                    start = j * ct.page_size_bytes
                    host[name] = cpu[:, start:start + ref.page_size_bytes]
                    names.append(name)
                groups.append(names)
        self.copier = BlockCopier(device, host, groups, backend=options.backend, block_dim=0,
                                  max_ctas=options.max_ctas)

    def job_ids(self, gpu_spec: GPULoadStoreSpec, cpu_ids: np.ndarray) -> Tuple[list, list, np.ndarray]:
        """Per copier group, the device block ids and host chunk ids of one job; and the
        sub-block index (``chunk * blocks_per_chunk + j``) of each block of the call, in
        the copier's order. ``ValueError`` when the spec's counts do not add up."""
        bpc = self.bpc
        gpu_ids = np.asarray(gpu_spec.block_ids, dtype=np.int64)
        cpu_ids = np.asarray(cpu_ids, dtype=np.int64)
        sizes, starts = list(gpu_spec.group_sizes), list(gpu_spec.block_indices)
        if len(sizes) != self.num_groups or len(starts) != self.num_groups:
            raise ValueError(f"transfer spec for {len(sizes)} KV cache groups, the caches have {self.num_groups}")
        dev: List[list] = []
        hostl: List[list] = []
        subs: List[np.ndarray] = []
        g_off = c_off = 0
        for n, first in zip(sizes, starts):
            n = int(n)
            skip = int(first) % bpc
            n_chunks = -(-(n + skip) // bpc) if n else 0
            gpu = gpu_ids[g_off:g_off + n]
            chunks = cpu_ids[c_off:c_off + n_chunks]
            if len(gpu) != n or len(chunks) != n_chunks:
                raise ValueError(f"transfer spec: {len(gpu_ids)} GPU blocks and {len(cpu_ids)} chunks do not cover "
                                 f"group sizes {sizes} with block indices {starts} ({bpc} blocks per chunk)")
            g_off += n
            c_off += n_chunks
            pos = skip + np.arange(n, dtype=np.int64)
            chunk_of, j_of = chunks[pos // bpc], pos % bpc
            for j in range(bpc):
                sel = j_of == j if bpc > 1 else slice(None)
                dev.append(gpu[sel].tolist())
                hostl.append(chunk_of[sel].tolist())
                subs.append(chunk_of[sel] * bpc + j)
        if g_off != len(gpu_ids) or c_off != len(cpu_ids):
            raise ValueError(f"transfer spec: {len(gpu_ids)} GPU blocks and {len(cpu_ids)} chunks for group sizes "
                             f"{sizes} with block indices {starts} ({bpc} blocks per chunk)")
        return dev, hostl, np.concatenate(subs) if subs else np.zeros(0, np.int64)


# ---------------------------------------------------------------- the worker
@dataclass
class _Job:
    job_id: int
    store: bool
    num_bytes: int
    subs: np.ndarray  # sub-block index of each block of the call
    sums: Optional[torch.Tensor]  # the copy's sums (on the copy's device)
    sums_host: Optional[torch.Tensor]  # ... copied to host memory (GPU jobs)
    expected: Optional[np.ndarray]  # a load's stored sums (uint64)
    unstored: int  # a load's sub-blocks with no stored sum
    start: Any = None  # GPU: timing events
    end: Any = None
    seconds: float = 0.0  # CPU: the copy's wall time


class _Queue:
    """One direction's GPU stream and its jobs in submission order (vLLM's handler
    runs each direction's jobs in order; one stream does that)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.jobs: Deque[_Job] = deque()


class KvcopyOffloadingWorker(OffloadingWorker):
    """vLLM's offloading worker interface with kvcopy's copies (module docstring)."""

    def __init__(self, kv_caches: CanonicalKVCaches, cpu_tensors: Sequence[torch.Tensor], blocks_per_chunk: int,
                 options: OffloadOptions, region: Optional[SharedOffloadRegion] = None):
        self.kv_caches = kv_caches
        self.cpu_tensors = list(cpu_tensors)
        self.options = options
        self._region = region
        self.layout = CopyLayout(kv_caches, self.cpu_tensors, blocks_per_chunk, options)
        self.copier = self.layout.copier
        self.on_gpu = self.layout.device.type == "cuda"
        subs = self.layout.num_chunks * blocks_per_chunk
        self._sums = np.zeros(subs, dtype=np.uint64)  # the last store's sum per sub-block
        self._stored = np.zeros(subs, dtype=bool)  # whether a checksummed store wrote it
        # True once a connector takes the failed loads (KvcopyOffloadingConnector);
        # until then a failed load is reported as a failed job (vLLM stops).
        self.reports_failures = False
        self._failed_loads: Set[int] = set()
        self._done: List[TransferResult] = []  # CPU jobs: finished in the call
        self._events: Dict[int, Any] = {}  # GPU job id -> end event
        if self.on_gpu:
            self._queues = {name: _Queue(self.layout.device) for name in ("store", "load", "expedited")}
        logger.info(
            "kvcopy offloading: backend %s (store %s, load %s), %d KV cache groups, %d copier layers, "
            "%d chunks x %d blocks, checksums %s", self.copier.backend, self.copier.backends()["to_host"],
            self.copier.backends()["to_device"], self.layout.num_groups,
            sum(len(g) for g in self.copier.layer_groups), self.layout.num_chunks, blocks_per_chunk,
            "on" if options.checksum else "off")

    # -------------------------------------------------------------- submission
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, store=True, queue="store")

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        return self._submit(job_id, dst_spec, src_spec, store=False, queue="expedited" if expedited else "load")

    def _submit(self, job_id: int, gpu_spec, cpu_spec, store: bool, queue: str) -> bool:
        if not isinstance(gpu_spec, GPULoadStoreSpec) or not isinstance(cpu_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"job {job_id}: expected a GPULoadStoreSpec and a CPU block spec, got "
                            f"{type(gpu_spec).__name__} and {type(cpu_spec).__name__}")
        dev, host, subs = self.layout.job_ids(gpu_spec, cpu_spec.block_ids)
        direction = "d2h" if store else "h2d"
        call = self.copier.plan(direction, dev, host)  # ids checked before any byte moves
        n = len(subs)
        checksum = self.options.checksum and n > 0
        sums = torch.empty(n, dtype=torch.int64, device=self.layout.device) if checksum else None
        job = _Job(job_id, store, call.total_bytes, subs, sums, None, None, 0)
        if checksum and not store:
            job.expected = self._sums[subs]
            job.unstored = int(n - np.count_nonzero(self._stored[subs]))
        if self.on_gpu:
            self._enqueue(self._queues[queue], job, direction, call)
        else:
            t0 = time.perf_counter()
            self.copier.run(direction, call, sums)
            job.seconds = time.perf_counter() - t0
            self._done.append(self._finish(job))
        return True

    def _enqueue(self, q: _Queue, job: _Job, direction: str, call) -> None:
        job.start = torch.cuda.Event(enable_timing=True)
        job.end = torch.cuda.Event(enable_timing=True)
        # Stores read what the model wrote; loads write blocks whose zeroing may be pending.
        q.stream.wait_stream(torch.cuda.current_stream(self.layout.device))
        with torch.cuda.stream(q.stream):
            job.start.record(q.stream)
            self.copier.run(direction, call, job.sums)
            if job.sums is not None:
                job.sums_host = torch.empty(len(job.subs), dtype=torch.int64, pin_memory=True)
                job.sums_host.copy_(job.sums, non_blocking=True)
            job.end.record(q.stream)
        q.jobs.append(job)
        self._events[job.job_id] = job.end

    # -------------------------------------------------------------- completion
    def _finish(self, job: _Job) -> TransferResult:
        """Record a finished job's sums (store) or compare them (load)."""
        ok = True
        if job.sums is not None:
            got = (job.sums_host if job.sums_host is not None else job.sums).numpy().view(np.uint64)
            if job.store:
                self._sums[job.subs] = got
                self._stored[job.subs] = True
            else:
                assert job.expected is not None
                bad = int(np.count_nonzero(got != job.expected))
                if bad or job.unstored:
                    ok = self._load_failed(job, bad)
        elapsed = job.seconds if job.end is None else job.start.elapsed_time(job.end) * 1e-3
        return TransferResult(job_id=job.job_id, success=ok, transfer_size=job.num_bytes, transfer_time=elapsed)

    def _load_failed(self, job: _Job, bad: int) -> bool:
        first = int(job.subs[0]) // self.layout.bpc if len(job.subs) else -1
        logger.error("kvcopy offloading: load job %d failed its checksums: %d of %d pages differ from what their "
                     "store computed, %d were never stored with a checksum (first chunk %d)%s", job.job_id, bad,
                     len(job.subs), job.unstored, first,
                     "; the request is reported as a failed KV load" if self.reports_failures else
                     "; vLLM's OffloadingConnector has no load failure path and stops on a failed job: use "
                     "KvcopyOffloadingConnector (kv_connector_module_path kvcopy.vllm) to recompute instead")
        if self.reports_failures:
            self._failed_loads.add(job.job_id)
            return True
        return False

    def take_failed_loads(self) -> Set[int]:
        """Load jobs reported finished whose checksums failed, since the last call."""
        out, self._failed_loads = self._failed_loads, set()
        return out

    def get_finished(self) -> List[TransferResult]:
        out, self._done = self._done, []
        if self.on_gpu:
            for q in self._queues.values():
                while q.jobs and q.jobs[0].end.query():
                    job = q.jobs.popleft()
                    del self._events[job.job_id]
                    out.append(self._finish(job))
        return out

    def wait(self, job_ids: Set[int]) -> None:
        for job_id in job_ids:
            event = self._events.get(job_id)
            if event is not None:
                event.synchronize()

    def shutdown(self) -> None:
        if self.on_gpu:
            for q in self._queues.values():
                q.stream.synchronize()
                q.jobs.clear()
            self._events.clear()
        self.copier.close()
        self.cpu_tensors.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


# ---------------------------------------------------------------- the spec
class KvcopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec (manager, policies, sizes, host layout) with
    :class:`KvcopyOffloadingWorker` as its worker."""

    def __init__(self, config: OffloadingConfig):
        self.options = OffloadOptions.from_extra_config(config.extra_config)
        if config.canonical_layout:
            raise ValueError("KvcopyOffloadingSpec: canonical_layout (the topology-free host layout of vLLM's tiering "
                             "spec) is not supported; vLLM's CPU spec does not write it either. Remove "
                             "canonical_layout from kv_connector_extra_config")
        if config.kv_cache_layout == "LHBNC":
            raise ValueError(_LHBNC)
        if self.options.checksum:
            if int(config.extra_config.get("sync_load_budget_bytes", 0) or 0) > 0:
                raise ValueError(
                    "KvcopyOffloadingSpec: checksums with sync loads (sync_load_budget_bytes > 0) are not supported: "
                    "vLLM 0.33 has no failure path for a load its request already runs on with several KV cache "
                    "groups. Set sync_load_budget_bytes to 0 or kvcopy.checksum to false")
            # Each rank keeps the sums of what it stored; a single shared copy would be
            # loaded by ranks that never stored it.
            config = dataclasses.replace(config, replicated_layout=False)
        super().__init__(config)
        self._worker: Optional[KvcopyOffloadingWorker] = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KvcopyOffloadingWorker:
        if self._worker is None:
            if current_platform.is_xpu():
                raise ValueError("KvcopyOffloadingSpec: kvcopy has no XPU backend; use CPUOffloadingSpec on XPU")
            self._check_layout()
            self._worker = self.create_worker(kv_caches)
        return self._worker

    def _check_layout(self) -> None:
        from vllm.config import get_current_vllm_config_or_none

        layout = self.config.kv_cache_layout
        if layout is None:
            cfg = get_current_vllm_config_or_none()
            layout = getattr(getattr(cfg, "cache_config", None), "kv_cache_layout", None)
        if layout == "LHBNC":
            raise ValueError(_LHBNC)

    def create_worker(self, kv_caches: CanonicalKVCaches) -> KvcopyOffloadingWorker:
        if self.num_chunks <= 0:
            raise ValueError(f"KvcopyOffloadingSpec: cpu_bytes_to_use={self.extra_config.get('cpu_bytes_to_use')} "
                             f"holds no chunk of {self.kv_bytes_per_chunk} bytes")
        region = None
        if self._uses_shared_region():
            region = self._shared_region()
        try:
            cpu_tensors = []
            for ct in kv_caches.tensors:
                row = ct.page_size_bytes * self.blocks_per_chunk
                if region is not None:
                    cpu_tensors.append(region.create_next_worker_view(row))
                else:
                    cpu_tensors.append(torch.zeros((self.num_chunks, row), dtype=torch.int8, device="cpu",
                                                   pin_memory=PIN_MEMORY and ct.tensor.is_cuda))
            return KvcopyOffloadingWorker(kv_caches, cpu_tensors, self.blocks_per_chunk, self.options, region)
        except BaseException:
            if region is not None:
                region.cleanup()
            raise

    def _shared_region(self) -> SharedOffloadRegion:
        """vLLM's shared host region with this rank's slot of each row, as its CPU spec
        makes it; pinned whole (kvcopy's kernels then find the memory page-locked; vLLM
        pins only this rank's slots, which kvcopy's per-storage pinning would meet)."""
        parallel = self.config.parallel
        region = SharedOffloadRegion(
            engine_id=self.config.engine_id, num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else parallel.rank, kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker, barrier=_all_workers_barrier,
            num_segments=_REGION_SEGMENTS,
            populate_shard=(parallel.rank, parallel.world_size) if self.replicated_layout else None)
        if PIN_MEMORY:
            pin_mmap_region(region, worker_slot_only=False)
        return region


_LHBNC = ("KvcopyOffloadingSpec: the LHBNC KV cache layout is not supported: a block's bytes of one layer are spread "
          "over its heads there, and vLLM's canonical (blocks, page) view of it names other blocks' bytes (vLLM's own "
          "CPU spec would copy them). Use LBHNC (what OffloadingConnector asks for) or a block-outermost layout")


# ---------------------------------------------------------------- the connector
def drop_chunks(manager: CPUOffloadingManager, keys: Set[OffloadKey]) -> Set[OffloadKey]:
    """Remove ``keys``' chunks from vLLM's CPU manager (a failed checksum: the bytes are
    bad), as its eviction does: policy entry removed, chunk freed, a removal event.
    Returns the keys whose chunks another load still reads (retried later)."""
    left: Set[OffloadKey] = set()
    removed: List[OffloadKey] = []
    for key in keys:
        chunk = manager._policy.get(key)
        if chunk is None or not chunk.is_ready:
            continue  # gone already, or re-stored since (a store in flight owns it)
        if chunk.ref_cnt > 0:
            left.add(key)
            continue
        manager._policy.remove(key)
        manager._num_evictable_cache_chunks -= 1
        manager._free_chunk(chunk)
        removed.append(key)
    if removed and manager.events is not None:
        manager.events.append(OffloadingEvent(keys=removed, medium=manager.medium, removed=True))
    return left


class KvcopyOffloadingConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` with a failure path for loads whose checksums
    fail: reported to vLLM's scheduler as ``failed_recving`` (its connector load-failure
    path; ``kv_load_failure_policy="recompute"`` recomputes), their chunks dropped from
    the manager. Everything else is vLLM's; its spec must be :class:`KvcopyOffloadingSpec`."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config
        spec_cls = OffloadingSpecFactory.get_spec_cls(extra)
        if not issubclass(spec_cls, KvcopyOffloadingSpec):
            raise ValueError(f"KvcopyOffloadingConnector needs spec_name KvcopyOffloadingSpec (spec_module_path "
                             f"kvcopy.vllm), got {spec_cls.__name__}")
        super().__init__(vllm_config, role, kv_cache_config)
        self._doomed: Set[OffloadKey] = set()
        if role == KVConnectorRole.SCHEDULER and OffloadOptions.from_extra_config(extra).checksum \
                and transfer.kv_load_failure_policy != "recompute":
            logger.warning("kvcopy offloading: kv_load_failure_policy is %r: a load that fails its checksums ends its "
                           "request with an error; set it to \"recompute\" to recompute the KV instead",
                           transfer.kv_load_failure_policy)

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]):
        super().register_kv_caches(kv_caches)
        worker = self._offload_worker()
        if worker is not None:
            worker.reports_failures = True

    def _offload_worker(self) -> Optional[KvcopyOffloadingWorker]:
        w = self.connector_worker.worker if self.connector_worker is not None else None
        return w if isinstance(w, KvcopyOffloadingWorker) else None

    def get_transfer_results(self, finished_req_ids: Set[str]):
        cw = self.connector_worker
        assert cw is not None
        load_jobs = dict(cw._load_jobs)  # job -> request (None: a sync load), before vLLM pops them
        results = super().get_transfer_results(finished_req_ids)
        worker = self._offload_worker()
        for job in sorted(worker.take_failed_loads() if worker is not None else ()):
            req_id = load_jobs.get(job)
            if req_id is None:  # the spec refuses sync loads with checksums
                raise RuntimeError(f"kvcopy offloading: sync load job {job} failed its checksums")
            results.finished_recving.add(req_id)
            results.failed_recving.add(req_id)
        return results

    def update_connector_output(self, connector_output) -> None:
        sched = self.connector_scheduler
        assert sched is not None
        # The failed loads' keys, read before vLLM completes the jobs and forgets them.
        for req_id in connector_output.failed_recving or ():
            status = sched._req_status.get(req_id)
            for job_id in status.transfer_jobs if status is not None else ():
                job = sched._jobs.get(job_id)
                if job is not None and not job.is_store:
                    self._doomed |= set(job.keys)
        super().update_connector_output(connector_output)
        if self._doomed:
            manager = sched.manager
            if not isinstance(manager, CPUOffloadingManager):
                raise TypeError(f"KvcopyOffloadingConnector: manager {type(manager).__name__} cannot drop chunks")
            with manager.lock:
                self._doomed = drop_chunks(manager, self._doomed)

