"""The CUDA side of kvcopy's native code: ``libkvcopy_cuda`` through ctypes, or NVRTC.

``libkvcopy_cuda.so`` (``csrc/cuda_copy.cu``, ``csrc/ce_copy.cu``; built by CMake when
nvcc is found) exports a C ABI: every function returns a CUDA error code and
:func:`check` raises :class:`CudaError` with the CUDA error name. When the library is
absent but cupy is installed, the fused kernel is compiled from the same
``kernels/*.cuh`` through NVRTC (:mod:`kvcopy.backends.nvrtc`); the copy-engine path needs the
library.

Also here: the per-device facts both GPU backends use (SM count, whether kernels may
use registered host pointers as is), the grid rule of the fused kernel and the
per-call array it reads (the packed call followed by the block prefix).
"""
from __future__ import annotations

import ctypes
import os
from typing import Dict, Optional, Tuple

import numpy as np

from . import native

_vp, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class CudaError(RuntimeError):
    """A CUDA call made by kvcopy failed; ``name`` is the CUDA error name."""

    def __init__(self, what: str, code: int, name: str):
        super().__init__(f"{what} failed: {name} ({code})")
        self.code = code
        self.name = name


_lib: Optional[ctypes.CDLL] = None
_lib_reason: Optional[str] = None
_loaded = False


def library() -> Tuple[Optional[ctypes.CDLL], Optional[str]]:
    """``(libkvcopy_cuda, None)`` or ``(None, why not)``, argtypes declared."""
    global _lib, _lib_reason, _loaded
    if not _loaded:
        _loaded = True
        lib, why = native.load("kvcopy_cuda")
        if lib is not None:
            try:
                _declare(lib)
            except AttributeError as exc:  # an old build without a symbol
                lib, why = None, f"libkvcopy_cuda.so is out of date ({exc}); rebuild with `pip install -e .`"
        _lib, _lib_reason = lib, why
    return _lib, _lib_reason


def _declare(lib: ctypes.CDLL) -> None:
    sig = {
        "kvcopy_cuda_abi_version": (_int, []),
        "kvcopy_cuda_threads": (_int, []),
        "kvcopy_cuda_inline_words": (_int, []),
        "kvcopy_cuda_params_bytes": (_int, []),
        "kvcopy_cuda_runtime_version": (_int, []),
        "kvcopy_cuda_error_name": (ctypes.c_char_p, [_int]),
        "kvcopy_cuda_error_string": (ctypes.c_char_p, [_int]),
        "kvcopy_cuda_device_count": (_int, [ctypes.POINTER(_int)]),
        "kvcopy_cuda_device_info": (_int, [_int, ctypes.POINTER(_int), ctypes.POINTER(_int)]),
        "kvcopy_cuda_host_device_pointer": (_int, [_vp, ctypes.POINTER(_vp)]),
        "kvcopy_cuda_copy": (_int, [_vp, _i64, _i64, _i64, _vp, _vp, _i64, _i64, _int, _int, _vp]),
        "kvcopy_cuda_stream_capturing": (_int, [_vp, ctypes.POINTER(_int)]),
        "kvcopy_cuda_store_words": (_int, [_vp, _vp, _i64, _vp]),
        "kvcopy_ce_batch_abi": (_int, []),
        "kvcopy_ce_error_name": (ctypes.c_char_p, [_int]),
        "kvcopy_ce_copy": (_int, [_vp, _vp, _vp, _i64, _vp, _int, _int, _int, _int, _vp,
                                  ctypes.POINTER(_int), ctypes.POINTER(_i64)]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def error_name(code: int) -> str:
    lib, _ = library()
    if lib is None:
        return f"CUDA error {code}"
    return lib.kvcopy_ce_error_name(code).decode()


def check(code: int, what: str) -> None:
    if code != 0:
        raise CudaError(what, code, error_name(code))


# ---------------------------------------------------------------- device facts
_device_info: Dict[int, Tuple[int, bool]] = {}


def device_info(device: int) -> Tuple[int, bool]:
    """(SM count, kernels may use registered host pointers as is) of ``device``."""
    if device not in _device_info:
        import torch

        sms = torch.cuda.get_device_properties(device).multi_processor_count
        usable = True
        lib, _ = library()
        if lib is not None:
            sm, ok = _int(0), _int(1)
            check(lib.kvcopy_cuda_device_info(device, ctypes.byref(sm), ctypes.byref(ok)),
                  "cudaDeviceGetAttribute")
            usable = bool(ok.value)
        else:
            from .pinning import host_pointer_usable

            usable = host_pointer_usable(device)
        _device_info[device] = (sms, usable)
    return _device_info[device]


# ---------------------------------------------------------------- the fused kernel
THREADS = 512  # KVCOPY_THREADS in kernels/block_copy_kernel.cuh
INLINE_WORDS = 480  # KVCOPY_INLINE_WORDS
# A warp gets at least this many bytes: below it the seek costs more than the copy.
MIN_BYTES_PER_WARP = int(os.environ.get("KVCOPY_MIN_BYTES_PER_WARP", 4096))
# CTAs per SM when uncapped (the kernel uses 124-128 registers x 512 threads: one fits).
CTAS_PER_SM = int(os.environ.get("KVCOPY_CTAS_PER_SM", 1))


def grid_size(total_bytes: int, sm_count: int, max_ctas: Optional[int]) -> int:
    """CTAs for a call: enough warps that each has >= MIN_BYTES_PER_WARP, at most one
    wave (CTAS_PER_SM per SM), at most ``max_ctas``."""
    warps = THREADS // 32
    need = -(-total_bytes // (warps * MIN_BYTES_PER_WARP))
    cap = sm_count * CTAS_PER_SM
    if max_ctas:
        cap = min(cap, int(max_ctas))
    return max(1, min(need, cap))


def static_table(tables, entries: Optional[np.ndarray] = None) -> np.ndarray:
    """entries | group_offsets | group_entries | entry_bytes_prefix, one int64 array
    (``entries`` replaces the tables' own rows, e.g. with translated host pointers)."""
    from ..tables import RUN_BYTES, RUNS_PER_PAGE

    e = tables.entries if entries is None else entries
    page = (e[:, RUN_BYTES] * e[:, RUNS_PER_PAGE]) if len(e) else np.zeros(0, np.int64)
    prefix = np.zeros(len(tables.group_entries) + 1, dtype=np.int64)
    if len(tables.group_entries):
        np.cumsum(page[tables.group_entries], out=prefix[1:])
    return np.concatenate([e.ravel(), tables.group_offsets, tables.group_entries, prefix]).astype(np.int64)


def call_array(call) -> np.ndarray:
    """The packed call followed by the block prefix over its runs (R+1 values)."""
    g = call.num_groups
    counts = call.packed[2 * (g + 1) + 2 :: 3]
    out = np.empty(len(call.packed) + len(counts) + 1, dtype=np.int64)
    n = len(call.packed)
    out[:n] = call.packed
    out[n] = 0
    np.cumsum(counts, out=out[n + 1 :])
    return out


# ---------------------------------------------------------------- tables on a GPU
def gpu_side(tables) -> Tuple[Optional[int], Optional[str]]:
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


def host_tensors(tables) -> list:
    return [t for t in list(tables.src_tensors) + list(tables.dst_tensors) if t.device.type == "cpu"]


def pin_host_side(tables):
    """Page-lock the pageable host tensors of ``tables`` (kvcopy.backends.pinning); the handle
    to release, or None when there is nothing to pin."""
    hosts = host_tensors(tables)
    if not hosts:
        return None
    from .pinning import pin_host_tensors

    return pin_host_tensors(hosts)


def call_on_device(device: int, fn, *args):
    """``fn(*args)`` with ``device`` current (a guard only when it is not already)."""
    import torch

    if torch.cuda.current_device() == device:
        return fn(*args)
    with torch.cuda.device(device):
        return fn(*args)


def cuda_unavailable() -> Optional[str]:
    import torch

    return None if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"


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

    def unsupported_reason(self, tables) -> Optional[str]:
        return gpu_side(tables)[1]
