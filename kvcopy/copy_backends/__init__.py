"""Copy backends and how ``auto`` picks one.

Every backend executes the same thing: the static :class:`~kvcopy.core.tables.CopyTables`
of one copier direction and one packed :class:`~kvcopy.core.tables.CallPlan`, enqueued on
the caller's current stream (CPU backends run synchronously: there is no stream).

========  ==========================================================================
torch     the reference: per group, per layer ``index_select``/``index_copy_``; any
          device; the oracle for every test
cpu       the CUDA item body (``kernels/block_copy.cuh``) compiled for the host, one
          C call per copy (CPU tensors on both sides)
triton    fused Triton kernel, one launch (CUDA tensors, or CPU under
          ``TRITON_INTERPRET=1``)
cuda      fused CUDA kernel, one launch, SMs reading pinned host memory over UVA
ce        copy engines: one ``cudaMemcpyBatchAsync`` for every segment of the call
========  ==========================================================================

A backend module is imported only when first asked for, so a missing optional
dependency (triton, the native library) costs nothing until it is needed and is then
reported by :func:`available_copy_backends` with the reason.
"""
from __future__ import annotations

import importlib
from typing import Dict, Optional

import torch

from ..core.tables import CallPlan, CopyTables


class Backend:
    """Interface of a copy backend; one instance per process."""

    name = "?"

    def unavailable_reason(self) -> Optional[str]:
        """Why this install cannot run the backend at all, or None."""
        return None

    def unsupported_reason(self, tables: CopyTables) -> Optional[str]:
        """Why this backend cannot run these tables (devices, alignment), or None."""
        return None

    def prepare(self, tables: CopyTables) -> None:
        """Once per copier direction: upload tables, pin host memory, compile; keeps
        what it made in ``tables.backend_state[self.name]``."""

    def state(self, tables: CopyTables):
        """What :meth:`prepare` kept for these tables, preparing them on first use."""
        st = tables.backend_state.get(self.name)
        if st is None:
            self.prepare(tables)
            st = tables.backend_state[self.name]
        return st

    def release(self, tables: CopyTables) -> None:
        """Undo :meth:`prepare`: drop the state, unpin what it pinned (``.pinning``).

        Copies may still be in flight on any stream the caller used, reading the device
        tables this drops: the device is synchronized first (closing a copier is not on
        the per-call path)."""
        st = tables.backend_state.pop(self.name, None)
        if st is None:
            return
        for dev in {tables.src_device, tables.dst_device}:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        pinning = getattr(st, "pinning", None)
        if pinning is not None:
            pinning.release()

    def copy(self, tables: CopyTables, call: CallPlan, max_ctas: Optional[int] = None) -> None:
        """Enqueue the call's copy; ``max_ctas`` (checked by the caller, None: none) caps
        this call's grid below the tables' own cap, on a backend with a grid (a kernel);
        the others take it and copy as without."""
        raise NotImplementedError

    # Checksums (kvcopy.core.checksum): the backends that compute them while copying
    # override both methods.
    def checksum_reason(self, tables: CopyTables) -> Optional[str]:
        """Why this backend cannot compute checksums while copying these tables, or None."""
        return f"backend {self.name!r} does not compute checksums"

    def copy_with_checksums(self, tables: CopyTables, call: CallPlan, out: torch.Tensor,
                            max_ctas: Optional[int] = None) -> None:
        """``copy``, and the call's page checksums into ``out`` (int64, one per block of
        the call, on the copy's device; checked by the caller), stream-ordered."""
        raise NotImplementedError(self.checksum_reason(tables))

    def copy_with_checksums_folded(self, tables: CopyTables, call: CallPlan, out: torch.Tensor,
                                   fold_at: int, max_ctas: Optional[int] = None) -> Optional[int]:
        """``copy_with_checksums``, then, where this backend can do it in the same host
        call, the fold at ``fold_at`` (a :class:`kvcopy.core.checksum.SumFold`'s block) of
        ``out``: the count of values differing from the fold's ``want``. None where it
        cannot: the copy and its sums are made, nothing is folded."""
        self.copy_with_checksums(tables, call, out, max_ctas)
        return None


# name -> "module:Class", imported lazily.
_REGISTRY = {
    "torch": "kvcopy.copy_backends.torch_backend:TorchBackend",
    "cpu": "kvcopy.copy_backends.cpu:CpuBackend",
    "triton": "kvcopy.copy_backends.triton_backend:TritonBackend",
    "cuda": "kvcopy.copy_backends.cuda:CudaBackend",
    "ce": "kvcopy.copy_backends.ce:CopyEngineBackend",
}
COPY_BACKENDS = tuple(_REGISTRY)

_instances: Dict[str, Backend] = {}
_import_errors: Dict[str, str] = {}


def get_backend(name: str) -> Backend:
    """The backend instance for ``name``; raises ``ValueError`` if it cannot run here."""
    backend = _load(name)
    if backend is None:
        raise ValueError(f"backend {name!r} is not available: {_import_errors[name]}")
    reason = backend.unavailable_reason()
    if reason:
        raise ValueError(f"backend {name!r} is not available: {reason}")
    return backend


def _load(name: str) -> Optional[Backend]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown copy backend {name!r}; known: {', '.join(COPY_BACKENDS)} or 'auto'")
    if name in _instances:
        return _instances[name]
    if name in _import_errors:
        return None
    module_name, cls_name = _REGISTRY[name].split(":")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:  # not written yet, or a missing dep
        _import_errors[name] = f"{type(exc).__name__}: {exc}"
        return None
    _instances[name] = cls()
    return _instances[name]


def available_copy_backends() -> Dict[str, Optional[str]]:
    """Each backend's name mapped to None when this install can run it, else why not."""
    out: Dict[str, Optional[str]] = {}
    for name in COPY_BACKENDS:
        backend = _load(name)
        out[name] = _import_errors[name] if backend is None else backend.unavailable_reason()
    return out


# ``auto``. On the host: the first of cpu, torch that runs. On a GPU: the measured
# rule of kvcopy.copy_backends.calibration (mean descriptor size per call; a per-device table from
# `kvcopy-bench calibrate`, else copy engines from 64 KiB descriptors up, the SM
# kernel below), applied per call by kvcopy.copy_backends.auto.AutoGpuBackend over the GPU
# backends that can run the tables; torch when none can.
_AUTO_ORDER_CPU = ("cpu", "torch")
_AUTO_GPU = ("ce", "cuda", "triton")


def _reason(name: str, tables: CopyTables) -> Optional[str]:
    backend = _load(name)
    if backend is None:
        return _import_errors[name]
    return backend.unavailable_reason() or backend.unsupported_reason(tables)


def choose_backend(tables: CopyTables) -> Backend:
    """The backend ``auto`` uses for these tables."""
    on_gpu = tables.src_device.type == "cuda" or tables.dst_device.type == "cuda"
    reasons = []
    if on_gpu:
        usable = {}
        for name in _AUTO_GPU:
            why = _reason(name, tables)
            if why is None:
                usable[name] = _instances[name]
            else:
                reasons.append(f"{name}: {why}")
        if len(usable) == 1:
            return next(iter(usable.values()))
        if usable:
            from .calibration import device_key, load_table
            from .auto import AutoGpuBackend

            dev = tables.src_device if tables.src_device.type == "cuda" else tables.dst_device
            direction = "h2d" if tables.src_device.type == "cpu" else "d2h"
            table = load_table(device_key(dev.index or 0))
            return AutoGpuBackend(usable, direction, table)
    for name in (("torch",) if on_gpu else _AUTO_ORDER_CPU):
        why = _reason(name, tables)
        if why is None:
            return _instances[name]
        reasons.append(f"{name}: {why}")
    raise ValueError("no backend can run this copy: " + "; ".join(reasons))
