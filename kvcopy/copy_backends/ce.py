"""Backend ``ce``: the copy engines, one ``cudaMemcpyBatchAsync`` for every segment of a call.

The library (``csrc/ce_copy.cu``) walks the call's items with the same item body as
the kernels and hands all segments (one per chunk of a merged run, else one per chunk
of each block) to the driver's ``cuMemcpyBatchAsync``, resolved at run time (CUDA 13
ABI, then 12.8). Without it, during graph capture, or with ``KVCOPY_CE_MODE=loop``, one
``cudaMemcpyAsync`` per segment. The legacy default stream, which the batch API
rejects, is bridged with a side stream and two events, so the copy stays ordered on
the caller's stream either way.

Source access order: ``STREAM`` for device sources, ``ANY`` for host sources (no stream
writes them). ``KVCOPY_CE_HOST_ANY=0`` asks for ``STREAM`` there too, for callers that
write a host buffer with a ``to_host`` and read it back with a ``to_device`` on the
same stream without waiting in between.

Copy engines are slow per descriptor (published H100 figures: 4-7 GB/s on 4 KiB pages,
~52 GB/s at 64 KiB): this backend is for merged runs of large pages; ``auto`` picks
it only there.
It computes no checksums (:mod:`kvcopy.core.checksum`): asked for them, it raises.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import native
from ..checks import env_flag
from . import Backend
from .gpu import GpuBackendBase, call_on_device, require_gpu
from .pinning import pin_host_side
from ..core.tables import CallPlan, CopyTables

_MODES = {"auto": 0, "batch": 1, "loop": 2}


@dataclass
class _State:
    copy: Any  # kvcopy_ce_copy, typed (kvcopy.native)
    device: int
    pinning: Any
    src_host: int
    dst_host: int
    tables: Any  # kvcopy.native.Tables over the host tables (kept alive here)
    last_used_batch: bool = False
    last_segments: int = 0


class CopyEngineBackend(GpuBackendBase, Backend):
    name = "ce"
    _lib: Any = None

    def _find(self) -> Optional[str]:
        self._lib, why = native.load("kvcopy_cuda")
        return why

    def batch_abi(self) -> int:
        """13000 / 12080: the cuMemcpyBatchAsync ABI the driver offers; 0: loop only."""
        self._resolve()
        return self._lib.kvcopy_ce_batch_abi() if self._lib is not None else 0

    def prepare(self, tables: CopyTables) -> None:
        self._resolve()
        if self._lib is None:
            raise ValueError(f"backend 'ce' is not available: {self._why}")
        device = require_gpu(tables, "ce")
        tables.backend_state["ce"] = _State(
            copy=self._lib.kvcopy_ce_copy,
            device=device,
            pinning=pin_host_side(tables),
            src_host=int(tables.src_device.type == "cpu"),
            dst_host=int(tables.dst_device.type == "cpu"),
            tables=tables.abi_struct(),
        )

    def checksum_reason(self, tables: CopyTables) -> Optional[str]:
        return ("backend 'ce' moves the bytes with the copy engines, which never bring them into "
                "an SM, so it cannot compute checksums; build the copier with backend 'cuda', "
                "'triton' or 'auto' (auto hands checksummed calls to its SM kernel)")

    def copy(self, tables: CopyTables, call: CallPlan, max_ctas: Optional[int] = None) -> None:  # copy engines: no CTAs
        st: _State = self.state(tables)
        mode = _MODES.get(os.environ.get("KVCOPY_CE_MODE", "auto"))
        if mode is None:
            raise ValueError(f"KVCOPY_CE_MODE must be one of {sorted(_MODES)}")
        host_any = int(env_flag("KVCOPY_CE_HOST_ANY", True))
        stream = torch.cuda.current_stream(st.device).cuda_stream
        used, segs = ctypes.c_int(0), ctypes.c_int64(0)
        options = native.CeOptions.make(src_is_host=st.src_host, dst_is_host=st.dst_host, host_access_any=host_any,
                                        mode=mode)
        rc = call_on_device(st.device, st.copy, ctypes.addressof(st.tables), call.words, ctypes.addressof(options),
                            stream, ctypes.byref(used), ctypes.byref(segs))
        st.last_used_batch, st.last_segments = bool(used.value), int(segs.value)
        native.check(rc, f"copy-engine copy of {segs.value} segments "
                          f"({'cuMemcpyBatchAsync' if mode != 2 else 'cudaMemcpyAsync loop'})")
