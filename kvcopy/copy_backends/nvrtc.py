"""The fused CUDA kernel without the prebuilt library: NVRTC at first use, cached.

When ``libkvcopy_cuda.so`` was not built (no nvcc where kvcopy was installed) but cupy
is installed, the backend ``cuda`` compiles ``kernels/block_copy_kernel.cuh`` (and the
``block_copy.cuh`` it includes: the same headers nvcc builds, passed to NVRTC as
in-memory headers) with cupy's NVRTC bindings, for the exact architecture of the
device, and caches the cubin in ``$XDG_CACHE_HOME/kvcopy/nvrtc/`` (``~/.cache`` when
unset) under a hash of the sources, the options and the NVRTC version. The module is
then loaded and launched through the driver API (``libcuda.so.1``, ctypes) into the
context torch made current, with the same single ``KernelParams`` argument the
library's launcher passes.

Only compilation needs cupy; nothing here needs a GPU until :class:`NvrtcLauncher`
loads the module. :func:`compile_kernels` is what the compile-only test runs.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from pathlib import Path
from typing import Dict, Optional, Tuple

from .. import native
from ..kernels import include_dir

HEADERS = ("entry_layout.cuh", "block_copy.cuh", "page_checksum.cuh", "block_copy_kernel.cuh")
ENTRY_POINTS = {w: f"kvcopy_block_copy_w{w}" for w in (16, 8, 4, 2, 1)}
SUM_ENTRY_POINTS = {w: f"kvcopy_block_copy_sums_w{w}" for w in (16, 8, 4, 2, 1)}  # checksums
SOURCE = '#include "block_copy_kernel.cuh"\nKVCOPY_DEFINE_KERNELS\n'
OPTIONS = ("-std=c++17",)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcopy" / "nvrtc"


def available() -> Optional[str]:
    """None when NVRTC can be used (cupy and libnvrtc found), else why not."""
    try:
        from cupy.cuda import nvrtc
    except ImportError as exc:
        return f"cupy is not installed ({exc})"
    try:
        nvrtc.getVersion()
    except Exception as exc:  # libnvrtc missing: cupy raises its own loader error
        return f"NVRTC library not found ({type(exc).__name__}: {exc})"
    return None


def _headers() -> Tuple[list, list]:
    names = list(HEADERS)
    return [(include_dir() / n).read_bytes() for n in names], [n.encode() for n in names]


def compile_kernels(arch: str, output: str = "cubin") -> bytes:
    """Compile the kernel headers with NVRTC. ``arch``: ``"sm_90"`` (cubin or PTX) or
    ``"compute_90"`` (PTX). Raises ``RuntimeError`` with NVRTC's log on failure."""
    from cupy.cuda import nvrtc

    texts, names = _headers()
    prog = nvrtc.createProgram(SOURCE, "kvcopy_block_copy.cu", texts, names)
    try:
        opts = list(OPTIONS) + [f"-arch={arch}"]
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed to compile the kvcopy kernels for {arch}: {exc}\n{log}") from None
        return nvrtc.getCUBIN(prog) if output == "cubin" else bytes(nvrtc.getPTX(prog))
    finally:
        nvrtc.destroyProgram(prog)


def cached_cubin(arch: str) -> bytes:
    """The cubin for ``arch`` from the cache, compiling it on a miss."""
    from cupy.cuda import nvrtc

    texts, _ = _headers()
    key = hashlib.sha256(
        b"\0".join([SOURCE.encode(), *texts, *(o.encode() for o in OPTIONS), arch.encode(),
                    repr(nvrtc.getVersion()).encode()])
    ).hexdigest()[:24]
    path = cache_dir() / f"block_copy_{arch}_{key}.cubin"
    if path.is_file():
        return path.read_bytes()
    image = compile_kernels(arch, "cubin")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(image)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache costs a compile per process, nothing else
    return image


# ------------------------------------------------------------------ launching
_CUDA_ERROR_INVALID_VALUE = 1


class NvrtcLauncher:
    """Loads the NVRTC-built module per device; same call as ``kvcopy_cuda_copy``."""

    inline_words = 480

    def __init__(self) -> None:
        self._cuda = native.driver()
        self._functions: Dict[int, Dict[int, ctypes.c_void_p]] = {}
        self._lock = threading.Lock()

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._cuda.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
        return f"CUresult {code}"

    def _load(self, device: int) -> Dict[int, ctypes.c_void_p]:
        with self._lock:
            if device not in self._functions:
                import torch

                major, minor = torch.cuda.get_device_capability(device)
                image = cached_cubin(f"sm_{major}{minor}")
                with torch.cuda.device(device):
                    torch.cuda.current_stream(device)  # the primary context is current
                    torch.empty(1, device=f"cuda:{device}")
                    module = ctypes.c_void_p()
                    rc = self._cuda.cuModuleLoadData(ctypes.byref(module), image)
                    if rc:
                        raise RuntimeError(f"cuModuleLoadData failed: {self.error_name(rc)} ({rc})")
                    fns = {}
                    named = (list(ENTRY_POINTS.items()) + [(-w, n) for w, n in SUM_ENTRY_POINTS.items()]
                             + [(0, "kvcopy_store_words")])
                    for w, name in named:
                        fn = ctypes.c_void_p()
                        rc = self._cuda.cuModuleGetFunction(ctypes.byref(fn), module, name.encode())
                        if rc:
                            raise RuntimeError(f"cuModuleGetFunction({name}) failed: {self.error_name(rc)} ({rc})")
                        fns[w] = fn
                self._functions[device] = fns
            return self._functions[device]

    def launch(self, device: int, tables: int, num_entries: int, num_groups: int, num_group_entries: int,
               call_host: Optional[int], call_device: Optional[int], call_words: int, total_bytes: int,
               word_bytes: int, grid: int, stream: int, threads: int, sums: Optional[int] = None,
               num_sums: int = 0) -> int:
        """``sums``: the device address of ``num_sums`` checksum slots, zeroed here on the
        stream: the checksum kernel runs."""
        fns = self._load(device)
        if sums is not None and num_sums > 0:
            rc = self._cuda.cuMemsetD8Async(ctypes.c_void_p(sums), 0, 8 * num_sums, ctypes.c_void_p(stream))
            if rc:
                return rc
        if sums is not None and total_bytes <= 0:
            return 0
        p = native.KernelParams()
        p.sums = sums
        p.tables = tables
        p.num_entries, p.num_groups, p.num_group_entries = num_entries, num_groups, num_group_entries
        p.total_bytes = total_bytes
        if call_host is not None and call_words <= self.inline_words:
            p.call = None
            ctypes.memmove(p.inline_call, call_host, 8 * call_words)
        elif call_device is not None:
            p.call = call_device
        else:
            return _CUDA_ERROR_INVALID_VALUE
        args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(p), ctypes.c_void_p))
        fn = fns[-word_bytes] if sums is not None else fns[word_bytes]
        return self._cuda.cuLaunchKernel(fn, grid, 1, 1, threads, 1, 1, 0, stream, args, None)

    def store_words(self, device: int, dst: int, src: int, count: int, stream: int) -> int:
        """As kvcopy_cuda_store_words: words carried into device memory by value."""
        fn = self._load(device)[0]
        p = native.StoreParams()
        for done in range(0, count, self.inline_words):
            n = min(self.inline_words, count - done)
            p.dst, p.count = dst + 8 * done, n
            ctypes.memmove(p.words, src + 8 * done, 8 * n)
            args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(p), ctypes.c_void_p))
            rc = self._cuda.cuLaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, stream, args, None)
            if rc:
                return rc
        return 0
