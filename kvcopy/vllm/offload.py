"""kvcopy as the copy engine of vLLM 0.33's KV offloading (``OffloadingConnector``).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvcopyOffloadingConnector",
        "kv_connector_module_path": "kvcopy.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"spec_name": "KvcopyOffloadingSpec",
            "spec_module_path": "kvcopy.vllm", "cpu_bytes_to_use": 68719476736}}'

:class:`KvcopyOffloadingSpec` is vLLM's CPU offloading spec (``CPUOffloadingSpec``:
its manager, eviction policies, chunk sizing, ``blocks_per_chunk``/``block_size``
ratios and host layout) whose worker, :class:`KvcopyOffloadingWorker`, moves the bytes
with :class:`kvcopy.offload.OffloadCopier` instead of vLLM's per-page descriptors
(``cuMemcpyBatchAsync`` for stores, a Triton kernel for small loads): one
:class:`~kvcopy.core.copier.BlockCopier` call per transfer job for every KV cache group and
layer, each group masked to its own layers, the backend ``auto`` (or the one named)
per device and direction. vLLM's connector hands the spec ``CanonicalKVCaches`` (int8
``(num_blocks, page)`` device tensors, per group one ``(tensor, page bytes)`` ref per
layer); the host tensors are vLLM's: a private zeroed tensor per device tensor (pinned
on a GPU), or on CUDA this worker's slot of each row of its shared ``/dev/shm`` region
(:mod:`kvcopy.offload` has the byte layout).

Checksums (``kv_connector_extra_config["kvcopy"]["checksum"]``, on by default): each
store's copy computes one sum per sub-block page, each load's copy the sums of what it
reads, compared with the stored ones when the job completes (:mod:`kvcopy.offload`). A
mismatch fails the load. vLLM 0.33's ``OffloadingConnector`` has no failure path for
offloading jobs (its worker asserts every ``TransferResult`` succeeded: "we currently
do not support job failures"), so :class:`KvcopyOffloadingConnector` routes the failed
load to vLLM's connector load-failure path, ``failed_recving`` (with
``kv_load_failure_policy="recompute"`` the scheduler recomputes the request from its
first token; vLLM's default ``"fail"`` ends it with an error), and drops the job's
chunks from the manager so the retry misses them. Under the stock
``OffloadingConnector`` a mismatch is logged and reported as a failed job, which vLLM's
assertion turns into a stopped engine: never a wrong byte served.

Refused with a clear error: ``canonical_layout`` (the topology-free host layout of
vLLM's tiering spec; vLLM's CPU spec does not write it either), an XPU device (no
kvcopy backend), the ``LHBNC`` KV cache layout (a block's bytes of one layer are not
together there: vLLM's own spec would copy the wrong bytes), and with checksums on:
sync loads (``sync_load_budget_bytes`` > 0: a failed sync load has no failure path
for several KV cache groups). With checksums on, the single-copy MLA host layout
(``replicated_layout``, TP > 1) is not used: every rank stores and checks its own
copy.

GPU jobs run on one stream per queue (store, load, expedited load), each waiting for
the compute stream as vLLM's do: no host synchronization on the engine thread (``wait``
synchronizes the jobs vLLM names). vLLM's own spec refuses the CPU platform; this one
runs there too (KV caches on the CPU, jobs copied in the call). Importing this module
needs vLLM 0.33.x (``ImportError`` naming the version otherwise).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Set

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.torch_utils import PIN_MEMORY
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec, CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingEvent, OffloadingWorker,
    OffloadKey, TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.gpu_worker import pin_mmap_region
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import _REGION_SEGMENTS, CPUOffloadingSpec, _all_workers_barrier
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from ..offload import JobResult, OffloadCopier, OffloadOptions
from .config import OFFLOAD_SURFACE, parse

logger = init_logger("vllm.kvcopy.offload")

__all__ = ["KvcopyOffloadingConnector", "KvcopyOffloadingSpec", "KvcopyOffloadingWorker", "OffloadOptions"]


# ---------------------------------------------------------------- the worker
class KvcopyOffloadingWorker(OffloadingWorker):
    """vLLM's offloading worker interface over :class:`~kvcopy.offload.OffloadCopier`."""

    def __init__(self, kv_caches: CanonicalKVCaches, cpu_tensors: Sequence[torch.Tensor], blocks_per_chunk: int,
                 options: OffloadOptions, region: Optional[SharedOffloadRegion] = None):
        self.kv_caches = kv_caches
        self.cpu_tensors = list(cpu_tensors)
        self.options = options
        self._region = region
        groups = [[(ref.tensor_idx, ref.page_size_bytes) for ref in refs] for refs in kv_caches.group_data_refs]
        for i, ct in enumerate(kv_caches.tensors):
            if ct.tensor.dim() != 2 or ct.tensor.shape[1] != ct.page_size_bytes:
                raise ValueError(f"KvcopyOffloadingSpec: canonical KV tensor {i} of shape {tuple(ct.tensor.shape)} "
                                 f"with page_size_bytes {ct.page_size_bytes}")
        self.jobs = OffloadCopier([ct.tensor for ct in kv_caches.tensors], groups, self.cpu_tensors, blocks_per_chunk,
                                  options)
        self.copier = self.jobs.copier
        # True once a connector takes the failed loads (KvcopyOffloadingConnector); until
        # then a failed load is reported as a failed job, which vLLM stops on.
        self.reports_failures = False
        self._failed_loads: Set[int] = set()
        copy_backends = self.copier.copy_backends()
        logger.info(
            "kvcopy offloading: backend %s (store %s, load %s), %d KV cache groups, %d copier layers, %d chunks x %d "
            "blocks, checksums %s", self.copier.copy_backend, copy_backends["to_host"], copy_backends["to_device"],
            self.jobs.num_groups, sum(len(g) for g in self.copier.layer_groups), self.jobs.num_chunks,
            blocks_per_chunk, "on" if options.checksum else "off")

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        self._submit(job_id, src_spec, dst_spec, True, "store")
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        self._submit(job_id, dst_spec, src_spec, False, "expedited" if expedited else "load")
        return True

    def _submit(self, job_id: int, gpu_spec, cpu_spec, store: bool, queue: str) -> None:
        if not isinstance(gpu_spec, GPULoadStoreSpec) or not isinstance(cpu_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"job {job_id}: expected a GPULoadStoreSpec and a CPU block spec, got "
                            f"{type(gpu_spec).__name__} and {type(cpu_spec).__name__}")
        self.jobs.submit(job_id, store, gpu_spec.group_sizes, gpu_spec.block_indices, gpu_spec.block_ids,
                         cpu_spec.block_ids, queue)

    def get_finished(self) -> List[TransferResult]:
        out = []
        for r in self.jobs.finished():
            ok = r.ok or self._load_failed(r)
            out.append(TransferResult(job_id=r.job_id, success=ok, transfer_size=r.num_bytes,
                                      transfer_time=r.seconds))
        return out

    def _load_failed(self, r: JobResult) -> bool:
        """Log a load that failed its checksums; True when the connector reports it."""
        logger.error("kvcopy offloading: load job %d failed its checksums: %d pages differ from what their store "
                     "computed, %d were never stored with a checksum (chunks %s)%s", r.job_id, r.bad_pages,
                     r.unstored_pages, list(r.bad_chunks),
                     "; the request is reported as a failed KV load" if self.reports_failures else
                     "; vLLM's OffloadingConnector has no load failure path and stops on a failed job: use "
                     "KvcopyOffloadingConnector (kv_connector_module_path kvcopy.vllm) to recompute instead")
        if self.reports_failures:
            self._failed_loads.add(r.job_id)
        return self.reports_failures

    def take_failed_loads(self) -> Set[int]:
        """Load jobs reported finished whose checksums failed, since the last call."""
        out, self._failed_loads = self._failed_loads, set()
        return out

    def wait(self, job_ids: Set[int]) -> None:
        self.jobs.wait(job_ids)

    def shutdown(self) -> None:
        self.jobs.close()
        self.cpu_tensors.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


# ---------------------------------------------------------------- the spec
class KvcopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec (manager, policies, sizes, host layout) with
    :class:`KvcopyOffloadingWorker` as its worker."""

    def __init__(self, config: OffloadingConfig):
        self.options = parse(config.extra_config.get("kvcopy"), OFFLOAD_SURFACE)
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
        if role == KVConnectorRole.SCHEDULER and parse(extra.get("kvcopy"), OFFLOAD_SURFACE).checksum \
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

