"""Backend ``cuda``: the fused CUDA kernel, one launch per call for every layer and group.

``prepare`` (once per copier direction) page-locks pageable host buffers in place
(:mod:`kvcopy.copy_backends.pinning`), translates host addresses where the device cannot use host
pointers directly (``cudaHostGetDevicePointer``), and uploads the static table
(entries | group offsets | group entries | entry byte prefix) to the device.

``copy`` launches ``kvcopy_block_copy_w{16,8,4,2,1}`` on the current stream with the
call array the planner wrote (the packed runs and their block prefix,
:mod:`kvcopy.copy_backends.kernel_inputs`):

* calls up to 480 int64 words (about 115 runs) travel **inside the kernel
  parameters**: no upload, no allocation, one launch and nothing else on the stream;
* larger calls are staged through a pinned host tensor and copied to a device tensor
  on the same stream just before the launch.

CUDA graphs. A captured ``to_device``/``to_host`` replays the ids it was captured
with, and a replay must read nothing that may have changed since capture. Small calls
are captured by value in the kernel node's parameters. A large call captured into a
graph is not staged through host memory (a memcpy node would re-read a pinned buffer
that torch may since have reused): its array is carried into a device tensor by
``kvcopy_store_words`` launches whose parameters hold the words (480 per launch), and
that tensor is kept for as long as the copier lives
(``backend_state["cuda"].graph_buffers``). The static table and the KV tensors are
read at replay time, as by any captured kernel: the copier must outlive the graph.

The kernel comes from ``libkvcopy_cuda.so`` (nvcc, CMake) or, when that library is
absent and cupy is installed, from NVRTC (:mod:`kvcopy.copy_backends.nvrtc`). ``KVCOPY_CUDA_NVRTC=1``
forces NVRTC. The CTA cap is ``tables.max_ctas`` (``BlockCopier(max_ctas=)``; None: the
launch heuristics of :mod:`kvcopy.copy_backends.kernel_inputs`), lowered for one call by
its own ``max_ctas`` (``BlockCopier.run(..., max_ctas=)``), on both launchers' paths.

Checksums (:mod:`kvcopy.core.checksum`): ``kvcopy_block_copy_sums_w*``, the same kernel with
each lane hashing the words it moves and one atomic per warp and page; the launcher
zeroes the output on the stream first. Such calls take the general path (call array
inline when small, else staged), not the inline fast path.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, List, Optional, Union

import numpy as np
import torch

from .. import native
from ..checks import env_flag
from . import Backend
from .gpu import GpuBackendBase, call_on_device, current_device_getter, device_info, raw_stream_getter, require_gpu
from .kernel_inputs import CTA_MIN_BYTES, INLINE_WORDS, THREADS, call_array, call_cap, grid_cap, grid_size, static_table
from .pinning import pin_host_side
from ..core.tables import DST_BASE, SRC_BASE, CallPlan, CopyTables


@dataclass
class _State:
    launcher: Any  # _LibLauncher or _NvrtcLauncher
    device: int
    sm_count: int
    static: torch.Tensor  # device int64 table
    num_entries: int
    num_groups: int
    num_group_entries: int
    word_bytes: int
    pinning: Any
    max_ctas: Optional[int]  # tables.max_ctas, read once, not per call
    graph_buffers: List[torch.Tensor] = field(default_factory=list)
    launches: int = 0
    inline: Optional["InlineLaunch"] = None  # the short per-call path (library launcher)


class InlineLaunch:
    """The per-call host path of a call whose array fits in the kernel parameters.

    Everything constant for a copier direction is resolved once, at prepare: the
    static table's device pointer and counts as ctypes values, the word size, the grid
    cap (SM count and ``max_ctas``), the launch function. A call then costs the grid
    rule's division, the current device and raw stream (two cheap torch getters: the
    stream can change between calls, so it is read every call, never cached), one
    ``kvcopy_cuda_call`` packed into bytes (one C call) and one 4-argument ctypes call
    with the plan's own buffer as the call array (the native planner wrote the block
    prefix in the same pass: no numpy on this path). ``launch`` is ``kvcopy_cuda_copy``, or,
    for ``kvcopy-bench overhead``, a no-op C function with the same argument types
    (:meth:`stubbed`), so the host cost is measurable without a GPU.
    """

    __slots__ = ("launch", "device", "grid_cap", "inline_words", "tables", "tables_at", "stream",
                 "current_device")

    def __init__(self, launch, device: int, static_ptr: int, num_entries: int, num_groups: int,
                 num_group_entries: int, word_bytes: int, sm_count: int, max_ctas: Optional[int],
                 inline_words: int, stream=None, current_device=None):
        self.launch = launch
        self.device = device
        self.grid_cap, self.inline_words = grid_cap(sm_count, max_ctas), inline_words
        self.tables = native.CudaTables.make(tables=static_ptr, num_entries=num_entries, num_groups=num_groups,
                                             num_group_entries=num_group_entries, word_bytes=word_bytes)
        self.tables_at = ctypes.addressof(self.tables)
        self.stream = stream or raw_stream_getter()
        self.current_device = current_device or current_device_getter()

    @classmethod
    def stubbed(cls, tables: CopyTables, noop, sm_count: int = 132, max_ctas: Optional[int] = None):
        """This path over ``tables`` (CPU tables do), launching ``noop``: no device, no stream."""
        return cls(noop, 0, 0, tables.num_entries, tables.num_groups, len(tables.group_entries),
                   tables.word_bytes, sm_count, max_ctas, INLINE_WORDS,
                   stream=lambda device: 0, current_device=lambda: 0)

    def __call__(self, call: CallPlan, max_ctas: Optional[int] = None) -> Optional[int]:
        """The launch's return code, or None when the call does not fit inline
        (``max_ctas``: this call's cap, below the copier's)."""
        words = call.num_words
        if words > self.inline_words:
            return None
        total = call.total_bytes
        cap = self.grid_cap if max_ctas is None else min(self.grid_cap, max_ctas)
        # grid_size's rule with its cap worked out at build, written out (a function call
        # here cost 0.2-0.3 us of this path's 1.4); tests/copy_backends/test_cuda_backend.py
        # checks the two agree
        packed = _PACK_CALL(_CALL_BYTES, 0, words, total, max(1, min(-(-total // CTA_MIN_BYTES), cap)))
        # ctypes passes the plan's bytes as the address of its data: the call array as the planner wrote it
        if self.current_device() != self.device:
            with torch.cuda.device(self.device):
                return self.launch(self.tables_at, packed, call.words, self.stream(self.device))
        return self.launch(self.tables_at, packed, call.words, self.stream(self.device))


_PACK_CALL = native.CUDA_CALL.pack
_CALL_BYTES = native.CUDA_CALL_BYTES


def _structs(tables, e, g, ge, call_device, call_words, total, word, grid):
    """The two structs of a launch that does not take the inline path."""
    return (native.CudaTables.make(tables=tables, num_entries=e, num_groups=g, num_group_entries=ge, word_bytes=word),
            native.CudaCall.make(call_device=call_device or 0, call_words=call_words, total_bytes=total, grid=grid))


class _LibLauncher:
    def __init__(self, lib):
        self._lib = lib
        self.inline_words = lib.kvcopy_cuda_inline_words()
        self.threads = lib.kvcopy_cuda_threads()
        self.kind = "library"
        self.copy_function = lib.kvcopy_cuda_copy  # ctypes, argtypes declared (kvcopy.native)

    def launch(self, device, tables, e, g, ge, call_host, call_device, call_words, total, word, grid, stream):
        t, c = _structs(tables, e, g, ge, call_device, call_words, total, word, grid)
        return self._lib.kvcopy_cuda_copy(ctypes.addressof(t), ctypes.addressof(c), call_host, stream)

    def launch_sums(self, device, tables, e, g, ge, call_host, call_device, call_words, total, word, grid, stream,
                    sums, num_sums):
        t, c = _structs(tables, e, g, ge, call_device, call_words, total, word, grid)
        return self._lib.kvcopy_cuda_copy_sums(ctypes.addressof(t), ctypes.addressof(c), call_host, stream, sums,
                                               num_sums)

    def store_words(self, device, dst, src, count, stream):
        return self._lib.kvcopy_cuda_store_words(dst, src, count, stream)

    def error_name(self, code: int) -> str:
        return native.error_name(code)


class _NvrtcLauncher:
    def __init__(self):
        from .nvrtc import NvrtcLauncher

        self._impl = NvrtcLauncher()
        self.inline_words = self._impl.inline_words
        self.threads = THREADS
        self.kind = "nvrtc"

    def launch(self, device, tables, e, g, ge, call_host, call_device, call_words, total, word, grid, stream):
        return self._impl.launch(device, tables, e, g, ge, call_host, call_device, call_words, total, word,
                                 grid, stream or 0, self.threads)

    def launch_sums(self, device, tables, e, g, ge, call_host, call_device, call_words, total, word, grid, stream,
                    sums, num_sums):
        return self._impl.launch(device, tables, e, g, ge, call_host, call_device, call_words, total, word,
                                 grid, stream or 0, self.threads, sums=sums, num_sums=num_sums)

    def store_words(self, device, dst, src, count, stream):
        return self._impl.store_words(device, dst, src, count, stream or 0)

    def error_name(self, code: int) -> str:
        return self._impl.error_name(code)


Launcher = Union[_LibLauncher, _NvrtcLauncher]


class CudaBackend(GpuBackendBase, Backend):
    name = "cuda"
    _launcher: Optional[Launcher] = None

    def _find(self) -> Optional[str]:
        lib, why = native.load("kvcopy_cuda")
        if lib is not None and not env_flag("KVCOPY_CUDA_NVRTC", False):
            self._launcher = _LibLauncher(lib)
            return None
        from . import nvrtc

        reason = nvrtc.available()
        if reason is None:
            try:
                self._launcher = _NvrtcLauncher()
                return None
            except OSError as exc:
                reason = f"libcuda.so.1 not loadable ({exc})"
        return f"{why or 'library not used (KVCOPY_CUDA_NVRTC=1)'}; and no NVRTC fallback: {reason}"

    @property
    def launcher_kind(self) -> Optional[str]:
        """"library" or "nvrtc" once resolved; None when unavailable."""
        self._resolve()
        return self._launcher.kind if self._launcher else None

    # ------------------------------------------------------------ tables
    def prepare(self, tables: CopyTables) -> None:
        self._resolve()
        launcher = self._launcher
        if launcher is None:
            raise ValueError(f"backend 'cuda' is not available: {self._why}")
        device = require_gpu(tables, "cuda")
        pinning = pin_host_side(tables)
        try:
            sms, host_ptr_ok = device_info(device)
            entries = tables.entries.copy()
            if not host_ptr_ok:
                _translate_host_pointers(entries, tables)
            static = torch.from_numpy(static_table(tables, entries)).to(f"cuda:{device}")
        except BaseException:
            if pinning is not None:
                pinning.release()
            raise
        st = _State(
            launcher=launcher, device=device, sm_count=sms, static=static, num_entries=tables.num_entries,
            num_groups=tables.num_groups, num_group_entries=len(tables.group_entries),
            word_bytes=tables.word_bytes, pinning=pinning, max_ctas=tables.max_ctas,
        )
        if isinstance(launcher, _LibLauncher):
            st.inline = InlineLaunch(launcher.copy_function, device, static.data_ptr(), st.num_entries,
                                     st.num_groups, st.num_group_entries, st.word_bytes, sms, st.max_ctas,
                                     launcher.inline_words)
        tables.backend_state["cuda"] = st

    # ------------------------------------------------------------ the copy
    def copy(self, tables: CopyTables, call: CallPlan, max_ctas: Optional[int] = None) -> None:
        st: _State = self.state(tables)
        if call.total_bytes <= 0:
            return
        if st.inline is not None:
            rc = st.inline(call, max_ctas)
            if rc is not None:
                if rc != 0:
                    raise native.CudaError(f"kvcopy_block_copy_w{st.word_bytes} launch (library)", rc,
                                            st.launcher.error_name(rc))
                st.launches += 1
                return
        self._launch(st, call, None, max_ctas)

    def checksum_reason(self, tables: CopyTables) -> Optional[str]:
        return self.unavailable_reason() or self.unsupported_reason(tables)

    def copy_with_checksums(self, tables: CopyTables, call: CallPlan, out: torch.Tensor,
                            max_ctas: Optional[int] = None) -> None:
        """The checksum kernel (``kvcopy_block_copy_sums_w*``): ``out`` zeroed on the
        stream by the launcher, then one launch, the call array as for :meth:`copy`."""
        self._launch(self.state(tables), call, out, max_ctas)

    def _launch(self, st: _State, call: CallPlan, sums: Optional[torch.Tensor], max_ctas: Optional[int]) -> None:
        """The launch of :meth:`copy` (or, with ``sums``, of the checksum kernel) when
        the call does not go through the inline path: the call array inline in the
        parameters when it fits, else staged on the device."""
        arr = call_array(call)
        stream = torch.cuda.current_stream(st.device)
        grid = grid_size(call.total_bytes, st.sm_count, call_cap(st.max_ctas, max_ctas))
        launcher = st.launcher
        call_device = _call_on_device(st, arr, stream) if len(arr) > launcher.inline_words else None
        args = (st.device, st.static.data_ptr(), st.num_entries, st.num_groups, st.num_group_entries,
                arr.ctypes.data, call_device, len(arr), call.total_bytes, st.word_bytes, grid, stream.cuda_stream)
        if sums is None:
            rc = call_on_device(st.device, launcher.launch, *args)
        else:
            rc = call_on_device(st.device, launcher.launch_sums, *args, sums.data_ptr(), sums.numel())
        if rc != 0:
            kind = "sums_" if sums is not None else ""
            raise native.CudaError(
                f"kvcopy_block_copy_{kind}w{st.word_bytes} launch ({grid} CTAs, {launcher.kind})", rc,
                launcher.error_name(rc))
        st.launches += 1


def _call_on_device(st: _State, arr: np.ndarray, stream) -> int:
    """Device address of a copy of a call array too large for the kernel parameters."""
    if torch.cuda.is_current_stream_capturing():
        # The graph must own the call array: carried by value into a device tensor by
        # small store launches; the tensor is kept for replays.
        dev = torch.empty(len(arr), dtype=torch.int64, device=f"cuda:{st.device}")
        rc = call_on_device(st.device, st.launcher.store_words, st.device, dev.data_ptr(), arr.ctypes.data,
                            len(arr), stream.cuda_stream)
        if rc != 0:
            raise native.CudaError("kvcopy_store_words launch", rc, st.launcher.error_name(rc))
        st.graph_buffers.append(dev)
    else:
        # A pinned block of torch's caching host allocator, not reused before the copy ran.
        dev = torch.from_numpy(arr.copy()).pin_memory().to(f"cuda:{st.device}", non_blocking=True)
    return dev.data_ptr()


def _translate_host_pointers(entries: np.ndarray, tables: CopyTables) -> None:
    """Replace host base addresses by cudaHostGetDevicePointer's, in place."""
    lib, why = native.load("kvcopy_cuda")
    if lib is None:
        raise ValueError(
            "this GPU cannot use host pointers directly (cudaDevAttrCanUseHostPointerForRegisteredMem = 0) "
            f"and the pointer translation needs libkvcopy_cuda: {why}")
    for col, side in ((SRC_BASE, tables.src_device), (DST_BASE, tables.dst_device)):
        if side.type != "cpu":
            continue
        for row in range(len(entries)):
            out = ctypes.c_void_p()
            native.check(lib.kvcopy_cuda_host_device_pointer(ctypes.c_void_p(int(entries[row, col])),
                                                              ctypes.byref(out)),
                          f"cudaHostGetDevicePointer for layer {tables.entry_names[row]!r}")
            entries[row, col] = out.value or 0
