"""What the GPU backends (``cuda``, ``ce``) share: device facts, which device a copy is
on, the current device and stream, and availability resolved once.

Device facts (:func:`device_info`): the SM count, for the grid rule, and whether
kernels may use registered host pointers as they are
(``cudaDevAttrCanUseHostPointerForRegisteredMem``; where it is 0 the ``cuda`` backend
translates them). Cached per device. Nothing here imports torch's CUDA state before
a GPU backend is asked for.
"""
from __future__ import annotations

import ctypes
from typing import Callable, Dict, Optional, Tuple

from .. import native
from ..core.tables import CopyTables

_device_info: Dict[int, Tuple[int, bool]] = {}


def device_info(device: int) -> Tuple[int, bool]:
    """(SM count, kernels may use registered host pointers as is) of ``device``."""
    if device not in _device_info:
        import torch

        sms = torch.cuda.get_device_properties(device).multi_processor_count
        usable = True
        lib, _ = native.load("kvcopy_cuda")
        if lib is not None:
            sm, ok = ctypes.c_int(0), ctypes.c_int(1)
            native.check(lib.kvcopy_cuda_device_info(device, ctypes.byref(sm), ctypes.byref(ok)),
                          "cudaDeviceGetAttribute")
            usable = bool(ok.value)
        else:
            from .pinning import host_pointer_usable

            usable = host_pointer_usable(device)
        _device_info[device] = (sms, usable)
    return _device_info[device]


def gpu_side(tables: CopyTables) -> Tuple[Optional[int], Optional[str]]:
    """(CUDA device index of the tables, None) or (None, why they are not a GPU copy)."""
    devs = {tables.src_device, tables.dst_device}
    cuda = [d for d in devs if d.type == "cuda"]
    if not cuda:
        return None, f"needs a CUDA tensor on one side, got {tables.src_device} -> {tables.dst_device}"
    if len(cuda) > 1:
        return None, f"both sides on different GPUs ({tables.src_device}, {tables.dst_device})"
    others = [d for d in devs if d.type not in ("cuda", "cpu")]
    if others:
        return None, f"unsupported device {others[0]}"
    for t in list(tables.src_tensors) + list(tables.dst_tensors):
        if t.device.type == "cuda" and t.device != cuda[0]:
            return None, f"tensors on several GPUs ({t.device} and {cuda[0]})"
    index = cuda[0].index
    if index is None:
        import torch

        index = torch.cuda.current_device()
    return index, None


def require_gpu(tables: CopyTables, backend: str) -> int:
    """The CUDA device index of ``tables``, or ``ValueError`` saying why they are not a
    copy ``backend`` can run."""
    device, why = gpu_side(tables)
    if device is None:
        raise ValueError(f"backend {backend!r}: {why}")
    return device


def call_on_device(device: int, fn: Callable, *args):
    """``fn(*args)`` with ``device`` current (a guard only when it is not already)."""
    import torch

    if torch.cuda.current_device() == device:
        return fn(*args)
    with torch.cuda.device(device):
        return fn(*args)


def raw_stream_getter() -> Callable[[int], int]:
    """device -> the current stream's raw pointer, without building a Stream object
    (``torch.cuda.current_stream`` builds one per call; torch's raw getter does not)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


def current_device_getter() -> Callable[[], int]:
    """() -> the current CUDA device index (torch's raw getter where it has one)."""
    import torch

    return getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def cuda_unavailable() -> Optional[str]:
    """Why no kernel can run here (no device), saying too whether ``libkvcopy_cuda.so``
    was built at install: "not built (no nvcc)" and "no device here" are different
    fixes."""
    import torch

    if torch.cuda.is_available():
        return None
    return f"no CUDA device here (torch.cuda.is_available() is False); {native.build_note('kvcopy_cuda')}"


class GpuBackendBase:
    """What ``cuda`` and ``ce`` share: availability resolved once, on first question
    (``_find`` returns None or why not), and GPU tables only."""

    _why: Optional[str] = None
    _resolved = False

    def _find(self) -> Optional[str]:
        raise NotImplementedError

    def _resolve(self) -> None:
        if not self._resolved:
            self._resolved = True
            self._why = cuda_unavailable() or self._find()

    def unavailable_reason(self) -> Optional[str]:
        self._resolve()
        return self._why

    def unsupported_reason(self, tables: CopyTables) -> Optional[str]:
        return gpu_side(tables)[1]
