"""Backend ``triton``: the fused Triton kernel (``kernels/triton_copy.py``), one launch per call.

``prepare`` (once per copier direction) page-locks pageable host buffers in place
(:mod:`kvcopy.copy_backends.pinning`), uploads the static tables to the device and picks the launch
shape (word size from the tables' alignment, rows about one chunk long). ``copy``
then does exactly two things on the caller's current stream: it puts the packed call
array on the device, and launches the kernel. Nothing synchronizes the host.

The call array goes up one of two ways. A call of at most 480 words (about 150 runs),
when ``libkvcopy_cuda`` is there: ``kvcopy_cuda_store_words`` carries the words in its
kernel parameters into a device buffer kept per stream (:class:`SmallCallUpload`): no
pinned staging block, no ``cudaMemcpyAsync``, one ctypes call on the host. The
buffer is reused by the next call on the same stream only, which runs after this
call's kernel by stream order (calls from several threads take a lock from the store
to the launch, so their stores and launches alternate on the stream). Larger calls
(or no library): a pinned staging tensor of PyTorch's caching host allocator (which
keeps the block from being reused until the copy has run) and one host-to-device copy.

Grid: at most ``max_ctas`` programs (``BlockCopier(..., max_ctas=N)``, which lands in
``tables.max_ctas``; else one program per SM), at most a call's own ``max_ctas``
(``BlockCopier.run(..., max_ctas=N)``), and never more than the call has 32 KiB tiles.

With ``TRITON_INTERPRET=1`` in the environment when a copier is built, the backend
runs the same kernel in Triton's interpreter on CPU tensors (both sides on the CPU);
that is how it is tested without a GPU. The default grid cap is then 4 programs
(each program instance costs about a millisecond there).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

import numpy as np
import torch

from .. import native
from ..core.tables import RUN_BYTES, CallPlan, CopyTables
from . import Backend
from .kernel_inputs import call_array, call_cap

STATE_KEY = "triton"
INTERPRETER_MAX_CTAS = 4


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's interpreter (read now, not at import)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@dataclass
class _State:
    mod: Any  # kernels module (compiled or interpreted variant)
    device: torch.device
    entries: torch.Tensor
    group_offsets: torch.Tensor
    group_entries: torch.Tensor
    cfg: Any  # triton_copy.LaunchConfig
    max_ctas: int
    pinning: Any  # kvcopy.copy_backends.pinning.HostPinning or None
    small_upload: Optional["SmallCallUpload"] = None  # GPU, with libkvcopy_cuda
    cfg_sums: Any = None  # triton_copy.LaunchConfig of the checksum kernel


class SmallCallUpload:
    """Small call arrays to the device through ``kvcopy_cuda_store_words``, into one
    device buffer per stream (see the module docstring). ``store`` is that function,
    or for ``kvcopy-bench overhead`` a no-op with its argument types; ``stream`` maps
    the device index to the current raw stream; ``allocate`` makes a buffer."""

    def __init__(self, store, device_index: int, max_words: int, stream, allocate):
        self._store, self._device, self.max_words = store, device_index, max_words
        self._stream, self._allocate = stream, allocate
        self._buffers: dict = {}
        # Held from a call's store to its launch: two threads enqueueing on one stream
        # would otherwise store twice into the one buffer before either kernel runs.
        self.lock = threading.Lock()

    def __call__(self, call: CallPlan, with_prefix: bool = False):
        """The device buffer now holding ``call.packed`` (and its block prefix after it
        when ``with_prefix``), or None: too large."""
        words = call.num_words if with_prefix else call.num_words - call.prefix_words
        if words > self.max_words:
            return None
        stream = self._stream(self._device)
        buf = self._buffers.get(stream)
        if buf is None:
            buf = self._buffers[stream] = self._allocate(self.max_words)
        rc = self._store(buf.data_ptr(), call.words, words, stream)
        if rc != 0:
            from ..native import CudaError, error_name

            raise CudaError("kvcopy_cuda_store_words (triton call array)", rc, error_name(rc))
        return buf


def _small_upload(device: torch.device) -> Optional[SmallCallUpload]:
    from .gpu import raw_stream_getter
    from .kernel_inputs import INLINE_WORDS

    lib, _ = native.load("kvcopy_cuda")
    if lib is None:
        return None
    return SmallCallUpload(lib.kvcopy_cuda_store_words, device.index, INLINE_WORDS, raw_stream_getter(),
                           lambda n: torch.empty(n, dtype=torch.int64, device=device))


class TritonBackend(Backend):
    name = "triton"

    def __init__(self) -> None:
        self._module: Optional[ModuleType] = None
        self._why: Optional[str] = None
        try:
            from ..kernels import triton_copy  # imports triton
        except ImportError as exc:
            self._why = f"triton is not installed ({exc})"
        else:
            self._module = triton_copy

    @property
    def _kernels(self) -> ModuleType:
        """kernels/triton_copy.py (only asked for once the backend is available)."""
        if self._module is None:
            raise ValueError(f"backend 'triton' is not available: {self._why}")
        return self._module

    # ------------------------------------------------------------ availability
    def unavailable_reason(self) -> Optional[str]:
        if self._why:
            return self._why
        if not interpreting() and not torch.cuda.is_available():
            return ("no CUDA device (set TRITON_INTERPRET=1 to run the kernel on CPU tensors "
                    "in Triton's interpreter)")
        return None

    def unsupported_reason(self, tables: CopyTables) -> Optional[str]:
        tensors = list(tables.src_tensors) + list(tables.dst_tensors)
        devices = {t.device for t in tensors} or {tables.src_device, tables.dst_device}
        if interpreting():
            if any(d.type != "cpu" for d in devices):
                return ("TRITON_INTERPRET=1 runs the kernel in the interpreter, on CPU tensors "
                        f"only; got {sorted(map(str, devices))}")
        else:
            cuda = {d for d in devices if d.type == "cuda"}
            if not cuda:
                return "CPU tensors on both sides need TRITON_INTERPRET=1 (or backend 'cpu')"
            if len(cuda) > 1:
                return f"device tensors on several GPUs: {sorted(map(str, cuda))}"
            if any(d.type not in ("cuda", "cpu") for d in devices):
                return f"unsupported device among {sorted(map(str, devices))}"
            from .pinning import host_pointer_usable

            index = next(iter(cuda)).index
            if not host_pointer_usable(index if index is not None else torch.cuda.current_device()):
                return ("this GPU cannot use registered host pointers directly "
                        "(cudaDevAttrCanUseHostPointerForRegisteredMem = 0); use backend 'ce'")
        if len(tables.entries) and (tables.entries[:, RUN_BYTES] <= 0).any():
            return "an entry has zero-byte pages"
        return None

    # ------------------------------------------------------------ per copier
    def prepare(self, tables: CopyTables) -> None:
        tc = self._kernels
        interp = interpreting()
        cuda = [t.device for t in list(tables.src_tensors) + list(tables.dst_tensors)
                if t.device.type == "cuda"]
        if interp or not cuda:
            device = torch.device("cpu")
            default_ctas = INTERPRETER_MAX_CTAS
        else:
            device = cuda[0] if cuda[0].index is not None else torch.device("cuda", torch.cuda.current_device())
            default_ctas = torch.cuda.get_device_properties(device).multi_processor_count
        max_ctas = tables.max_ctas or default_ctas
        pinning = None
        if device.type == "cuda":
            from .pinning import pin_host_side

            pinning = pin_host_side(tables)

        def upload(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64).reshape(-1)).to(device)

        min_chunk = tables.min_run_bytes()
        tables.backend_state[STATE_KEY] = _State(
            mod=tc.kernels(interpret=interp),
            device=device,
            entries=upload(tables.entries),
            group_offsets=upload(tables.group_offsets),
            group_entries=upload(tables.group_entries) if len(tables.group_entries) else upload(np.zeros(1)),
            cfg=tc.launch_config(tables.word_bytes, min_chunk, native.ENTRY_FIELDS),
            cfg_sums=tc.launch_config(tables.word_bytes, min_chunk, native.ENTRY_FIELDS, checksums=True),
            max_ctas=max_ctas,
            pinning=pinning,
            small_upload=_small_upload(device) if device.type == "cuda" else None,
        )

    # ------------------------------------------------------------ per call
    def copy(self, tables: CopyTables, call: CallPlan, max_ctas: Optional[int] = None) -> None:
        st = self.state(tables)
        if call.num_items == 0:
            return
        grid = self._kernels.grid_size(call.total_bytes, st.cfg, call_cap(st.max_ctas, max_ctas))
        if st.device.type != "cuda":
            self._kernels.launch(st.mod, grid, st.entries, st.group_offsets, st.group_entries,
                                 torch.from_numpy(call.packed.copy()), call.num_groups, st.cfg)
            return
        # One small H2D copy of the call, then the launch, both on the current stream.
        # pin_memory() draws from the caching host allocator, which records the copy's
        # stream and does not hand the block out again before the copy has run.
        if torch.cuda.current_device() != st.device.index:
            with torch.cuda.device(st.device):
                self._launch_cuda(st, call, grid)
        else:
            self._launch_cuda(st, call, grid)

    def _launch_cuda(self, st: _State, call: CallPlan, grid: int) -> None:
        if torch.cuda.is_current_stream_capturing():
            # A captured copy from a cached pinned block would re-read host memory the
            # allocator has long reused at every replay, and a captured store into the
            # per-stream buffer would replay over later calls' words. The `cuda`
            # backend stages the call array on the device for graphs.
            raise RuntimeError("the triton backend cannot be captured in a CUDA graph; use backend='cuda'")
        if st.small_upload is not None:
            with st.small_upload.lock:
                call_dev = st.small_upload(call)
                if call_dev is not None:
                    self._kernels.launch(st.mod, grid, st.entries, st.group_offsets, st.group_entries,
                                         call_dev, call.num_groups, st.cfg)
                    return
        call_dev = torch.from_numpy(call.packed.copy()).pin_memory().to(st.device, non_blocking=True)
        self._kernels.launch(st.mod, grid, st.entries, st.group_offsets, st.group_entries,
                             call_dev, call.num_groups, st.cfg)

    # ------------------------------------------------------------ checksums
    def checksum_reason(self, tables: CopyTables) -> Optional[str]:
        return self.unavailable_reason() or self.unsupported_reason(tables)

    def copy_with_checksums(self, tables: CopyTables, call: CallPlan, out: torch.Tensor,
                            max_ctas: Optional[int] = None) -> None:
        """The checksum kernel (``fused_copy_sums_kernel``): the call array goes up with
        its block prefix (the pages' output slots); ``out`` is zeroed on the stream first."""
        st = self.state(tables)
        out.zero_()
        if call.num_items == 0:
            return
        grid = self._kernels.grid_size(call.total_bytes, st.cfg_sums, call_cap(st.max_ctas, max_ctas))
        if st.device.type != "cuda":
            self._kernels.launch_sums(st.mod, grid, st.entries, st.group_offsets, st.group_entries,
                                      torch.from_numpy(call_array(call).copy()), call.num_groups, out, st.cfg_sums)
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the triton backend cannot be captured in a CUDA graph; use backend='cuda'")
        with torch.cuda.device(st.device):
            if st.small_upload is not None:
                with st.small_upload.lock:
                    call_dev = st.small_upload(call, with_prefix=True)
                    if call_dev is not None:
                        self._kernels.launch_sums(st.mod, grid, st.entries, st.group_offsets, st.group_entries,
                                                  call_dev, call.num_groups, out, st.cfg_sums)
                        return
            call_dev = torch.from_numpy(call_array(call).copy()).pin_memory().to(st.device, non_blocking=True)
            self._kernels.launch_sums(st.mod, grid, st.entries, st.group_offsets, st.group_entries,
                                      call_dev, call.num_groups, out, st.cfg_sums)
