"""vLLM 0.33's own CPU offloading worker, run on CPU tensors: the reference for
:mod:`kvcopy.vllm.offload` in its tests and its benchmark. Imports vLLM.

vLLM's ``CPUOffloadingWorker`` and its ``SingleDirectionOffloadingHandler`` run as they
are (descriptor building per job: group sizes, block indices, sub-block skips; their
own host tensors), with three stand-ins for what needs CUDA: the device tensors are
CPU tensors of a subclass that reports ``is_cuda`` (the handler asserts it), the
batched DMA call (``ops.swap_blocks_batch``, ``cuMemcpyBatchAsync``) is a function
that copies each of its descriptors (:func:`memmove_batch`, or a faster one the caller
gives), and the CUDA streams and events it takes from its pools are objects that do
nothing (the copy is done when the call returns).
"""
from __future__ import annotations

import ctypes
from typing import Callable, Optional

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor, TransferResult
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker


class ReportsCuda(torch.Tensor):
    """A CPU tensor vLLM's handler accepts as a device tensor."""

    @property
    def is_cuda(self):
        return True


class NoEvent:
    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.0


class NoStream:
    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass


def memmove_batch(src, dst, sizes, is_src_access_order_any=False):
    """What ``cuMemcpyBatchAsync`` does with vLLM's descriptors: one memmove each."""
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, n)


class VllmCpuWorker:
    """vLLM's ``CPUOffloadingWorker`` over ``kv_caches`` (module docstring); ``batch``
    copies a job's descriptors ``(src pointers, dst pointers, sizes)``."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int,
                 batch: Optional[Callable] = None):
        tensors = [CanonicalKVCacheTensor(ct.tensor.as_subclass(ReportsCuda), ct.page_size_bytes)
                   for ct in kv_caches.tensors]
        self.worker = CPUOffloadingWorker(CanonicalKVCaches(tensors, kv_caches.group_data_refs), blocks_per_chunk,
                                          num_chunks)
        self.handlers = (self.worker._store_handler, self.worker._load_handler, self.worker._expedited_load_handler)
        for h in self.handlers:
            h._swap_blocks_batch = batch or memmove_batch
        self.cpu_tensors = self.handlers[0].dst_tensors

    def _run(self, submit, *args) -> TransferResult:
        for h in self.handlers:  # a transfer takes two events and a stream from the pools
            h._event_pool[:] = [NoEvent(), NoEvent()]
            h._stream_pool[:] = [NoStream()]
        assert submit(*args)
        (done,) = self.worker.get_finished()
        assert done.success
        return done

    def store(self, job_id, gpu_spec, cpu_spec) -> TransferResult:
        return self._run(self.worker.submit_store, job_id, gpu_spec, cpu_spec)

    def load(self, job_id, cpu_spec, gpu_spec, expedited=False) -> TransferResult:
        return self._run(self.worker.submit_load, job_id, cpu_spec, gpu_spec, expedited)
