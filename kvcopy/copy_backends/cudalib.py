"""``libkvcopy_cuda`` through ctypes: loading it, its C signatures, and its error codes.

``libkvcopy_cuda.so`` (``csrc/cuda_copy.cu``, ``csrc/ce_copy.cu``; built by CMake when
nvcc is found) exports a C ABI: raw pointers, sizes and a stream in, a CUDA error code
out. :func:`library` loads it once and declares every function's argument types (a
library without one of them is reported out of date: rebuild it); :func:`check` turns
a non-zero code into :class:`CudaError` with the CUDA error name. When the library is
absent but cupy is installed, the ``cuda`` backend compiles the same kernel headers
through NVRTC instead (:mod:`kvcopy.copy_backends.nvrtc`); the copy-engine path needs the
library.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Tuple

from .. import native

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
            except AttributeError as exc:  # built from older sources: a symbol is missing
                lib, why = None, f"libkvcopy_cuda.so is out of date ({exc}); rebuild with `pip install -e .`"
        _lib, _lib_reason = lib, why
    return _lib, _lib_reason


# kvcopy_cuda_copy(static, entries, groups, group_entries, call_host, call_device,
# call_words, total_bytes, word_bytes, grid, stream)
COPY_ARGTYPES = [_vp, _i64, _i64, _i64, _vp, _vp, _i64, _i64, _int, _int, _vp]
# kvcopy_cuda_copy_sums(the same, then sums, num_sums)
COPY_SUMS_ARGTYPES = COPY_ARGTYPES + [_vp, _i64]
# kvcopy_cuda_store_words(dst, src, count, stream)
STORE_ARGTYPES = [_vp, _vp, _i64, _vp]


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
        "kvcopy_cuda_copy": (_int, COPY_ARGTYPES),
        "kvcopy_cuda_copy_sums": (_int, COPY_SUMS_ARGTYPES),
        "kvcopy_cuda_stream_capturing": (_int, [_vp, ctypes.POINTER(_int)]),
        "kvcopy_cuda_store_words": (_int, STORE_ARGTYPES),
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
