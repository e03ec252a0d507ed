"""Page-locking host buffers in place, so GPU kernels can read and write them.

vLLM allocates its host staging buffers pageable (``torch.zeros(..., device="cpu")``
without ``pin_memory``); a kernel that dereferences a pageable host address faults.
:func:`pin_host_tensors` registers each distinct pageable CPU storage once with
``cudaHostRegister`` (portable | mapped) and :meth:`HostPinning.release` undoes it;
a pinning that is garbage collected releases itself. Storages that are already
page-locked by others (``torch.empty(..., pin_memory=True)``, or registered by
NIXL/UCX) are left alone and never unregistered by us; kvcopy's own registrations are
reference-counted across copiers, so closing one copier never unpins memory another
still uses. The first time pageable
memory gets pinned the process logs it once at INFO (later ones at DEBUG), so the
behaviour is never silent. Without CUDA it is a no-op.

Unified addressing: on x86-64 Linux (and Grace with ATS) a registered host pointer is
usable by kernels as is (``cudaDevAttrCanUseHostPointerForRegisteredMem`` = 1).
Where that attribute is 0 a kernel needs the pointer from
``cudaHostGetDevicePointer`` instead; :func:`host_pointer_usable` reports it, and
backends that pass raw host addresses to kernels refuse such devices rather than
translate (not needed on any machine kvcopy targets today).
"""
from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from typing import Dict, Iterable, List, Optional, Tuple

import torch

logger = logging.getLogger("kvcopy.pinning")

_HOST_REGISTER_PORTABLE = 0x01
_HOST_REGISTER_MAPPED = 0x02
_ERR_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
_CU_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91

_logged = False
_log_lock = threading.Lock()


def _storage_range(t: torch.Tensor) -> Tuple[int, int, torch.UntypedStorage]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes(), s


def _is_pinned_range(storage: torch.UntypedStorage) -> bool:
    """True when the first and the last byte of ``storage`` are page-locked."""
    n = storage.nbytes()
    if n == 0:
        return True
    probe = torch.empty(0, dtype=torch.uint8)
    first = probe.set_(storage, 0, (1,))
    last = torch.empty(0, dtype=torch.uint8).set_(storage, n - 1, (1,))
    return bool(first.is_pinned()) and bool(last.is_pinned())


# Registrations kvcopy made, shared by every pinning that uses them: address ->
# [number of live pinnings, storage]. Two copiers over the same host buffers (a
# TransferManager's and one of copy_blocks's) share one registration; it is undone when
# the last of them is released, never under a copier that still runs.
_owned: Dict[int, list] = {}
_owned_lock = threading.Lock()


def _unregister(ptrs: List[int], storages: list) -> None:
    """Finalizer: drop this pinning's references; unregister those nobody else holds,
    then let the storages go (they are kept alive until now)."""
    if not ptrs:
        return
    try:
        with _owned_lock:
            last = []
            for p in ptrs:
                entry = _owned.get(p)
                if entry is not None:
                    entry[0] -= 1
                    if entry[0] == 0:
                        del _owned[p]
                        last.append(p)
        if last and torch.cuda.is_available():
            for dev in range(torch.cuda.device_count()):
                torch.cuda.synchronize(dev)  # no kernel may still read or write them
            rt = torch.cuda.cudart()
            for p in last:
                rt.cudaHostUnregister(p)
    finally:
        ptrs.clear()
        storages.clear()


class HostPinning:
    """The registrations made by one :func:`pin_host_tensors` call."""

    def __init__(self, ptrs: List[int], storages: list, already_pinned: int):
        self._ptrs = ptrs
        self._storages = storages
        self.already_pinned = already_pinned
        self._finalizer = weakref.finalize(self, _unregister, ptrs, storages)
        self._finalizer.atexit = False  # the process is going away: nothing to undo

    @property
    def registered(self) -> int:
        """Storages this pinning holds a kvcopy registration of (undone with the last holder)."""
        return len(self._ptrs)

    @property
    def registered_bytes(self) -> int:
        return sum(s.nbytes() for s in self._storages)

    def release(self) -> None:
        """Unregister what this pinning registered (after a device synchronize). Idempotent."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def pin_host_tensors(tensors: Iterable[torch.Tensor]) -> HostPinning:
    """Page-lock every distinct pageable CPU storage under ``tensors`` in place.

    Non-CPU tensors are ignored. Raises ``RuntimeError`` naming the CUDA error when a
    registration fails (registrations made so far are undone first).
    """
    if not torch.cuda.is_available():
        return HostPinning([], [], 0)
    seen: Dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        ptr, nbytes, storage = _storage_range(t)
        if nbytes and ptr not in seen:
            seen[ptr] = storage
    ptrs: List[int] = []
    storages: list = []
    already = 0
    rt = torch.cuda.cudart()
    try:
        for ptr, storage in seen.items():
            with _owned_lock:
                entry = _owned.get(ptr)
                if entry is not None and entry[1].nbytes() >= storage.nbytes():
                    entry[0] += 1  # kvcopy's own registration: share it
                    ptrs.append(ptr)
                    storages.append(storage)
                    continue
            if _is_pinned_range(storage):
                already += 1
                continue
            res = rt.cudaHostRegister(ptr, storage.nbytes(), _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED)
            err = int(res)
            if err != 0:
                _clear_last_error()  # else torch's next launch check reports it
            if err == _ERR_ALREADY_REGISTERED:
                # Registered by someone else (NIXL, UCX) between the check and now, or
                # overlapping another registration: usable only if it covers all of it.
                if not _is_pinned_range(storage):
                    raise RuntimeError(
                        f"host buffer at {ptr:#x} ({storage.nbytes()} bytes) overlaps memory "
                        "registered elsewhere but is not page-locked as a whole"
                    )
                already += 1
                continue
            if err != 0:
                raise RuntimeError(
                    f"cudaHostRegister({ptr:#x}, {storage.nbytes()}) failed: "
                    f"{_error_name(res)} ({err})"
                )
            with _owned_lock:
                _owned[ptr] = [1, storage]
            ptrs.append(ptr)
            storages.append(storage)
    except BaseException:
        _unregister(ptrs, storages)
        raise
    pinning = HostPinning(ptrs, storages, already)
    if ptrs:
        _log_pinned(pinning)
    return pinning


def _log_pinned(p: HostPinning) -> None:
    global _logged
    with _log_lock:
        first, _logged = not _logged, True
    msg = ("kvcopy: page-locked %d pageable host buffer(s), %.1f MiB, in place with "
           "cudaHostRegister so GPU kernels can access them (allocate them with "
           "pin_memory=True to skip this)")
    (logger.info if first else logger.debug)(msg, p.registered, p.registered_bytes / 2**20)


_cudart_lib: list = []


def _clear_last_error() -> None:
    """``cudaGetLastError()`` in the CUDA runtime this process loaded (torch's binding
    does not expose it); a failed ``cudaHostRegister`` leaves its error there."""
    if not _cudart_lib:
        lib = None
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
            for path in sorted(paths):
                lib = ctypes.CDLL(path)
                break
        except OSError:
            lib = None
        _cudart_lib.append(lib)
    if _cudart_lib[0] is not None:
        _cudart_lib[0].cudaGetLastError()


def _error_name(err) -> str:
    try:
        return str(torch.cuda.cudart().cudaGetErrorString(err))
    except Exception:  # pragma: no cover - older torch
        return "cudaError"


_usable: Dict[int, bool] = {}


def host_pointer_usable(device: Optional[int] = None) -> bool:
    """``cudaDevAttrCanUseHostPointerForRegisteredMem`` of ``device``: whether kernels may
    use registered host pointers as is. True when it cannot be queried (x86 Linux,
    where it is always 1)."""
    if not torch.cuda.is_available():
        return True
    dev = torch.cuda.current_device() if device is None else int(device)
    if dev not in _usable:
        value = ctypes.c_int(1)
        try:
            libcuda = ctypes.CDLL("libcuda.so.1")
            rc = libcuda.cuDeviceGetAttribute(
                ctypes.byref(value), _CU_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, dev)
            _usable[dev] = bool(value.value) if rc == 0 else True
        except OSError:
            _usable[dev] = True
    return _usable[dev]
